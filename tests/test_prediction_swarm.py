"""Weight prediction in a live pipeline (real stage peers over P2P in one process, a real driver with its referee):
honest lone copies that predict their weights are refereed and audited like any, and nothing honest is convicted,
held for hiding or withholding, or left without a verdict for long."""

from __future__ import annotations

import asyncio
import time

from swarm.dht.dht import shutdown_dht
from swarm.dht.records import MemberRecord
from swarm.pipeline.stage.stage_rpc import StageServicer, stage_namespace
from swarm.run.runconfig import RunConfig
from test_blame_swarm import _allow, _driver, _stop
from test_referee_swarm import start_lone_copies

RUN = RunConfig.model_validate({
    "name": "prediction-swarm",
    "model": {"stages": 3, "hidden_dim": 32},
    "training": {"batch_size": 8, "in_flight": 4, "weight_prediction": 2.0},
    "integrity": {"spot_share": 0.3},  # many of the hops refereed, so a wrong rebuild would show at once
    "timeouts": {"rpc_s": 10},
})
MICROBATCHES = 120
DRIVE_LIMIT_S = 60.0


def test_honest_lone_copies_that_predict_their_weights_are_upheld_and_never_punished():
    dhts, peers = [], []
    try:
        first = start_lone_copies(RUN, dhts, peers)
        record = MemberRecord(str(first.peer_id), "online", "test", 0.0, 0.0, shard=0)
        for peer in peers:
            asyncio.run_coroutine_threadsafe(_allow(peer, record), peer._loop).result(5)

        async def drive() -> dict:
            p2p, executor, driver = await _driver(first, RUN, "predict")
            door = StageServicer(driver.worker, executor)  # its stage 0's weights door, as a layer0 peer serves it
            await door.add_p2p_handlers(p2p, namespace=stage_namespace(RUN.run_id, "layer0"))
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
                        "stage0_predicted": driver.worker.predicted, "stage0": peers[0]._servicer.spot0.stats(),
                        "stage0_reason": peers[0]._servicer.spot0.referee.last_reason}
            finally:
                await _stop(driver, task, executor, p2p)

        result = asyncio.run(drive())
        referee = result["referee"]
        assert result["microbatches"] >= MICROBATCHES, result
        assert peers[0].worker.predicted > 0 and result["stage0_predicted"] > 0, result  # layer2 (the last): none
        assert peers[1].worker.predicted == 0, result
        shown = peers[0].metrics()  # what its node's dashboard and `volunteer ctl status` read
        assert shown.predicted_forwards == peers[0].worker.predicted and 0 <= shown.predicted_ahead <= 8, result
        assert peers[1].metrics().predicted_ahead == 0, result
        assert referee["held"] >= 5 and referee["convicted"] == 0, result
        assert referee["climbing"] == 0 and referee["withheld"] == 0 and result["holds"] == 0, result
        assert referee["unshown"] <= max(2, referee["refereed"] // 5), result
        assert not result["reason"], result
        stage0 = result["stage0"]  # layer1 referees the driver's predicted stage-0 outputs against its receipts
        assert stage0["upheld"] >= 5 and stage0["convicted"] == 0, result
    finally:
        for peer in peers:
            peer.stop()
        for dht in dhts:
            shutdown_dht(dht)
