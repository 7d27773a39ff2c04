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

Both run on the compute thread or an answering worker thread, under the stage's lock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from swarm.averaging.influence import InfluenceGuard, flat_scales
from swarm.ecl.updates import BadMessageError, DsgdNode, EclNode
from swarm.run.runconfig import InfluenceConfig

logger = logging.getLogger(__name__)

NORM_FLOOR = 1e-6


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
