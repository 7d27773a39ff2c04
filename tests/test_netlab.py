"""Volunteers on separate hosts: the network lab (benchmarks/netlab.py) and a swarm trained across it.

Each host is a network namespace with its own address on a private bridge (10.77.S.0/24), its link
rate-limited by tbf and delayed by the lab's relay. Skips where namespaces cannot be made (not root,
no iproute2): the reason says which.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from benchmarks.netlab import Lab, LabError, Link, lab_unavailable, nat_unavailable, remove_stale_labs
from procs import TEST_IDENTITY_BITS, wait_until

UNAVAILABLE = lab_unavailable()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=UNAVAILABLE or "")
NAT_UNAVAILABLE = nat_unavailable()
needs_nat = pytest.mark.skipif(NAT_UNAVAILABLE is not None, reason=NAT_UNAVAILABLE or "")

PROBE = str(Path(__file__).resolve().parent.parent / "benchmarks" / "netlab_probe.py")
RATE_MBIT_S = 20.0
TRANSFER_BYTES = 2_500_000  # 1 s at 20 Mbit/s: the tbf burst (32 KiB) is ~1 % of it
DELAY_MS = (10.0, 15.0)
PROBE_TIMEOUT_S = 30.0
SWARM_TIMEOUT_S = 150.0  # the default run to its target: ~30 s on an idle machine, bounded for a loaded one


def _ns_and_links() -> str:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return netns + links


def _server(lab: Lab, host, mode: str, port: int) -> subprocess.Popen:
    proc = lab.popen(host, [sys.executable, PROBE, mode, host.address, str(port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture(scope="module")
def lab():
    with Lab([Link(RATE_MBIT_S, DELAY_MS[0]), Link(RATE_MBIT_S, DELAY_MS[1]), Link()]) as built:
        yield built


def test_hosts_have_their_own_addresses_and_reach_each_other(lab):
    a, b, c = lab.hosts
    assert len({a.address, b.address, c.address}) == 3
    own = lab.run(a, ["ip", "-4", "-o", "addr", "show", "dev", "eth0"], PROBE_TIMEOUT_S).stdout
    assert a.address in own and b.address not in own
    sink = _server(lab, c, "sink", 5001)
    lab.run(a, [sys.executable, PROBE, "send", c.address, "5001", "1000"], PROBE_TIMEOUT_S)
    assert json.loads(sink.stdout.readline())["bytes"] == 1000


def test_a_host_link_runs_at_its_rate(lab):
    a, b, _ = lab.hosts
    sink = _server(lab, b, "sink", 5002)
    lab.run(a, [sys.executable, PROBE, "send", b.address, "5002", str(TRANSFER_BYTES)], PROBE_TIMEOUT_S)
    got = json.loads(sink.stdout.readline())
    assert got["bytes"] == TRANSFER_BYTES
    rate_mbit_s = got["bytes"] * 8 / got["seconds"] / 1e6
    # a shaper never runs faster than its rate (bar the burst); a loaded machine may run slower
    assert 0.4 * RATE_MBIT_S < rate_mbit_s < 1.1 * RATE_MBIT_S, rate_mbit_s


def test_the_relay_adds_both_links_delays_to_the_round_trip(lab):
    a, b, _ = lab.hosts
    _server(lab, b, "echo", 5003)
    _, _, ip, _, port = lab.expose(b, 5003).split("/")
    rtts = json.loads(lab.run(a, [sys.executable, PROBE, "ping", ip, port, "5"], PROBE_TIMEOUT_S).stdout)["rtt_ms"]
    expected_ms = 2 * sum(DELAY_MS)
    assert min(rtts) >= expected_ms, rtts
    assert min(rtts) < expected_ms + 200, rtts  # bounded: the relay queues nothing else


def test_a_closed_lab_leaves_nothing_and_a_stale_one_is_removed(tmp_path):
    lab = Lab([Link(), Link()]).start()
    names = [h.netns for h in lab.hosts] + [lab.bridge]
    sleeper = lab.popen(lab.hosts[0], ["sleep", "60"])
    lab.close()
    lab.close()  # idempotent
    assert sleeper.poll() is not None
    assert not any(name in _ns_and_links() for name in names)
    # a lab whose process was SIGKILLed: its names carry a pid that no longer runs
    stale = "vlab-4194304-a-h0"  # above any pid this kernel hands out by default
    subprocess.run(["ip", "netns", "add", stale], check=True)
    assert stale in remove_stale_labs()
    assert stale not in _ns_and_links()


@needs_nat
def test_a_host_behind_nat_dials_out_and_nobody_dials_in():
    with Lab([Link(), Link(nat=True)]) as lab:
        open_host, natted = lab.hosts
        assert natted.address != natted.public_address and natted.public_address.startswith("10.77.")
        # out: the far end sees the router's address, not the host's own
        sink = _server(lab, open_host, "sink", 5101)
        lab.run(natted, [sys.executable, PROBE, "send", open_host.address, "5101", "1000"], PROBE_TIMEOUT_S)
        got = json.loads(sink.stdout.readline())
        assert got["bytes"] == 1000 and got["peer"] == natted.public_address, got
        # in: neither its own address (no route) nor its router's (nothing forwarded) answers
        _server(lab, natted, "sink", 5102)
        for address in (natted.address, natted.public_address):
            with pytest.raises(LabError):
                lab.run(open_host, [sys.executable, PROBE, "send", address, "5102", "10"], PROBE_TIMEOUT_S)
        with pytest.raises(LabError, match="behind NAT"):
            lab.expose(natted, 5102)
        names = [natted.netns, natted.netns.replace("-h1", "-r1")]
        assert all(name in _ns_and_links() for name in names)
    assert not any(name in _ns_and_links() for name in names)


# ----- a swarm across hosts


def _default_run(path: Path) -> Path:
    from volunteer.config import load_run

    run, _ = load_run(None)
    config = run.model_dump(mode="json")
    config["timeouts"]["heartbeat_s"] = 1.0  # local timing only: not part of the run id
    config["training"]["eval_every_s"] = 5.0  # the target is seen sooner (a run id of its own)
    # identity work sized for a test, as every test run (procs.TEST_IDENTITY_BITS): at the default each lab host
    # proved ~1 s of scrypt (5-10 s in a loaded suite), which spread the volunteers' arrivals out
    config["integrity"]["identity_bits"] = TEST_IDENTITY_BITS
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def start_lab_swarm(swarm, tmp_path: Path, run_path: Path, boot_host, volunteers: list,
                    default_listen: bool = False) -> str:
    """A bootstrap peer on boot_host, then one `volunteer join` per (host, layer) with the default
    preferences plus network.listen on the host's own address (or, with ``default_listen``, nothing: the
    volunteer listens on every interface, loopback included); the bootstrap peer's address."""
    boot = swarm.start("bootstrap", "--listen", boot_host.maddr(), "--json", "--identity",
                       str(tmp_path / "boot.key"), name="bootstrap", prefix=boot_host.exec_prefix())
    maddr = boot.first_json_line()["maddrs"][0]
    for k, (host, layer) in enumerate(volunteers):
        lab_join(swarm, tmp_path, run_path, maddr, host, layer, f"v{k}-layer{layer}", default_listen)
    return maddr


