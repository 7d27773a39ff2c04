"""A volunteer behind NAT in the network lab (benchmarks/netlab.py, ``Link(nat=True)``): it joins, drives and
averages, says that nobody can dial it, and nobody routes to it (swarm/dht/reachability.py). A file of its own
so that the suite's two workers can run it beside tests/test_netlab.py. Skips where the lab or nftables
is unavailable; the reason says which."""

from __future__ import annotations

import json
import time

import pytest

from benchmarks.netlab import Lab, Link, nat_unavailable
from procs import wait_until
from test_netlab import SWARM_TIMEOUT_S, _default_run, start_lab_swarm

NAT_UNAVAILABLE = nat_unavailable()
pytestmark = pytest.mark.skipif(NAT_UNAVAILABLE is not None, reason=NAT_UNAVAILABLE or "")


def test_a_volunteer_behind_nat_joins_and_drives_and_nobody_routes_to_it(swarm, tmp_path):
    """The driver (layer0) and a second layer2 volunteer sit behind NAT, with the default preferences plus
    network.listen: each finds out that nobody can dial it and says so in its record; the driver still
    drives the run to the demo target, routing around the layer2 volunteer it cannot dial, and loses no
    micro-batch; the serving volunteers find out that they are reachable. `volunteer doctor` behind the
    NAT says why and what to do."""
    from volunteer_cli.commands.demo import demo_target, latest_evaluation, target_reached

    run_path = _default_run(tmp_path / "run.yaml")
    with Lab([Link(rate_mbit_s=100.0)] * 4 + [Link(rate_mbit_s=100.0, nat=True)] * 2) as lab:
        boot_host, *servers, natted, natted_server = lab.hosts
        maddr = start_lab_swarm(swarm, tmp_path, run_path, boot_host,
                                list(zip([natted, *servers, natted_server], [0, 1, 2, 3, 2])))
        reader = swarm.reader(run_path, maddr)
        target = demo_target(reader.run, None, None)
        started = time.monotonic()
        last_seen: list = [None, None]  # what the last read found, for the message of a timeout

        def reached():
            for proc in swarm.procs:
                proc.check_running()
            views = {f"layer{k}": reader.membership.read(f"layer{k}") for k in range(4)}
            reach = {name: sorted(r.reachable for r in records) for name, records in views.items()}
            accuracy, loss = latest_evaluation(views["layer0"])
            last_seen[:] = [accuracy, reach]
            done = target_reached(target, accuracy, loss) and reach == {
                "layer0": [0], "layer1": [1], "layer2": [0, 1], "layer3": [1]}
            return (accuracy, reach, views) if done else None

        what = f"{target} driven from behind NAT, and each node's reachability"
        try:
            accuracy, reach, views = wait_until(reached, SWARM_TIMEOUT_S, interval_s=1.0, what=what)
        except TimeoutError as exc:  # CI keeps nothing but the failure's text: say which half was missing
            raise AssertionError(f"{exc}: last read accuracy {last_seen[0]}, reachability {last_seen[1]} (wanted "
                                 "layer0 [0], layer1 [1], layer2 [0, 1], layer3 [1])") from exc
        print(f"{target} reached ({accuracy:.3f}) from behind NAT in {time.monotonic() - started:.0f} s; {reach}")
        (driver,) = views["layer0"]
        assert driver.trained > 0 and driver.lost == 0, driver
        cut_off = next(r for r in views["layer2"] if r.reachable == 0)
        assert cut_off.served == 0 and cut_off.state == "online", cut_off

        # a second run of doctor, as a user would, when the first could not ask enough peers ("need 2 to tell":
        # in a loaded suite two of the three peers asked once did not try our addresses in time)
        for attempt in range(2):
            doctor = swarm.start("doctor", "--run", str(run_path), "--initial-peers", maddr, "--listen", natted.maddr(),
                                 "--data-dir", str(tmp_path / "doctor"), "--json", name=f"doctor{attempt}",
                                 prefix=natted.exec_prefix())  # forked into the host's namespace
            doctor.wait(120)
            assert doctor.stdout().strip(), f"doctor printed no report: {doctor.stderr()[-2000:]}"
            checks = {(c["section"], c["name"]): c for c in json.loads(doctor.stdout())["checks"]}
            reach_check = checks[("reachability", "dialled from outside")]
            if "need 2 to tell" not in reach_check["detail"]:
                break
        assert reach_check["status"] == "warn" and "could not dial" in reach_check["detail"], reach_check
        assert "forward a TCP port" in reach_check["detail"] and "layer0" in reach_check["detail"]
        swarm.close()  # before the namespaces go
