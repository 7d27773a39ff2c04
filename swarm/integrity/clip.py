"""How large one update may be: centered clipping around the recent accepted ones, and a history-free ceiling.

Centered clipping (Karimireddy, He & Jaggi 2021, "Learning from History for Byzantine Robust
Optimization"): an update whose norm exceeds ``clip_multiplier`` x the median norm of the last
``clip_history`` accepted updates is scaled down to that bound. One message can then do at most a few
honest updates' worth of harm, whatever its size.

Before a history exists (a fresh copy, the first ``MIN_HISTORY`` updates), the bound is a ceiling
that needs none: a plain gradient step ``lr * g`` must not move the copy by more than
``max_step_ratio`` of its norm, i.e. ``||g|| <= max_step_ratio * ||theta|| / lr``. The ceiling also
holds afterwards, so a slow drift of the median cannot lift the bound past it. The parameter step
itself is bounded per tensor in guard.py.

Pure numbers only; the stage computes the norms and applies the scale.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

MIN_HISTORY = 8  # accepted updates before the median is trusted


def clip_scale(norm: float, bound: float | None) -> float:
    """The factor that brings ``norm`` within ``bound`` (1.0 when it already is, or when there is no bound).

    A non-finite norm has no meaningful direction: 0.0, and the caller rejects the request."""
    if not math.isfinite(norm):
        return 0.0
    if bound is None or bound <= 0.0 or norm <= bound or norm == 0.0:  # a bound of 0 carries no scale
        return 1.0
    return bound / norm


def history_bound(norms: list[float] | deque[float], multiplier: float, min_history: int = MIN_HISTORY) -> float | None:
    """``multiplier`` x the median of the accepted norms, or None while there are fewer than ``min_history``."""
    if len(norms) < min_history:
        return None
    return multiplier * statistics.median(norms)


def step_ceiling(param_norm: float, lr: float, max_step_ratio: float) -> float | None:
    """The largest gradient norm whose plain step ``lr * g`` moves the copy by ``max_step_ratio`` of its norm."""
    if lr <= 0 or not math.isfinite(param_norm) or param_norm <= 0:
        return None
    return max_step_ratio * param_norm / lr


def combined_bound(*bounds: float | None) -> float | None:
    """The tightest of the bounds that exist."""
    present = [b for b in bounds if b is not None]
    return min(present) if present else None


def step_bound(tensor_norm: float, floor_norm: float, max_step_ratio: float) -> float:
    """How far one update may move a tensor: ``max_step_ratio`` of its norm, with a floor for small tensors
    (a zero-initialised bias must still be able to learn): the norm of the stage's typical tensor."""
    return max_step_ratio * max(tensor_norm, floor_norm)


class NormHistory:
    """The norms of the last accepted updates and the clip bound they give."""

    def __init__(self, size: int, multiplier: float, min_history: int = MIN_HISTORY):
        self.norms: deque[float] = deque(maxlen=size)
        self.multiplier = multiplier
        self.min_history = min(min_history, size)
        self.seen = 0
        self.clipped = 0

    def bound(self, multiplier: float | None = None) -> float | None:
        """The clip bound: ``multiplier`` (default: this history's) x the median accepted norm."""
        return history_bound(self.norms, self.multiplier if multiplier is None else multiplier, self.min_history)

    def accept(self, norm: float, was_clipped: bool) -> None:
        """Record an applied update's norm (after clipping). A zero update carries no scale: kept out, or
        zero-gradient micro-batches (a saturated loss, or a driver sending zeros) would pull the median
        to 0 and make every later update look non-finite (measured: the driver lost 60-106 micro-batches
        in 2.5 s with Adam on tests/fake_stages.py)."""
        if math.isfinite(norm) and norm > 0.0:
            self.norms.append(norm)
        self.seen += 1
        self.clipped += int(was_clipped)

    @property
    def clipped_fraction(self) -> float:
        return self.clipped / self.seen if self.seen else 0.0
