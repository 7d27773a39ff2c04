"""Checkpoints of one node's copy of its layer: saved atomically, restored on restart.

A checkpoint holds the stage's ``state_dict``, the optimizer state, the clock (samples trained
into this copy), the parameter version and the loss EMA. The node saves one on pause, on exit and
every ``resources.checkpoint_interval_s``, so a crash loses at most one interval of progress.

Consistency and responsiveness: ``capture`` copies the tensors to CPU under the worker's lock (the
compute thread holds it while it updates, so a copy is never half-updated); ``Checkpointer``
writes the copy on its own thread, so neither the compute thread nor the node's tick loop ever
waits for the disk. A write goes to a temporary file in the same folder, is fsynced, then
``os.replace``d over the old one (and the folder fsynced): a crash mid-write leaves the previous
checkpoint intact, never a torn one.

On restart ``plan_resume`` (a pure function over the checkpoint's clock and the swarm's records)
decides whether to continue from the checkpoint or, when the swarm has moved well past it, to set
it aside and take the layer from the peers instead.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
CHECKPOINT_SUFFIX = ".ckpt"
ASIDE_SUFFIX = ".aside"
CORRUPT_SUFFIX = ".corrupt"
# The swarm "has moved on" when a peer's clock exceeds ours by this fraction of ours, and by at least
# this many samples (a young swarm's clocks differ by a few micro-batches all the time).
AHEAD_FRACTION = 0.5
AHEAD_MIN_SAMPLES = 50_000
MAX_SLOTS = 64
WRITE_WAIT_S = 30.0  # on exit: how long the last write may take before we give up on it
ACTIVE_STATES = frozenset({"online", "paused", "finishing", "syncing"})


class CheckpointError(Exception):
    """A checkpoint cannot be read or does not fit this node; the message says why."""


@dataclass(frozen=True, slots=True)
class CheckpointState:
    """A consistent CPU copy of one stage's training state."""

    run_id: str
    swarm: str
    module: dict[str, Any]
    optimizer: dict[str, Any]
    clock: float  # fractional once averaging merged clocks
    param_version: int
    loss_ema: float | None
    saved_at: float  # wall clock

    def to_payload(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION, "run_id": self.run_id, "swarm": self.swarm, "module": self.module,
            "optimizer": self.optimizer, "clock": self.clock, "param_version": self.param_version,
            "loss_ema": -1.0 if self.loss_ema is None else float(self.loss_ema), "saved_at": self.saved_at,
        }


@dataclass(frozen=True, slots=True)
class ResumePlan:
    use_checkpoint: bool  # restore it; else start from the peers (or fresh) and set it aside
    reason: str  # one line for the event log


@dataclass(frozen=True, slots=True)
class Resume:
    """What a starting node does with its checkpoint: decided before its stage serves anything."""

    state: CheckpointState | None  # restore this once the stage is built; None: start as a newcomer
    message: str = ""  # for the event log; "" when there was no checkpoint
    warning: bool = False


def claim_slot(node_dir: Path) -> tuple[Path, Any]:
    """The first checkpoint of this (run, swarm) folder that no running node holds, and its lock.

    A restarted node finds its swarm's checkpoint whatever identity slot it got; two volunteers of
    one swarm on one machine each keep their own (``checkpoint.ckpt``, ``checkpoint-2.ckpt``...).
    """
    from swarm.dht.dht import IdentityLock

    for slot in range(MAX_SLOTS):
        path = node_dir / f"checkpoint{f'-{slot + 1}' if slot else ''}{CHECKPOINT_SUFFIX}"
        lock = IdentityLock(path)
        if lock.acquire():
            return path, lock
    raise CheckpointError(f"all {MAX_SLOTS} checkpoint slots in {node_dir} are held by running nodes")


