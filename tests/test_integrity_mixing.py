"""The bounds on what one peer's copy or edge message does to ours (swarm/integrity/mixing.py), no network.

Honest differences pass whole; a far copy and an outlier against the history are rejected; a large
step is clipped to the history's bound, to a fraction of our norm, and to the peer's budget per
window; no peer gets more than its fair share of the pulls.
"""

from __future__ import annotations

import math

import pytest
import torch

from swarm.averaging.influence import InfluenceGuard, distance, toward
from swarm.integrity.mixing import InfluenceLedger, judge_mix, tensor_scales, typical_distance
from swarm.run.runconfig import InfluenceConfig, RunConfig

CFG = InfluenceConfig(max_step_ratio=0.05, max_drift_ratio=0.25)  # the budget on, to test it  # max_distance 0.5, clip x3, outlier x10, history 32
NORM = 100.0
BUDGET = math.inf


def test_an_honest_difference_is_applied_whole():
    verdict = judge_mix(2.0, 0.5, NORM, [2.0] * 10, BUDGET, CFG)
    assert verdict.scale == 1.0 and not verdict.rejected and not verdict.clipped


@pytest.mark.parametrize("far", [math.nan, math.inf, 51.0, 141.0])
def test_a_copy_far_from_ours_is_rejected_even_without_history(far):
    verdict = judge_mix(far, 0.5, NORM, [], BUDGET, CFG)
    assert verdict.rejected
    assert "max_distance_ratio" in verdict.reason or "not finite" in verdict.reason


def test_an_outlier_against_the_history_is_rejected_and_says_why():
    history = [1.0] * 10  # a median of 1.0 (above the floor, 1 % of 100)
    assert not judge_mix(9.9, 0.5, NORM, history, BUDGET, CFG).rejected
    verdict = judge_mix(10.1, 0.5, NORM, history, BUDGET, CFG)
    assert verdict.rejected and "outlier_multiplier" in verdict.reason


def test_the_history_clips_around_its_median():
    verdict = judge_mix(6.0, 0.1, NORM, [1.0] * 10, BUDGET, CFG)
    assert verdict.clipped and verdict.scale == pytest.approx(3.0 / 6.0)  # clip_multiplier x the median
    assert "median" in verdict.reason


def test_without_history_only_the_step_cap_applies():
    # weight 0.5 and distance 40: the step would be 20 = 20 % of our norm; capped at 5 % = 5
    verdict = judge_mix(40.0, 0.5, NORM, [1.0] * 7, BUDGET, CFG)
    assert not verdict.rejected and 0.5 * 40.0 * verdict.scale == pytest.approx(0.05 * NORM)
    assert verdict.reason == "max_step_ratio"


def test_the_floor_keeps_identical_copies_from_making_every_difference_an_outlier():
    assert typical_distance([0.0] * 10, NORM, CFG) == pytest.approx(1.0)  # 1 % of our norm
    assert typical_distance([0.0] * 7, NORM, CFG) is None
    assert not judge_mix(5.0, 0.5, NORM, [0.0] * 10, BUDGET, CFG).rejected


def test_a_spent_budget_skips_without_rejecting():
    verdict = judge_mix(2.0, 0.5, NORM, [2.0] * 10, 0.0, CFG)
    assert verdict.scale == 0.0 and not verdict.rejected
    partial = judge_mix(2.0, 0.5, NORM, [2.0] * 10, 0.5, CFG)
    assert 0.5 * 2.0 * partial.scale == pytest.approx(0.5)


def test_the_ledger_forgets_moves_older_than_its_window():
    ledger = InfluenceLedger(window_s=60.0)
    ledger.record("a", 0.0, 10.0)
    ledger.record("a", 30.0, 5.0)
    assert ledger.moved("a", 59.0) == 15.0
    assert ledger.moved("a", 61.0) == 5.0
    assert ledger.budget_left("a", 61.0, NORM, CFG) == pytest.approx(0.25 * NORM - 5.0)
    assert ledger.moved("a", 200.0) == 0.0 and "a" not in ledger.moves


