"""The pipeline driver of a layer0 peer: micro-batches forward through one peer of every swarm, back again.

Stage 0 runs on this peer's own worker (its data never leaves the machine); every other hop is an
RPC to a peer of that stage's swarm, chosen by ``SwarmRouter``. ``in_flight`` micro-batches run
concurrently so every swarm is busy. A failed or timed-out hop is retried on another peer of the
same swarm after a capped backoff, so a dying peer costs time, never a micro-batch. When a swarm has
no online peer the driver waits and says which one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from swarm.data import Dataset, MicroBatches
from swarm.routing import SwarmRouter, retry_delay_s
from swarm.runconfig import RunConfig
from swarm.stage import EVAL_BATCH, StageWorker
from swarm.stage_rpc import StageError, Traffic, call_stage, stage_namespace

logger = logging.getLogger(__name__)

MAX_HOP_ATTEMPTS = 200  # with capped backoff: minutes of trying before a micro-batch is given up
EMPTY_SWARM_NOTICE_S = 10.0


class DriverStopped(Exception):
    pass


@dataclass(slots=True)
class DriverStats:
    sent: int = 0  # samples whose micro-batch was started
    trained: int = 0  # samples whose micro-batch completed forward and backward everywhere
    lost: int = 0  # micro-batches given up
    microbatches: int = 0
    retries: int = 0
    last_loss: float | None = None
    waiting_for: str = ""  # the empty swarm we are waiting on, "" when none
    eval_accuracy: float | None = None
    eval_loss: float | None = None
    eval_at_samples: int = 0
    hop_ms: dict[str, float] = field(default_factory=dict)


class PipelineDriver:
    def __init__(self, run: RunConfig, worker: StageWorker, p2p: Any, executor: Executor, dataset: Dataset,
                 shards: list[Any], own_shard: int, *, peer_tag: str, seed: int = 0, traffic: Traffic | None = None,
                 notify: Callable[[str, str], None] | None = None):
        self.run = run
        self.worker = worker
        self.p2p = p2p
        self.executor = executor
        self.dataset = dataset
        self.shards = shards
        self.own_shard = own_shard
        self.seed = seed
        self.covered: tuple[int, ...] = ()
        self.batches: MicroBatches | None = None
        self.notify = notify or (lambda kind, text: None)
        self.cover_shards(range(len(shards)))
        self.routers = {name: SwarmRouter() for name in run.swarm_names}
        self.stats = DriverStats()
        self.traffic = traffic or Traffic()
        self.peer_tag = peer_tag
        self._ids = itertools.count()
        self._running = asyncio.Event()
        self._running.set()
        self._stopping = False
        self._empty_since: dict[str, float] = {}
        self.in_flight = 0

    # ----- control (called in the loop thread)
    def cover_shards(self, unheld: Any) -> None:
        """Train on our own shard plus every shard no other online layer0 peer holds (rarest-first coverage)."""
        covered = tuple(sorted({self.own_shard, *unheld}))
        if covered == self.covered:
            return
        self.covered = covered
        indices = np.concatenate([self.shards[i] for i in covered])
        self.batches = MicroBatches(self.dataset.x_train, self.dataset.y_train, indices,
                                    self.run.training.batch_size, self.seed)
        if len(covered) > 1:
            self.notify("info", f"training on shards {list(covered)}: no other online layer0 peer holds them")
        else:
            self.notify("info", f"training on shard {self.own_shard} only: other layer0 peers hold the rest")

    def set_own_shard(self, shard: int) -> None:
        self.own_shard = shard
        self.covered = ()  # the next cover_shards rebuilds the batches

    def set_peers(self, swarm: str, peer_ids: list[str]) -> None:
        self.routers[swarm].set_peers(peer_ids)

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def stop(self) -> None:
        self._stopping = True
        self._running.set()

    # ----- training
    async def run_forever(self) -> None:
        lanes = [asyncio.create_task(self._lane()) for _ in range(self.run.training.in_flight)]
        try:
            await asyncio.gather(*lanes)
        finally:
            for lane in lanes:
                lane.cancel()

    async def _lane(self) -> None:
        while not self._stopping:
            await self._running.wait()
            if self._stopping:
                return
            x, y = next(self.batches)
            try:
                await self.train_microbatch(x, y)
            except DriverStopped:
                return

    async def train_microbatch(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One micro-batch through every stage and back; returns its loss."""
        stages = self.run.model.stages
        mb = f"{self.peer_tag}-{next(self._ids)}"
        batch = int(x.shape[0])
        self.stats.sent += batch
        loop = asyncio.get_running_loop()
        self.in_flight += 1
        try:
            if stages == 1:
                loss, _ = await loop.run_in_executor(self.executor, self.worker.forward_backward, mb, x, y)
            else:
                inputs: dict[int, torch.Tensor] = {}
                served_by: dict[int, str] = {}
                h = await loop.run_in_executor(self.executor, self.worker.forward, mb, x)
                for k in range(1, stages - 1):
                    inputs[k] = h
                    (h,), _, served_by[k] = await self._hop(k, "forward", [h], {"mb": mb})
                reply_tensors, meta, _ = await self._hop(stages - 1, "forward_backward", [h, y], {"mb": mb})
                loss = float(meta["loss"])
                grad = reply_tensors[0]
                for k in range(stages - 2, 0, -1):
                    grad = await self._backward_hop(k, mb, grad, inputs[k], served_by[k], loss)
                await loop.run_in_executor(self.executor, self.worker.backward, mb, grad, None, loss)
        except HopGivenUp as exc:
            self.stats.lost += 1
            self.notify("error", f"gave up a micro-batch: {exc}")
            return math.nan
        finally:
            self.in_flight -= 1
        self.stats.trained += batch
        self.stats.microbatches += 1
        self.stats.last_loss = loss
        return loss

    async def _backward_hop(self, k: int, mb: str, grad: torch.Tensor, x: torch.Tensor, peer: str,
                            loss: float) -> torch.Tensor:
        """Backward goes to the peer that ran the forward (it reuses its activations), else anywhere."""
        try:
            (grad_in,), _, _ = await self._hop(k, "backward", [grad], {"mb": mb, "loss": loss}, only=peer)
            return grad_in
        except HopGivenUp:
            pass
        (grad_in,), _, _ = await self._hop(k, "backward", [grad, x], {"mb": mb, "loss": loss})
        return grad_in

    async def _hop(self, k: int, op: str, tensors: list[torch.Tensor], meta: dict, *, only: str | None = None,
                   ) -> tuple[list[torch.Tensor], dict, str]:
        """Call stage ``k``; retry on other peers until it succeeds. ``only``: one try at that peer."""
        swarm = f"layer{k}"
        router = self.routers[swarm]
        tried: list[str] = []
        for attempt in range(1 if only else MAX_HOP_ATTEMPTS):
            if self._stopping:
                raise DriverStopped()
            peer = only or router.choose(time.monotonic(), exclude=tried[-1:])
            if peer is None:
                await self._wait_for_peers(swarm, attempt)
                continue
            self._swarm_has_peers(swarm)
            router.begin(peer)
            try:
                out, reply, elapsed = await call_stage(
                    self.p2p, peer, stage_namespace(self.run.run_id, swarm), op, tensors, meta,
                    timeout_s=self.run.timeouts.rpc_s, wire_dtype=self.run.training.wire_dtype,
                    max_bytes=int(self.run.training.max_payload_mb * 2**20), traffic=self.traffic,
                    expect_bytes=_bytes(tensors[0]),
                )
                router.success(peer, elapsed)
                self.stats.hop_ms[swarm] = elapsed * 1000
                return out, reply, peer
            except StageError as exc:
                if exc.code == "rejected":
                    raise HopGivenUp(f"{swarm} peer {peer[-8:]} rejected it: {exc}") from None
                if exc.code == "need_input":
                    raise HopGivenUp("need_input") from None
                router.failure(peer, time.monotonic())  # paused or failing: route around it for a while
            except Exception as exc:  # timeouts, dead peers, broken streams: all mean "try another peer"
                ban_s = router.failure(peer, time.monotonic())
                logger.info("%s %s at %s failed (%s: %s); banned for %.0f s", op, swarm, peer[-8:],
                            exc.__class__.__name__, exc, ban_s)
            finally:
                router.end(peer)
            tried.append(peer)
            self.stats.retries += 1
            if only:
                break
            await asyncio.sleep(retry_delay_s(min(attempt, 6)))
        raise HopGivenUp(f"{op} at {swarm} failed after {len(tried)} attempt(s)")

    async def _wait_for_peers(self, swarm: str, attempt: int) -> None:
        now = time.monotonic()
        since = self._empty_since.setdefault(swarm, now)
        if self.stats.waiting_for != swarm:
            self.stats.waiting_for = swarm
            self.notify("warning", f"waiting: swarm {swarm} has no online peer, so no micro-batch can pass it")
        elif now - since > EMPTY_SWARM_NOTICE_S:
            self._empty_since[swarm] = now
            self.notify("warning", f"still waiting for a peer in {swarm}")
        await asyncio.sleep(retry_delay_s(min(attempt, 6)))

    def _swarm_has_peers(self, swarm: str) -> None:
        if self.stats.waiting_for == swarm:
            self.stats.waiting_for = ""
            self._empty_since.pop(swarm, None)
            self.notify("info", f"{swarm} has an online peer now; micro-batches flow again")

    # ----- evaluation
    async def evaluate(self) -> tuple[float | None, float]:
        """Forward-only pass of the test split through the whole pipeline: (accuracy, mean loss)."""
        loop = asyncio.get_running_loop()
        stages = self.run.model.stages
        loss_sum, correct, count = 0.0, 0, 0
        for start in range(0, len(self.dataset.x_test), EVAL_BATCH):
            x = self.dataset.x_test[start : start + EVAL_BATCH]
            y = self.dataset.y_test[start : start + EVAL_BATCH]
            if stages == 1:
                part_loss, part_correct, part_count = await loop.run_in_executor(self.executor, self.worker.evaluate, x, y)
            else:
                h = await loop.run_in_executor(self.executor, self.worker.infer, x)
                for k in range(1, stages - 1):
                    (h,), _, _ = await self._hop(k, "infer", [h], {})
                _, meta, _ = await self._hop(stages - 1, "evaluate", [h, y], {})
                part_loss, part_correct, part_count = float(meta["loss_sum"]), int(meta["correct"]), int(meta["count"])
            loss_sum, correct, count = loss_sum + part_loss, correct + part_correct, count + part_count
        accuracy = correct / count if self.dataset.kind == "classification" else None
        self.stats.eval_accuracy, self.stats.eval_loss = accuracy, loss_sum / max(count, 1)
        return accuracy, self.stats.eval_loss


class HopGivenUp(Exception):
    pass


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * 4
