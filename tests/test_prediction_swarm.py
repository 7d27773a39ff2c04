"""Weight prediction in a live pipeline (real stage peers over P2P in one process, a real driver with its referee):
honest lone copies that predict their weights are refereed and audited like any, and nothing honest is convicted,
held for hiding or withholding, or left without a verdict for long."""

from __future__ import annotations

import asyncio
import time

from swarm.dht.dht import DHTSettings, shutdown_dht, start_dht
from swarm.dht.records import MemberRecord
from swarm.pipeline.peer import SwarmPeer
from swarm.run.runconfig import RunConfig
from test_blame_swarm import _allow, _driver, _stop

RUN = RunConfig.model_validate({
    "name": "prediction-swarm",
    "model": {"stages": 3, "hidden_dim": 32},
    "training": {"batch_size": 8, "in_flight": 4, "weight_prediction": True},
    "integrity": {"spot_share": 0.3},  # many of the hops refereed, so a wrong rebuild would show at once
    "timeouts": {"rpc_s": 10},
})
MICROBATCHES = 120
DRIVE_LIMIT_S = 60.0


def test_honest_lone_copies_that_predict_their_weights_are_upheld_and_never_punished():
    dhts, peers = [], []
    first = start_dht(DHTSettings(), [])
    dhts.append(first)
    maddrs = [str(m) for m in first.get_visible_maddrs()]
    try:
        for swarm in ("layer1", "layer2"):
            dht = start_dht(DHTSettings(initial_peers=maddrs), [])
            dhts.append(dht)
            peer = SwarmPeer(RUN, dht, swarm, evaluate=False)
            peer.start()
            peers.append(peer)
        record = MemberRecord(str(first.peer_id), "online", "test", 0.0, 0.0, shard=0)
        for peer in peers:
            asyncio.run_coroutine_threadsafe(_allow(peer, record), peer._loop).result(5)

        async def drive() -> dict:
            p2p, executor, driver = await _driver(first, RUN, "predict")
            driver.set_peers("layer1", [str(peers[0].dht.peer_id)])
            driver.set_peers("layer2", [str(peers[1].dht.peer_id)])
            task = asyncio.create_task(driver.run_forever())
            started = time.monotonic()
            try:
                while time.monotonic() - started < DRIVE_LIMIT_S and driver.stats.microbatches < MICROBATCHES:
                    await asyncio.sleep(0.2)
                    assert not task.done(), f"the driver ended: {task.exception()!r}"
                await asyncio.sleep(1.0)  # the last judgements and audits
                return {"microbatches": driver.stats.microbatches, "referee": driver.referee.stats(),
                        "holds": driver.spot.hidden_holds, "reason": driver.stats.blocked_reason,
                        "stage0_predicted": driver.worker.predicted}
            finally:
                await _stop(driver, task, executor, p2p)

        result = asyncio.run(drive())
        referee = result["referee"]
        assert result["microbatches"] >= MICROBATCHES, result
        assert peers[0].worker.predicted > 0 and result["stage0_predicted"] > 0, result  # layer2 (the last): none
        assert peers[1].worker.predicted == 0, result
        assert referee["held"] >= 5 and referee["convicted"] == 0, result
        assert referee["climbing"] == 0 and referee["withheld"] == 0 and result["holds"] == 0, result
        assert referee["unshown"] <= max(2, referee["refereed"] // 5), result
        assert not result["reason"], result
    finally:
        for peer in peers:
            peer.stop()
        for dht in dhts:
            shutdown_dht(dht)
