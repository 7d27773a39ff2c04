"""The stage RPCs in one process: remote gradients equal local ones; hostile tensors are rejected, never applied."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from swarm.run.data import load_dataset, make_shards
from swarm.dht.dht import DHTSettings, fresh_p2p, shutdown_dht, start_dht
from swarm.pipeline.control.driver import PipelineDriver
from swarm.run.models import assemble, build_stages, loss_fn
from swarm.pipeline.peer import SwarmPeer
from swarm.dht.records import MemberRecord
from swarm.run.runconfig import RunConfig
from swarm.pipeline.stage.worker import StageWorker
from swarm.integrity.receipts import ReceiptKey
from swarm.pipeline.stage.stage_rpc import StageError, call_stage, stage_namespace
from receipting import relay_meta, stage0_meta

RUN = RunConfig.model_validate({
    "name": "piperpc",
    "model": {"stages": 3, "hidden_dim": 32},
    "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.0},
    "training": {"batch_size": 8, "in_flight": 1, "max_payload_mb": 0.05},
    "integrity": {"max_step_ratio": 0.5},  # lr 0.1 on a tiny model moves the last stage >5% at step 1: unclipped
    "timeouts": {"rpc_s": 10},
})
MAX_BYTES = int(RUN.training.max_payload_mb * 2**20)


@pytest.fixture(scope="module")
def stage_servers():
    dhts, peers = [], []
    try:
        first = start_dht(DHTSettings(), [])
        dhts.append(first)
        maddrs = [str(m) for m in first.get_visible_maddrs()]
        for k in range(1, RUN.model.stages):
            dht = start_dht(DHTSettings(initial_peers=maddrs), [])
            dhts.append(dht)
            peer = SwarmPeer(RUN, dht, f"layer{k}")
            peer.start()
            peers.append(peer)
        allow_drivers(peers, {str(first.peer_id): 0})  # the tests drive from the first DHT's identity
        yield first, peers
    finally:
        for peer in peers:
            peer.stop()
        for dht in dhts:
            shutdown_dht(dht)


def driver_record(peer_id: str, shard: int) -> MemberRecord:
    return MemberRecord(peer_id=peer_id, state="online", version="test", started_at=0.0, updated_at=0.0, shard=shard)


def allow_drivers(peers, shards_by_peer: dict[str, int]) -> None:
    """What heartbeats do: these peers are the run's online layer0 drivers, in this view and the one before
    (the grace for a stale view), applied before returning."""
    records = [driver_record(pid, shard) for pid, shard in shards_by_peer.items()]

    async def apply(peer):
        peer.gate.set_drivers(records)
        peer.gate.set_drivers(records)
        # claims held for long: past the grace a new claim gets (swarm/integrity/labels.py, DriverView)
        peer.gate.view.held_since = dict.fromkeys(peer.gate.view.held_since, float("-inf"))

    for peer in peers:
        asyncio.run_coroutine_threadsafe(apply(peer), peer._loop).result(5)


def _with_driver(dht0, peers, body):
    async def main():
        p2p = await fresh_p2p(dht0)
        executor = ThreadPoolExecutor(max_workers=1)
        try:
            dataset = load_dataset(RUN.data, RUN.model)
            shards = make_shards(dataset.y_train, RUN.data, dataset.num_classes)
            driver = PipelineDriver(RUN, StageWorker(RUN, 0), p2p, executor, dataset, shards, 0, peer_tag="test")
            for peer in peers:
                driver.set_peers(peer.swarm, [str(peer.dht.peer_id)])
            return await body(driver, p2p, dataset)
        finally:
            executor.shutdown(wait=False)
            await p2p.shutdown()

    return asyncio.run(main())


async def _hop(p2p, peer, op, tensors, meta):
    return await call_stage(p2p, str(peer.dht.peer_id), stage_namespace(RUN.run_id, peer.swarm), op, tensors, meta,
                            timeout_s=10, codec="float32", max_bytes=MAX_BYTES)


def test_remote_gradients_equal_local_gradients(stage_servers):
    """One micro-batch through layer0 (here), layer1 and layer2 (remote, by sample ids): the same loss,
    gradients and update as the whole model trained in one process."""
    dht0, peers = stage_servers
    layer1, layer2 = peers
    before = [{n: p.detach().clone() for n, p in peer.worker.module.named_parameters()} for peer in peers]

    async def body(driver, p2p, dataset):
        ids = torch.as_tensor(make_shards(dataset.y_train, RUN.data, dataset.num_classes)[0][:8], dtype=torch.int64)
        x, y = dataset.x_train[ids], dataset.y_train[ids]
        worker0, key = driver.worker, driver.receipt_key
        h0 = worker0.forward("g", x)
        (h1,), m1, _ = await _hop(p2p, layer1, "forward", [h0], stage0_meta(key, RUN.run_id, "g", h0, ids))
        (g1,), meta, _ = await _hop(p2p, layer2, "forward_backward", [h1, ids], relay_meta(key, "g", m1["rc"]))
        (g0,), _, _ = await _hop(p2p, layer1, "backward", [g1], {**relay_meta(key, "g", meta["rc"]), "loss": meta["loss"]})
        worker0.backward("g", g0, None, meta["loss"])
        return worker0, x, y, meta["loss"]

    worker0, x, y, remote_loss = _with_driver(dht0, peers, body)
    local_stages = build_stages(RUN.model)
    local_loss = loss_fn(RUN.model, assemble(local_stages)(x), y)
    local_loss.backward()
    assert remote_loss == pytest.approx(local_loss.item(), rel=1e-5)
    remote_workers = [worker0.module] + [peer.worker.module for peer in peers]
    for k, (local, remote) in enumerate(zip(local_stages, remote_workers)):
        for (name, lp), (_, rp) in zip(local.named_parameters(), remote.named_parameters()):
            assert torch.allclose(lp.grad, rp.grad, atol=1e-6), f"layer{k}.{name}"
    # the update went into each remote copy (SGD, lr 0.1): p_new = p_old - 0.1 * grad
    for peer, old in zip(peers, before):
        for name, param in peer.worker.module.named_parameters():
            assert torch.allclose(param, old[name] - 0.1 * param.grad, atol=1e-6)
    # the last stage judged that loss as the driver's through layer1's copy: the signer of its input, not whoever
    # relayed it (here the driver), is the source its loss health keys on (swarm/integrity/health.py)
    assert {source for _, source in layer2.worker.health._owner_losses} == {str(layer1.dht.peer_id)}


def test_gradient_checks_recompute_the_gradients_a_stage_returns_and_apply_nothing(stage_servers):
    """A driver's spot check of a gradient hop (swarm/pipeline/control/spot_checks.py): forward_backward_check at the last
    stage and backward_check [g, x] with the chain of receipts at another stage return the input gradient the
    training op returns, signed, and leave the copy as it was."""
    dht0, peers = stage_servers
    layer1, layer2 = peers

    async def body(driver, p2p, dataset):
        ids = torch.as_tensor(make_shards(dataset.y_train, RUN.data, dataset.num_classes)[0][8:16], dtype=torch.int64)
        key = driver.receipt_key
        h0 = driver.worker.forward("c", dataset.x_train[ids])
        first = stage0_meta(key, RUN.run_id, "c", h0, ids)
        (h1,), m1, _ = await _hop(p2p, layer1, "forward", [h0], first)
        versions = [peer.worker.stats.param_version for peer in peers]
        (check2,), c2, _ = await _hop(p2p, layer2, "forward_backward_check", [h1, ids], relay_meta(key, "c", m1["rc"]))
        assert [peer.worker.stats.param_version for peer in peers] == versions, "a check applied an update"
        (g1,), meta, _ = await _hop(p2p, layer2, "forward_backward", [h1, ids], relay_meta(key, "c", m1["rc"]))
        chain = relay_meta(key, "c", meta["rc"], first["rc"][0], m1["rc"])
        (check1,), c1, _ = await _hop(p2p, layer1, "backward_check", [g1, h0], chain)
        assert layer1.worker.stats.param_version == versions[0], "a check applied an update"
        (g0,), _, _ = await _hop(p2p, layer1, "backward", [g1], {**relay_meta(key, "c", meta["rc"]), "loss": meta["loss"]})
        return check2, c2, g1, meta, check1, c1, g0

    check2, c2, g1, meta, check1, c1, g0 = _with_driver(dht0, peers, body)
    assert torch.allclose(check2, g1, atol=1e-6) and c2["loss"] == pytest.approx(meta["loss"], rel=1e-6)
    assert torch.allclose(check1, g0, atol=1e-6)
    assert c1["rc"] and c2["rc"]  # signed, as every reply


def test_a_micro_batch_resent_to_a_stage_that_applied_it_is_refused_not_applied_twice(stage_servers):
    """A driver that resends a hop whose answer it never got (a timeout, a broken push resumed by relay) must not make
    a copy take two steps on one micro-batch: the second forward_backward or backward of the same micro-batch id is
    refused with ``duplicate`` and applies nothing; a request that applied nothing (need_input) leaves the id free,
    so the honest retry runs."""
    dht0, peers = stage_servers
    layer1, layer2 = peers

    async def body(driver, p2p, dataset):
        ids = torch.as_tensor(make_shards(dataset.y_train, RUN.data, dataset.num_classes)[0][16:24], dtype=torch.int64)
        key = driver.receipt_key
        h0 = driver.worker.forward("d", dataset.x_train[ids])
        first = stage0_meta(key, RUN.run_id, "d", h0, ids)
        with pytest.raises(StageError) as early:  # nothing saved here yet: applies nothing, claims nothing
            await _hop(p2p, layer1, "backward", [torch.zeros(8, 32)], first)
        (h1,), m1, _ = await _hop(p2p, layer1, "forward", [h0], first)
        version2 = layer2.worker.stats.param_version
        (g1,), meta, _ = await _hop(p2p, layer2, "forward_backward", [h1, ids], relay_meta(key, "d", m1["rc"]))
        # the resend is answered as the first copy was (the same gradient, the same signed receipt), not applied again
        (g1_again,), meta_again, _ = await _hop(p2p, layer2, "forward_backward", [h1, ids],
                                                relay_meta(key, "d", m1["rc"]))
        assert torch.equal(g1_again, g1) and meta_again["rc"] == meta["rc"]
        assert layer2.worker.stats.param_version == version2 + 1, "a resent micro-batch was applied twice"
        version1 = layer1.worker.stats.param_version
        await _hop(p2p, layer1, "backward", [g1], {**relay_meta(key, "d", meta["rc"]), "loss": meta["loss"]})
        assert layer1.worker.stats.param_version == version1 + 1, "the backward after a need_input must run"
        # its saved activations are gone now: a resend carries its input and receipts (as after need_input)
        chain = {**relay_meta(key, "d", meta["rc"], first["rc"][0], m1["rc"]), "loss": meta["loss"]}
        await _hop(p2p, layer1, "backward", [g1, h0], chain)  # the same gradient: answered with its reply
        assert layer1.worker.stats.param_version == version1 + 1, "a resent backward was applied twice"
        # ... but the same micro-batch id on another input is refused: one update per micro-batch, whatever comes
        other_ids = ids + 8
        h0b = driver.worker.forward("d", dataset.x_train[other_ids])
        (h1b,), m1b, _ = await _hop(p2p, layer1, "forward", [h0b], stage0_meta(key, RUN.run_id, "d", h0b, other_ids))
        with pytest.raises(StageError) as again:
            await _hop(p2p, layer2, "forward_backward", [h1b, other_ids], relay_meta(key, "d", m1b["rc"]))
        assert layer2.worker.stats.param_version == version2 + 1
        return early.value, again.value

    early, again = _with_driver(dht0, peers, body)
    assert early.code == "need_input"
    assert again.code == "duplicate" and "already been applied" in str(again)
    assert layer2._servicer.applied.refused >= 2 and layer2._servicer.replies.replayed == 1
    assert layer1._servicer.replies.replayed == 1


def test_an_update_whose_caller_left_mid_compute_lands_once_and_its_resend_gets_its_reply(stage_servers):
    """A caller that leaves while the last stage computes its forward_backward (a pushing layer1 peer killed: its
    session's running calls are cancelled, swarm/pipeline/transport/sessions.py) cannot take back the update the
    compute thread applies. The stage finishes the request anyway: the micro-batch stays claimed, its signed reply is
    kept, and the driver's resend is answered with it. Before, the cancelled handler released the claim while the
    update landed, and the resend was applied a second time: the suite's clean-stop test saw the last stage's sample
    clock one micro-batch past its driver's count (CI, session 18). A request cancelled before its compute began
    applies nothing and leaves its micro-batch free."""
    import threading
    from types import SimpleNamespace

    from swarm.pipeline.transport.wire import as_proto, encode_tensors, pack_metadata

    dht0, peers = stage_servers
    layer1, layer2 = peers
    servicer = layer2._servicer
    started, release = threading.Event(), threading.Event()
    original = layer2.worker.forward_backward

    def slow(*args, **kwargs):
        started.set()
        release.wait(10)  # the caller leaves while this runs
        return original(*args, **kwargs)

    def cancelled_on_layer2(tensors, meta, context, when):
        """``_handle`` on layer2's loop, as a session runs it, cancelled ``when`` "queued" or "computing"."""
        async def run():
            serialized = [as_proto(t) for t in encode_tensors(tensors)]
            task = asyncio.ensure_future(servicer._handle(serialized, pack_metadata({**meta, "op": "forward_backward"}),
                                                          context))
            if when == "queued":  # the compute thread is busy with another request: ours waits its turn
                blocker = asyncio.ensure_future(servicer.fair.run("another driver", release.wait, 10))
                await asyncio.sleep(0.2)
                task.cancel()
                release.set()
                await blocker
            else:
                deadline = time.monotonic() + 10
                while not started.is_set() and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert started.is_set(), "layer2 never began computing the forward_backward"
                task.cancel()
                release.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            deadline = time.monotonic() + 10
            while servicer.active and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            return servicer.active

        return asyncio.run_coroutine_threadsafe(run(), layer2._loop).result(30)

    async def body(driver, p2p, dataset):
        ids = torch.as_tensor(make_shards(dataset.y_train, RUN.data, dataset.num_classes)[0][24:32], dtype=torch.int64)
        key, context = driver.receipt_key, SimpleNamespace(remote_id=p2p.peer_id)
        results = {}
        for when in ("queued", "computing"):
            mb = f"left-{when}"
            started.clear(), release.clear()
            h0 = driver.worker.forward(mb, dataset.x_train[ids])
            (h1,), m1, _ = await _hop(p2p, layer1, "forward", [h0], stage0_meta(key, RUN.run_id, mb, h0, ids))
            version = layer2.worker.stats.param_version
            layer2.worker.forward_backward = slow
            try:
                active = await asyncio.get_running_loop().run_in_executor(
                    None, cancelled_on_layer2, [h1, ids], relay_meta(key, mb, m1["rc"]), context, when)
            finally:
                release.set()
                layer2.worker.forward_backward = original
            applied = layer2.worker.stats.param_version - version
            (g1,), meta, _ = await _hop(p2p, layer2, "forward_backward", [h1, ids], relay_meta(key, mb, m1["rc"]))
            results[when] = (active, applied, layer2.worker.stats.param_version - version, meta["ok"], g1.shape)
        return results

    replayed = servicer.replies.replayed
    results = _with_driver(dht0, peers, body)
    # queued: nothing ran, so the resend is the micro-batch's first update; computing: applied once, replayed once
    assert results["queued"] == (0, 0, 1, True, (8, 32)), results
    assert results["computing"] == (0, 1, 1, True, (8, 32)), "a micro-batch whose caller left was applied twice"
    assert servicer.replies.replayed == replayed + 1


def test_an_op_that_is_not_a_string_is_refused_as_unknown(stage_servers):
    """A hostile op of another type (a list: unhashable) is refused like any unknown op, before any set lookup could
    raise on it."""
    from types import SimpleNamespace

    from swarm.pipeline.transport.wire import encode_tensors, pack_metadata

    _, (layer1, _) = stage_servers

    async def ask():
        return await layer1._servicer._handle(encode_tensors([torch.zeros(8, 32)]),
                                              pack_metadata({"op": ["forward"], "mb": "m7"}),
                                              SimpleNamespace(remote_id="a-stranger"))

    out, reply = asyncio.run_coroutine_threadsafe(ask(), layer1._loop).result(10)
    assert out == [] and reply["code"] == "rejected" and "unknown op" in reply["error"], reply
    assert layer1._servicer.active == 0


@pytest.mark.parametrize(
    ("tensors", "meta", "expected"),
    [
        ([torch.zeros(8, 5)], {"op": "forward", "mb": "m1"}, "shape (8, 5)"),
        ([torch.full((8, 32), float("nan"))], {"op": "forward", "mb": "m2"}, "NaN"),
        ([torch.zeros(8, 32, dtype=torch.int64)], {"op": "forward", "mb": "m3"}, "dtype"),
        ([torch.zeros(512, 32)], {"op": "forward", "mb": "m4"}, "payload larger"),
        ([torch.zeros(8, 32)], {"op": "explode", "mb": "m5"}, "unknown op"),
        ([torch.zeros(8, 32)], {"op": "forward"}, "micro-batch id"),
        ([torch.zeros(8, 32)], {"op": "forward_backward", "mb": "m6"}, "only served by the last stage"),
        ([torch.zeros(8, 32)], {"op": "backward", "mb": "never-seen"}, "no saved activations"),
    ],
)
def test_stage_rejects_bad_requests_and_applies_nothing(stage_servers, tensors, meta, expected):
    dht0, peers = stage_servers
    layer1 = peers[0]
    version = layer1.worker.stats.param_version

    async def body(driver, p2p, dataset):
        signed = {**stage0_meta(driver.receipt_key, RUN.run_id, meta.get("mb", "x"), tensors[0]), **meta}
        if "mb" not in meta:
            del signed["mb"]
        with pytest.raises(StageError) as caught:
            await call_stage(p2p, str(layer1.dht.peer_id), stage_namespace(RUN.run_id, "layer1"), signed.pop("op"),
                             tensors, signed, timeout_s=10, codec="float32", max_bytes=10 * MAX_BYTES)
        # the server is still up and serves a good request
        x = torch.zeros(4, 32)
        (out,), _, _ = await call_stage(p2p, str(layer1.dht.peer_id), stage_namespace(RUN.run_id, "layer1"),
                                        "infer", [x], stage0_meta(driver.receipt_key, RUN.run_id, "ok", x, op="infer"),
                                        timeout_s=10, codec="float32", max_bytes=MAX_BYTES)
        return caught.value, out

    error, out = _with_driver(dht0, peers, body)
    assert expected in str(error)
    assert out.shape == (4, 32)
    assert layer1.worker.stats.param_version == version, "a rejected request must not update the layer"


@pytest.mark.parametrize(("op", "ids", "code", "expected"), [
    ("forward_backward", torch.full((8,), 10**6), "rejected", "out of range"),
    ("evaluate", torch.full((8,), 10**6), "rejected", "out of range"),
    ("forward_backward", torch.zeros(8), "rejected", "int64"),
    ("forward_backward", "shard1", "wrong_shard", "shard(s) [1]"),
])
def test_last_stage_takes_sample_ids_only_from_the_senders_shards(stage_servers, op, ids, code, expected):
    """Targets come from the run's data by id: ids out of range, or in a shard another driver holds, are refused."""
    dht0, peers = stage_servers
    last = peers[-1]
    version = last.worker.stats.param_version
    allow_drivers(peers, {str(dht0.peer_id): 0, "QmAnotherDriverHoldsShard1": 1})

    async def body(driver, p2p, dataset):
        sample_ids = ids
        if isinstance(ids, str):
            sample_ids = torch.as_tensor(make_shards(dataset.y_train, RUN.data, 10)[1][:8], dtype=torch.int64)
        x, key = torch.zeros(8, 32), driver.receipt_key
        forward = "infer" if op == "evaluate" else "forward"
        (h,), m1, _ = await _hop(p2p, peers[0], forward, [x], stage0_meta(key, RUN.run_id, "t", x, sample_ids, op=forward))
        with pytest.raises(StageError) as caught:
            await _hop(p2p, last, op, [h, sample_ids], relay_meta(key, "t", m1["rc"]))
        return caught.value

    try:
        error = _with_driver(dht0, peers, body)
    finally:
        allow_drivers(peers, {str(dht0.peer_id): 0})
    assert error.code == code and expected in str(error)
    assert last.worker.stats.param_version == version


def test_a_burst_of_wrong_shard_micro_batches_is_refused_without_a_ban_until_the_driver_goes_on(stage_servers):
    """A driver's lanes full of a shard whose holder our view still shows (it left; our read lags its driver's) are
    refused and nobody is struck: ten of them banned an honest driver in CI. A driver told so that keeps sending
    them past its in-flight grace is struck, and banned as before."""
    from swarm.integrity.labels import WRONG_SHARD_GRACE_S

    dht0, peers = stage_servers
    last = peers[-1]
    me = str(dht0.peer_id)
    allow_drivers(peers, {me: 0, "QmAnotherDriverHoldsShard1": 1})
    book = last.gate.book
    refusals = last.gate.shard_refusals
    allowance, refusals.allowance = refusals.allowance, int(RUN.integrity.ban_strikes)  # "in flight": the first 10

    async def body(driver, p2p, dataset):
        wrong = torch.as_tensor(make_shards(dataset.y_train, RUN.data, 10)[1][:8], dtype=torch.int64)
        key, codes = driver.receipt_key, []
        for i in range(3 * int(RUN.integrity.ban_strikes)):
            x = torch.zeros(8, 32)
            (h,), m1, _ = await _hop(p2p, peers[0], "forward", [x], stage0_meta(key, RUN.run_id, f"w{i}", x, wrong))
            try:
                await _hop(p2p, last, "forward_backward", [h, wrong], relay_meta(key, f"w{i}", m1["rc"]))
            except StageError as exc:
                codes.append(exc.code)
            if i == int(RUN.integrity.ban_strikes):  # the in-flight grace is over and the driver went on
                told = last.gate.shard_refusals._told
                told[me][0] -= WRONG_SHARD_GRACE_S
        return codes

    try:
        codes = _with_driver(dht0, peers, body)
        banned = book.banned(me, time.monotonic())
    finally:
        allow_drivers(peers, {me: 0})
        book._book.pop(me, None)  # the module's other tests drive with this peer
        refusals.allowance = allowance
    first = int(RUN.integrity.ban_strikes) + 1
    assert codes[:first] == ["wrong_shard"] * first, codes
    assert "banned" in codes[first:] or banned, f"a driver that went on after it was told was never banned: {codes}"


def test_a_peer_without_a_layer0_record_is_refused(stage_servers):
    """Only the run's online layer0 peers may ask for work: a stranger gets unknown_driver (and a retry time)."""
    dht0, peers = stage_servers
    layer1 = peers[0]

    async def main():
        p2p = await fresh_p2p(peers[-1].dht)  # a peer of the run, but not a layer0 driver
        try:
            with pytest.raises(StageError) as caught:
                x = torch.zeros(8, 32)
                await _hop(p2p, layer1, "forward", [x], stage0_meta(ReceiptKey(str(p2p.peer_id)), RUN.run_id, "x", x))
            return caught.value
        finally:
            await p2p.shutdown()

    assert asyncio.run(main()).code == "unknown_driver"


def test_float16_wire_halves_the_bytes_and_keeps_values_close(stage_servers):
    dht0, peers = stage_servers
    layer1 = peers[0]

    async def body(driver, p2p, dataset):
        x = torch.randn(8, 32)
        results = {}
        for dtype in ("float32", "float16"):
            before = driver.traffic.bytes_out
            x = x.clone()  # serialized anew in this codec
            meta = stage0_meta(driver.receipt_key, RUN.run_id, dtype, x, op="infer", codec=dtype)
            (out,), _, _ = await call_stage(p2p, str(layer1.dht.peer_id), stage_namespace(RUN.run_id, "layer1"),
                                            "infer", [x], meta, timeout_s=10, codec=dtype, max_bytes=MAX_BYTES,
                                            traffic=driver.traffic)
            results[dtype] = (out, driver.traffic.bytes_out - before)
        return results

    results = _with_driver(dht0, peers, body)
    assert results["float16"][1] * 2 == results["float32"][1]
    assert torch.allclose(results["float16"][0], results["float32"][0], atol=1e-2)


def test_large_payloads_are_streamed_both_ways():
    """4 MiB of activations in and out: over the unary limit, so request and reply are streamed."""
    wide = RunConfig.model_validate({"name": "wide", "model": {"stages": 3, "hidden_dim": 2048},
                                     "training": {"batch_size": 512}, "timeouts": {"rpc_s": 30}})
    first = start_dht(DHTSettings(), [])
    dht = start_dht(DHTSettings(initial_peers=[str(m) for m in first.get_visible_maddrs()]), [])
    peer = SwarmPeer(wide, dht, "layer1")
    try:
        peer.start()
        allow_drivers([peer], {str(first.peer_id): 0})

        async def main():
            p2p = await fresh_p2p(first)
            try:
                x = torch.randn(512, 2048)
                meta = stage0_meta(ReceiptKey(str(p2p.peer_id)), wide.run_id, "w", x, op="infer")
                (out,), _, _ = await call_stage(p2p, str(dht.peer_id), stage_namespace(wide.run_id, "layer1"), "infer",
                                                [x], meta, timeout_s=30, codec="float32", max_bytes=64 * 2**20,
                                                expect_bytes=x.numel() * 4)
                return x, out
            finally:
                await p2p.shutdown()

        x, out = asyncio.run(main())
        assert out.shape == (512, 2048)
        assert torch.allclose(out, peer.worker.infer(x), atol=1e-5)
        assert peer.traffic.bytes_in >= 4 * 2**20 and peer.traffic.bytes_out >= 4 * 2**20
    finally:
        peer.stop()
        shutdown_dht(dht)
        shutdown_dht(first)
