"""Live rebalancing's decisions (swarm/rebalance.py), placement at join, the capacity a stage publishes,
and the large-run simulation that drives them (benchmarks/scale_sim.py)."""

from __future__ import annotations

import time

import pytest

from swarm.dht.membership import least_served_swarm
from swarm.rebalance import (
    RebalancePolicy, SwarmLoad, best_split, loads_from_records, mover_order, plan_move, upper_bound,
)
from swarm.dht.records import MemberRecord
from swarm.pipeline.stage.worker import StageStats


def record(pid: str, state: str = "online", capacity: float = -1.0, movable: bool = True) -> MemberRecord:
    return MemberRecord(pid, state, "t", 0.0, 0.0, capacity=capacity, movable=movable)


def equal(counts: dict[str, int], capacity: float = 1.0) -> dict[str, SwarmLoad]:
    return {name: SwarmLoad(capacity * n, n) for name, n in counts.items()}


def test_loads_count_serving_and_arriving_peers_and_fill_missing_figures_with_the_median():
    views = {
        "layer0": [record("a", capacity=10.0), record("b", capacity=30.0), record("c", state="syncing")],
        "layer1": [record("d", state="paused", capacity=99.0), record("e", state="offline", capacity=99.0),
                   record("f")],
        "layer2": [],
    }
    loads = loads_from_records(views, ["layer0", "layer1", "layer2"])
    assert loads["layer0"] == SwarmLoad(60.0, 3)  # c counts as layer0's median, 20
    assert loads["layer1"] == SwarmLoad(20.0, 1)  # f counts as the run's median; paused and offline do not count
    assert loads["layer2"] == SwarmLoad(0.0, 0)
    mine = loads_from_records(views, ["layer0", "layer1", "layer2"], me="a", my_swarm="layer0", my_capacity=50.0)
    assert mine["layer0"] == SwarmLoad(110.0, 3)  # our live 50 replaces our record; c counts as b, 30
    counts = loads_from_records({"layer0": [record("x"), record("y")], "layer1": [record("z")]}, ["layer0", "layer1"])
    assert counts == {"layer0": SwarmLoad(2.0, 2), "layer1": SwarmLoad(1.0, 1)}  # no figures: peer counts


def test_a_lying_capacity_weighs_at_most_sixteen_typical_peers():
    views = {"layer0": [record(f"p{i}", capacity=10.0) for i in range(3)] + [record("liar", capacity=9e8)],
             "layer1": [record("q", capacity=10.0)]}
    loads = loads_from_records(views, ["layer0", "layer1"])
    assert loads["layer0"].capacity == 30.0 + 160.0


def test_a_newcomer_joins_the_swarm_with_the_least_capacity_not_the_fewest_peers():
    views = {"layer0": [record("a", capacity=100.0)], "layer1": [record("b", capacity=5.0), record("c", capacity=5.0)]}
    assert least_served_swarm(views, ["layer0", "layer1"]) == "layer1"
    views["layer1"].append(record("d", state="joining"))  # arriving peers count (as their swarm's median)
    views["layer0"] = [record("a", capacity=12.0)]
    assert least_served_swarm(views, ["layer0", "layer1"]) == "layer0"


def test_balanced_swarms_and_slightly_short_ones_stay_put():
    assert plan_move(equal({"layer0": 4, "layer1": 4}), "layer0", 1.0, rank=0) is None
    loads = {"layer0": SwarmLoad(10.2, 10), "layer1": SwarmLoad(9.8, 10)}  # 2 % short: within the hysteresis
    assert plan_move(loads, "layer0", 1.02, rank=0) is None


def test_one_peer_of_three_moves_to_a_swarm_left_with_one_and_only_the_first_in_mover_order():
    loads = equal({"layer0": 3, "layer1": 1})
    first = plan_move(loads, "layer0", 1.0, rank=0)
    assert first is not None and first.target == "layer1" and first.movers == 1 and first.gain == pytest.approx(2.0)
    assert plan_move(loads, "layer0", 1.0, rank=1) is None
    assert plan_move(loads, "layer1", 1.0, rank=0) is None  # the short swarm's peer stays


