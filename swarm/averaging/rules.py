"""The decisions of averaging, exchange, sync and the edge modes' graph: plain functions and small
bookkeeping classes.

No networking, no threads, no clocks of their own (callers pass ``now``), so every rule is tested
without a network. The interpolation itself and the clock merge reuse ``swarm.ecl.gossip`` (the
simulator's Dpwa), so the simulated and the networked swarm follow the same math.

Interpolation (Dpwa): ``p <- f * peer + (1 - f) * p`` with
    constant  f = constant_factor
    clock     f = peer_clock / (clock + peer_clock)            (0.5 when neither has trained)
    loss      f = loss / (loss + peer_loss)                    (constant_factor while a loss is unknown)
then the divergence rule: when ``divergence_threshold > 0`` and our loss is below it,
``f *= loss / divergence_threshold`` (a well-trained copy moves less). The clock merges the same
way: ``clock <- f * peer_clock + (1 - f) * clock``.

Peer choice for a pull (flow control): every peer has a score, 0 when first seen. A pull that
succeeds adds ``SCORE_SUCCESS`` (capped at ``SCORE_MAX``), a refusal (busy, syncing) adds
``SCORE_REFUSAL``, a timeout or broken transfer adds ``SCORE_TIMEOUT`` (floored at ``SCORE_MIN``);
scores decay toward 0 with a half-life of ``SCORE_HALF_LIFE_S``, so a peer that failed long ago is
tried again. The chosen peer maximises ``score + uniform(0, RANDOM_SPAN)``: healthy peers (scores
between 0 and 1) share the pulls almost evenly, which is what mixing needs, while a peer that just
timed out (-3) is skipped until its score has decayed to within ``RANDOM_SPAN`` of the others.
A peer whose pulls fail in a row also *rests*: it is not chosen for ``REST_S`` after its first failure, doubling per
failure up to ``MAX_REST_S`` and over on its next success. Scores alone left a swarm's only other member chosen at
every draw: a peer that announces the swarm but serves no parameters (another version, a stranger) drew ~8 failed
pulls a second, each a dial and a log line (benchmarks.adversary, session 27).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field

from swarm.ecl.gossip import clock_factor, draw_candidates, exchange_winner, merged_clock
from swarm.dht.records import MemberRecord
from swarm.run.runconfig import AveragingConfig

__all__ = [
    "BanList", "FlowControl", "donor_order", "edge_graph_members", "exchange_candidates", "exchange_winner",
    "interpolation_factor", "merged_clock", "pull_candidates", "should_pull",
]

SCORE_SUCCESS = 1.0
SCORE_REFUSAL = -1.0
SCORE_TIMEOUT = -3.0
SCORE_MAX = 1.0
SCORE_MIN = -10.0
SCORE_HALF_LIFE_S = 60.0
REST_S = 1.0  # a peer whose pull failed is not chosen this long, doubling while its pulls keep failing
MAX_REST_S = 60.0
RANDOM_SPAN = 2.0
DONOR_TOP_K = 3  # newcomers pick a random donor among the k most trained peers, spreading the load
SERVING_STATES = frozenset({"online"})
GRAPH_STATES = frozenset({"online"})  # the edge modes' graph: peers that train, hence step and send


# ----- interpolation
def interpolation_factor(cfg: AveragingConfig, *, clock: float, peer_clock: float, loss: float | None,
                         peer_loss: float | None) -> float:
    """The weight ``f`` of the peer's copy in ``p <- f * peer + (1 - f) * p`` (see the module doc)."""
    if cfg.interpolation == "clock":
        factor = clock_factor(max(0.0, clock), max(0.0, peer_clock))
    elif cfg.interpolation == "loss" and _known(loss) and _known(peer_loss) and loss + peer_loss > 0:
        factor = loss / (loss + peer_loss)
    else:
        factor = cfg.constant_factor
    return divergence_scaled(factor, loss, cfg.divergence_threshold)


def divergence_scaled(factor: float, loss: float | None, threshold: float) -> float:
    """``f * loss / threshold`` when our loss is below a positive threshold, else ``f``."""
    if threshold > 0 and _known(loss) and loss < threshold:
        return factor * loss / threshold
    return factor


def _known(loss: float | None) -> bool:
    return loss is not None and math.isfinite(loss) and loss >= 0


def should_pull(rng: random.Random, fetch_probability: float) -> bool:
    """One draw per training step: start a pull with probability ``fetch_probability`` (0 never pulls)."""
    return fetch_probability > 0 and rng.random() < fetch_probability


def budget_allows(now: float, last_end: float | None, last_duration_s: float, budget: float) -> bool:
    """``averaging.pull_budget``: whether another pull fits, besides ``should_pull``'s draws. Pulls may take
    ``budget`` of the wall time: the next one starts once the last one's duration x (1 / budget - 1) has
    passed since it ended (at once before the first). 0 or less: never (only the draws pull)."""
    if budget <= 0:
        return False
    if last_end is None:
        return True
    return now - last_end >= last_duration_s * (1.0 / min(budget, 0.99) - 1.0)


# ----- flow control
@dataclass(slots=True)
class _Score:
    value: float = 0.0
    at: float = 0.0


