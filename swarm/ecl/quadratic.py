"""Quadratic consensus problems, where the answer is known: f_i(w) = |w - b_i|^2 / 2, optimum mean(b_i).

Used by the tests and by the eta measurement of docs/ECL.md. Gradients are exact, so a method that
converges to the optimum gets there to machine precision, and any remaining distance is bias.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from swarm.ecl.graph import GraphKind, PeerGraph, build_graph
from swarm.ecl.live_sim import LiveConfig, simulate_live
from swarm.ecl.simulate import SimConfig, SimResult, simulate
from swarm.ecl.updates import PDMM_THETA, DsgdNode, EclConfig, EclNode, common_eta, reference_eta


@dataclass(frozen=True, kw_only=True, slots=True)
class QuadraticRun:
    method: str = "ecl"  # "ecl" or "dsgd"
    graph: GraphKind = "ring"
    peers: int = 8
    dim: int = 5
    period_steps: int = 1
    ticks: int = 400
    step_size: float = 0.5  # mu for ECL, lr for DSGD
    theta: float = PDMM_THETA
    per_node_eta: bool = False
    speed_range: tuple[float, float] | None = None
    departures: Mapping[str, int] = field(default_factory=dict)
    returns: Mapping[str, int] = field(default_factory=dict)  # live orderings: a departed peer comes back
    delay_ticks: int = 0
    dual_init: str = "neutral"
    ordering: str = "reference"  # or "oneway", "swap": a swarm peer's ordering (live_sim.py)
    out_of_phase: bool = False  # live orderings: each node's step counter starts elsewhere
    seed: int = 0


def targets(peers: list[str], dim: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {peer: torch.randn(dim, generator=generator, dtype=torch.float64) for peer in peers}


def optimum_distances(params: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> tuple[float, float]:
    """(largest distance of a node to the mean of the live nodes' targets, largest distance between nodes)."""
    optimum = torch.stack([b[peer] for peer in params]).mean(dim=0)
    stacked = torch.stack(list(params.values()))
    to_optimum = float((stacked - optimum).norm(dim=1).max())
    spread = float((stacked - stacked.mean(dim=0)).norm(dim=1).max())
    return to_optimum, spread


def run_quadratic(run: QuadraticRun, eval_every_ticks: int | None = None) -> tuple[SimResult, dict[str, torch.Tensor]]:
    """Simulate ``run``; the metric recorded is the largest distance of a node to the live optimum."""
    peers = [f"peer{index:02d}" for index in range(run.peers)]
    b = targets(peers, run.dim, run.seed)
    rebuild = lambda ids: build_graph(run.graph, ids, run.period_steps, run.seed)
    graph = rebuild(peers)
    nodes = {peer: _node(run, peer, torch.zeros(run.dim, dtype=torch.float64), graph) for peer in peers}
    oracles = {peer: (lambda w, target=b[peer]: (0.5 * float((w - target).square().sum()), w - target))
               for peer in peers}
    evaluate = lambda params: optimum_distances(params, b)[0]
    every = eval_every_ticks or max(run.ticks, 1)
    if run.ordering != "reference":
        live = LiveConfig(ticks=run.ticks, eval_every_ticks=every, ordering=run.ordering, lag_ticks=run.delay_ticks,
                          out_of_phase=run.out_of_phase, seed=run.seed, speed_range=run.speed_range,
                          departures=run.departures, returns=run.returns)
        return simulate_live(nodes, oracles, rebuild, evaluate, live), b
    config = SimConfig(ticks=run.ticks, eval_every_ticks=every, seed=run.seed,
                       speed_range=run.speed_range, departures=run.departures, record_exchanges=True,
                       delay_ticks=run.delay_ticks)
    result = simulate(nodes, oracles, rebuild, evaluate, config)
    return result, b


def _node(run: QuadraticRun, peer: str, params: torch.Tensor, graph: PeerGraph):
    if run.method == "dsgd":
        return DsgdNode(peer, params, graph, lr=run.step_size)
    if run.method != "ecl":
        raise ValueError(f"unknown quadratic method {run.method!r}: use 'ecl' or 'dsgd'")
    if run.per_node_eta:
        eta = reference_eta(run.step_size, run.period_steps, graph.degree(peer))
    else:
        eta = common_eta(run.step_size, graph)
    return EclNode(peer, params, graph, EclConfig(mu=run.step_size, eta=eta, theta=run.theta, dual_init=run.dual_init))
