"""The driver's evaluation of the pipeline: the test split through every stage, replicated over up to
``MAX_REPLICAS`` peers of the last swarm, and published as they agree (swarm/integrity/evaluations.py): one lying last
stage cannot publish its own figure. Each hop carries receipts as a training hop does (swarm/pipeline/control/driver.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import torch

from swarm.integrity.evaluations import MAX_REPLICAS, Figures, consensus
from swarm.integrity.receipts import ids_digest
from swarm.pipeline.control.hops import HopGivenUp, NeedInputReply, Refused
from swarm.run.models import eval_batch

# ``driver`` below is the PipelineDriver (swarm/pipeline/control/driver.py) that calls in: it imports this module, so this one
# does not import it, even for types (no import circle)
PipelineDriver = Any

logger = logging.getLogger(__name__)


async def evaluate(driver: PipelineDriver) -> tuple[float | None, float]:
    """Forward-only pass of the test split through the whole pipeline: (accuracy, mean loss; a language model's
    in nats per byte of text). With several peers
    in the last swarm, the same pass goes through up to ``MAX_REPLICAS`` of them, and what is published is what
    they agree on (swarm/integrity/evaluations.py): one lying last stage cannot publish its own figure."""
    stages = driver.run.model.stages
    if stages == 1:
        figures = [await _evaluate_through(driver, None)]
    else:
        figures = []
        for peer in _replicas(driver, stages - 1, time.monotonic()) or [None]:
            try:
                figures.append(await _evaluate_through(driver, peer))
            except (HopGivenUp, NeedInputReply, Refused) as exc:
                logger.info("evaluation through last-stage peer %s failed: %s", (peer or "?")[-8:], exc)
        if not figures:
            raise HopGivenUp("no last-stage peer completed the evaluation")
    verdict = consensus(figures)
    if verdict.outliers:  # left out of the published figure, and nothing more: see swarm/integrity/evaluations.py
        logger.info("last-stage peer(s) %s evaluated far from the median (%s); left out of the published figure",
                    ", ".join(p[-8:] for p in verdict.outliers),
                    "; ".join(f"{f.peer[-8:]}: {f.accuracy if f.accuracy is not None else f.loss:.3f}" for f in figures))
    # a language model's test loss is published per byte of text (per token / bytes per token; byte-level models:
    # the same), so that every reader's bits per byte (status, completion, the demo) holds for BPE runs too
    loss = verdict.loss / driver.dataset.bytes_per_token
    driver.stats.eval_accuracy, driver.stats.eval_loss = verdict.accuracy, loss
    driver.stats.eval_replicas, driver.stats.eval_validated = verdict.replicas, verdict.validated
    return verdict.accuracy, loss


def _replicas(driver: PipelineDriver, k: int, now: float) -> list[str]:
    """The last-stage copies to evaluate through: up to MAX_REPLICAS, the most corroborated first (then the fastest),
    leaving out copies held off while others are usable, and copies whose own recent training loss (route losses:
    signed, recomputed by a referee) is far worse than the best copy's. The median of three is a vote and keys are
    free: six keys trained to harm, faster than the honest copy and not held off yet, were the three evaluated and
    published 18-78 % while the honest copy stood at 96 % (session 27, six_keys_last_harm)."""
    router = driver.routers[f"layer{k}"]
    peers = [p for p, stats in router.peers.items() if stats.banned_until <= now] or list(router.peers)
    routes = driver.route_losses
    if routes is not None:
        known = {p: loss for p in peers if (loss := routes.training_loss(k, p)) is not None}
        if known:
            best = min(known.values())
            peers = [p for p in peers if p not in known or not routes.far_worse(known[p], best)]
    credit = driver.spot.book.get
    return sorted(peers, key=lambda p: (-credit(p), router.expected_s(p)))[:MAX_REPLICAS]


async def _evaluate_through(driver: PipelineDriver, last: str | None) -> Figures:
    """The test split through the pipeline, its last hop at peer ``last`` (None: any peer, or no hop at all)."""
    loop = asyncio.get_running_loop()
    stages = driver.run.model.stages
    loss_sum, correct, count = 0.0, 0, 0
    chunk = eval_batch(driver.run.model)
    for start in range(0, len(driver.dataset.x_test), chunk):
        x = driver.dataset.x_test[start : start + chunk]
        ids = torch.arange(start, start + len(x), dtype=torch.int64)  # test-split rows
        if stages == 1:
            y = driver.dataset.y_test[ids]
            part_loss, part_correct, part_count = await loop.run_in_executor(driver.executor, driver.worker.evaluate, x, y)
        else:
            mb, ids_d = f"{driver.peer_tag}-ev{next(driver._ids)}", ids_digest(ids)
            h, committed = await loop.run_in_executor(driver.executor, _infer_committed, driver.worker, x)
            receipt = driver._sign_own(mb, "infer", h, ids_d, committed)
            for k in range(1, stages - 1):
                (h,), reply, _ = await driver.hops.hop(k, "infer", [h], driver._meta(mb, receipt),
                                                     vouch=driver._vouch(mb, receipt, ids_d))
                receipt = reply["receipt"]
            _, meta, _ = await driver.hops.hop(stages - 1, "evaluate", [h, ids], driver._meta(mb, receipt), only=last,
                                             vouch=driver._vouch(mb, receipt, ids_d))
            part_loss, part_correct, part_count = float(meta["loss_sum"]), int(meta["correct"]), int(meta["count"])
        loss_sum, correct, count = loss_sum + part_loss, correct + part_correct, count + part_count
    accuracy = correct / count if driver.dataset.kind == "classification" else None
    return Figures(last or "", accuracy, loss_sum / max(count, 1))


def _infer_committed(worker: Any, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, bytes]]:
    """Stage 0's evaluation forward and the weights it ran with, read on the compute thread."""
    return worker.infer(x), worker.committed
