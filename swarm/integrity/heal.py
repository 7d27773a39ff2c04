"""Self-healing copies: a last-good snapshot, a health check every few steps, and the restore.

How it works:
- ``on_step`` (a stage step hook: compute thread, under the stage's lock) measures the parameter
  norm every ``CHECK_EVERY_STEPS`` updates and, every ``integrity.snapshot_every_steps`` updates of
  a healthy copy, keeps a CPU snapshot of the copy (weights, optimizer state, clock) as the last
  good one. The seeded (or downloaded) starting copy is the first snapshot, so one always exists. A node keeps its
  snapshots in files (swarm/integrity/snapshots.py: 8 bytes a parameter of RAM less) and reads one back to heal.
  Snapshots are kept in bfloat16 (``SNAPSHOT_DTYPE``: weights and Adam's moments, the step count exact): 6 bytes a
  parameter with Adam instead of 12. A restore is rare and lowers the step size anyway; the rounding it brings back
  (below 2**-9 of each weight) moved a trained digits copy's loss by under 1 % (tests/test_integrity_health.py).
- ``watch`` (a task on the peer's event loop) notices a sick copy (swarm/integrity/health.py),
  tells the node (state ``healing``: drivers route around it, its own lanes wait), restores the
  last good snapshot on the compute thread, multiplies the step-size scale by ``heal_lr_scale``
  and resumes. The scale recovers by a factor ``1/sqrt(heal_lr_scale)`` after every ``heal_steps``
  healthy updates (multiplicative decrease, slow increase), up to a ceiling: ``sqrt(heal_lr_scale)``
  times the scale the copy was sick at, so a copy that diverges at some step size settles below it
  instead of climbing back and healing in a loop, and never below ``heal_lr_scale ** MIN_SCALE_HEALS``; a
  snapshot that keeps getting sick after being restored (RESTORES_BEFORE_FALLBACK times with no newer one) gives
  way to the good snapshot before it (never to the seeded copy once the copy has trained). The ceiling itself rises the same way every ``CEILING_RECOVERY x heal_steps``
  healthy updates: a transient cause (a burst of staleness on a busy machine) costs speed for a while,
  not for good. The scale goes through the
  stage's ``StepSize`` (swarm/pipeline/stage/staleness.py), which multiplies it with each update's staleness factor.

Why the snapshot and not a peer's copy: the snapshot is ours and was healthy; a copy served by a
peer is a stranger's (it could be the reason we are sick). Averaging pulls bring the restored copy
back toward the swarm afterwards, through the usual checks and bounds.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from swarm.integrity.health import HealthMonitor
from swarm.integrity.snapshots import Kept, SnapshotStore

logger = logging.getLogger(__name__)

CHECK_EVERY_STEPS = 10  # parameter-norm check period (a pass over the parameters)
WATCH_PERIOD_S = 0.25  # how often the loop looks for a sick copy
CEILING_RECOVERY = 10  # the step-size ceiling rises once per this many heal_steps of healthy updates
FORGIVE_WINDOW_S = 120.0  # heals this recent are given back when a peer whose tensors we used is convicted
MAX_HEALS_KEPT = 16
RESTORES_BEFORE_FALLBACK = 2  # a snapshot restored this often without a newer one: the next heal restores the one before
# The step size never falls below this power of heal_lr_scale (0.3**3 = 0.027x the run's): measured, 33 heals in a
# row took a copy's scale to 5.6e-18x, a stage frozen for good while it said it trained.
MIN_SCALE_HEALS = 3
SNAPSHOT_DTYPE = torch.bfloat16

Notify = Callable[[str, str, str], None]  # (level, kind, text)


@dataclass(slots=True, frozen=True)
class HealStatus:
    """What the node shows: whether the copy heals now, why, and how often it did."""

    healing: str = ""  # the reason while sick or healing, "" when healthy
    heals: int = 0
    last_heal_at: float = 0.0  # wall time of the last restore; 0 = never
    lr_scale: float = 1.0  # current step-size scale (below 1 for a while after a heal)


def param_norm(module: torch.nn.Module) -> float:
    params = [p.detach() for p in module.parameters()]
    if not params:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([n.float() for n in torch._foreach_norm(params)])))


def lowered_scale(scale: float, heal_lr_scale: float) -> float:
    """The step-size scale after a heal: multiplicative decrease from where it was, never below
    ``heal_lr_scale ** MIN_SCALE_HEALS`` (a copy that heals again and again must still learn)."""
    return max(scale * heal_lr_scale, heal_lr_scale**MIN_SCALE_HEALS)


def raised_scale(scale: float, heal_lr_scale: float, ceiling: float = 1.0) -> float:
    """The scale after ``heal_steps`` healthy updates: half the decrease of one heal back, at most ``ceiling``."""
    return min(ceiling, 1.0, scale / heal_lr_scale**0.5)


def lowered_ceiling(ceiling: float, sick_scale: float, heal_lr_scale: float) -> float:
    """After a heal: never climb back to the scale the copy was sick at (half a heal's decrease below it), and never
    below the floor of the scale itself."""
    return max(min(ceiling, sick_scale * heal_lr_scale**0.5), heal_lr_scale**MIN_SCALE_HEALS)


class Healer:
    def __init__(self, worker: Any, notify: Notify, on_change: Callable[[], None] | None = None,
                 store: SnapshotStore | None = None):
        self.worker = worker
        self.store = store or SnapshotStore()  # on disk where the node gives it a folder (swarm/integrity/snapshots.py)
        self.cfg = worker.run.integrity
        self.health: HealthMonitor = worker.health
        self.notify = notify
        self.on_change = on_change or (lambda: None)
        self._snapshot: Kept | None = None
        self._steps = 0
        self._healthy_steps = 0  # since the last heal or the last raise of the scale
        self._scale = 1.0
        self._ceiling = 1.0  # the scale never rises above this (lowered by each heal, recovering slowly)
        self._ceiling_steps = 0
        # the good snapshot before the last, weights only (4 bytes a parameter less for Adam): the fallback when the
        # last keeps getting sick, restored with a fresh optimizer state (its moments were of the copy it replaces)
        self._previous: Kept | None = None
        self._restores = 0  # of the current snapshot
        self._status = HealStatus()
        self._healing = False
        # (wall time, scale, ceiling) before each recent heal: a heal later found to be a convicted peer's doing
        # gives its step size back (``forgive``)
        self._heals: list[tuple[float, float, float]] = []

    # ----- compute thread
    def take_snapshot(self) -> None:
        """Keep the current copy as the last good one; a non-finite or collapsed copy is never kept (it is
        sick): stage 0 checks its outputs on its last batch of own data first (the update that killed the
        copy may come right before a snapshot, and a dead snapshot would heal into a dead copy)."""
        with self.worker.lock:
            norm = param_norm(self.worker.module)
            if not math.isfinite(norm):
                self.health.observe_param_norm(norm)
                return
            if self.collapsed():
                return
            if self._snapshot is not None and self._restores == 0:
                self.store.drop(self._previous)
                self._previous = self._snapshot.weights_only()
            else:  # one restored since is no longer "good"
                self.store.drop(self._snapshot)
            self._snapshot = self.store.keep(self.worker.capture(include_optimizer=True, dtype=SNAPSHOT_DTYPE))
            self._restores = 0
            self.health.set_baseline(norm)

    def collapsed(self) -> bool:
        """Stage 0 (under the worker's lock): are the copy's outputs on its last own batch collapsed? Marks it sick."""
        probe = self.health.probe
        if probe is None:
            return False
        with torch.no_grad():
            return self.health.judge_collapse(probe, self.worker.module(probe))

    def on_step(self, info: Any) -> None:
        self._steps += 1
        heal_steps = max(1, self.cfg.heal_steps)
        if self._ceiling < 1.0:
            self._ceiling_steps += 1
            if self._ceiling_steps >= CEILING_RECOVERY * heal_steps:
                self._ceiling_steps = 0
                self._ceiling = raised_scale(self._ceiling, self.cfg.heal_lr_scale)
        if self._scale < self._ceiling:
            self._healthy_steps += 1
            if self._healthy_steps >= heal_steps:
                self._healthy_steps = 0
                self._set_lr_scale(raised_scale(self._scale, self.cfg.heal_lr_scale, self._ceiling))
        if self._steps % CHECK_EVERY_STEPS == 0:
            self.health.observe_param_norm(param_norm(self.worker.module))
        if self._steps % self.cfg.snapshot_every_steps == 0 and not self.health.sick:
            self.take_snapshot()

    def heal(self) -> str:
        """Restore the last good snapshot and lower the step size; returns what was done."""
        reason = self.health.sick_reason or "unknown"
        with self.worker.lock:
            self.worker.cache.clear()
            self._restores += 1
            if self._restores > RESTORES_BEFORE_FALLBACK and self._previous is not None and (
                    self._previous.clock > 0 or self._snapshot.clock == 0):
                # sick again and again from it: it is not good. One snapshot further back, never the seeded copy
                # of a copy that has trained (a trained copy reset to its seed lost everything it learnt)
                self._fall_back()
            try:
                state = self.store.load(self._snapshot)
            except OSError:  # its file is gone (a data dir removed under the node): the one before, if any
                if self._previous is None:
                    raise
                logger.warning("healing's last snapshot cannot be read: restoring the one before it")
                self._fall_back()
                state = self.store.load(self._snapshot)
            self.worker.restore(state)
            if not self._snapshot.optimizer:  # the fallback, kept without its moments: Adam starts afresh
                self.worker.optimizer.state.clear()
            self._heals = [h for h in self._heals if time.time() - h[0] < FORGIVE_WINDOW_S][-MAX_HEALS_KEPT:]
            self._heals.append((time.time(), self._scale, self._ceiling))
            self._ceiling = lowered_ceiling(self._ceiling, self._scale, self.cfg.heal_lr_scale)
            self._ceiling_steps = 0
            scale = lowered_scale(self._scale, self.cfg.heal_lr_scale)
            self._set_lr_scale(scale)
            self._healthy_steps = 0
            self.health.healed()
        self._status = HealStatus(healing="", heals=self._status.heals + 1, last_heal_at=time.time(), lr_scale=scale)
        return (f"healed: {reason}; restored the last good copy (clock {self._snapshot.clock:.0f}); step size now "
                f"{scale:.2g}x the run's, recovering every {self.cfg.heal_steps} healthy updates up to "
                f"{self._ceiling:.2g}x")

    def _fall_back(self) -> None:
        """The snapshot before the last becomes the one to restore (weights only); the last is forgotten."""
        self.store.drop(self._snapshot)
        self._snapshot, self._previous, self._restores = self._previous, None, 0

    def forgive(self, signer: str, now: float | None = None) -> str | None:
        """``signer`` was convicted (its tensors did not follow from its weights: swarm/pipeline/stage/convictions.py):
        the heals of the last FORGIVE_WINDOW_S were likely its doing, not this copy's, so the step size and its
        ceiling go back to what they were before the first of them (the restored weights stay: the snapshot was
        good). Said, and returned; None when there was nothing to give back. Called on the event loop."""
        now = time.time() if now is None else now
        with self.worker.lock:
            recent = [h for h in self._heals if now - h[0] < FORGIVE_WINDOW_S]
            self._heals = []
            if not recent:
                return None
            _, scale, ceiling = recent[0]
            if scale <= self._scale and ceiling <= self._ceiling:
                return None
            self._ceiling = max(self._ceiling, ceiling)
            self._ceiling_steps = 0
            self._healthy_steps = 0
            self._set_lr_scale(max(self._scale, min(scale, self._ceiling)))
        text = (f"{len(recent)} heal(s) of the last {FORGIVE_WINDOW_S:.0f} s are put down to peer {signer[-8:]}, "
                f"convicted of sending tensors its weights do not give: step size back to {self._scale:.2g}x")
        self.notify("info", "forgiven", text)
        return text

    def _set_lr_scale(self, scale: float) -> None:
        self._scale = scale
        self.worker.step_size.set_heal_scale(scale)  # composes with the staleness factor (swarm/pipeline/stage/staleness.py)
        self._status = HealStatus(healing=self._status.healing, heals=self._status.heals,
                                  last_heal_at=self._status.last_heal_at, lr_scale=scale)

    def close(self) -> None:
        """The stage is stopping: its snapshots' files go."""
        self.store.close()

    # ----- any thread
    def status(self) -> HealStatus:
        reason = self.health.sick_reason
        if reason and not self._status.healing:
            return HealStatus(healing=reason, heals=self._status.heals, last_heal_at=self._status.last_heal_at,
                              lr_scale=self._status.lr_scale)
        return self._status

    # ----- event loop
    async def watch(self, executor: Any, stop: asyncio.Event | None = None) -> None:
        loop = asyncio.get_running_loop()
        while stop is None or not stop.is_set():
            await asyncio.sleep(WATCH_PERIOD_S)
            notice, self.health.notice = self.health.notice, None
            if notice:  # a loss that restores did not cure: the inputs' doing (health.py LOSS_HEALS_MAX)
                self.notify("warning", "upstream", notice)
            reason = self.health.sick_reason
            if reason is None or self._healing:
                continue
            self._healing = True
            try:
                self.notify("warning", "healing", f"this copy is sick ({reason}): it stops serving and heals")
                self.on_change()
                text = await loop.run_in_executor(executor, self.heal)
                self.notify("warning", "healed", text)
            except Exception as exc:  # healing must not die silently: say it, try again next period
                logger.exception("healing failed")
                self.notify("error", "healing", f"healing failed ({exc.__class__.__name__}: {exc}); retrying")
            finally:
                self._healing = False
                self.on_change()
