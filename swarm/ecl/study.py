"""The convergence study on heterogeneous data: every method on the same digits shards, same budget.

Set-up (docs/ECL.md): scikit-learn digits through ``swarm.run.data``, 8 nodes with label-skewed shards
(each holds 8 of the 10 classes), softmax regression and a small MLP, a peer graph whose edges
exchange every K steps at their own offsets, nodes of random speed (asynchronous), and a single-node
reference trained on all the training data for the same number of epochs and batch size.

Every method gets the same number of epochs, the same batch size, the same graph and exchange
schedule, and one tuned knob (its step size, from the same grid), chosen on a validation split
carved out of the training data (``tune``), never on the test set.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch

from swarm.ecl.gossip import BestModelExchange, GossipNode, SgdNode
from swarm.ecl.graph import GraphKind, PeerGraph, build_graph
from swarm.ecl.live_sim import LiveConfig, simulate_live
from swarm.ecl.models import FlatClassifier
from swarm.ecl.simulate import SimConfig, SwarmHook, simulate
from swarm.ecl.updates import ADMM_THETA, PDMM_THETA, DsgdNode, EclConfig, EclNode, common_eta, reference_eta

METHODS: tuple[str, ...] = ("reference", "pdmm_isvr", "admm_isvr", "dsgd", "gossip_constant", "gossip_clock",
                            "best_model")
MODELS: dict[str, tuple[int, ...]] = {"softmax": (64, 10), "mlp": (64, 32, 10)}
STEP_SIZE_GRID: tuple[float, ...] = (0.1, 0.2, 0.4, 0.8, 1.6)
VALIDATION_FRACTION = 0.2
LIVE_METHODS: tuple[str, ...] = ("pdmm_isvr", "admm_isvr", "dsgd")  # the edge modes a swarm runs
BEST_MODEL_EVERY_EPOCHS = 1  # best-model exchange period, in epochs of a node's shard
BEST_MODEL_MARGIN = 0.05  # the run config's default (averaging.exchange.margin)


@dataclass(frozen=True, kw_only=True, slots=True)
class StudyConfig:
    epochs: int = 200
    batch_size: int = 16
    nodes: int = 8
    classes_per_shard: int = 8
    graph: GraphKind = "random"
    period_steps: int = 8  # K: each edge exchanges once every K ticks, at its own offset
    speed_range: tuple[float, float] | None = (0.5, 1.0)
    eta_scale: float = 1.0  # ECL: common_eta times this
    per_node_eta: bool = False  # ECL: the authors' per-node eta_i instead of one common eta
    dual_init: str = "neutral"  # ECL: a new edge's dual, "neutral" or "zero" (the paper's)
    delay_ticks: int = 0  # messages arrive this many ticks after they were made
    ordering: str = "reference"  # or a swarm peer's: "oneway", "swap" (live_sim.py; edge methods only)
    out_of_phase: bool = False  # live orderings: each node's step counter starts elsewhere
    l2: float = 1e-4
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Problem:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_eval: torch.Tensor  # test set, or the validation split when tuning
    y_eval: torch.Tensor
    shards: tuple[np.ndarray, ...]  # indices into x_train, one per node


def load_problem(config: StudyConfig, validation: bool = False) -> Problem:
    """Digits, split and sharded by ``swarm.run.data``; with ``validation`` the evaluation set is a split
    of each shard's training samples (the test set stays unseen) and the shards lose those samples."""
    from swarm.run.data import load_dataset, make_shards
    from swarm.run.runconfig import DataConfig, ModelConfig

    data = DataConfig(source="digits", shards=config.nodes, partition="label_skewed",  # the split docs/ECL.md
                      classes_per_shard=config.classes_per_shard, split_seed=config.seed,  # measured on: its own
                      validation_fraction=0.0)  # validation split comes out of the shards below
    dataset = load_dataset(data, ModelConfig(kind="mlp", input_dim=64, num_classes=10))
    shards = make_shards(dataset.y_train, data, dataset.num_classes)
    if not validation:
        return Problem(dataset.x_train, dataset.y_train, dataset.x_test, dataset.y_test, tuple(shards))
    rng = np.random.default_rng([config.seed, 3])
    kept, held_out = [], []
    for shard in shards:
        order = rng.permutation(shard)
        cut = int(round(VALIDATION_FRACTION * len(order)))
        held_out.append(order[:cut])
        kept.append(np.sort(order[cut:]))
    held = np.concatenate(held_out)
    return Problem(dataset.x_train, dataset.y_train, dataset.x_train[held], dataset.y_train[held], tuple(kept))


class BatchOracle:
    """Loss and gradient on the next micro-batch of one node's shard (reshuffled each pass, seeded)."""

    def __init__(self, model: FlatClassifier, x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int):
        self.model, self.x, self.y = model, x, y
        self.batch_size = min(batch_size, len(y))
        self.generator = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(len(y), generator=self.generator)
        self.position = 0

    def __call__(self, params: torch.Tensor) -> tuple[float, torch.Tensor]:
        if self.position + self.batch_size > len(self.order):
            self.order = torch.randperm(len(self.y), generator=self.generator)
            self.position = 0
        batch = self.order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return self.model.loss_and_grad(params, self.x[batch], self.y[batch])


def peer_ids(count: int) -> list[str]:
    return [f"node{index:02d}" for index in range(count)]


