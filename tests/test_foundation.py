"""The foundation slice with real processes on 127.0.0.1: bootstrap, join, status, leave, crash."""

from __future__ import annotations

import signal

from procs import tagged_pids, wait_until, write_run

HEARTBEATS_TO_APPEAR = 8  # seconds: a DHT start plus a few 1 s heartbeats


def _peers(report: dict, swarm: str) -> dict[str, dict]:
    return {row["peer_id"]: row for row in report["swarms"][swarm]}


def _states(report: dict) -> dict[str, str]:
    return {row["peer_id"]: row["state"] for rows in report["swarms"].values() for row in rows}


def _peer_id(proc) -> str:
    proc.wait_for_output("joined the DHT as", timeout_s=60)
    for line in proc.stdout().splitlines():
        if '"peer_id": "' in line and '"type": "summary"' in line:
            return line.split('"peer_id": "', 1)[1].split('"', 1)[0]
    raise AssertionError("no summary line with the peer id")


def test_three_volunteers_in_two_swarms_appear_then_leave(swarm, tmp_path):
    run = write_run(tmp_path / "run.yaml")
    _, maddr = swarm.bootstrap()
    joins = [
        swarm.join(run, "layer0", maddr, "--log-format", "json", name="a"),
        swarm.join(run, "layer1", maddr, "--log-format", "json", name="b"),
        swarm.join(run, "layer1", maddr, "--log-format", "json", name="c"),
    ]
    ids = [_peer_id(proc) for proc in joins]

    def all_online():
        report = swarm.status(run, maddr)
        states = _states(report)
        return report if all(states.get(pid) == "online" for pid in ids) else None

    report = wait_until(all_online, HEARTBEATS_TO_APPEAR * 3, interval_s=1.0, what="three online records")
    assert set(_peers(report, "layer0")) == {ids[0]}
    assert set(_peers(report, "layer1")) == {ids[1], ids[2]}
    assert report["run_id"].startswith("testrun-")
    row = _peers(report, "layer1")[ids[1]]
    assert row["version"] and 0 <= row["age_s"] < 10

    # A clean exit (SIGINT, as Ctrl+C) announces offline at once and leaves nothing behind.
    joins[1].signal(signal.SIGINT)
    assert joins[1].wait(30) == 0
    report = swarm.status(run, maddr)
    assert _states(report)[ids[1]] == "offline"
    assert "Traceback" not in joins[1].stderr()
    assert not [pid for pid in tagged_pids(swarm.tag) if pid == joins[1].pid]


def test_sigkilled_volunteer_expires_and_leaves_no_process(swarm, tmp_path):
    run = write_run(tmp_path / "run.yaml")
    _, maddr = swarm.bootstrap()
    victim = swarm.join(run, "layer0", maddr, "--log-format", "json", name="victim")
    victim_id = _peer_id(victim)
    wait_until(lambda: victim_id in _states(swarm.status(run, maddr)), 30, interval_s=1.0, what="victim online")
    victim_tree = set(tagged_pids(swarm.tag)) - _bootstrap_pids(swarm)
    assert len(victim_tree) >= 4, "main, watchdog, DHT process and p2pd"

    victim.signal(signal.SIGKILL)
    victim.wait(10)
    # Its DHT process and p2pd are reaped by the watchdog, not left to hold the port and identity.
    wait_until(lambda: not (set(tagged_pids(swarm.tag)) & victim_tree), 15,
               what="the crashed volunteer's helpers to be reaped")
    # Its record expires after about three heartbeats.
    wait_until(lambda: victim_id not in _states(swarm.status(run, maddr)), 30, interval_s=1.0,
               what="the record to expire")


def _bootstrap_pids(swarm) -> set[int]:
    """The bootstrap peer's own process tree (it must stay up)."""
    boot = swarm.procs[0]
    pids = set()
    for pid in tagged_pids(swarm.tag):
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[1]) == boot.pid or pid == boot.pid or _ancestor(pid, boot.pid):
            pids.add(pid)
    return pids


def _ancestor(pid: int, ancestor: int) -> bool:
    for _ in range(10):
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            return False
        pid = int(stat[stat.rfind(")") + 2 :].split()[1])
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
    return False


def test_different_config_gets_its_own_run_id_and_never_mixes(swarm, tmp_path):
    run_a = write_run(tmp_path / "a.yaml", name="shared")
    run_b = tmp_path / "b.yaml"
    run_b.write_text(run_a.read_text().replace("stages: 2", "stages: 2\n  hidden_dim: 64"))
    _, maddr = swarm.bootstrap()
    a = swarm.join(run_a, "layer0", maddr, "--log-format", "json", name="a")
    a_id = _peer_id(a)
    wait_until(lambda: a_id in _states(swarm.status(run_a, maddr)), 30, interval_s=1.0, what="a online")
    # --new-run: training alone in its own run is b's explicit choice (without it, b stops: test_run_conflict.py)
    b = swarm.join(run_b, "layer0", maddr, "--log-format", "json", "--new-run", name="b")
    b_id = _peer_id(b)
    # b is told plainly why it will not see a's swarm.
    b.wait_for_output("different config", timeout_s=30)
    assert "model.hidden_dim" in b.stdout()
    def b_online():
        report = swarm.status(run_b, maddr)
        return report if b_id in _states(report) else None

    report_b = wait_until(b_online, 30, interval_s=1.0, what="b online")
    report_a = swarm.status(run_a, maddr)
    assert report_a["run_id"] != report_b["run_id"]
    assert b_id not in _states(report_a)
    assert a_id not in _states(report_b)


def test_restarted_bootstrap_keeps_its_peer_id(swarm, tmp_path):
    identity = tmp_path / "boot-identity.key"
    first, maddr1 = swarm.bootstrap(identity=identity)
    first.signal(signal.SIGTERM)
    assert first.wait(30) == 0
    _, maddr2 = swarm.bootstrap(identity=identity)
    assert maddr1.rsplit("/p2p/", 1)[1] == maddr2.rsplit("/p2p/", 1)[1]
