"""No helper process outlives a volunteer process, on any exit path.

hivemind runs the DHT in a forked process that starts p2pd; if our main process is killed
(SIGKILL, a crash), both keep running and hold the identity and the port. So before anything
else starts, we fork a tiny watchdog that leads its own process group; the DHT process joins
that group (and p2pd with it). The watchdog polls its parent: once the parent is gone, it
terminates the group, waits, kills what is left, and exits. On a clean exit the group is
already empty and the watchdog simply leaves.

SIGINT/SIGTERM in the main process become a ``ShutdownRequested`` flag that the engine's
loops wait on, so Ctrl+C shuts the DHT down in order instead of raising in random places.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

WATCHDOG_POLL_S = 0.2
WATCHDOG_TERM_GRACE_S = 3.0


class Watchdog:
    def __init__(self) -> None:
        self.pgid: int | None = None
        self.pid: int | None = None

    def start(self) -> "Watchdog":
        if not hasattr(os, "fork"):
            return self
        parent = os.getpid()
        # SIGINT/SIGTERM wait while we fork: a handler run inside the at-fork hooks (logging's lock) or in the
        # child before it sets its own would act in the wrong place; they are delivered once unblocked.
        mask = _block_stop_signals()
        try:
            pid = os.fork()
            if pid == 0:  # pragma: no cover - runs in the forked child
                _watchdog_main(parent, mask)
        finally:
            _restore_signals(mask)
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass  # the child already did it (or is gone); both call it to avoid a race
        self.pid = self.pgid = pid
        return self

    def stop(self) -> None:
        """Called after a clean shutdown: the group should be empty; let the watchdog go."""
        if self.pid is None:
            return
        try:
            os.kill(self.pid, signal.SIGTERM)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        self.pid = None


def _block_stop_signals() -> set | None:
    if not hasattr(signal, "pthread_sigmask"):
        return None
    return signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})


def _restore_signals(mask: set | None) -> None:
    if mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _watchdog_main(parent: int, mask: set | None) -> None:  # pragma: no cover - runs in the forked child
    try:
        os.setpgid(0, 0)
        own_group = os.getpgid(0)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.closerange(3, 65536)
        stopped = []
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda *_: stopped.append(True))
        _restore_signals(mask)
        while os.getppid() == parent and not stopped:
            time.sleep(WATCHDOG_POLL_S)
        _reap_group(own_group)
    finally:
        os._exit(0)


def group_members(pgid: int) -> list[int]:
    """Pids in process group ``pgid`` (Linux /proc; elsewhere an empty list)."""
    return _members(STAT_PGRP, {pgid})


def session_members(sids: Iterable[int]) -> list[int]:
    """Pids in any of the sessions ``sids`` (a forked process's tree: volunteer_cli/forkserver.py)."""
    return _members(STAT_SESSION, set(sids))


STAT_PGRP, STAT_SESSION = 2, 3  # /proc/PID/stat after the command's ")": state, ppid, pgrp, session, ...


def _members(field: int, wanted: set[int]) -> list[int]:
    """Live (non-zombie) processes other than this one whose stat ``field`` is in ``wanted``."""
    me = os.getpid()
    members: list[int] = []
    proc = Path("/proc")
    if not wanted or not proc.is_dir():
        return members
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > field and int(fields[field]) in wanted and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def tagged_pids(env_name: str, tag: str) -> list[int]:
    """Live (non-zombie) processes other than this one whose environment has ``env_name=tag``.

    The test harness and the benchmark fleets tag every process they start this way, so that a
    leftover (a DHT child, p2pd) is found whatever its parent or process group (Linux /proc).
    """
    needle = f"{env_name}={tag}".encode()
    me = os.getpid()
    found: list[int] = []
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            if needle not in (entry / "environ").read_bytes():
                continue
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if stat[stat.rfind(")") + 2] != "Z":
            found.append(int(entry.name))
    return found


def _reap_group(pgid: int) -> None:  # pragma: no cover - runs in the forked child
    members = group_members(pgid)
    if not members:
        return
    for pid in members:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + WATCHDOG_TERM_GRACE_S
    while time.monotonic() < deadline and group_members(pgid):
        time.sleep(0.1)
    for pid in group_members(pgid):
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_group_now(pgid: int, spare: int | None = None, wait_s: float = 0.5) -> None:
    """SIGKILL every process of group ``pgid`` but ``spare`` and remove the unix sockets p2pd listened on.

    For an abandoned startup, where nothing was announced that a clean leave would have to take back.
    SIGKILL, not SIGTERM: the DHT process ignores SIGTERM, and p2pd logs errors while it shuts down;
    so its sockets (named on its command line, ``/unix/tmp/hivemind-*.sock``) are removed here."""
    members = [pid for pid in group_members(pgid) if pid != spare]
    sockets = [path for pid in members for path in _unix_sockets(pid)]
    for pid in members:
        _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and [pid for pid in group_members(pgid) if pid != spare]:
        time.sleep(0.02)
    for path in sockets:
        try:
            path.unlink()
        except OSError:
            continue  # already gone (or never made)


def _unix_sockets(pid: int) -> list[Path]:
    """Hivemind's p2pd sockets in ``pid``'s command line (Linux /proc)."""
    try:
        args = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return []
    found = []
    for arg in args:
        text = arg.decode(errors="replace")
        for part in text.split(","):
            path = part.split("/unix", 1)[1] if "/unix/" in part else ""
            if path.endswith(".sock") and Path(path).name.startswith("hivemind-"):
                found.append(Path(path))
                found.append(Path(path.replace("hivemind-p2pd-", "hivemind-p2pclient-")))  # the DHT process's end
    return found


class ShutdownRequested:
    """Turns SIGINT/SIGTERM into an Event; a second Ctrl+C while shutting down exits at once.

    The handler takes no lock: it runs in the main thread between any two bytecodes, also inside a critical section
    of the very Event it would set, or inside itself for a second signal. Until session 33 it set the Event and ran
    the callbacks there, and a second SIGTERM that came while the first one's ``Event.set`` held that Event's lock
    (the tests' harness signals a process twice; so does a user's ``kill`` twice) waited on the lock forever: the
    volunteer never left (tests/procs.py caught two such, stacks in hand). Now the handler only notes the signal and
    puts it on a ``SimpleQueue`` (whose ``put`` is safe in a signal handler), and a relay thread sets the Event and
    runs the callbacks, once. A process forked after ``install`` that sets no handler of its own has no relay
    thread: there the signal does what it does by default."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None  # the first signal received
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._fired = False
        self._queue: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._pid: int | None = None  # the process whose relay thread reads the queue

    def install(self) -> "ShutdownRequested":
        self.start_relay()
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)
        return self

    def start_relay(self) -> None:
        if self._pid != os.getpid():
            self._pid = os.getpid()
            threading.Thread(target=self._relay, name="signal-relay", daemon=True).start()

    def on_request(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` on the first signal; at once if one already came (while the command set up)."""
        with self._lock:
            self._callbacks.append(callback)
            fired = self._fired
        if fired:
            callback()

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            os.write(2, b"\nforced exit\n")  # not print: the main thread may be inside a write to stderr
            os._exit(130)
        if self.signum is None:
            self.signum = signum
        if self._pid == os.getpid():
            self._queue.put(signum)
        else:  # forked after ``install``, without a handler of its own: the signal's default (it ends), no lock
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _relay(self) -> None:
        while True:
            self._queue.get()
            self._fire()

    def _fire(self) -> None:
        """Set the Event and run the callbacks, on the first signal only."""
        with self._lock:
            if self._fired:
                return
            self._fired = True
            callbacks = list(self._callbacks)
        self.event.set()
        for callback in callbacks:
            callback()


def quiet_libraries(verbose: int) -> None:
    """Keep hivemind and p2pd quiet unless asked (-v: info, -vv: debug). hivemind reads HIVEMIND_LOGLEVEL when it is
    imported: a process forked from one that imported it already (volunteer_cli/forkserver.py) gets the level here."""
    level = {0: "ERROR", 1: "INFO"}.get(verbose, "DEBUG")
    os.environ.setdefault("HIVEMIND_LOGLEVEL", level)
    os.environ.setdefault("GOLOG_LOG_LEVEL", "error" if verbose < 2 else "info")
    loaded = sys.modules.get("hivemind.utils.logging")
    if loaded is not None:
        import logging

        loaded.loglevel = os.environ["HIVEMIND_LOGLEVEL"]
        logging.getLogger("hivemind").setLevel(os.environ["HIVEMIND_LOGLEVEL"])


PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up once in the parent: between fork and exec the child then makes one system call, and
    imports nothing (an import there takes the import machinery's locks, as another thread left them at the fork)."""
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:
        return None


def die_with_parent_hook() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes a child get SIGTERM when its parent dies (Linux); None elsewhere.

    For processes a supervisor starts in their own session (the demo's volunteers, benchmark fleets):
    they then leave cleanly even if the supervisor is SIGKILLed, and their own watchdogs reap the rest.
    """
    prctl = _prctl() if sys.platform.startswith("linux") else None
    if prctl is None:
        return None

    def term_when_parent_dies() -> None:  # in the child between fork and exec: one system call, no import, no lock
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    return term_when_parent_dies


EXIT_THREADS_S = 5.0  # end_process waits this long for the threads that are not daemons, then exits without them


def end_process(code: int, handlers: bool = True) -> None:
    """End this process with ``code`` as a normal exit would, up to the interpreter's finalization: it waits for the
    threads that are not daemons (a write still under way is finished, as at ``sys.exit``; at most EXIT_THREADS_S,
    where a normal exit would wait forever for a stuck one) and runs the exit handlers (logging's flush,
    multiprocessing's stop of daemonic children); ``handlers`` False: neither, for a start abandoned while a thread
    still loads. The interpreter's finalization does not run. That finalization collected the heap torch and hivemind
    built and ran torch's library finalizers: 0.6-1.5 s of CPU in a child of the fork server (which writes to, and so
    copies, every page the fork shared), ~1 s at the end of an exec'ed command, after its work was done. For the
    `volunteer` command and the fork server's children only: whatever the command started, it has stopped."""
    import atexit

    try:
        if handlers:
            joined = threading.Event()
            threading.Thread(target=_exit_without_threads, args=(code, joined), name="exit-deadline",
                             daemon=True).start()
            threading._shutdown()  # what the interpreter does first at an exit: join the threads that are not daemons
            joined.set()
            atexit._run_exitfuncs()
    finally:
        _flush_and_exit(code)


def _exit_without_threads(code: int, joined: threading.Event) -> None:
    """``end_process``'s bound: threads that are not daemons still running after EXIT_THREADS_S are left behind."""
    if joined.wait(EXIT_THREADS_S):
        return
    stuck = [t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
    try:
        sys.stderr.write(f"exiting without {len(stuck)} thread(s) still running after {EXIT_THREADS_S:g} s: "
                         f"{', '.join(stuck)}\n")
    except (OSError, ValueError):
        pass
    _flush_and_exit(code)


def _flush_and_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that left, a stream the command closed
            pass
    os._exit(code)
