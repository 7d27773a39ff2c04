"""Blame the signer, never the relay (real stage peers over P2P, in one process; a real driver).

A hostile last-stage peer trains nothing honestly: it returns gradients of 9.9e5 (under the driver's reply bound of
1e6, so they pass its checks) with its own valid receipt. The honest driver relays them to layer1. Before receipts,
layer1 struck the driver that relayed them until it was banned and the run stalled; now layer1 strikes and bans the
peer that signed them, refuses its tensors from then on (``bad_author``), the driver routes around it, and training
goes on through the honest last stage."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from swarm.dht.dht import DHTSettings, fresh_p2p, shutdown_dht, start_dht
from swarm.dht.records import MemberRecord
from swarm.pipeline.control.driver import PipelineDriver
from swarm.pipeline.peer import SwarmPeer
from swarm.pipeline.stage.worker import StageWorker
from swarm.run.data import load_dataset, make_shards
from swarm.run.models import assemble
from swarm.run.runconfig import RunConfig

RUN = RunConfig.model_validate({
    "name": "blame",
    "model": {"stages": 3, "hidden_dim": 32},
    "training": {"batch_size": 8, "in_flight": 2},
    "timeouts": {"rpc_s": 10},
})
HOSTILE_VALUE = 9.9e5
DRIVE_LIMIT_S = 60.0
AFTER_BAN_MICROBATCHES = 30


def _hostile_last_stage(worker: StageWorker) -> None:
    """Huge gradients (each validly signed by this peer), and a perfect score in every evaluation."""
    honest = worker.forward_backward

    def forward_backward(mb, x, y, owner="", **kw):
        loss, grad = honest(mb, x, y, owner=owner, **kw)
        return loss, torch.where(grad >= 0, HOSTILE_VALUE, -HOSTILE_VALUE)

    worker.forward_backward = forward_backward
    worker.evaluate = lambda x, y: (0.0, len(y), len(y))


def test_a_hostile_last_stage_is_banned_not_the_driver_that_relayed_its_gradients():
    dhts, peers = [], []
    try:
        first = start_dht(DHTSettings(), [])
        dhts.append(first)
        maddrs = [str(m) for m in first.get_visible_maddrs()]
        for swarm in ("layer1", "layer2", "layer2"):
            dht = start_dht(DHTSettings(initial_peers=maddrs), [])
            dhts.append(dht)
            peer = SwarmPeer(RUN, dht, swarm, evaluate=False)
            peer.start()
            peers.append(peer)
        layer1, honest_last, hostile_last = peers
        _hostile_last_stage(hostile_last.worker)
        driver_id, hostile_id = str(first.peer_id), str(hostile_last.dht.peer_id)
        record = MemberRecord(driver_id, "online", "test", 0.0, 0.0, shard=0)
        for peer in peers:
            asyncio.run_coroutine_threadsafe(_allow(peer, record), peer._loop).result(5)

        driver_stats = asyncio.run(_drive(first, peers, hostile_id))
        banned = {ban.requester for peer in peers for ban in peer.gate.book.bans}
        assert hostile_id in banned, "the peer that signed the wrong gradients is banned"
        assert driver_id not in banned, "the driver that relayed them is not"
        assert all(bool(torch.isfinite(p).all()) for p in layer1.worker.module.parameters())
        assert driver_stats["after_ban"] >= AFTER_BAN_MICROBATCHES, driver_stats
        # the published evaluation is what the replicas agree on, never the liar's 1.0: here the honest figure,
        # within 0.02 of the same model evaluated in one process
        stages = [driver_stats["stage0"], layer1.worker.module, honest_last.worker.module]
        dataset = load_dataset(RUN.data, RUN.model)
        with torch.no_grad():
            logits = assemble(stages).eval()(dataset.x_test)
        recomputed = float((logits.argmax(-1) == dataset.y_test).float().mean())
        assert driver_stats["accuracy"] < 1.0 and not driver_stats["validated"], driver_stats
        assert abs(driver_stats["accuracy"] - recomputed) <= 0.02, (driver_stats, recomputed)
    finally:
        for peer in peers:
            peer.stop()
        for dht in dhts:
            shutdown_dht(dht)


async def _allow(peer: SwarmPeer, record: MemberRecord) -> None:
    peer.gate.set_drivers([record])
    peer.gate.set_drivers([record])


async def _drive(dht0, peers, hostile_id: str) -> dict:
    layer1, honest_last, hostile_last = peers
    p2p, executor, driver = await _driver(dht0, RUN, "blame")
    driver.set_peers("layer1", [str(layer1.dht.peer_id)])
    driver.set_peers("layer2", [hostile_id])  # every micro-batch through it until layer1 bans it (10 strikes)
    task = asyncio.create_task(driver.run_forever())
    deadline = time.monotonic() + DRIVE_LIMIT_S
    banned_at = None
    try:
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            if banned_at is None and any(b.requester == hostile_id for b in layer1.gate.book.bans):
                banned_at = driver.stats.microbatches
                driver.set_peers("layer2", [str(honest_last.dht.peer_id), hostile_id])  # now it has a choice
            if banned_at is not None and driver.stats.microbatches - banned_at >= AFTER_BAN_MICROBATCHES:
                break
            assert not task.done(), f"the driver ended: {task.exception()!r}"
        driver.pause()  # no new micro-batch: the copies hold still while the pipeline is evaluated
        await asyncio.sleep(1.0)
        accuracy, _ = await asyncio.wait_for(driver.evaluate(), 60)
    finally:
        await _stop(driver, task, executor, p2p)
    return {"accuracy": accuracy, "validated": driver.stats.eval_validated, "replicas": driver.stats.eval_replicas,
            "stage0": driver.worker.module, "banned_at": banned_at, "after_ban": driver.stats.microbatches - (driver.stats.microbatches if banned_at is None else banned_at),
            "microbatches": driver.stats.microbatches, "lost": driver.stats.lost, "refused": driver.stats.refused}


SPOT_RUN = RunConfig.model_validate({
    "name": "gradspot",
    "model": {"stages": 3, "hidden_dim": 32},
    "training": {"batch_size": 8, "in_flight": 2},
    "integrity": {"spot_share": 0.5},
    "timeouts": {"rpc_s": 10},
})


def _ascent_last_stage(worker: StageWorker) -> None:
    """Trains honestly; every input gradient it returns (training and recomputations alike) points the other way."""
    honest_fb, honest_check = worker.forward_backward, worker.input_gradient

    def forward_backward(mb, x, y, owner="", **kw):
        loss, grad = honest_fb(mb, x, y, owner=owner, **kw)
        return loss, -grad

    def input_gradient(x, y=None, grad_out=None):
        loss, grad = honest_check(x, y, grad_out)
        return loss, -grad

    worker.forward_backward, worker.input_gradient = forward_backward, input_gradient


def test_a_last_stage_that_returns_ascent_gradients_is_caught_by_gradient_spot_checks():
    """Signed, plausible, at the honest norm: nothing but a recomputation at two other last-stage peers can tell. The
    driver holds the liar off, passes none of its checked gradients upstream, and nobody honest is penalised."""
    dhts, peers = [], []
    try:
        first = start_dht(DHTSettings(), [])
        dhts.append(first)
        maddrs = [str(m) for m in first.get_visible_maddrs()]
        for swarm in ("layer1", "layer2", "layer2", "layer2"):
            dht = start_dht(DHTSettings(initial_peers=maddrs), [])
            dhts.append(dht)
            peer = SwarmPeer(SPOT_RUN, dht, swarm, evaluate=False)
            peer.start()
            peers.append(peer)
        _ascent_last_stage(peers[3].worker)
        hostile_id = str(peers[3].dht.peer_id)
        record = MemberRecord(str(first.peer_id), "online", "test", 0.0, 0.0, shard=0)
        for peer in peers:
            asyncio.run_coroutine_threadsafe(_allow(peer, record), peer._loop).result(5)
        caught = asyncio.run(_drive_with_checks(first, peers, hostile_id))
        # settled by the referee's recomputation now (convicted), or by the vote where it could not be
        assert caught["caught"] + caught["stats"]["convicted"] >= 1 and caught["culprits"] == {hostile_id}, caught
        assert caught["after"] >= AFTER_BAN_MICROBATCHES, caught
        # a stage bans nobody but the liar (layer1 does on the driver's evidence of its conviction: convictions.py)
        assert {ban.requester for peer in peers for ban in peer.gate.book.bans} <= {hostile_id}
        assert all(bool(torch.isfinite(p).all()) for peer in peers for p in peer.worker.module.parameters())
    finally:
        for peer in peers:
            peer.stop()
        for dht in dhts:
            shutdown_dht(dht)


async def _drive_with_checks(dht0, peers, hostile_id: str) -> dict:
    p2p, executor, driver = await _driver(dht0, SPOT_RUN, "spot")
    driver.set_peers("layer1", [str(peers[0].dht.peer_id)])
    driver.set_peers("layer2", [str(peer.dht.peer_id) for peer in peers[1:]])
    culprits: set[str] = set()
    task = asyncio.create_task(driver.run_forever())
    deadline = time.monotonic() + DRIVE_LIMIT_S
    caught_at = None
    try:
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            now = time.monotonic()
            culprits |= {p for p, s in driver.routers["layer2"].peers.items() if s.banned_until > now}
            if caught_at is None and (driver.spot.caught or driver.spot.convicted):
                caught_at = driver.stats.microbatches
            if caught_at is not None and driver.stats.microbatches - caught_at >= AFTER_BAN_MICROBATCHES:
                break
            assert not task.done(), f"the driver ended: {task.exception()!r}"
    finally:
        await _stop(driver, task, executor, p2p)
    return {"caught": driver.spot.caught, "culprits": culprits, "stats": driver.spot.stats(),
            "after": driver.stats.microbatches - (caught_at or 0)}


async def _stop(driver, task, executor, p2p) -> None:
    """The end of a ``_driver``'s drive: its lanes stopped, its task awaited, its executor and P2P replica shut."""
    driver.stop()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    executor.shutdown(wait=False)
    await p2p.shutdown()


async def _driver(dht0, run: RunConfig, tag: str) -> tuple:
    """A real driver of ``run`` on its own P2P replica of ``dht0``: (p2p, executor, driver); the caller shuts both."""
    p2p = await fresh_p2p(dht0)
    executor = ThreadPoolExecutor(max_workers=1)
    dataset = load_dataset(run.data, run.model)
    shards = make_shards(dataset.y_train, run.data, dataset.num_classes)
    return p2p, executor, PipelineDriver(run, StageWorker(run, 0), p2p, executor, dataset, shards, 0, peer_tag=tag)
