"""Real `volunteer` processes for tests: loopback only, bounded waits, nothing left behind.

Every process a test starts carries VOLUNTEER_TEST_TAG=<uuid> in its environment; children
inherit it (the DHT process, p2pd, the watchdog), so after a test we can find anything that
outlived it by scanning /proc/*/environ, whatever its parent or process group.

Most are forked from one fork server per test process (volunteer_cli/forkserver.py: torch, hivemind and the
client imported once, ~2.2 s of CPU a process less). A forked process's /proc/PID/environ is the server's (its
os.environ, what p2pd and every program it execs inherit, carries the tag), so a forked process and what it forks
in turn (its watchdog) are found by their session instead: each starts one, which its own children stay in.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

from benchmarks.netlab import netns_of  # a lab host's prefix: its volunteer is forked into the namespace
from volunteer_cli.forkserver import Forked, ForkServer, available as forks_available, spawn_or_exec
from volunteer.hygiene import session_members, tagged_pids as pids_with_env

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
TAG_ENV = "VOLUNTEER_TEST_TAG"
STUCK_LOG = Path("/tmp/volunteer-tests-stuck.log")  # processes that outlived a SIGTERM (Proc.stop)


def volunteer_exe() -> str:
    exe = Path(sys.executable).parent / "volunteer"
    return str(exe) if exe.exists() else (shutil.which("volunteer") or "volunteer")


def unused_peer_id() -> str:
    """A well-formed libp2p peer id (sha256 multihash, base58) that nobody holds."""
    number = int.from_bytes(b"\x12\x20" + hashlib.sha256(b"nobody").digest(), "big")
    out = ""
    while number:
        number, digit = divmod(number, 58)
        out = BASE58[digit] + out
    return out


def tagged_pids(tag: str, sessions: Iterable[int] = ()) -> list[int]:
    """Live processes (not this one) that carry our tag (see volunteer.hygiene.tagged_pids), or that are in one of
    ``sessions`` (the forked processes' own)."""
    return sorted(set(pids_with_env(TAG_ENV, tag)) | set(session_members(sessions)))


_FORKS: ForkServer | None = None
# The environment this test process started with. A test's processes start from it, not from os.environ as it is
# then: a library imported by a test writes into os.environ (scikit-learn sets KMP_DUPLICATE_LIB_OK, torch's inductor
# TORCHINDUCTOR_CACHE_DIR), and a child asked for with start-up settings other than its fork server's is exec'ed
# (the serial suite failed on it, and a worker exec'ed every later child: ~2.5 s of CPU more each). A test that wants
# a variable in its processes passes it (``Swarm.start(env=...)``).
START_ENV = {key: value for key, value in os.environ.items() if key != "HIVEMIND_LOGLEVEL"}


def fork_server() -> ForkServer:
    """This test process's fork server, started at its first use (it leaves when this process does: its socket
    closes). Its environment is ``START_ENV``, as every test's processes start from (their tags and folders are in
    each request's environment)."""
    global _FORKS
    if _FORKS is None or _FORKS.proc.poll() is not None:
        _FORKS = ForkServer(env=dict(START_ENV))
    return _FORKS


def wait_until(predicate, timeout_s: float, interval_s: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


class Proc:
    def __init__(self, args: list[str], env: dict[str, str], log_dir: Path, name: str, prefix: list[str] = (),
                 forks: ForkServer | None = None):
        self.name = name
        self.swarm: str | None = None  # set by Swarm.join
        self.stdout_path = log_dir / f"{name}.out"
        self.stderr_path = log_dir / f"{name}.err"
        self._stdout = open(self.stdout_path, "wb")
        self._stderr = open(self.stderr_path, "wb")
        netns = netns_of(prefix)
        self.popen = spawn_or_exec(None if prefix and netns is None else forks, list(args), env,
                                   self._stdout.fileno(), self._stderr.fileno(), [*prefix, volunteer_exe(), *args],
                                   netns=netns)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def check_running(self) -> None:
        """Raise, with the end of its stderr, if the process has exited."""
        if self.popen.poll() is not None:
            raise RuntimeError(f"{self.name} exited {self.popen.returncode}: {self.stderr()[-2000:]}")

    def first_json_line(self, timeout_s: float = 60.0) -> dict:
        def line():
            text = self.stdout()
            if "\n" in text:
                return text.split("\n", 1)[0]
            self.check_running()
            return None

        return json.loads(wait_until(line, timeout_s, what=f"{self.name}'s first line"))

    def wait_for_output(self, needle: str, timeout_s: float = 60.0) -> None:
        def found():
            if needle in self.stdout():
                return True
            self.check_running()
            return False

        wait_until(found, timeout_s, what=f"{needle!r} from {self.name}")

    def signal(self, sig: int) -> None:
        """Signal it if it still runs: a forked child that exits between the check and the signal is reaped by its
        fork server, and os.kill then raised ProcessLookupError (tests/test_netlab.py failed so in a full run at
        its final close); both Popen and forkserver.Forked send only to a child not yet reaped, and take that race."""
        self.popen.send_signal(sig)

    def wait(self, timeout_s: float = 30.0) -> int:
        return self.popen.wait(timeout=timeout_s)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM, then SIGKILL the whole session if it does not exit in time."""
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._record_stuck(timeout_s)
                try:
                    os.killpg(self.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.popen.wait(timeout=5)
        self._stdout.close()
        self._stderr.close()

    def _record_stuck(self, timeout_s: float) -> None:
        """A process that did not leave within ``timeout_s`` of a SIGTERM: what its threads were doing and which signals
        they blocked, pending and caught (/proc; py-spy's Python stacks where it is installed), in NAME.stuck.txt beside
        its output and in STUCK_LOG, before it is killed. A volunteer must leave on SIGTERM; the harness kills it so
        that the suite goes on, and this says why it did not."""
        pid = self.popen.pid
        lines = [f"{time.strftime('%H:%M:%S')} {self.name} (pid {pid}) still running {timeout_s:.0f} s after SIGTERM"]
        for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
            try:
                status = (task / "status").read_text().splitlines()
                wchan = (task / "wchan").read_text()
            except OSError:
                continue
            fields = {k: v.strip() for k, _, v in (line.partition(":") for line in status)}
            lines.append(f"  task {task.name} {fields.get('Name')} {fields.get('State')} wchan={wchan} "
                         + " ".join(f"{k}={fields.get(k)}" for k in ("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")))
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        if Path(spy).exists():
            try:
                done = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=20)
                lines.append(done.stdout + done.stderr)
            except (OSError, subprocess.TimeoutExpired) as exc:
                lines.append(f"py-spy: {exc}")
        text = "\n".join(lines) + "\n"
        try:
            self.stdout_path.with_suffix(".stuck.txt").write_text(text)
            with open(STUCK_LOG, "a") as log:
                log.write(text)
        except OSError:
            pass
        print(text, file=sys.stderr)


class Swarm:
    """Starts and reaps the processes of one test.

    Its `volunteer` processes are forked from this test process's fork server (``fork_server``); ``fork=False`` (or
    VOLUNTEER_TEST_EXEC=1 in the environment) execs every process as a user's shell would: the tests of what happens
    while a process imports. A process the server will not fork (its start-up environment differs, or it has a tag
    of its own) is exec'ed."""

    def __init__(self, tmp_path: Path, fork: bool = True):
        self.tag = uuid.uuid4().hex
        self.tmp = tmp_path
        self.procs: list[Proc] = []
        self.fork = fork and forks_available() and not os.environ.get("VOLUNTEER_TEST_EXEC")
        self.readers: list = []  # swarm_client.Client, closed with the swarm
        self.env = dict(START_ENV)
        self.env.update({
            TAG_ENV: self.tag,
            "VOLUNTEER_DATA_DIR": str(tmp_path / "data"),
            "VOLUNTEER_CONFIG_DIR": str(tmp_path / "config"),
            "PYTHONUNBUFFERED": "1",
            "VOLUNTEER_LOW_PRIORITY": "0",  # joins at normal priority: test timings on a shared machine
        })

    def start(self, *args: str, name: str | None = None, env: dict[str, str] | None = None,
              prefix: list[str] = ()) -> Proc:
        """`volunteer ARGS`; prefix goes before it (a network lab host's `ip netns exec NS`, which execs
        the command, so the process's pid is the volunteer's)."""
        name = name or f"p{len(self.procs)}-{args[0]}"
        env = {**self.env, **(env or {})}
        # a process given a tag of its own (a test finds its tree apart from the others' by it) is exec'ed: a forked
        # one's /proc/PID/environ would not show it; a network lab host's process is forked into its namespace
        forks = fork_server() if self.fork and (not prefix or netns_of(prefix)) and env.get(TAG_ENV) == self.tag \
            else None
        proc = Proc(list(args), env, self.tmp, name, prefix, forks)
        self.procs.append(proc)
        return proc

    def bootstrap(self, *extra: str, identity: Path | None = None) -> tuple[Proc, str]:
        identity = identity or self.tmp / "bootstrap.key"
        proc = self.start("bootstrap", "--listen", LOOPBACK, "--json", "--identity", str(identity), *extra,
                          name=f"bootstrap{len(self.procs)}")
        info = proc.first_json_line()
        return proc, info["maddrs"][0]

    def join(self, run: Path, swarm: str, maddr: str, *extra: str, name: str | None = None,
             env: dict[str, str] | None = None) -> Proc:
        proc = self.start("join", "--run", str(run), "--swarm", swarm, "--initial-peers", maddr,
                          "--listen", LOOPBACK, "--headless", *extra, name=name, env=env)
        proc.swarm = swarm
        return proc

    def status(self, run: Path, maddr: str, timeout_s: float = 120.0) -> dict:
        proc = subprocess.run(
            [volunteer_exe(), "status", "--run", str(run), "--initial-peers", maddr, "--json"],
            env=self.env, capture_output=True, text=True, timeout=timeout_s,
        )
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def reader(self, run: Path, maddr: str):
        """An in-process reader of the run's records (swarm_client.Client), closed with the swarm. Its
        ``report()`` is what `volunteer status --json` prints; use it to poll, and `status` to check the CLI."""
        from swarm_client import Client

        client = Client(run, maddr)
        self.readers.append(client)
        return client

    def live_pids(self) -> list[int]:
        """Every live process this test started, and what they started (by tag, or by a forked process's session)."""
        return tagged_pids(self.tag, [p.pid for p in self.procs if isinstance(p.popen, Forked)])

    def leftovers(self, timeout_s: float = 10.0) -> list[int]:
        try:
            wait_until(lambda: not self.live_pids(), timeout_s, what="test processes to exit")
        except TimeoutError:
            return self.live_pids()
        return []

    def close(self) -> list[int]:
        """Stop everything: the layer0 drivers first (a driver whose stages left first waits on them for
        seconds), then the other volunteers at once (each drains and leaves on its own), bootstrap peers last."""
        for reader in self.readers:
            reader.close()
        self.readers.clear()
        drivers = [p for p in self.procs if p.swarm == "layer0"]
        boots = [p for p in self.procs if p.name.startswith("bootstrap")]
        others = [p for p in self.procs if p not in boots and p not in drivers]
        for group in (drivers, others, boots):
            for proc in group:
                proc.signal(signal.SIGTERM)
            for proc in group:
                proc.stop()
        left = self.leftovers()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left


# identity work sized for a test (4 scrypt evaluations, ~20 ms): the shipped default (8 bits, about a second of CPU
# per new identity) would add minutes to a suite that starts hundreds of fresh identities
TEST_IDENTITY_BITS = 2


def write_run(path: Path, name: str = "testrun", stages: int = 2, heartbeat_s: float = 1.0, **extra: str) -> Path:
    extra.setdefault("integrity", f"{{identity_bits: {TEST_IDENTITY_BITS}}}")
    lines = [f"name: {name}", "model:", f"  stages: {stages}", "timeouts:", f"  heartbeat_s: {heartbeat_s}"]
    for key, value in extra.items():
        lines.append(f"{key}: {value}")
    path.write_text("\n".join(lines) + "\n")
    return path
