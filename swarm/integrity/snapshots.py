"""Healing's snapshots on disk (issue 42): a last-good copy of the stage lives in a file, not in memory.

A stage keeps its last good snapshot (weights and optimizer state in bfloat16: 6 bytes a parameter with Adam) and the
one before it (its weights: 2 bytes) for a restore that is rare (swarm/integrity/heal.py). In memory that was 8 of
the ~44 bytes a stage parameter costs a volunteer's RAM, and on a GPU volunteer a third of the host memory its stage
takes. So a node writes them to files in its own folder (``volunteer/paths.py node_dir``: beside its checkpoint, on
the disk, not in /tmp, which is RAM on many systems) and reads one back only to heal.

- ``keep`` hands the captured state to one writer thread and returns at once (the compute thread, under the stage's
  lock, does not wait on the disk); the state stays in memory until its file is complete, so a heal meanwhile
  restores it from there. A file is written under a temporary name and renamed, so a file that exists is whole.
- A write that fails (a full disk, a folder removed under us) keeps that snapshot in memory and says so once: a heal
  never lacks a snapshot because of the disk.
- ``drop`` deletes a snapshot nobody will restore (after its write: one thread does both, in order); ``close``
  removes the folder. A process killed before it could is cleaned up after by the next one in that folder (the
  folder is named after its process id).
- Without a folder (in-process tests, tools) snapshots stay in memory, as before.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import torch

logger = logging.getLogger(__name__)

PREFIX = "heal-"
_FOLDERS = itertools.count()


class _Entry:
    """A snapshot's tensors: in memory (``state``) until its file (``path``) is whole, or for good without one."""

    __slots__ = ("state", "path", "dropped")

    def __init__(self, state: Any, path: Path | None):
        self.state, self.path, self.dropped = state, path, False