def test_a_peer_pulled_more_than_its_fair_share_waits_for_the_others():
    ledger = InfluenceLedger(window_s=60.0)
    peers = ["a", "b", "c"]
    assert not ledger.over_share("a", peers, 0.0, 2.0)
    for t in range(2):
        ledger.record("a", float(t), 0.1)
    assert ledger.over_share("a", peers, 3.0, 2.0)  # 2 of 2 pulls, the fair share is 2/3
    assert not ledger.over_share("b", peers, 3.0, 2.0)
    for t in range(6):
        for p in peers:
            ledger.record(p, 10.0 + t, 0.1)
    assert not any(ledger.over_share(p, peers, 20.0, 2.0) for p in peers), "an even spread is fair"
    assert not ledger.over_share("a", ["a"], 20.0, 2.0), "a lone peer is always allowed"


def test_the_guard_moves_a_same_norm_perturbation_by_at_most_the_step_cap():
    torch.manual_seed(0)
    ours = {"w": torch.randn(50, 50), "b": torch.randn(50), "n": torch.tensor(3)}
    norm = math.sqrt(sum(float(t.double().pow(2).sum()) for k, t in ours.items() if k != "n"))
    # a perturbation 30 % of our norm away, rescaled to our total norm: passes check_params' norm test
    noise = {k: torch.randn_like(t) for k, t in ours.items() if k != "n"}
    theirs = {k: ours[k] + 0.3 * norm * noise[k] / math.sqrt(sum(float(n.pow(2).sum()) for n in noise.values()))
              for k in noise}
    scale = norm / math.sqrt(sum(float(t.double().pow(2).sum()) for t in theirs.values()))
    theirs = {k: t * scale for k, t in theirs.items()} | {"n": torch.tensor(10**9)}
    guard = InfluenceGuard(CFG)
    dist = distance(ours, theirs)
    verdict = guard.judge("liar", dist, 0.5, norm, now=0.0)
    assert verdict.clipped
    moved = toward(ours, theirs, verdict.scale)
    step = 0.5 * distance(ours, moved)  # what p <- 0.5 theirs + 0.5 p does with the clipped copy
    assert step == pytest.approx(CFG.max_step_ratio * norm, rel=1e-6)
    assert int(moved["n"]) == 3, "a clipped copy keeps our integer buffers"


def test_the_influence_block_is_in_the_run_config_with_safe_defaults():
    run = RunConfig.model_validate({"name": "x", "averaging": {"influence": {"max_step_ratio": 0.2}}})
    assert run.averaging.influence.max_step_ratio == 0.2 and run.averaging.influence.min_history == 8
    assert RunConfig(name="x").averaging.influence.max_step_ratio == 0.1
    with pytest.raises(ValueError, match="min_history"):
        InfluenceConfig(history=8, min_history=9)


def test_the_allowance_cannot_be_spent_on_one_small_tensor():
    # a 100x100 weight of norm 100 and a 10-value bias of norm 1; the whole step aimed at the bias
    norms, numels = {"w": 100.0, "b": 1.0}, {"w": 10_000, "b": 10}
    scales = tensor_scales({"w": 0.0, "b": 8.0}, norms, numels, weight=0.5, scale=1.0, cfg=CFG)
    # the bias counts with its share of the total norm: 100 * sqrt(10 / 10010) ~ 3.16 > its own 1.0
    share = math.sqrt(100.0**2 + 1.0) * math.sqrt(10 / 10_010)
    assert 0.5 * 8.0 * scales["b"] == pytest.approx(CFG.max_step_ratio * share)
    assert scales["w"] == 1.0
    honest = tensor_scales({"w": 1.0, "b": 0.01}, norms, numels, weight=0.5, scale=1.0, cfg=CFG)
    assert honest == {"w": 1.0, "b": 1.0}, "small honest differences are untouched"


def test_the_budget_is_off_by_default():
    cfg = InfluenceConfig()
    ledger = InfluenceLedger(window_s=60.0)
    ledger.record("a", 0.0, 1e9)
    assert ledger.budget_left("a", 1.0, NORM, cfg) == math.inf
    assert judge_mix(2.0, 0.5, NORM, [2.0] * 10, ledger.budget_left("a", 1.0, NORM, cfg), cfg).scale == 1.0
