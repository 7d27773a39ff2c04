"""Live rebalancing with real processes on 127.0.0.1: an auto volunteer moves to the swarm that lost its peers.

layer1's two fixed peers start first, so the auto volunteer (`--swarm auto --rebalance-s 2`) joins the
empty layer0, and then the fixed driver joins it too. Both layer1 peers are SIGKILLed: once their
records expire, the auto volunteer leaves layer0 (the fixed driver keeps it served), downloads layer1
(from nobody: its seeded weights) and serves it, and training goes on. Its own drained micro-batches
and the fixed driver's after the move are not lost.
"""

from __future__ import annotations

import re
import signal
import time

from procs import wait_until, write_run
from swarm.dht.records import ONLINE_WITHIN_MIN_S

PERIOD_S = 2.0


def _rows(report: dict, swarm: str, state: str | None = None) -> list[dict]:
    return [r for r in report["swarms"][swarm] if state is None or r["state"] == state]


def test_an_auto_volunteer_moves_to_a_swarm_whose_peers_were_killed(swarm, tmp_path):
    run = write_run(tmp_path / "run.yaml", name="rebalance", stages=2, training="{batch_size: 16, in_flight: 2}")
    _, maddr = swarm.bootstrap()
    middles = [swarm.join(run, "layer1", maddr, name=f"layer1-{i}") for i in range(2)]
    reader = swarm.reader(run, maddr)
    wait_until(lambda: len(_rows(reader.report(), "layer1", "online")) == 2, 60, what="both layer1 peers online")
    mover = swarm.start("join", "--run", str(run), "--swarm", "auto", "--initial-peers", maddr, "--listen",
                        "/ip4/127.0.0.1/tcp/0", "--headless", "--rebalance-s", str(PERIOD_S), name="auto")
    mover.wait_for_output("--swarm auto chose layer0", timeout_s=60)
    driver = swarm.join(run, "layer0", maddr, name="layer0")

    def trained() -> int:
        return sum(r["trained"] for r in _rows(reader.report(), "layer0"))

    wait_until(lambda: trained() > 500, 90, interval_s=0.5, what="training through layer1")
    assert "moving from" not in mover.stdout(), "nothing to rebalance while layer1 is served"

    for proc in middles:
        proc.signal(signal.SIGKILL)
    killed_at = time.monotonic()
    mover.wait_for_output("moving from layer0 to layer1", timeout_s=60)
    moved_s = time.monotonic() - killed_at
    mover.wait_for_output("online in layer1 (moved from layer0)", timeout_s=60)
    assert re.search(r"moving from layer0 to layer1: rebalancing: .* short", mover.stdout())
    # the killed records expire after 3 heartbeats; then the move comes within 2 periods (jitter included)
    assert moved_s < 3 * 1.0 + 2 * PERIOD_S + 10.0, f"moved {moved_s:.1f} s after the kill"

    def driver_row() -> dict | None:
        rows = [r for r in _rows(reader.report(), "layer0", "online") if r["peer_id"].endswith(_short(driver))]
        return rows[0] if rows else None

    wait_until(lambda: (row := driver_row()) is not None and row["trained"] > 0, 30, what="the driver's record")
    lost_after_move = driver_row()["lost"]
    start = driver_row()["trained"]
    wait_until(lambda: driver_row()["trained"] >= start + 1000, 90, interval_s=0.5,
               what="training to go on through the moved volunteer")
    assert driver_row()["lost"] == lost_after_move, "no micro-batch lost once the volunteer serves layer1"
    # a reader keeps a record it no longer reads online while its heartbeat is fresh (swarm/dht/records.py
    # ONLINE_WITHIN_MIN_S, 10 s): the killed peers' records may still read online if those 1000 samples came fast
    served = wait_until(lambda: rows if len(rows := _rows(reader.report(), "layer1", "online")) == 1 else None,
                        ONLINE_WITHIN_MIN_S + 10.0, interval_s=0.5, what="the killed layer1 peers' records to go stale")
    assert served[0]["peer_id"].endswith(_short(mover)) and served[0]["served"] > 0


def _short(proc) -> str:
    match = re.search(r"joined the DHT as (\w+)", proc.stdout())
    assert match, proc.stdout()[-2000:]
    return match.group(1)