def prepare_resume(path: Path, run_id: str, swarm: str, records: Iterable[Any], my_peer_id: str, *,
                   can_sync: bool) -> Resume:
    """Read our checkpoint and decide; a damaged or outrun checkpoint is moved aside, never deleted."""
    try:
        state = read(path, run_id, swarm)
    except FileNotFoundError:
        return Resume(None)
    except CheckpointError as exc:
        move_aside(path, CORRUPT_SUFFIX)
        return Resume(None, f"not using the checkpoint: {exc}; kept as {path.name}{CORRUPT_SUFFIX}", warning=True)
    plan = plan_resume(state.clock, records, my_peer_id, can_sync=can_sync)
    if not plan.use_checkpoint:
        move_aside(path)
        return Resume(None, f"{plan.reason}; kept as {path.name}{ASIDE_SUFFIX}")
    return Resume(state, plan.reason)


# ----- capture, write, read, restore


def capture(worker: Any, run_id: str, swarm: str) -> CheckpointState:
    """Copy the worker's state under its lock (blocks compute for the length of one copy only)."""
    with worker.lock:
        module = {name: tensor.detach().to("cpu", copy=True) for name, tensor in worker.module.state_dict().items()}
        optimizer = _cpu_copy(worker.optimizer.state_dict())
        stats = worker.stats
        clock, version, loss = float(stats.clock), int(stats.param_version), stats.loss_ema
    return CheckpointState(run_id=run_id, swarm=swarm, module=module, optimizer=optimizer, clock=clock,
                           param_version=version, loss_ema=loss, saved_at=time.time())


def _cpu_copy(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _cpu_copy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu_copy(item) for item in value)
    return value


