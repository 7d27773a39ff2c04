"""Staleness of asynchronous updates: measured per stage, and a step size that shrinks with it.

Staleness is the number of updates applied to a stage's copy between a micro-batch's forward and its
backward there: the gradient the backward applies was taken at weights that many updates old. It
grows with the micro-batches in flight, the number of drivers and the machine's load, and the last
stage (whose forward and backward are one call) always has 0. The stage records its update counter
with each saved forward and the difference at the backward (swarm/pipeline/stage/worker.py); a window of the recent
values gives the mean, p95 and max that records, status and the dashboard show.

Staleness-aware updates, ``optimizer.staleness``:
- ``divide`` (Zhang, Gupta, Lian & Liu 2016, "Staleness-aware Async-SGD for Distributed Deep
  Learning"): the step of a gradient that is ``tau`` updates stale is divided by ``tau``, with ``tau``
  up to ``optimizer.staleness_tolerance`` taking the full step.
- ``momentum`` (Mitliagkas, Zhang, Hadjis & Re 2016, "Asynchrony begets momentum"): stale gradients
  already act like momentum, so SGD's momentum gives up the share of its horizon
  (``1 / (1 - momentum)`` updates) that the copy's recent mean staleness takes.
- ``divide_momentum`` (the default): both. Measured (benchmarks/README.md, staleness): dividing alone
  stopped SGD-momentum's blow-ups with 2 drivers at in_flight 8 but not with 4, where layer1's copy
  saw a mean staleness of 16.

How the factor reaches the step (``StepSize``, the one owner of the optimizer's ``lr``): for SGD it
scales this update's gradient, so exactly this gradient's share of the momentum buffer shrinks (a
per-step lr would also rescale the older gradients in the buffer); for Adam and AdamW, which
normalise the gradient's scale away, it scales this step's lr. The self-healing scale
(swarm/integrity/heal.py) multiplies in: ``lr = run's lr x heal scale x staleness factor``.
Edge modes replace the optimizer (``StageWorker.set_update_rule``); their step is left alone.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

STALENESS_WINDOW = 256  # recent updates the mean, p95 and max are taken over
RULES = ("none", "divide", "momentum", "divide_momentum")
DIVIDING_RULES = frozenset({"divide", "divide_momentum"})
MOMENTUM_RULES = frozenset({"momentum", "divide_momentum"})
ADAPTIVE_OPTIMIZERS = frozenset({"adam", "adamw"})


@dataclass(slots=True, frozen=True)
class StalenessSummary:
    """Recent staleness of one copy's updates, in updates."""

    mean: float
    p95: float
    max: int
    count: int  # updates the figures are taken over


def percentile(values: list[int], q: float) -> float:
    """Linear-interpolated percentile of ``values`` (non-empty), ``q`` in [0, 100]."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (position - low))


def summarize(values: Iterable[int]) -> StalenessSummary | None:
    """Mean, p95 and max of the staleness values, or None when there are none."""
    values = list(values)
    if not values:
        return None
    return StalenessSummary(mean=sum(values) / len(values), p95=percentile(values, 95.0), max=max(values),
                            count=len(values))


def step_factor(staleness: int, rule: str, tolerance: int = 1) -> float:
    """The factor on the step of a gradient ``staleness`` updates old: 1 up to ``tolerance``, then
    ``tolerance / staleness`` (rules ``divide*``; Zhang et al. 2016 is ``tolerance`` 1); 1 for the others."""
    if rule not in RULES:
        raise ValueError(f"optimizer.staleness {rule!r} is not one of {', '.join(RULES)}")
    if tolerance < 1:
        raise ValueError(f"optimizer.staleness_tolerance must be at least 1, got {tolerance}")
    if rule not in DIVIDING_RULES or staleness <= tolerance:
        return 1.0
    return tolerance / staleness


def stale_momentum(momentum: float, mean_staleness: float) -> float:
    """SGD's momentum once staleness takes its share (Mitliagkas et al. 2016, "Asynchrony begets momentum":
    gradients ``tau`` updates stale already act like momentum). The run's momentum averages over
    ``1 / (1 - momentum)`` updates; the stale updates take ``mean_staleness`` of that horizon and the
    momentum keeps the rest: 0.9 with a mean staleness of 5 gives 0.8, of 9 or more gives 0."""
    if momentum <= 0.0 or not math.isfinite(mean_staleness):
        return momentum if momentum > 0.0 else 0.0
    horizon = 1.0 / (1.0 - momentum)
    return 1.0 - 1.0 / max(1.0, horizon - max(0.0, mean_staleness))


class StalenessWindow:
    """The last ``STALENESS_WINDOW`` staleness values (the compute thread records, the node reads)."""

    def __init__(self, size: int = STALENESS_WINDOW):
        self._values: deque[int] = deque(maxlen=size)
        self._sum = 0
        self._lock = threading.Lock()

    def record(self, staleness: int) -> None:
        with self._lock:
            if len(self._values) == self._values.maxlen:
                self._sum -= self._values[0]
            value = max(0, int(staleness))
            self._values.append(value)
            self._sum += value

    def mean(self) -> float:
        """The mean of the window (0 while empty), without sorting: read at every update."""
        with self._lock:
            return self._sum / len(self._values) if self._values else 0.0

    def summary(self) -> StalenessSummary | None:
        with self._lock:
            values = list(self._values)
        return summarize(values)


class StepSize:
    """The one owner of the optimizer's ``lr``: the run's lr x the heal scale x this update's staleness factor."""

    def __init__(self, optimizer: Any, optimizer_name: str, rule: str = "none", tolerance: int = 1):
        step_factor(0, rule, tolerance)  # validates rule and tolerance
        self.optimizer = optimizer
        self.adaptive = optimizer_name in ADAPTIVE_OPTIMIZERS
        self.rule = rule
        self.tolerance = tolerance
        self._base_lrs = [group["lr"] for group in optimizer.param_groups]
        self._base_momenta = [group.get("momentum", 0.0) for group in optimizer.param_groups]
        self.heal_scale = 1.0

    @property
    def lr(self) -> float:
        """The step size before any staleness factor (the first group's), for the step ceiling."""
        return self._base_lrs[0] * self.heal_scale if self._base_lrs else 0.0

    def set_heal_scale(self, scale: float) -> None:
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"a step-size scale must be a positive number, got {scale}")
        self.heal_scale = scale
        self._write_lrs(1.0)

    def before_step(self, staleness: int, grads: list[Any], mean_staleness: float = 0.0) -> float:
        """Scale this update by its staleness (grads in place for SGD, this step's lr for Adam), and SGD's
        momentum by the copy's recent mean staleness (rules ``*momentum``); returns the step factor."""
        factor = step_factor(staleness, self.rule, self.tolerance)
        self._write_lrs(factor if self.adaptive else 1.0)
        if self.rule in MOMENTUM_RULES and not self.adaptive:
            for group, base in zip(self.optimizer.param_groups, self._base_momenta):
                group["momentum"] = stale_momentum(base, mean_staleness)
        if factor < 1.0 and not self.adaptive and grads:
            import torch

            torch._foreach_mul_(grads, factor)
        return factor

    def _write_lrs(self, factor: float) -> None:
        for group, base in zip(self.optimizer.param_groups, self._base_lrs):
            group["lr"] = base * self.heal_scale * factor
