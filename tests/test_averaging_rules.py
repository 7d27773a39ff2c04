"""Averaging decisions and checks as pure functions: no network, no processes."""

from __future__ import annotations

import math
import random
import time

import pytest
import torch

from swarm.averaging import rules
from swarm.averaging.checks import ParamsRejected, check_optimizer, check_params
from swarm.averaging.rules import (
    BanList, FlowControl, donor_order, exchange_candidates, exchange_winner, interpolation_factor, merged_clock,
    budget_allows, pull_candidates, should_pull,
)
from swarm.run.optim_state import load_optimizer_tensors, optimizer_tensors
from swarm.dht.records import MemberRecord
from swarm.run.runconfig import AveragingConfig, RunConfig
from swarm.pipeline.stage.worker import StageWorker


def _cfg(**fields) -> AveragingConfig:
    return AveragingConfig(**fields)


def _record(peer_id: str, **changes) -> MemberRecord:
    now = time.time()
    fields = dict(peer_id=peer_id, state="online", version="t", started_at=now, updated_at=now)
    fields.update(changes)
    return MemberRecord(**fields)


# ----- interpolation
def test_constant_factor_is_the_configured_one():
    assert interpolation_factor(_cfg(interpolation="constant", constant_factor=0.5), clock=10, peer_clock=90,
                                loss=1.0, peer_loss=2.0) == 0.5


def test_clock_1_against_3_gives_three_quarters_and_clock_two_and_a_half():
    f = interpolation_factor(_cfg(interpolation="clock"), clock=1, peer_clock=3, loss=None, peer_loss=None)
    assert f == pytest.approx(0.75)
    assert merged_clock(1, 3, f) == pytest.approx(2.5)
    assert interpolation_factor(_cfg(interpolation="clock"), clock=0, peer_clock=0, loss=None, peer_loss=None) == 0.5


def test_loss_3_against_1_gives_three_quarters_and_unknown_losses_fall_back_to_the_constant():
    cfg = _cfg(interpolation="loss", constant_factor=0.3)
    assert interpolation_factor(cfg, clock=0, peer_clock=0, loss=3.0, peer_loss=1.0) == pytest.approx(0.75)
    assert interpolation_factor(cfg, clock=0, peer_clock=0, loss=None, peer_loss=1.0) == pytest.approx(0.3)


def test_divergence_rule_halves_the_factor_at_half_the_threshold_and_zero_disables_it():
    on = _cfg(interpolation="constant", constant_factor=0.5, divergence_threshold=2.0)
    assert interpolation_factor(on, clock=0, peer_clock=0, loss=1.0, peer_loss=1.0) == pytest.approx(0.25)
    assert interpolation_factor(on, clock=0, peer_clock=0, loss=3.0, peer_loss=1.0) == pytest.approx(0.5)
    off = _cfg(interpolation="constant", constant_factor=0.5, divergence_threshold=0.0)
    assert interpolation_factor(off, clock=0, peer_clock=0, loss=1.0, peer_loss=1.0) == pytest.approx(0.5)


def test_fetch_probability_zero_never_pulls_and_one_always_does():
    rng = random.Random(0)
    assert not any(should_pull(rng, 0.0) for _ in range(10_000))
    assert all(should_pull(rng, 1.0) for _ in range(100))
    assert 800 < sum(should_pull(rng, 0.1) for _ in range(10_000)) < 1200


def test_a_pull_budget_spaces_pulls_by_their_own_cost():
    assert not budget_allows(100.0, None, 0.0, 0.0), "0 is off: only fetch_probability's draws pull"
    assert budget_allows(100.0, None, 0.0, 0.25), "the first pull at once"
    # a 20 ms pull at a quarter of the time: the next one 60 ms after it ended
    assert not budget_allows(100.05, 100.0, 0.02, 0.25) and budget_allows(100.06, 100.0, 0.02, 0.25)
    # a 4 s download of a large layer: 12 s of quiet before the next
    assert not budget_allows(111.0, 100.0, 4.0, 0.25) and budget_allows(112.0, 100.0, 4.0, 0.25)
    with pytest.raises(ValueError):
        RunConfig(name="r", averaging={"pull_budget": 1.0})
    assert RunConfig(name="r", averaging={"pull_budget": 0.0}).run_id == RunConfig(name="r").run_id
    assert RunConfig(name="r", averaging={"pull_budget": 0.25}).run_id != RunConfig(name="r").run_id


