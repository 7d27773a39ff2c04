"""`volunteer` processes forked from one that has already imported torch and hivemind.

Every `volunteer` process imports torch, hivemind and the client before it does anything: ~2.2 s of CPU on the 2-core
machines this project is measured on. `volunteer demo` starts a bootstrap peer and a volunteer per stage at once, so
five processes import the same modules side by side before the first is online; a test run starts hundreds. A fork
server imports them once, then forks each process from there: the child runs `volunteer ARGV` with the environment,
working directory, standard streams and session it was asked for, exactly as an exec'ed `volunteer` would, minus the
imports (a fork of the server takes ~10 ms).

Why a child starts as clean as a fresh interpreter: the server forks only while it is single-threaded (Python's
threads; numpy's OpenBLAS keeps a native thread that its own at-fork handlers stop and restart), has no event loop,
never initialises CUDA and never runs a tensor op (libgomp's pool would not survive a fork). ``serve`` checks the
first two and refuses to fork otherwise (the caller then execs, ``ForkServer.spawn`` raising ``ForkRefused``).
Python's ``random`` reseeds itself in a forked child; numpy's global generator is reseeded here; torch's default
generator is at its import-time seed in both cases.

What differs from an exec, and is handled:
- ``/proc/PID/environ`` is the environment the *server* was started with (the kernel keeps the one an exec set);
  ``os.environ``, what the program and the processes it starts see, is the child's. A caller that finds its processes
  by an environment tag (tests/procs.py, benchmarks/fleet.py) starts a server with that tag.
- The interpreter's start-up flags are the server's: the server is started with ``-u`` semantics where the caller
  asks for unbuffered output (``PYTHONUNBUFFERED`` in the child's environment re-opens its streams write-through).
- The child's parent is the server: the server reports each child's exit status to the client that spawned it
  (``Forked.poll``/``wait`` read it, as ``subprocess.Popen``'s do); a child asked to die with its parent gets SIGTERM
  when the server dies, and the server dies with its client (``die_with_parent``).

Linux only (``available()``); elsewhere callers exec as before.

Wire (a SOCK_SEQPACKET socket pair, one JSON message per packet): a request ``{"argv", "env", "cwd",
"session", "die_with_parent"}`` carries the child's stdin, stdout and stderr as file descriptors (SCM_RIGHTS); the
server answers ``{"pid": PID}`` or ``{"error": TEXT}``, and later ``{"exit": PID, "code": CODE}`` (a negative code: the
signal that ended it, as ``Popen.returncode``).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

PACKET = 1 << 20  # a request's bytes (the environment) fit in one packet
CLOSE_WAIT_S = 10.0
SPAWN_TIMEOUT_S = 120.0  # the first request waits for the server's imports: seconds, more on a loaded machine
# What a volunteer process imports before it joins, loaded once by the server (module names; a missing one is skipped).
PRELOAD = (
    "torch", "hivemind", "numpy", "yaml", "pydantic", "cryptography", "blake3", "psutil",
    "volunteer_cli.main", "volunteer_cli.commands.join", "volunteer_cli.commands.bootstrap",
    "volunteer.config", "volunteer.node", "swarm.dht.dht", "swarm.pipeline.stage.worker",
    "swarm.pipeline.control.driver", "swarm.run.models", "swarm.run.data",
)


class ForkRefused(RuntimeError):
    """The server cannot fork this child (it is not single-threaded, or it is gone): exec the command instead."""


class SpawnCancelled(RuntimeError):
    """The caller's ``cancelled`` turned true while it waited (a Ctrl+C during the server's imports): no child."""


def available() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "fork") and hasattr(socket, "SOCK_SEQPACKET")


class Forked:
    """A child of the fork server, with the part of ``subprocess.Popen``'s interface callers use."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]):
        self._server = server
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self.stdin = self.stdout = self.stderr = None  # as a Popen's whose streams are not pipes

    def poll(self) -> int | None:
        if self.returncode is None:
            self._server._exit_code(self, timeout_s=0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._server._exit_code(self, timeout_s=timeout, wait=True)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The client's side: starts the server process (``env``: its environment, e.g. a test's tag) and asks it for
    children. Thread-safe. ``close`` ends the server; children asked to die with their parent get SIGTERM then."""

    def __init__(self, env: dict[str, str] | None = None, preexec_fn: Any = None, log: str | None = None):
        """``log``: a file for the server's own output (what its imports print; a crash); by default nowhere."""
        if not available():
            raise ForkRefused("no fork server on this platform")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self._lock = threading.Lock()
        # the children still running, by pid: an exit is told to the child that had the pid *then* (pids are reused:
        # a test run wraps Linux's 32,768 and a pid's next holder must not read its predecessor's status)
        self._running: dict[int, Forked] = {}
        self._argv: dict[int, list[str]] = {}  # by request id, until its reply
        self._replies: dict[int, dict[str, Any]] = {}
        self._asked = 0
        self._abandoned: set[int] = set()  # requests given up on: a child forked for one later is killed at once
        self.killed: list[int] = []  # those children
        self._gone = False
        out = open(log or os.devnull, "ab")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "volunteer_cli.forkserver", str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                env={**(env if env is not None else os.environ), "PYTHONUNBUFFERED": "1"}, stdin=subprocess.DEVNULL,
                stdout=out, stderr=out, start_new_session=True, preexec_fn=preexec_fn,
            )
        finally:
            out.close()
            theirs.close()

    def spawn(self, argv: list[str], env: dict[str, str], stdout: int, stderr: int, stdin: int | None = None,
              cwd: str | None = None, session: bool = True, die_with_parent: bool = False,
              cancelled: Callable[[], bool] = lambda: False) -> Forked:
        """`volunteer ARGV` in a child of the server; ``stdout``/``stderr``/``stdin`` are file descriptors (they are
        duplicated into the child, the caller keeps and closes its own). Raises ForkRefused if it cannot, and
        SpawnCancelled if ``cancelled()`` turns true while it waits (a child forked later for it is killed)."""
        null = None
        if stdin is None:
            null = stdin = os.open(os.devnull, os.O_RDONLY)
        request = {"argv": list(argv), "env": dict(env), "cwd": cwd or os.getcwd(), "session": session,
                   "die_with_parent": die_with_parent}
        try:
            with self._lock:
                if self._gone:
                    raise ForkRefused("the fork server has stopped")
                self._asked += 1
                request["id"] = ask = self._asked
                self._argv[ask] = ["volunteer", *argv]
                try:
                    socket.send_fds(self._sock, [json.dumps(request).encode()], [stdin, stdout, stderr])
                except OSError as exc:
                    self._gone = True
                    raise ForkRefused(f"the fork server has stopped ({exc})") from exc
                reply = self._reply(ask, SPAWN_TIMEOUT_S, cancelled)
        finally:
            if null is not None:
                os.close(null)
        if reply.get("cancelled"):
            raise SpawnCancelled("cancelled while the fork server started")
        if "pid" not in reply:
            raise ForkRefused(reply.get("error", "no answer from the fork server"))
        return reply["child"]

    def close(self) -> None:
        with self._lock:
            deadline = time.monotonic() + CLOSE_WAIT_S  # a child forked for a request given up on is killed first
            while self._abandoned and not self._gone and time.monotonic() < deadline:
                self._read(0.1)
            self._gone = True
            self._sock.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    # ----- under the lock
    def _reply(self, ask: int, timeout_s: float, cancelled: Callable[[], bool]) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while ask not in self._replies:
            left = deadline - time.monotonic()
            if self._gone or left <= 0 or cancelled():
                self._abandoned.add(ask)
                if cancelled():
                    return {"cancelled": True}
                return {"error": "the fork server has stopped" if self._gone else "the fork server did not answer"}
            self._read(min(left, 0.1))
        return self._replies.pop(ask)

    def _read(self, timeout_s: float) -> bool:
        """Read what the server sent within ``timeout_s``: exits onto their children, replies into ``_replies``."""
        got = False
        while not self._gone:
            ready, _, _ = select.select([self._sock], [], [], timeout_s)
            if not ready:
                return got
            try:
                data = self._sock.recv(PACKET)
            except OSError:
                data = b""
            if not data:  # the server is gone: its children's exits will never be told (see _exit_code)
                self._gone = True
                return got
            message = json.loads(data)
            if "exit" in message:
                child = self._running.pop(int(message["exit"]), None)  # None: a child killed as abandoned
                if child is not None:
                    child.returncode = int(message["code"])
            elif message.get("id") in self._abandoned:  # its caller went on without it (and exec'ed instead)
                self._abandoned.discard(message["id"])
                self._argv.pop(message["id"], None)
                if "pid" in message:
                    self.killed.append(int(message["pid"]))
                    _kill_session(int(message["pid"]))
            else:
                ask = int(message.get("id", 0))
                argv = self._argv.pop(ask, ["volunteer"])
                if "pid" in message:  # registered as it is read: its pid's earlier holder's exit was read before
                    message["child"] = self._running[int(message["pid"])] = Forked(self, int(message["pid"]), argv)
                self._replies[ask] = message
            got, timeout_s = True, 0.0
        return got

    def _exit_code(self, child: Forked, timeout_s: float | None, wait: bool = False) -> None:
        """Sets ``child.returncode`` once its exit is known (within ``timeout_s`` if ``wait``)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._lock:
                if child.returncode is None and not self._gone:
                    left = 0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic()))
                    self._read(left if wait else 0.0)
                if child.returncode is not None:
                    return
                if self._gone and not _alive(child.pid):  # nobody will tell its status: gone from /proc is all
                    child.returncode = -signal.SIGKILL
                    self._running.pop(child.pid, None)
                    return
                gone = self._gone
            if not wait or (deadline is not None and time.monotonic() >= deadline):
                return
            if gone:
                time.sleep(0.05)


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# ----- the server process


def _preload() -> None:
    import importlib

    os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")  # as volunteer_cli.main sets it
    from swarm.dht.lightdht import light_hivemind

    light_hivemind()
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


# Read once, when an interpreter or a library starts (the path, the allocator, thread pools, hivemind's log level): a
# child asked for with other values than the server started with is exec'ed instead (PYTHONUNBUFFERED: the server
# is unbuffered, which a child without it does not mind; PYTHONDONTWRITEBYTECODE only spares the disk).
STARTUP_ENV_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "GLIBC_", "OMP_", "KMP_", "MKL_", "OPENBLAS_", "HIVEMIND_", "TORCH",
                        "CUDA", "PYTORCH")
STARTUP_ENV_IGNORED = ("PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE")


def _startup_env_differs(started: dict[str, str], wanted: dict[str, str]) -> str | None:
    for name in sorted(set(started) | set(wanted)):
        if name.startswith(STARTUP_ENV_PREFIXES) and name not in STARTUP_ENV_IGNORED \
                and started.get(name) != wanted.get(name):
            return f"{name} differs from the fork server's (read when a process starts)"
    return None


def _why_not_fork() -> str | None:
    if threading.active_count() != 1:
        return f"the fork server runs {threading.active_count()} Python threads"
    import asyncio

    if asyncio.get_event_loop_policy()._local._loop is not None:  # type: ignore[attr-defined]
        return "the fork server has an event loop"
    return None


def serve(fd: int) -> None:
    """The server's loop: fork a child per request, report each child's exit; return when the client leaves."""
    sock = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl+C reaches the client's whole terminal group; it decides
    started = dict(os.environ)
    _preload()
    owners: set[int] = set()
    while True:
        try:
            ready, _, _ = select.select([sock, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap(sock, owners)
        if sock in ready:
            try:
                data, fds, _, _ = socket.recv_fds(sock, PACKET, 3)
            except OSError:
                data, fds = b"", []
            if not data:
                return
            request = json.loads(data)
            reason = _why_not_fork() or _startup_env_differs(started, request["env"])
            if reason is None and len(fds) != 3:
                reason = "a request without its three standard streams"
            if reason is not None:
                _send(sock, {"id": request.get("id"), "error": reason})
            else:
                sys.stdout.flush()
                sys.stderr.flush()
                server = os.getpid()
                ready_r, ready_w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    os.close(ready_r)
                    _child(request, fds, sock, [wake_r, wake_w], server, ready_w)  # never returns
                owners.add(pid)
                os.close(ready_w)
                os.read(ready_r, 1)  # its session and streams are set up (or it died trying): as Popen returns
                os.close(ready_r)
                _send(sock, {"id": request.get("id"), "pid": pid})
            for extra in fds:
                os.close(extra)


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    try:
        sock.send(json.dumps(message).encode())
    except OSError:
        pass


def _reap(sock: socket.socket, owners: set[int]) -> None:
    while owners:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        owners.discard(pid)
        _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _child(request: dict[str, Any], fds: list[int], sock: socket.socket, close: list[int], server: int,
           ready: int) -> None:
    """In the forked child: become `volunteer ARGV` as an exec would have made it, run it, exit with its code."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if request.get("session", True):
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        sock.close()  # the object, not only its descriptor: its finalizer would close whatever reuses the number
        for fd in [*fds, *close]:
            try:
                os.close(fd)
            except OSError:
                pass
        if request.get("die_with_parent"):
            from volunteer.hygiene import die_with_parent_hook

            hook = die_with_parent_hook()
            if hook is not None:
                hook()
                if os.getppid() != server:  # the server died before the hook was set: as if after
                    raise SystemExit(128 + signal.SIGTERM)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        os.write(ready, b"1")  # the caller may signal our session from now on
        os.close(ready)
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()  # a fresh process draws its own seed; a fork would share the server's
        sys.argv = ["volunteer", *request["argv"]]
        from volunteer_cli.main import main

        code = main(request["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child must never return into the server's loop
        import traceback

        traceback.print_exc()
        code = 1
    raise SystemExit(code)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
