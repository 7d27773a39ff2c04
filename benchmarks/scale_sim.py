"""A simulation of a large run: placement, churn and live rebalancing of 1,000-10,000 volunteers (pure).

It drives the project's own decisions, not copies of them, on ``MemberRecord``s as peers publish them
(state, capacity once measured, movable): a newcomer picks its swarm with
``swarm.dht.membership.least_served_swarm`` (what `--swarm auto` does at join), and every auto volunteer
reconsiders its swarm once per rebalance period with ``swarm.rebalance.loads_from_records``,
``mover_order`` and ``plan_move`` (what the node's rebalancer, volunteer/node/rebalancer.py, does).

Model, per rebalance period (60 s by default):
- Peers differ in speed: capacity (samples/s through any layer, equal-cost layers) is log-normal.
- Churn: a fraction of the peers leaves at random each period and as many newcomers arrive.
- A newcomer, and a peer that moved, downloads its layer for ``sync_periods`` before it serves.
- The decisions of one period are spread over ``substeps`` (the random delay of the policy): each
  sub-step's deciders see the records as they were at the end of the one before, movers included.
- Throughput = the smallest swarm's summed capacity of its serving peers (every sample passes every
  layer). The optimum splits the same peers (serving or moving, not newcomers that are still
  downloading) as well as possible: ``best_split`` (LPT), reported with the even-spread bound too.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from swarm.dht.membership import least_served_swarm
from swarm.rebalance import RebalancePolicy, best_split, loads_from_records, mover_order, plan_move, upper_bound
from swarm.dht.records import MemberRecord


@dataclass(slots=True)
class SimPeer:
    pid: int
    capacity: float
    swarm: str
    ready_at: int  # period from which it serves (after its download)
    newcomer: bool = True  # still in its first download: not part of any split yet


@dataclass(slots=True)
class SimConfig:
    peers: int = 1000
    swarms: int = 8
    periods: int = 120
    warmup: int = 20  # periods left out of the averages (the run filling up)
    churn: float = 0.02  # fraction of the peers replaced each period
    sigma: float = 1.0  # log-normal spread of capacities (1.0: the fastest of 1,000 is ~20x the median)
    sync_periods: int = 1  # a download takes this many periods
    substeps: int = 10
    arrival_waves: int = 20  # a period's newcomers arrive in this many waves; one wave reads the same records
    rebalance: bool = True
    policy: RebalancePolicy = field(default_factory=RebalancePolicy)
    seed: int = 0


@dataclass(slots=True)
class SimResult:
    throughput_vs_best: float  # mean over periods after warm-up of throughput / best_split
    throughput_vs_bound: float  # the same against the even spread (an upper bound of the optimum)
    worst_vs_best: float  # the worst period after warm-up
    moves_per_peer_hour: float
    periods: int

    def to_json(self) -> dict:
        return {key: round(value, 4) if isinstance(value, float) else value
                for key, value in (("throughput_vs_best", self.throughput_vs_best),
                                   ("throughput_vs_bound", self.throughput_vs_bound),
                                   ("worst_vs_best", self.worst_vs_best),
                                   ("moves_per_peer_hour", self.moves_per_peer_hour),
                                   ("periods", self.periods))}


class Simulation:
    def __init__(self, config: SimConfig):
        self.config = config
        self.rng = random.Random(config.seed)
        self.names = [f"layer{index}" for index in range(config.swarms)]
        self.peers: dict[int, SimPeer] = {}
        self.next_pid = 0
        self.period = 0
        self.moves = 0
        self.views: dict[str, dict[int, MemberRecord]] = {name: {} for name in self.names}  # the DHT's records
        per_wave = math.ceil(config.peers / 1000)  # the run fills up: newcomers read the records of those before
        for start in range(0, config.peers, per_wave):
            swarm = least_served_swarm(self._view(), self.names)
            for _ in range(min(per_wave, config.peers - start)):
                self._arrive(ready_at=0, swarm=swarm)
        for peer in self.peers.values():
            peer.newcomer = False
            self._publish(peer)

    # ----- records, as the peers publish them
    def _publish(self, peer: SimPeer) -> None:
        """A peer's record: syncing until its download is done; its capacity once it has trained
        (a newcomer in its first download has no figure yet, as in the live record)."""
        for records in self.views.values():
            records.pop(peer.pid, None)
        state = "online" if peer.ready_at <= self.period else "syncing"
        capacity = -1.0 if peer.newcomer else peer.capacity
        self.views[peer.swarm][peer.pid] = MemberRecord(str(peer.pid), state, "sim", 0.0, 0.0, capacity=capacity,
                                                        movable=True)

    def _view(self) -> dict[str, list[MemberRecord]]:
        return {name: list(records.values()) for name, records in self.views.items()}

    def _arrive(self, ready_at: int, swarm: str | None = None) -> None:
        swarm = swarm or least_served_swarm(self._view(), self.names)  # what `--swarm auto` does at join
        peer = SimPeer(self.next_pid, self.rng.lognormvariate(0.0, self.config.sigma), swarm, ready_at)
        self.peers[peer.pid] = peer
        self.next_pid += 1
        self._publish(peer)

    def _leave(self, pid: int) -> None:
        peer = self.peers.pop(pid)
        self.views[peer.swarm].pop(pid, None)

    # ----- one period
    def step(self) -> tuple[float, float, float]:
        config = self.config
        self.period += 1
        for peer in self.peers.values():  # downloads done by now: online, and newcomers have a figure
            if peer.ready_at == self.period:
                peer.newcomer = False
                self._publish(peer)
        leaving = self.rng.sample(sorted(self.peers), k=int(round(config.churn * len(self.peers))))
        for pid in leaving:
            self._leave(pid)
        waves = min(len(leaving), config.arrival_waves)
        for wave in range(waves):  # newcomers of one wave read the same records (they arrive together)
            size = len(leaving) // waves + (1 if wave < len(leaving) % waves else 0)
            swarm = least_served_swarm(self._view(), self.names)
            for _ in range(size):
                self._arrive(ready_at=self.period + config.sync_periods, swarm=swarm)
        if config.rebalance:
            self._rebalance()
        serving = dict.fromkeys(self.names, 0.0)
        for peer in self.peers.values():
            if peer.ready_at <= self.period:
                serving[peer.swarm] += peer.capacity
        throughput = min(serving.values())
        splittable = [peer.capacity for peer in self.peers.values() if not peer.newcomer]
        return throughput, best_split(splittable, config.swarms), upper_bound(splittable, config.swarms)

    def _rebalance(self) -> None:
        """Each serving peer decides once, at its own random time in the period (decision_delay_s): the
        deciders of one sub-step read the records as the sub-steps before them left them."""
        config = self.config
        deciders = [peer for peer in self.peers.values() if peer.ready_at <= self.period]
        self.rng.shuffle(deciders)
        per_substep = max(1, math.ceil(len(deciders) / config.substeps))
        for start in range(0, len(deciders), per_substep):
            view = self._view()
            loads = loads_from_records(view, self.names)
            ranks = self._ranks(view)
            moved = []
            for peer in deciders[start:start + per_substep]:
                move = plan_move(loads, peer.swarm, peer.capacity, ranks[peer.pid], config.policy)
                if move is not None:
                    moved.append((peer, move.target))
            for peer, target in moved:
                peer.swarm = target
                peer.ready_at = self.period + config.sync_periods
                self.moves += 1
                self._publish(peer)

    def _ranks(self, view: dict[str, list[MemberRecord]]) -> dict[int, int]:
        """Each online movable peer's place in its swarm's mover order this period (-1: not online)."""
        ranks = dict.fromkeys(self.peers, -1)
        for records in view.values():
            ids = [r.peer_id for r in records if r.state == "online" and r.movable]
            for rank, pid in enumerate(mover_order(ids, self.period)):
                ranks[int(pid)] = rank
        return ranks

    def run(self) -> SimResult:
        config = self.config
        ratios, bounds = [], []
        for _ in range(config.periods):
            throughput, best, bound = self.step()
            if self.period > config.warmup:
                ratios.append(throughput / best if best > 0 else 0.0)
                bounds.append(throughput / bound if bound > 0 else 0.0)
        hours = config.periods * config.policy.period_s / 3600.0
        return SimResult(
            throughput_vs_best=sum(ratios) / len(ratios), throughput_vs_bound=sum(bounds) / len(bounds),
            worst_vs_best=min(ratios), moves_per_peer_hour=self.moves / config.peers / hours, periods=len(ratios),
        )


def simulate(**overrides) -> SimResult:
    return Simulation(SimConfig(**overrides)).run()
