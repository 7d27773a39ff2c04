"""The bounds of swarm/integrity/mixing.py applied to tensors: one guard per averaging runtime.

``InfluenceGuard`` keeps the history of accepted distances and the per-peer ledger, and answers for
one copy or message: rejected (the caller bans the sender), skipped (the sender's budget for the
window is spent), or the tensors to apply instead (``theirs`` moved toward ``ours`` so the step fits
the bound). Thread-safe: Dpwa checks copies on a helper thread while the event loop picks peers.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from swarm.integrity.mixing import GrowthLedger, InfluenceLedger, MixVerdict, growth_scale, judge_mix, tensor_scales
from swarm.run.runconfig import InfluenceConfig


@dataclass(frozen=True, slots=True)
class Judged:
    verdict: MixVerdict
    distance: float


def distance(ours: Mapping[str, torch.Tensor] | torch.Tensor, theirs: Mapping[str, torch.Tensor] | torch.Tensor) -> float:
    """``||theirs - ours||`` over the floating tensors (float64 sums: a layer has millions of values)."""
    if isinstance(ours, torch.Tensor):
        return float((theirs.detach().double() - ours.detach().double()).norm())
    squares = [(theirs[name].detach().to(t.device).double() - t.detach().double()).pow(2).sum()
               for name, t in ours.items() if t.is_floating_point()]
    return float(torch.stack(squares).sum().sqrt()) if squares else 0.0


def toward(ours: Mapping[str, torch.Tensor], theirs: Mapping[str, torch.Tensor],
           scale: float | Mapping[str, float]) -> dict[str, torch.Tensor]:
    """``ours + scale * (theirs - ours)`` per floating tensor (one scale, or one per tensor); a clipped
    copy keeps our integer buffers."""
    out = {}
    for name, mine in ours.items():
        other = theirs[name].to(mine.device)
        s = scale if isinstance(scale, (int, float)) else scale.get(name, 1.0)
        if mine.is_floating_point():
            out[name] = other if s >= 1.0 else mine.detach() + s * (other.to(mine.dtype) - mine.detach())
        else:
            out[name] = other if s >= 1.0 else mine.detach().clone()
    return out


def per_tensor(ours: Mapping[str, torch.Tensor], theirs: Mapping[str, torch.Tensor], weight: float, scale: float,
               cfg: InfluenceConfig) -> tuple[dict[str, float], float]:
    """The per-tensor scales of ``tensor_scales`` and the norm of the resulting step ``weight * ||scaled d||``."""
    floats = {name: t for name, t in ours.items() if t.is_floating_point()}
    dists = {name: float((theirs[name].detach().to(t.device).double() - t.detach().double()).norm())
             for name, t in floats.items()}
    norms = {name: float(t.detach().double().norm()) for name, t in floats.items()}
    scales = tensor_scales(dists, norms, {name: t.numel() for name, t in floats.items()}, weight, scale, cfg)
    step = weight * sum((scales[name] * d) ** 2 for name, d in dists.items()) ** 0.5
    return scales, step


class InfluenceGuard:
    """History and ledger of one runtime (Dpwa and exchange share one; the edge modes have their own)."""

    def __init__(self, cfg: InfluenceConfig):
        self.cfg = cfg
        self.history: deque[float] = deque(maxlen=cfg.history)
        self.ledger = InfluenceLedger(cfg.window_s)
        self.growth = GrowthLedger(cfg.window_s)
        self.clipped = 0
        self.shortened = 0  # steps shortened to the window's norm growth
        self._lock = threading.Lock()

    def fit_growth(self, own_sq: float, dot: float, step_sq: float, now: float) -> float:
        """The share of a step ``own + step`` that fits the window's norm growth (mixing.py item 4); records the
        growth of that share."""
        own_norm = own_sq ** 0.5
        with self._lock:
            s = growth_scale(own_sq, dot, step_sq, own_norm, self.growth.left(now, own_norm))
            self.growth.record(now, max(0.0, own_sq + 2 * s * dot + s * s * step_sq) ** 0.5 - own_norm, own_norm)
            self.shortened += int(s < 1.0)
            return s

    def judge(self, peer: str, dist: float, weight: float, reference_norm: float, now: float) -> MixVerdict:
        with self._lock:
            budget = self.ledger.budget_left(peer, now, reference_norm, self.cfg)
            return judge_mix(dist, weight, reference_norm, tuple(self.history), budget, self.cfg)

    def accepted(self, peer: str, dist: float, step_norm: float, now: float, clipped: bool) -> None:
        """Record an applied step: its unclipped distance feeds the median, its step the peer's budget."""
        with self._lock:
            self.history.append(dist)
            self.ledger.record(peer, now, step_norm)
            self.clipped += int(clipped)

    def over_share(self, candidates: Iterable[str], now: float) -> set[str]:
        """The candidates that had more than their fair share of pulls within the window."""
        peers = list(candidates)
        with self._lock:
            return {p for p in peers if self.ledger.over_share(p, peers, now, self.cfg.fair_share_slack)}


def flat_scales(params: torch.Tensor, difference: torch.Tensor, numels: list[int], weight: float, scale: float,
                cfg: InfluenceConfig) -> tuple[torch.Tensor | None, float]:
    """``per_tensor`` for a flat vector cut into parameter tensors of ``numels`` values: the factor of
    each value (None when nothing is clipped) and the norm of the step ``weight * factors * difference``."""
    parts = difference.split(numels)
    dists = {i: float(part.double().norm()) for i, part in enumerate(parts)}
    norms = {i: float(part.double().norm()) for i, part in enumerate(params.split(numels))}
    scales = tensor_scales(dists, norms, dict(enumerate(numels)), weight, scale, cfg)
    step = weight * sum((scales[i] * d) ** 2 for i, d in dists.items()) ** 0.5
    if min(scales.values(), default=1.0) >= 1.0:
        return None, step
    factors = torch.cat([torch.full((n,), scales[i], dtype=difference.dtype, device=difference.device)
                         for i, n in enumerate(numels)])
    return factors, step


def step_moments(ours: Mapping[str, torch.Tensor], theirs: Mapping[str, torch.Tensor], weight: float
                 ) -> tuple[float, float, float]:
    """``(||ours||^2, <ours, step>, ||step||^2)`` of the averaging step ``weight * (theirs - ours)`` over the
    floating tensors (float64 sums), for ``InfluenceGuard.fit_growth``."""
    own_sq = dot = step_sq = 0.0
    for name, mine in ours.items():
        if not mine.is_floating_point():
            continue
        a = mine.detach().double()
        d = theirs[name].detach().to(a.device).double() - a
        own_sq += float(a.pow(2).sum())
        dot += weight * float((a * d).sum())
        step_sq += weight * weight * float(d.pow(2).sum())
    return own_sq, dot, step_sq
