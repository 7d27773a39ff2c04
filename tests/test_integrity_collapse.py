"""A stage-0 copy whose outputs stop depending on its inputs (every ReLU dead) is sick, on the node's own data only.

Found by running an untuned config (SGD lr 0.1, momentum 0.95, 6 in flight) in `volunteer demo`: layer0's
first ReLU died within 10 000 samples, the run sat at chance for 75 s and nothing noticed.
"""

from __future__ import annotations

import pytest
import torch

from swarm.integrity.heal import RESTORES_BEFORE_FALLBACK, Healer
from swarm.integrity.snapshots import SnapshotStore
from swarm.integrity.health import DEAD_FORWARDS, HealthMonitor, SickCopy, batch_spread, live_share, outputs_collapsed
from swarm.run.runconfig import IntegrityConfig, RunConfig
from swarm.pipeline.stage.worker import StageWorker


def _run() -> RunConfig:
    return RunConfig(name="collapse", model={"stages": 2, "hidden_dim": 16},
                     optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9})


def _kill(worker: StageWorker) -> None:
    """What one step too large does: the first layer's bias far below zero, so its ReLU outputs 0 for any input."""
    with torch.no_grad():
        worker.module[0].bias.fill_(-1e4)


def test_the_collapse_rule():
    assert live_share(torch.zeros(8, 4)) == 0.0 and live_share(torch.ones(1, 4)) == 0.0
    mostly_dead = torch.zeros(8, 50)
    mostly_dead[:, 0] = torch.arange(8.0)  # one unit of 50 still answers: what the demo's layer0 looked like
    assert live_share(mostly_dead) == pytest.approx(0.02) and live_share(torch.randn(8, 50)) == 1.0
    assert live_share(torch.full((8, 4), 1.0) + 1e-9 * torch.randn(8, 4)) == 0.0, "float noise is not variation"
    assert outputs_collapsed(0.0, 1.0, None), "rows that differ going in and are equal coming out"
    assert not outputs_collapsed(0.02, 1.0, None), "before a healthy share is known, only no live unit counts"
    assert outputs_collapsed(0.02, 1.0, 0.9) and not outputs_collapsed(0.3, 1.0, 0.9)
    assert not outputs_collapsed(0.0, 0.0, 1.0), "identical inputs give no verdict"


def test_collapsed_forwards_in_a_row_make_the_copy_sick_and_one_is_not_enough():
    monitor = HealthMonitor(IntegrityConfig())
    for _ in range(5):
        monitor.observe_live(live=0.9, in_spread=1.0)
    for _ in range(DEAD_FORWARDS - 1):
        monitor.observe_live(live=0.0, in_spread=1.0)
    monitor.observe_live(live=0.8, in_spread=1.0)  # a healthy batch in between resets the count
    for _ in range(DEAD_FORWARDS - 1):
        monitor.observe_live(live=0.02, in_spread=1.0)
    assert not monitor.sick
    monitor.observe_live(live=0.02, in_spread=1.0, features=48)
    assert monitor.sick and "collapsed: 2% of 48" in monitor.sick_reason


def test_a_dead_layer0_refuses_work_on_its_own_data_and_heals_alive():
    worker = StageWorker(_run(), 0)
    healer = Healer(worker, notify=lambda *a: None)
    x = torch.randn(32, 64)
    worker.forward("mb-0", x)  # a healthy forward of our own data: the probe and the healthy spread
    healer.take_snapshot()
    _kill(worker)
    for k in range(DEAD_FORWARDS - 1):
        worker.forward(f"mb-{k + 1}", x)
    with pytest.raises(SickCopy, match="collapsed"):
        worker.forward("mb-9", x)
    assert healer.status().healing
    healer.heal()
    assert not worker.health.sick and batch_spread(worker.forward("mb-10", x)) > 0
    assert worker.optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * 0.3)


