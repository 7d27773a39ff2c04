"""Pulls between peers in one process: real DHTs and RPCs on 127.0.0.1, peers that do not train.

The parameter service returns a consistent copy with its state; one Dpwa pull interpolates as the
rules say; hostile parameters are rejected and their server banned; fetch_probability 0 never pulls;
a newcomer downloads its layer (and optimizer state) before it computes anything.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from swarm.averaging.params_rpc import fetch_params
from swarm.run.optim_state import optimizer_tensors
from swarm.dht.dht import DHTSettings, shutdown_dht, start_dht
from swarm.pipeline.peer import SwarmPeer
from swarm.dht.records import MemberRecord
from swarm.run.runconfig import RunConfig
from swarm.pipeline.stage.worker import StageWorker, WorkerState

RUN = RunConfig.model_validate({
    "name": "avgpull",
    "model": {"stages": 2, "hidden_dim": 32},
    "optimizer": {"name": "adam", "lr": 0.001},  # 30 steps of 0.01 would take a copy 3 norms from its peer
    "training": {"batch_size": 8, "in_flight": 1},
    "averaging": {"mode": "dpwa", "fetch_probability": 0.0, "interpolation": "constant", "constant_factor": 0.5,
                  "timeout_s": 10, "ban_s": 60, "sync_timeout_s": 20},
})
WAIT_S = 30


def _record(peer_id: str, state: str = "online", **changes) -> MemberRecord:
    now = time.time()
    return MemberRecord(peer_id=peer_id, state=state, version="t", started_at=now, updated_at=now, **changes)


def _record_of(peer: SwarmPeer) -> MemberRecord:
    stats = peer.worker.stats
    return _record(str(peer.dht.peer_id), clock=int(stats.clock), loss=stats.loss_ema or -1.0)


def _on_loop(peer: SwarmPeer, coro, timeout_s: float = WAIT_S):
    return asyncio.run_coroutine_threadsafe(coro, peer._loop).result(timeout_s)


def _params(peer_or_worker) -> dict[str, torch.Tensor]:
    worker = getattr(peer_or_worker, "worker", peer_or_worker)
    return worker.state_snapshot()


def _set_params(worker: StageWorker, params: dict[str, torch.Tensor]) -> None:
    worker.restore(WorkerState(params=params, optimizer=None, clock=worker.stats.clock,
                               loss_ema=worker.stats.loss_ema, param_version=0))


def _distance(a: dict, b: dict) -> float:
    return sum(float((a[k] - b[k]).pow(2).sum()) for k in a) ** 0.5


class FakeWorker:
    """Serves whatever tensors a test wants, claiming whatever state it wants."""

    def __init__(self, params: dict[str, torch.Tensor], clock: float = 100.0, loss: float = 0.01):
        self.params, self.clock, self.loss = params, clock, loss

    def capture(self, include_optimizer: bool = False) -> WorkerState:
        return WorkerState(params=dict(self.params), optimizer={} if include_optimizer else None, clock=self.clock,
                           loss_ema=self.loss, param_version=1)


@pytest.fixture(scope="module")
def net():
    """A DHT for the tests' own client plus helpers that start peers on it; all torn down at the end."""
    dhts, peers = [], []
    first = start_dht(DHTSettings(), [])
    dhts.append(first)
    maddrs = [str(m) for m in first.get_visible_maddrs()]

    def new_dht():
        dht = start_dht(DHTSettings(initial_peers=maddrs), [])
        dhts.append(dht)
        return dht

    def new_peer(swarm: str = "layer1", run: RunConfig = RUN, sync_from=None) -> SwarmPeer:
        peer = SwarmPeer(run, new_dht(), swarm, evaluate=False, notify=lambda *event: peer.events.append(event))
        peer.events = []
        peer.start(sync_from=sync_from)
        peers.append(peer)
        return peer

    def serve_fake(worker: FakeWorker) -> str:
        """A layer1 peer whose parameter service serves the fake worker's tensors instead of its own."""
        peer = new_peer()
        peer._params_servicer.worker = worker
        return str(peer.dht.peer_id)

    try:
        yield new_peer, serve_fake
    finally:
        for peer in peers:
            peer.stop()
        for dht in dhts:
            shutdown_dht(dht)


