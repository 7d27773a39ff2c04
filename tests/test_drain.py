"""A leaving peer's drain (swarm/pipeline/peer.py ``SwarmPeer.drain``): it waits for its own micro-batches, and gives up
when nothing moves. A pushed micro-batch is one call from the driver's side (nothing moves there until it is back), so
"nothing moves" lasts at least twice the slowest micro-batch lately: a drain that gave up on a push still on its way
left stages 1..L with an update whose samples the driver never counted (its stage 0 never stepped on them)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from swarm.pipeline.control.hops import DriverStats
from swarm.pipeline.peer import SwarmPeer


def _peer(round_trip_s: float) -> SwarmPeer:
    peer = SwarmPeer.__new__(SwarmPeer)  # the drain reads the driver and the servicer only
    peer.driver = SimpleNamespace(stats=DriverStats(), in_flight=1, round_trip_s=round_trip_s)
    peer._servicer = None
    return peer


def _drain(peer: SwarmPeer, back_after_s: float) -> tuple[bool, float]:
    def back():
        time.sleep(back_after_s)
        peer.driver.stats.trained += 16
        peer.driver.in_flight = 0

    threading.Thread(target=back, daemon=True).start()
    started = time.monotonic()
    done = peer.drain(timeout_s=5.0, stalled_s=0.3)
    return done, time.monotonic() - started


def test_a_drain_waits_for_a_micro_batch_as_slow_as_the_slowest_lately_and_no_longer_for_one_that_never_comes():
    done, took = _drain(_peer(round_trip_s=0.5), back_after_s=0.8)
    assert done and 0.7 < took < 1.5, took  # 0.8 s without progress: past stalled_s, within 2 round trips
    done, took = _drain(_peer(round_trip_s=0.0), back_after_s=0.8)
    assert not done and took < 0.7, took  # no round trip known: the run's own stall bound
    peer = _peer(round_trip_s=0.2)
    peer.driver.in_flight = 1
    started = time.monotonic()
    assert not peer.drain(timeout_s=5.0, stalled_s=0.3) and time.monotonic() - started < 0.8  # gone for good
