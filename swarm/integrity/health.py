"""Is this copy of the layer healthy? Signals, the verdict, and the exception a sick copy raises.

A copy is sick when it produces non-finite values (outputs, input gradients, a loss), when its
parameter norm has grown far beyond the norm of its last good snapshot (a diverging copy grows
fast: SGD with momentum on a busy machine reached a loss of ~1e35), at the last stage, where the
loss is computed here and not read from the wire, when its loss EMA has exploded relative to the EMA
at the last good snapshot, or, at stage 0 on its own driver's data, when it has collapsed: its
outputs no longer depend on its inputs (fewer than DEAD_LIVE_RATIO of the most output features that
ever varied over a batch still do). A step too large kills every ReLU of stage 0's first layer
(SGD lr 0.1, momentum 0.95, 6 micro-batches in flight did it within 10 000 samples): its output is 0
for every input, every later stage sees the same row, the run's loss sits at chance (ln 10) with a
zero gradient for stage 0, and nothing else notices: no value is non-finite and no norm grows. A
loss reported by a driver is never a health signal, and the collapse check runs only on the node's
own data: a stranger could make a healthy copy heal forever.

Everything here is plain arithmetic over numbers the stage hands in; ``HealthMonitor`` keeps the
state and is called on the compute thread (under the stage's lock). The healing itself
(stop serving, restore, a lower step size for a while) is in heal.py.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass

from swarm.run.runconfig import IntegrityConfig

logger = logging.getLogger(__name__)

NORM_EXPLODE_RATIO = 10.0  # sick when ||params|| exceeds this many times the smallest of the recent good snapshots'
# A snapshot is retaken every few hundred updates while the copy looks healthy, so a norm that grows 1.25x per
# snapshot (measured: 10.5 -> 398 under a stranger's ascent) never exceeded 10x the *last* one. The reference is the
# smallest norm among this many recent good snapshots: a slow drift past 10x is caught too.
NORM_HISTORY_SNAPSHOTS = 16
# A loss that explodes again after this many restores of good copies in a row (no snapshot taken between) is not
# this copy's doing: its inputs changed upstream (measured, benchmarks.adversary pair_middle_harm: a copy trained to
# harm fed the last stage, the driver's stage 0 adapted to it, and once it was held off the honest last stage healed
# every 2 s for the rest of the run, refusing all work: a 33 s stall, the run counted killed). The copy then
# serves on and takes the new loss as its baseline; its own weights are what it restored, and were good.
LOSS_HEALS_MAX = 3
LOSS_EMA_ALPHA = 0.1
LOSS_WARMUP_UPDATES = 20  # a loss EMA over fewer updates is not yet a signal
LOSS_OWNER_RECENT_S = 30.0  # a driver's loss EMA counts while it sent a micro-batch within this long
MAX_LOSS_OWNERS = 256  # drivers whose loss EMA is kept; the longest silent goes first
DEAD_LIVE_RATIO = 0.1  # collapsed when the share of output features that still vary falls below this x the healthy share
LIVE_STD_RATIO = 1e-4  # a feature varies when its std over the batch exceeds this x the outputs' RMS
DEAD_FORWARDS = 3  # ... in this many forwards in a row (one odd batch is not a verdict)
LIVE_EMA_ALPHA = 0.05


class SickCopy(Exception):
    """This copy produced something it must not send onward; it stops serving and heals.

    The stage servicer answers ``healing``; a driver whose own stage-0 copy raises it pauses its
    lanes until the copy has healed (no micro-batch is lost to a sick copy)."""


@dataclass(slots=True, frozen=True)
class Baseline:
    """What the copy looked like at its last good snapshot."""

    param_norm: float
    loss_ema: float | None


def all_finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)


def norm_exploded(norm: float, baseline_norm: float, ratio: float = NORM_EXPLODE_RATIO) -> bool:
    """A parameter norm far beyond the last good one (or not finite)."""
    if not math.isfinite(norm):
        return True
    return baseline_norm > 0 and norm > ratio * baseline_norm


def loss_limit(baseline_loss: float | None, ratio: float, chance_loss: float) -> float | None:
    """The loss EMA above which the copy is sick: ``ratio`` times the last good one, but never below the
    loss of guessing (a converged copy's EMA of 0.01 may triple by noise; one back at chance level is
    broken), and ``ratio`` times the loss of guessing before any good loss is known."""
    if baseline_loss is None or not baseline_loss > 0:
        return ratio * chance_loss if chance_loss > 0 else None
    return max(ratio * baseline_loss, chance_loss)


def loss_exploded(loss_ema: float | None, baseline_loss: float | None, ratio: float,
                  chance_loss: float = 0.0) -> bool:
    """A locally computed loss EMA past ``loss_limit`` (or not finite)."""
    if loss_ema is None:
        return False
    if not math.isfinite(loss_ema):
        return True
    limit = loss_limit(baseline_loss, ratio, chance_loss)
    return limit is not None and loss_ema > limit


def batch_spread(tensor) -> float:
    """How much a batch's rows differ: the mean over features of the standard deviation across rows."""
    if tensor is None or tensor.dim() == 0 or tensor.shape[0] < 2:
        return 0.0
    rows = tensor.detach().reshape(tensor.shape[0], -1).double()
    return float(rows.std(dim=0).mean())


