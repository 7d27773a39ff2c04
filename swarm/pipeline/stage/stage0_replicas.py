"""Stage 0's one service to others: recomputing its output from sample ids, for a layer1 peer's spot check.

A driver computes stage 0 on its own copy and its own data and signs that output; nothing but its word says the
output is stage 0's computation. Every volunteer has the whole data set on disk and inputs are looked up by id,
so any other layer0 peer can recompute it: a stage-1 peer sends ``infer [ids]`` (int64 rows of the TRAIN split)
to another layer0 peer and compares (swarm/pipeline/control/stage0_checks.py). Stage 0 still serves no one's training:
this op applies nothing, keeps nothing, and is served only

- to online layer1 peers of the same run (``set_callers``, from the node's views of layer1),
- within bounds, since a layer0 peer is a driver busy training: ``REPLICA_IN_FLIGHT_PER_PEER`` requests of one
  caller at once, ``REPLICA_IN_FLIGHT_TOTAL`` of all callers, and a token bucket of ``REPLICA_RATE_PER_S`` per
  caller (burst ``REPLICA_BURST``); over a bound the answer is ``busy`` (a check that gets it skips: no blame).

``ReplicaDoor`` is pure bookkeeping (tested without a network); the servicer (stage_rpc.py) computes the reply
on its compute thread in turn with the other requesters (fair_queue.py) and signs it like every other reply.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from swarm.integrity.requesters import Refusal
from swarm.pipeline.transport.wire import WireError

# An honest layer1 peer asks for share x its forwards, spread over the other drivers: at SPOT_SHARE (3 %) and
# 100 forwards/s that is 3 checks/s in all, each asking one or two drivers. A hostile caller gets no more than this.
REPLICA_RATE_PER_S = 4.0
REPLICA_BURST = 8.0
REPLICA_IN_FLIGHT_PER_PEER = 2
REPLICA_IN_FLIGHT_TOTAL = 4
REPLICA_RETRY_S = 0.5
MAX_CALLERS = 1024  # buckets kept; a caller no view lists any more is forgotten when it is refused
IDS_DTYPE = "<i8"


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


class ReplicaDoor:
    """Who may ask stage 0 to recompute, and how much. Not thread-safe: used on the RPC loop only."""

    def __init__(self, rate_per_s: float = REPLICA_RATE_PER_S, burst: float = REPLICA_BURST,
                 per_peer: int = REPLICA_IN_FLIGHT_PER_PEER, total: int = REPLICA_IN_FLIGHT_TOTAL):
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.per_peer = per_peer
        self.total = total
        self.callers: frozenset[str] = frozenset()
        self._buckets: dict[str, _Bucket] = {}
        self._in_flight: Counter[str] = Counter()
        self.served = 0  # replicas computed
        self.refused = 0  # requests refused at the door
        self.compute_s = 0.0  # seconds of our compute thread they took (their cost to our driver)

    def set_callers(self, peer_ids: Iterable[str]) -> None:
        """The online layer1 peers of the run, as last read."""
        self.callers = frozenset(peer_ids)
        if len(self._buckets) > MAX_CALLERS:
            self._buckets = {p: b for p, b in self._buckets.items() if p in self.callers}

    def admit(self, requester: str, now: float) -> Refusal | None:
        """None: serve it (and call ``finished`` after); else the refusal to answer."""
        refusal = self._refusal(requester, now)
        if refusal is not None:
            self.refused += 1
            return refusal
        self._in_flight[requester] += 1
        return None

    def _refusal(self, requester: str, now: float) -> Refusal | None:
        if requester not in self.callers:
            return Refusal("unknown_peer", "stage 0 recomputes its output only for online layer1 peers of this run",
                           REPLICA_RETRY_S * 4)
        if self._in_flight[requester] >= self.per_peer or sum(self._in_flight.values()) >= self.total:
            return Refusal("busy", "this driver is recomputing enough stage-0 outputs for others now", REPLICA_RETRY_S)
        bucket = self._buckets.get(requester) or _Bucket(self.burst, now)
        bucket.tokens = min(self.burst, bucket.tokens + max(0.0, now - bucket.at) * self.rate_per_s)
        bucket.at = now
        self._buckets[requester] = bucket
        if bucket.tokens < 1.0:
            return Refusal("busy", f"more than {self.rate_per_s:g} stage-0 recomputations a second asked of this "
                           "driver", (1.0 - bucket.tokens) / self.rate_per_s)
        bucket.tokens -= 1.0
        return None

    def finished(self, requester: str, compute_s: float, served: bool) -> None:
        self._in_flight[requester] -= 1
        if self._in_flight[requester] <= 0:
            del self._in_flight[requester]
        if served:
            self.served += 1
            self.compute_s += compute_s

    def stats(self) -> dict[str, float]:
        return {"served": self.served, "refused": self.refused, "compute_s": round(self.compute_s, 4)}


@dataclass(slots=True)
class ReplicaService:
    """What stage 0 needs to recompute: the door, and its inputs by train-split row."""

    door: ReplicaDoor
    lookup: Callable[[torch.Tensor], torch.Tensor]  # train-split rows -> stage 0's input
    n_train: int
    max_batch: int

    def check_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return check_train_ids(ids, self.n_train, self.max_batch)


def check_train_ids(ids: torch.Tensor, n_train: int, max_batch: int) -> torch.Tensor:
    """Sample ids as a stranger sends them: int64, one dimension, 1..max_batch of them, rows of the train split."""
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
        raise WireError("sample ids: expected a one-dimensional int64 tensor")
    if not 0 < ids.shape[0] <= max_batch:
        raise WireError(f"sample ids: {ids.shape[0]} of them, expected 1..{max_batch}")
    if int(ids.min()) < 0 or int(ids.max()) >= n_train:
        raise WireError(f"sample ids: outside the train split's 0..{n_train - 1}")
    return ids


def ids_bytes(ids: torch.Tensor | np.ndarray) -> bytes:
    """Sample ids as a forward at stage 1 carries them in its metadata (``ids``): int64 little-endian."""
    return np.ascontiguousarray(np.asarray(ids, dtype=IDS_DTYPE)).tobytes()


def ids_from_meta(raw: object, batch: int) -> torch.Tensor:
    """The ``ids`` of a forward's metadata: ``batch`` int64 values, or WireError."""
    if not isinstance(raw, bytes) or len(raw) != 8 * batch:
        raise WireError(f"a forward at layer1 carries its {batch} sample ids in 'ids' (int64 little-endian bytes)")
    return torch.from_numpy(np.frombuffer(raw, dtype=IDS_DTYPE).astype(np.int64))
