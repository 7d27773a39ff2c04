"""Stage 0's outputs spot-checked by replication, with real peers over P2P (swarm/pipeline/control/stage0_checks.py).

Real SwarmPeers (each with its own DHT process and p2pd) in one test process, so their books can be read: two or
three honest layer0 drivers that train, one layer1 and one layer2 peer, and (first test) a hostile driver from
tests/hostile.py that signs made-up stage-0 outputs as its own. The layer1 peer has other layer0 peers recompute
the outputs it is sent: the hostile driver's micro-batches are refused (``spot_check``) and it is struck until
banned, while no honest driver is struck; with label-skewed shards and honest drivers only, nobody is."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import psutil
import torch

from hostile import HostilePeer
from swarm.dht.dht import DHTSettings, shutdown_dht, start_dht
from swarm.dht.records import MemberRecord
from swarm.pipeline.peer import SwarmPeer
from swarm.pipeline.stage.worker import StageWorker
from swarm.run.data import load_dataset, make_shards
from swarm.run.runconfig import RunConfig

BASE = {"model": {"stages": 3, "hidden_dim": 32}, "training": {"batch_size": 8, "in_flight": 1},
        "timeouts": {"rpc_s": 10}}
RUN = RunConfig.model_validate({"name": "spot0", **BASE})
SKEWED = RunConfig.model_validate({"name": "spot0-skewed", **BASE,
                                   "data": {"partition": "label_skewed", "classes_per_shard": 2}})
CHECK_BUDGET_S = 2.0  # a loaded 2-core machine runs six p2pd and three copies here: more than the default's 0.5 s
HOSTILE_MICROBATCHES = 24
HONEST_WINDOW_S = 12.0  # at most: the window ends once HONEST_CHECKS honest micro-batches were checked
HONEST_CHECKS = 300  # ~4 s on an idle 2-core machine (868 in the 12 s), 15x the 20 the test asks for at least
DRIFT = 0.6  # relative noise on the honest copies: a median row cosine of ~0.88 between two of them
PENALTY_LINES = ("refused a micro-batch of driver {}", "banned peer {}", "layer0 peer {}: spot check")


class Swarm:
    """The peers of one test, started on loopback and always stopped (``close``)."""

    def __init__(self, run: RunConfig):
        self.run = run
        self.dhts: list = []
        self.peers: list[SwarmPeer] = []
        self.first = self._dht([])
        self.maddrs = [str(m) for m in self.first.get_visible_maddrs()]

    def _dht(self, initial: list[str]):
        dht = start_dht(DHTSettings(initial_peers=initial), [])
        self.dhts.append(dht)
        return dht

    def join(self, swarm: str, shard: int | None = None) -> SwarmPeer:
        peer = SwarmPeer(self.run, self._dht(self.maddrs), swarm, shard=shard, evaluate=False)
        self.peers.append(peer)
        return peer

    def start(self, extra_drivers: list[MemberRecord] = ()) -> None:
        """Start every peer, then give each the views a node's heartbeat would."""
        for peer in self.peers:
            peer.start()
        views: dict[str, list[MemberRecord]] = {"layer0": list(extra_drivers), "layer1": [], "layer2": []}
        for peer in self.peers:
            views[peer.swarm].append(_record(str(peer.dht.peer_id), peer.shard))
        for peer in self.peers:
            peer.update_views(views)

    def close(self) -> None:
        for peer in self.peers:
            peer.stop()
        for dht in self.dhts:
            shutdown_dht(dht)


def _record(peer_id: str, shard: int | None) -> MemberRecord:
    now = time.time()
    return MemberRecord(peer_id, "online", "test", now, now, shard=-1 if shard is None else shard)


def _check_every_forward(layer1: SwarmPeer, drivers: list[SwarmPeer]) -> None:
    checker = layer1._servicer.spot0
    checker.share, checker.budget_s = 1.0, CHECK_BUDGET_S
    for driver in drivers:  # every forward checked is more than a driver's door lets a caller ask by default
        door = driver._servicer.replicas.door
        door.rate_per_s, door.burst, door.per_peer, door.total = 1000.0, 1000.0, 8, 8


def _drift_apart(drivers: list[SwarmPeer], relative: float = DRIFT) -> float:
    """Move each driver's stage-0 copy apart as training on label-skewed shards does (a 12 s run barely moves
    them): noise of ``relative`` x each tensor's mean magnitude. Returns the median row cosine of two copies'
    outputs on the same inputs (measured for skewed copies trained apart for 300 steps: 0.88)."""
    for seed, driver in enumerate(drivers):
        g = torch.Generator().manual_seed(seed)
        with driver.worker.lock, torch.no_grad():
            for p in driver.worker.module.parameters():
                p.add_(torch.randn(p.shape, generator=g) * relative * p.abs().mean())
    x = load_dataset(SKEWED.data, SKEWED.model).x_train[:256]
    with torch.no_grad():
        a, b = drivers[0].worker.module(x), drivers[1].worker.module(x)
    return float(torch.nn.functional.cosine_similarity(a, b, dim=1).median())


