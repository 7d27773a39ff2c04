"""Which way each driver pushes this copy: the cosine of its update with the swarm's recent direction.

Per driver we keep an EMA of the unit direction of its (clipped) parameter gradients. The reference a
new update is compared with is the sum of every driver's EMA, each weighted by its tenure here
(``min(1, seconds since first seen / TENURE_FULL_S)``): the drivers that have trained this copy for
a while define "the consensus", and a newcomer that pushes the other way (gradient ascent) shows a
mean cosine well below zero within a few dozen updates while it carries little weight itself. The
driver's own EMA is part of the reference, so with one honest and one hostile driver the one that was
here first is not blamed. Sybils that outnumber and outlast the honest drivers defeat this; the
fair share and the bounds still limit what they do per update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DIRECTION_EMA_ALPHA = 0.1
TENURE_FULL_S = 300.0
MAX_TRACKED = 64  # drivers whose direction we keep; the least recently seen is forgotten first


def tenure_weight(age_s: float, full_s: float = TENURE_FULL_S) -> float:
    """How much a driver's direction counts in the reference: grows linearly to 1 over ``full_s``."""
    return min(1.0, max(age_s, 0.0) / full_s) if full_s > 0 else 1.0


@dataclass(slots=True)
class _Track:
    ema: torch.Tensor
    first_seen: float
    last_seen: float


class DirectionTracker:
    def __init__(self, alpha: float = DIRECTION_EMA_ALPHA, max_tracked: int = MAX_TRACKED):
        self.alpha = alpha
        self.max_tracked = max_tracked
        self._tracks: dict[str, _Track] = {}

    @torch.no_grad()
    def observe(self, requester: str, grads: list[torch.Tensor], now: float) -> float | None:
        """The cosine of this update with the reference (None without one), then fold it into the driver's EMA."""
        flat = torch.cat([g.detach().reshape(-1).float() for g in grads])
        norm = float(flat.norm())
        if norm == 0.0 or not torch.isfinite(flat).all():
            return None
        unit = flat / norm
        reference = self._reference(now)
        cosine = None
        if reference is not None:
            ref_norm = float(reference.norm())
            if ref_norm > 0:
                cosine = float(unit @ reference) / ref_norm
        track = self._tracks.get(requester)
        if track is None or track.ema.shape != unit.shape:
            self._forget_oldest()
            track = self._tracks[requester] = _Track(ema=torch.zeros_like(unit), first_seen=now, last_seen=now)
        track.ema.mul_(1 - self.alpha).add_(unit, alpha=self.alpha)
        track.last_seen = now
        return cosine

    def forget(self, requester: str) -> None:
        self._tracks.pop(requester, None)

    def _reference(self, now: float) -> torch.Tensor | None:
        out = None
        for track in self._tracks.values():
            weight = tenure_weight(now - track.first_seen)
            if weight <= 0:
                continue
            out = track.ema * weight if out is None else out.add_(track.ema, alpha=weight)
        return out

    def _forget_oldest(self) -> None:
        while len(self._tracks) >= self.max_tracked:
            oldest = min(self._tracks, key=lambda r: self._tracks[r].last_seen)
            del self._tracks[oldest]
