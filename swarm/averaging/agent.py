"""One peer's averaging runtime: Dpwa pulls, best-model exchange scored on validation data, the bans.

Threads: the decisions to start something are drawn on the compute thread right after a step
(``on_step``, a StageWorker step hook); the pulls run on the peer's asyncio loop beside training;
what a pull brings is checked and applied back on the compute thread, under the stage's lock, so
it lands *between* two steps. An exchange's scoring (validation.py) runs on the compute thread too.

Best-model exchange (the decision, and the scoring: exchange.py): every ``exchange.every_samples``
samples, score a few random peers' copies and ours on the run's validation split, and adopt the best
when it beats ours by ``exchange.margin``. Nobody's reported loss or clock decides.

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

Events (through ``notify``): rejections and adoptions always; successful
Dpwa pulls at most once per ``AVERAGED_NOTICE_S`` (they happen several times a second), saying how
many pulls happened since the last notice.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from swarm.averaging.checks import ParamsRejected, check_params, total_norm
from swarm.averaging.exchange import (  # noqa: F401  (CONTEXT_TRIES, OWN, load_validation: re-exported)
    CONTEXT_TRIES, OWN, ExchangeScorer, fmt_score, load_validation,
)
from swarm.averaging.influence import InfluenceGuard, distance, per_tensor, step_moments, toward
from swarm.integrity.mixing import MAX_GROWTH_RATIO, MixVerdict
from swarm.averaging.params_rpc import ParamsRefused, fetch_params
from swarm.averaging.rules import (
    BanList, FlowControl, budget_allows, exchange_candidates, exchange_winner, interpolation_factor, pull_candidates,
    should_pull,
)
from swarm.dht.records import MemberRecord
from swarm.run.runconfig import RunConfig
from swarm.pipeline.stage.worker import StageWorker, StepInfo
from swarm.pipeline.stage.stage_rpc import Traffic
from swarm.pipeline.transport.wire import WireError

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
    exchanges: int = 0  # best-model exchanges that scored at least one candidate
    adopted: int = 0  # ... and adopted one
    kept_own: int = 0  # ... and kept our copy (no candidate beat it on the validation split)
    last_factor: float | None = None


class _Skipped(Exception):
    """The peer has moved our copy as far as its budget allows within the window: drop this copy."""


class _Far(ParamsRejected):
    """A copy refused only for its distance from ours: on label-skewed shards an honest partner drifts that far
    (issue 25: with SGD + momentum and 2 peers per swarm every peer banned its only partner for 300 s, and the
    copies never averaged again). Before any ban it is scored on the validation split (``_vouch``)."""


FAR_VOUCH_S = 60.0  # a far copy that scored well is taken (clipped) from its peer for this long without a new score
# a far copy is vouched for when its validation loss is at most this factor of ours plus the slack: a skewed
# partner's copy scores about as badly as ours on the other classes; a garbage copy scores near chance (ln 10)
FAR_LOSS_FACTOR, FAR_LOSS_SLACK = 1.5, 0.1
FAR_CHANCE_FRACTION = 0.9  # ... and below this fraction of chance's loss (ln of the classes or the vocabulary)


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
        self.guard = InfluenceGuard(self.cfg.influence)
        self._vouched: dict[str, float] = {}  # far peers whose copies scored well: until when (monotonic)
        self._bans_lock = threading.Lock()  # ban lists are written from the compute thread too
        self._draw_rng = random.Random(seed)  # compute thread only
        self._choice_rng = random.Random(None if seed is None else seed + 1)  # loop thread only
        self._pulls_enabled = self.cfg.mode == "dpwa"
        self._exchange_every = self.cfg.exchange.every_samples
        self._since_exchange = 0
        self._pull_task: asyncio.Task | None = None
        self._last_pull_end: float | None = None  # loop thread writes, the compute thread reads (plain floats)
        self._last_pull_s = 0.0
        self._exchange_task: asyncio.Task | None = None
        self.views: dict[str, list[MemberRecord]] = {}  # every swarm's records (exchange context)
        self.scorer = ExchangeScorer(run, swarm, worker, self._choice_rng, self._fetch, self._reject)
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
            return self.banned.active(now)

    # ----- compute thread
    def on_step(self, info: StepInfo) -> None:
        """After every update (compute thread, under the lock): the draws."""
        if self._exchange_every > 0:
            self._since_exchange += info.batch_size
            if self._since_exchange >= self._exchange_every:
                self._since_exchange = 0
                self._post(self._start_exchange)
        if self._pulls_enabled and (should_pull(self._draw_rng, self.cfg.fetch_probability) or budget_allows(
                time.monotonic(), self._last_pull_end, self._last_pull_s, self.cfg.pull_budget)):
            self._post(self._start_pull)

    def _post(self, callback: Callable[[], None]) -> None:
        try:
            self.loop.call_soon_threadsafe(callback)
        except RuntimeError:  # the loop is closing: nothing more to start
            pass

    # ----- Dpwa
    def _start_pull(self) -> None:
        if self._closed or _running(self._pull_task):
            return
        self._pull_task = asyncio.ensure_future(self.pull_once())
        self._pull_task.add_done_callback(_report_failure)

    async def pull_once(self) -> bool:
        """Pull one peer's copy and interpolate toward it; True if it was applied."""
        started = time.monotonic()
        try:
            return await self._pull_once()
        finally:  # what averaging.pull_budget measures (a failed pull took the link's time too)
            self._last_pull_end = time.monotonic()
            self._last_pull_s = self._last_pull_end - started

    async def _pull_once(self) -> bool:
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
            try:
                factor = await self.loop.run_in_executor(self.executor, self._mix, state, meta)
            except _Far as exc:  # scored on data before any verdict: a skewed partner is not a poisoner
                if not await self._vouch(peer, state, str(exc)):
                    return False
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
        if verdict.far and self._vouched.get(peer, 0.0) > now:  # scored well on data: taken, one capped step
            verdict = MixVerdict(min(1.0, self.cfg.influence.max_step_ratio * total_norm(own) / (weight * dist)),
                                 "far, vouched for by its validation loss")
        elif verdict.rejected:
            raise (_Far if verdict.far else ParamsRejected)(verdict.reason)
        if verdict.scale <= 0.0:
            self.stats.over_budget += 1
            raise _Skipped()
        scales, step = per_tensor(own, state, weight, verdict.scale, self.cfg.influence)
        clipped = min(scales.values(), default=1.0) < 1.0
        bounded = toward(own, state, scales) if clipped else state
        # the window's norm growth, all partners together (swarm/integrity/mixing.py item 4)
        share = self.guard.fit_growth(*step_moments(own, bounded, weight), now)
        self.guard.accepted(peer, dist, step * share, now, clipped or share < 1.0)
        if share < 1.0:
            logger.info("shortened the step toward %s's copy to %.2g of it: averaging grew our norm by %.0f %% "
                        "within %.0f s already", peer[-8:], share, 100 * MAX_GROWTH_RATIO, self.cfg.influence.window_s)
            bounded = toward(own, bounded, share)
        elif not clipped:
            return state, peer_clock
        self.stats.clipped += 1
        if clipped:
            logger.info("clipped the copy of %s: distance %.3g, step %.3g of norm %.3g (%s)", peer[-8:], dist, step,
                        total_norm(own), verdict.reason or "max_step_ratio per tensor")
        clock = self.worker.stats.clock
        return bounded, clock + verdict.scale * share * (peer_clock - clock)

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
                     wire_dtype: str | None = None, swarm: str | None = None) -> tuple[dict, dict] | None:
        try:
            return await fetch_params(self.p2p, peer, self.run, swarm or self.swarm, timeout_s,
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

    async def _vouch(self, peer: str, state: dict, why: str) -> bool:
        """Score a far copy and ours on the validation split: True (and taken for ``FAR_VOUCH_S``) when it scores
        about as well; banned only when it is no better than guessing; skipped, nobody blamed, when it learned
        something but scores worse (a skewed partner may) or when no score could be made."""
        context = await self.scorer.context(self.views, self.me)
        scored = None if context is None else await self.loop.run_in_executor(
            self.executor, self.scorer.score, context, {peer: state})
        if scored is None:
            logger.info("a far copy of %s (%s) could not be scored: skipped, not blamed", peer[-8:], why)
            return False
        own, scores, _ = scored
        theirs = scores[peer].loss
        model = self.run.model  # and it must have learned something: a copy near chance proves nothing
        chance = math.log(model.num_classes if model.kind == "mlp" else model.vocab_size)
        if theirs <= FAR_LOSS_FACTOR * own.loss + FAR_LOSS_SLACK and theirs < FAR_CHANCE_FRACTION * chance:
            self._vouched[peer] = time.monotonic() + FAR_VOUCH_S
            logger.info("the copy of %s is far from ours (%s) but scores %.3f on the validation split against our "
                        "%.3f: averaged with, one capped step at a time", peer[-8:], why, theirs, own.loss)
            return True
        if theirs < FAR_CHANCE_FRACTION * chance:  # it learned something, just less of what the split asks: a
            # partner on other classes can score well below our copy on the whole split; not taken, not blamed
            logger.info("a far copy of %s (%s) scores %.3f on the validation split against our %.3f: skipped, not "
                        "blamed", peer[-8:], why, theirs, own.loss)
            return False
        self._reject(peer, f"{why}, and it scores {theirs:.3f} on the validation split against our {own.loss:.3f}, "
                           f"no better than guessing ({chance:.3f})")
        return False

    def _reject(self, peer: str, reason: str) -> None:
        with self._bans_lock:
            self.banned.ban(peer, time.monotonic(), self.cfg.ban_s)
        self.stats.rejected += 1
        self.notify("warning", "rejected",
                    f"rejected {peer[-8:]}: {reason}; no pulls from it for {self.cfg.ban_s:.0f} s")

    # ----- best-model exchange
    def set_views(self, views: dict[str, list[MemberRecord]]) -> None:
        """Every swarm's records: where the context layers of a scoring are pulled from."""
        self.views = {name: list(records) for name, records in views.items()}

    def _start_exchange(self) -> None:
        if self._closed or _running(self._exchange_task):
            return
        self._exchange_task = asyncio.ensure_future(self.exchange_once())
        self._exchange_task.add_done_callback(_report_failure)

    async def exchange_once(self) -> bool:
        """Score ``candidates`` random peers' copies and ours on the validation split; adopt the best
        one when its validation loss beats ours by the margin. True if a copy was adopted."""
        cfg = self.cfg.exchange
        candidates = exchange_candidates(self.records, self.me, self.excluded(time.monotonic()), self._choice_rng,
                                         cfg.candidates)
        if not candidates:
            return False
        context = await self.scorer.context(self.views, self.me)
        if context is None:
            return False
        copies: dict[str, dict] = {}
        for peer in candidates:
            fetched = await self._fetch(peer, self.cfg.timeout_s)
            if fetched is not None:
                copies[peer] = fetched[0]
        if not copies:
            return False
        self.stats.exchanges += 1
        scored = await self.loop.run_in_executor(self.executor, self.scorer.score, context, copies)
        if scored is None:
            return False
        own, scores, clocks = scored
        winner = exchange_winner(own.loss, {p: s.loss for p, s in scores.items()}, cfg.margin)
        logger.info("exchange: our validation loss %.4f; %s", own.loss,
                    ", ".join(f"{p[-8:]} {s.loss:.4f}" for p, s in scores.items()))
        if winner is None:
            self.stats.kept_own += 1
            return False
        self._vouched[winner] = time.monotonic() + FAR_VOUCH_S  # it just scored better than ours: never "far"
        try:
            await self.loop.run_in_executor(self.executor, self._adopt, winner, copies[winner], clocks[winner])
        except ParamsRejected as exc:
            self._reject(winner, str(exc))
            return False
        except _Skipped:  # it moved our copy as far as its budget allows within the window
            return False
        self.stats.adopted += 1
        self.notify("info", "adopted", f"adopted the copy of {winner[-8:]}: validation loss "
                                       f"{fmt_score(scores[winner])} vs ours {fmt_score(own)} "
                                       f"({self.scorer.samples} samples, scored here)")
        return True

    def _adopt(self, peer: str, state: dict, clock: float) -> None:
        with self.worker.lock:
            check_params(self.worker.module.state_dict(), state, self.cfg.max_norm_ratio)
            bounded, clock = self._bounded(peer, state, clock, self.cfg.exchange.factor)
            self.worker.mix_in(bounded, self.cfg.exchange.factor, clock)


def _running(task: asyncio.Task | None) -> bool:
    return task is not None and not task.done()


def _report_failure(task: asyncio.Task) -> None:
    """A pull or exchange that failed in an unexpected way is logged; training goes on."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("averaging task failed", exc_info=task.exception())
