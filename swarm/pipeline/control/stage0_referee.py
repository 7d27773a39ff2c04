"""Stage 1 referees a driver's stage-0 output exactly: the output's receipt commits to the driver's stage-0 weights, the
driver shows them (``weights``, swarm/pipeline/stage/weights_rpc.py), and stage 1 recomputes stage 0 on the sample ids the
receipt names, from its own copy of the run's data (every volunteer has it). No other copy is compared, so a copy
trained apart on a skewed shard is no reason for doubt, and a run with one driver is checked too.

Used by swarm/pipeline/control/stage0_checks.py: where no other layer0 peer can recompute, and on every disagreement the
replicas could not settle. Outcomes as at the driver's referee (swarm/pipeline/control/referee.py): HOLDS, CONVICTED (its
output does not follow from the weights it committed to, or it showed other weights), UNSHOWN (no weights in time:
no verdict, nobody blamed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import torch

from swarm.integrity.receipts import NO_WEIGHTS
from swarm.integrity.prediction import Derivation, PredictionLie, rebuild
from swarm.integrity.recompute import compare, recompute, tolerance_for
from swarm.integrity.weights import tensors_bytes, weights_digest
from swarm.pipeline.control.referee import CONVICTED, HOLDS, UNSHOWN
from swarm.pipeline.stage.stage_rpc import stage_namespace
from swarm.pipeline.stage.weights_rpc import fetch_weights
from swarm.run.models import build_stage

logger = logging.getLogger(__name__)

MAX_SPARE_MODULES = 4  # stage-0 modules kept for judgements at once (more are built and dropped)


class Stage0Referee:
    def __init__(self, run: Any, p2p: Any, call: Any = None, device: str = "cpu"):
        self.run = run
        self.device = device  # this stage's: stage 0 recomputed where it would run (a GPU-sized one on the GPU)
        self.p2p = p2p
        self.call = call
        self.namespace = stage_namespace(run.run_id, "layer0")
        self._module: torch.nn.Module | None = None
        self._x_train: torch.Tensor | None = None
        self._loading: asyncio.Future | None = None
        self._spare: list[torch.nn.Module] = []  # modules no judgement holds now (_recompute; list ops are atomic)
        self.counts = {HOLDS: 0, CONVICTED: 0, UNSHOWN: 0}
        self.last_reason = ""
        self.traffic: Any = None  # the stage's Traffic: the driver's weights it fetches are counted on its link

    async def judge(self, author: str, x: torch.Tensor, ids: torch.Tensor, digest: bytes, timeout_s: float) -> str:
        """HOLDS, CONVICTED or UNSHOWN for ``x``, the stage-0 output ``author`` signed for ``ids`` with ``digest``."""
        if float(getattr(self.run.model, "dropout", 0.0) or 0.0) > 0:  # a training forward's mask cannot be replayed
            return self._count(UNSHOWN, "dropout: stage 0's training forward cannot be replayed")
        if digest in (b"", NO_WEIGHTS) or timeout_s <= 0:
            return self._count(UNSHOWN, "its receipt commits to no weights")
        started = time.monotonic()
        try:
            module, x_train = await self._ready()
            def fetch(wanted: bytes) -> Any:
                return fetch_weights(self.p2p, author, self.namespace, wanted, call=self.call, traffic=self.traffic,
                                     timeout_s=max(0.05, timeout_s - (time.monotonic() - started)),
                                     expect_bytes=tensors_bytes(module.state_dict()))

            weights = await fetch(digest)
            if isinstance(weights, Derivation):  # predicted weights, rebuilt from the two versions they name
                weights = await rebuild(fetch, weights, self.run.integrity.max_step_ratio,
                                        [name for name, _ in module.named_parameters()])
        except asyncio.CancelledError:
            raise
        except PredictionLie as exc:
            return self._count(CONVICTED, f"its stage-0 weights: {exc}")
        except Exception as exc:  # busy, slow, gone: no evidence either way
            return self._count(UNSHOWN, f"no weights: {str(exc)[:120]}")
        if weights_digest(weights) != digest:
            return self._count(CONVICTED, "it showed stage-0 weights whose digest is not the one it signed")
        rows = x_train[ids.long()]
        try:
            recomputed = await asyncio.to_thread(self._recompute, weights, rows)
        except ValueError as exc:
            return self._count(CONVICTED, f"it showed weights that are not stage 0's: {exc}")
        finding = compare(x, recomputed, tolerance_for("forward", self.run.training.codec,
                                                       float(getattr(self.run.model, "dropout", 0.0) or 0.0)))
        if not finding.holds:
            return self._count(CONVICTED, f"its stage-0 output does not follow from the weights it committed to "
                                          f"({finding.describe()})")
        return self._count(HOLDS, "")

    def _recompute(self, weights: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        """On a thread of its own: judgements run at once, and a recomputation holds its module for the call
        (recompute.py module_lock: functional_call swaps its parameters), so each takes a module no other judgement
        holds (built here when none is spare) rather than wait in line behind the others."""
        try:
            module = self._spare.pop()
        except IndexError:
            module = build_stage(self.run.model, 0).to(self.device)
        try:
            return recompute(self.run.model, module, "forward", weights, [rows])
        finally:
            if len(self._spare) < MAX_SPARE_MODULES:
                self._spare.append(module)

    def _count(self, outcome: str, reason: str) -> str:
        self.counts[outcome] += 1
        self.last_reason = reason
        if outcome == UNSHOWN:
            logger.debug("stage-0 referee: %s", reason)
        return outcome

    async def _ready(self) -> tuple[torch.nn.Module, torch.Tensor]:
        """Stage 0's module and the run's training inputs, loaded once (off the event loop)."""
        if self._module is None or self._x_train is None:
            if self._loading is None:
                self._loading = asyncio.ensure_future(asyncio.to_thread(self._load))
            module, x_train = await asyncio.shield(self._loading)
            if self._module is None:
                self._module, self._x_train = module, x_train
                self._spare.append(module)
        return self._module, self._x_train

    def _load(self) -> tuple[torch.nn.Module, torch.Tensor]:
        from swarm.run.data import load_dataset

        return build_stage(self.run.model, 0).to(self.device), load_dataset(self.run.data, self.run.model).x_train