def write_atomic(path: Path, state: CheckpointState) -> int:
    """Write temp + fsync + os.replace + fsync of the folder; returns the size in bytes."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(scratch, "wb") as file:
            torch.save(state.to_payload(), file)
            file.flush()
            os.fsync(file.fileno())
        size = scratch.stat().st_size
        os.replace(scratch, path)
    except BaseException:
        scratch.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return size


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # not every platform opens folders
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a folder; the rename itself is still atomic
    finally:
        os.close(fd)


def read(path: Path, run_id: str, swarm: str) -> CheckpointState:
    """The checkpoint at path; CheckpointError if it is unreadable or belongs to another run or swarm."""
    import torch

    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as exc:  # torch raises many kinds for a damaged file
        raise CheckpointError(f"{path} is damaged ({exc.__class__.__name__}: {str(exc)[:120]})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path} is not a checkpoint of format {FORMAT_VERSION}")
    if payload.get("run_id") != run_id or payload.get("swarm") != swarm:
        raise CheckpointError(
            f"{path} belongs to {payload.get('run_id')}/{payload.get('swarm')}, not {run_id}/{swarm}"
        )
    try:
        loss = float(payload["loss_ema"])
        return CheckpointState(
            run_id=run_id, swarm=swarm, module=dict(payload["module"]), optimizer=dict(payload["optimizer"]),
            clock=float(payload["clock"]), param_version=int(payload["param_version"]),
            loss_ema=loss if loss >= 0 and math.isfinite(loss) else None, saved_at=float(payload["saved_at"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path} misses a field: {exc}") from None


def restore(worker: Any, state: CheckpointState) -> None:
    """Load the state into the worker under its lock; CheckpointError (and no change) if it does not fit."""
    with worker.lock:
        worker.ring.release_live()  # a referee may still ask for the version it replaces
        before_module = {name: tensor.detach().clone() for name, tensor in worker.module.state_dict().items()}
        before_optimizer = _cpu_copy(worker.optimizer.state_dict())
        try:
            worker.module.load_state_dict(state.module, strict=True)
            worker.optimizer.load_state_dict(state.optimizer)
        except (RuntimeError, ValueError, KeyError) as exc:
            worker.module.load_state_dict(before_module)
            worker.optimizer.load_state_dict(before_optimizer)
            raise CheckpointError(f"the checkpoint does not fit this layer: {str(exc)[:200]}") from None
        worker.stats.clock = state.clock
        worker.stats.param_version = state.param_version
        worker.stats.loss_ema = state.loss_ema


def move_aside(path: Path, suffix: str = ASIDE_SUFFIX) -> Path | None:
    """Keep a checkpoint we do not use (the newest one per suffix) where it cannot be overwritten."""
    target = path.with_name(path.name + suffix)
    try:
        os.replace(path, target)
    except FileNotFoundError:
        return None
    return target


# ----- the decision on restart (pure)


def plan_resume(checkpoint_clock: float, records: Iterable[Any], my_peer_id: str, *, can_sync: bool) -> ResumePlan:
    """Continue from our checkpoint, unless the swarm moved well past it and we can download from peers.

    ``records`` are the swarm's membership records; our own (a stale record of the process that
    crashed) is ignored. Without a way to download the layer, even an old checkpoint beats the
    initial weights, so it is used.
    """
    others = [r.clock for r in records if r.peer_id != my_peer_id and r.state in ACTIVE_STATES]
    best = max(others, default=0)
    ahead = best > checkpoint_clock + max(AHEAD_MIN_SAMPLES, AHEAD_FRACTION * checkpoint_clock)
    mine = f"{checkpoint_clock:.0f}"
    if not ahead:
        where = f"the swarm's best clock is {best:.0f}" if others else "no other peer in the swarm"
        return ResumePlan(True, f"resuming from the checkpoint at clock {mine} ({where})")
    if can_sync:
        return ResumePlan(False, f"the swarm moved on (clock {best:.0f} vs our checkpoint's {mine}): "
                                 "downloading the layer from peers instead")
    return ResumePlan(True, f"the swarm moved on (clock {best:.0f} vs our checkpoint's {mine}), but "
                            "downloading the layer from peers is not available: resuming from the checkpoint")


# ----- the node's saver


class Checkpointer:
    """Saves one node's checkpoint on a schedule and on demand; writes run on a writer thread.

    ``save`` captures at once (the caller's thread, under the worker's lock) and queues the write;
    a save with nothing trained since the last one is skipped. ``close`` waits for queued writes.
    """

    def __init__(self, path: Path, run_id: str, swarm: str, interval_s: float,
                 notify: Callable[[str, str], None] | None = None, monotonic: Callable[[], float] = time.monotonic,
                 lock: Any = None):
        self.path = path
        self._lock = lock  # released by close(), after the last write
        self.run_id = run_id
        self.swarm = swarm
        self.interval_s = interval_s
        self._notify = notify or (lambda level, text: None)
        self._monotonic = monotonic
        self._next_s = monotonic() + interval_s
        self._saved_version: int | None = 0  # a copy that never trained is the seeded initial weights
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._pending: list[Future] = []
        self._closed = False
        self.last_saved_clock: float | None = None

    def mark_restored(self, state: CheckpointState) -> None:
        """The worker now holds this state: no need to write it again until it trains."""
        self._saved_version = state.param_version
        self.last_saved_clock = state.clock

    def due(self) -> bool:
        return self._monotonic() >= self._next_s

    def save(self, worker: Any, why: str, periodic: bool = False) -> Future | None:
        """Capture now, write in the background; None when skipped (nothing new, or closed)."""
        self._next_s = self._monotonic() + self.interval_s
        if self._closed or worker is None:
            return None
        if worker.stats.param_version == self._saved_version:
            return None
        state = capture(worker, self.run_id, self.swarm)
        self._saved_version = state.param_version
        future = self._writer.submit(self._write, state, why, periodic)
        self._pending = [f for f in self._pending if not f.done()] + [future]
        return future

    def _write(self, state: CheckpointState, why: str, periodic: bool) -> int:
        started = time.monotonic()
        try:
            size = write_atomic(self.path, state)
        except OSError as exc:
            self._saved_version = None  # try again next time
            self._notify("warning", f"could not save the checkpoint to {self.path}: {exc}")
            return 0
        self.last_saved_clock = state.clock
        logger.info("checkpoint (%s) at clock %.0f: %d bytes in %.2f s", why, state.clock, size,
                    time.monotonic() - started)
        if not periodic:  # the periodic ones would fill the event log
            self._notify("info", f"saved a checkpoint at clock {state.clock:.0f} ({why})")
        return size

    def close(self, timeout_s: float = WRITE_WAIT_S) -> bool:
        """Wait for queued writes (bounded); idempotent. False if a write was still running."""
        self._closed = True
        deadline = time.monotonic() + timeout_s
        done = True
        for future in self._pending:
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception as exc:
                logger.warning("checkpoint write did not finish: %s", exc.__class__.__name__)
                done = False
        self._writer.shutdown(wait=False)
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        return done
