"""Which way each driver pushes this copy: the cosine of its update with the swarm's recent direction.

Per driver we keep an EMA of the unit direction of its (clipped) parameter gradients. The reference a
new update is compared with is the sum of every driver's EMA, each weighted by its tenure here
(``min(1, seconds since first seen / TENURE_FULL_S)``): the drivers that have trained this copy for
a while define "the consensus", and a newcomer that pushes the other way (gradient ascent) shows a
mean cosine well below zero within a few dozen updates while it carries little weight itself.
The reference is the OTHER drivers' directions, and a cosine counts only when they carry at least
the weight of the driver judged: a lone driver is never compared with itself (SGD with momentum at a
large step oscillates, and its cosine with its own EMA reached -0.25: the demo banned its only
driver), and with one honest and one hostile driver only the newcomer is judged. Sybils that
outnumber and outlast the honest drivers defeat this; the fair share and the bounds still limit what
they do per update.
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
        track = self._tracks.get(requester)
        own_weight = tenure_weight(now - track.first_seen) if track is not None else 0.0
        reference, others_weight = self._reference(now, excluding=requester)
        cosine = None
        if reference is not None and others_weight > 0 and others_weight >= own_weight:
            ref_norm = float(reference.norm())
            if ref_norm > 0:
                cosine = float(unit @ reference) / ref_norm
        if track is None or track.ema.shape != unit.shape:
            self._forget_oldest()
            track = self._tracks[requester] = _Track(ema=torch.zeros_like(unit), first_seen=now, last_seen=now)
        track.ema.mul_(1 - self.alpha).add_(unit, alpha=self.alpha)
        track.last_seen = now
        return cosine

    def forget(self, requester: str) -> None:
        self._tracks.pop(requester, None)

    def _reference(self, now: float, excluding: str) -> tuple[torch.Tensor | None, float]:
        """The other drivers' directions weighted by tenure, and their total weight."""
        out, total = None, 0.0
        for requester, track in self._tracks.items():
            weight = tenure_weight(now - track.first_seen)
            if weight <= 0 or requester == excluding or track.ema.shape != (out.shape if out is not None else track.ema.shape):
                continue
            out = track.ema * weight if out is None else out.add_(track.ema, alpha=weight)
            total += weight
        return out, total

    def _forget_oldest(self) -> None:
        while len(self._tracks) >= self.max_tracked:
            oldest = min(self._tracks, key=lambda r: self._tracks[r].last_seen)
            del self._tracks[oldest]