def live_share(tensor) -> float:
    """The share of a batch's output features that vary across its rows (a dead ReLU unit is 0 for every row)."""
    if tensor is None or tensor.dim() == 0 or tensor.shape[0] < 2:
        return 0.0
    rows = tensor.detach().reshape(tensor.shape[0], -1).double()
    rms = float(rows.square().mean().sqrt())
    if not rms > 0 or not math.isfinite(rms):
        return 0.0
    return float((rows.std(dim=0) > LIVE_STD_RATIO * rms).double().mean())


def outputs_collapsed(live: float, in_spread: float, healthy_live: float | None) -> bool:
    """Rows that differ going in, and (almost) no output feature that still varies coming out: the copy's
    outputs no longer depend on its inputs. Identical inputs give no verdict. Before a healthy share is
    known, only outputs where no feature varies count."""
    if not in_spread > 0:
        return False
    if healthy_live is None or not healthy_live > 0:
        return live == 0.0
    return live < DEAD_LIVE_RATIO * healthy_live


def collapse_reason(live: float, healthy: float | None, features: int = 0) -> str:
    count = f" of {features}" if features else ""
    was = f" (it was {healthy:.0%})" if healthy else ""
    return (f"it has collapsed: {live:.0%}{count} of its output features still vary with the input{was}; a step "
            "size too large for this run kills ReLU units this way")