# ----- flow control
def test_flow_control_scores_move_as_documented():
    flow = FlowControl()
    assert flow.score("a", 0.0) == 0.0
    assert flow.success("a", 0.0) == rules.SCORE_SUCCESS
    assert flow.success("a", 0.0) == rules.SCORE_MAX, "successes are capped"
    assert flow.refusal("b", 0.0) == rules.SCORE_REFUSAL
    assert flow.timeout("c", 0.0) == rules.SCORE_TIMEOUT
    for _ in range(10):
        flow.timeout("c", 0.0)
    assert flow.score("c", 0.0) == rules.SCORE_MIN, "timeouts are floored"
    # decay toward zero: one half-life halves the score
    assert flow.score("c", rules.SCORE_HALF_LIFE_S) == pytest.approx(rules.SCORE_MIN / 2)
    flow.timeout("d", 0.0)
    assert flow.success("d", 0.0) == pytest.approx(rules.SCORE_TIMEOUT + rules.SCORE_SUCCESS)


def test_choice_shares_pulls_among_healthy_peers_and_avoids_one_that_timed_out():
    flow, rng = FlowControl(), random.Random(1)
    flow.success("good", 0.0)
    flow.timeout("slow", 0.0)
    picks = [flow.choose(["good", "new", "slow"], 0.0, rng) for _ in range(2000)]
    assert picks.count("slow") == 0, "a fresh timeout (-3) is more than the random span below a healthy peer"
    # P(u1 - u2 > 1) for two uniforms on [0, 2] is 1/8: an untried peer still gets pulls
    assert 0.08 < picks.count("new") / len(picks) < 0.18
    later = [flow.choose(["good", "slow"], 5 * rules.SCORE_HALF_LIFE_S, rng) for _ in range(2000)]
    assert later.count("slow") > 100, "after its score decays the slow peer is tried again"
    assert flow.choose([], 0.0, rng) is None


def test_a_peer_whose_pulls_keep_failing_rests_longer_each_time_until_one_succeeds():
    # a swarm's only other member that serves no parameters was chosen at every draw: ~8 failed dials a second
    flow, rng = FlowControl(), random.Random(1)
    flow.timeout("mute", 0.0)
    assert flow.choose(["mute"], 0.5, rng) is None, "resting for REST_S after a failure, even when it is the only one"
    assert flow.choose(["mute"], rules.REST_S, rng) == "mute"
    flow.timeout("mute", rules.REST_S)
    assert flow.rests("mute", rules.REST_S + 1.5) and not flow.rests("mute", rules.REST_S + 2.0), "doubled"
    now = 10.0
    for _ in range(20):
        flow.timeout("mute", now)
    assert not flow.rests("mute", now + rules.MAX_REST_S), "capped at MAX_REST_S"
    flow.success("mute", now)
    assert not flow.rests("mute", now), "a success ends the rest"
    flow.timeout("mute", now)
    assert not flow.rests("mute", now + rules.REST_S), "and starts the doubling over"


def test_bans_expire_and_candidates_skip_me_banned_and_offline():
    bans = BanList()
    bans.ban("x", now=0.0, duration_s=10.0)
    assert bans.active(5.0) == {"x"} and bans.active(10.0) == set()
    records = [_record("me"), _record("a"), _record("b", state="paused"), _record("c"), _record("d", state="syncing")]
    assert pull_candidates(records, "me", {"c"}) == ["a"]


# ----- newcomers
def test_donors_are_spread_over_the_most_trained_peers():
    records = [_record(f"p{i}", clock=1000 * i) for i in range(6)] + [_record("idle", state="paused", clock=10**9)]
    firsts = {donor_order(records, "p0", random.Random(seed))[0] for seed in range(50)}
    assert firsts == {"p5", "p4", "p3"}
    order = donor_order(records, "p0", random.Random(0))
    assert order[3:] == ["p2", "p1"] and "p0" not in order and "idle" not in order
    assert donor_order([_record("me")], "me", random.Random(0)) == []


