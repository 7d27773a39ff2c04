"""Labels from the data, not the wire: the last stage looks targets up by sample id, and only in the
shards the requesting driver may use. Also the view of the run's drivers (online layer0 records).

A driver sends row indices into the run's train split (``forward_backward``) or test split
(``evaluate``); every volunteer loads the run's data deterministically (swarm/run/data.py), so the last
stage holds the same targets. A driver may use its own shard (from its layer0 record) and every shard
no online layer0 peer holds (drivers also cover unheld shards, swarm/pipeline/control/driver.py ``cover_shards``).
Records are a heartbeat stale at times, so the view before the latest counts too (the grace).

A future source of private data (targets that only the driver holds) cannot work this way: the last
stage would need the targets from the wire again, and the bound on a wrong label would have to come
from elsewhere (e.g. the last stage checking the loss it computes against its recent distribution,
or the driver running the last stage itself).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable

import numpy as np
import torch

from swarm.dht.records import MemberRecord


DRAINING_STATES = frozenset({"paused", "finishing"})


class WrongShard(ValueError):
    """Sample ids outside the shards the requester may use (reply code ``wrong_shard``). ``excusable``: the
    shards are closed only by the grace view (their holder's record is missing from our latest read), so
    the requester's own read may have missed it as well: refused, but no strike."""

    def __init__(self, message: str, excusable: bool = False):
        super().__init__(message)
        self.excusable = excusable


class UnknownDriver(Exception):
    """No online layer0 record of the requester in our view (reply code ``unknown_driver``)."""


def allowed_shards(requester: str, view: dict[str, int], num_shards: int) -> set[int]:
    """The requester's own shard plus every shard that no online driver of ``view`` (peer -> shard) holds."""
    held = {s % num_shards for s in view.values() if s >= 0}
    allowed = set(range(num_shards)) - held
    own = view.get(requester, -1)
    if own >= 0:
        allowed.add(own % num_shards)
    return allowed


# The protocol's rule after a ``wrong_shard`` refusal: the driver trains on its own shard only for this long
# (swarm/pipeline/control/driver_failures.py), and a stage strikes it only for a micro-batch outside its shards sent
# after it was told (ShardRefusals). Its micro-batches already in flight when it was told arrive for a while yet.
WRONG_SHARD_HOLD_S = 30.0
WRONG_SHARD_GRACE_S = 10.0


class ShardRefusals:
    """When this stage last told each driver ``wrong_shard``, and how often since: a refusal strikes only a driver
    that was told and went on, i.e. more than ``allowance`` refusals (what it can have had in flight when it was told,
    each refused twice at most: a push, then its relay) and ``WRONG_SHARD_GRACE_S`` or more after it was told, within
    ``WRONG_SHARD_HOLD_S``. Counted, not only timed: on a busy machine a micro-batch built before the refusal can
    arrive more than the grace later.

    Two honest views of layer0 disagree for a few heartbeats whenever a driver joins, leaves or misses a heartbeat:
    the driver covers a shard its last reads showed unheld while our reads still show the holder (a holder that
    left: its offline record not read here yet; a busy holder's record seen here and missed there). Striking every
    such micro-batch banned an honest driver whose lanes were full of them (CI: ten in flight on a loaded machine,
    the adversary module's honest driver banned at layer2 for the rest of the run). The refusal alone keeps the
    labels of a shard from a driver that may not use it; the strike is for one that ignores it."""

    def __init__(self, allowance: int = 32, max_drivers: int = 4096) -> None:
        self.allowance = allowance
        self.max_drivers = max_drivers
        self._told: OrderedDict[str, list] = OrderedDict()  # driver -> [when told, refusals since]

    def strikes(self, requester: str, now: float | None = None) -> bool:
        """A non-excusable refusal of ``requester`` now: does it strike? (Not: this refusal tells it.)"""
        now = time.monotonic() if now is None else now
        told = self._told.get(requester)
        if told is not None and now - told[0] < WRONG_SHARD_HOLD_S:
            told[1] += 1
            return now - told[0] >= WRONG_SHARD_GRACE_S and told[1] > self.allowance
        self._told[requester] = [now, 1]
        self._told.move_to_end(requester)
        while len(self._told) > self.max_drivers:
            self._told.popitem(last=False)
        return False


class DriverView:
    """Online layer0 peers and their shards: the latest view and the one before it (a heartbeat's grace).

    A shard newly claimed (a driver joined, or moved to it) stays open to the others for ``claim_grace_s``
    after this view first saw it held: the drivers that covered it learn of the claim only at their own next
    read, and their micro-batches from it meanwhile are honest. Closing it at once refused them as
    ``wrong_shard`` and struck their senders: three drivers joining together banned each other at layer3
    for 60 s (the demo with ``--per-swarm 3`` stalled below its target)."""

    def __init__(self, claim_grace_s: float = 0.0) -> None:
        self.current: dict[str, int] = {}
        self.previous: dict[str, int] = {}
        self.draining: set[str] = set()  # paused or finishing drivers: their in-flight backward passes still count
        self.claim_grace_s = claim_grace_s
        self.held_since: dict[int, float] = {}  # shard -> when this view first saw it held (monotonic)

    @staticmethod
    def _online(records: Iterable[MemberRecord]) -> dict[str, int]:
        return {r.peer_id: r.shard for r in records if r.state == "online"}

    @staticmethod
    def _draining(records: Iterable[MemberRecord]) -> set[str]:
        return {r.peer_id for r in records if r.state in DRAINING_STATES}

    def update(self, records: Iterable[MemberRecord], now: float | None = None) -> None:
        """A new view from the heartbeat: the current one becomes the grace view."""
        records = list(records)
        self.previous, self.current = self.current, self._online(records)
        self.draining = self._draining(records)
        self._note_claims(time.monotonic() if now is None else now)

    def merge(self, records: Iterable[MemberRecord], now: float | None = None) -> None:
        """Records read on demand (an unknown requester): add them, drop nothing."""
        records = list(records)
        self.current = {**self.current, **self._online(records)}
        self.draining |= self._draining(records)
        self._note_claims(time.monotonic() if now is None else now)

    def _note_claims(self, now: float) -> None:
        held = {s for s in (*self.current.values(), *self.previous.values()) if s >= 0}
        self.held_since = {shard: self.held_since.get(shard, now) for shard in held}

    def knows(self, requester: str) -> bool:
        return requester in self.current or requester in self.previous

    def drivers(self) -> int:
        return len(set(self.current) | set(self.previous))

    def allowed(self, requester: str, num_shards: int, now: float | None = None, latest_only: bool = False) -> set[int]:
        """A shard is held if either view shows a driver on it: a record missing from one read (a late
        heartbeat, a DHT read that missed it) does not open that driver's shard to everyone. A claim younger
        than ``claim_grace_s`` does not close its shard yet (the class doc). ``latest_only``: the shards the
        latest view alone would allow (what a requester whose read also missed a record would cover)."""
        now = time.monotonic() if now is None else now
        both = self.current if latest_only else {**self.previous, **self.current}
        others = {peer: shard for peer, shard in both.items() if peer != requester
                  and now - self.held_since.get(shard, float("-inf")) >= self.claim_grace_s}
        own = {s % num_shards for s in (self.current.get(requester, -1), self.previous.get(requester, -1)) if s >= 0}
        return (allowed_shards(requester, others, num_shards)) | own


class LabelSource:
    """The run's targets by sample id, and which shard each train sample belongs to."""

    def __init__(self, y_train: torch.Tensor, y_test: torch.Tensor, shards: list[np.ndarray]):
        self.y_train = y_train
        self.y_test = y_test
        self.num_shards = len(shards)
        self.shard_of = np.full(len(y_train), -1, dtype=np.int64)
        for shard, members in enumerate(shards):
            self.shard_of[np.asarray(members, dtype=np.int64)] = shard

    @staticmethod
    def _check_ids(ids: torch.Tensor, batch: int, size: int, what: str) -> torch.Tensor:
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise ValueError(f"{what} ids must be a 1-D int64 tensor, got {tuple(ids.shape)} {ids.dtype}")
        if ids.shape[0] != batch:
            raise ValueError(f"{what} ids: batch of {ids.shape[0]} does not match the input's {batch}")
        if batch and (int(ids.min()) < 0 or int(ids.max()) >= size):
            raise ValueError(f"{what} ids out of range (the {what} split has {size} samples)")
        return ids

    def train_targets(self, ids: torch.Tensor, batch: int, allowed: set[int],
                      excusable: set[int] | None = None) -> torch.Tensor:
        """The targets of train ids, all from ``allowed`` shards; else WrongShard, excusable when every shard
        outside ``allowed`` is in ``excusable`` (open in the latest view alone)."""
        ids = self._check_ids(ids, batch, len(self.y_train), "train")
        shards = set(np.unique(self.shard_of[ids.numpy()]).tolist())
        outside = shards - allowed
        if outside:
            raise WrongShard(f"sample ids from shard(s) {sorted(outside)[:4]} that you may not use "
                             f"(yours or unheld: {sorted(allowed)[:8]})", excusable=outside <= (excusable or set()))
        return self.y_train[ids]

    def test_targets(self, ids: torch.Tensor, batch: int) -> torch.Tensor:
        return self.y_test[self._check_ids(ids, batch, len(self.y_test), "test")]