@pytest.fixture(scope="module")
def pair(net):
    new_peer, _ = net
    a, b = new_peer(), new_peer()
    return a, b


def _fetch(peer: SwarmPeer, target: str, **kwargs):
    return _on_loop(peer, fetch_params(peer.p2p, target, RUN, "layer1", timeout_s=10, **kwargs))


def test_parameter_service_serves_a_consistent_copy_with_its_state(pair):
    a, b = pair
    b.worker.forward_backward("warm", torch.randn(8, 32), torch.arange(8))
    state, meta = _fetch(a, str(b.dht.peer_id))
    expected = _params(b)
    assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state)
    assert meta["clock"] == 8 and meta["param_version"] == b.worker.stats.param_version
    assert meta["loss"] == pytest.approx(b.worker.stats.loss_ema)
    half, half_meta = _fetch(a, str(b.dht.peer_id), wire_dtype="float16")
    assert half_meta["bytes"] == meta["bytes"] // 2, "float16 on the wire halves the bytes"
    assert all(torch.allclose(half[k], expected[k], atol=1e-2) for k in state)
    _, full_meta = _fetch(a, str(b.dht.peer_id), wire_dtype="float16", with_optimizer=True)
    optimizer = full_meta["optimizer_state"]
    assert {name.rsplit("/", 1)[1] for name in optimizer} == {"step", "exp_avg", "exp_avg_sq"}
    assert all(t.dtype == torch.float32 for t in optimizer.values()), "optimizer state always travels as float32"
    with pytest.raises(Exception, match="protocols not supported"):  # b serves layer1 only
        _on_loop(a, fetch_params(a.p2p, str(b.dht.peer_id), RUN, "layer0", timeout_s=10))


def test_constant_half_between_two_idle_peers_gives_the_mean(pair):
    a, b = pair
    torch.manual_seed(1)
    # honest copies are close (a few % of the norm apart); far ones are clipped (test_averaging_poison.py)
    _set_params(b.worker, {k: v + torch.randn_like(v) * 0.002 for k, v in _params(a).items()})
    before_a, before_b = _params(a), _params(b)
    a.averaging.cfg = RUN.averaging
    a.averaging.set_records([_record_of(a), _record_of(b)])
    assert _on_loop(a, a.averaging.pull_once())
    after = _params(a)
    for name in after:
        assert torch.allclose(after[name], (before_a[name] + before_b[name]) / 2, atol=1e-6), name
    assert any(kind == "averaged" and "at f=0.50" in text for _, kind, text in a.events)


def test_clock_1_against_3_moves_three_quarters_and_merges_the_clock_to_2_5(pair):
    a, b = pair
    a.worker.stats.clock, b.worker.stats.clock = 1.0, 3.0
    before_a, before_b = _params(a), _params(b)
    a.averaging.cfg = RUN.averaging.model_copy(update={"interpolation": "clock"})
    a.averaging.set_records([_record_of(a), _record_of(b)])
    try:
        assert _on_loop(a, a.averaging.pull_once())
    finally:
        a.averaging.cfg = RUN.averaging
    assert a.averaging.stats.last_factor == pytest.approx(0.75)
    assert a.worker.stats.clock == pytest.approx(2.5)
    after = _params(a)
    for name in after:
        assert torch.allclose(after[name], 0.25 * before_a[name] + 0.75 * before_b[name], atol=1e-6), name


@pytest.mark.parametrize("poison", ["nan", "shape"])
def test_nan_and_wrong_shape_parameters_are_rejected_and_their_server_banned(net, pair, poison):
    _, serve_fake = net
    a, _ = pair
    params = _params(a)
    name = next(iter(params))
    if poison == "nan":
        params[name] = torch.full_like(params[name], float("nan"))
    else:
        params[name] = torch.zeros(params[name].shape[0] + 1, *params[name].shape[1:])
    liar = serve_fake(FakeWorker(params))
    before = _params(a)
    a.averaging.set_records([_record_of(a), _record(liar, loss=0.01, clock=10**6)])
    assert not _on_loop(a, a.averaging.pull_once())
    assert all(torch.equal(before[k], v) for k, v in _params(a).items()), "nothing of it was applied"
    reason = "NaN" if poison == "nan" else "shape"
    assert any(kind == "rejected" and liar[-8:] in text and reason in text for _, kind, text in a.events)
    pulls = a.averaging.stats.pulls
    assert not _on_loop(a, a.averaging.pull_once()), "banned: no second pull"
    assert a.averaging.stats.pulls == pulls


