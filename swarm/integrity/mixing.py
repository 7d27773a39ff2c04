"""Bounded influence of one peer on our copy through averaging: how far a pull or a message may move it.

Every averaging step has the form ``ours <- ours + w * (theirs - ours)``: a Dpwa pull (``w`` the
interpolation factor, ``ours`` our parameters), a best-model adoption (``w = exchange.factor``), a
DSGD message (``w`` the mixing weight) and an ECL message (``ours`` the edge's dual, ``w = theta``).
Whatever ``theirs`` is, the step ``w * d`` with ``d = theirs - ours`` is bounded here, over plain
numbers (norms, a history, a time):

1. **Rejected** (and the sender banned for ``averaging.ban_s`` by the caller): ``||d||`` is not
   finite, or over ``max_distance_ratio * ||ours||`` (no honest peer of the swarm is that far: peers
   start from the same seeded weights or a newcomer's download, and averaging keeps them together),
   or over ``outlier_multiplier`` times the typical distance (centered clipping's outlier).
2. **Clipped** (centered clipping, Karimireddy, He & Jaggi 2021): ``d`` is scaled down so that
   ``||d|| <= clip_multiplier * typical`` and ``w * ||d|| <= max_step_ratio * ||ours||`` and
   ``w * ||d||`` fits the peer's budget when one is set: everything that peer moved our copy within
   ``window_s`` stays under ``max_drift_ratio * ||ours||``. Off by default (honest steps go back and
   forth, so their sum grows with the pull rate); the bound per unit of time is then the step cap
   times the peer's fair share of the pulls (``InfluenceLedger.over_share``).

3. **Per tensor**: the step of each tensor is also at most ``max_step_ratio`` of that tensor's norm
   (``tensor_scales``), so the whole allowance cannot be spent on one small tensor (an output bias);
   a tensor near zero counts with its share of the total norm, ``||ours|| * sqrt(numel / total)``.

4. **Norm growth per window**, against the copy's own history, whoever the senders are: the growth of our
   copy's norm by averaging within ``window_s`` is at most ``MAX_GROWTH_RATIO`` of its norm (``GrowthLedger``;
   a step is shortened along its own direction so that the norm after it fits, ``growth_scale``). Honest
   mixing is a convex combination and grows no norm past the larger of the two copies', so it hardly spends
   this; a partner that pushes the same way on every pull spends it at once. Measured before it (issue 25):
   66 such pulls at 0.45 of the norm took a copy's norm from 8.2 to 2,271, every pull within the per-pull caps.

``typical`` is the median of the last ``history`` accepted distances, at least ``floor_ratio *
||ours||``, and unknown until ``min_history`` were accepted (then only the ratio limits apply). The
accepted distances are recorded unclipped, so the bound follows honest copies drifting apart; an
attacker can only shift the median if it supplies half the history, which the fair share of pulls
(``InfluenceLedger.over_share``) prevents while the swarm has two other peers or more.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from swarm.run.runconfig import InfluenceConfig

NORM_FLOOR = 1e-6  # a copy whose norm is ~0 is measured against this instead
MIN_FREE_PULLS = 2  # pulls per window any peer gets before the fair share counts
SPENT_BUDGET_STEPS = 0.01  # a budget below this fraction of one full step counts as spent (no crumbs)
MAX_GROWTH_RATIO = 0.1  # averaging may grow a copy's norm by this fraction per window_s (60 s), all senders together


@dataclass(frozen=True, slots=True)
class MixVerdict:
    """What to do with one copy or message: reject it, or apply ``scale * d`` (``scale`` in [0, 1])."""

    scale: float
    reason: str = ""  # why it was clipped or rejected; empty when applied whole
    rejected: bool = False
    far: bool = False  # rejected only for its distance: the caller may vouch for it on data (agent.py)

    @property
    def clipped(self) -> bool:
        return not self.rejected and self.scale < 1.0


def typical_distance(history: Sequence[float], reference_norm: float, cfg: InfluenceConfig) -> float | None:
    """The median accepted distance (at least ``floor_ratio`` of our norm), or None while too few."""
    if len(history) < cfg.min_history:
        return None
    return max(statistics.median(history), cfg.floor_ratio * max(reference_norm, NORM_FLOOR))


def judge_mix(distance: float, weight: float, reference_norm: float, history: Sequence[float],
              budget_left: float, cfg: InfluenceConfig) -> MixVerdict:
    """The verdict on a difference of norm ``distance`` applied with ``weight`` (see the module doc).

    ``budget_left``: how much more the sender may move our copy within the window (absolute norm).
    A scale of 0 means the budget is spent: skip it, nothing is wrong with the sender.
    """
    ref = max(reference_norm, NORM_FLOOR)
    if not math.isfinite(distance) or not math.isfinite(weight):
        return MixVerdict(0.0, "its difference from our copy is not finite", rejected=True)
    if distance > cfg.max_distance_ratio * ref:
        return MixVerdict(0.0, f"its copy is {distance / ref:.2f} of our norm away from ours; the limit is "
                               f"averaging.influence.max_distance_ratio = {cfg.max_distance_ratio:g}", rejected=True,
                          far=True)
    typical = typical_distance(history, ref, cfg)
    if typical is not None and distance > cfg.outlier_multiplier * typical:
        return MixVerdict(0.0, f"its copy is {distance / typical:.0f}x farther from ours than the recent median "
                               f"({typical:.3g}); the limit is averaging.influence.outlier_multiplier = "
                               f"{cfg.outlier_multiplier:g}", rejected=True, far=True)
    if weight <= 0 or distance <= 0:
        return MixVerdict(1.0)
    if budget_left < SPENT_BUDGET_STEPS * cfg.max_step_ratio * ref:
        return MixVerdict(0.0, f"its budget per {cfg.window_s:g} s is spent (max_drift_ratio)")
    limits = [(cfg.max_step_ratio * ref / weight, "max_step_ratio"),
              (max(0.0, budget_left) / weight, f"its budget per {cfg.window_s:g} s (max_drift_ratio)")]
    if typical is not None:
        limits.append((cfg.clip_multiplier * typical, "clip_multiplier x the recent median"))
    bound, reason = distance, ""
    for limit, name in limits:
        if limit < bound:
            bound, reason = limit, name
    return MixVerdict(bound / distance, reason)


def tensor_scales(distances: Mapping[str, float], norms: Mapping[str, float], numels: Mapping[str, int],
                  weight: float, scale: float, cfg: InfluenceConfig) -> dict[str, float]:
    """Per tensor, the scale of its difference: ``scale``, lowered where ``weight * scale * distance``
    would exceed ``max_step_ratio`` of the tensor's norm (at least its share of the total norm)."""
    total_norm = math.sqrt(sum(n * n for n in norms.values()))
    total_numel = max(1, sum(numels.values()))
    out = {}
    for name, dist in distances.items():
        share = total_norm * math.sqrt(numels[name] / total_numel)
        cap = cfg.max_step_ratio * max(norms[name], share, NORM_FLOOR)
        out[name] = scale if weight <= 0 or weight * scale * dist <= cap else cap / (weight * dist)
    return out


