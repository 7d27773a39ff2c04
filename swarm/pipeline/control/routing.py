"""Which peer of a swarm gets the next hop, and how long to wait for it: choice, bans, holds, timeouts.

Pure bookkeeping over peer ids and measured service times (no networking), so it is tested
without processes. The driver feeds it the online peers from the DHT records, reports each hop's
outcome, and asks it for a peer, a timeout and a hedge delay.

- Choice: the peer expected to finish soonest. A peer never measured is tried early, but one probe
  at a time, and a peer with failures in a row is expected to take a whole first-contact timeout
  per failure: a peer that accepts connections and never answers (a black hole) stops being
  attractive after its first timeout.
- Timeouts: ``clamp(hop_timeout_factor x p95, floor, rpc_s)`` of the swarm's recent service times of
  that op; ``first_contact_s`` for a peer never measured; each timeout of the op in a row doubles it.
- Bans (our judgement: failures, bad replies) are soft: if every peer is banned the least bad is used.
  Holds (the peer's own ``retry_after_s``: busy, banned, unknown_driver) are hard: never before.
- Newcomers together (with ``established``: the driver's spot-check credit, swarm/pipeline/control/spot_checks.py): while a
  peer with validated work here is usable, peers without it get at most NEWCOMER_ROUTE_SHARE of the swarm's recent
  hops, however many they are. The fastest peer used to get every hop, so fresh keys that answer fast (identities
  cost a second of CPU) carried most of the traffic until each was caught; now they carry a quarter while they earn
  credit (every check of their hops that agrees), and then compete on speed like anyone.
- Re-measurement: a peer's speed is known only from the hops it gets, so one slow first answer (a cold start, a busy
  second) used to leave it out for good while faster peers had hops queued. A training hop goes to a usable peer
  that has not had one for REMEASURE_S (twice as long per hedge lost or failure in a row) as if it were new: one
  probe, whose answer replaces the old measurement.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

SERVICE_EMA_ALPHA = 0.2
BAN_BASE_S = 1.0  # first ban after a failure; doubles per consecutive failure
BAN_MAX_S = 30.0
BAD_REPLY_BAN_S = 60.0  # a malformed reply is worse than a dropped connection
HOLD_MAX_S = 300.0  # a peer's retry_after_s is honoured up to this (it comes from a stranger)
RETRY_BASE_S = 0.05  # driver's wait before a retry; doubles per attempt
RETRY_MAX_S = 2.0
SERVICE_WINDOW = 64  # recent service times per op the timeouts are taken from
MIN_SAMPLES_FOR_P95 = 3
NEWCOMER_ROUTE_SHARE = 0.25  # of a swarm's recent hops, the most its peers without validated work here get...
ROUTE_WINDOW = 32  # ...over this many hops, while a peer with validated work is usable
REMEASURE_S = 30.0  # a usable peer without a training hop for this long gets one, to measure it again...
REMEASURE_MAX_S = 480.0  # ...doubling per hedge lost or failure in a row (a black hole: ever more rarely)


@dataclass(slots=True, frozen=True)
class HopPolicy:
    """The timeout knobs (TimeoutsConfig), as plain numbers."""

    rpc_s: float = 30.0
    timeout_factor: float = 4.0
    timeout_floor_s: float = 1.0
    first_contact_s: float = 5.0
    hedge_factor: float = 2.5

    @classmethod
    def from_config(cls, timeouts) -> "HopPolicy":
        return cls(rpc_s=timeouts.rpc_s, timeout_factor=timeouts.hop_timeout_factor,
                   timeout_floor_s=timeouts.hop_timeout_floor_s, first_contact_s=timeouts.first_contact_s,
                   hedge_factor=timeouts.hedge_factor)


@dataclass(slots=True)
class PeerStats:
    service_ema_s: float | None = None  # None: never measured
    in_flight: int = 0
    failures: int = 0  # consecutive
    banned_until: float = 0.0
    held_until: float = 0.0  # the peer asked us not to come back before this
    abandoned: int = 0  # hedged requests in a row it had not answered when another peer had
    # a ban on evidence of a wrong tensor (a failed spot check, a tensor a stage refused as its author's): an answer
    # that lands afterwards (a hop that was in flight) lifts a ban for failures, never this one
    convicted_until: float = 0.0
    # proven: our referee's recomputation convicted it: nothing it computes can be used, so it is not chosen even as
    # the last peer of its swarm (``choose``); a neighbour's word (a refused tensor, "I banned its author") is not
    # proof here: a hostile middle stage could say it of an honest lone last stage and stall its swarm
    proven_until: float = 0.0
    last_hop_at: float | None = None  # when it last got a training hop (before its first: when first seen)


@dataclass(slots=True)
class SwarmRouter:
    """Peer choice and timeouts for one swarm."""

    policy: HopPolicy = field(default_factory=HopPolicy)
    peers: dict[str, PeerStats] = field(default_factory=dict)
    rng: random.Random = field(default_factory=random.Random)
    service_s: dict[str, deque] = field(default_factory=dict)  # op -> recent successful service times
    timeouts_in_row: dict[str, int] = field(default_factory=dict)  # op -> consecutive timeouts
    established: Callable[[str], bool] | None = None  # has the peer validated work here (None: nobody is told)
    recent: deque = field(default_factory=lambda: deque(maxlen=ROUTE_WINDOW))  # per recent hop: to a newcomer?

    def set_peers(self, peer_ids: Iterable[str]) -> None:
        """The online peers from the latest records; stats of peers that stay are kept."""
        current = set(peer_ids)
        self.peers = {pid: self.peers.get(pid, PeerStats()) for pid in sorted(current)}

    def add_peer(self, peer_id: str) -> None:
        self.peers.setdefault(peer_id, PeerStats())

    # ----- choice
    def choose(self, now: float, exclude: Iterable[str] = (), *, hop: bool = False) -> str | None:
        """The peer expected to finish the hop soonest; None if there is none, or every one holds us off.
        Bans are ignored if every peer that does not hold us off is banned, a proven conviction's never: its
        neighbours refuse a proven convict's tensors (the evidence is sent to them), so a lone one would apply updates
        nobody can use (a full test
        run lost 6,831 micro-batches that way); we wait instead (``proven_only``). ``hop``: a training hop, whose
        share going to newcomers is bounded (NEWCOMER_ROUTE_SHARE); spot checks and hedges choose freely."""
        excluded = set(exclude)
        free = [pid for pid, stats in self.peers.items() if stats.held_until <= now]
        candidates = [pid for pid in free if pid not in excluded] or free
        usable = [pid for pid in candidates if self.peers[pid].banned_until <= now] or \
            [pid for pid in candidates if self.peers[pid].proven_until <= now]
        if not usable:
            return None
        bounded = hop and self.established is not None
        if bounded:
            usable = self._newcomers_bounded(usable)
        if hop:
            for pid in candidates:
                if self.peers[pid].last_hop_at is None:
                    self.peers[pid].last_hop_at = now
        peer = min(usable, key=lambda pid: (self.expected_s(pid, now if hop else None), self.rng.random()))
        if hop:
            stats = self.peers[peer]
            if self._stale(stats, now):
                stats.service_ema_s = None  # a probe: its answer is the new measurement, not one more in an average
            stats.last_hop_at = now
        if bounded:
            self.recent.append(not self.established(peer))
        return peer

    def _newcomers_bounded(self, usable: list[str]) -> list[str]:
        """``usable`` without the newcomers when one more hop to them would pass their share of the recent hops and
        a peer with validated work is usable (never fewer peers to choose from than that: no stall)."""
        seniors = [pid for pid in usable if self.established(pid)]
        if not seniors or len(seniors) == len(usable):
            return usable
        if (sum(self.recent) + 1) / (len(self.recent) + 1) <= NEWCOMER_ROUTE_SHARE:
            return usable
        return seniors

    def hedge_to(self, now: float, first: str) -> str | None:
        """A second peer for a request ``first`` is slow to answer, or None. Never one set aside (banned for failures
        or a hedge it lost), holding us off, or whose last request failed: a hedge is optional, and where that peer
        is the only other one (``choose`` ignores bans then, so that a hop never stalls) it only added a request that
        hangs: a black hole beside one slow honest peer got one per slow hop on a loaded machine."""
        peer = self.choose(now, exclude=[first])
        return peer if peer is not None and peer != first and self.may_ask(peer, now) else None

    def may_ask(self, peer_id: str, now: float) -> bool:
        """Optional work (a hedge, a spot check's second copy) may go to this peer: it is not set aside (banned for
        failures or a lost hedge), not holding us off, and its last request did not fail."""
        stats = self.peers.get(peer_id)
        return stats is not None and stats.banned_until <= now and stats.held_until <= now and not stats.failures

    def proven_only(self, now: float) -> bool:
        """Peers exist, and every one is proven to have computed a wrong tensor (``PeerStats.proven_until``)."""
        return bool(self.peers) and all(stats.proven_until > now for stats in self.peers.values())

    def free_at(self) -> float | None:
        """When the first peer that holds us off takes us again (None: no peer, or one is free)."""
        if not self.peers:
            return None
        return min(stats.held_until for stats in self.peers.values())

    def expected_s(self, peer_id: str, now: float | None = None) -> float:
        """Seconds until the peer would finish one more hop. With ``now`` (a training hop's choice): a peer whose
        measurement is stale (no hop for REMEASURE_S, doubled per hedge lost or failure in a row) and that has
        nothing in flight counts as unmeasured (0 s: one probe)."""
        stats = self.peers[peer_id]
        if stats.abandoned and stats.in_flight:  # it left its last hedged hop unanswered: one probe at a time
            return float("inf")
        if now is not None and self._stale(stats, now):
            return 0.0
        if stats.service_ema_s is not None:
            return stats.service_ema_s * (stats.in_flight + 1)
        # never measured: tried early (0 s), but one probe at a time, and not again soon after it failed
        return self.policy.first_contact_s * (stats.in_flight + stats.failures)

    @staticmethod
    def _stale(stats: PeerStats, now: float) -> bool:
        if stats.service_ema_s is None or stats.in_flight or stats.last_hop_at is None:
            return False
        misses = min(stats.abandoned + stats.failures, 8)
        return now - stats.last_hop_at >= min(REMEASURE_MAX_S, REMEASURE_S * 2**misses)

    # ----- timeouts
    def p95_s(self, op: str) -> float | None:
        times = self.service_s.get(op)
        if not times or len(times) < MIN_SAMPLES_FOR_P95:
            return None
        ordered = sorted(times)
        return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]

    def timeout_s(self, op: str, peer_id: str) -> float:
        """How long to wait for ``op`` at ``peer_id`` before trying elsewhere."""
        p = self.policy
        p95 = self.p95_s(op)
        stats = self.peers.get(peer_id)
        if p95 is None or stats is None or stats.service_ema_s is None:
            base = p.first_contact_s if p95 is None else max(p.first_contact_s, p.timeout_factor * p95)
        else:
            base = max(p.timeout_floor_s, p.timeout_factor * p95)
        return min(p.rpc_s, base * 2 ** min(self.timeouts_in_row.get(op, 0), 8))

    def hedge_after_s(self, op: str, peer_id: str) -> float:
        """When a second peer gets the same update-free request: ``hedge_factor`` x the expected time
        (half the first-contact timeout while the swarm has no measurement of ``op``)."""
        p = self.policy
        timeout_s = self.timeout_s(op, peer_id)
        p95 = self.p95_s(op)
        if p95 is None:
            return min(timeout_s, p.first_contact_s / 2)
        stats = self.peers.get(peer_id)
        expected = p95 if stats is None or stats.service_ema_s is None else max(stats.service_ema_s, p95 / 2)
        return min(timeout_s, max(p.timeout_floor_s / 2, p.hedge_factor * expected))

    # ----- outcomes
    def begin(self, peer_id: str) -> None:
        self.peers.setdefault(peer_id, PeerStats()).in_flight += 1

    def end(self, peer_id: str) -> None:
        stats = self.peers.get(peer_id)
        if stats is not None and stats.in_flight > 0:
            stats.in_flight -= 1

    def success(self, peer_id: str, service_s: float, op: str = "") -> None:
        stats = self.peers.setdefault(peer_id, PeerStats())
        stats.failures = 0
        stats.abandoned = 0
        stats.banned_until = stats.convicted_until  # past or a conviction's: never lifted by an answer
        self._observe(stats, service_s)
        if op:
            self.service_s.setdefault(op, deque(maxlen=SERVICE_WINDOW)).append(service_s)
            self.timeouts_in_row[op] = 0

    def slow(self, peer_id: str, waited_s: float, now: float | None = None) -> None:
        """A hedged request this peer had not answered after ``waited_s`` when another peer had: at least that
        slow, and (with ``now``) set aside for a while that doubles per such loss in a row, until it answers
        once. Without that a peer that accepts requests and never answers (a black hole) looked only
        ``hedge_factor`` x slower than the others, and under load, when the fast peers' queues made them look
        slower than that, it got a share of the hops again, each costing a hedge delay (a soft ban: it is
        local routing, never a penalty, and is ignored if every peer is set aside)."""
        stats = self.peers.get(peer_id)
        if stats is None:
            return
        self._observe(stats, max(waited_s, stats.service_ema_s or 0.0))
        if now is not None:
            stats.abandoned += 1
            aside_s = min(BAN_MAX_S, BAN_BASE_S * 2 ** min(stats.abandoned - 1, 8))
            stats.banned_until = max(stats.banned_until, now + aside_s)

    def failure(self, peer_id: str, now: float, min_ban_s: float = 0.0, *, convicted: bool = False,
                proven: bool = False) -> float:
        """Ban the peer for a while (exponential in consecutive failures); returns the ban in seconds.
        ``convicted``: on evidence of a wrong tensor, a ban its later answers do not lift; ``proven``: our referee's
        conviction by recomputation, which even a swarm without another peer does not lift (PeerStats)."""
        stats = self.peers.setdefault(peer_id, PeerStats())
        stats.failures += 1
        ban_s = max(min_ban_s, min(BAN_MAX_S, BAN_BASE_S * 2 ** (stats.failures - 1)))
        stats.banned_until = max(stats.banned_until, now + ban_s)
        if convicted or proven:
            stats.convicted_until = max(stats.convicted_until, now + ban_s)
        if proven:
            stats.proven_until = max(stats.proven_until, now + ban_s)
        return ban_s

    def timed_out(self, peer_id: str, op: str, now: float) -> float:
        """A hop that got no answer in time: a failure, and the next timeout of this op is longer
        (if the whole swarm is slower than measured, the timeouts catch up)."""
        self.timeouts_in_row[op] = self.timeouts_in_row.get(op, 0) + 1
        return self.failure(peer_id, now)

    def hold(self, peer_id: str, now: float, retry_after_s: float) -> float:
        """The peer asked us to come back after ``retry_after_s`` (clamped: it is a stranger's number)."""
        wait_s = min(HOLD_MAX_S, max(0.0, retry_after_s))
        stats = self.peers.setdefault(peer_id, PeerStats())
        stats.held_until = max(stats.held_until, now + wait_s)
        return wait_s

    @staticmethod
    def _observe(stats: PeerStats, service_s: float) -> None:
        ema = stats.service_ema_s
        stats.service_ema_s = service_s if ema is None else (1 - SERVICE_EMA_ALPHA) * ema + SERVICE_EMA_ALPHA * service_s


def retry_delay_s(attempt: int) -> float:
    """Capped exponential backoff before retry number ``attempt`` (0-based)."""
    return min(RETRY_MAX_S, RETRY_BASE_S * 2**attempt)


def backoff_s(streak: int, base_s: float, max_s: float) -> float:
    """Capped exponential backoff after ``streak`` (>= 1) refusals in a row."""
    return min(max_s, base_s * 2 ** max(0, min(streak - 1, 30)))
