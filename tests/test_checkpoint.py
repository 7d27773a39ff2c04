"""Checkpoints: a real stage worker saved and restored, atomic writes, damaged files, the resume decision."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from swarm.dht.records import MemberRecord
from swarm.run.runconfig import RunConfig
from swarm.pipeline.stage.worker import StageWorker
from volunteer import checkpoint
from volunteer.checkpoint import (
    AHEAD_MIN_SAMPLES,
    CheckpointError,
    Checkpointer,
    capture,
    claim_slot,
    plan_resume,
    prepare_resume,
    read,
    restore,
    write_atomic,
)

RUN = RunConfig(name="ckpt", model={"stages": 2, "hidden_dim": 16}, optimizer={"name": "adam", "lr": 0.01})


def trained_worker(steps: int = 3) -> StageWorker:
    worker = StageWorker(RUN, 1, "cpu")
    for step in range(steps):
        x = torch.randn(8, RUN.model.hidden_dim)
        y = torch.randint(0, RUN.model.num_classes, (8,))
        worker.forward_backward(f"mb{step}", x, y)
    return worker


def params(worker: StageWorker) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in worker.module.state_dict().items()}


def record(peer_id: str, clock: float, state: str = "online") -> MemberRecord:
    return MemberRecord(peer_id=peer_id, state=state, version="0", started_at=0.0, updated_at=0.0, clock=int(clock))


def test_a_saved_worker_comes_back_with_weights_optimizer_clock_and_loss(tmp_path):
    worker = trained_worker()
    path = tmp_path / "checkpoint.ckpt"
    write_atomic(path, capture(worker, RUN.run_id, "layer1"))

    fresh = StageWorker(RUN, 1, "cpu")
    restore(fresh, read(path, RUN.run_id, "layer1"))
    for name, tensor in params(worker).items():
        assert torch.equal(fresh.module.state_dict()[name], tensor), name
    assert fresh.stats.clock == worker.stats.clock == 24
    assert fresh.stats.param_version == worker.stats.param_version == 3
    assert fresh.stats.loss_ema == pytest.approx(worker.stats.loss_ema)
    # Adam's moments came back too: one more identical step gives identical weights.
    x, y = torch.randn(8, RUN.model.hidden_dim), torch.randint(0, 10, (8,))
    worker.forward_backward("next", x, y)
    fresh.forward_backward("next", x, y)
    for name, tensor in params(worker).items():
        assert torch.allclose(fresh.module.state_dict()[name], tensor), name


def test_a_capture_is_a_copy_later_steps_do_not_change_it(tmp_path):
    worker = trained_worker(1)
    state = capture(worker, RUN.run_id, "layer1")
    before = {name: tensor.clone() for name, tensor in state.module.items()}
    worker.forward_backward("later", torch.randn(8, RUN.model.hidden_dim), torch.randint(0, 10, (8,)))
    assert all(torch.equal(state.module[name], tensor) for name, tensor in before.items())
    assert state.clock == 8


def test_a_failed_write_keeps_the_previous_checkpoint_and_leaves_no_scratch_file(tmp_path, monkeypatch):
    worker = trained_worker(1)
    path = tmp_path / "checkpoint.ckpt"
    write_atomic(path, capture(worker, RUN.run_id, "layer1"))
    worker.forward_backward("more", torch.randn(8, RUN.model.hidden_dim), torch.randint(0, 10, (8,)))

    def crash(*args):
        raise OSError("disk pulled out")

    monkeypatch.setattr(checkpoint.os, "replace", crash)
    with pytest.raises(OSError):
        write_atomic(path, capture(worker, RUN.run_id, "layer1"))
    assert read(path, RUN.run_id, "layer1").clock == 8  # the old one, whole
    assert os.listdir(tmp_path) == ["checkpoint.ckpt"]


def test_a_damaged_or_foreign_checkpoint_is_refused_with_a_reason(tmp_path):
    path = tmp_path / "checkpoint.ckpt"
    write_atomic(path, capture(trained_worker(1), RUN.run_id, "layer1"))
    with pytest.raises(CheckpointError, match="belongs to"):
        read(path, RUN.run_id, "layer0")
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="damaged"):
        read(path, RUN.run_id, "layer1")


def test_a_checkpoint_of_another_shape_leaves_the_worker_untouched(tmp_path):
    other_run = RunConfig(name="ckpt", model={"stages": 2, "hidden_dim": 8})
    state = capture(StageWorker(other_run, 1, "cpu"), RUN.run_id, "layer1")
    worker = trained_worker(1)
    before = params(worker)
    with pytest.raises(CheckpointError, match="does not fit"):
        restore(worker, state)
    assert all(torch.equal(worker.module.state_dict()[name], tensor) for name, tensor in before.items())
    assert worker.stats.clock == 8


def test_resume_from_the_checkpoint_unless_the_swarm_moved_well_past_it():
    me = "QmMe"
    # alone (our own stale record from before the crash does not count)
    assert plan_resume(1000, [record(me, 1000)], me, can_sync=True).use_checkpoint
    # others near us
    assert plan_resume(1000, [record("QmA", 1000 + AHEAD_MIN_SAMPLES)], me, can_sync=True).use_checkpoint
    # others far ahead: take the layer from them
    far = [record("QmA", 10 * AHEAD_MIN_SAMPLES)]
    plan = plan_resume(1000, far, me, can_sync=True)
    assert not plan.use_checkpoint and "downloading the layer from peers" in plan.reason
    # ...unless we cannot download: an old checkpoint still beats the initial weights
    plan = plan_resume(1000, far, me, can_sync=False)
    assert plan.use_checkpoint and "not available" in plan.reason
    # offline peers say nothing about the swarm now
    assert plan_resume(1000, [record("QmA", 10 * AHEAD_MIN_SAMPLES, "offline")], me, can_sync=True).use_checkpoint


def test_prepare_resume_moves_an_outrun_or_damaged_checkpoint_aside(tmp_path):
    path = tmp_path / "checkpoint.ckpt"
    write_atomic(path, capture(trained_worker(1), RUN.run_id, "layer1"))
    resume = prepare_resume(path, RUN.run_id, "layer1", [record("QmA", 10 * AHEAD_MIN_SAMPLES)], "QmMe", can_sync=True)
    assert resume.state is None and not path.exists() and (tmp_path / "checkpoint.ckpt.aside").exists()

    path.write_bytes(b"not a checkpoint")
    resume = prepare_resume(path, RUN.run_id, "layer1", [], "QmMe", can_sync=True)
    assert resume.state is None and resume.warning and (tmp_path / "checkpoint.ckpt.corrupt").exists()
    assert prepare_resume(path, RUN.run_id, "layer1", [], "QmMe", can_sync=True).message == ""  # none left


def test_checkpointer_writes_off_the_calling_thread_and_skips_when_nothing_changed(tmp_path, monkeypatch):
    worker = trained_worker(1)
    writers = []
    original = checkpoint.write_atomic

    def spy(path, state):
        writers.append(threading.current_thread().name)
        return original(path, state)

    monkeypatch.setattr(checkpoint, "write_atomic", spy)
    saver = Checkpointer(tmp_path / "c.ckpt", RUN.run_id, "layer1", interval_s=3600)
    assert saver.save(worker, "paused").result(30) > 0
    assert saver.save(worker, "again") is None  # nothing trained since
    worker.forward_backward("more", torch.randn(8, RUN.model.hidden_dim), torch.randint(0, 10, (8,)))
    assert saver.save(worker, "exit") is not None
    assert saver.close(30)
    assert writers and all(name.startswith("checkpoint-writer") for name in writers)
    assert read(tmp_path / "c.ckpt", RUN.run_id, "layer1").clock == 16
    assert not saver.due()


def test_two_nodes_of_one_swarm_on_one_machine_get_their_own_checkpoint(tmp_path):
    first, first_lock = claim_slot(tmp_path)
    second, second_lock = claim_slot(tmp_path)
    assert (first.name, second.name) == ("checkpoint.ckpt", "checkpoint-2.ckpt")
    first_lock.release()
    again, again_lock = claim_slot(tmp_path)  # a restarted node takes the freed slot, and its checkpoint
    assert again == first
    second_lock.release()
    again_lock.release()