@dataclass(slots=True)
class InfluenceLedger:
    """Per peer, when and how far its accepted copies or messages moved ours, over the last window.

    Plain bookkeeping: the caller passes ``now`` (monotonic seconds), so it is tested without clocks.
    """

    window_s: float
    moves: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)

    def _recent(self, peer: str, now: float) -> deque[tuple[float, float]]:
        entries = self.moves.get(peer)
        if entries is None:
            return deque()
        while entries and entries[0][0] <= now - self.window_s:
            entries.popleft()
        if not entries:
            del self.moves[peer]
        return entries

    def record(self, peer: str, now: float, step_norm: float) -> None:
        self._recent(peer, now)
        self.moves.setdefault(peer, deque()).append((now, max(0.0, step_norm)))

    def moved(self, peer: str, now: float) -> float:
        """How far ``peer`` moved our copy within the window (sum of step norms)."""
        return sum(step for _, step in self._recent(peer, now))

    def count(self, peer: str, now: float) -> int:
        return len(self._recent(peer, now))

    def budget_left(self, peer: str, now: float, reference_norm: float, cfg: InfluenceConfig) -> float:
        """What ``peer`` may still move our copy by within the window (inf when the budget is off)."""
        if cfg.max_drift_ratio <= 0:
            return math.inf
        return cfg.max_drift_ratio * max(reference_norm, NORM_FLOOR) - self.moved(peer, now)

    def over_share(self, peer: str, candidates: Iterable[str], now: float, slack: float) -> bool:
        """True when ``peer`` had more than ``slack`` times its fair share of the window's steps."""
        peers = set(candidates) | {peer}
        counts = {p: self.count(p, now) for p in peers}
        fair = sum(counts.values()) / len(peers)
        return counts[peer] >= max(MIN_FREE_PULLS, slack * fair)


def growth_scale(own_sq: float, dot: float, step_sq: float, own_norm: float, growth_left: float) -> float:
    """The largest ``s`` in [0, 1] with ``||own + s * step|| <= own_norm + max(growth_left, 0)``, given
    ``own_sq = ||own||^2``, ``dot = <own, step>`` and ``step_sq = ||step||^2``: how much of an averaging step fits
    what is left of the window's norm growth. A step that does not grow the norm is not shortened."""
    if step_sq <= 0.0 or not math.isfinite(step_sq) or not math.isfinite(dot):
        return 1.0
    limit = own_norm + max(growth_left, 0.0)
    if own_sq + 2.0 * dot + step_sq <= limit * limit:
        return 1.0
    # s^2 * step_sq + 2 s * dot + (own_sq - limit^2) <= 0; own_sq <= limit^2, so the root is real and >= 0
    disc = max(dot * dot - step_sq * (own_sq - limit * limit), 0.0)
    return min(1.0, max(0.0, (-dot + math.sqrt(disc)) / step_sq))


@dataclass(slots=True)
class GrowthLedger:
    """How much averaging grew our copy's norm within the last window (positive growths only, any sender),
    against the smallest norm the copy had before a step of the window: the bound does not compound."""

    window_s: float
    growths: deque[tuple[float, float, float]] = field(default_factory=deque)  # (time, growth, norm before)

    def left(self, now: float, own_norm: float, ratio: float = MAX_GROWTH_RATIO) -> float:
        while self.growths and self.growths[0][0] <= now - self.window_s:
            self.growths.popleft()
        base = min([own_norm, *(before for _, _, before in self.growths)])
        return ratio * max(base, NORM_FLOOR) - sum(g for _, g, _ in self.growths)

    def record(self, now: float, growth: float, norm_before: float = math.inf) -> None:
        if growth > 0.0:
            self.growths.append((now, growth, norm_before))
