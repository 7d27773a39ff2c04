"""Convictions any peer can check: a referee's evidence sent to the stages next to the convicted signer, which re-run
it before they act on it (issue 40 item 3: "a conviction is a self-contained, signed statement ... so a false
accusation fails and costs its author").

The ``conviction`` op (stage_rpc.py dispatches it): tensors ``[x (as it travelled), (ids,) claim (as it travelled),
*the weights packed one flat tensor per dtype]``, metadata ``{"rc": the convict's receipt, "names", "shapes",
"dtypes"}`` (weights_rpc.py ``pack``). Everything is bound by the
convict's own signature: the receipt names the input's digest, the output's, the sample ids' and the weights'. The
stage checks the signature with the signer's key, every digest, recomputes the op, and when the claim does not
follow it bans the signer here (everything it signs is then ``bad_author``, whoever relays it). An accusation that
does not hold is a strike on its sender.

Which lies can be shown this way: activations (``forward``, ``infer``) and a last stage's input gradients
(``forward_backward``, ``forward_backward_check``: the stage looks the targets up by id, as the last stage does),
and the loss a last stage reports (metadata ``loss``: its receipt signs it, format 3; recomputed from the same
weights, input and targets, ``recompute.loss_agrees``).
A backward's receipt does not bind the output gradient it was given, so its conviction stays with the referee that
made it (open).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import torch

from swarm.integrity.receipts import Receipt, ReceiptError, ids_digest, loss_digest, signature_valid, tensor_digest
from swarm.integrity.recompute import LAST_GRADIENT_OPS, compare, loss_agrees, recompute, recompute_loss, tolerance_for
from swarm.integrity.weights import weights_digest
from swarm.pipeline.stage.weights_rpc import pack, unpack
from swarm.pipeline.transport.wire import WireError, payload_of, refusal_meta

logger = logging.getLogger(__name__)

CONVICTION_OP = "conviction"
SHAREABLE_OPS = frozenset({"forward", "infer"}) | LAST_GRADIENT_OPS
MAX_PENDING = 2  # convictions checked at once here (each a recomputation)
CHECKED_KEPT = 1024


def evidence(conviction: Any) -> tuple[list[torch.Tensor], dict] | None:
    """The tensors and metadata of a ``conviction`` request for a referee's Conviction, or None when its op cannot
    be shown to a third party (a backward) or a tensor lost the bytes it travelled as."""
    receipt = Receipt.from_wire(conviction.receipt)
    if receipt.op not in SHAREABLE_OPS or conviction.weights is None:
        return None
    inputs = conviction.inputs[:2] if receipt.op in LAST_GRADIENT_OPS else conviction.inputs[:1]
    if payload_of(inputs[0]) is None or payload_of(conviction.claim) is None:
        return None
    flats, layout = pack(conviction.weights)
    meta = {"rc": conviction.receipt, **layout}
    if getattr(conviction, "loss", None) is not None and receipt.op in LAST_GRADIENT_OPS:
        meta["loss"] = float(conviction.loss)
    return [*inputs, conviction.claim, *flats], meta


class ConvictionDesk:
    """A stage's side: checks a conviction it is sent and bans the convict on proof (``ban``), strikes a false
    accuser (``strike``). ``labels()``: the train split's targets (a coroutine: loaded on first need)."""

    def __init__(self, run: Any, keys: Any, ban: Any, strike: Any, labels: Any, device: str = "cpu"):
        self.run = run
        self.device = device  # where a convict's hop is recomputed: this stage's device (a GPU-sized stage on its GPU)
        self.run_id = run.run_id
        self.keys = keys
        self.ban = ban
        self.strike = strike
        self.labels = labels
        self._modules: dict[int, torch.nn.Module] = {}
        self._checked: dict[bytes, bool] = {}
        self.banned: Any = lambda peer: False  # desk_for: the stage gate's bans
        self.pending = 0
        self.upheld = 0
        self.false = 0

    async def receive(self, requester: str, tensors: list[torch.Tensor], meta: dict) -> tuple[list, dict]:
        if self.banned(requester):  # a banned sender's accusations cost no recomputation (nor more strikes)
            return [], refusal_meta("banned", "this peer has banned you: no convictions are checked for you")
        if self.pending >= MAX_PENDING:
            return [], refusal_meta("busy", "checking other convictions", 1.0)
        self.pending += 1
        try:
            proven, why = await self._check(tensors, meta)
        except (ReceiptError, WireError, ValueError, KeyError, IndexError, TypeError) as exc:
            proven, why = False, f"malformed: {str(exc)[:160]}"
        finally:
            self.pending -= 1
        if proven is None:
            return [], refusal_meta("busy", why, 1.0)
        if not proven:
            self.false += 1
            logger.warning("a conviction sent by %s does not hold: %s", requester[-8:], why)
            self.strike(requester, f"sent a conviction that does not hold: {why[:120]}")
            return [], refusal_meta("rejected", f"the conviction does not hold: {why}")
        self.upheld += 1
        return [], {"ok": True}

    async def _check(self, tensors: list[torch.Tensor], meta: dict) -> tuple[bool | None, str]:
        receipt = Receipt.from_wire(meta.get("rc"))
        if receipt.run_id != self.run_id or receipt.op not in SHAREABLE_OPS or \
                not 0 < receipt.stage < self.run.model.stages:
            return False, "a receipt of another run, op or stage"
        if self._checked.get(receipt.signature):
            return True, "already checked"
        key = await self.keys.key(receipt.signer, f"layer{receipt.stage}")
        if key is None:
            return None, "cannot get the signer's key yet"
        if not signature_valid(receipt, key):
            return False, "the receipt is not signed by its signer"
        last = receipt.op in LAST_GRADIENT_OPS
        count = 3 if last else 2
        if len(tensors) <= count:
            return False, "no weights in the evidence"
        x, claim, weights = tensors[0], tensors[count - 1], unpack(tensors[count:], meta)
        if _digest(x) != receipt.input or _digest(claim) != receipt.output:
            return False, "the input or the claim is not the one the receipt names"
        ids = tensors[1] if last else None
        if last and ids_digest(ids) != receipt.ids:
            return False, "the sample ids are not the ones the receipt names"
        # a forward names what it computed with apart from its version where it predicted them (integrity/prediction.py)
        if weights_digest(weights) != (receipt.forward_weights if receipt.op == "forward" else receipt.weights):
            return False, "the weights are not the ones the receipt commits to"
        loss = meta.get("loss") if last else None
        if loss is not None and (not isinstance(loss, float) or not math.isfinite(loss) or
                                 receipt.figures != loss_digest(loss)):
            return False, "the loss is not the one the receipt signs"
        targets = (await self.labels())[ids.long()] if last else None
        module = self._module(receipt.stage)
        recomputed = await asyncio.to_thread(recompute, self.run.model, module, receipt.op, weights, [x], targets)
        # (off the event loop, beside the compute thread: a conviction is rare, and MAX_PENDING bounds a flood)
        finding = compare(claim, recomputed, tolerance_for(receipt.op, self.run.training.codec))
        what = f"its {receipt.op} at layer{receipt.stage} does not follow from the weights it committed to " \
               f"({finding.describe()})"
        if finding.holds and loss is not None:
            recomputed_loss = await asyncio.to_thread(recompute_loss, self.run.model, module, weights, x, targets)
            if loss_agrees(loss, recomputed_loss):
                return False, f"its claim and its loss follow from its weights ({finding.describe()})"
            what = f"its signed loss {loss:.4g} at layer{receipt.stage} is not what the weights it committed to " \
                   f"give ({recomputed_loss:.4g})"
        elif finding.holds:
            return False, f"its claim follows from its weights ({finding.describe()})"
        self._checked[receipt.signature] = True
        if len(self._checked) > CHECKED_KEPT:
            self._checked.clear()
        self.ban(receipt.signer, f"convicted by recomputation: {what}")
        return True, ""

    def _module(self, k: int) -> torch.nn.Module:
        if k not in self._modules:
            from swarm.run.models import build_stage

            self._modules[k] = build_stage(self.run.model, k).to(self.device)
        return self._modules[k]