def test_a_strangers_inputs_never_make_the_copy_sick():
    """Only our own driver's forwards (no owner) count: a stranger could pick inputs a healthy copy maps to one row."""
    worker = StageWorker(_run(), 0)
    _kill(worker)
    for k in range(2 * DEAD_FORWARDS):
        worker.forward(f"mb-{k}", torch.randn(8, 64), owner="stranger")
    assert not worker.health.sick


def test_a_dead_copy_is_never_kept_as_the_last_good_one():
    """The update that kills the copy can come right before a snapshot: the snapshot is checked on our last batch."""
    worker = StageWorker(_run(), 0)
    healer = Healer(worker, notify=lambda *a: None)
    x = torch.randn(32, 64)
    worker.forward("mb-0", x)
    healer.take_snapshot()
    _kill(worker)
    healer.take_snapshot()
    assert worker.health.sick and "collapsed" in worker.health.sick_reason
    healer.heal()
    assert batch_spread(worker.forward("mb-1", x)) > 0, "healed into the copy from before the collapse"


def _healer(worker: StageWorker, where: str, folder) -> Healer:
    """Snapshots in memory (a stage built in-process) or in files (a node's: swarm/integrity/snapshots.py)."""
    return Healer(worker, notify=lambda *a: None, store=SnapshotStore(folder if where == "disk" else None))


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_a_snapshot_that_keeps_getting_sick_gives_way_to_the_one_before(where, tmp_path):
    worker = StageWorker(_run(), 0)
    healer = _healer(worker, where, tmp_path)
    start = {k: v.bfloat16().float() for k, v in worker.module.state_dict().items()}  # snapshots keep bfloat16
    healer.take_snapshot()  # the starting copy
    with torch.no_grad():
        worker.module[0].weight.add_(1.0)
    healer.take_snapshot()  # a later one, that turns out to collapse whenever training resumes from it
    for _ in range(RESTORES_BEFORE_FALLBACK):
        worker.health.mark_sick("test")
        healer.heal()
        assert not torch.equal(worker.module[0].weight, start["0.weight"])
    worker.health.mark_sick("test")
    healer.heal()
    assert all(torch.equal(t, start[k]) for k, t in worker.module.state_dict().items())
    # the one before is kept as weights only (4 bytes a parameter less with Adam): its optimizer starts afresh
    assert not worker.optimizer.state
    healer.store.settle()
    if where == "disk":  # the snapshot given up on is deleted; the one restored stays
        assert [f.name for f in healer.store.directory.iterdir()] == [healer._snapshot.path.name]


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_the_snapshot_before_the_last_keeps_weights_only(where, tmp_path):
    worker = StageWorker(_run(), 0)
    healer = _healer(worker, where, tmp_path)
    x = torch.randn(8, 64)
    for i in range(3):  # momentum buffers exist
        worker.forward(f"m{i}", x)
        worker.backward(f"m{i}", 1e-3 * torch.randn(8, 16), None, None)
    healer.take_snapshot()
    healer.take_snapshot()
    healer.store.settle()
    assert healer._snapshot.optimizer and not healer._previous.optimizer
    previous = healer.store.load(healer._previous)
    assert set(previous.params) == set(worker.module.state_dict()) and previous.optimizer is None
    # in memory, only its weights are held; on disk, nothing is
    held = len(healer._previous.tensors())
    assert held == (len(previous.params) if where == "memory" else 0)



def test_a_trained_copy_is_never_reset_to_its_seeded_weights():
    """Measured: a stage that healed 33 times ended on "clock 0", its seeded weights, for good."""
    worker = StageWorker(_run(), 0)
    healer = Healer(worker, notify=lambda *a: None)
    healer.take_snapshot()  # the seeded copy, clock 0
    with torch.no_grad():
        worker.module[0].weight.add_(1.0)
    worker.stats.clock = 5000.0  # it trained
    healer.take_snapshot()
    trained = worker.module[0].weight.detach().bfloat16().float()  # as the snapshot keeps it
    for _ in range(RESTORES_BEFORE_FALLBACK + 3):
        worker.health.mark_sick("test")
        healer.heal()
        assert torch.equal(worker.module[0].weight, trained) and worker.stats.clock == 5000.0
