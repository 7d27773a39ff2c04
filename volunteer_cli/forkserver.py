"""`volunteer` processes forked from one that has already imported torch and hivemind: the client's side.

Every `volunteer` process imports torch, hivemind and the client before it does anything: ~2.2 s of CPU on the 2-core
machines this project is measured on. `volunteer demo` starts a bootstrap peer and a volunteer per stage at once, and a
test run hundreds of processes. ``ForkServer`` starts a server process (volunteer_cli/forkserver_process.py) that
imports them once and forks each child from there; the child runs `volunteer ARGV` with the environment, working
directory, standard streams and session it was asked for, as an exec'ed `volunteer` would, minus the imports.
``Forked`` is the child as ``subprocess.Popen`` callers know it (``poll``, ``wait``, ``send_signal``, ``returncode``:
the server reports each exit, negative for a signal). Where the server cannot fork a child (``ForkRefused``) the caller
execs it; Linux only (``available()``).

What differs from an exec: ``/proc/PID/environ`` shows the environment the *server* was started with (``os.environ``,
what the program and its own children see, is the child's), so a caller that finds its processes by an environment tag
starts a server with that tag or finds them by their session (``volunteer.hygiene.session_members``); the child's
parent is the server, which dies with its client when asked (``preexec_fn``), and its children with it
(``die_with_parent``).
"""

from __future__ import annotations

import json
import logging
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

from volunteer_cli.forkserver_process import PACKET

logger = logging.getLogger(__name__)

CLOSE_WAIT_S = 10.0
SPAWN_TIMEOUT_S = 120.0  # the first request waits for the server's imports: seconds, more on a loaded machine


class ForkRefused(RuntimeError):
    """The server cannot fork this child (it is not single-threaded, or it is gone): exec the command instead."""


class SpawnCancelled(RuntimeError):
    """The caller's ``cancelled`` turned true while it waited (a Ctrl+C during the server's imports): no child."""


def available() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "fork") and hasattr(socket, "SOCK_SEQPACKET")


def spawn_or_exec(forks: ForkServer | None, args: list[str], env: dict[str, str], stdout: int, stderr: int,
                  exec_argv: list[str], preexec_fn: Any = None, die_with_parent: bool = False,
                  cancelled: Callable[[], bool] = lambda: False, netns: str | None = None) -> Forked | subprocess.Popen:
    """`volunteer ARGS` forked by ``forks`` if there is one and it can, else ``exec_argv`` exec'ed in a session of its
    own (with ``preexec_fn``), stdin from /dev/null either way: what the demo, the tests and the benchmarks call.
    ``netns``: the forked child joins that network namespace (``exec_argv`` then says how an exec enters it)."""
    if forks is not None:
        try:
            return forks.spawn(args, env, stdout, stderr, die_with_parent=die_with_parent, cancelled=cancelled,
                               netns=netns)
        except ForkRefused as exc:
            logger.info("not forked (%s): %s is exec'ed", exc, " ".join(args[:1]))
    return subprocess.Popen(exec_argv, env=env, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=preexec_fn)


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
                [sys.executable, "-m", "volunteer_cli.forkserver_process", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                env={**(env if env is not None else os.environ), "PYTHONUNBUFFERED": "1"}, stdin=subprocess.DEVNULL,
                stdout=out, stderr=out, start_new_session=True, preexec_fn=preexec_fn,
            )
        finally:
            out.close()
            theirs.close()

    def spawn(self, argv: list[str], env: dict[str, str], stdout: int, stderr: int, stdin: int | None = None,
              cwd: str | None = None, session: bool = True, die_with_parent: bool = False,
              cancelled: Callable[[], bool] = lambda: False, netns: str | None = None,
              module: str | None = None) -> Forked:
        """`volunteer ARGV` in a child of the server (``python -m MODULE ARGV`` with ``module``: a benchmark);
        ``stdout``/``stderr``/``stdin`` are file descriptors (they are duplicated into the child, the caller keeps and
        closes its own). Raises ForkRefused if it cannot, and SpawnCancelled if ``cancelled()`` turns true while it
        waits (a child forked later for it is killed)."""
        null = None
        if stdin is None:
            null = stdin = os.open(os.devnull, os.O_RDONLY)
        request = {"argv": list(argv), "env": dict(env), "cwd": cwd or os.getcwd(), "session": session,
                   "die_with_parent": die_with_parent, "netns": netns, "module": module}
        try:
            with self._lock:
                if self._gone:
                    raise ForkRefused("the fork server has stopped")
                self._asked += 1
                request["id"] = ask = self._asked
                self._argv[ask] = [sys.executable, "-m", module, *argv] if module else ["volunteer", *argv]
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