class HealthMonitor:
    """The sick-or-healthy state of one copy, fed by the stage (compute thread) and read by the peer."""

    def __init__(self, cfg: IntegrityConfig, chance_loss: float = 0.0):
        self.cfg = cfg
        self.chance_loss = chance_loss  # the loss of guessing (log of the number of classes)
        self._lock = threading.Lock()
        self._reason: str | None = None
        self.baseline: Baseline | None = None
        self._norms: deque[float] = deque(maxlen=NORM_HISTORY_SNAPSHOTS)  # of the recent good snapshots
        self.loss_ema: float | None = None  # of the losses computed here (last stage only)
        self._losses_seen = 0
        # (driver, the peer that computed the input) -> (loss EMA, losses, last seen)
        self._owner_losses: dict[tuple[str, str], tuple[float, int, float]] = {}
        self._loss_heals = 0  # heals for an exploded loss since the last good snapshot
        self.upstream_losses = 0  # exploded losses taken as the inputs' doing (LOSS_HEALS_MAX), not healed
        self.declined = 0  # updates not learned: one source's loss exploded where others' did not
        self._declined_from: set[str] = set()  # sources said so (once each)
        self.notice: str | None = None  # said once by the healer (heal.py), then cleared
        self.times_sick = 0
        self.live_ema: float | None = None  # stage 0: the share of its output features that vary, own batches
        self.live_peak: float | None = None  # ... the highest that EMA has been
        self.probe = None  # stage 0: the last batch of its own data (a snapshot is checked on it)
        self._collapsed_forwards = 0

    @property
    def sick_reason(self) -> str | None:
        with self._lock:
            return self._reason

    @property
    def sick(self) -> bool:
        return self.sick_reason is not None

    def mark_sick(self, reason: str) -> None:
        with self._lock:
            if self._reason is None:
                self._reason = reason
                self.times_sick += 1

    def check_tensor(self, tensor, what: str) -> None:
        """Raise SickCopy (and mark the copy sick) if ``tensor`` holds a non-finite value."""
        import torch

        if tensor is not None and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            reason = f"{what} contain non-finite values"
            self.mark_sick(reason)
            raise SickCopy(reason)

    def observe_local_loss(self, loss: float, owner: str = "", now: float | None = None, source: str = "") -> bool:
        """A loss this stage computed itself (last stage) on ``owner``'s micro-batch, whose input ``source`` computed:
        non-finite means sick, and so does an exploded loss EMA, judged per driver and source: the copy is sick when
        the loss of every (driver, source) active here exploded (the lowest of their EMAs), not when one's did. A
        driver that pairs activations with the wrong ids has a loss of its own that explodes; that must not make the
        copy heal, again and again, for everyone (issue 25 item 7: "a lying loss cannot make a stage heal forever").
        Nor must the inputs of an upstream copy trained to harm: six such keys beside one honest copy made the honest
        last stage heal five times in 12 s and cut its step size to 0.027x (benchmarks.adversary six_keys_middle_harm),
        while the loss of what the honest copy sent it stayed low. A copy that really broke breaks for everyone.
        True: this (driver, source)'s loss exploded where the same driver's through another source did not: the
        inputs' doing, not to be learned from (the stage declines the update, ``declined``); drivers' route losses
        judge the source's copy."""
        if not math.isfinite(loss):
            self.mark_sick("the loss is not finite")
            return False
        self.loss_ema = loss if self.loss_ema is None else (1 - LOSS_EMA_ALPHA) * self.loss_ema + LOSS_EMA_ALPHA * loss
        self._losses_seen += 1
        now = time.monotonic() if now is None else now
        key = (owner, source)
        ema, seen, _ = self._owner_losses.get(key, (loss, 0, now))
        self._owner_losses[key] = (loss if seen == 0 else (1 - LOSS_EMA_ALPHA) * ema + LOSS_EMA_ALPHA * loss,
                                   seen + 1, now)
        if len(self._owner_losses) > MAX_LOSS_OWNERS:
            del self._owner_losses[min(self._owner_losses, key=lambda o: self._owner_losses[o][2])]
        judged = [e for e, n, at in self._owner_losses.values()
                  if n >= LOSS_WARMUP_UPDATES and now - at <= LOSS_OWNER_RECENT_S]
        if not judged:
            return False
        lowest = min(judged)
        baseline = self.baseline.loss_ema if self.baseline is not None else None
        ratio = self.cfg.loss_explode_ratio
        if not loss_exploded(lowest, baseline, ratio, self.chance_loss):
            ema, seen, _ = self._owner_losses[key]
            if seen >= LOSS_WARMUP_UPDATES and loss_exploded(ema, baseline, ratio, self.chance_loss) and \
                    self._fine_elsewhere(owner, source, now, baseline, ratio):
                self.declined += 1
                if source not in self._declined_from and len(self._declined_from) < MAX_LOSS_OWNERS:
                    self._declined_from.add(source)
                    logger.warning("not learning from the inputs %s computes for %s: their loss EMA here, %.3g, "
                                   "exploded where the others' did not (drivers judge its copy by route losses)",
                                   source[-8:] or "?", owner[-8:] or "?", ema)
                return True
            return False
        if self.sick:  # already healing
            return False
        limit = loss_limit(baseline, ratio, self.chance_loss)
        if self._loss_heals >= LOSS_HEALS_MAX and math.isfinite(lowest):
            self.upstream_losses += 1
            self.baseline = Baseline(param_norm=self.baseline.param_norm if self.baseline else float("nan"),
                                     loss_ema=lowest)
            self.notice = (f"the loss EMA {lowest:.3g} stays past its limit ({limit:.3g}) after {self._loss_heals} "
                           f"restores of good copies: its inputs changed upstream, not this copy; serving on, "
                           f"with {lowest:.3g} as the loss to compare with until the next good snapshot")
            return False
        self._loss_heals += 1
        self.mark_sick(f"the loss EMA {lowest:.3g} exploded (the limit is {limit:.3g})"
                       + (f" for all {len(judged)} drivers and sources" if len(judged) > 1 else ""))
        return False

    def _fine_elsewhere(self, owner: str, source: str, now: float, baseline: float | None, ratio: float) -> bool:
        """Does the same driver's loss through another source stay within the limit? Only then is one source's
        exploded loss its inputs' doing: a driver whose own loss is high everywhere (label-skewed shards early in a
        run: the copy predicts the other drivers' classes) is learned from as before."""
        return any(o == owner and s != source and n >= LOSS_WARMUP_UPDATES and now - at <= LOSS_OWNER_RECENT_S
                   and not loss_exploded(e, baseline, ratio, self.chance_loss)
                   for (o, s), (e, n, at) in self._owner_losses.items())

    def observe_own_forward(self, inputs, outputs) -> None:
        """Stage 0, a forward of the node's own data: a copy whose outputs stopped depending on its inputs
        has collapsed (sick after DEAD_FORWARDS in a row)."""
        self.probe = inputs.detach()
        self.observe_live(live_share(outputs), batch_spread(inputs.float()), outputs[0].numel())

    def healthy_live(self) -> float | None:
        """The reference share: the highest the copy had (units dying a few at a time is the collapse too:
        the demo's layer0 went 100% -> 12% -> 0% live; a snapshot's share would follow it down)."""
        return self.live_peak

    def judge_collapse(self, inputs, outputs) -> bool:
        """One batch of our own data, now (a snapshot about to be kept): collapsed outputs make the copy sick."""
        live, healthy = live_share(outputs), self.healthy_live()
        if outputs_collapsed(live, batch_spread(inputs.float()), healthy):
            self.mark_sick(collapse_reason(live, healthy, outputs[0].numel()))
            return True
        return False

    def observe_live(self, live: float, in_spread: float, features: int = 0) -> None:
        healthy = self.healthy_live()
        if outputs_collapsed(live, in_spread, healthy):
            self._collapsed_forwards += 1
            if self._collapsed_forwards >= DEAD_FORWARDS:
                self.mark_sick(collapse_reason(live, healthy, features))
            return
        self._collapsed_forwards = 0
        if in_spread > 0:
            a = LIVE_EMA_ALPHA
            self.live_ema = live if self.live_ema is None else (1 - a) * self.live_ema + a * live
            self.live_peak = self.live_ema if self.live_peak is None else max(self.live_peak, self.live_ema)

    def observe_param_norm(self, norm: float) -> None:
        baseline = min(self._norms) if self._norms else 0.0
        if norm_exploded(norm, baseline):
            what = "not finite" if not math.isfinite(norm) else \
                f"{norm:.3g}, {norm / baseline:.0f}x that of a recent good copy"
            self.mark_sick(f"the parameter norm is {what}")

    def set_baseline(self, param_norm: float) -> None:
        """A good snapshot was taken: the signals compare against it (and the norm against the recent ones) from now
        on."""
        self.baseline = Baseline(param_norm=param_norm, loss_ema=self.loss_ema if self._losses_seen else None)
        self._loss_heals = 0
        if math.isfinite(param_norm) and param_norm > 0:
            self._norms.append(param_norm)

    def healed(self) -> None:
        with self._lock:
            self._reason = None
        self.loss_ema = self.baseline.loss_ema if self.baseline is not None else None
        self._losses_seen = 0
        # every driver's loss is judged afresh, after its warm-up: kept, the EMA that made it sick made the restored
        # copy sick again on its first loss (a heal every 2 s, no work served between)
        self._owner_losses.clear()
        self._collapsed_forwards = 0
