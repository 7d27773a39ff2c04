"""``training.in_flight: auto`` (issue 12, item 4): the driver keeps enough micro-batches in flight to
cover the measured round trip x throughput, bounded by ``in_flight_max`` (swarm/pipeline/control/depth.py).

The controller is driven here by a model of a pipeline: a bottleneck that serves ``mu`` micro-batches
per second and a round trip of ``rtt`` seconds without queueing (a far volunteer has a long one)."""

from __future__ import annotations

import asyncio
import math

import pytest

from swarm.pipeline.control.depth import PROBE_EVERY_S, DepthController, target_depth
from swarm.run.memory import lanes_cap
from swarm.run.runconfig import RunConfig


def _simulate(ctrl: DepthController, mu: float, rtt: float, seconds: float) -> list[int]:
    """Lanes at depth d complete min(d / rtt, mu) micro-batches per second; queueing stretches the trips."""
    now, depths, step = 0.0, [], 0.05
    carry = 0.0
    while now < seconds:
        depth = ctrl.decide(now)
        rate = min(depth / rtt, mu)
        trip = max(rtt, depth / mu)  # Little's law: a queue forms once the bottleneck is full
        carry += rate * step
        while carry >= 1.0:
            carry -= 1.0
            ctrl.completed(now, trip, alone=(depth == 1))
        depths.append(depth)
        now += step
    return depths


@pytest.mark.parametrize("rtt_s, mu", [(0.01, 100.0), (0.15, 100.0), (0.3, 40.0)])
def test_the_depth_settles_near_the_bandwidth_delay_product(rtt_s: float, mu: float):
    ctrl = DepthController(cap=64)
    depths = _simulate(ctrl, mu, rtt_s, seconds=120.0)
    product = mu * rtt_s
    steady = [d for d in depths[len(depths) // 2:] if d > 1]  # leave out the brief probes
    assert min(steady) >= product, (product, min(steady))  # the bottleneck is kept busy
    assert max(steady) <= math.ceil(2.0 * product) + 1, (product, max(steady))  # and not flooded


def test_a_far_volunteer_needs_no_tuning_and_a_near_one_keeps_few_lanes():
    far = DepthController(cap=64)
    near = DepthController(cap=64)
    far_depth = _simulate(far, mu=50.0, rtt=0.2, seconds=60.0)[-1]
    near_depth = _simulate(near, mu=50.0, rtt=0.02, seconds=60.0)[-1]
    assert far_depth >= 10 and near_depth <= 3


def test_the_cap_bounds_the_depth_and_probes_drop_to_one_lane():
    ctrl = DepthController(cap=6)
    depths = _simulate(ctrl, mu=1000.0, rtt=0.5, seconds=3 * PROBE_EVERY_S)
    assert max(depths) == 6
    assert 1 in depths[len(depths) // 3:]  # the shortest round trip is measured again now and then


def test_target_depth_grows_at_most_twofold_and_stays_in_bounds():
    assert target_depth(rate_per_s=1000.0, rtt_s=1.0, cap=256, current=2) == 4
    assert target_depth(rate_per_s=0.0, rtt_s=1.0, cap=8, current=5) == 1
    assert target_depth(rate_per_s=10.0, rtt_s=0.2, cap=8, current=3) == 3  # ceil(1.5 x 2)


def test_nonsense_round_trips_are_ignored():
    ctrl = DepthController(cap=8)
    for trip in (float("nan"), float("inf"), -1.0, 0.0):
        ctrl.completed(1.0, trip, alone=False)
    assert ctrl.decide(10.0) == ctrl.depth == 2


def test_lanes_cap_is_the_fixed_depth_or_the_auto_bound():
    def run(**training) -> RunConfig:
        return RunConfig.model_validate({"name": "t", "model": {"stages": 2}, "training": training,
                                         "integrity": {"max_in_flight_per_requester": 12}})

    assert lanes_cap(run(in_flight=5)) == 5
    assert lanes_cap(run(in_flight="auto")) == 12  # in_flight_max 16, but a stage serves one driver 12
    assert lanes_cap(run(in_flight="auto", in_flight_max=6)) == 6


def test_a_driver_far_from_its_stages_deepens_its_pipeline(monkeypatch):
    """The real driver against a last stage 150 ms away: with ``in_flight: auto`` it runs more lanes than
    the 2 it starts with (the fake stage has no bottleneck, so the cap is where it stops)."""
    import swarm.pipeline.control.depth as depth
    from fake_stages import FakeSwarm, drive, honest

    monkeypatch.setattr(depth, "DECIDE_EVERY_S", 0.3)
    monkeypatch.setattr(depth, "RATE_WINDOW_S", 0.6)
    run = RunConfig.model_validate({"name": "far", "model": {"stages": 2, "hidden_dim": 16},
                                    "training": {"batch_size": 8, "in_flight": "auto", "in_flight_max": 8}})
    fake = FakeSwarm({"layer1": {"far": honest(run, 1)}}, service_s=0.15)
    peak = []

    async def watch(driver):
        for _ in range(40):
            peak.append(driver.in_flight)
            await asyncio.sleep(0.1)

    driver = drive(run, fake, seconds=0.5, during=watch, min_microbatches=20)
    assert max(peak) > 2 and driver.stats.depth > 2, (peak, driver.stats.depth)
    assert max(peak) <= 8 and driver.stats.lost == 0
