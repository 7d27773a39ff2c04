"""The processes of a benchmark: real processes on 127.0.0.1 that never outlive it.

Every process a benchmark starts carries ``VOLUNTEER_BENCH_TAG=<uuid>`` in its environment, and so do their children
(the DHT process, p2pd, the watchdog, torch_shm_manager; a fleet's fork server carries it, so its children show it).
``Fleet.close`` stops them in order (SIGTERM, then SIGKILL of the session), then SIGKILLs anything still tagged:
nothing is left behind, even on Ctrl+C, SIGTERM or an exception. Children also get SIGTERM if the benchmark itself is
killed (PR_SET_PDEATHSIG). DHTs the benchmark runs in-process live in a watchdog's process group (as a volunteer's
do), which is reaped when they are shut down or the benchmark dies. The benchmark process itself is not tagged: its
own torch_shm_manager must outlive the reaping (killing it aborts the process that uses it). Every wait is bounded.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import BenchmarkError, say, wait_until
from benchmarks.procstats import cmdline, process_cpu_seconds, process_kind
from volunteer.hygiene import die_with_parent_hook, tagged_pids as pids_with_env
from volunteer_cli.forkserver import ForkServer, available as forks_available, spawn_or_exec

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
TAG_ENV = "VOLUNTEER_BENCH_TAG"
STOP_GRACE_S = 20.0
REAP_GRACE_S = 10.0
START_TIMEOUT_S = 180.0  # a cold `import torch` takes 6 s, and much longer on a loaded 2-core machine

# ----- processes


def tagged_pids(tag: str) -> list[int]:
    """Live processes (not this one) that carry our tag: see volunteer.hygiene.tagged_pids."""
    return pids_with_env(TAG_ENV, tag)


class Proc:
    """One child process in its own session; stdout and stderr go to files in the work dir."""

    def __init__(self, argv: list[str], env: dict[str, str], log_dir: Path, name: str, stdin_pipe: bool = False,
                 forks: Any = None):  # forks: a ForkServer that forks `volunteer ARGV` instead of an exec of argv
        self.name = name
        self.started_at = time.time()
        self.stdout_path = log_dir / f"{name}.out"
        self.stderr_path = log_dir / f"{name}.err"
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            if forks is not None:
                self.popen = spawn_or_exec(forks, argv, env, out.fileno(), err.fileno(),
                                           [sys.executable, "-m", "volunteer_cli", *argv], die_with_parent_hook(),
                                           die_with_parent=True)
            else:
                self.popen = subprocess.Popen(
                    argv, env=env, stdout=out, stderr=err, stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
                    start_new_session=True, preexec_fn=die_with_parent_hook(),
                )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stdout(self) -> str:
        try:
            return self.stdout_path.read_text(errors="replace")
        except OSError:
            return ""

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""

    def json_lines(self) -> list[dict[str, Any]]:
        """Complete JSON lines printed so far (other lines are skipped)."""
        out = []
        for line in self.stdout().split("\n")[:-1]:
            try:
                item = json.loads(line)
            except ValueError:
                continue
            if isinstance(item, dict):
                out.append(item)
        return out

    def check_running(self) -> None:
        if self.popen.poll() is not None:
            raise BenchmarkError(f"{self.name} exited with status {self.popen.returncode}: {self.stderr()[-1500:]}")

    def stop(self, timeout_s: float = STOP_GRACE_S) -> float:
        """SIGTERM, then SIGKILL the whole session if it does not exit in time; returns seconds taken."""
        started = time.monotonic()
        if self.popen.stdin is not None:  # children that read stdin leave when it closes
            try:
                self.popen.stdin.close()
            except OSError:
                pass
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        if self.popen.poll() is None:
            try:
                os.kill(self.popen.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return time.monotonic() - started

    def kill(self) -> None:
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


class Fleet:
    """The processes (and in-process DHTs) of one benchmark, reaped on every exit path.

    Use as a context manager. ``close`` is idempotent and also runs at interpreter exit and on
    SIGTERM/SIGINT (turned into KeyboardInterrupt so ``finally`` blocks run).
    """

    _live: list["Fleet"] = []

    def __init__(self, prefix: str = "volunteer-bench-", keep_workdir: bool = False, fork: bool = False):
        """``fork``: `volunteer` processes are forked from a fork server of the fleet's (volunteer_cli/forkserver.py:
        ~2.2 s of CPU less each), for benchmarks that measure after start-up; VOLUNTEER_BENCH_EXEC=1 execs them."""
        self.tag = uuid.uuid4().hex
        self.fork = fork and not os.environ.get("VOLUNTEER_BENCH_EXEC")
        self.forks: Any = None
        self.workdir = Path(tempfile.mkdtemp(prefix=prefix))
        self.keep_workdir = keep_workdir
        self.procs: list[Proc] = []
        self.dhts: list[Any] = []
        self.closed = False
        os.environ.setdefault("HIVEMIND_LOGLEVEL", "ERROR")
        os.environ.setdefault("GOLOG_LOG_LEVEL", "error")
        self.env = {
            **os.environ,
            TAG_ENV: self.tag,
            "VOLUNTEER_DATA_DIR": str(self.workdir / "data"),
            "VOLUNTEER_CONFIG_DIR": str(self.workdir / "config"),
            "PYTHONUNBUFFERED": "1",
            "VOLUNTEER_LOW_PRIORITY": "0",  # normal priority, as the figures taken before join lowered itself
        }
        self._watchdog: Any = None
        Fleet._live.append(self)
        _install_handlers()

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- child processes
    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None, stdin_pipe: bool = False) -> Proc:
        proc = Proc(argv, {**self.env, **(env or {})}, self.workdir, name, stdin_pipe=stdin_pipe)
        self.procs.append(proc)
        return proc

    def volunteer(self, name: str, *args: str, env: dict[str, str] | None = None) -> Proc:
        merged = {**self.env, **(env or {})}
        if self.fork and merged.get(TAG_ENV) == self.tag:  # a forked child's /proc environ is the server's (tagged)
            if self.forks is None and forks_available():
                self.forks = ForkServer(self.env, die_with_parent_hook(), str(self.workdir / "forkserver.log"))
            if self.forks is not None:  # forked, or exec'ed where the server will not fork it
                self.procs.append(Proc(list(args), merged, self.workdir, name, forks=self.forks))
                return self.procs[-1]
        return self.start(name, [sys.executable, "-m", "volunteer_cli", *args], env=env)

    def bootstrap(self, timeout_s: float = START_TIMEOUT_S) -> tuple[Proc, str]:
        """A real `volunteer bootstrap` on loopback; returns it and its multiaddr."""
        proc = self.volunteer("bootstrap", "bootstrap", "--listen", LOOPBACK, "--json",
                              "--identity", str(self.workdir / "bootstrap.key"))

        def first_line() -> dict | None:
            proc.check_running()
            lines = proc.json_lines()
            return lines[0] if lines else None

        info = wait_until(first_line, timeout_s, "the bootstrap peer to start", interval_s=0.05)
        return proc, info["maddrs"][0]

    def join(self, name: str, run: Path, swarm: str, maddr: str, *extra: str, env: dict[str, str] | None = None) -> Proc:
        return self.volunteer(name, "join", "--run", str(run), "--swarm", swarm, "--initial-peers", maddr,
                              "--listen", LOOPBACK, "--headless", "--log-format", "json", *extra, env=env)

    def stop(self, procs: list[Proc], timeout_s: float = STOP_GRACE_S) -> None:
        """Stop several processes at once (a clean leave takes seconds each): SIGTERM all, then wait."""
        for proc in procs:
            if proc.alive():
                try:
                    os.kill(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                say(f"{proc.name} did not stop in {timeout_s:.0f} s; killing it")
                proc.kill()

    def cpu_snapshot(self) -> dict[int, tuple[str, float]]:
        """CPU time (user + system) used so far by each live process of this fleet: pid -> (kind, seconds).

        Kinds: ``volunteer`` (the main process of each `volunteer` command: stage compute, RPC
        handling, the engine), ``dht`` (the DHT process each of them forks), ``p2pd`` and ``other``.
        """
        pids = tagged_pids(self.tag)
        servers = (self.forks.proc.pid,) if self.forks is not None else ()
        return {pid: (process_kind(pid, pids, servers), process_cpu_seconds(pid)) for pid in pids}

    # ----- in-process DHTs (forked processes of this one, with their p2pd)
    def _process_group(self) -> int | None:
        """A watchdog group for in-process DHTs: they die with this process even on SIGKILL."""
        if self._watchdog is None:
            from volunteer.hygiene import Watchdog

            self._watchdog = Watchdog().start()
        return self._watchdog.pgid

    def dht(self, initial_peers: list[str], validators: list[Any], *, identity_path: Path | None = None,
            client_mode: bool = False) -> Any:
        from swarm.dht.dht import DHTSettings, start_dht

        settings = DHTSettings(initial_peers=initial_peers, host_maddrs=[LOOPBACK], client_mode=client_mode,
                               identity_path=identity_path, process_group=self._process_group())
        dht = start_dht(settings, validators)
        self.dhts.append(dht)
        return dht

    # ----- teardown
    def close(self) -> list[int]:
        """Stop everything; returns the pids that had to be SIGKILLed after the orderly stop."""
        if self.closed:
            return []
        from swarm.dht.dht import shutdown_dht

        for proc in reversed(self.procs):
            try:
                proc.stop()
            except Exception as exc:  # keep reaping the others
                say(f"stopping {proc.name}: {exc}")
        for dht in reversed(self.dhts):
            try:
                shutdown_dht(dht)
            except Exception as exc:
                say(f"stopping an in-process DHT: {exc}")
        if self._watchdog is not None:
            self._wait_group_empty(self._watchdog.pgid)
            self._watchdog.stop()  # it SIGTERMs, then SIGKILLs, whatever is still in its group
            self._watchdog = None
        if self.forks is not None:
            self.forks.close()
            self.forks = None
        self.procs, self.dhts = [], []
        leftovers = self._reap()
        if not self.keep_workdir:
            subprocess.run(["rm", "-rf", str(self.workdir)], check=False)
        self.closed = True  # only now: an interrupted close runs again at exit
        if self in Fleet._live:
            Fleet._live.remove(self)
        return leftovers

    def in_process_helpers(self) -> list[int]:
        """The processes behind this benchmark's in-process DHTs (DHT processes and their p2pd)."""
        from volunteer.hygiene import group_members

        pgid = self._watchdog.pgid if self._watchdog is not None else None
        return [pid for pid in group_members(pgid) if pid != pgid] if pgid is not None else []

    def close_dht(self, dht: Any) -> None:
        from swarm.dht.dht import shutdown_dht

        shutdown_dht(dht)
        if dht in self.dhts:
            self.dhts.remove(dht)

    def _wait_group_empty(self, pgid: int | None) -> None:
        from volunteer.hygiene import group_members

        if pgid is None:
            return
        deadline = time.monotonic() + REAP_GRACE_S
        while time.monotonic() < deadline and set(group_members(pgid)) - {pgid}:
            time.sleep(0.1)
        left = set(group_members(pgid)) - {pgid}
        if left:
            say("in-process DHT helpers still running, the watchdog reaps them: "
                + "; ".join(f"{pid} {cmdline(pid)[:80]}" for pid in sorted(left)))

    def _reap(self) -> list[int]:
        deadline = time.monotonic() + REAP_GRACE_S
        while time.monotonic() < deadline and tagged_pids(self.tag):
            time.sleep(0.2)
        left = tagged_pids(self.tag)
        if left:
            say("left over: " + "; ".join(f"{pid} {cmdline(pid)[:120]}" for pid in left))
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if left:
            say(f"killed {len(left)} leftover process(es): {left}")
        return left


_handlers_installed = False


def _install_handlers() -> None:
    global _handlers_installed
    if _handlers_installed:
        return
    _handlers_installed = True
    atexit.register(_close_all)

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)


def _close_all() -> None:
    for fleet in list(Fleet._live):
        fleet.close()


def new_identity(path: Path) -> Path:
    """A libp2p identity file (a returning volunteer already has one, so key generation is not timed)."""
    from swarm.dht.dht import ensure_identity

    ensure_identity(path)
    return path