def lab_join(swarm, tmp_path: Path, run_path: Path, maddr: str, host, layer: int, name: str,
             default_listen: bool = False, *extra: str):
    prefs = tmp_path / f"prefs-{name}.yaml"
    prefs.write_text(yaml.safe_dump({} if default_listen else {"network": {"listen": [host.maddr()]}}))
    return swarm.start("join", "--run", str(run_path), "--swarm", f"layer{layer}", "--initial-peers", maddr,
                       "--prefs", str(prefs), "--headless", *extra, name=name, prefix=host.exec_prefix())


def test_a_bootstrap_peer_and_five_volunteers_on_their_default_listen_train_download_and_export(swarm, tmp_path):
    """The default run (4 stages), one host each, with the default preferences: every volunteer listens on all
    interfaces, so it announces its host's address and 127.0.0.1, an address that from any other host leads
    to that host's own loopback (issue 25 item 9: peers with several addresses, one of them unusable). They
    train to the demo target; a newcomer downloads layer1 from its peer on another host before it serves; a
    run organiser on another host exports the model."""
    from volunteer_cli.commands.demo import demo_target, latest_evaluation, target_reached

    run_path = _default_run(tmp_path / "run.yaml")
    with Lab([Link(rate_mbit_s=100.0)] * 7) as lab:
        boot_host, *hosts = lab.hosts
        maddr = start_lab_swarm(swarm, tmp_path, run_path, boot_host, [(host, k) for k, host in enumerate(hosts[:4])],
                                default_listen=True)
        assert maddr.startswith(f"/ip4/{boot_host.address}/"), maddr
        reader = swarm.reader(run_path, maddr)
        target = demo_target(reader.run, None, None)
        started = time.monotonic()

        def reached():
            for proc in swarm.procs:
                proc.check_running()
            accuracy, loss = latest_evaluation(reader.membership.read("layer0"))
            return (accuracy, loss) if target_reached(target, accuracy, loss) else None

        accuracy, _ = wait_until(reached, SWARM_TIMEOUT_S, interval_s=1.0, what=f"{target} across the lab's hosts")
        print(f"{target} reached ({accuracy:.3f}) in {time.monotonic() - started:.0f} s")
        newcomer = lab_join(swarm, tmp_path, run_path, maddr, hosts[4], 1, "late-layer1", True, "--log-format", "json")
        wait_until(lambda: "synced layer1 from" in newcomer.stdout() or newcomer.check_running(), 90, interval_s=0.5,
                   what="the newcomer to download layer1 from a peer on another host")

        def summary():
            lines = [json.loads(line) for line in newcomer.stdout().splitlines() if '"type": "summary"' in line]
            return lines[-1] if lines else None

        maddrs = wait_until(summary, 60, what="a summary line")["maddrs"]  # as it announces them, loopback included
        assert any("/ip4/127.0.0.1/" in m for m in maddrs) and any(hosts[4].address in m for m in maddrs), maddrs

        out = tmp_path / "exported.pt"
        export = swarm.start("export", "--run", str(run_path), "--initial-peers", maddr, "--out", str(out), "--json",
                             name="export", prefix=hosts[5].exec_prefix())  # forked into the host's namespace
        assert export.wait(120) == 0 and out.exists() and out.stat().st_size > 0, export.stdout() + export.stderr()
        swarm.close()  # before the namespaces go
