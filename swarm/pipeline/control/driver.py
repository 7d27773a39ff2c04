"""The pipeline driver of a layer0 peer: micro-batches forward through one peer of every swarm, back again.

Stage 0 runs on this peer's own worker (its data never leaves the machine); every other hop is an
RPC to a peer of that stage's swarm (swarm/pipeline/control/hops.py: checked replies, timeouts from measured service
times, hedged update-free ops, retries on other peers). ``in_flight`` lanes run concurrently so
every swarm is busy. The driver sends sample ids, never targets: the last stage looks the labels up
in its own copy of the run's data (``forward_backward [x, ids]`` train-split rows, ``evaluate [x, ids]``
test-split rows).

What a lane does when a micro-batch cannot pass:
- a peer fails, times out, answers garbage, is paused or healing: the hop goes to another peer;
- the next stage refuses the micro-batch itself (``rejected``, ``wrong_shard``): it is dropped
  (``refused``, not ``lost``: nothing was applied) and the lane backs off exponentially (capped),
  so a stage that rejects everything costs a few requests per second, not a storm;
- our own stage-0 copy is sick (SickCopy): the lane waits until it has healed and retries the same
  micro-batch (none is lost to a sick copy);
- anything unexpected costs that micro-batch (``lost``), is logged once, and the lane goes on.
``stats.blocked_reason`` says why no micro-batch flows ("" when they do).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import secrets
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import numpy as np
import torch

from swarm.run.data import Dataset, MicroBatches
from swarm.run.memory import lanes_cap
from swarm.pipeline.control.depth import DepthController
from swarm.pipeline.control.driver_failures import COVER_HOLD_S, LaneFailures  # noqa: F401  (COVER_HOLD_S re-exported)
from swarm.pipeline.control.hops import (  # noqa: F401  (DriverStats, DriverStopped, HopGivenUp: re-exported for callers)
    AlreadyApplied, Blockage, CallStage, DriverStats, DriverStopped, HopCaller, HopGivenUp, NeedInputReply, Refused,
)
from swarm.integrity.health import SickCopy
from swarm.integrity.receipts import Receipt, ReceiptKey, ids_digest, tensor_digest
from swarm.pipeline.control import push_driver
from swarm.pipeline.transport.keybook import KeyBook
from swarm.pipeline.control.push_driver import Pusher
from swarm.pipeline.transport.replies import Vouch
from swarm.pipeline.control.routing import HopPolicy, SwarmRouter
from swarm.pipeline.control.driver_eval import evaluate
from swarm.pipeline.control.route_losses import SELF_WITNESS, RouteLosses
from swarm.pipeline.control.referee import Referee
from swarm.pipeline.control.spot_checks import SpotChecker
from swarm.pipeline.stage.stage0_replicas import ids_bytes
from swarm.pipeline.transport.wire import serialize_once
from swarm.run.runconfig import RunConfig
from swarm.pipeline.stage.worker import StageWorker
from swarm.pipeline.stage.stage_rpc import Traffic, call_stage

logger = logging.getLogger(__name__)


SICK_POLL_S = 0.5
ALONE_S = 300.0  # an audit verdict convicts only when no other driver was seen for this long (referee_audits.py)
LANE_BUG_PAUSE_S = 0.1
ROUND_TRIP_DECAY = 0.8  # per micro-batch completed, of the slowest round trip kept (``round_trip_s``)


class PipelineDriver(LaneFailures):
    def __init__(self, run: RunConfig, worker: StageWorker, p2p: Any, executor: Executor, dataset: Dataset,
                 shards: list[Any], own_shard: int, *, peer_tag: str, seed: int = 0, traffic: Traffic | None = None,
                 notify: Callable[[str, str], None] | None = None, call: CallStage = call_stage,
                 receipt_key: ReceiptKey | None = None, keys: KeyBook | None = None):
        self.run = run
        self.run_id = run.run_id  # a property that hashes the whole config (0.14 ms): read once, not per hop
        # we sign stage 0's outputs and check every receipt a stage returns before relaying it (integrity/receipts.py)
        self.receipt_key = receipt_key or ReceiptKey(str(p2p.peer_id))
        self.keys = keys or KeyBook()
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
        self._cover_hold_until = float("-inf")  # monotonic time until which we cover no unheld shard
        self.cover_shards(range(len(shards)))
        policy = HopPolicy.from_config(run.timeouts)
        self.routers = {name: SwarmRouter(policy=policy) for name in run.swarm_names}
        self.stats = DriverStats()
        self.round_trip_s = 0.0  # the slowest micro-batch lately (decaying): a leave's drain waits about as long
        self.traffic = traffic or Traffic()
        self.blockage = Blockage(self.stats, self.notify)
        self.hops = HopCaller(run, p2p, self.routers, self.stats, self.blockage, traffic=self.traffic,
                              is_stopping=lambda: self._stopping, call=call, keys=self.keys)
        # a share of forward and gradient hops replicated at a second peer
        # VOLUNTEER_REFEREE=0: disputes go to the vote as before (benchmarks measure the referee's cost both ways)
        self.referee = None if os.environ.get("VOLUNTEER_REFEREE") == "0" else \
            Referee(run, p2p, self.hops.namespaces, None, dataset, call=call, device=worker.device,
                    versions=self.hops.versions)
        self.others_seen_at = float("-inf")  # when a view last showed another online driver (swarm/pipeline/peer.py)
        if self.referee is not None:
            self.referee.alone = lambda: time.monotonic() - self.others_seen_at > ALONE_S
            self.referee.traffic = self.traffic
        self.spot = SpotChecker(self.hops, share=run.integrity.spot_share, seed=seed, referee=self.referee)
        # what each copy's weights do to the loss of what went through it (chance: ln of the model's outputs)
        outputs = run.model.num_classes if run.model.kind == "mlp" else run.model.vocab_size
        # VOLUNTEER_ROUTE_LOSSES=0: no holds on the loss through a copy (benchmarks.adversary measures both ways)
        self.route_losses = None if os.environ.get("VOLUNTEER_ROUTE_LOSSES") == "0" else \
            RouteLosses(math.log(max(2, outputs)), standing=self.spot.book.get)
        for router in self.routers.values():  # newcomers together get a bounded share of each swarm's hops
            router.established = self.spot.established
        self.pusher = Pusher(self) if push_driver.enabled() and run.model.stages > 1 else None
        # a micro-batch's id is unique per driver start: a stage refuses an update it has applied for an id already
        # (swarm/pipeline/stage/applied.py), and a restarted driver must not meet its old ids there
        self.peer_tag = f"{peer_tag}-{secrets.token_hex(3)}"
        self._ids = itertools.count()
        self._running = asyncio.Event()
        self._running.set()
        self._stopping = False
        self._refused_streak = 0
        self._bugs_seen: set[str] = set()
        self.in_flight = 0
        self._started = 0  # micro-batches started so far (a round trip was alone if none started meanwhile)
        cap = lanes_cap(run)
        self.depth = DepthController(cap=cap) if run.training.in_flight == "auto" else None
        self.allowed = self.depth.depth if self.depth is not None else cap  # lanes that may take work now
        self._depth_changed: asyncio.Event | None = None  # set (and replaced) whenever ``allowed`` changes

    # ----- control (called in the loop thread)
    def cover_shards(self, unheld: Any) -> None:
        """Train on our own shard plus every shard no other online layer0 peer holds (rarest-first coverage);
        only our own for ``COVER_HOLD_S`` after a stage refused one we covered."""
        if time.monotonic() < self._cover_hold_until:
            unheld = ()
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
        self._set_allowed(lanes_cap(self.run))  # waiting lanes wake and see the stop

    # ----- training
    async def run_forever(self) -> None:
        self._depth_changed = asyncio.Event()
        lanes = [asyncio.create_task(self._lane(i)) for i in range(lanes_cap(self.run))]
        try:
            await asyncio.gather(*lanes)
        finally:
            for lane in lanes:
                lane.cancel()
            logger.info("spot checks and referee at the stop: %s", self.spot.stats())
            self.spot.cancel_background()
            if self.pusher is not None:
                self.pusher.cancel()
            if self.referee is not None:
                self.referee.close()

    async def _lane(self, index: int = 0) -> None:
        """Micro-batches one after another; nothing a peer sends, and no bug in one micro-batch, ends it.
        Lane ``index`` takes work only while fewer lanes than ``allowed`` would be busy (``in_flight: auto``)."""
        while not self._stopping:
            await self._running.wait()
            while index >= self.allowed and not self._stopping and self._depth_changed is not None:
                await self._depth_changed.wait()
            if self._stopping:
                return
            x, ids = self.batches.next_with_ids()
            try:
                await self.train_microbatch(x, ids)
            except DriverStopped:
                return
            except Refused as exc:
                await self._refused(exc)
            except Exception as exc:
                self._lane_bug(exc)
                await asyncio.sleep(LANE_BUG_PAUSE_S)  # a bug that fails every micro-batch must not spin the lane

    async def train_microbatch(self, x: torch.Tensor, ids: torch.Tensor) -> float:
        """One micro-batch (inputs and train-split sample ids) through every stage and back; returns its loss.
        Raises Refused when a stage refused it before anything was applied."""
        stages = self.run.model.stages
        mb = f"{self.peer_tag}-{next(self._ids)}"
        batch = int(x.shape[0])
        self.stats.sent += batch
        self.in_flight += 1
        self._started += 1
        started_at, started_n, alone = time.monotonic(), self._started, self.in_flight == 1
        try:
            if stages == 1:
                loss, _ = await self._own(self.worker.forward_backward, mb, x, self.dataset.y_train[ids])
            else:
                loss = await self._through_the_swarms(mb, x, ids)
        except HopGivenUp as exc:
            self.stats.lost += 1
            self.notify("error", f"gave up a micro-batch: {exc}")
            return math.nan
        finally:
            self.in_flight -= 1
        self.stats.trained += batch
        self.stats.microbatches += 1
        self._completed(started_at, alone and self._started == started_n)
        self.stats.last_loss = loss
        self._refused_streak = 0
        self.blockage.clear()
        return loss

    async def _through_the_swarms(self, mb: str, x: torch.Tensor, ids: torch.Tensor) -> float:
        """Forward through every swarm and back. Every tensor we pass on travels with the receipt of the peer that
        computed it, checked here first (swarm/pipeline/transport/replies.py check_receipt); we author only stage 0's."""
        stages = self.run.model.stages
        inputs: dict[int, torch.Tensor] = {}
        served_by: dict[int, str] = {}
        ids_d = ids_digest(ids)
        h, committed = await self._own(self._forward_committed, mb, x)
        forwards = {0: self._sign_own(mb, "forward", h, ids_d, committed)}  # stage -> the receipt of its forward
        start = 1
        # stages hand the tensors to each other (swarm/pipeline/control/push_driver.py); None: this micro-batch is relayed
        pushed = await self.pusher.push(mb, h, ids, ids_d, forwards[0]) if self.pusher is not None else None
        if pushed is not None:
            served_by.update(pushed.served_by)
            forwards.update(pushed.forwards)
            if pushed.grad is not None:
                inputs.update(pushed.inputs)
                return await self._backward_from(mb, x, pushed.back_from, pushed.grad, pushed.grad_receipt,
                                                 pushed.loss, inputs, forwards, served_by, ids_d)
            inputs[1] = h  # a push failed part-way: relayed on from the stage after the last that answered
            start, h = pushed.partial_at + 1, pushed.h
        for k in range(start, stages - 1):
            inputs[k] = h
            meta, vouch = self._meta(mb, forwards[k - 1]), self._vouch(mb, forwards[k - 1], ids_d)
            if k == 1:  # stage 1 may have other layer0 peers recompute our stage 0 from them (stage0_checks.py)
                meta["ids"] = ids_bytes(ids)
            (h,), reply, served_by[k] = await self.hops.hop(k, "forward", [h], meta, vouch=vouch)
            forwards[k] = reply["receipt"]
            await self.spot.after_forward(k, inputs[k], meta, vouch, served_by[k], h, forwards[k])
        last, last_meta = stages - 1, self._meta(mb, forwards[stages - 2])
        last_vouch = self._vouch(mb, forwards[stages - 2], ids_d)
        reply_tensors, meta, served_by[last] = await self.hops.hop(last, "forward_backward", [h, ids], last_meta,
                                                                   vouch=last_vouch)
        loss = float(meta["loss"])
        grad, receipt = reply_tensors[0], meta["receipt"]
        try:
            await self.spot.after_gradient(last, "forward_backward_check", [h, ids], last_meta, last_vouch,
                                           served_by[last], grad, receipt, loss=loss)
        except Refused as exc:  # the last stage has applied its update: this micro-batch is half done, lost
            self._avoid_author(exc)
            raise HopGivenUp(str(exc)) from None
        return await self._backward_from(mb, x, stages - 2, grad, receipt, loss, inputs, forwards, served_by, ids_d)

    async def _backward_from(self, mb: str, x: torch.Tensor, k: int, grad: torch.Tensor, receipt: Receipt | None,
                             loss: float, inputs: dict[int, torch.Tensor], forwards: dict[int, Receipt],
                             served_by: dict[int, str], ids_d: bytes) -> float:
        """The backward relayed from stage ``k`` (``grad``: the gradient of its output, ``receipt`` its signer's) up
        to our own stage 0; the micro-batch's loss."""
        try:
            for k in range(k, 0, -1):
                grad, receipt = await self._backward_hop(k, mb, grad, receipt, inputs.get(k), forwards, served_by[k],
                                                         loss, ids_d)
        except Refused as exc:  # the last stage has applied its update: this micro-batch is half done, lost
            self._avoid_author(exc)
            raise HopGivenUp(str(exc)) from None
        await self._own(self.worker.backward, mb, grad, x, loss)
        self._judge_routes(served_by, loss)
        return loss

    def _judge_routes(self, served_by: dict[int, str], loss: float) -> None:
        """Copies whose weights give a far higher loss than their swarm's other copies are held off
        (swarm/pipeline/control/route_losses.py: weights trained to harm pass every recomputation, not this)."""
        if self.route_losses is None:
            return
        last = self.run.model.stages - 1
        middle = {k: peer for k, peer in served_by.items() if k < last}
        verdicts = self.route_losses.record(middle, loss, witness=served_by.get(last, ""))
        if last in served_by:  # a last stage's loss is its own claim, signed and recomputed by a referee: no witness
            verdicts += self.route_losses.record({last: served_by[last]}, loss, witness=SELF_WITNESS)
        for harmful in verdicts:
            self.routers[f"layer{harmful.stage}"].failure(harmful.peer, time.monotonic(), min_ban_s=harmful.hold_s,
                                                          convicted=True)
            self.notify("warning", f"layer{harmful.stage} peer {harmful.peer[-8:]}: {harmful.describe()}; not "
                                   f"using it for {harmful.hold_s:.0f} s")

    async def _backward_hop(self, k: int, mb: str, grad: torch.Tensor, receipt: Receipt, x: torch.Tensor | None,
                            forwards: dict[int, Receipt], peer: str, loss: float,
                            ids_d: bytes) -> tuple[torch.Tensor, Receipt]:
        """Backward goes to the peer that ran the forward (it reuses its activations), else anywhere with the input
        and the receipts that prove it (x's, the forward's at stage k)."""
        vouch = self._vouch(mb, forwards[k - 1], ids_d)
        chain = {**self._meta(mb, receipt, forwards[k - 1], forwards[k]), "loss": loss}  # g's, x's, the forward's
        try:
            (grad_in,), reply, _ = await self.hops.hop(k, "backward", [grad], {**self._meta(mb, receipt), "loss": loss},
                                                       only=peer, vouch=vouch)
        except AlreadyApplied:
            raise  # its copy stepped on it already: resent with its input, another copy would step on it too
        except (HopGivenUp, NeedInputReply):
            if x is None:  # a pushed hop's input never came here: only the peer that ran its forward can do it
                raise HopGivenUp(f"backward at layer{k}: peer {peer[-8:]} holds the only copy of its input") from None
            (grad_in,), reply, peer = await self.hops.hop(k, "backward", [grad, x], chain, vouch=vouch)
        if x is not None:
            await self.spot.after_gradient(k, "backward_check", [grad, x], chain, vouch, peer, grad_in,
                                           reply["receipt"])
        return grad_in, reply["receipt"]

    def _forward_committed(self, mb: str, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, bytes, bytes]]:
        """Our stage 0's forward and the weights it ran with (version, its digest, the digest of what it computed with:
        another where it predicted, swarm/pipeline/stage/predicting.py), read on the compute thread."""
        with self.worker.lock:  # re-entrant: what this forward ran with, not what a later one did
            h = self.worker.forward(mb, x)
            return h, (*self.worker.committed, self.worker.forward_weights)

    def _sign_own(self, mb: str, op: str, h: torch.Tensor, ids_d: bytes, committed: tuple) -> Receipt:
        """The receipt of our own stage 0's output, committed to the weights that computed it (a referee can recompute
        it exactly): serialized once, so what travels is what we signed. ``committed``: (version, digest) or, for a
        training forward, (version, digest, the digest of the predicted weights it computed with)."""
        training = self.run.training
        item = serialize_once(h, training.codec, training.wire_rank)
        version, weights, *computed = committed
        return self.receipt_key.sign(self.run_id, mb, op, 0, version, ids_d, tensor_digest(item), ids_d, weights,
                                     computed[0] if computed else None)

    def _meta(self, mb: str, *receipts: Receipt) -> dict:
        return {"mb": mb, "rc": [r.to_wire() for r in receipts], "rk": self.receipt_key.public}

    def _vouch(self, mb: str, previous: Receipt, ids_d: bytes) -> Vouch:
        return Vouch(self.run_id, mb, previous.output, ids_d)

    async def _own(self, fn: Callable, *args: Any) -> Any:
        """Our own stage-0 worker; while its copy is sick, wait for it to heal and retry (nothing is lost)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                return await loop.run_in_executor(self.executor, fn, *args)
            except SickCopy as exc:
                while self.worker.health.sick:
                    self.blockage.set(f"our layer0 copy is sick, healing ({exc})")  # said once it has lasted 2 s
                    if self._stopping:
                        raise DriverStopped() from None
                    await asyncio.sleep(SICK_POLL_S)

    def _completed(self, started_at: float, alone: bool) -> None:
        """Keep the round trip; ``in_flight: auto``: feed it to the depth controller, wake lanes when it allows more."""
        now = time.monotonic()
        self.round_trip_s = max(now - started_at, ROUND_TRIP_DECAY * self.round_trip_s)
        if self.depth is None:
            return
        self.depth.completed(now, now - started_at, alone)
        allowed = self.depth.decide(now)
        self.stats.depth = allowed
        if allowed != self.allowed:
            if allowed != 1 and self.allowed != 1:  # not the brief probes of the shortest round trip
                logger.info("micro-batches in flight: %d -> %d (round trip %.0f ms, %.1f micro-batches/s)",
                            self.allowed, allowed, (self.depth.rtt_s or 0) * 1000, self.depth.rate_per_s)
            self._set_allowed(allowed)

    def _set_allowed(self, allowed: int) -> None:
        """Change the lanes that may work, and wake the waiting ones to look (in the loop thread)."""
        self.allowed = allowed
        if self._depth_changed is not None:
            woken, self._depth_changed = self._depth_changed, asyncio.Event()
            woken.set()

    # ----- evaluation (swarm/pipeline/control/driver_eval.py)
    async def evaluate(self) -> tuple[float | None, float]:
        """Forward-only pass of the test split through the whole pipeline: (accuracy, mean loss), replicated over up to
        ``MAX_REPLICAS`` last-stage peers and published as they agree (swarm/integrity/evaluations.py)."""
        return await evaluate(self)
