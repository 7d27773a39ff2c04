"""Live rebalancing of `--swarm auto` volunteers toward the bottleneck swarm (pure decisions).

The pipeline runs at the pace of its slowest swarm: every sample passes every layer, so the run's
throughput is the smallest, over swarms, of the summed capacity (samples/s) of the peers serving it.
Placing a volunteer once, at join (``least_served_swarm``), goes stale as peers leave, join and differ
in speed; SWARM parallelism (Ryabinin et al. 2023) measured 82.7 % of optimal throughput without
rebalancing and 95.8 % with it.

The rule, run by each auto volunteer once per period with the records it has read:

- The *level* is what every swarm would have if capacity were spread evenly: total / number of swarms.
  A swarm is *short* when it lies more than ``hysteresis`` below the level (a swarm a little short is
  not worth a download); the bottleneck, the swarm with the least capacity, is the shortest.
- Many peers read the same records at about the same time, and they must not all move. A donor swarm
  (one above the level) sends its share of the short swarms' deficit, never more than its surplus, as
  whole peers: the first ``round(share / its mean peer capacity)`` (at least one) of its movable peers
  in ``mover_order``, a hash of (peer id, period) that every reader computes alike and that changes
  each period. Each mover takes the next slice of the share, and the slices are laid over the short
  swarms by what each lacks, largest first.
- A mover goes only if both swarms end above where the target was (a fast peer must not turn its own
  swarm into the new bottleneck), and only if at least ``min_peers`` peers stay behind.
- Peers on their way (``joining``/``syncing``) count in the swarm they are entering, so the next
  period does not send more; the node acts at a random time in the period (``decision_delay_s``), so a
  later decider sees earlier movers' records.

Capacities are samples/s through one swarm's layer; layers of different cost are compared through
``cost`` (compute per sample, relative): a peer with capacity c in a layer of cost k has c x k / k'
in a layer of cost k'. Without costs every layer counts the same.
"""

from __future__ import annotations

import hashlib
import random
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class RebalancePolicy:
    period_s: float = 60.0  # how often an auto volunteer reconsiders its swarm
    hysteresis: float = 0.05  # move only toward a swarm this fraction below the even level
    min_peers: int = 1  # never leave a swarm with fewer peers than this
    jitter: float = 1.0  # the decision waits uniform(0, jitter x period_s) into the period


@dataclass(frozen=True, slots=True)
class Move:
    target: str
    movers: int  # how many of this swarm's peers move this period (this one among them)
    gain: float  # the pipeline's minimum after the move over before, if this peer alone moved


@dataclass(frozen=True, slots=True)
class SwarmLoad:
    """What the records say of one swarm: its peers' summed capacity (samples/s) and how many they are."""

    capacity: float
    peers: int


SERVING_OR_ARRIVING = frozenset({"online", "joining", "syncing", "healing"})
MAX_TIMES_MEDIAN = 16.0  # a published capacity counts at most this many times the run's median


def _members(views: Mapping[str, Sequence[Any]], names: Sequence[str], me: str,
             my_capacity: float | None) -> tuple[dict[str, list[Any]], dict[str, list[float]], float]:
    """Each swarm's records that serve or arrive (ours left out), each swarm's published capacities
    clamped to ``MAX_TIMES_MEDIAN`` x the run's median, and that median (1 where nobody has a figure)."""
    members = {name: [r for r in views.get(name, ()) if r.state in SERVING_OR_ARRIVING and r.peer_id != me]
               for name in names}
    known = [r.capacity for records in members.values() for r in records if r.capacity > 0]
    if my_capacity is not None and my_capacity > 0:
        known.append(my_capacity)
    run_typical = statistics.median(known) if known else 1.0
    ceiling = MAX_TIMES_MEDIAN * run_typical  # a stranger's figure weighs at most this much
    figures = {name: [min(r.capacity, ceiling) for r in members[name] if r.capacity > 0] for name in names}
    return members, figures, run_typical


def loads_from_records(views: Mapping[str, Sequence[Any]], names: Sequence[str], *, me: str = "",
                       my_swarm: str = "", my_capacity: float | None = None) -> dict[str, SwarmLoad]:
    """Each swarm's load from its membership records: peers serving or arriving, each at its published
    ``capacity``, at most ``MAX_TIMES_MEDIAN`` x the run's median (a record is a stranger's word: one
    liar weighs as much as that many typical peers, not as a swarm); one without a figure (a newcomer, an
    old client) counts as its swarm's median, or the run's where the swarm has none, or 1 where nobody
    has one (then loads are peer counts). With ``me``, our own record is replaced by ``my_capacity`` in
    ``my_swarm``."""
    members, figures, run_typical = _members(views, names, me, my_capacity)
    loads = {}
    for name in names:
        typical = statistics.median(figures[name]) if figures[name] else run_typical
        unmeasured = sum(1 for r in members[name] if r.capacity <= 0)
        total, count = sum(figures[name]) + unmeasured * typical, len(members[name])
        if me and name == my_swarm:
            total += my_capacity if my_capacity is not None and my_capacity > 0 else typical
            count += 1
        loads[name] = SwarmLoad(float(total), count)
    return loads


