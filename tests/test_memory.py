"""The memory a llama stage needs, computed from the config: parameters exactly, the activations autograd keeps
within 20 % of what torch saves (float32, and bf16 autocast forced on the CPU); llm-small builds and steps."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.nn import functional as F

from swarm.run.fused_loss import CHUNK_BYTES
from swarm.run.memory import activation_bytes, stage_memory, stage_params
from swarm.run.models import build_stage, stage_input_spec
from swarm.run.runconfig import ModelConfig
from volunteer.config import load_run

SMALL = ModelConfig(kind="llama", stages=3, blocks_per_stage=2, d_model=128, n_heads=4, n_kv_heads=2,
                    vocab_size=2048, seq_len=64)
BATCH = 4


def saved_bytes(model: ModelConfig, index: int, batch: int, bf16: bool) -> int:
    """What torch keeps for the backward of one micro-batch (unique storages, parameters excluded), plus the stage's
    output (a stage keeps it in its activation cache); the last stage's training loss as the worker takes it (its
    head and loss fused: swarm/run/fused_loss.py), plus the one chunk of logits that step holds at a time."""
    stage = build_stage(model, index)
    stage.force_autocast = bf16
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    x = stage_input_spec(model, index).example(batch, high=model.vocab_size)
    if x.is_floating_point():
        x.requires_grad_(True)
    last = index == model.stages - 1
    with saved_tensors_hooks(pack, lambda tensor: tensor):
        out = stage(x, torch.zeros((batch, model.seq_len), dtype=torch.long)) if last else stage(x)
    chunk = min(CHUNK_BYTES, batch * model.seq_len * 4 * model.vocab_size) if last else 0
    return sum(seen.values()) + out.untyped_storage().nbytes() + chunk


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_the_activation_estimate_is_within_a_fifth_of_what_torch_saves(bf16):
    model = SMALL.model_copy(update={"mixed_precision": "bf16" if bf16 else "none"})
    for index in range(model.stages):
        measured = saved_bytes(model, index, BATCH, bf16)
        estimate = activation_bytes(model, index, BATCH, bf16)
        assert 0.8 <= estimate / measured <= 1.2, f"stage {index}: estimated {estimate}, torch saved {measured}"


def test_parameters_are_counted_exactly_from_the_config():
    for model in (SMALL, SMALL.model_copy(update={"n_kv_heads": None, "ffn_dim": 200, "stages": 1})):
        for index in range(model.stages):
            assert stage_params(model, index) == sum(p.numel() for p in build_stage(model, index).parameters())


def test_llm_small_is_a_100m_model_whose_stages_fit_a_12_gib_gpu_and_one_takes_a_step_on_the_cpu():
    run, _ = load_run("llm-small")
    total = sum(stage_params(run.model, k) for k in range(run.model.stages))
    assert 90e6 < total < 150e6
    needs = [stage_memory(run, k) for k in range(run.model.stages)]
    assert all(need.total_bytes < 12 * 2**30 for need in needs)
    assert needs[1].micro_batches == run.training.in_flight and needs[-1].micro_batches == 1
    assert stage_memory(run, 1, cuda=False).overhead_bytes == 0

    stage = build_stage(run.model, run.model.stages - 1)  # the last: 4 layers, the norm and the head
    assert sum(p.numel() for p in stage.parameters()) == stage_params(run.model, run.model.stages - 1)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=run.optimizer.lr)
    x = torch.randn(1, 32, run.model.d_model)  # a tiny batch and a short sequence: the CPU is slow
    before = stage.lm_head.weight.detach().clone()
    loss = F.cross_entropy(stage(x).reshape(-1, run.model.vocab_size), torch.randint(0, 2048, (32,)))
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss) and not torch.equal(before, stage.lm_head.weight)


def test_doctor_shows_each_stages_gpu_memory_for_llama_runs_only():
    from volunteer_cli.commands.doctor_memory import memory_checks

    run, _ = load_run("llm-small")
    checks = [c for c in memory_checks(run, "cpu") if c.section.startswith("GPU")]
    assert [c.name for c in checks] == ["layer0", "layer1", "layer2", "layer3"]
    assert all("GiB" in c.detail and "in flight" in c.detail for c in checks)
    assert checks[0].section.startswith("GPU memory a stage needs (bf16 autocast, batch 8 x 1024 tokens)")
    charlm = memory_checks(load_run("charlm")[0], "cpu")
    assert charlm and not any(c.section.startswith("GPU") for c in charlm)
    # every run: the host bytes each stage keeps, per parameter and by part
    host = [c for c in memory_checks(run, "cpu") if c.section.startswith("Host memory")]
    assert [c.name for c in host] == ["layer0", "layer1", "layer2", "layer3"]
    assert all("bytes each" in c.detail and "snapshots" in c.detail and "weight versions" in c.detail for c in host)
    # weight prediction (charlm's): the predicted copies its forwards in flight hold, never at the last stage
    charlm_host = [c.detail for c in charlm if c.section.startswith("Host memory")]
    assert ["predicted weights while forwards are in flight" in d for d in charlm_host] == [True, True, True, False]
    assert not any("predicted" in c.detail for c in host)  # llm-small does not predict
    # a small stage's parts read in tenths of a MiB, not "0" each (digits: 0.02 M parameters)
    from volunteer_cli.commands.common import mib_text

    sizes = (0, 4096, 0.4 * 2**20, 9.94 * 2**20, 758.3 * 2**20)
    assert [mib_text(n) for n in sizes] == ["0", "<0.1", "0.4", "9.9", "758"]
    digits = [c for c in memory_checks(load_run("digits-mlp")[0], "cpu") if c.section.startswith("Host memory")]
    assert digits and all("(live copy 0," not in c.detail and "guard 0 " not in c.detail for c in digits)
    # healing's snapshot files against the data dir's free space (swarm/integrity/snapshots.py)
    assert len([c for c in memory_checks(run, "cpu", disk_free=1 << 40) if c.section.startswith("Host memory")]) == 4
    full = [c for c in memory_checks(run, "cpu", disk_free=100 * 2**20) if c.status == "warn" and "on disk" in c.detail]
    assert [c.name for c in full] == ["layer0", "layer1", "layer2", "layer3"]
    assert "kept in memory instead" in full[0].detail and "--data-dir" in full[0].detail


def test_the_gpu_check_runs_without_a_gpu_and_says_what_it_skipped(capsys):
    import json

    from benchmarks.gpu_check import main

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the check would run llm-small on it")
    assert main(["--json", "--steps", "1"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["cuda"] is False and "CUDA checks" in report["skipped"] and report["all_finite"]
    assert [s["stage"] for s in report["stages"]] == [0, 1] and all(s["tokens_per_s"] > 0 for s in report["stages"])
    assert "swarm" not in report  # the local swarm runs with CUDA (or --swarm-window-s): the suite does not pay it
    # the same stage as a bare module beside it: what the stage server adds (on an H200, 2.7x for a middle stage)
    assert all(s["bare_step_s"] > 0 and s["worker_vs_bare"] > 0 for s in report["stages"])


def test_the_gpu_checks_swarm_reads_the_drivers_data_plane_from_its_own_summary_line():
    """From what a headless driver really writes (volunteer/eventlog.py), not from a line made up here: the first
    version read it from the DHT record, which does not carry it, and would have failed after the window."""
    import io
    import json

    from benchmarks.gpu_swarm import last_data_plane
    from fake_engine import sample_snapshot
    from volunteer.eventlog import EventLog

    stream = io.StringIO()
    log = EventLog(stream, fmt="json", summary_every_s=0.0)
    log.on_snapshot(sample_snapshot(data_plane=""))  # before any micro-batch: nothing said yet
    log.on_snapshot(sample_snapshot(data_plane="stage to stage 96% · 1 peer relayed now"))
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    said = last_data_plane(lines, lines[-1]["time"] + 2.0)
    assert said == {"said": "stage to stage 96% · 1 peer relayed now", "age_s": 2.0}
    assert last_data_plane(lines[:1], 0.0) is None


def test_the_gpu_checks_swarm_runs_the_checked_model_on_shipped_data_against_its_stages_in_sequence():
    from benchmarks.gpu_swarm import in_sequence_samples_per_s, swarm_run
    from swarm.run.runconfig import RunConfig

    config = swarm_run("llm-small", batch_size=4)
    run = RunConfig.model_validate(config)
    assert run.model.d_model == 768 and run.model.stages == 4 and run.training.batch_size == 4
    assert run.data.source == "text" and run.data.path is None  # the shipped corpus: nothing to download or write
    assert run.training.eval_every_s >= 1e5  # what is timed is training
    stages = [{"step_s": 0.4, "micro_batches_per_step": 4}, {"step_s": 0.2, "micro_batches_per_step": 4},
              {"step_s": 0.05, "micro_batches_per_step": 1}]
    sequence, slowest = in_sequence_samples_per_s(stages, batch=8)
    assert sequence == pytest.approx(8 / 0.2) and slowest == pytest.approx(8 / 0.1)


@pytest.mark.parametrize("name", ["llm-tiny", "digits-mlp"])
def test_host_bytes_per_stage_parameter_are_what_the_estimate_says(name, tmp_path):
    """issue 42: what a trained stage holds (the ring at its bound, the guard; healing's two snapshots in files, as a
    node keeps them) within 10 % of ``host_memory``, the figure `doctor` shows, and the files within 10 % of its
    ``disk_bytes``; for llm-tiny's stages, 34 bytes a parameter with Adam (16 of them the live copy), where it was
    72 before the guard's per-tensor deltas, its kept Adam copy and the second snapshot's moments went (52), before
    snapshots and committed versions were kept in bfloat16 (36), before commitments were exact (44) and before the
    snapshots went to disk (42)."""
    from swarm.integrity.heal import Healer
    from swarm.integrity.snapshots import SnapshotStore
    from swarm.pipeline.stage.worker import StageWorker
    from swarm.run.memory import held_bytes, host_memory
    from swarm.run.models import stage_output_spec, target_spec

    run, _ = load_run(name)
    index = run.model.stages - 1 if name == "llm-tiny" else 1
    worker = StageWorker(run, index)
    healer = Healer(worker, notify=lambda *a: None, store=SnapshotStore(tmp_path))
    gen = torch.Generator().manual_seed(0)
    high = run.model.vocab_size if run.model.kind == "llama" else run.model.num_classes
    steps = 12 if name == "llm-tiny" else 270  # versions enough to fill the ring (8 MiB of 33 kB ones); snapshots on the way
    for i in range(steps):
        x = stage_input_spec(run.model, index).example(4, gen, high=2)
        if worker.is_last:
            worker.forward_backward(f"m{i}", x, target_spec(run.model).example(4, gen, high=high))
        else:
            worker.forward(f"m{i}", x)
            worker.backward(f"m{i}", 1e-3 * stage_output_spec(run.model, index, 4).example(4, gen), None, None)
        if i in (3, steps - 3):
            healer.take_snapshot()
    healer.store.settle()
    expected = host_memory(run, index)
    held = held_bytes(worker, healer)
    assert abs(held / expected.total_bytes - 1) <= 0.10, (held, expected)
    # as far as referees asking for dropped versions may grow the ring, and pin versions over it: doctor's "up to"
    from swarm.integrity.weights import PIN_MAX

    most = worker.ring.largest_bytes + PIN_MAX * worker.ring.copy_bytes
    assert abs(most / expected.ring_max_bytes - 1) <= 0.10, (most, expected)
    files = list(healer.store.directory.glob("*.pt"))
    assert len(files) == 2 and abs(sum(f.stat().st_size for f in files) / expected.disk_bytes - 1) <= 0.10
    if expected.params >= 500_000:
        # 36 with bfloat16 commitments (session 13); exact ones (the referee's honest tail: swarm/integrity/weights.py)
        # cost the ring's 4 copies 2 more bytes each (44); the guard undoing a step from the ring's copy of the
        # weights an update computed with, not from its own, 4 fewer (40, + 1.6 for llm-tiny's 1 MiB scratch);
        # healing's snapshots on disk, 8 fewer
        assert expected.per_param <= 34 and (held - expected.fixed_bytes) / expected.params <= 34
        assert worker.guard.shared_steps == worker.guard.steps > 0, "every step undone from the ring's copy"
    healer.close()
    assert not healer.store.directory.exists()