def _penalties(caplog, peer_ids: list[str]) -> list[str]:
    """Log lines that penalise one of ``peer_ids`` (a refusal of its micro-batch, a ban, a replica found lying)."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
            and any(line.format(p[-8:]) in r.getMessage() for line in PENALTY_LINES for p in peer_ids)]


def _children() -> set[int]:
    return {c.pid for c in psutil.Process().children(recursive=True)}


def _left_behind(before: set[int]) -> list[str]:
    """Processes started during the test that outlive it (torch's shared-memory manager lives as long as the
    pytest process that started it, whichever test that was: not ours to reap)."""
    deadline = time.monotonic() + 10.0
    while True:
        left = []
        for child in psutil.Process().children(recursive=True):
            try:
                if child.pid not in before and child.status() != psutil.STATUS_ZOMBIE \
                        and child.name() != "torch_shm_manager":
                    left.append(f"{child.pid} {child.name()}")
            except psutil.NoSuchProcess:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def test_a_driver_that_makes_up_its_stage0_outputs_is_refused_and_banned(tmp_path: Path, caplog):
    caplog.set_level(logging.WARNING)
    before = _children()
    swarm = Swarm(RUN)
    hostile = None
    try:
        honest = [swarm.join("layer0", shard=0), swarm.join("layer0", shard=1)]
        layer1, layer2 = swarm.join("layer1"), swarm.join("layer2")
        hostile = HostilePeer(RUN, swarm.maddrs, tmp_path / "hostile.key")
        swarm.start(extra_drivers=[_record(hostile.peer_id, 2)])
        hostile_id = hostile.peer_id
        _check_every_forward(layer1, honest)
        # the honest drivers are established here first (a verdict strikes only when both accusers have more
        # corroborated work at this layer1 peer than the accused): in a loaded suite their first micro-batches came
        # late and the liar was refused ~20 times without a strike before the first one counted
        honest_ids = [str(d.dht.peer_id) for d in honest]
        credit = layer1._servicer.spot0.credit
        deadline = time.monotonic() + 60.0
        while min(credit.get(p, 0) for p in honest_ids) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert min(credit.get(p, 0) for p in honest_ids) >= 2, (credit, [d.driver.stats for d in honest])
        trained_before = [d.driver.stats.trained for d in honest]

        dataset = load_dataset(RUN.data, RUN.model)
        shard = make_shards(dataset.y_train, RUN.data, dataset.num_classes)[2]
        stage0 = StageWorker(RUN, 0).module
        l1, l2 = str(layer1.dht.peer_id), str(layer2.dht.peer_id)
        codes = []
        started = time.monotonic()
        for i in range(HOSTILE_MICROBATCHES):
            ids = torch.as_tensor(shard[i * 8:(i + 1) * 8], dtype=torch.int64)
            reply = hostile.train_made_up(("scaled_x10", "random")[i % 2], stage0, dataset.x_train[ids], ids, l1, l2)
            codes.append(reply.code if not reply.ok else "ok")
        hostile_s = time.monotonic() - started

        counts = layer1._servicer.spot0.stats()
        # every micro-batch is checked here: refused until two verdicts (5 strikes each) ban it, refused from then on
        assert codes.count("spot_check") >= 2 and codes.count("ok") <= 2, (codes, counts)
        assert codes[-HOSTILE_MICROBATCHES // 2:] == ["banned"] * (HOSTILE_MICROBATCHES // 2), codes
        assert hostile.peer_id in {ban.requester for ban in layer1.gate.book.bans}
        assert hostile_s < 120, hostile_s
        assert not _penalties(caplog, honest_ids), _penalties(caplog, honest_ids)
        assert not any(layer1.gate.book.banned(p, time.monotonic()) for p in honest_ids)
        assert counts["caught"] >= 2 and counts["replica_caught"] == 0, counts
        time.sleep(2.0)
        assert all(d.driver.stats.trained > before for d, before in zip(honest, trained_before)), \
            "the honest drivers kept training"
        # what the checks cost the drivers that recomputed: replicas served and seconds of their compute thread
        cost = {str(d.dht.peer_id)[-8:]: d._servicer.replicas.door.stats() for d in honest}
        print("hostile replies:", codes, "stage-0 spot checks at layer1:", counts, "replicas served by the drivers:", cost)
    finally:
        if hostile is not None:
            hostile.close()
        swarm.close()
    assert not _left_behind(before)
    assert _penalties(caplog, [hostile_id]), "the matcher sees the hostile driver's penalties"


def test_honest_drivers_on_label_skewed_shards_are_never_struck(caplog):
    caplog.set_level(logging.WARNING)
    before = _children()
    swarm = Swarm(SKEWED)
    try:
        honest = [swarm.join("layer0", shard=s) for s in range(3)]
        layer1 = swarm.join("layer1")
        swarm.join("layer2")
        swarm.start()
        cosine = _drift_apart(honest)
        assert 0.8 < cosine < 0.92, cosine  # they disagree at 0.9 now and then, and are never far
        _check_every_forward(layer1, honest)
        deadline = time.monotonic() + HONEST_WINDOW_S
        while time.monotonic() < deadline and layer1._servicer.spot0.stats()["checked"] < HONEST_CHECKS:
            time.sleep(0.5)
        counts = layer1._servicer.spot0.stats()
        honest_ids = [str(d.dht.peer_id) for d in honest]
        assert counts["checked"] >= 20, counts
        assert counts["caught"] == 0 and counts["replica_caught"] == 0, counts
        shown = layer1.metrics()  # what its node shows (`volunteer ctl status`, the dashboard's "checks" row)
        assert shown.spot_checked >= counts["checked"] and shown.spot_caught == 0, shown
        assert counts["undecided"] > 0, counts  # the copies did disagree, and that blamed nobody
        assert not _penalties(caplog, honest_ids), _penalties(caplog, honest_ids)
        assert not layer1.gate.book.bans
        assert all(d.driver.stats.trained > 0 and d.driver.stats.refused == 0 for d in honest)
        print(f"stage-0 spot checks at layer1 (skewed, honest, row cosine {cosine:.2f}):", counts)
    finally:
        swarm.close()
    assert not _left_behind(before)
