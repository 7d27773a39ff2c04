"""ECL-ISVR and DSGD on quadratics f_i(w) = |w - b_i|^2 / 2, whose optimum is the mean of the b_i."""

import pytest
import torch

from swarm.ecl.graph import double_ring, ring
from swarm.ecl.quadratic import QuadraticRun, optimum_distances, run_quadratic
from swarm.ecl.updates import ADMM_THETA, PDMM_THETA, BadMessageError, EclConfig, EclNode, dsgd_mix

TOLERANCE = 1e-6


@pytest.mark.parametrize("graph", ["ring", "double_ring", "random"])
@pytest.mark.parametrize("theta", [PDMM_THETA, ADMM_THETA], ids=["pdmm", "admm"])
def test_isvr_reaches_the_global_optimum(graph, theta):
    result, _ = run_quadratic(QuadraticRun(graph=graph, theta=theta, ticks=300))
    assert result.metrics[0] > 0.5
    assert result.metrics[-1] < TOLERANCE


@pytest.mark.parametrize("theta", [PDMM_THETA, ADMM_THETA], ids=["pdmm", "admm"])
def test_isvr_reaches_the_optimum_with_offsets_and_random_speeds(theta):
    run = QuadraticRun(graph="random", theta=theta, period_steps=4, speed_range=(0.5, 1.0), ticks=3000)
    result, _ = run_quadratic(run)
    assert result.metrics[-1] < TOLERANCE


def test_dsgd_with_a_constant_step_stays_measurably_away():
    for graph in ["ring", "double_ring", "random"]:
        dsgd, _ = run_quadratic(QuadraticRun(method="dsgd", graph=graph, ticks=300))
        isvr, _ = run_quadratic(QuadraticRun(graph=graph, ticks=300))
        assert dsgd.metrics[-1] > 1e-2 > 1e4 * isvr.metrics[-1]


def test_exchanges_happen_exactly_at_the_edge_offsets():
    result, _ = run_quadratic(QuadraticRun(graph="double_ring", period_steps=4, ticks=40))
    graph = double_ring([f"peer{index:02d}" for index in range(8)], period_steps=4)
    expected = {(tick, a, b) for tick in range(40) for a, b in graph.edges if tick % 4 == graph.offset(a, b)}
    assert set(result.exchanges) == expected
    assert len(result.exchanges) == len(expected) == 10 * len(graph.edges)


def test_a_departed_peer_does_not_stall_its_neighbours():
    run = QuadraticRun(graph="ring", ticks=600, departures={"peer03": 150})
    result, b = run_quadratic(run, eval_every_ticks=150)
    assert "peer03" not in result.final_params
    to_optimum, spread = optimum_distances(result.final_params, b)
    assert to_optimum < TOLERANCE and spread < TOLERANCE
    remaining_mean = torch.stack([b[peer] for peer in result.final_params]).mean(dim=0)
    everyone_mean = torch.stack(list(b.values())).mean(dim=0)
    assert float((remaining_mean - everyone_mean).norm()) > 0.05  # the optimum really moved
    assert result.local_steps["peer02"] == result.local_steps["peer04"] == 600


def test_admm_tolerates_messages_that_arrive_periods_late_and_pdmm_does_not():
    """The simulator's message delay (a network slower than a step): ADMM's averaged dual update still
    reaches the optimum; PDMM's pure reflection does not (docs/ECL.md, the lag table)."""
    run = QuadraticRun(graph="random", period_steps=8, ticks=8000, delay_ticks=16)  # two periods late
    admm, b = run_quadratic(_with(run, theta=ADMM_THETA))
    pdmm, _ = run_quadratic(_with(run, theta=PDMM_THETA))
    assert optimum_distances(admm.final_params, b)[0] < 1e-5  # measured 1.6e-6
    assert optimum_distances(pdmm.final_params, b)[0] > 1e-4  # measured 4.4e-4


def test_late_messages_of_a_departed_peer_are_dropped():
    result, b = run_quadratic(QuadraticRun(graph="ring", period_steps=4, ticks=6000, theta=ADMM_THETA, delay_ticks=6,
                                           departures={"peer03": 500}))
    assert "peer03" not in result.final_params
    assert optimum_distances(result.final_params, b)[0] < 1e-6


