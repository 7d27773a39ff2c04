"""A real swarm trains across its stage boundaries with a lossy codec: layer0 drives here, layer1 and layer2
are SwarmPeers on real DHTs and sockets (127.0.0.1), activations and gradients travel as int8 or lowrank
both ways, and the test accuracy rises while the bytes on the wire shrink as the codec promises; a coded
payload that lies about its size is rejected by a live stage, which goes on serving."""

from __future__ import annotations

import asyncio
import struct
from concurrent.futures import ThreadPoolExecutor

import pytest

from swarm.run.data import load_dataset, make_shards
from swarm.dht.dht import DHTSettings, fresh_p2p, shutdown_dht, start_dht
from swarm.pipeline.control.driver import PipelineDriver
from swarm.pipeline.peer import SwarmPeer
from swarm.dht.records import MemberRecord
from swarm.run.runconfig import RunConfig
from swarm.pipeline.stage.worker import StageWorker

MICROBATCHES = 90
BATCH = 16
HIDDEN = 32
FLOAT32_BYTES_PER_SAMPLE = 4 * HIDDEN * 3 * 2  # boundaries 0|1 (1 hop), 1|2 (2 hops), activations and gradients


def _run(codec: str) -> RunConfig:
    return RunConfig.model_validate({
        "name": f"codec-{codec}",
        "model": {"stages": 3, "hidden_dim": HIDDEN},
        "optimizer": {"name": "adam", "lr": 0.01},
        "training": {"batch_size": BATCH, "in_flight": 1, "wire_codec": codec, "wire_rank": 4},
        "integrity": {"max_step_ratio": 0.5},
        "timeouts": {"rpc_s": 20},
    })


def _allow_driver(peers: list[SwarmPeer], driver_id: str) -> None:
    """What heartbeats do: the driver is the run's online layer0 peer (in this view and the one before)."""
    record = MemberRecord(peer_id=driver_id, state="online", version="test", started_at=0.0, updated_at=0.0, shard=0)

    async def apply(peer):
        peer.gate.set_drivers([record])
        peer.gate.set_drivers([record])

    for peer in peers:
        asyncio.run_coroutine_threadsafe(apply(peer), peer._loop).result(5)


async def _send_hostile_payload(p2p, run: RunConfig, peer: SwarmPeer) -> dict:
    """A coded activation whose header promises 2**40 values: the stage's reply metadata."""
    from hivemind.p2p import PeerID
    from hivemind.proto import runtime_pb2

    from swarm.pipeline.stage.stage_rpc import StageServicer, stage_namespace
    from swarm.pipeline.transport.wire import pack_metadata, unpack_metadata

    lying = struct.pack("<2sBBH2I", b"VC", 1, 2, 256, 2**20, 2**20) + bytes(64)
    tensor = runtime_pb2.Tensor(buffer=lying, size=[len(lying)], dtype="uint8")
    stub = StageServicer.get_stub(p2p, PeerID.from_base58(str(peer.dht.peer_id)),
                                  namespace=stage_namespace(run.run_id, peer.swarm))
    request = runtime_pb2.ExpertRequest(tensors=[tensor], metadata=pack_metadata({"op": "forward", "mb": "evil"}))
    reply = await asyncio.wait_for(stub.rpc_call(request), 20)
    return unpack_metadata(reply.metadata)


def _train(run: RunConfig, dht0, peers: list[SwarmPeer]) -> tuple[float, float, float, dict]:
    """(accuracy before, accuracy after, bytes per trained sample the driver sent and received, the reply to a
    hostile payload)."""

    async def main():
        p2p = await fresh_p2p(dht0)
        executor = ThreadPoolExecutor(max_workers=1)
        try:
            dataset = load_dataset(run.data, run.model)
            shards = make_shards(dataset.y_train, run.data, dataset.num_classes)
            driver = PipelineDriver(run, StageWorker(run, 0), p2p, executor, dataset, shards, 0, peer_tag="codec")
            if driver.referee is not None:  # measured here: the codec's bytes, the hops' tensors. A referee's fetches
                driver.referee.traffic = None  # (float32 weights, on a volunteer's Traffic: tests/test_referee.py)
            for peer in peers:
                driver.set_peers(peer.swarm, [str(peer.dht.peer_id)])
            before, _ = await asyncio.wait_for(driver.evaluate(), 60)
            refusal = await _send_hostile_payload(p2p, run, peers[0])  # then it must go on serving
            start_in, start_out = driver.traffic.bytes_in, driver.traffic.bytes_out
            for _ in range(MICROBATCHES):
                x, ids = driver.batches.next_with_ids()
                await asyncio.wait_for(driver.train_microbatch(x, ids), 30)
            moved = driver.traffic.bytes_in - start_in + driver.traffic.bytes_out - start_out
            after, _ = await asyncio.wait_for(driver.evaluate(), 60)
            return before, after, moved / driver.stats.trained, refusal
        finally:
            executor.shutdown(wait=False)
            await p2p.shutdown()

    return asyncio.run(main())


@pytest.mark.parametrize(("codec", "max_bytes_ratio"), [("int8", 0.3), ("lowrank", 0.15)])
def test_a_swarm_learns_through_a_lossy_codec_and_sends_fewer_bytes(codec, max_bytes_ratio):
    run = _run(codec)
    dhts, peers = [], []
    try:
        dht0 = start_dht(DHTSettings(), [])
        dhts.append(dht0)
        maddrs = [str(m) for m in dht0.get_visible_maddrs()]
        for k in range(1, run.model.stages):
            dht = start_dht(DHTSettings(initial_peers=maddrs), [])
            dhts.append(dht)
            peer = SwarmPeer(run, dht, f"layer{k}")
            peer.start()
            peers.append(peer)
        _allow_driver(peers, str(dht0.peer_id))
        before, after, bytes_per_sample, refusal = _train(run, dht0, peers)
    finally:
        for peer in peers:
            peer.stop()
        for dht in dhts:
            shutdown_dht(dht)
    print(f"{codec}: accuracy {before:.3f} -> {after:.3f}, {bytes_per_sample:.0f} B per sample")
    assert before < 0.3, f"an untrained model is near chance, got {before:.2f}"
    assert after > 0.6, f"{codec}: test accuracy {before:.2f} -> {after:.2f} after {MICROBATCHES * BATCH} samples"
    assert bytes_per_sample < max_bytes_ratio * FLOAT32_BYTES_PER_SAMPLE, bytes_per_sample
    assert refusal["code"] == "rejected" and "larger than" in refusal["error"], refusal
