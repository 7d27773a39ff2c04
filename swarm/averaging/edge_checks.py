"""What an edge message must pass before the edge modes (edges.py) apply it: its norm, then the bounds.

- **Norm.** A message whose norm is over ``averaging.max_norm_ratio`` times the larger of our copy's
  and our own message's on that edge is refused (``norm_problem``).
- **Bounded influence.** A message moves its reference by ``w * (message - reference)``: DSGD our
  parameters (``w`` the mixing weight), ECL the edge's dual (``w = theta``; the dual enters the
  primal step divided by ``1/mu + eta E``, so bounding the dual's move bounds the copy's). For DSGD
  that difference goes through an ``InfluenceGuard`` (influence.py, rules in
  swarm/integrity/mixing.py): an outlier is rejected like a bad message, a larger step is clipped
  (the message moved toward the reference), and a sender whose budget for the window is spent is
  skipped (``bound_message``). Honest messages sit well inside the bounds, so the math is unchanged
  for them. ECL duals keep the norm check only (see ``bound_message`` for why).
- **What the duals do to the copy, over time** (``bound_dual_pull``). A dual is not clipped, but its effect on
  the primal step is bounded against the copy's own history, as averaging's is (mixing.py item 4): the part of
  ECL's step that the duals make (the step minus where it would land if every dual were neutral) may grow the
  copy's norm by at most ``DUAL_GROWTH_RATIO`` of it per window, net, all neighbours together; past that it is
  shortened along its own direction. A neighbour whose messages always sit at the norm check's edge could
  otherwise grow the copy without end (the check is relative to our own norm: each step allowed the next to be
  larger; a poisoned PDMM ring went 0.93 -> 0.10). Honest duals pull copies together and rarely grow a norm.

Both run on the compute thread or an answering worker thread, under the stage's lock.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from swarm.averaging.influence import InfluenceGuard, flat_scales
from swarm.integrity.mixing import growth_scale
from swarm.ecl.updates import BadMessageError, DsgdNode, EclNode
from swarm.run.runconfig import InfluenceConfig

logger = logging.getLogger(__name__)

NORM_FLOOR = 1e-6
# The duals may grow the copy's norm by this fraction per window, net (``DualGrowth``). Measured on the ECL study
# (`benchmarks.convergence_ecl --epochs 24 --nodes 4 --classes-per-shard 5`, the bound applied to every node at 10,
# 30 and 100 steps a second): at 0.25 no honest step was ever shortened and every method's accuracy was unchanged;
# at 0.1 net, 208 of 8,040 PDMM steps were shortened (softmax 0.94 -> 0.85); counting only growths at 0.1, 721
# (mlp 0.95 -> 0.81). A neighbour at the norm check's edge overflowed a copy within 60 s without the bound.
DUAL_GROWTH_RATIO = 0.25


@dataclass(frozen=True, slots=True)
class Bounded:
    """The message to apply (None: its sender is over its budget, apply nothing), and whether it was clipped."""

    message: torch.Tensor | None
    clipped: bool = False


def norm_problem(node: EclNode | DsgdNode, sender: str, message: torch.Tensor, max_norm_ratio: float) -> str | None:
    """Why ``message`` is too large to apply (its norm against our copy and our message), or None."""
    own_norm = max(float(node.params.norm()), NORM_FLOOR)
    bound = max_norm_ratio * max(own_norm, float(node.make_message(sender).norm()))
    norm = float(message.norm())
    if norm > bound:
        return f"its norm {norm:.3g} is over {max_norm_ratio:g} times ours"
    return None


@dataclass(slots=True)
class DualGrowth:
    """The net growth of our copy's norm that the duals made within the last window (signed: PDMM's duals swing, and
    an honest pull that grows the norm now shrinks it a few steps later; counting only the growths shortened honest
    PDMM steps 721 times in 8,040 and took a skewed 4-node ring from 0.95 to 0.81 of accuracy), against the smallest
    norm the copy had before a step of the window. Across windows the bound compounds (1.25x a minute at most)."""

    window_s: float
    ratio: float = DUAL_GROWTH_RATIO
    bucket_s: float = 0.5  # steps are summed per bucket: at most window_s / bucket_s entries, whatever the rate
    # (bucket start, net growth within it, smallest norm before a step of it)
    buckets: deque[list[float]] = field(default_factory=deque)

    def left(self, now: float, own_norm: float) -> float:
        while self.buckets and self.buckets[0][0] <= now - self.window_s:
            self.buckets.popleft()
        base = min([own_norm, *(b[2] for b in self.buckets)])
        return self.ratio * max(base, NORM_FLOOR) - sum(b[1] for b in self.buckets)

    def record(self, now: float, growth: float, norm_before: float) -> None:
        if self.buckets and now - self.buckets[-1][0] < self.bucket_s:
            last = self.buckets[-1]
            last[1] += growth
            last[2] = min(last[2], norm_before)
        else:
            self.buckets.append([now, growth, norm_before])


def bound_dual_pull(node: EclNode, before: torch.Tensor, grad: torch.Tensor, growth: DualGrowth, now: float) -> float:
    """After ``node.step(grad)`` from ``before``: shorten the duals' part of the step so that the window's net norm
    growth by the duals stays within ``growth.ratio`` of the copy's norm. Returns the share of it kept (1.0:
    untouched)."""
    if not node.duals:
        return 1.0
    denominator = 1.0 / node.config.mu + node.config.eta * len(node.duals)
    # every dual neutral (-A_ij w_i) pulls nothing: the step is then ``before - grad / denominator``
    base = before - grad / denominator
    pull = node.params - base
    b, m = base.double(), pull.double()
    own_sq, dot, step_sq = float(b.pow(2).sum()), float((b * m).sum()), float(m.pow(2).sum())
    own_norm = own_sq ** 0.5
    share = growth_scale(own_sq, dot, step_sq, own_norm, growth.left(now, own_norm))
    if share < 1.0:
        node.params = base + share * pull
    growth.record(now, max(0.0, own_sq + 2 * share * dot + share * share * step_sq) ** 0.5 - own_norm, own_norm)
    return share


def bound_message(node: EclNode | DsgdNode, sender: str, message: torch.Tensor, guard: InfluenceGuard,
                  numels: list[int], influence: InfluenceConfig, now: float) -> Bounded:
    """The message, or one moved toward its reference so its step fits the bounds; ``Bounded(None)``
    when the sender is over its budget. Raises BadMessageError for an outlier."""
    if isinstance(node, DsgdNode):
        reference, weight = node.params, node.weights[sender]
    else:
        reference, weight = node.duals[sender], node.config.theta
    if message.shape != reference.shape or message.dtype != reference.dtype:
        return Bounded(message)  # the node's own check refuses it
    # ECL duals are neither clipped nor judged as outliers here: a clipped dual no longer tracks the
    # edge constraint (clipping honest duals at 5 % of the norm took PDMM-ISVR from 0.98 to 0.72 of
    # the local reference), and judging them by distance rejected honest neighbours of a 3-peer PDMM
    # ring until its copies drifted apart (tests/test_edges_swarm.py). Duals keep the checks of
    # edge_rpc (finite, norm ratio); a tighter bound on a dual's effect is open work.
    if isinstance(node, EclNode):
        return Bounded(message)
    difference = message - reference
    dist = float(difference.double().norm())
    verdict = guard.judge(sender, dist, weight, float(node.params.double().norm()), now)
    if verdict.rejected:
        raise BadMessageError(verdict.reason)
    if verdict.scale <= 0.0:
        return Bounded(None)
    factors, step = flat_scales(node.params, difference, numels, weight, verdict.scale, influence)
    bounded = difference if factors is None else factors * difference
    own = node.params.double()
    moved = weight * bounded.double()  # the step a DSGD message makes: params + weight * (message - params)
    share = guard.fit_growth(float(own.pow(2).sum()), float((own * moved).sum()), float(moved.pow(2).sum()), now)
    guard.accepted(sender, dist, step * share, now, factors is not None or share < 1.0)
    if factors is None and share >= 1.0:
        return Bounded(message)
    logger.info("clipped an edge message from %s: distance %.3g, step %.3g (%s)", sender[-8:], dist, step * share,
                verdict.reason or ("max_step_ratio per tensor" if share >= 1.0 else "the window's norm growth"))
    return Bounded(reference + share * bounded, clipped=True)
