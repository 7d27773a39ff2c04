"""Saved forward graphs at a stage: bounded in entries and time, with a fair share per driver.

A forward keeps its graph until the backward of the same micro-batch comes back (swarm/pipeline/stage/worker.py).
Entries are keyed by (driver, micro-batch id), so one driver can neither read nor replace another's
graph by guessing its ids. Each driver holds at most ``owner_cap`` entries (its own oldest go first),
and when the cache is full the oldest entry of the driver holding the most goes: a flood of forwards
from one peer evicts that peer's graphs, never the other drivers'.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch

from swarm.integrity.weights import STASHED_VERSIONS_MAX

CACHE_ENTRIES = 64
CACHE_TTL_S = 120.0
MIN_OWNER_ENTRIES = 8


@dataclass(slots=True)
class Saved:
    inputs: torch.Tensor
    outputs: torch.Tensor
    params: dict[str, torch.Tensor]
    created: float
    version: int = 0  # updates the stage had applied when this forward ran (its staleness is counted from it)
    weights: bytes = b"\0" * 16  # the digest of the weights it ran with (its backward's receipt names them too)
    stash: dict[str, torch.Tensor] | None = None  # the ring's view of those weights, held for the backward (weight
    # stashing: swarm/integrity/weights.py live_view): while held, nothing writes them


Key = tuple[str, str]  # (owner: the requesting driver, "" for local calls; micro-batch id)


def owner_cap(max_entries: int, drivers: int) -> int:
    """Entries one driver may hold: an equal share of the cache among the run's drivers, at least a few."""
    return max(MIN_OWNER_ENTRIES, max_entries // max(drivers, 1))


class ActivationCache:
    """Bounded LRU of forward graphs with a time limit (a driver that dies must not leak memory)."""

    def __init__(self, max_entries: int = CACHE_ENTRIES, ttl_s: float = CACHE_TTL_S):
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.owner_cap = max_entries
        self._items: OrderedDict[Key, Saved] = OrderedDict()
        self._owners: Counter[str] = Counter()

    def put(self, key: Key, saved: Saved) -> None:
        if key in self._items:
            self._drop(key)
        self._expire(saved.created)
        owner = key[0]
        if self._owners[owner] >= self.owner_cap:
            self._drop(next(k for k in self._items if k[0] == owner))
        self._items[key] = saved
        self._owners[owner] += 1
        while len(self._items) > self.max_entries:
            largest = self._owners.most_common(1)[0][0]
            self._drop(next(k for k in self._items if k[0] == largest))
        if saved.stash is not None:
            self._bound_stashed()

    def _bound_stashed(self) -> None:
        """At most STASHED_VERSIONS_MAX weight versions held by graphs: the oldest version's graphs go first. A forward
        whose backward never comes back ages, so a driver that floods forwards loses its own graphs before the young
        ones of drivers whose backwards return; what goes is recomputed from the re-sent input, never a penalty."""
        held = {id(s.stash): s.stash for s in self._items.values() if s.stash is not None}
        while len(held) > STASHED_VERSIONS_MAX:
            oldest = next(iter(held))
            for key in [k for k, s in self._items.items() if s.stash is not None and id(s.stash) == oldest]:
                self._drop(key)
            del held[oldest]

    def pop(self, key: Key, now: float) -> Saved | None:
        self._expire(now)
        if key not in self._items:
            return None
        saved = self._items[key]
        self._drop(key)
        return saved

    def held_by(self, owner: str) -> int:
        return self._owners[owner]

    def _drop(self, key: Key) -> None:
        del self._items[key]
        self._owners[key[0]] -= 1
        if self._owners[key[0]] <= 0:
            del self._owners[key[0]]

    def _expire(self, now: float) -> None:
        while self._items:
            key, oldest = next(iter(self._items.items()))
            if now - oldest.created <= self.ttl_s:
                return
            self._drop(key)

    def clear(self) -> None:
        self._items.clear()
        self._owners.clear()

    def __len__(self) -> int:
        return len(self._items)
