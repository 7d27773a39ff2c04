"""The fork server (volunteer_cli/forkserver.py): a child is `volunteer ARGV` as an exec would have made it (its own
session, streams, environment, working directory and exit status), and nothing outlives the server."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.procs import LOOPBACK, tagged_pids, volunteer_exe, wait_until
from volunteer.hygiene import session_members
from volunteer_cli.forkserver import ForkRefused, Forked, ForkServer, SpawnCancelled, _alive, available, spawn_or_exec

pytestmark = pytest.mark.skipif(not available(), reason="the fork server is Linux-only")


SESSIONS: list[int] = []  # every child's: what is still running in them after a test is a leftover


@pytest.fixture(scope="module")
def forks():
    server = ForkServer()
    yield server
    server.close()
    assert server.proc.returncode is not None


@pytest.fixture(autouse=True)
def no_leftovers():
    yield
    left = tagged_pids("no tag", SESSIONS)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes outlived the test: {left}"


def _spawn(forks: ForkServer, tmp_path, *argv: str, env: dict[str, str] | None = None, cwd=None, **kw):
    out = open(tmp_path / "out", "wb")
    err = open(tmp_path / "err", "wb")
    try:
        child = forks.spawn(list(argv), {**os.environ, **(env or {})}, out.fileno(), err.fileno(), cwd=cwd, **kw)
    finally:
        out.close()
        err.close()
    SESSIONS.append(child.pid)
    return child


def _stop(child) -> int:
    child.send_signal(signal.SIGTERM)
    try:
        return child.wait(30)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(10)
        wait_until(lambda: not tagged_pids("no tag", [child.pid]), 15, what="its watchdog and p2pd to leave")


def test_a_forked_command_exits_as_the_exec_of_the_same_command(forks, tmp_path):
    """Same exit status, same output, for a command that succeeds and one that fails on its input."""
    child = _spawn(forks, tmp_path, "--version")
    assert child.wait(30) == 0
    assert (tmp_path / "out").read_text().startswith("volunteer ")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel: {stages: 0}\n")
    child = _spawn(forks, tmp_path, "join", "--run", str(bad), "--swarm", "layer0", "--headless")
    forked_code, forked_err = child.wait(60), (tmp_path / "err").read_text()
    execd = subprocess.run([volunteer_exe(), "join", "--run", str(bad), "--swarm", "layer0", "--headless"],
                           capture_output=True, text=True, timeout=120)
    assert forked_code == execd.returncode != 0
    assert "stages" in forked_err and forked_err.strip().splitlines()[-1] == execd.stderr.strip().splitlines()[-1]


def test_a_forked_module_runs_as_python_dash_m_with_its_arguments_and_exit_status(forks, tmp_path):
    """``module``: the child is ``python -m MODULE ARGV`` (the benchmarks' smoke runs), same output and status as the
    exec: a module that succeeds, and one whose main block exits with an error on its arguments."""
    child = _spawn(forks, tmp_path, "2026", "11", module="calendar")
    assert child.wait(30) == 0
    execd = subprocess.run([sys.executable, "-m", "calendar", "2026", "11"], capture_output=True, text=True, timeout=60)
    assert (tmp_path / "out").read_text() == execd.stdout and "November 2026" in execd.stdout
    missing = str(tmp_path / "missing.json")
    child = _spawn(forks, tmp_path, missing, module="json.tool")
    forked_code, forked_err = child.wait(30), (tmp_path / "err").read_text()
    execd = subprocess.run([sys.executable, "-m", "json.tool", missing], capture_output=True, text=True, timeout=60)
    assert forked_code == execd.returncode != 0
    assert missing in forked_err and missing in execd.stderr


def test_a_forked_peer_has_its_own_session_environment_and_directory_and_its_signal_status(forks, tmp_path):
    data = tmp_path / "data"
    child = _spawn(forks, tmp_path, "bootstrap", "--listen", LOOPBACK, "--json", "--identity", "boot.key",
                   env={"VOLUNTEER_DATA_DIR": str(data), "PYTHONUNBUFFERED": "1"}, cwd=str(tmp_path))
    try:
        line = wait_until(lambda: (tmp_path / "out").read_text().partition("\n")[0] or None, 60, what="its first line")
        assert json.loads(line)["maddrs"]
        assert (tmp_path / "boot.key").exists(), "its --identity is relative to the directory it was given"
        assert os.getsid(child.pid) == child.pid and os.getpgid(child.pid) == child.pid
        # its tree is found by its session (its /proc environ is the server's): itself and the watchdog it forked
        tree = wait_until(lambda: len(found := session_members([child.pid])) >= 2 and found, 15, what="its watchdog")
        assert child.pid in tree and all(os.getsid(pid) == child.pid for pid in tree)
        assert child.poll() is None
    finally:
        assert _stop(child) == 0, (tmp_path / "err").read_text()[-2000:]
    # a child killed outright says so as Popen does: minus the signal
    child = _spawn(forks, tmp_path, "bootstrap", "--listen", LOOPBACK, "--json", "--identity", "boot2.key",
                   cwd=str(tmp_path))
    time.sleep(0.5)
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait(30) == -signal.SIGKILL
    wait_until(lambda: not tagged_pids("no tag", [child.pid]), 15, what="its watchdog to reap its p2pd")
    child = _spawn(forks, tmp_path, "bootstrap", "--listen", LOOPBACK, "--identity", "boot3.key", cwd=str(tmp_path))
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(0.2)
    finally:
        _stop(child)


def test_children_that_die_with_their_parent_stop_when_the_server_dies(tmp_path):
    server = ForkServer()
    child = _spawn(server, tmp_path, "bootstrap", "--listen", LOOPBACK, "--json", "--identity", "boot.key",
                   cwd=str(tmp_path), die_with_parent=True)
    wait_until(lambda: (tmp_path / "out").read_text(), 60, what="its first line")
    server.proc.kill()
    server.proc.wait(10)
    wait_until(lambda: not _alive(child.pid), 30, what="the child to stop with its server")
    assert child.poll() is not None  # the server cannot tell its status: gone is all the client knows
    server.close()


def test_a_child_whose_interpreter_would_start_otherwise_is_refused_so_that_it_is_execed(forks, tmp_path):
    """PYTHONPATH, the allocator's settings, hivemind's log level: read when a process starts, so a fork would run
    with the server's. tests/procs.py and the demo exec such a child instead."""
    for name, value in (("PYTHONPATH", str(tmp_path)), ("MALLOC_ARENA_MAX", "1"), ("HIVEMIND_LOGLEVEL", "DEBUG")):
        with pytest.raises(ForkRefused, match=name):
            _spawn(forks, tmp_path, "--version", env={name: value})
    assert _spawn(forks, tmp_path, "--version", env={"PYTHONUNBUFFERED": "1", "VOLUNTEER_X": "1"}).wait(30) == 0
    # torch sets this in a process's environment once anything there asked inductor for its cache (a test of the
    # same worker, found by the exec'ed children that followed it); it is read at each use, never at start
    cache = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    assert _spawn(forks, tmp_path, "--version", env=cache).wait(30) == 0
    # what the demo, the harness and the benchmarks call: such a child is exec'ed, and runs
    with open(tmp_path / "out", "wb") as out:
        child = spawn_or_exec(forks, ["--version"], {**os.environ, "PYTHONPATH": str(tmp_path)}, out.fileno(),
                              out.fileno(), [volunteer_exe(), "--version"])
    assert isinstance(child, subprocess.Popen) and child.wait(60) == 0
    assert (tmp_path / "out").read_text().startswith("volunteer ")


def test_a_start_cancelled_while_the_server_imports_leaves_no_child(tmp_path):
    """A Ctrl+C while the demo's first child waits for the server's imports: the wait ends at once, and the child
    the server forks for it afterwards is killed (the demo says "interrupted" within a second, not after them)."""
    server = ForkServer()
    began = time.monotonic()
    with pytest.raises(SpawnCancelled):
        _spawn(server, tmp_path, "bootstrap", "--listen", LOOPBACK, "--identity", "boot.key", cwd=str(tmp_path),
               cancelled=lambda: time.monotonic() - began > 0.3)
    assert time.monotonic() - began < 1.5
    server.close()  # waits for the late child's pid, kills its session
    assert server.proc.returncode is not None and len(server.killed) == 1
    SESSIONS.extend(server.killed)  # no_leftovers checks it is gone, with anything it started
    wait_until(lambda: not _alive(server.killed[0]), 15, what="the late child to be gone")


def test_a_pid_used_again_is_a_new_child_not_its_predecessors_exit():
    """A test run wraps Linux's 32,768 pids: a child that gets an earlier child's pid must not read that one's exit
    status (the suite's driver "first" once got an earlier process's status, so it was never sent its SIGTERM
    and waited 20 s for a SIGKILL at teardown). The server's side played here over the same socket."""
    import threading

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client = ForkServer.__new__(ForkServer)
    client.__dict__.update(_sock=ours, _lock=threading.Lock(), _running={}, _argv={}, _replies={}, _asked=0,
                           _abandoned=set(), killed=[], _gone=False)

    def serve(messages):
        data, fds, _, _ = socket.recv_fds(theirs, 1 << 20, 3)
        for fd in fds:
            os.close(fd)
        ask = json.loads(data)["id"]
        for message in messages:
            theirs.send(json.dumps({**message, "id": ask} if "pid" in message else message).encode())

    def spawn(messages):
        server = threading.Thread(target=serve, args=(messages,))
        server.start()
        child = client.spawn(["--version"], {}, 1, 2)
        server.join(5)
        return child

    first = spawn([{"pid": 4242}])
    theirs.send(json.dumps({"exit": 4242, "code": 3}).encode())
    assert first.wait(5) == 3
    second = spawn([{"pid": 4242}])  # the same pid, a new child: still running
    assert second.poll() is None and first.returncode == 3
    third = spawn([{"exit": 4242, "code": -15}, {"pid": 4242}])  # the second's exit, then the pid a third time
    assert second.poll() == -15 and third.poll() is None
    ours.close()
    theirs.close()


def test_a_forked_command_quiets_hivemind_as_an_execed_one(monkeypatch):
    """hivemind reads HIVEMIND_LOGLEVEL at import, which a forked child did in the server: the level the command
    sets (ERROR unless -v) reaches the logger hivemind already made (a forked volunteer logged hivemind's INFO)."""
    import logging

    import hivemind.utils.logging  # noqa: F401 - as in the server
    from volunteer.hygiene import quiet_libraries

    for name in ("HIVEMIND_LOGLEVEL", "GOLOG_LOG_LEVEL"):  # recorded, so that what quiet_libraries sets is undone
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    logger = logging.getLogger("hivemind")
    monkeypatch.setattr(logger, "level", logging.INFO)
    quiet_libraries(0)
    assert logger.level == logging.ERROR and os.environ["HIVEMIND_LOGLEVEL"] == "ERROR"


def test_the_harness_forks_its_volunteers_and_finds_what_they_leave(swarm):
    """tests/procs.py: a Swarm's processes come from the fork server (not an exec that fell back unnoticed), and
    ``live_pids`` sees a forked one's tree while it runs and nothing once it has stopped."""
    boot, _ = swarm.bootstrap()
    assert isinstance(boot.popen, Forked)
    assert wait_until(lambda: len(set(swarm.live_pids()) & set(session_members([boot.pid]))) >= 2, 15,
                      what="the bootstrap peer's tree")
    boot.stop()
    wait_until(lambda: not swarm.live_pids(), 15, what="its tree to leave")


def test_a_variable_a_library_writes_into_the_test_process_does_not_make_its_children_execed(swarm, monkeypatch):
    """scikit-learn's import sets KMP_DUPLICATE_LIB_OK in os.environ (tests/test_data.py imports it): a Swarm made
    after that still starts from the test process's start environment, so its children are forked, not exec'ed
    (the serial suite failed here: the harness's test above found its bootstrap peer exec'ed)."""
    first, _ = swarm.bootstrap()  # the fork server is started by then
    assert isinstance(first.popen, Forked)
    monkeypatch.setenv("KMP_DUPLICATE_LIB_OK", "True")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/nonexistent/inductor")
    (swarm.tmp / "later").mkdir()
    later = type(swarm)(swarm.tmp / "later")  # the harness of conftest.py (its module, its fork server)
    try:
        boot, _ = later.bootstrap()
        assert isinstance(boot.popen, Forked)
    finally:
        assert not later.close()


def test_a_child_forked_into_a_network_namespace_runs_there_and_a_missing_one_is_refused(forks, tmp_path):
    """A network lab host's volunteer (tests/procs.py forks it with ``netns``, as `ip netns exec` would exec it):
    the child and what it starts are in that namespace; a namespace that does not exist is refused (exec'ed)."""
    from benchmarks.netlab import NS_PREFIX, lab_unavailable

    reason = lab_unavailable()
    if reason is not None:
        pytest.skip(reason)
    name = f"{NS_PREFIX}{os.getpid()}-fs"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, capture_output=True)
        child = _spawn(forks, tmp_path, "bootstrap", "--listen", LOOPBACK, "--json", "--identity",
                       str(tmp_path / "boot.key"), netns=name)
        wait_until(lambda: (tmp_path / "out").read_text().strip() or child.poll() is not None, 60,
                   what="the bootstrap peer's first line")
        assert child.poll() is None, (tmp_path / "err").read_text()[-2000:]
        inside = os.stat(f"/var/run/netns/{name}").st_ino
        assert os.stat(f"/proc/{child.pid}/ns/net").st_ino == inside != os.stat("/proc/self/ns/net").st_ino
        started = [pid for pid in session_members([child.pid]) if pid != child.pid]
        assert started and all(os.stat(f"/proc/{pid}/ns/net").st_ino == inside for pid in started)  # its p2pd
        _stop(child)
        with pytest.raises(ForkRefused, match="no network namespace"):
            _spawn(forks, tmp_path, "--version", netns=f"{name}-gone")
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_the_fork_exit_benchmark_prices_a_childs_end(tmp_path):
    """benchmarks/fork_exit.py --quick: one JSON line with each way's CPU; a child that ends through end_process
    costs less than one that finalizes its interpreter (0.04-0.06 s against 0.6-1.5 s, measured)."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.fork_exit", "--quick", "--json"], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = done.stdout.strip().splitlines()
    report = json.loads(line)
    assert set(report["cpu_s"]) == {"finalize", "end_process", "collect", "collect_frozen"}
    assert 0 < report["cpu_s"]["end_process"] < report["cpu_s"]["finalize"], report["cpu_s"]
    assert report["quick"] is True and report["children_per_way"] == 2
