"""The fork server's process (started by volunteer_cli/forkserver.py ``ForkServer``): import once, fork each child.

Why a child starts as clean as a fresh interpreter: the server forks only while it is single-threaded (Python's
threads; numpy's OpenBLAS keeps a native thread that its own at-fork handlers stop and restart) and has no event loop
(``_why_not_fork``), never initialises CUDA and never runs a tensor op (libgomp's pool would not survive a fork). A
child whose start-up environment differs from the server's (``STARTUP_ENV_PREFIXES``: read once, when an interpreter
or a library starts) is refused. Python's ``random`` reseeds itself in a forked child; numpy's global generator is
reseeded here; torch's default generator is at its import-time seed in both cases. The server runs unbuffered, so its
children's output reaches their files at once.

Wire (a SOCK_SEQPACKET socket pair, one JSON message per packet, in order): a request ``{"id", "argv", "env", "cwd",
"session", "die_with_parent", "netns", "module"}`` carries the child's stdin, stdout and stderr as file descriptors
(SCM_RIGHTS); ``netns``, a network namespace's name or null, is joined by the child before it runs; ``module``, a
module's name or null, makes the child ``python -m MODULE ARGV`` instead of `volunteer ARGV`. The answer is
``{"id", "pid"}`` once the child has its session and streams, or ``{"id", "error"}``; later ``{"exit": PID, "code":
CODE}`` (negative: the signal that ended it, as ``Popen.returncode``). The server returns when the client's side
closes.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import sys
import threading
from typing import Any

PACKET = 1 << 20  # a request's bytes (the environment) fit in one packet
READY_TIMEOUT_S = 10.0  # a child that has not set up its session and streams by then is answered anyway
# What a volunteer process imports before it joins, loaded once by the server (module names; a missing one is skipped).
PRELOAD = (
    "torch", "hivemind", "numpy", "yaml", "pydantic", "cryptography", "blake3", "psutil",
    "volunteer_cli.main", "volunteer_cli.commands.join", "volunteer_cli.commands.bootstrap",
    "volunteer.config", "volunteer.node", "swarm.dht.dht", "swarm.pipeline.stage.worker",
    "swarm.pipeline.control.driver", "swarm.run.models", "swarm.run.data",
    "swarm.pipeline.peer", "swarm.averaging.agent", "volunteer.headless", "volunteer.checkpoint",
)


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
# is unbuffered, which a child without it does not mind; PYTHONDONTWRITEBYTECODE only spares the disk;
# TORCHINDUCTOR_CACHE_DIR is read at each use, and torch writes it into the environment of any process that once
# asked inductor for its cache folder: in a test run every child after that was exec'ed, 38 of one worker's).
STARTUP_ENV_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "GLIBC_", "OMP_", "KMP_", "MKL_", "OPENBLAS_", "HIVEMIND_", "TORCH",
                        "CUDA", "PYTORCH")
STARTUP_ENV_IGNORED = ("PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "TORCHINDUCTOR_CACHE_DIR")


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

    # the policy's current loop, without get_event_loop's side effects (it would make one)
    if getattr(getattr(asyncio.get_event_loop_policy(), "_local", None), "_loop", None) is not None:
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
    # Every object the imports made (~200,000) moves to the collector's permanent generation: a child's full
    # collections no longer walk them nor write to their headers, which copied the pages the fork shared (Python's
    # documentation recommends it to a server that forks). Measured: a volunteer of a 45-s demo ran one, 0.16-0.20 s
    # of CPU, 0.02 s frozen
    gc.freeze()
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
            netns = request.get("netns")
            if reason is None and netns and not os.path.exists(os.path.join(NETNS_DIR, str(netns))):
                reason = f"no network namespace {netns!r}"
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
                # its session and streams are set up (or it died trying): as Popen returns; bounded, the others wait
                if select.select([ready_r], [], [], READY_TIMEOUT_S)[0]:
                    os.read(ready_r, 1)
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


CLONE_NEWNET = 0x40000000
NETNS_DIR = "/var/run/netns"


def _enter_netns(name: str) -> None:
    """Join the named network namespace, as `ip netns exec NAME` does for the network (a network lab's host: the
    child and the p2pd it starts see that host's interfaces only). Needs root, as `ip netns exec` does."""
    import ctypes

    if "/" in name or name in ("", ".", ".."):
        raise ValueError(f"not a network namespace's name: {name!r}")
    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns into network namespace {name}: {os.strerror(error)}")
    finally:
        os.close(fd)


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
        if request.get("netns"):
            _enter_netns(str(request["netns"]))
        os.write(ready, b"1")  # the caller may signal our session from now on
        os.close(ready)
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()  # a fresh process draws its own seed; a fork would share the server's
        module = request.get("module")
        if module:  # `python -m MODULE ARGV` (a benchmark): its `__main__` block exits with the code
            import runpy

            sys.argv = [module, *request["argv"]]
            runpy.run_module(str(module), run_name="__main__", alter_sys=True)
            code = 0
        else:
            sys.argv = ["volunteer", *request["argv"]]
            from volunteer_cli.main import main

            code = main(request["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child must never return into the server's loop
        import traceback

        traceback.print_exc()
        code = 1
    # without finalizing the interpreter: its collection of the heap inherited from the server wrote to every
    # object's header and so copied each page the fork shared, 0.6-1.5 s of CPU per child at every exit
    from volunteer.hygiene import end_process

    end_process(code)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
