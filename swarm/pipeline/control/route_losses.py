"""Weights trained to harm, seen in the loss of the micro-batches routed through them (issue 40, item 3).

A copy that trains itself to do harm (gradient ascent, flipped labels) and then computes honestly from its own
weights passes every recomputation: its claims follow from the weights it committed to. What gives it away is what
those weights do to the run's loss. A driver sends micro-batches of one data stream through every copy of a swarm
it routes to, so the loss of the micro-batches that went through copy p, against the loss of those that went
through its other copies at the same time, measures p's weights (Gauntlet's idea, scoring a peer by the loss its
contribution gives, on the data the driver was training on anyway: no extra compute, no extra traffic).

Each completed micro-batch's loss is kept per swarm and per peer that served it (the last ``WINDOW`` within
``MAX_AGE_S``), and copies are compared *pairwise in time*: each loss through p beside the loss through q nearest in
time (within ``PAIR_S``: the driver's lanes interleave the copies), so that the fall of the loss over a run does not
favour whichever copy served later. Peer p is held off when, over ``MIN_PAIRS`` pairs at least, the median of its
loss over q's is ``RATIO`` or more *and* the median difference is ``ABS_MARGIN_SHARE`` of the chance loss (ln of the
outputs) or more. The absolute margin is what honest copies do not cross: measured on digits with 2 copies per
swarm, honest copies near convergence (train losses of 0.01-0.05) differ 1.5-1.9x in ratio but by hundredths of a
nat, and comparing windows not paired in time held two honest copies off in the run's first seconds; a copy trained
to harm moves its loss towards chance and beyond, nats away. A hold, not a conviction (a copy can be worse by
accident: a bad snapshot, a fresh copy), doubling while it repeats, its losses cleared so that it is measured afresh
when it serves again. What it cannot see: a swarm with one copy (nothing to compare).

A *last* stage's copies are judged by their own losses (``SELF_WITNESS``: each loss is the claim of the copy judged,
signed in its receipt since format 3 and recomputed by a referee, so a copy that reports low losses for itself to get
an honest rival held off is convicted on its first sampled hop; the standing rule below holds as well), and only when
its own loss is at the chance loss or above, worse than a copy that knows nothing: an honest last-stage copy that lags
its rival early in a run is 1.9x and a nat worse (held off in a label-skewed SGD demo, session 27), where weights
trained to harm climb past the chance loss within seconds. Or when the rival has learned (its median within the
absolute margin): a copy that keeps its loss at 0.8 of the chance loss beside one that has learned drew 427 training
ops in 20 s and took the run to 0.97 of clean unheld (``pair_last_capped_harm``); early in a run no copy has. Its
gradients are honest ones of harmful weights, and the driver's stage 0 and the middle copies descend them: one key
trained to harm at layer2 beside the honest copy took the run to 0.50-0.87 of the clean run's accuracy before (session
27).

Every loss is a claim of the last-stage peer that computed it (the *witness*), and a lying last stage can report
higher losses for whatever came through one middle copy (the receipts tell it whose activations it was given) and
frame it. So copies are compared witness by witness: p's losses are paired only with q's reported by the same
last-stage peer, and p is held off only if every witness that saw enough of both (``VETO_PAIRS``) finds it worse:
one honest last-stage copy beside the framer vetoes it. With one last-stage peer it is the only witness (and could
report any loss it likes for the whole run anyway). The price, in the other direction: a lying witness can also veto
the hold of a copy that does harm (it reports normal losses for it); pooled, as before, it pulled the median down
the same way. A disagreement is counted (``disputed``) and the honest copy is not punished; a witness that reports a
false loss is left to the referee, which recomputes the loss of its sampled hops (their receipts sign it).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass

WINDOW = 32
MIN_PAIRS = 12
VETO_PAIRS = 6  # a witness that saw this many pairs and finds p no worse vetoes holding it off
PAIR_S = 2.0
MAX_AGE_S = 60.0
RATIO = 1.5
ABS_MARGIN_SHARE = 0.25  # of the chance loss: digits 0.58 nats, a 2048-token vocabulary 1.9
JUDGE_EVERY_S = 1.0  # a swarm's copies compared at most this often (pairs of n copies cost n^2 x WINDOW: many keys)
HOLD_S = 60.0
MAX_HOLD_S = 3600.0
SELF_WITNESS = "self"  # a last stage's copies: each reports (and signs) its own loss, compared with each other's


@dataclass(frozen=True, slots=True)
class Harmful:
    stage: int
    peer: str
    ratio: float  # median of its loss over the other copy's, paired in time
    excess: float  # median difference, nats
    rival: str
    hold_s: float

    def describe(self) -> str:
        return (f"micro-batches through its copy come back with {self.ratio:.1f}x the loss (+{self.excess:.2f} nats) "
                f"of those through peer {self.rival[-8:]}'s at the same time")


class RouteLosses:
    def __init__(self, chance_loss: float, clock=time.monotonic, standing=lambda peer: 0):
        """``standing(peer)``: its validated work (the driver's credit book). A copy is held off only against a rival
        with at least as much: the losses come from the last stage, which may lie, and fresh keys there reporting
        low losses for their own middle copy must not make an established honest copy the one held off."""
        self.clock = clock
        self.standing = standing
        self.chance_loss = chance_loss
        self.abs_margin = ABS_MARGIN_SHARE * chance_loss
        self._losses: dict[tuple[int, str], deque[tuple[float, float, str]]] = {}  # (time, loss, witness)
        self._holds: dict[str, int] = {}  # peer -> times held off
        self._judged_at: dict[int, float] = {}  # stage -> when its copies were last compared
        self.held = 0
        self.disputed = 0  # holds vetoed by a witness that saw the same copies do no harm

    def record(self, served_by: dict[int, str], loss: float, witness: str = "") -> list[Harmful]:
        """One completed micro-batch: the peer that served each (middle) stage, its loss and the last-stage peer that
        reported it (SELF_WITNESS: the stages of ``served_by`` are last stages, judged by their own losses and held
        off at the chance loss or above, or beside a rival that has learned). Returns the copies to hold off."""
        if not math.isfinite(loss) or loss < 0:
            return []
        now = self.clock()
        for k, peer in served_by.items():
            self._losses.setdefault((k, peer), deque(maxlen=WINDOW)).append((now, loss, witness))
        verdicts = []
        for k in sorted(set(served_by)):
            if now - self._judged_at.get(k, float("-inf")) >= JUDGE_EVERY_S:
                self._judged_at[k] = now
                floor = self.chance_loss if witness == SELF_WITNESS else 0.0
                if (verdict := self._judge(k, now, floor)) is not None:
                    verdicts.append(verdict)
        return verdicts

    def training_loss(self, k: int, peer: str) -> float | None:
        """The median loss of the recent micro-batches ``peer`` served at stage ``k`` (None: none kept; a copy held
        off is measured afresh). At the last stage it is the copy's own claim, which a referee recomputes."""
        window = self._losses.get((k, peer))
        return statistics.median(v for _, v, _ in window) if window else None

    def far_worse(self, loss: float, best: float) -> bool:
        """Is ``loss`` as far above ``best`` as a hold asks (RATIO and the absolute margin)?"""
        return loss >= RATIO * best and loss - best >= self.abs_margin

    def _judge(self, k: int, now: float, floor: float = 0.0) -> Harmful | None:
        windows = {}
        for (stage, peer), window in list(self._losses.items()):
            if stage != k:
                continue
            while window and now - window[0][0] > MAX_AGE_S:
                window.popleft()
            if not window:
                del self._losses[(stage, peer)]
            elif len(window) >= MIN_PAIRS:
                windows[peer] = list(window)
        found = None
        for peer, mine in windows.items():
            for rival, theirs in windows.items():
                if rival == peer:
                    continue
                if self.standing(rival) < self.standing(peer):
                    continue
                verdict = self._compare(mine, theirs, floor)
                if verdict is not None and (found is None or verdict[0] > found[1]):
                    found = (peer, *verdict, rival)
        if found is None:
            return None
        peer, ratio, excess, rival = found
        times = self._holds.get(peer, 0)
        if len(self._holds) > 4096:
            self._holds.clear()
        self._holds[peer] = times + 1
        self._losses.pop((k, peer), None)  # measured afresh when it serves again
        self.held += 1
        return Harmful(k, peer, ratio, excess, rival, min(MAX_HOLD_S, HOLD_S * 2**times))

    def _compare(self, mine: list[tuple[float, float, str]], theirs: list[tuple[float, float, str]],
                 floor: float = 0.0) -> tuple[float, float] | None:
        """(ratio, excess) of my losses over the rival's when they show harm, witness by witness: enough pairs in all
        (MIN_PAIRS) from witnesses that each find me worse (with a median of my losses at ``floor`` or above, or of
        the rival's within the absolute margin: a rival that has learned), and no witness with VETO_PAIRS pairs that
        does not."""
        harmful: list[tuple[float, float]] = []
        vetoed = False
        for witness in sorted({w for _, _, w in mine}):
            pairs = _paired([(t, v) for t, v, w in mine if w == witness], [(t, v) for t, v, w in theirs if w == witness])
            if not pairs:
                continue
            ratio = statistics.median(a / max(b, 1e-9) for a, b in pairs)
            excess = statistics.median(a - b for a, b in pairs)
            mine_m, theirs_m = statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs)
            if ratio >= RATIO and excess >= self.abs_margin and (mine_m >= floor or theirs_m <= self.abs_margin):
                harmful += pairs
            elif len(pairs) >= VETO_PAIRS:
                vetoed = True  # a witness that saw enough finds me no worse
        if vetoed:
            if len(harmful) >= MIN_PAIRS:  # the last stage's copies disagree on the same two copies: one of them lies
                self.disputed += 1
            return None
        if len(harmful) < MIN_PAIRS:
            return None
        return statistics.median(a / max(b, 1e-9) for a, b in harmful), statistics.median(a - b for a, b in harmful)


def _paired(mine: list[tuple[float, float]], theirs: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Each of my losses beside the other copy's nearest in time, within PAIR_S (both lists in time order)."""
    if not theirs:
        return []
    pairs, j = [], 0
    for t, loss in mine:
        while j + 1 < len(theirs) and abs(theirs[j + 1][0] - t) <= abs(theirs[j][0] - t):
            j += 1
        if abs(theirs[j][0] - t) <= PAIR_S:
            pairs.append((loss, theirs[j][1]))
    return pairs