def _with(run: QuadraticRun, **changes) -> QuadraticRun:
    from dataclasses import replace

    return replace(run, **changes)


def test_per_node_eta_is_biased_where_degrees_differ_and_common_eta_is_not():
    per_node, _ = run_quadratic(QuadraticRun(graph="random", period_steps=4, per_node_eta=True, ticks=1500))
    common, _ = run_quadratic(QuadraticRun(graph="random", period_steps=4, ticks=1500))
    assert per_node.metrics[-1] > 1e-2
    assert common.metrics[-1] < TOLERANCE


def test_messages_carry_opposite_signs_at_the_two_ends_of_an_edge():
    graph = ring(["a", "b", "c"])
    config = EclConfig(mu=0.1, eta=1.0, dual_init="zero")
    w = torch.tensor([1.0, 2.0])
    a, b = EclNode("a", w, graph, config), EclNode("b", w, graph, config)
    assert torch.equal(a.make_message("b"), 2 * w) and torch.equal(b.make_message("a"), -2 * w)
    neutral = EclConfig(mu=0.1, eta=1.0)
    a, b = EclNode("a", w, graph, neutral), EclNode("b", w, graph, neutral)
    assert torch.equal(a.make_message("b"), w) and torch.equal(b.make_message("a"), -w)


def test_a_new_edge_pulls_nothing_with_a_neutral_dual_and_toward_zero_with_a_zero_dual():
    graph = ring(["a", "b", "c"])
    w = torch.tensor([1.0, -2.0])
    neutral = EclNode("b", w, graph, EclConfig(mu=0.1, eta=2.0))
    zero = EclNode("b", w, graph, EclConfig(mu=0.1, eta=2.0, dual_init="zero"))
    for node in (neutral, zero):
        node.step(torch.zeros(2))
    assert torch.allclose(neutral.params, w)
    assert torch.allclose(zero.params, w / (1 + 0.1 * 2.0 * 2))


def test_surviving_edges_keep_their_duals_when_the_graph_is_rebuilt():
    peers = ["a", "b", "c", "d"]
    node = EclNode("b", torch.ones(2), ring(peers), EclConfig(mu=0.1, eta=1.0))
    node.on_messages({"a": torch.full((2,), 3.0), "c": torch.full((2,), 5.0)})
    node.set_graph(ring(["a", "b", "d"]))
    assert set(node.duals) == {"a", "d"}
    assert torch.equal(node.duals["a"], torch.full((2,), 3.0))
    assert torch.equal(node.duals["d"], -torch.ones(2))  # new edge, neutral: -A_bd w_b with b < d


def test_bad_messages_are_rejected_before_anything_is_applied():
    node = EclNode("b", torch.zeros(2), ring(["a", "b", "c"]), EclConfig(mu=0.1, eta=1.0))
    with pytest.raises(BadMessageError, match="shape"):
        node.on_messages({"a": torch.ones(2), "c": torch.ones(3)})
    assert torch.equal(node.duals["a"], torch.zeros(2))
    with pytest.raises(BadMessageError, match="NaN"):
        node.on_messages({"a": torch.tensor([float("nan"), 0.0])})
    with pytest.raises(BadMessageError, match="not a neighbour"):
        node.on_messages({"z": torch.ones(2)})


def test_dsgd_mixing_is_synchronous_with_all_neighbours_and_pairwise_with_one():
    w = torch.zeros(1)
    neighbours = {"a": torch.ones(1), "c": torch.full((1,), 3.0)}
    weights = {"a": 0.25, "c": 0.25}
    assert float(dsgd_mix(w, neighbours, weights)) == pytest.approx(1.0)
    assert float(dsgd_mix(w, {"c": neighbours["c"]}, weights)) == pytest.approx(0.75)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="theta"):
        EclConfig(mu=0.1, eta=1.0, theta=0.0)
    with pytest.raises(ValueError, match="eta"):
        EclConfig(mu=0.1, eta=0.0)


def test_runs_are_reproducible():
    run = QuadraticRun(graph="random", period_steps=4, speed_range=(0.3, 1.0), ticks=100)
    first, _ = run_quadratic(run)
    second, _ = run_quadratic(run)
    assert first.metrics == second.metrics and first.exchanges == second.exchanges
