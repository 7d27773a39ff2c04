"""How an edge exchange is paired (swarm/ecl/pairing.py) and the live orderings' simulation (live_sim.py).

The swap makes both messages of an exchange before either is applied, as the reference does: with no
lag and counters in phase it is the reference, step for step, and it converges with lag, out-of-phase
step counters and random speeds (docs/ECL.md, "Message pairing", compares it with the one-way pushes)."""

import pytest
import torch

from swarm.ecl.graph import build_graph, ring
from swarm.ecl.live_sim import LiveConfig, start_counters
from swarm.ecl.pairing import EdgeGenerations, answer_swap, initiates, swaps_due
from swarm.ecl.quadratic import QuadraticRun, run_quadratic
from swarm.ecl.updates import ADMM_THETA, BadMessageError, EclConfig, EclNode

PEERS = [f"peer{index:02d}" for index in range(4)]


def _pair():
    graph = ring(PEERS[:2])
    config = EclConfig(mu=0.5, eta=0.3)
    a = EclNode("peer00", torch.tensor([1.0, 2.0]), graph, config)
    b = EclNode("peer01", torch.tensor([-1.0, 0.5]), graph, config)
    return a, b


def test_the_smaller_id_starts_every_swap_of_an_edge_at_its_own_offset():
    graph = build_graph("random", [f"p{index}" for index in range(8)], period_steps=4, seed=1)
    started = {(me, peer, step) for step in range(8) for me in graph.peers for peer in swaps_due(graph, me, step)}
    # each edge is started by exactly one end, twice in 8 steps (K = 4), at its offset
    assert {(a, b) for a, b, _ in started} == set(graph.edges)
    assert all(step % 4 == graph.offset(a, b) for a, b, step in started)
    assert len(started) == 2 * len(graph.edges)
    assert initiates("a", "b") and not initiates("b", "a")
    with pytest.raises(ValueError):
        initiates("a", "a")


def test_a_swap_answers_with_the_message_made_before_the_request_is_applied():
    a, b = _pair()
    request = a.make_message("peer01")
    expected_reply = b.make_message("peer00")
    reply = answer_swap(b, "peer00", request)
    assert torch.equal(reply, expected_reply)
    assert torch.equal(b.duals["peer00"], request)  # PDMM: the dual becomes the neighbour's message
    a.on_messages({"peer01": reply})
    # both ends now hold the other's message: the exchange the reference makes
    assert torch.equal(a.duals["peer01"], expected_reply)


def test_a_bad_request_is_neither_applied_nor_answered():
    a, b = _pair()
    before = b.duals["peer00"].clone()
    with pytest.raises(BadMessageError):
        answer_swap(b, "peer00", torch.tensor([float("nan"), 0.0]))
    assert torch.equal(b.duals["peer00"], before)


def test_an_edge_rebuilt_while_its_reply_travels_drops_that_reply():
    generations = EdgeGenerations()
    generations.update(["b", "c"])
    sent_b, sent_c = generations.current("b"), generations.current("c")
    generations.update(["c"])  # b left ...
    assert generations.current("b") is None and generations.matches("c", sent_c)
    generations.update(["b", "c"])  # ... and came back: a new edge with a fresh dual
    assert not generations.matches("b", sent_b) and generations.matches("c", sent_c)


def test_out_of_phase_counters_are_seeded_and_spread():
    counters = start_counters(PEERS, out_of_phase=True, seed=3)
    assert counters == start_counters(PEERS, out_of_phase=True, seed=3)
    assert len({value % 8 for value in counters.values()}) > 1
    assert set(start_counters(PEERS, out_of_phase=False, seed=3).values()) == {0}
    with pytest.raises(ValueError, match="ordering"):
        LiveConfig(ticks=1, eval_every_ticks=1, ordering="reference")


@pytest.mark.parametrize("graph", ["ring", "random"])
def test_the_swap_with_no_lag_in_phase_is_exactly_the_reference(graph):
    reference, _ = run_quadratic(QuadraticRun(graph=graph, period_steps=4, ticks=200))
    swap, _ = run_quadratic(QuadraticRun(graph=graph, period_steps=4, ticks=200, ordering="swap"))
    for peer, params in reference.final_params.items():
        assert torch.allclose(swap.final_params[peer], params, atol=1e-12)


@pytest.mark.parametrize("theta", [1.0, ADMM_THETA], ids=["pdmm", "admm"])
def test_the_swap_converges_with_lag_out_of_phase_counters_and_random_speeds(theta):
    run = QuadraticRun(graph="random", period_steps=4, ticks=2500, theta=theta, ordering="swap", delay_ticks=2,
                       out_of_phase=True, speed_range=(0.5, 1.0))
    result, _ = run_quadratic(run)
    assert result.metrics[0] > 0.5 and result.metrics[-1] < 1e-6


@pytest.mark.parametrize("theta", [1.0, ADMM_THETA], ids=["pdmm", "admm"])
def test_the_swap_converges_after_a_peer_leaves_and_comes_back_with_fresh_edges(theta):
    """The edge reset rules: a departed peer's edges go; when it returns they are new (neutral duals at
    both ends), and swaps of the old edges still on the wire are dropped."""
    run = QuadraticRun(graph="random", period_steps=4, ticks=3000, theta=theta, ordering="swap", delay_ticks=2,
                       out_of_phase=True, speed_range=(0.5, 1.0), departures={"peer03": 300}, returns={"peer03": 700})
    result, _ = run_quadratic(run, eval_every_ticks=500)
    assert result.metrics[-1] < 1e-6  # the optimum of all eight, the returned peer included
