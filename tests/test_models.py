"""Stage building: deterministic per-stage seeding, chaining specs, and the loss."""

import math

import pytest
import torch

from swarm.run.models import (
    assemble,
    bits_per_char,
    build_stage,
    build_stages,
    loss_fn,
    stage_input_spec,
    stage_output_spec,
    target_spec,
)
from swarm.run.runconfig import ModelConfig

MLP = ModelConfig(kind="mlp", stages=4, hidden_dim=32, seed=7)
LM = ModelConfig(kind="transformer", stages=3, d_model=32, n_heads=4, d_ff=64, seq_len=16, seed=7)
BATCH = 5


def _example_input(model: ModelConfig, batch: int = BATCH) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return stage_input_spec(model, 0).example(batch, generator, high=model.vocab_size)


@pytest.mark.parametrize("model", [MLP, LM], ids=["mlp", "transformer"])
def test_a_stage_built_alone_has_the_same_weights_as_when_built_with_all(model):
    torch.manual_seed(123)
    rng_before = torch.get_rng_state()
    together = build_stages(model)
    assert torch.equal(torch.get_rng_state(), rng_before), "building stages must not move the global RNG"
    for index in reversed(range(model.stages)):
        alone = build_stage(model, index)
        for (name, a), (_, b) in zip(together[index].state_dict().items(), alone.state_dict().items()):
            assert torch.equal(a, b), f"stage {index} tensor {name} differs"


def test_the_seed_and_the_stage_index_both_change_the_weights():
    first = build_stage(MLP, 1).state_dict()
    other_stage = build_stage(MLP, 2).state_dict()
    other_seed = build_stage(MLP.model_copy(update={"seed": 8}), 1).state_dict()
    key = "0.linear.weight"
    assert not torch.equal(first[key], other_stage[key])
    assert not torch.equal(first[key], other_seed[key])


@pytest.mark.parametrize("model", [MLP, LM, MLP.model_copy(update={"stages": 1}), LM.model_copy(update={"stages": 1})])
def test_each_stage_output_fits_the_next_stage_input_spec(model):
    x = _example_input(model)
    for index, stage in enumerate(build_stages(model)):
        assert stage_input_spec(model, index).mismatch(x) is None
        x = stage(x)
        assert stage_output_spec(model, index, BATCH).mismatch(x) is None
    assert loss_fn(model, x, target_spec(model).example(BATCH, high=2)).dim() == 0


@pytest.mark.parametrize("model", [MLP, LM], ids=["mlp", "transformer"])
def test_assembled_model_equals_running_the_stages_one_by_one(model):
    stages = [stage.eval() for stage in build_stages(model)]
    x = _example_input(model)
    expected = x
    for stage in stages:
        expected = stage(expected)
    assert torch.allclose(assemble(stages)(x), expected)


def test_specs_accept_any_batch_size_but_reject_wrong_dtype_or_width():
    spec = stage_input_spec(MLP, 1)
    assert spec.mismatch(torch.zeros(3, 32)) is None
    assert spec.mismatch(torch.zeros(300, 32)) is None
    assert "dtype" in spec.mismatch(torch.zeros(3, 32, dtype=torch.float64))
    assert "shape" in spec.mismatch(torch.zeros(3, 31))
    assert "shape" in stage_input_spec(MLP, 1, batch_size=4).mismatch(torch.zeros(3, 32))
    assert stage_input_spec(LM, 0).dtype == torch.int64
    assert target_spec(LM, 2).shape == (2, 16)


def test_out_of_range_stage_index_is_a_clear_error():
    with pytest.raises(ValueError, match="model.stages"):
        build_stage(MLP, 4)


def test_lm_loss_is_per_token_and_bits_per_char_converts_nats():
    logits = torch.zeros(2, 16, LM.vocab_size)
    targets = torch.zeros(2, 16, dtype=torch.int64)
    assert loss_fn(LM, logits, targets).item() == pytest.approx(math.log(LM.vocab_size))
    assert bits_per_char(math.log(256)) == pytest.approx(8.0)


def test_throughput_can_be_read_while_the_compute_thread_records_steps():
    """The node's thread reads samples/s while the compute thread appends (a race that crashed a node)."""
    import threading
    import time

    from swarm.pipeline.stage.worker import StageStats

    stats, stop, errors = StageStats(), threading.Event(), []

    def record() -> None:
        while not stop.is_set():
            stats.record_update(8, 0.5, time.monotonic())

    writer = threading.Thread(target=record)
    writer.start()
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            try:
                stats.samples_per_s(time.monotonic())
            except RuntimeError as exc:
                errors.append(exc)
                break
    finally:
        stop.set()
        writer.join(5)
    assert not errors


def test_building_a_stage_seeds_no_gpu_generator(monkeypatch):
    """torch.manual_seed also reseeds every CUDA generator (fork_rng(devices=[]) would not restore it):
    every peer of a swarm would then draw the same dropout masks on a GPU."""
    import torch

    from swarm.run.models import build_stage
    from swarm.run.runconfig import ModelConfig

    calls = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: calls.append(seed))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: calls.append(seed))
    build_stage(ModelConfig(stages=2), 1)
    assert calls == []
