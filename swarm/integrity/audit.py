"""Update audits: does a copy's update descend the loss of the micro-batch it was computed from? (issue 40, item 3)

A copy trained to harm (gradient ascent, flipped labels) and then computing honestly from its own weights passes
every recomputation of its hops: they follow from the weights it committed to. Where its swarm has other copies,
the loss through it gives it away (swarm/pipeline/control/route_losses.py); a lone copy has nobody to be compared
with. What does give it away is the trace of its updates. A backward (or a last stage's forward_backward) at
version v is the update that takes that copy from v to v+1: its receipt names the weights it computed with (v),
and any later receipt of that peer at version v+1 names the weights the update produced. From them and the hop's
tensors a referee recomputes the parameter gradient g of that micro-batch at v and measures

    cosine(w_v - w_{v+1}, g)

which is positive for an update that descends (SGD: the step is -lr g; Adam: the step is -lr m/sqrt(v), and m
carries (1 - beta1) g) and negative for one that climbs. Clipping, the staleness factor and the step bound scale an
update, they do not turn it. Measured (3-stage digits MLP, batch 32, over 3,000 updates: ``/tmp``-free in
benchmarks/referee.py ``--audit``): honest Adam +0.16 to +0.39 per update (spread 0.1-0.26; 13-17 % of single
updates below 0), SGD with momentum +0.32 to +0.45; ascent -0.24 to -0.63 (85-100 % below 0), flipped labels at the
last stage -0.10 to -0.13 (89-94 % below 0). Single updates overlap, their mean over ``MIN_AUDITS`` does not: a
copy is convicted when the mean of its last ``MIN_AUDITS`` or more audits is below ``-MARGIN`` (an honest copy's
mean sits about six standard errors above 0), or of its last ``QUICK_AUDITS`` or more below ``-QUICK_MARGIN``.

What an audit cannot see: an update of a micro-batch that is not ours (another driver's; a liar can behave for
ours and climb on its own driver's), and a weight change between v and v+1 that is no update (a pull towards a
partner: an audit then measures both, and a pull is not aimed against our gradient). The first needs the stage to
show the trace of every update (the inputs of each, signed by their drivers): not done yet.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

MIN_AUDITS = 32
MARGIN = 0.05
# ... and sooner for a copy that climbs hard (ascent measured -0.24 to -0.63): over QUICK_AUDITS, a mean below
# -QUICK_MARGIN (an honest copy's mean over 16 sits ~5 standard errors above it). A run a lone ascent copy takes to
# chance in seconds should not wait for 32 audits.
QUICK_AUDITS = 16
QUICK_MARGIN = 0.15
KEPT = 64  # audits per peer (the newest)
MAX_AGE_S = 1800.0
MAX_PEERS = 1024
VERSIONS_KEPT = 4096  # (peer, stage, version) -> digest


def update_cosine(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor],
                  grads: dict[str, torch.Tensor]) -> float:
    """cosine(before - after, grads) over every parameter that has a gradient (0.0 when either is zero)."""
    dot = moved = grad = 0.0
    for name, g in grads.items():
        step = before[name].double() - after[name].double()
        g = g.double()
        dot += float((step * g).sum())
        moved += float((step * step).sum())
        grad += float((g * g).sum())
    if moved <= 0.0 or grad <= 0.0 or not math.isfinite(dot):
        return 0.0
    return dot / math.sqrt(moved * grad)


@dataclass(frozen=True, slots=True)
class Climbing:
    peer: str
    stage: int
    mean: float
    audits: int

    def describe(self) -> str:
        return (f"its updates climb the loss they were computed for: mean cosine {self.mean:+.2f} between its steps "
                f"and the descent of their micro-batches over {self.audits} audited updates (honest copies: +0.16 "
                "or more)")


class UpdateAudits:
    """Each peer's recent audit cosines; ``add`` returns a Climbing verdict once their mean is below ``-MARGIN``."""

    def __init__(self, min_audits: int = MIN_AUDITS, margin: float = MARGIN, clock=time.monotonic):
        self.min_audits = min_audits
        self.margin = margin
        self.clock = clock
        self._cosines: OrderedDict[str, deque[tuple[float, float]]] = OrderedDict()
        self.audits = 0

    def add(self, peer: str, stage: int, cosine: float) -> Climbing | None:
        now = self.clock()
        kept = self._cosines.get(peer)
        if kept is None:
            kept = self._cosines[peer] = deque(maxlen=KEPT)
            while len(self._cosines) > MAX_PEERS:
                self._cosines.popitem(last=False)
        self._cosines.move_to_end(peer)
        kept.append((now, cosine))
        while kept and now - kept[0][0] > MAX_AGE_S:
            kept.popleft()
        self.audits += 1
        if len(kept) < min(self.min_audits, QUICK_AUDITS):
            return None
        mean = sum(c for _, c in kept) / len(kept)
        if not (mean < -QUICK_MARGIN or (len(kept) >= self.min_audits and mean < -self.margin)):
            return None
        self._cosines.pop(peer, None)  # convicted: a later return is audited afresh
        return Climbing(peer, stage, mean, len(kept))

    def mean(self, peer: str) -> tuple[float, int] | None:
        kept = self._cosines.get(peer)
        if not kept:
            return None
        return sum(c for _, c in kept) / len(kept), len(kept)


class VersionBook:
    """The weights digest each peer's receipts named for each version of its stage (the latest one named: a peer that
    restarted from a checkpoint counts its versions again, with other weights), so that an update at version v can be
    paired with the weights it produced (v+1). Bounded, the most recently named kept."""

    def __init__(self, kept: int = VERSIONS_KEPT):
        self.kept = kept
        self._digests: OrderedDict[tuple[str, int, int], bytes] = OrderedDict()

    def note(self, peer: str, stage: int, version: int, digest: bytes) -> None:
        key = (peer, stage, version)
        if not digest.strip(b"\0"):
            return
        self._digests[key] = digest
        self._digests.move_to_end(key)
        while len(self._digests) > self.kept:
            self._digests.popitem(last=False)

    def digest(self, peer: str, stage: int, version: int) -> bytes | None:
        return self._digests.get((peer, stage, version))