@dataclass(slots=True)
class FlowControl:
    """Flow-control scores of the peers we pull from (the rule is in the module doc)."""

    scores: dict[str, _Score] = field(default_factory=dict)
    resting: dict[str, tuple[float, int]] = field(default_factory=dict)  # peer -> (until, failures in a row)

    def score(self, peer: str, now: float) -> float:
        entry = self.scores.get(peer)
        if entry is None:
            return 0.0
        return entry.value * 0.5 ** (max(0.0, now - entry.at) / SCORE_HALF_LIFE_S)

    def _add(self, peer: str, delta: float, now: float) -> float:
        value = min(SCORE_MAX, max(SCORE_MIN, self.score(peer, now) + delta))
        self.scores[peer] = _Score(value, now)
        return value

    def success(self, peer: str, now: float) -> float:
        self.resting.pop(peer, None)
        return self._add(peer, SCORE_SUCCESS, now)

    def refusal(self, peer: str, now: float) -> float:
        return self._add(peer, SCORE_REFUSAL, now)

    def timeout(self, peer: str, now: float) -> float:
        """A pull that failed (timed out, broke, or found no one serving): the peer rests (module doc)."""
        failures = self.resting.get(peer, (0.0, 0))[1] + 1
        if len(self.resting) > 4096:  # strangers' keys: the oldest rests are forgotten first
            for forgotten in sorted(self.resting, key=lambda p: self.resting[p][0])[:1024]:
                del self.resting[forgotten]
        self.resting[peer] = (now + min(MAX_REST_S, REST_S * 2 ** (failures - 1)), failures)
        return self._add(peer, SCORE_TIMEOUT, now)

    def rests(self, peer: str, now: float) -> bool:
        return self.resting.get(peer, (0.0, 0))[0] > now

    def choose(self, candidates: Iterable[str], now: float, rng: random.Random) -> str | None:
        best, best_key = None, -math.inf
        for peer in sorted(candidates):
            if self.rests(peer, now):
                continue
            key = self.score(peer, now) + rng.uniform(0.0, RANDOM_SPAN)
            if key > best_key:
                best, best_key = peer, key
        return best


@dataclass(slots=True)
class BanList:
    """Peers we do not pull from until a time (they served bad parameters)."""

    until: dict[str, float] = field(default_factory=dict)

    def ban(self, peer: str, now: float, duration_s: float) -> None:
        self.until[peer] = max(self.until.get(peer, 0.0), now + duration_s)

    def active(self, now: float) -> set[str]:
        for peer in [p for p, t in self.until.items() if t <= now]:
            del self.until[peer]
        return set(self.until)


def pull_candidates(records: Sequence[MemberRecord], me: str, excluded: set[str]) -> list[str]:
    """Online peers of our swarm we may pull from."""
    return [r.peer_id for r in records if r.state in SERVING_STATES and r.peer_id != me and r.peer_id not in excluded]


# ----- newcomers
def donor_order(records: Sequence[MemberRecord], me: str, rng: random.Random, top_k: int = DONOR_TOP_K) -> list[str]:
    """Whom a newcomer asks for the layer, in order: a random order of the ``top_k`` most trained
    online peers (so simultaneous newcomers spread over donors), then the rest by clock."""
    ranked = sorted((r for r in records if r.state in SERVING_STATES and r.peer_id != me),
                    key=lambda r: (-r.clock, r.peer_id))
    head = [r.peer_id for r in ranked[:top_k]]
    rng.shuffle(head)
    return head + [r.peer_id for r in ranked[top_k:]]


# ----- best-model exchange
def exchange_candidates(records: Sequence[MemberRecord], me: str, excluded: set[str], rng: random.Random,
                        count: int) -> list[str]:
    """Whose copies we pull and score at an exchange: ``count`` online peers drawn at random.

    Never chosen by their reported loss: under label-skewed shards the lowest training loss belongs to
    the peer with the easiest shard, not the best copy, and a stranger can report anything. Drawing at
    random lets every copy be scored in turn, and a liar costs one pull and one scoring at most.
    """
    return draw_candidates(pull_candidates(records, me, excluded), rng, count)


# ----- the edge modes' graph
def edge_graph_members(last_seen: Mapping[str, float], listed: Mapping[str, str], unreachable: Set[str], now: float,
                       grace_s: float) -> dict[str, float]:
    """Who stays in an edge mode's graph (edges.py), each with when its record last said it trains.

    ``listed``: peer id -> state from the newest records of the swarm. A peer whose record says it
    stopped training (paused, offline) leaves at once, and so does one whose record is missing while
    our last message to it failed (a crash); one whose record is only missing (a late heartbeat on a
    loaded machine) stays for ``grace_s``, so a slow heartbeat does not reset its edges.
    """
    seen = dict(last_seen)
    seen.update({peer: now for peer, state in listed.items() if state in GRAPH_STATES})
    kept = {}
    for peer, seen_at in seen.items():
        said_so = peer in listed and listed[peer] not in GRAPH_STATES
        crashed = peer not in listed and peer in unreachable  # its record and our messages fail
        if not (said_so or crashed or now - seen_at > grace_s):
            kept[peer] = seen_at
    return kept
