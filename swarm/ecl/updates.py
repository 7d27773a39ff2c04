"""Per-node state and updates of DSGD and ECL-ISVR (PDMM-ISVR, ADMM-ISVR), over flat parameter vectors.

One node = one peer. A node never talks to anyone: the caller (the simulation harness now, a swarm
peer later) computes the gradient, calls ``step``, asks ``make_message(peer)`` for what to send on an
edge when that edge's exchange is due, and hands what arrived to ``on_messages``. When the peer graph
is rebuilt (a peer joined or left) the caller passes the new graph to ``set_graph``. No globals, no
I/O, no clocks: the same class runs in the single-process simulation and in a networked peer.

ECL-ISVR (Niwa et al., ICML 2021, Algorithm 1), node i with neighbours j in E_i, edge sign
s_ij = +1 if i < j else -1 (A_{i|j} = s_ij I), step size mu, constraint strength eta:

    primal  w_i <- argmin_w <g_i, w> + |w - w_i|^2 / (2 mu) + sum_j <z_ij, A_ij w> + eta/2 sum_j |A_ij w|^2
               = (w_i / mu - g_i - sum_j s_ij z_ij) / (1/mu + eta |E_i|)
    message y_ij = z_ij + 2 eta s_ij w_i                 (sent to j)
    dual    z_ij <- (1 - theta) z_ij + theta y_ji        (on receiving j's message)

theta = 1 is PDMM (Peaceman-Rachford splitting of the dual), theta = 1/2 is ADMM (Douglas-Rachford).
The dual is stored and sent divided by eta (``u_ij = z_ij / eta``, in the units of the parameters),
as the authors' code does: with one common eta the two forms are the same algorithm; with per-node
etas (the authors' choice, ``reference_eta``) the scaled form still reaches consensus but, as
docs/ECL.md measures, at a biased point; use ``common_eta`` for every node of a graph.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from swarm.ecl.graph import PeerGraph, edge_sign

PDMM_THETA = 1.0
ADMM_THETA = 0.5
MixingWeights = Literal["metropolis", "uniform"]
DualInit = Literal["neutral", "zero"]


class BadMessageError(ValueError):
    """A message that must not be applied: unknown sender, wrong shape or dtype, or not finite."""


def check_message(own: torch.Tensor, message: torch.Tensor, sender: str) -> None:
    """Raise BadMessageError unless ``message`` is a finite tensor shaped like ``own``."""
    if not isinstance(message, torch.Tensor):
        raise BadMessageError(f"message from {sender!r} is a {type(message).__name__}, not a tensor")
    if message.shape != own.shape or message.dtype != own.dtype:
        raise BadMessageError(
            f"message from {sender!r} has shape {tuple(message.shape)} and dtype {message.dtype}; "
            f"expected {tuple(own.shape)} and {own.dtype}"
        )
    if not torch.isfinite(message).all():
        raise BadMessageError(f"message from {sender!r} holds NaN or infinite values")


class DecentralizedNode(Protocol):
    """What the simulation harness (and later a swarm peer) calls on a node."""

    peer_id: str
    params: torch.Tensor

    def step(self, grad: torch.Tensor) -> None: ...

    def make_message(self, peer: str) -> Any: ...

    def on_messages(self, messages: Mapping[str, Any]) -> None: ...

    def set_graph(self, graph: PeerGraph) -> None: ...


# ----- ECL-ISVR
@dataclass(frozen=True, kw_only=True, slots=True)
class EclConfig:
    mu: float  # step size of the linearised proximal primal update (the paper's mu, the code's lr)
    eta: float  # constraint strength; give every node of a graph the same value (see common_eta)
    theta: float = PDMM_THETA  # dual averaging: 1 = PDMM-ISVR, 1/2 = ADMM-ISVR
    dual_init: DualInit = "neutral"  # a new edge's dual: "neutral" (-A_ij w_i) or "zero" (the paper's)

    def __post_init__(self) -> None:
        if not self.mu > 0:
            raise ValueError(f"EclConfig.mu must be positive, got {self.mu}")
        if not self.eta > 0:
            raise ValueError(f"EclConfig.eta must be positive, got {self.eta}")
        if not 0 < self.theta <= 1:
            raise ValueError(f"EclConfig.theta must be within (0, 1] (1 = PDMM, 0.5 = ADMM), got {self.theta}")
        if self.dual_init not in ("neutral", "zero"):
            raise ValueError(f"EclConfig.dual_init must be 'neutral' or 'zero', got {self.dual_init!r}")


def reference_eta(mu: float, period_steps: int, degree: float, piw: float = 1.0) -> float:
    """The per-node eta_i of the authors' code (nttcslab/ecl-isvr, edgecons/ecl.py):
    ``piw / (mu (K E_i + K - piw E_i))``, K the exchange period, E_i the node's degree. ``piw`` is 1 in
    their run scripts for both PDMM-ISVR and ADMM-ISVR (2 switches on their dual averaging)."""
    denominator = mu * (period_steps * degree + period_steps - piw * degree)
    if degree <= 0 or denominator <= 0:
        raise ValueError(
            f"reference eta is undefined for degree {degree}, period {period_steps}, piw {piw}: "
            f"it needs K (E + 1) > piw E"
        )
    return piw / denominator


def common_eta(mu: float, graph: PeerGraph, scale: float = 1.0) -> float:
    """One eta for every node: the reference formula at the graph's mean degree, times ``scale``.
    Every peer computes the same graph, so every peer computes the same value."""
    if not graph.edges:
        raise ValueError("common_eta needs a graph with at least one edge")
    mean_degree = 2 * len(graph.edges) / len(graph.peers)
    return scale * reference_eta(mu, graph.period_steps, mean_degree)


class EclNode:
    """One peer's ECL-ISVR state: its parameters and one (scaled) dual variable per edge."""

    def __init__(self, peer_id: str, params: torch.Tensor, graph: PeerGraph, config: EclConfig):
        self.peer_id = peer_id
        self.config = config
        self.params = params.detach().clone()
        self.duals: dict[str, torch.Tensor] = {}
        self._signs: dict[str, float] = {}
        self.set_graph(graph)

    def set_graph(self, graph: PeerGraph) -> None:
        """Adopt a rebuilt graph: edges that survive keep their dual, new edges start from ``new_dual``."""
        neighbours = graph.neighbours(self.peer_id)
        self._signs = {j: edge_sign(self.peer_id, j) for j in neighbours}
        self.duals = {j: self.duals[j] if j in self.duals else self.new_dual(j) for j in neighbours}

    def new_dual(self, peer: str) -> torch.Tensor:
        """A new edge's (scaled) dual. ``zero`` is the paper's start: until the neighbour's first message
        arrives, the constraint term then pulls our copy toward 0 by a factor 1 / (1 + mu eta E) per
        step. ``neutral`` starts at ``-A_ij w_i``, the dual that pulls nothing (as if the neighbour held
        our copy), which is also what the neighbour's first message sets when the copies agree; a
        networked edge whose first message takes tens of steps needs it (docs/ECL.md measures both)."""
        if self.config.dual_init == "zero":
            return torch.zeros_like(self.params)
        return -self._signs[peer] * self.params

    def step(self, grad: torch.Tensor) -> None:
        """The primal update: one linearised proximal step pulled towards the edge constraints."""
        mu, eta = self.config.mu, self.config.eta
        pull = torch.zeros_like(self.params)
        for j, dual in self.duals.items():
            pull.add_(dual, alpha=self._signs[j])
        numerator = self.params / mu - grad - eta * pull
        self.params = numerator / (1.0 / mu + eta * len(self.duals))

    def make_message(self, peer: str) -> torch.Tensor:
        """y_{i|j} / eta for neighbour ``peer``, from the current parameters and dual."""
        if peer not in self.duals:
            raise BadMessageError(f"{peer!r} is not a neighbour of {self.peer_id!r} in the current graph")
        return self.duals[peer] + 2.0 * self._signs[peer] * self.params

    def on_messages(self, messages: Mapping[str, torch.Tensor]) -> None:
        """The dual update for each neighbour whose message arrived; all are checked before any is applied."""
        for sender, message in messages.items():
            if sender not in self.duals:
                raise BadMessageError(f"message from {sender!r}, which is not a neighbour of {self.peer_id!r}")
            check_message(self.params, message, sender)
        theta = self.config.theta
        for sender, message in messages.items():
            self.duals[sender] = (1.0 - theta) * self.duals[sender] + theta * message


