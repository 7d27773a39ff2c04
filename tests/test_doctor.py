"""`volunteer doctor` through the installed entry point, against a real bootstrap peer on loopback."""

from __future__ import annotations

import json
import subprocess

from procs import unused_peer_id, volunteer_exe, write_run


def doctor(swarm, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([volunteer_exe(), "doctor", *args], env=swarm.env, capture_output=True, text=True,
                          timeout=90)


def test_doctor_reports_each_bootstrap_peer_idle_sources_gpu_and_data_dir(swarm, tmp_path):
    run = write_run(tmp_path / "run.yaml")
    _, maddr = swarm.bootstrap()
    dead = f"/ip4/127.0.0.1/tcp/9/p2p/{unused_peer_id()}"
    done = doctor(swarm, "--run", str(run), "--initial-peers", maddr, dead, "--json", "--timeout-s", "20")
    assert done.returncode == 1, done.stderr  # one bootstrap peer does not answer
    report = json.loads(done.stdout)
    checks = {(check["section"], check["name"]): check for check in report["checks"]}
    assert report["ok"] is False and report["run_id"].startswith("testrun-")

    assert checks[("bootstrap peers", maddr)]["status"] == "ok"
    assert checks[("bootstrap peers", maddr)]["detail"].startswith("answered in")
    assert checks[("bootstrap peers", dead)]["status"] == "fail"
    assert checks[("bootstrap peers", "joining the DHT")]["status"] == "ok"
    reach = checks[("reachability", "dialled from outside")]
    assert reach["status"] == "warn" and "no peer of the run is online" in reach["detail"]
    swarms = checks[(f"run {report['run_id']}", "swarms")]["detail"]
    assert swarms.startswith("layer0 0 online, layer1 0 online; nobody serves layer0, layer1 yet")

    data_dir = checks[("data dir", report["data_dir"])]
    assert data_dir["status"] in ("ok", "warn") and "writable" in data_dir["detail"]
    idle = {name: check for (section, name), check in checks.items() if section.startswith("idle detection")}
    assert {"logind", "x11", "tty", "user idle time", "other cpu", "battery", "gpu"} <= set(idle)
    assert idle["other cpu"]["status"] == "ok"  # psutil works everywhere we run
    assert ("gpu", "cuda") in checks or ("gpu", "cuda:0") in checks


def test_doctor_without_bootstrap_peers_says_what_to_do(swarm, tmp_path):
    run = write_run(tmp_path / "run.yaml")
    done = doctor(swarm, "--run", str(run))
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert lines[0] == f"volunteer doctor (run {run_id_of(done.stdout)})"
    assert any(line.startswith("  FAIL  bootstrap peers: none: pass --initial-peers MADDR") for line in lines)
    assert "data dir" in lines and lines[-1].startswith("1 failed")


def run_id_of(text: str) -> str:
    return text.split("(run ", 1)[1].split(")", 1)[0]


def test_doctor_refuses_a_listen_address_it_cannot_use_before_anything_loads(swarm, tmp_path):
    run = write_run(tmp_path / "run.yaml")
    for bad, says in (("garbage", "is not a multiaddr"), ("/ip4/0.0.0.0/udp/0/quic-v1", "needs a TCP address")):
        done = doctor(swarm, "--run", str(run), "--listen", bad)
        assert done.returncode == 2 and "--listen: " in done.stderr and says in done.stderr, done.stderr
