"""torch.optim without torch._dynamo (swarm/run/optim_light.py): a volunteer's start no longer pays a second of CPU
for an import it never uses, and its updates are exactly those of ``optimizer.step()``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from swarm.run.local import make_optimizer
from swarm.run.optim_light import lighten, step_of
from swarm.run.runconfig import OptimizerConfig

pytestmark = pytest.mark.skipif(not lighten(), reason="this torch lays torch.optim's wrappers out otherwise")


@pytest.mark.parametrize("name,extra", [("adam", {}), ("adamw", {"weight_decay": 0.01}),
                                        ("sgd", {"momentum": 0.9, "weight_decay": 1e-4})])
def test_the_light_step_is_the_optimizers_step_bit_for_bit(name, extra):
    config = OptimizerConfig.model_validate({"name": name, "lr": 0.01, **extra})
    torch.manual_seed(0)
    twins = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)) for _ in range(2)]
    twins[1].load_state_dict(twins[0].state_dict())
    optimizers = [make_optimizer(m.parameters(), config) for m in twins]
    steps = [optimizers[0].step, step_of(optimizers[1])]
    assert steps[1] != optimizers[1].step  # the light one
    for i in range(6):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        for model, step in zip(twins, steps):
            model.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            step()
    for a, b in zip(twins[0].parameters(), twins[1].parameters()):
        assert torch.equal(a, b)
    assert optimizers[1].state  # its moments (momentum buffers) were kept like the other's


def test_a_stage_trains_and_snapshots_without_importing_dynamo():
    """In a fresh interpreter (this one's torch._dynamo may be loaded by other tests): digits and llm-tiny stages,
    forwards, backwards and the last stage's forward_backward through the guard, and a snapshot with optimizer
    state, as a volunteer does from its start to its first checkpoint. Nor sympy: a backward given a gradient tensor
    imports it in torch (+34 MiB of RSS, 0.45 s of CPU); the stage's backward takes a scalar root instead
    (swarm/run/models.py backward_root)."""
    script = """
import sys, torch
from volunteer.config import load_run
from swarm.pipeline.stage.worker import StageWorker
from swarm.run.models import stage_input_spec, stage_output_spec, target_spec
for name in ("digits-mlp", "llm-tiny"):
    run, _ = load_run(name)
    high = run.model.vocab_size if run.model.kind == "llama" else run.model.num_classes
    for k in range(run.model.stages):
        worker, g = StageWorker(run, k), torch.Generator().manual_seed(k)
        for i in range(2):
            x = stage_input_spec(run.model, k).example(4, g, high=high if k == 0 else 2)
            if worker.is_last:
                worker.forward_backward(f"m{i}", x, target_spec(run.model).example(4, g, high=high))
            else:
                worker.forward(f"m{i}", x)
                worker.backward(f"m{i}", stage_output_spec(run.model, k, 4).example(4, g) * 1e-3, None, None)
        assert worker.stats.clock > 0, (name, k)
        worker.capture(include_optimizer=True)
print(" ".join(m for m in ("torch._dynamo", "sympy") if m in sys.modules) or "clean")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("clean"), done.stdout
