"""The stage servicer's part in spot checks of stage 0 (a mixin of swarm/pipeline/stage/stage_rpc.py ``StageServicer``).

At stage 1: every forward names its sample ids, and a share of the stage-0 outputs is recomputed by other layer0
peers before stage 1 answers (swarm/pipeline/control/stage0_checks.py); a micro-batch whose author is the odd one out is
refused (``Stage0Refused`` -> ``spot_check``). At stage 0: ``infer [ids]`` recomputes our output for an online
layer1 peer, within the door of swarm/pipeline/stage/stage0_replicas.py, signed like every reply.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from swarm.integrity.health import SickCopy
from swarm.integrity.receipts import ids_digest
from swarm.integrity.spot import AUTHOR_ODD
from swarm.pipeline.stage.worker import StageWorker
from swarm.pipeline.stage.stage0_replicas import ids_from_meta
from swarm.pipeline.stage.stage_receipts import ReceiptRefusal, Vouched
from swarm.pipeline.transport.wire import WireError, decode_tensors, refusal_meta

logger = logging.getLogger(__name__)


class Stage0Refused(Exception):
    """Stage 1 refuses a micro-batch whose stage-0 output failed its spot check."""


class Stage0Ops:
    """Needs the servicer's ``worker``, ``executor``, ``fair``, ``desk``, ``max_bytes``, ``replicas``, ``spot0`` and
    ``_signed``."""

    def _start_stage0_check(self, requester: str, op: str, meta: dict, tensors: list[torch.Tensor],
                            vouched: Vouched) -> asyncio.Task | None:
        """Stage 1: maybe have other layer0 peers recompute the stage-0 output this request carries (signed by the
        requester: the desk checked it). Every forward must name its sample ids, sampled or not: a driver that
        could leave them out would leave them out when it lies."""
        if self.spot0 is None or self.desk is None or self.worker.index != 1 or op not in ("forward", "forward_backward"):
            return None
        batch = int(tensors[0].shape[0])
        try:
            ids = tensors[1] if op == "forward_backward" else ids_from_meta(meta.get("ids"), batch)
        except WireError as exc:
            raise ReceiptRefusal("bad_receipt", str(exc), strike=True) from None
        if op == "forward" and ids_digest(ids) != vouched.ids:
            raise ReceiptRefusal("bad_receipt", "the sample ids sent ('ids') are not the ones your stage-0 receipt "
                                 "names", strike=True)
        return self.spot0.start(requester, vouched.mb, tensors[0], ids, vouched.input_weights)

    async def _stage0_verdict(self, check: asyncio.Task, requester: str, mb: Any) -> None:
        """Wait for the check (bounded by its budget; shielded, so a requester that gives up still gets its verdict)
        and refuse the micro-batch when its author is the odd one out, dropping the forward we saved for it."""
        try:
            verdict = await asyncio.shield(check)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in a check must not cost an honest micro-batch
            logger.exception("a spot check of stage 0 failed: %s", exc)
            return
        if verdict != AUTHOR_ODD:
            return
        if isinstance(mb, str):
            await asyncio.get_running_loop().run_in_executor(self.executor, self.worker.cache.pop, (requester, mb),
                                                             time.monotonic())
        raise Stage0Refused("your stage-0 output is far from the recomputations of two other layer0 peers, which "
                            "agree: the micro-batch is refused before anything applied it")

    async def _serve_replica(self, requester: str, serialized: list[Any], meta: dict) -> tuple[list[Any], dict]:
        """Stage 0: recompute our output on train-split rows for an online layer1 peer (stage0_replicas.py)."""
        door = self.replicas.door
        refusal = door.admit(requester, time.monotonic())
        if refusal is not None:
            return [], refusal_meta(refusal.code, refusal.error, refusal.retry_after_s)
        compute_s, served = 0.0, False
        try:
            mb = meta.get("mb")
            if not isinstance(mb, str) or not 0 < len(mb) <= 128:
                raise WireError("missing or malformed micro-batch id")
            tensors = decode_tensors(serialized, self.max_bytes, coded=True)
            if len(tensors) != 1:
                raise WireError(f"infer at stage 0 takes 1 tensor (the sample ids), got {len(tensors)}")
            ids = self.replicas.check_ids(tensors[0])
            out, compute_s = await self.fair.run(requester, _replicate, self.worker, self.replicas.lookup, ids)
            served = True
            ids_d = ids_digest(ids)
            return await self._signed(requester, "infer", Vouched(mb=mb, input=ids_d, ids=ids_d), [out], {"ok": True})
        except SickCopy as exc:
            return [], refusal_meta("healing", f"this copy is sick and healing ({exc}): ask another peer")
        except (WireError, ValueError, TypeError) as exc:  # no strike: our book is of the drivers we serve
            return [], refusal_meta("rejected", str(exc))
        finally:
            door.finished(requester, compute_s, served)


def _replicate(worker: StageWorker, lookup: Callable[[torch.Tensor], torch.Tensor],
               ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Stage 0's output on our own copy of the rows ``ids`` (eval mode, nothing kept), and its compute time."""
    started = time.perf_counter()
    out = worker.infer(lookup(ids))
    return out, time.perf_counter() - started
