"""What a stage runs for one validated request (swarm/pipeline/stage/stage_rpc.py ``StageServicer`` checks and receipts
around it): the op table, on the compute thread, with every failure of a request's tensor put down to that tensor's
author (``ContentError``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from swarm.pipeline.stage.worker import StageWorker
from swarm.pipeline.stage.stage_gate import StageGate
from swarm.pipeline.transport.wire import WireError


@dataclass(slots=True, frozen=True)
class Request:
    """Who sent a request, and the gate that knows its shards (None: tests of the worker alone)."""

    requester: str = ""
    gate: StageGate | None = None
    source: str = ""  # the peer that computed the request's input (its receipt's signer): the last stage's loss health

    def targets(self, worker: StageWorker, ids: torch.Tensor, batch: int, split: str) -> torch.Tensor:
        labels = self.gate.labels if self.gate is not None else None
        if labels is None:
            raise WireError(f"layer{worker.index} has no data set loaded: it cannot look up sample ids")
        if split == "test":
            return labels.test_targets(ids, batch)
        return labels.train_targets(ids, batch, self.gate.allowed_shards(self.requester),
                                    excusable=self.gate.allowed_shards(self.requester, latest_only=True))


def dispatch(worker: StageWorker, op: Any, tensors: list[torch.Tensor], meta: dict,
             request: Request = Request()) -> tuple[list[torch.Tensor], dict]:
    """Run one validated request on the compute thread."""
    mb = meta.get("mb")
    owner = request.requester
    if op in ("forward", "backward", "forward_backward") and (not isinstance(mb, str) or not 0 < len(mb) <= 128):
        raise WireError("missing or malformed micro-batch id")
    if op == "forward":
        (x,) = _expect(tensors, 1, op)
        return [_content(0, worker.forward, mb, _content(0, worker.check_input, x), owner=owner)], {"ok": True}
    if op == "infer":
        (x,) = _expect(tensors, 1, op)
        return [_content(0, worker.infer, _content(0, worker.check_input, x))], {"ok": True}
    if op == "backward":
        if worker.is_last:
            raise WireError("the last stage takes forward_backward, not backward")
        if len(tensors) not in (1, 2):
            raise WireError("backward takes the output gradient and optionally the input")
        x = _content(1, worker.check_input, tensors[1]) if len(tensors) == 2 else None
        grad = _content(0, worker.check_grad, tensors[0], tensors[0].shape[0])
        if x is not None and x.shape[0] != grad.shape[0]:
            raise WireError("backward: input and gradient batches differ")
        loss = meta.get("loss")
        loss = float(loss) if isinstance(loss, (int, float)) else None
        grad_in = _content(0, worker.backward, mb, grad, x, loss, owner=owner)
        return ([] if grad_in is None else [grad_in]), {"ok": True}
    if op == "backward_check":
        if worker.is_last:
            raise WireError("the last stage takes forward_backward_check, not backward_check")
        grad, x = _expect(tensors, 2, op)
        x = _content(1, worker.check_input, x)
        grad = _content(0, worker.check_grad, grad, grad.shape[0])
        if x.shape[0] != grad.shape[0]:
            raise WireError("backward_check: input and gradient batches differ")
        _, grad_in = _content(0, worker.input_gradient, x, grad_out=grad)
        return [grad_in], {"ok": True}
    if op == "forward_backward_check":
        if not worker.is_last:
            raise WireError(f"{op} is only served by the last stage")
        x, ids = _expect(tensors, 2, op)
        x = _content(0, worker.check_input, x)
        y = worker.check_targets(request.targets(worker, ids, x.shape[0], "train"), x.shape[0])
        loss, grad_in = _content(0, worker.input_gradient, x, y)
        return [grad_in], {"ok": True, "loss": loss}
    if op in ("forward_backward", "evaluate"):
        if not worker.is_last:
            raise WireError(f"{op} is only served by the last stage")
        x, ids = _expect(tensors, 2, op)
        x = _content(0, worker.check_input, x)
        y = worker.check_targets(request.targets(worker, ids, x.shape[0], "test" if op == "evaluate" else "train"),
                                 x.shape[0])
        if op == "evaluate":
            loss_sum, correct, count = worker.evaluate(x, y)
            return [], {"ok": True, "loss_sum": loss_sum, "correct": correct, "count": count}
        loss, grad_in = _content(0, worker.forward_backward, mb, x, y, owner=owner, source=request.source)
        return ([] if grad_in is None else [grad_in]), {"ok": True, "loss": loss}
    raise WireError(f"unknown op {op!r}")


def check_op_here(worker: StageWorker, op: str) -> None:
    """Ops this stage does not serve, refused before anything is decoded."""
    if worker.index == 0:
        raise WireError("stage 0 runs only for its own driver, on its own data: drive from your own layer0 copy")
    if op in ("forward_backward", "evaluate", "forward_backward_check") and not worker.is_last:
        raise WireError(f"{op} is only served by the last stage")
    if op in ("backward", "backward_check") and worker.is_last:
        raise WireError(f"the last stage takes forward_backward, not {op}")


class ContentError(WireError):
    """Tensor ``index`` of a request is wrong in itself (non-finite, wrong shape): its author's fault."""

    def __init__(self, message: str, index: int):
        super().__init__(message)
        self.index = index


def _content(index: int, fn: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
    """``fn(*args)``; a check of tensor ``index`` that fails, or a computation its values break (outputs non-finite or
    out of range: swarm/pipeline/stage/worker.py), is that tensor's author's fault."""
    try:
        return fn(*args, **kwargs)
    except (WireError, ValueError) as exc:
        raise ContentError(str(exc), index) from None


def _expect(tensors: list[torch.Tensor], count: int, op: str) -> list[torch.Tensor]:
    if len(tensors) != count:
        raise WireError(f"{op} takes {count} tensor(s), got {len(tensors)}")
    return tensors
