"""Healing's snapshots in files (swarm/integrity/snapshots.py, issue 42): what a node keeps on disk instead of in RAM,
and what happens when the disk says no."""

from __future__ import annotations

import shutil
import subprocess
import sys

import torch

from swarm.integrity.heal import Healer
from swarm.integrity.snapshots import SnapshotStore
from swarm.pipeline.stage.worker import StageWorker
from swarm.run.runconfig import RunConfig


def _worker() -> StageWorker:
    run = RunConfig(name="snapshots", model={"stages": 2, "hidden_dim": 16}, optimizer={"name": "adam", "lr": 1e-3})
    worker = StageWorker(run, 0)
    x = torch.randn(8, 64)
    for i in range(3):  # Adam's moments exist
        worker.forward(f"m{i}", x)
        worker.backward(f"m{i}", 1e-3 * torch.randn(8, 16), None, None)
    return worker


def _poison(worker: StageWorker) -> None:
    with torch.no_grad():
        for p in worker.module.parameters():
            p.fill_(float("nan"))


def test_a_snapshot_in_a_file_holds_no_memory_and_heals_the_copy_with_its_moments(tmp_path):
    worker = _worker()
    healer = Healer(worker, notify=lambda *a: None, store=SnapshotStore(tmp_path))
    want = {k: v.bfloat16().float() for k, v in worker.module.state_dict().items()}
    moments = {id(p): s["exp_avg"].bfloat16().float() for p, s in worker.optimizer.state.items()}
    healer.take_snapshot()
    healer.store.settle()
    assert healer._snapshot.tensors() == [] and healer._snapshot.path.is_file()
    assert not list(healer.store.directory.glob("*.partial")), "a file that exists is whole"
    _poison(worker)
    worker.health.mark_sick("test")
    healer.heal()
    assert all(torch.equal(t, want[k]) for k, t in worker.module.state_dict().items())
    assert all(torch.equal(s["exp_avg"], moments[id(p)]) for p, s in worker.optimizer.state.items())
    healer.close()
    assert not healer.store.directory.exists()


def test_a_snapshot_that_cannot_be_written_stays_in_memory_and_the_user_is_told_once(tmp_path):
    said = []
    worker = _worker()
    store = SnapshotStore(tmp_path, notify=lambda level, kind, text: said.append((level, kind, text)))
    healer = Healer(worker, notify=lambda *a: None, store=store)
    shutil.rmtree(store.directory)  # the folder is gone under us (a disk that fails, a user cleaning up)
    healer.take_snapshot()
    healer.take_snapshot()
    store.settle()
    assert healer._snapshot.tensors(), "kept in memory: a heal never lacks its snapshot"
    assert store.failed == 2 and len(said) == 1 and said[0][:2] == ("warning", "snapshots")
    assert "kept in memory instead of on disk" in said[0][2]
    want = {k: v.bfloat16().float() for k, v in worker.module.state_dict().items()}
    _poison(worker)
    worker.health.mark_sick("test")
    healer.heal()
    assert all(torch.equal(t, want[k]) for k, t in worker.module.state_dict().items())
    healer.close()
    # a folder that cannot be made at all (a data dir that is a file, read-only, gone): said, and kept in memory
    (tmp_path / "a-file").write_text("")
    said.clear()
    store = SnapshotStore(tmp_path / "a-file" / "runs", notify=lambda level, kind, text: said.append(text))
    assert not store.on_disk and store.failed == 1 and "cannot make a folder" in said[0]
    assert store.keep(worker.capture(include_optimizer=True)).tensors()


def test_snapshots_given_up_leave_no_file_and_a_killed_nodes_folder_is_cleaned_up_by_the_next(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = tmp_path / f"heal-{dead.pid}-0"  # what a node killed with SIGKILL leaves
    left.mkdir()
    (left / "snapshot-3.pt").write_bytes(b"x" * 1000)
    store = SnapshotStore(tmp_path)
    assert not left.exists() and store.directory.parent == tmp_path
    worker = _worker()
    healer = Healer(worker, notify=lambda *a: None, store=store)
    for _ in range(5):
        healer.take_snapshot()  # each new one replaces the one before the last
    store.drop(store.keep(worker.capture(include_optimizer=True)))  # dropped before (or while) it is written
    store.settle()
    names = sorted(f.name for f in store.directory.iterdir())
    assert names == sorted([healer._snapshot.path.name, healer._previous.path.name])
    healer.close()
    assert list(tmp_path.iterdir()) == []


def test_a_snapshot_file_removed_under_the_node_heals_from_the_one_before(tmp_path):
    worker = _worker()
    healer = Healer(worker, notify=lambda *a: None, store=SnapshotStore(tmp_path))
    before = {k: v.bfloat16().float() for k, v in worker.module.state_dict().items()}
    healer.take_snapshot()
    with torch.no_grad():
        worker.module[0].weight.add_(1.0)
    healer.take_snapshot()
    healer.store.settle()
    healer._snapshot.path.unlink()  # a user cleaning up the data dir of a running node
    _poison(worker)
    worker.health.mark_sick("test")
    healer.heal()
    assert all(torch.equal(t, before[k]) for k, t in worker.module.state_dict().items())
    assert not worker.optimizer.state, "the one before is restored without its moments"
    healer.close()