def test_fetch_probability_zero_sends_no_pull_and_one_pulls(pair):
    a, b = pair
    a.averaging.set_records([_record_of(a), _record_of(b)])
    served, pulls, averaged = b._params_servicer.served, a.averaging.stats.pulls, a.averaging.stats.averaged

    def train(steps: int) -> None:
        for i in range(steps):
            a.executor.submit(a.worker.forward_backward, f"p{i}", torch.randn(8, 32), torch.arange(8)).result(10)

    train(30)
    time.sleep(0.5)
    assert a.averaging.stats.pulls == pulls and b._params_servicer.served == served
    a.averaging.cfg = RUN.averaging.model_copy(update={"fetch_probability": 1.0})
    try:
        train(5)
        deadline = time.monotonic() + 10
        while a.averaging.stats.averaged == averaged and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        a.averaging.cfg = RUN.averaging
    assert a.averaging.stats.averaged > averaged and b._params_servicer.served > served


def test_newcomer_downloads_the_layer_and_optimizer_before_its_first_micro_batch(net, monkeypatch):
    new_peer, _ = net
    first_forward: dict[int, dict[str, torch.Tensor]] = {}
    first_optimizer: dict[int, dict[str, torch.Tensor]] = {}
    original = StageWorker.forward

    def spy(self, mb_id, x):
        if id(self) not in first_forward:
            first_forward[id(self)] = self.state_snapshot()
            first_optimizer[id(self)] = optimizer_tensors(self.module, self.optimizer)
        return original(self, mb_id, x)

    monkeypatch.setattr(StageWorker, "forward", spy)
    donor = new_peer("layer0")  # its driver waits for layer1 peers; its weights we set by hand
    torch.manual_seed(2)
    trained = {k: v + torch.randn_like(v) * 0.05 for k, v in _params(donor).items()}
    _set_params(donor.worker, trained)
    with donor.worker.lock:  # one update so that the optimizer has state to share (then our weights again)
        donor.worker.forward("opt", torch.randn(8, 64))
        donor.worker.backward("opt", torch.randn(8, 32), None, 1.0)
        _set_params(donor.worker, trained)
        donor_optimizer = optimizer_tensors(donor.worker.module, donor.worker.optimizer)
    donor.worker.stats.clock = 4321.0  # set after the update, which counted 8 samples
    donor.worker.stats.loss_ema = 0.42
    newcomer = new_peer("layer0", sync_from=[_record_of(donor), _record("offline-one", state="offline")])
    deadline = time.monotonic() + 10
    while id(newcomer.worker) not in first_forward and time.monotonic() < deadline:
        time.sleep(0.05)
    seen = first_forward[id(newcomer.worker)]
    assert _distance(seen, trained) < 1e-6 < _distance(seen, StageWorker(RUN, 0).state_snapshot())
    assert newcomer.worker.stats.clock == 4321.0 and newcomer.worker.stats.loss_ema == pytest.approx(0.42)
    assert donor_optimizer and all(torch.equal(first_optimizer[id(newcomer.worker)][k], v)
                                   for k, v in donor_optimizer.items())
    assert any(kind == "synced" and str(donor.dht.peer_id)[-8:] in text for _, kind, text in newcomer.events)


def test_newcomer_of_an_empty_swarm_keeps_the_seeded_weights(net):
    new_peer, _ = net
    alone = new_peer("layer1", sync_from=[])
    assert _distance(_params(alone), StageWorker(RUN, 1).state_snapshot()) == 0.0
    assert any(kind == "synced" and "seeded initial weights" in text for _, kind, text in alone.events)
