"""The stage server's door: who may ask (online layer0 drivers of the run), how much (fair share,
in-flight cap), and what a driver's behaviour costs it (strikes, bans). Thin glue over the pure
decisions of swarm/integrity (requesters.py, labels.py); the servicer (stage_rpc.py) asks ``admit``
before a request runs and calls ``settle`` after.

The view of the drivers comes from the node's heartbeat (``set_drivers``, via SwarmPeer.update_views);
a requester unknown to it triggers at most one read of the layer0 records per
``REFRESH_MIN_INTERVAL_S`` (a driver that joined since the last heartbeat is served at once).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from swarm.pipeline.stage.activations import ActivationCache, owner_cap
from swarm.integrity.labels import DriverView, LabelSource, ShardRefusals
from swarm.integrity.receipts import CHECK_OPS
from swarm.integrity.requesters import HEAVY_CLIP_SCALE, Ban, Refusal, RequesterBook
from swarm.dht.records import MAX_BAN_REASON_CHARS, MemberRecord
from swarm.run.runconfig import IntegrityConfig

logger = logging.getLogger(__name__)

SERVED_OPS = frozenset({"forward", "backward", "forward_backward", "infer", "evaluate"}) | CHECK_OPS
UPDATE_OPS = frozenset({"backward", "forward_backward"})
DRAINING_OPS = frozenset({"backward", "infer", "evaluate"})  # what a paused or finishing driver may still ask
REFRESH_MIN_INTERVAL_S = 1.0
UNKNOWN_DRIVER_RETRY_S = 2.0

Refresh = Callable[[], Awaitable[list[MemberRecord]]]
Notify = Callable[[str, str, str], None]  # (level, kind, text), as SwarmPeer's


@dataclass(slots=True, frozen=True)
class Outcome:
    """How a request ended, for ``settle``."""

    applied: bool = False  # an update was applied
    clip_scale: float = 1.0
    strike: str | None = None  # why this request counts against its sender
    author: str = ""  # the peer that computed the tensor applied (its receipt's signer); "" when not known
    author_strike: str | None = None  # why this request counts against that author


class StageGate:
    def __init__(self, cfg: IntegrityConfig, *, labels: LabelSource | None = None, refresh: Refresh | None = None,
                 notify: Notify | None = None, cache: ActivationCache | None = None, swarm: str = "",
                 claim_grace_s: float = 0.0, balance: bool = False):
        self.cfg = cfg
        self.labels = labels
        self.view = DriverView(claim_grace_s)  # a new shard claim stays open to the others this long
        # who was told wrong_shard when: a strike only for going on past what it had in flight (pushed, then relayed)
        self.shard_refusals = ShardRefusals(allowance=2 * cfg.max_in_flight_per_requester)
        self.book = RequesterBook(cfg, balance)  # balance: a label-skewed run (swarm/integrity/requesters.py)
        self._refresh_records = refresh
        self._notify = notify or (lambda level, kind, text: None)
        self._cache = cache
        self._swarm = swarm
        self._last_refresh = float("-inf")
        self._refreshing: asyncio.Future | None = None

    # ----- the view of the run's drivers
    def set_drivers(self, records: Iterable[MemberRecord]) -> None:
        self.view.update(records)
        if self._cache is not None:
            self._cache.owner_cap = owner_cap(self._cache.max_entries, self.view.drivers())

    async def _refresh(self) -> None:
        """Read layer0's records now, at most once per REFRESH_MIN_INTERVAL_S (concurrent callers share it)."""
        if self._refresh_records is None:
            return
        if self._refreshing is not None:
            await asyncio.shield(self._refreshing)
            return
        if time.monotonic() - self._last_refresh < REFRESH_MIN_INTERVAL_S:
            return
        self._last_refresh = time.monotonic()
        self._refreshing = asyncio.ensure_future(self._refresh_records())
        try:
            self.view.merge(await self._refreshing)
        except Exception as exc:  # a failed read leaves the view as it was
            logger.info("reading layer0's records failed: %s", exc)
        finally:
            self._refreshing = None

    def allowed_shards(self, requester: str, latest_only: bool = False) -> set[int]:
        if self.labels is None:
            return set()
        return self.view.allowed(requester, self.labels.num_shards, latest_only=latest_only)

    # ----- before and after a request
    async def admit(self, requester: str, op: object) -> Refusal | None:
        if op not in SERVED_OPS:
            return None  # dispatch rejects it
        now = time.monotonic()
        if self.book.banned(requester, now):
            return self.book.admit(requester, False, now)  # the ban refusal, with its remaining time
        if not self.view.knows(requester) and not self._draining_may(requester, op):
            await self._refresh()
            if not self.view.knows(requester) and not self._draining_may(requester, op):
                return Refusal("unknown_driver", "only online layer0 peers of this run may ask: no record of you "
                               "in this peer's view yet", UNKNOWN_DRIVER_RETRY_S)
        return self.book.admit(requester, op in UPDATE_OPS, time.monotonic())

    def _draining_may(self, requester: str, op: object) -> bool:
        """A paused or finishing driver completes its micro-batches (backward) and evaluates the pipeline one
        last time (infer, evaluate: they apply nothing). Refusing its evaluation made every finish pause
        without a final figure once its record said finishing (the CI failure of test_export_then_eval)."""
        return op in DRAINING_OPS and requester in self.view.draining

    def settle(self, requester: str, outcome: Outcome) -> None:
        """After an admitted request: free its slot, count its update, and hand out strikes and bans."""
        self.book.finished(requester)
        now = time.monotonic()
        bans: list[Ban | None] = []
        # Blame the author: an update clipped to nothing was computed by the receipt's signer, not by the driver
        # that relayed it. Without a receipt (author unknown) the requester is the author.
        author = outcome.author if outcome.author and outcome.author != requester else requester
        if outcome.applied:
            bans.append(self.book.on_update(requester, outcome.clip_scale if author == requester else 1.0, now))
            if author != requester and outcome.clip_scale < HEAVY_CLIP_SCALE:
                bans.append(self.book.on_strike(author, f"its tensors clipped to {outcome.clip_scale:.2g} of their "
                                                "size", now))
        if outcome.strike is not None:
            bans.append(self.book.on_strike(requester, outcome.strike, now))
        if outcome.author_strike is not None and outcome.author:
            bans.append(self.book.on_strike(outcome.author, outcome.author_strike, now))
        for ban in bans:
            if ban is not None:
                self._announce(ban)

    def strike(self, requester: str, reason: str, weight: float = 1.0) -> None:
        """A request refused before it was admitted (malformed beyond use) still counts against its sender; so does
        a spot check's verdict on its stage-0 output, with ``weight`` strikes (swarm/pipeline/control/stage0_checks.py)."""
        ban = self.book.on_strike(requester, reason, time.monotonic(), weight)
        if ban is not None:
            self._announce(ban)

    def refusals(self, now: float) -> tuple[int, int, str]:
        """(the run's online drivers this stage refuses right now, the online drivers it knows of, the last ban's
        reason, "" while it refuses none): what the record publishes, so that status can say "layer1 refuses
        all 4 drivers" once instead of four log lines (swarm/dht/alarms.py)."""
        drivers = list(self.view.current)
        refused = sum(1 for driver in drivers if self.book.banned(driver, now))
        reason = self.book.bans[-1].reason if refused and self.book.bans else ""
        return refused, len(drivers), reason[:MAX_BAN_REASON_CHARS]

    def _announce(self, ban: Ban) -> None:
        text = f"{self._swarm}: banned peer {ban.requester[-8:]} for {ban.duration_s:.0f} s: {ban.reason}"
        logger.warning(text)
        self._notify("warning", "banned", text)