class Kept:
    """One snapshot: its clock and version in memory, its tensors in a file (or in memory until written, or for good
    without a folder or after a failed write). ``optimizer``: whether a restore brings the optimizer's state back."""

    def __init__(self, entry: _Entry, clock: float, param_version: int, optimizer: bool):
        self._entry, self.clock, self.param_version, self.optimizer = entry, clock, param_version, optimizer

    @property
    def path(self) -> Path | None:
        return self._entry.path

    def weights_only(self) -> Kept:
        """The same snapshot restored without its optimizer state (the fallback one snapshot back): in memory its
        moments go; on disk the file stays as it is and is read without them."""
        entry = self._entry
        if entry.path is None and entry.state is not None:  # in memory for good: keep only what a restore reads
            entry = _Entry(replace(entry.state, optimizer=None), None)
        return Kept(entry, self.clock, self.param_version, False)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this snapshot holds in memory (none once its file is written)."""
        state = self._entry.state
        if state is None:
            return []
        return [*state.params.values(), *(state.optimizer or {}).values()]


class SnapshotStore:
    def __init__(self, directory: Path | None = None, notify: Callable[[str, str, str], None] | None = None):
        self.directory: Path | None = None
        self._notify = notify or (lambda level, kind, text: None)
        self._names = itertools.count()
        self._writer: _Writer | None = None
        self._warned = False
        self._lock = threading.Lock()
        self.failed = 0  # writes that did not land (the snapshot stayed in memory)
        if directory is not None:
            try:
                self.directory = _own_folder(Path(directory))
                self._writer = _Writer()
            except OSError as exc:
                self._fail(f"cannot make a folder for them in {directory}: {exc}")

    @property
    def on_disk(self) -> bool:
        return self._writer is not None

    def keep(self, state: Any) -> Kept:
        """A snapshot of ``state`` (a WorkerState, its optimizer state included or not); written in the background."""
        writer, directory = self._writer, self.directory
        entry = _Entry(state, None if writer is None or directory is None else
                       directory / f"snapshot-{next(self._names)}.pt")
        if writer is not None and entry.path is not None:
            try:
                writer.submit(self._write, entry)
            except RuntimeError:  # closed: a stop under way
                entry.path = None
        return Kept(entry, state.clock, state.param_version, state.optimizer is not None)

    def load(self, kept: Kept) -> Any:
        """The WorkerState to restore (without its optimizer state for a weights-only snapshot). Raises OSError when
        the file is gone or unreadable (the heal says so and tries again)."""
        entry = kept._entry
        state, path = entry.state, entry.path
        if state is not None:
            return state if kept.optimizer else replace(state, optimizer=None)
        if path is None:
            raise OSError("healing's snapshot was dropped")
        from swarm.pipeline.stage.stage_stats import WorkerState

        try:
            saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            raise OSError(f"healing's snapshot {path} cannot be read: {exc}") from None
        return WorkerState(params=saved["params"], optimizer=saved["optimizer"] if kept.optimizer else None,
                           clock=float(saved["clock"]), loss_ema=saved["loss_ema"],
                           param_version=int(saved["param_version"]))

    def drop(self, kept: Kept | None) -> None:
        """Forget ``kept``: its file is deleted once written."""
        if kept is None:
            return
        entry = kept._entry
        with self._lock:
            entry.dropped, entry.state = True, None
            path = entry.path
        if path is not None and self._writer is not None:
            try:
                self._writer.submit(_remove, path)
            except RuntimeError:
                pass

    def settle(self, timeout_s: float = 60.0) -> None:
        """Wait until every snapshot handed over so far is written (or failed): a measure of what memory holds."""
        writer = self._writer
        if writer is not None:
            writer.submit(lambda: None).result(timeout_s)

    def close(self) -> None:
        """Stop writing and remove the folder (a write in progress fails quietly)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.shutdown()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)

    # ----- the writer thread
    def _write(self, entry: _Entry) -> None:
        state, path = entry.state, entry.path
        if state is None or path is None:  # dropped before its turn
            return
        temporary = path.with_suffix(".partial")
        try:
            torch.save({"params": state.params, "optimizer": state.optimizer or {}, "clock": state.clock,
                        "loss_ema": state.loss_ema, "param_version": state.param_version}, temporary)
            os.replace(temporary, path)
        except Exception as exc:  # the state stays in memory: a heal restores it from there
            _remove(temporary)
            entry.path = None  # in memory for good
            if self._writer is not None:  # not a stop's doing
                self._fail(f"could not write one to {path.parent} ({exc.__class__.__name__}: {exc})")
            return
        with self._lock:
            if not entry.dropped:  # (a dropped one's file goes by the removal queued behind this write)
                entry.state = None

    def _fail(self, why: str) -> None:
        with self._lock:
            self.failed += 1
            warned, self._warned = self._warned, True
        if not warned:
            text = f"healing's snapshots are kept in memory instead of on disk: {why}"
            logger.warning(text)
            self._notify("warning", "snapshots", text)


class _Writer:
    """One daemon thread running what it is given in order: a process that exits (a Ctrl+C) never waits on a write
    (a ThreadPoolExecutor's thread is joined at exit, and a large stage's file takes seconds)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        threading.Thread(target=self._run, name="heal-writer", daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        if self._closed:
            raise RuntimeError("closed")
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        """What is queued is not run; what runs finishes (or fails: its folder goes)."""
        self._closed = True
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if self._closed:
                future.cancel()
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 (handed to whoever waits on it)
                future.set_exception(exc)


def _own_folder(parent: Path) -> Path:
    """``parent/heal-<pid>-<n>``, new, after removing the folders of processes that no longer run."""
    parent.mkdir(parents=True, exist_ok=True)
    for old in parent.glob(f"{PREFIX}*"):
        pid = old.name.removeprefix(PREFIX).partition("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    while True:
        folder = parent / f"{PREFIX}{os.getpid()}-{next(_FOLDERS)}"
        try:
            folder.mkdir(mode=0o700)
            return folder
        except FileExistsError:  # a process of ours before a fork, or an earlier one with our id
            continue


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        logger.debug("removing %s: %s", path, exc)
