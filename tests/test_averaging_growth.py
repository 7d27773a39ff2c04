"""The norm growth averaging may cause within a window, whoever the partners are (swarm/integrity/mixing.py item 4).

Measured before (issue 25): a hostile averaging peer that always pushed the same direction, 0.45 of the norm per
copy, took a layer's norm from 8.2 to 2,271 in 66 pulls, each within the per-pull caps."""

from __future__ import annotations

import math

import pytest
import torch

from swarm.averaging.influence import InfluenceGuard, step_moments, toward
from swarm.integrity.mixing import MAX_GROWTH_RATIO, GrowthLedger, growth_scale
from swarm.run.runconfig import InfluenceConfig


def test_a_step_that_does_not_grow_the_norm_is_never_shortened():
    assert growth_scale(own_sq=100.0, dot=-5.0, step_sq=4.0, own_norm=10.0, growth_left=0.0) == 1.0
    # growing by 1 with 0.5 left: shortened so that the norm after it is 10.5
    s = growth_scale(own_sq=100.0, dot=10.0, step_sq=1.0, own_norm=10.0, growth_left=0.5)
    assert math.sqrt(100.0 + 2 * s * 10.0 + s * s) == pytest.approx(10.5)


def test_the_ledger_forgets_growth_older_than_the_window():
    ledger = GrowthLedger(window_s=60.0)
    ledger.record(0.0, 0.5)
    ledger.record(1.0, -3.0)  # shrinking spends nothing
    assert ledger.left(30.0, own_norm=10.0) == pytest.approx(10.0 * MAX_GROWTH_RATIO - 0.5)
    assert ledger.left(61.0, own_norm=10.0) == pytest.approx(10.0 * MAX_GROWTH_RATIO)


def _pull(guard: InfluenceGuard, own: dict, theirs: dict, weight: float, now: float) -> dict:
    """What SwarmAveraging._bounded and mix_in do with one pulled copy (swarm/averaging/agent.py)."""
    from swarm.averaging.checks import total_norm as total_norm_of
    from swarm.averaging.influence import distance, per_tensor

    verdict = guard.judge("hostile", distance(own, theirs), weight, total_norm_of(own), now)
    assert not verdict.rejected
    scales, _ = per_tensor(own, theirs, weight, verdict.scale, guard.cfg)
    bounded = toward(own, theirs, scales)
    share = guard.fit_growth(*step_moments(own, bounded, weight), now)
    bounded = toward(own, bounded, share)
    return {k: own[k] + weight * (bounded[k] - own[k]) for k in own}


def test_a_partner_pushing_one_way_grows_the_norm_at_most_the_ratio_per_window():
    cfg = InfluenceConfig(max_step_ratio=0.45, max_distance_ratio=1.0, window_s=60.0)
    guard = InfluenceGuard(cfg)
    g = torch.Generator().manual_seed(0)
    own = {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)}
    start = math.sqrt(sum(float(t.pow(2).sum()) for t in own.values()))
    for pull in range(66):  # each pull: the same direction, 0.45 of our norm away, every 0.5 s
        norm = math.sqrt(sum(float(t.pow(2).sum()) for t in own.values()))
        theirs = {k: t + 0.45 * t / norm * (norm / start) for k, t in own.items()}  # away from the origin
        own = _pull(guard, own, theirs, weight=0.5, now=pull * 0.5)
    end = math.sqrt(sum(float(t.pow(2).sum()) for t in own.values()))
    assert end <= start * (1 + MAX_GROWTH_RATIO) * 1.001, (start, end)
    assert guard.shortened > 0
