"""Baselines for the convergence study: pair-wise gossip (Dpwa) and best-model exchange (NetTorrent).

The decisions are plain functions over tensors and numbers so the networked versions (another
module) can reuse them; the node classes wrap them in the same interface as ``updates.py`` so the
simulation harness runs every method the same way.

- Dpwa: on an exchange with a peer, ``p <- f * peer + (1 - f) * p`` with f constant (0.5 averages)
  or by clock, ``f = peer_clock / (clock + peer_clock)``, the clock (samples trained into the copy)
  merging the same way: ``clock <- f * peer_clock + (1 - f) * clock``.
- Best-model exchange, two rules:
  - ``BestModelExchange`` (the old rule, kept as the study's baseline): every N samples the peer with
    the best (self-reported) loss EMA shares its weights and the others adopt them when it is better
    than theirs by a relative margin.
  - ``ValidatedExchange`` (the networked rule, swarm/averaging/agent.py): every N samples each node
    scores ``candidates`` random peers' copies and its own on a validation set every node has, and
    adopts the best one when it beats its own by the margin (``draw_candidates``, ``exchange_winner``
    are the functions the swarm uses).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from swarm.ecl.graph import PeerGraph
from swarm.ecl.updates import BadMessageError, check_message

DEFAULT_CONSTANT_FACTOR = 0.5
Interpolation = Literal["constant", "clock"]


# ----- pure decisions
def clock_factor(clock: float, peer_clock: float) -> float:
    """Weight of the peer's copy: the share of all samples it has seen; 0.5 when neither saw any."""
    if clock < 0 or peer_clock < 0:
        raise ValueError(f"clocks count samples and cannot be negative, got {clock} and {peer_clock}")
    total = clock + peer_clock
    return DEFAULT_CONSTANT_FACTOR if total == 0 else peer_clock / total


def interpolate(params: torch.Tensor, peer_params: torch.Tensor, factor: float) -> torch.Tensor:
    """``factor * peer + (1 - factor) * params``."""
    if not 0.0 <= factor <= 1.0:
        raise ValueError(f"interpolation factor must be within [0, 1], got {factor}")
    return torch.lerp(params, peer_params, factor)


def merged_clock(clock: float, peer_clock: float, factor: float) -> float:
    return factor * peer_clock + (1.0 - factor) * clock


def best_peer(loss_ema_by_peer: Mapping[str, float]) -> str | None:
    """The peer with the lowest finite loss EMA (ties: the smallest id), or None if there is none."""
    finite = [(loss, peer) for peer, loss in loss_ema_by_peer.items() if math.isfinite(loss)]
    return min(finite)[1] if finite else None


def should_adopt(own_loss_ema: float, best_loss_ema: float, margin: float) -> bool:
    """Adopt only a copy whose loss EMA beats ours by the relative ``margin`` (unknown own loss: adopt)."""
    if not math.isfinite(best_loss_ema):
        return False
    if not math.isfinite(own_loss_ema):
        return True
    return best_loss_ema < own_loss_ema * (1.0 - margin)


def draw_candidates(peers: Sequence[str], rng: random.Random, count: int) -> list[str]:
    """``count`` of ``peers`` drawn at random (all of them when fewer): whose copies an exchange scores."""
    ordered = sorted(peers)
    return rng.sample(ordered, min(count, len(ordered)))


def exchange_winner(own_loss: float, scores: Mapping[str, float], margin: float) -> str | None:
    """The candidate to adopt: the lowest loss (ties: the smallest id) if it beats ``own_loss`` by the
    relative ``margin``; None keeps our copy. A non-finite loss loses; a non-finite own loss adopts
    any finite winner."""
    best = best_peer(dict(scores))
    if best is None or not should_adopt(own_loss, scores[best], margin):
        return None
    return best


# ----- nodes for the simulation harness
@dataclass(frozen=True, slots=True)
class GossipMessage:
    params: torch.Tensor
    clock: float


class GossipNode:
    """Local SGD plus Dpwa interpolation with whichever neighbours exchanged this tick."""

    def __init__(self, peer_id: str, params: torch.Tensor, graph: PeerGraph, lr: float, samples_per_step: int,
                 interpolation: Interpolation = "constant", constant_factor: float = DEFAULT_CONSTANT_FACTOR):
        if not lr > 0 or samples_per_step < 1:
            raise ValueError(f"GossipNode needs lr > 0 and samples_per_step >= 1, got {lr}, {samples_per_step}")
        if interpolation not in ("constant", "clock"):
            raise ValueError(f"unknown interpolation {interpolation!r}: use 'constant' or 'clock'")
        self.peer_id = peer_id
        self.params = params.detach().clone()
        self.lr = lr
        self.samples_per_step = samples_per_step
        self.interpolation = interpolation
        self.constant_factor = constant_factor
        self.clock = 0.0
        self.neighbours: tuple[str, ...] = ()
        self.set_graph(graph)

    def set_graph(self, graph: PeerGraph) -> None:
        self.neighbours = graph.neighbours(self.peer_id)

    def step(self, grad: torch.Tensor) -> None:
        self.params = self.params - self.lr * grad
        self.clock += self.samples_per_step

    def make_message(self, peer: str) -> GossipMessage:
        return GossipMessage(self.params.clone(), self.clock)

    def on_messages(self, messages: Mapping[str, GossipMessage]) -> None:
        for sender, message in messages.items():
            if sender not in self.neighbours:
                raise BadMessageError(f"message from {sender!r}, which is not a neighbour of {self.peer_id!r}")
            check_message(self.params, message.params, sender)
        for message in messages.values():
            if self.interpolation == "clock":
                factor = clock_factor(self.clock, message.clock)
                self.clock = merged_clock(self.clock, message.clock, factor)
            else:
                factor = self.constant_factor
            self.params = interpolate(self.params, message.params, factor)


