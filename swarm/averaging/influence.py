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

from swarm.integrity.mixing import InfluenceLedger, MixVerdict, judge_mix
from swarm.runconfig import InfluenceConfig


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


def toward(ours: Mapping[str, torch.Tensor], theirs: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """``ours + scale * (theirs - ours)`` per floating tensor; a clipped copy keeps our integer buffers."""
    out = {}
    for name, mine in ours.items():
        other = theirs[name].to(mine.device)
        if mine.is_floating_point():
            out[name] = mine.detach() + scale * (other.to(mine.dtype) - mine.detach())
        else:
            out[name] = other if scale >= 1.0 else mine.detach().clone()
    return out


class InfluenceGuard:
    """History and ledger of one runtime (Dpwa and exchange share one; the edge modes have their own)."""

    def __init__(self, cfg: InfluenceConfig):
        self.cfg = cfg
        self.history: deque[float] = deque(maxlen=cfg.history)
        self.ledger = InfluenceLedger(cfg.window_s)
        self.clipped = 0
        self._lock = threading.Lock()

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