def make_node(method: str, peer: str, params: torch.Tensor, graph: PeerGraph, step_size: float,
              config: StudyConfig):
    """The node of ``method`` (any but the reference); ``step_size`` is mu for ECL, lr otherwise."""
    if method in ("pdmm_isvr", "admm_isvr"):
        theta = PDMM_THETA if method == "pdmm_isvr" else ADMM_THETA
        if config.per_node_eta:
            eta = reference_eta(step_size, graph.period_steps, graph.degree(peer))
        else:
            eta = common_eta(step_size, graph, config.eta_scale)
        return EclNode(peer, params, graph, EclConfig(mu=step_size, eta=eta, theta=theta, dual_init=config.dual_init))
    if method == "dsgd":
        return DsgdNode(peer, params, graph, lr=step_size)
    if method in ("gossip_constant", "gossip_clock"):
        interpolation = "constant" if method == "gossip_constant" else "clock"
        return GossipNode(peer, params, graph, step_size, config.batch_size, interpolation)
    if method == "best_model":
        return SgdNode(peer, params, graph, lr=step_size)
    raise ValueError(f"unknown method {method!r}: use one of {', '.join(METHODS)}")


def run_method(method: str, model_name: str, step_size: float, problem: Problem, config: StudyConfig) -> list[float]:
    """Node-averaged evaluation accuracy after each epoch (index 0: before training)."""
    model = FlatClassifier(MODELS[model_name], l2=config.l2)
    initial = model.init(config.seed)
    evaluate: Callable[[Mapping[str, torch.Tensor]], float] = lambda params: float(
        np.mean([model.accuracy(w, problem.x_eval, problem.y_eval) for w in params.values()]))
    if method == "reference":
        return _run_reference(model, initial, step_size, problem, config, evaluate)
    peers = peer_ids(config.nodes)
    rebuild = lambda ids: build_graph(config.graph, ids, config.period_steps, config.seed)
    graph = rebuild(peers)
    nodes = {peer: make_node(method, peer, initial, graph, step_size, config) for peer in peers}
    oracles = {peer: BatchOracle(model, problem.x_train[shard], problem.y_train[shard], config.batch_size,
                                 seed=config.seed * 1000 + index)
               for index, (peer, shard) in enumerate(zip(peers, problem.shards))}
    ticks_per_epoch = math.ceil(np.mean([len(shard) for shard in problem.shards]) / config.batch_size)
    hook: SwarmHook | None = None
    if method == "best_model":
        every_samples = BEST_MODEL_EVERY_EPOCHS * ticks_per_epoch * config.batch_size
        hook = BestModelExchange(every_samples, config.batch_size, margin=BEST_MODEL_MARGIN)
    if config.ordering != "reference":
        if method not in LIVE_METHODS:
            raise ValueError(f"the {config.ordering} ordering runs {', '.join(LIVE_METHODS)}, not {method!r}")
        live = LiveConfig(ticks=config.epochs * ticks_per_epoch, eval_every_ticks=ticks_per_epoch,
                          ordering=config.ordering, lag_ticks=config.delay_ticks, out_of_phase=config.out_of_phase,
                          seed=config.seed, speed_range=config.speed_range)
        return simulate_live(nodes, oracles, rebuild, evaluate, live).metrics
    sim = SimConfig(ticks=config.epochs * ticks_per_epoch, eval_every_ticks=ticks_per_epoch, seed=config.seed,
                    speed_range=config.speed_range, delay_ticks=config.delay_ticks)
    return simulate(nodes, oracles, rebuild, evaluate, sim, hook).metrics


def _run_reference(model: FlatClassifier, initial: torch.Tensor, lr: float, problem: Problem, config: StudyConfig,
                   evaluate: Callable[[Mapping[str, torch.Tensor]], float]) -> list[float]:
    everything = np.concatenate(problem.shards)
    oracle = BatchOracle(model, problem.x_train[everything], problem.y_train[everything], config.batch_size,
                         seed=config.seed)
    steps_per_epoch = math.ceil(len(everything) / config.batch_size)
    params, curve = initial.clone(), [evaluate({"single": initial})]
    for _ in range(config.epochs):
        for _ in range(steps_per_epoch):
            params = params - lr * oracle(params)[1]
        curve.append(evaluate({"single": params}))
    return curve


def tune(method: str, model_name: str, config: StudyConfig, grid: tuple[float, ...] = STEP_SIZE_GRID,
         problem: Problem | None = None) -> tuple[float, dict[float, float]]:
    """The step size of ``grid`` with the best validation accuracy (mean of the last 3 epochs)."""
    problem = problem or load_problem(config, validation=True)
    scores = {step: float(np.mean(run_method(method, model_name, step, problem, config)[-3:])) for step in grid}
    return max(scores, key=lambda step: (scores[step], -step)), scores


def with_overrides(config: StudyConfig, **changes) -> StudyConfig:
    return replace(config, **changes)


# Chosen by `python -m benchmarks.convergence_ecl --tune` (validation split, seed 0, 200 epochs,
# random graph, K = 8); the full report is in docs/ECL.md. Same grid for every method.
TUNED_STEP_SIZES: dict[str, dict[str, float]] = {
    "reference": {"softmax": 0.1, "mlp": 0.1},
    "pdmm_isvr": {"softmax": 0.8, "mlp": 0.8},
    "admm_isvr": {"softmax": 0.8, "mlp": 1.6},
    "dsgd": {"softmax": 0.8, "mlp": 1.6},
    "gossip_constant": {"softmax": 0.8, "mlp": 1.6},
    "gossip_clock": {"softmax": 0.8, "mlp": 1.6},
    "best_model": {"softmax": 1.6, "mlp": 0.4},
}