class SgdNode:
    """Plain local SGD with no edge messages: the node of the best-model-exchange baseline, whose
    exchanges are swarm-wide (``BestModelExchange`` below, run as the simulation's swarm hook)."""

    def __init__(self, peer_id: str, params: torch.Tensor, graph: PeerGraph, lr: float):
        if not lr > 0:
            raise ValueError(f"SgdNode lr must be positive, got {lr}")
        self.peer_id = peer_id
        self.params = params.detach().clone()
        self.lr = lr

    def set_graph(self, graph: PeerGraph) -> None:
        """Best-model exchange ignores the graph."""

    def step(self, grad: torch.Tensor) -> None:
        self.params = self.params - self.lr * grad

    def make_message(self, peer: str) -> torch.Tensor:
        return self.params.clone()

    def on_messages(self, messages: Mapping[str, torch.Tensor]) -> None:
        """Edge exchanges carry nothing for this method."""

    def adopt(self, params: torch.Tensor, factor: float = 1.0) -> None:
        check_message(self.params, params, "the best peer")
        self.params = interpolate(self.params, params, factor)


class BestModelExchange:
    """Swarm hook for ``simulate``: every ``every_samples`` samples of a full-speed node, every node
    whose loss EMA the best one beats by ``margin`` adopts the best node's weights."""

    def __init__(self, every_samples: int, samples_per_step: int, margin: float = 0.0, factor: float = 1.0):
        if every_samples < samples_per_step or samples_per_step < 1:
            raise ValueError(f"every_samples ({every_samples}) must be at least samples_per_step ({samples_per_step})")
        self.every_ticks = every_samples // samples_per_step
        self.margin = margin
        self.factor = factor

    def __call__(self, tick: int, nodes: Mapping[str, SgdNode], loss_emas: Mapping[str, float]) -> None:
        if (tick + 1) % self.every_ticks:
            return
        best = best_peer({peer: loss_emas.get(peer, math.inf) for peer in nodes})
        if best is None:
            return
        best_params = nodes[best].params.clone()
        for peer, node in nodes.items():
            if peer != best and should_adopt(loss_emas.get(peer, math.inf), loss_emas[best], self.margin):
                node.adopt(best_params, self.factor)


class ValidatedExchange:
    """Swarm hook for ``simulate``: the networked rule. Every ``every_samples`` samples of a full-speed
    node, each node scores its own copy and ``candidates`` random peers' copies with ``score`` (a loss
    on a validation set every node has) and adopts the winner of ``exchange_winner``. All nodes decide
    on the copies as they were when the exchange began. ``adoptions`` counts the adoptions."""

    def __init__(self, every_samples: int, samples_per_step: int, score: Callable[[torch.Tensor], float],
                 candidates: int = 2, margin: float = 0.0, factor: float = 1.0, seed: int = 0):
        if every_samples < samples_per_step or samples_per_step < 1 or candidates < 1:
            raise ValueError(f"every_samples ({every_samples}) must be at least samples_per_step "
                             f"({samples_per_step}), and candidates ({candidates}) at least 1")
        self.every_ticks = every_samples // samples_per_step
        self.score = score
        self.candidates = candidates
        self.margin = margin
        self.factor = factor
        self.rng = random.Random(seed)
        self.adoptions = 0
        self.exchanges = 0

    def __call__(self, tick: int, nodes: Mapping[str, SgdNode], loss_emas: Mapping[str, float]) -> None:
        if (tick + 1) % self.every_ticks:
            return
        params = {peer: node.params.clone() for peer, node in nodes.items()}
        scores = {peer: self.score(p) for peer, p in params.items()}
        for peer, node in nodes.items():
            others = draw_candidates([p for p in nodes if p != peer], self.rng, self.candidates)
            winner = exchange_winner(scores[peer], {p: scores[p] for p in others}, self.margin)
            self.exchanges += 1
            if winner is not None:
                node.adopt(params[winner], self.factor)
                self.adoptions += 1