# ----- DSGD
def mixing_weights(graph: PeerGraph, peer: str, kind: MixingWeights = "metropolis") -> dict[str, float]:
    """W_ij for the neighbours of ``peer``; W_ii = 1 - sum of these. Metropolis weights
    1 / (1 + max(E_i, E_j)) are symmetric, so mixing keeps the network average; uniform weights
    1 / (E_i + 1) are not when degrees differ."""
    neighbours = graph.neighbours(peer)
    if kind == "metropolis":
        return {j: 1.0 / (1 + max(graph.degree(peer), graph.degree(j))) for j in neighbours}
    if kind == "uniform":
        return {j: 1.0 / (1 + len(neighbours)) for j in neighbours}
    raise ValueError(f"unknown mixing weights {kind!r}: use 'metropolis' or 'uniform'")


def dsgd_mix(
    params: torch.Tensor, neighbour_params: Mapping[str, torch.Tensor], weights: Mapping[str, float]
) -> torch.Tensor:
    """sum_j W_ij w_j with W_ii = 1 - sum_j W_ij, over the neighbours whose parameters are given.

    Given all neighbours this is the synchronous DSGD mixing step; given only the neighbour that just
    exchanged it is the asynchronous, pair-wise variant.
    """
    mixed = params.clone()
    for j, other in neighbour_params.items():
        mixed.add_(other - params, alpha=weights[j])
    return mixed


class DsgdNode:
    """One peer's DSGD state: local SGD steps, and mixing with whichever neighbours exchanged."""

    def __init__(self, peer_id: str, params: torch.Tensor, graph: PeerGraph, lr: float,
                 weights: MixingWeights = "metropolis"):
        if not lr > 0:
            raise ValueError(f"DSGD lr must be positive, got {lr}")
        self.peer_id = peer_id
        self.lr = lr
        self.weights_kind: MixingWeights = weights
        self.params = params.detach().clone()
        self.weights: dict[str, float] = {}
        self.set_graph(graph)

    def set_graph(self, graph: PeerGraph) -> None:
        self.weights = mixing_weights(graph, self.peer_id, self.weights_kind)

    def step(self, grad: torch.Tensor) -> None:
        self.params = self.params - self.lr * grad

    def make_message(self, peer: str) -> torch.Tensor:
        if peer not in self.weights:
            raise BadMessageError(f"{peer!r} is not a neighbour of {self.peer_id!r} in the current graph")
        return self.params.clone()

    def on_messages(self, messages: Mapping[str, torch.Tensor]) -> None:
        for sender, message in messages.items():
            if sender not in self.weights:
                raise BadMessageError(f"message from {sender!r}, which is not a neighbour of {self.peer_id!r}")
            check_message(self.params, message, sender)
        self.params = dsgd_mix(self.params, messages, self.weights)