def test_a_move_that_would_only_shift_the_bottleneck_is_not_made():
    assert plan_move(equal({"layer0": 2, "layer1": 1}), "layer0", 1.0, rank=0) is None  # 2/1 -> 1/2: no gain
    fast = {"layer0": SwarmLoad(12.0, 2), "layer1": SwarmLoad(6.0, 2)}
    assert plan_move(fast, "layer0", 10.0, rank=0) is None  # the fast peer would leave layer0 at 2
    assert plan_move(fast, "layer0", 2.0, rank=0).target == "layer1"
    assert plan_move(equal({"layer0": 1, "layer1": 0}), "layer0", 1.0, rank=0) is None  # never leave a swarm empty


def test_a_donor_swarm_sends_its_share_of_the_deficit_as_whole_peers_over_the_short_swarms():
    loads = equal({"layer0": 20, "layer1": 20, "layer2": 2, "layer3": 6})  # level 12
    moves = [plan_move(loads, "layer0", 1.0, rank=r) for r in range(20)]
    targets = [m.target for m in moves if m is not None]
    # deficits 10 (layer2) and 6 (layer3), split between two donors: 8 from layer0, 5 to layer2 and 3 to layer3
    assert len(targets) == 8 and targets.count("layer2") == 5 and targets.count("layer3") == 3
    assert moves[0].movers == 8 and all(m is None for m in moves[8:])


def test_layers_of_different_cost_are_compared_in_compute():
    # layer1 costs 3x per sample: a peer doing 3 samples/s in layer0 does 1 there
    loads = {"layer0": SwarmLoad(12.0, 4), "layer1": SwarmLoad(1.0, 1)}
    move = plan_move(loads, "layer0", 3.0, rank=0, cost={"layer0": 1.0, "layer1": 3.0})
    assert move is not None and move.target == "layer1" and move.gain == pytest.approx(2.0)


def test_layer_costs_come_from_the_swarms_median_capacities():
    from swarm.rebalance import layer_costs

    views = {"layer0": [record("a", capacity=100.0), record("b", capacity=300.0)],
             "layer1": [record("c", capacity=50.0)], "layer2": [record("d")]}
    costs = layer_costs(views, ["layer0", "layer1", "layer2"])
    assert costs == {"layer0": pytest.approx(125 / 200), "layer1": pytest.approx(125 / 50), "layer2": 1.0}
    assert layer_costs({}, ["layer0"]) == {"layer0": 1.0}
    # a lone liar in layer1 claiming 10^8 samples/s moves its layer's cost at most 16x, not 10^6x
    lied = layer_costs({"layer0": [record("a", capacity=100.0), record("b", capacity=100.0)],
                        "layer1": [record("liar", capacity=1e8)]}, ["layer0", "layer1"])
    assert lied["layer0"] / lied["layer1"] == pytest.approx(16.0)


def test_mover_order_is_shared_and_changes_each_period():
    ids = [f"peer{i}" for i in range(20)]
    assert mover_order(ids, 7) == mover_order(list(reversed(ids)), 7)
    assert mover_order(ids, 7) != mover_order(ids, 8) and sorted(mover_order(ids, 8)) == sorted(ids)


def test_best_split_is_close_to_the_even_bound():
    caps = [float(c) for c in range(1, 101)]
    assert upper_bound(caps, 4) == pytest.approx(1262.5)
    assert 0.99 * upper_bound(caps, 4) <= best_split(caps, 4) <= upper_bound(caps, 4)


def test_a_stage_publishes_its_capacity_from_the_time_it_computes():
    stats = StageStats()
    assert stats.capacity(time.monotonic()) is None
    for _ in range(4):
        with stats.busy():
            time.sleep(0.02)
        stats.record_update(32, 1.0, time.monotonic())
    capacity = stats.capacity(time.monotonic())
    assert capacity is not None and 128 / 0.2 < capacity <= 128 / 0.08  # samples over seconds computing
    assert stats.capacity(time.monotonic() + 60.0) == capacity  # idle (a stalled pipeline): the last figure


def test_the_simulation_with_churn_and_uneven_peers_stays_near_the_optimum_only_with_rebalancing():
    from benchmarks.scale_sim import simulate

    kept = simulate(peers=300, swarms=6, periods=40, warmup=10, churn=0.0, rebalance=False, seed=1)
    moved = simulate(peers=300, swarms=6, periods=40, warmup=10, churn=0.0, rebalance=True, seed=1)
    assert kept.throughput_vs_best < 0.9 and moved.throughput_vs_best >= 0.95
    churned = simulate(peers=300, swarms=6, periods=40, warmup=10, churn=0.02, rebalance=True, seed=1)
    assert churned.throughput_vs_best >= 0.9 and churned.moves_per_peer_hour < 1.0