def layer_costs(views: Mapping[str, Sequence[Any]], names: Sequence[str]) -> dict[str, float]:
    """Each layer's compute per sample relative to the run's, estimated from the records: a swarm whose
    peers publish half the run's median capacity holds a layer that costs twice as much (peers differ,
    but a swarm's median over peers is a fair proxy). 1 for a swarm with no figure. The figures are the
    clamped ones of ``loads_from_records``, so a liar moves a cost at most 16x. ``plan_move`` uses it
    to convert a mover's capacity into the target layer's samples/s."""
    _, figures, _ = _members(views, names, "", None)
    medians = {name: statistics.median(found) for name, found in figures.items() if found}
    if not medians:
        return {name: 1.0 for name in names}
    typical = statistics.median(medians.values())
    return {name: typical / medians[name] if name in medians else 1.0 for name in names}


def mover_order(peer_ids: Iterable[str], epoch: int) -> list[str]:
    """The order in which a swarm's movable peers volunteer to move in one rebalance period: a hash of
    (peer id, period), so every peer that reads the same records agrees on it and it changes each period."""
    def key(peer_id: str) -> bytes:
        return hashlib.sha256(f"{peer_id}/{epoch}".encode()).digest()

    return sorted(peer_ids, key=key)


def plan_move(loads: Mapping[str, SwarmLoad], mine: str, my_capacity: float, rank: int,
              policy: RebalancePolicy = RebalancePolicy(), cost: Mapping[str, float] | None = None) -> Move | None:
    """Where this volunteer should move now, or None to stay.

    ``loads``: every swarm's load, this peer counted in ``mine`` and peers on their way into a swarm
    counted in it; capacities are samples/s through each swarm's own layer. ``rank``: this peer's place
    in ``mover_order`` among its swarm's movable peers. O(swarms) per call.
    """
    if mine not in loads or len(loads) < 2 or my_capacity <= 0 or rank < 0:
        return None
    if loads[mine].peers <= policy.min_peers:
        return None
    k = {name: (cost or {}).get(name, 1.0) for name in loads}  # compute per sample, relative
    have = {name: load.capacity for name, load in loads.items()}
    work = {name: have[name] * k[name] for name in loads}  # compute per second: comparable across layers
    level = sum(work.values()) / sum(k.values())  # samples/s every swarm would have, spread evenly
    short = {name: (level - have[name]) * k[name] for name in loads
             if have[name] < level * (1.0 - policy.hysteresis)}  # compute per second each short swarm lacks
    surplus = {name: work[name] - level * k[name] for name in loads if have[name] > level}
    if not short or mine not in surplus:
        return None
    # what my swarm sends: its share of the deficit (never more than its surplus), split over the short
    # swarms by what each lacks; its peers go in mover order, each taking the next slice
    share = min(sum(short.values()) * surplus[mine] / sum(surplus.values()), surplus[mine])
    per_peer = work[mine] / loads[mine].peers
    movers = max(1, round(share / per_peer))
    if rank >= movers:
        return None
    targets = sorted(short, key=lambda name: (-short[name], name))
    position = (rank + 0.5) * share / movers
    target = targets[-1]
    for name in targets:
        position -= share * short[name] / sum(short.values())
        if position < 0:
            target = name
            break
    arrives = my_capacity * k[mine] / k[target]
    if min(have[mine] - my_capacity, have[target] + arrives) <= have[target]:
        return None  # this peer would leave its own swarm below where the target was: no better
    before = min(have.values())
    after = dict(have)
    after[mine] -= my_capacity
    after[target] += arrives
    return Move(target=target, movers=movers, gain=min(after.values()) / before if before > 0 else float("inf"))


def decision_delay_s(policy: RebalancePolicy, rng: random.Random | None = None) -> float:
    """How long after reading the records a volunteer acts: spreads one period's moves over it."""
    return (rng or random.Random()).uniform(0.0, policy.jitter * policy.period_s)


def best_split(peer_capacities: Sequence[float], swarms: int) -> float:
    """A near-optimal pipeline throughput for these peers over ``swarms`` equal-cost layers: the
    longest-processing-time-first greedy (largest peer to the least-served swarm), at least 3/4 of the
    optimum and within one peer's capacity of it. The bound ``upper_bound`` is the other side."""
    loads = [0.0] * swarms
    for capacity in sorted(peer_capacities, reverse=True):
        index = loads.index(min(loads))
        loads[index] += capacity
    return min(loads) if loads else 0.0


def upper_bound(peer_capacities: Sequence[float], swarms: int) -> float:
    """No split of these peers over ``swarms`` equal-cost layers beats an even spread of their capacity."""
    return sum(peer_capacities) / swarms if swarms else 0.0