def desk_for(run: Any, keys: Any, gate: Any, on_convicted: Any = None, device: str = "cpu") -> ConvictionDesk:
    """A stage peer's desk: a proven convict is struck twice the ban threshold in ``gate``'s book (banned, and every
    tensor it signs is bad_author here), a false accuser once; targets loaded on the first conviction that needs them.
    ``on_convicted(signer)`` is told of each proven convict (the healer: heals it caused are given back)."""
    strikes = 2 * run.integrity.ban_strikes
    loaded: dict[str, Any] = {}

    async def labels() -> Any:
        if "y" not in loaded:
            from swarm.run.data import load_dataset

            loaded["y"] = (await asyncio.to_thread(load_dataset, run.data, run.model)).y_train
        return loaded["y"]

    def ban(signer: str, reason: str) -> None:
        gate.strike(signer, reason, strikes)
        if on_convicted is not None:
            on_convicted(signer)

    desk = ConvictionDesk(run, keys, ban, gate.strike, labels, device)
    desk.banned = lambda peer: gate.book.banned(peer, time.monotonic())
    return desk


def _digest(tensor: torch.Tensor) -> bytes:
    item = payload_of(tensor)
    if item is None:
        raise ValueError("a tensor without its payload")
    return tensor_digest(item)


async def announce(conviction: Any, peers: list[tuple[str, str]], call: Any, p2p: Any, run: Any,
                   timeout_s: float = 10.0) -> int:
    """Send ``conviction`` to ``peers`` ((peer, namespace) pairs); how many upheld it."""
    message = evidence(conviction)
    if message is None:
        return 0
    tensors, meta = message
    started = time.monotonic()

    async def one(peer: str, namespace: str) -> bool:
        try:
            await call(p2p, peer, namespace, CONVICTION_OP, tensors, meta, timeout_s=timeout_s, codec="float32",
                       max_bytes=int(run.training.max_payload_mb * 2**20),
                       expect_bytes=sum(t.numel() * t.element_size() for t in tensors))
            return True
        except Exception as exc:  # a peer that is gone or busy: it will convict on its own evidence, or not
            logger.debug("conviction to %s: %s", peer[-8:], exc)
            return False

    upheld = sum(await asyncio.gather(*(one(p, ns) for p, ns in peers)))
    logger.info("conviction of %s sent to %d peer(s), upheld by %d (%.1f s)", conviction.peer[-8:], len(peers),
                upheld, time.monotonic() - started)
    return upheld
