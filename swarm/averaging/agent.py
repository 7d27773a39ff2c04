"""One peer's averaging runtime: Dpwa pulls, best-model exchange with its trial, and the bans.

Threads: the decisions to start something are drawn on the compute thread right after a step
(``on_step``, a StageWorker step hook); the pulls run on the peer's asyncio loop beside training;
what a pull brings is checked and applied back on the compute thread, under the stage's lock, so
it lands *between* two steps. A trial's verdict (keep or roll back) is also taken on the compute
thread, right after the step that completes it.

Optimizer state (the decision): a Dpwa interpolation and an adoption keep our optimizer state.
Adam's moments are running statistics of the gradients near our copy; after a partial move toward
a peer they remain a good estimate, and sending them would triple each pull. Resetting them would
restart Adam's bias correction on every pull. A rollback restores the optimizer state saved with
the old copy; a newcomer (sync.py) downloads the donor's optimizer state with its weights.

Bounded influence (the decision): every copy that passed ``check_params`` goes through an
``InfluenceGuard`` (influence.py, rules in swarm/integrity/mixing.py) before it is mixed in or
adopted: an outlier is rejected and its server banned like a copy that failed the checks; otherwise
the step ``f * (peer - ours)`` is clipped (the copy handed to ``mix_in`` is moved toward ours
first), and a peer that already moved our copy by its budget within the window is skipped. Pulls
go to peers within their fair share of the window's pulls, so no one peer fills the history.

Events (through ``notify``): rejections, adoptions, trial verdicts and rollbacks always; successful
Dpwa pulls at most once per ``AVERAGED_NOTICE_S`` (they happen several times a second), saying how
many pulls happened since the last notice.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from swarm.averaging.checks import ParamsRejected, check_params, total_norm
from swarm.averaging.influence import InfluenceGuard, distance, per_tensor, toward
from swarm.averaging.params_rpc import ParamsRefused, fetch_params
from swarm.averaging.rules import (
    BanList, FlowControl, Trial, exchange_choice, interpolation_factor, pull_candidates, should_pull, trial_keeps,
)
from swarm.records import MemberRecord
from swarm.runconfig import RunConfig
from swarm.stage import StageWorker, StepInfo, WorkerState
from swarm.stage_rpc import Traffic
from swarm.wire import WireError

logger = logging.getLogger(__name__)

AVERAGED_NOTICE_S = 30.0
Notify = Callable[[str, str, str], None]  # (level, kind, text)


@dataclass(slots=True)
class AveragingStats:
    pulls: int = 0  # pulls started
    averaged: int = 0  # interpolations applied
    failed: int = 0  # pulls that timed out, broke or were refused
    rejected: int = 0  # copies refused by the checks
    clipped: int = 0  # copies applied with a clipped step (swarm/integrity/mixing.py)
    over_budget: int = 0  # copies dropped because their peer had moved ours enough within the window
    adopted: int = 0
    kept: int = 0  # adoptions that passed their trial
    rolled_back: int = 0
    last_factor: float | None = None


class _Skipped(Exception):
    """The copy changed hands meanwhile (a trial began): drop this pull."""


class SwarmAveraging:
    """Keeps one peer's copy of its layer close to the swarm's (see the module doc)."""

    def __init__(self, run: RunConfig, swarm: str, me: str, worker: StageWorker, p2p: Any, executor: Executor,
                 loop: asyncio.AbstractEventLoop, notify: Notify, traffic: Traffic | None = None,
                 seed: int | None = None):
        self.run = run
        self.cfg = run.averaging
        self.swarm = swarm
        self.me = me
        self.worker = worker
        self.p2p = p2p
        self.executor = executor
        self.loop = loop
        self.notify = notify
        self.traffic = traffic
        self.stats = AveragingStats()
        self.records: list[MemberRecord] = []
        self.flow = FlowControl()
        self.banned = BanList()
        self.distrusted = BanList()
        self.guard = InfluenceGuard(self.cfg.influence)
        self._bans_lock = threading.Lock()  # ban lists are written from the compute thread too
        self._draw_rng = random.Random(seed)  # compute thread only
        self._choice_rng = random.Random(None if seed is None else seed + 1)  # loop thread only
        self._pulls_enabled = self.cfg.mode == "dpwa"
        self._exchange_every = self.cfg.exchange.every_samples
        self._since_exchange = 0
        self._pull_task: asyncio.Task | None = None
        self._exchange_task: asyncio.Task | None = None
        self.trial: Trial | None = None  # compute thread (under the lock) writes; others only read
        self._backup: WorkerState | None = None
        self._closed = False
        self._notice_at = -AVERAGED_NOTICE_S
        self._unannounced = 0

    # ----- lifecycle (loop thread)
    def start(self) -> None:
        self.worker.add_step_hook(self.on_step)

    async def close(self) -> None:
        self._closed = True
        tasks = [t for t in (self._pull_task, self._exchange_task) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def set_records(self, records: list[MemberRecord]) -> None:
        self.records = list(records)

    def excluded(self, now: float) -> set[str]:
        with self._bans_lock:
            return self.banned.active(now) | self.distrusted.active(now)

    # ----- compute thread
    def on_step(self, info: StepInfo) -> None:
        """After every update (compute thread, under the lock): trial bookkeeping and the draws."""
        trial = self.trial
        if trial is not None and trial.record(info.loss, info.forward_at):
            self._finish_trial(trial)
        if self._exchange_every > 0:
            self._since_exchange += info.batch_size
            if self._since_exchange >= self._exchange_every:
                self._since_exchange = 0
                self._post(self._start_exchange)
        if self._pulls_enabled and should_pull(self._draw_rng, self.cfg.fetch_probability):
            self._post(self._start_pull)

    def _post(self, callback: Callable[[], None]) -> None:
        try:
            self.loop.call_soon_threadsafe(callback)
        except RuntimeError:  # the loop is closing: nothing more to start
            pass

    # ----- Dpwa
    def _start_pull(self) -> None:
        if self._closed or self.trial is not None or _running(self._pull_task):
            return
        self._pull_task = asyncio.ensure_future(self.pull_once())
        self._pull_task.add_done_callback(_report_failure)

    async def pull_once(self) -> bool:
        """Pull one peer's copy and interpolate toward it; True if it was applied."""
        now = time.monotonic()
        candidates = pull_candidates(self.records, self.me, self.excluded(now))
        busy = self.guard.over_share(candidates, now)  # fair share: they wait for the others to catch up
        peer = self.flow.choose([p for p in candidates if p not in busy], now, self._choice_rng)
        if peer is None:
            return False
        self.stats.pulls += 1
        fetched = await self._fetch(peer, self.cfg.timeout_s)
        if fetched is None:
            return False
        state, meta = fetched
        try:
            factor = await self.loop.run_in_executor(self.executor, self._mix, state, meta)
        except ParamsRejected as exc:
            self._reject(peer, str(exc))
            return False
        except _Skipped:
            return False
        self.flow.success(peer, time.monotonic())
        self.stats.averaged += 1
        self.stats.last_factor = factor
        self._notice_averaged(peer, factor)
        return True

    def _mix(self, state: dict, meta: dict) -> float:
        with self.worker.lock:
            if self.trial is not None:
                raise _Skipped()
            check_params(self.worker.module.state_dict(), state, self.cfg.max_norm_ratio)
            stats = self.worker.stats
            factor = interpolation_factor(self.cfg, clock=stats.clock, peer_clock=meta["clock"], loss=stats.loss_ema,
                                          peer_loss=meta["loss"])
            bounded, clock = self._bounded(meta["peer_id"], state, meta["clock"], factor)
            self.worker.mix_in(bounded, factor, clock)
            return factor

    def _bounded(self, peer: str, state: dict, peer_clock: float, weight: float) -> tuple[dict, float]:
        """``state`` and its clock, or both moved toward ours so the step fits the bounds (under the lock).

        Raises ParamsRejected for an outlier (the caller bans its server) and _Skipped when the peer
        has moved our copy as far as its budget allows within the window."""
        own = self.worker.module.state_dict()
        now = time.monotonic()
        dist = distance(own, state)
        verdict = self.guard.judge(peer, dist, weight, total_norm(own), now)
        if verdict.rejected:
            raise ParamsRejected(verdict.reason)
        if verdict.scale <= 0.0:
            self.stats.over_budget += 1
            raise _Skipped()
        scales, step = per_tensor(own, state, weight, verdict.scale, self.cfg.influence)
        clipped = min(scales.values(), default=1.0) < 1.0
        self.guard.accepted(peer, dist, step, now, clipped)
        if not clipped:
            return state, peer_clock
        self.stats.clipped += 1
        logger.info("clipped the copy of %s: distance %.3g, step %.3g of norm %.3g (%s)", peer[-8:], dist, step,
                    total_norm(own), verdict.reason or "max_step_ratio per tensor")
        clock = self.worker.stats.clock
        return toward(own, state, scales), clock + verdict.scale * (peer_clock - clock)

    def _notice_averaged(self, peer: str, factor: float) -> None:
        self._unannounced += 1
        now = time.monotonic()
        if now - self._notice_at < AVERAGED_NOTICE_S:
            return
        more = f" ({self._unannounced - 1} more pull(s) since the last notice)" if self._unannounced > 1 else ""
        self.notify("info", "averaged", f"averaged with {peer[-8:]} at f={factor:.2f}{more}")
        self._notice_at, self._unannounced = now, 0

    # ----- fetching and bans
    async def _fetch(self, peer: str, timeout_s: float, with_optimizer: bool = False,
                     wire_dtype: str | None = None) -> tuple[dict, dict] | None:
        try:
            return await fetch_params(self.p2p, peer, self.run, self.swarm, timeout_s,
                                      wire_dtype or self.cfg.wire_dtype, with_optimizer=with_optimizer,
                                      traffic=self.traffic)
        except ParamsRefused as exc:
            self.flow.refusal(peer, time.monotonic())
            self.stats.failed += 1
            logger.info("%s refused a pull: %s", peer[-8:], exc)
        except WireError as exc:
            self._reject(peer, f"malformed reply ({exc})")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # timeouts, dead peers, broken streams
            self.flow.timeout(peer, time.monotonic())
            self.stats.failed += 1
            logger.info("pull from %s failed: %s %s", peer[-8:], exc.__class__.__name__, exc)
        return None

    def _reject(self, peer: str, reason: str) -> None:
        with self._bans_lock:
            self.banned.ban(peer, time.monotonic(), self.cfg.ban_s)
        self.stats.rejected += 1
        self.notify("warning", "rejected",
                    f"rejected {peer[-8:]}: {reason}; no pulls from it for {self.cfg.ban_s:.0f} s")

    # ----- best-model exchange
    def _start_exchange(self) -> None:
        if self._closed or self.trial is not None or _running(self._exchange_task):
            return
        self._exchange_task = asyncio.ensure_future(self.exchange_once())
        self._exchange_task.add_done_callback(_report_failure)

    async def exchange_once(self) -> bool:
        """Adopt the swarm's best copy when it beats ours by the margin; True if a trial began."""
        own_loss = self.worker.stats.loss_ema
        choice = exchange_choice(self.records, self.me, own_loss, self.cfg.exchange.margin,
                                 self.excluded(time.monotonic()))
        if choice is None or self.trial is not None:
            return False
        fetched = await self._fetch(choice.peer_id, self.cfg.timeout_s)
        if fetched is None:
            return False
        state, meta = fetched
        try:
            baseline = await self.loop.run_in_executor(self.executor, self._adopt, choice.peer_id, state, meta)
        except ParamsRejected as exc:
            self._reject(choice.peer_id, str(exc))
            return False
        except _Skipped:
            return False
        self.stats.adopted += 1
        self.notify("info", "adopted",
                    f"adopted the best model from {choice.peer_id[-8:]} (its loss {choice.loss:.3f}, ours "
                    f"{baseline:.3f}); on trial for {self.cfg.exchange.trial_batches} micro-batches")
        return True

    def _adopt(self, peer: str, state: dict, meta: dict) -> float:
        with self.worker.lock:
            baseline = self.worker.stats.loss_ema
            if self.trial is not None or baseline is None:
                raise _Skipped()
            check_params(self.worker.module.state_dict(), state, self.cfg.max_norm_ratio)
            bounded, clock = self._bounded(peer, state, meta["clock"], self.cfg.exchange.factor)
            self._backup = self.worker.capture(include_optimizer=True)
            self.worker.mix_in(bounded, self.cfg.exchange.factor, clock)
            self.trial = Trial(peer=peer, baseline_loss=baseline, batches=self.cfg.exchange.trial_batches,
                               started_at=time.monotonic())
            return baseline

    def _finish_trial(self, trial: Trial) -> None:
        """Compute thread, under the lock, right after the step that completed the trial."""
        backup, self._backup, self.trial = self._backup, None, None
        peer, mean, baseline = trial.peer[-8:], trial.mean_loss, trial.baseline_loss
        if trial_keeps(baseline, trial.losses):
            self.worker.stats.loss_ema = mean  # the new copy's own measurement, not the peer's claim
            self.stats.kept += 1
            self.notify("info", "adopted", f"kept the model adopted from {peer}: trial loss {mean:.3f} "
                                           f"vs {baseline:.3f} before")
            return
        if backup is not None:
            self.worker.restore(backup)
        with self._bans_lock:
            self.distrusted.ban(trial.peer, time.monotonic(), self.cfg.exchange.distrust_s)
        self.stats.rolled_back += 1
        self.notify("warning", "rolled_back",
                    f"rolled back {peer}: its model's trial loss {mean:.3f} is worse than our {baseline:.3f}; "
                    f"distrusting it for {self.cfg.exchange.distrust_s:.0f} s")


def _running(task: asyncio.Task | None) -> bool:
    return task is not None and not task.done()


def _report_failure(task: asyncio.Task) -> None:
    """A pull or exchange that failed in an unexpected way is logged; training goes on."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("averaging task failed", exc_info=task.exception())