# ----- best-model exchange
def test_exchange_scores_random_online_peers_never_chosen_by_their_reported_loss():
    records = [_record("me", loss=1.0), _record("a", loss=5.0), _record("b", loss=0.01), _record("c"),
               _record("d", loss=0.001, state="paused"), _record("e")]
    drawn = [tuple(exchange_candidates(records, "me", {"e"}, random.Random(seed), 2)) for seed in range(60)]
    assert {peer for pair in drawn for peer in pair} == {"a", "b", "c"}, "online, not us, not excluded"
    assert all(len(set(pair)) == 2 for pair in drawn)
    firsts = [pair[0] for pair in drawn]
    assert min(firsts.count(p) for p in "abc") >= 10, "a low reported loss does not attract the pulls"
    assert sorted(exchange_candidates(records, "me", set(), random.Random(0), 10)) == ["a", "b", "c", "e"]
    assert exchange_candidates([_record("me")], "me", set(), random.Random(0), 2) == []


def test_exchange_adopts_only_a_clear_improvement_on_our_own_measurement():
    assert exchange_winner(1.0, {"a": 0.5, "b": 0.5, "c": 0.7}, 0.05) == "a", "ties between others: smallest id"
    assert exchange_winner(0.5, {"a": 0.5}, 0.0) is None, "a tie keeps our own copy"
    assert exchange_winner(0.52, {"a": 0.5}, 0.05) is None, "within the margin"
    assert exchange_winner(1.0, {"a": math.inf, "b": math.nan}, 0.0) is None, "a copy that breaks loses"
    assert exchange_winner(math.inf, {"a": 3.0}, 0.05) == "a", "our own copy broke: any working copy wins"
    assert exchange_winner(1.0, {}, 0.05) is None



# ----- checks
def _params() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"w": torch.randn(4, 3), "b": torch.randn(4)}


@pytest.mark.parametrize(("change", "reason"), [
    (lambda p: p.update(w=torch.full((4, 3), float("nan"))), "NaN"),
    (lambda p: p.update(w=torch.zeros(3, 4)), "shape"),
    (lambda p: p.update(w=p["w"].double()), "dtype"),
    (lambda p: p.pop("b"), "missing b"),
    (lambda p: p.update(extra=torch.zeros(1)), "unexpected extra"),
    (lambda p: p.update(w=p["w"] * 100, b=p["b"] * 100), "max_norm_ratio"),
    (lambda p: p.update(w=p["w"] * 0, b=p["b"] * 0), "max_norm_ratio"),
])
def test_bad_parameters_are_rejected_with_the_reason(change, reason):
    own, received = _params(), _params()
    change(received)
    with pytest.raises(ParamsRejected, match=reason):
        check_params(own, received, max_norm_ratio=10.0)


def test_good_parameters_pass_and_optimizer_state_round_trips():
    own = _params()
    check_params(own, {k: v * 3 for k, v in own.items()}, max_norm_ratio=10.0)
    run = RunConfig.model_validate({"name": "opt", "model": {"stages": 2, "hidden_dim": 8},
                                    "optimizer": {"name": "adam", "lr": 0.01}})
    donor, newcomer = StageWorker(run, 1), StageWorker(run, 1)
    donor.forward_backward("m", torch.randn(4, 8), torch.tensor([0, 1, 2, 3]))
    tensors = optimizer_tensors(donor.module, donor.optimizer)
    shapes = {n: p.shape for n, p in donor.module.named_parameters()}
    check_optimizer(shapes, tensors)
    load_optimizer_tensors(newcomer.module, newcomer.optimizer, tensors)
    assert optimizer_tensors(newcomer.module, newcomer.optimizer).keys() == tensors.keys()
    for name, tensor in optimizer_tensors(newcomer.module, newcomer.optimizer).items():
        assert torch.equal(tensor, tensors[name])
    bad = dict(tensors)
    bad[next(n for n in bad if n.endswith("exp_avg_sq"))] *= -1
    with pytest.raises(ParamsRejected):
        check_optimizer(shapes, bad)
    with pytest.raises(ParamsRejected, match="does not belong"):
        check_optimizer(shapes, {"nope/exp_avg": torch.zeros(1)})


def test_an_edge_graph_keeps_a_late_heartbeat_for_a_record_lifetime_but_not_a_crash_or_a_pause():
    seen = {"late": 0.0, "crashed": 0.0, "paused": 0.0, "gone": 0.0}
    listed = {"paused": "paused", "online": "online"}
    kept = rules.edge_graph_members(seen, listed, unreachable={"crashed"}, now=10.0, grace_s=15.0)
    assert kept == {"late": 0.0, "gone": 0.0, "online": 10.0}
    assert rules.edge_graph_members(kept, listed, unreachable=set(), now=20.0, grace_s=15.0) == {"online": 20.0}
