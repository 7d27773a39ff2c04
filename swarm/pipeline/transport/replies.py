"""Checks on a stage's reply, as strict as the stage's checks on a request.

A reply comes from a stranger: the driver uses it only after its tensor count, dtypes, shapes
(against the stage's output / input-gradient spec for this batch), finite values, a magnitude
bound and the types of its metadata are checked. A reply that fails is that peer's failure
(``BadReply``): the driver bans the peer for longer than a transport failure and sends the hop
elsewhere. Pure functions over tensors and dicts, tested without a network.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from swarm.integrity.receipts import (
    CHECK_OPS,
    Expect,
    Receipt,
    ReceiptError,
    figures_digest,
    loss_digest,
    mismatch,
    signature_valid,
    tensor_digest,
)
from swarm.pipeline.transport.wire import carry_payload, payload_of, peak_abs
from swarm.run.models import TensorSpec, stage_input_spec, stage_output_spec
from swarm.run.runconfig import ModelConfig

UPDATE_OPS = frozenset({"backward", "forward_backward"})  # apply an update at the peer: never hedged
HEDGED_OPS = frozenset({"forward", "infer", "evaluate"})  # apply no update: may go to two peers at once


class BadReply(ValueError):
    """A reply that must not be used; the text says what was wrong with it."""


def reply_spec(model: ModelConfig, k: int, op: str, batch: int) -> TensorSpec | None:
    """The one tensor a reply of ``op`` at stage ``k`` carries, or None when it carries none."""
    if op in ("forward", "infer"):
        return stage_output_spec(model, k, batch)
    if op in UPDATE_OPS or op in CHECK_OPS:  # the gradient of the stage's input; stage 0 is never called remotely
        return stage_input_spec(model, k, batch)
    if op == "evaluate":
        return None
    raise ValueError(f"unknown op {op!r}")


def check_reply(model: ModelConfig, k: int, op: str, batch: int, tensors: list[torch.Tensor], meta: dict,
                max_abs: float) -> tuple[list[torch.Tensor], dict]:
    """The reply's tensors (converted to the spec's dtype) and metadata, or BadReply."""
    spec = reply_spec(model, k, op, batch)
    want = 0 if spec is None else 1
    if len(tensors) != want:
        raise BadReply(f"{op} reply carries {len(tensors)} tensor(s), expected {want}")
    if spec is not None:
        tensors = [check_reply_tensor(tensors[0], spec, max_abs, f"{op} reply")]
    check_reply_meta(op, meta, batch)
    return tensors, meta


def check_reply_tensor(tensor: torch.Tensor, spec: TensorSpec, max_abs: float, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise BadReply(f"{what}: not a tensor")
    if tensor.is_floating_point() and spec.dtype.is_floating_point:
        tensor = carry_payload(tensor, tensor.to(spec.dtype))
    problem = spec.mismatch(tensor)
    if problem:
        raise BadReply(f"{what}: {problem}")
    if tensor.is_floating_point():
        peak = peak_abs(tensor)  # one pass: finite exactly when every value is
        if not math.isfinite(peak):
            raise BadReply(f"{what}: contains NaN or infinite values")
        if peak > max_abs:
            raise BadReply(f"{what}: a value of magnitude {peak:.3g} exceeds the bound {max_abs:.3g}")
    return tensor


def check_reply_meta(op: str, meta: dict, batch: int) -> None:
    if op in ("forward_backward", "forward_backward_check"):
        loss = meta.get("loss")
        if not _finite_number(loss) or loss < 0:
            raise BadReply(f"{op} reply: loss {_show(loss)} is not a finite non-negative number")
    elif op == "evaluate":
        loss_sum, correct, count = meta.get("loss_sum"), meta.get("correct"), meta.get("count")
        if not _finite_number(loss_sum) or loss_sum < 0:
            raise BadReply(f"evaluate reply: loss_sum {_show(loss_sum)} is not a finite non-negative number")
        if not _integer(count) or count != batch:
            raise BadReply(f"evaluate reply: count {_show(count)}, expected {batch}")
        if not _integer(correct) or not 0 <= correct <= count:
            raise BadReply(f"evaluate reply: correct {_show(correct)} outside 0..{count}")


@dataclass(slots=True, frozen=True)
class Vouch:
    """What the receipt of a hop's reply must say (swarm/integrity/receipts.py): the micro-batch, the digest of
    the activations the hop consumed (the previous receipt's output), the sample ids' digest."""

    run_id: str
    mb: str
    input: bytes
    ids: bytes


def check_receipt(k: int, op: str, vouch: Vouch, peer: str, tensors: list[torch.Tensor], meta: dict,
                  keys: Any) -> Receipt:
    """The reply's receipt, signed by ``peer`` (whose key rides on its reply) over what it returned; or BadReply.
    ``keys``: the driver's KeyBook (swarm/pipeline/transport/keybook.py)."""
    keys.learn(peer, meta.get("rk"))
    key = keys.known(peer)
    try:
        receipt = Receipt.from_wire(meta.get("rc"))
    except ReceiptError as exc:
        raise BadReply(f"{op} reply: {exc}") from None
    if op == "evaluate":
        output = figures_digest(meta["loss_sum"], meta["correct"], meta["count"])
    else:
        item = payload_of(tensors[0])
        if item is None:
            raise BadReply(f"{op} reply: a tensor without its payload")
        output = tensor_digest(item)
    problem = mismatch(receipt, Expect(vouch.run_id, k, frozenset({op}), output, mb=vouch.mb, input=vouch.input,
                                       ids=vouch.ids, signer=peer))
    if problem is not None:
        raise BadReply(f"{op} reply: its receipt does not hold: {problem}")
    if op in ("forward_backward", "forward_backward_check") and receipt.figures != loss_digest(meta["loss"]):
        raise BadReply(f"{op} reply: its receipt does not sign the loss it reports")
    if key is None or not signature_valid(receipt, key):
        raise BadReply(f"{op} reply: its receipt is not signed with the key it sent")
    return receipt


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value: Any) -> str:
    return repr(value)[:40]
