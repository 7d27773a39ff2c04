"""A single-process reference trainer: the yardstick for the distributed run.

Tests and benchmarks compare the swarm against ``train_local``, which trains the same stages with
the same optimizer, batch size and loss in one process. ``make_optimizer`` is shared with the stage
servers so both sides step the weights the same way.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from swarm.run.data import Dataset, MicroBatches, load_dataset
from swarm.run.models import assemble, bits_per_char, build_stages, eval_batch, loss_fn
from swarm.run.runconfig import ModelConfig, OptimizerConfig, RunConfig


@dataclass(frozen=True)
class LocalResult:
    """What a local run reached; ``accuracy`` is None and ``bits_per_char`` set for a language model."""

    accuracy: float | None
    test_loss: float
    initial_test_loss: float
    bits_per_char: float | None
    initial_bits_per_char: float | None
    samples: int
    train_s: float
    samples_per_s: float


def make_optimizer(params: Iterable[nn.Parameter], opt: OptimizerConfig) -> torch.optim.Optimizer:
    """The run's optimizer over ``params``; a plain function so stage servers build the same one.

    PyTorch's fused kernels where the parameters allow them (floating point, on the CPU or CUDA): the same update
    to float rounding (6e-8 after 50 Adam steps) at a fraction of the CPU. On one thread, for a 2048 x 2048 layer,
    Adam's default per-tensor loop takes 69 ms a step, its fused kernel 13 ms; SGD with momentum 15 -> 8 ms
    (benchmarks/README.md, issue 29). A volunteer lends that CPU; the one-process yardstick uses this same function.
    """
    from swarm.run.optim_light import lighten

    lighten()  # no torch._dynamo import for the constructor's add_param_group (swarm/run/optim_light.py)
    params = list(params)
    fused = _fusable(params)
    if opt.name == "sgd":
        return torch.optim.SGD(params, lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay, fused=fused)
    if opt.name == "adam":
        return torch.optim.Adam(params, lr=opt.lr, weight_decay=opt.weight_decay, fused=fused)
    if opt.name == "adamw":
        return torch.optim.AdamW(params, lr=opt.lr, weight_decay=opt.weight_decay, fused=fused)
    raise ValueError(f"optimizer.name {opt.name!r} is not one of sgd, adam, adamw")


def _fusable(params: list[nn.Parameter]) -> bool | None:
    """True where every parameter is a float32/float64 tensor on one CPU or CUDA device; None (the default loop)
    otherwise."""
    devices = {p.device.type for p in params}
    if not params or len(devices) != 1 or devices - {"cpu", "cuda"}:
        return None
    if any(p.dtype not in (torch.float32, torch.float64) for p in params):
        return None
    return True


@torch.no_grad()
def evaluate(
    model_or_stages: nn.Module | list[nn.Module], dataset: Dataset, model_cfg: ModelConfig, batch_size: int | None = None
) -> tuple[float | None, float]:
    """(test accuracy or None for a language model, mean test loss in nats per sample or token) in eval mode."""
    batch_size = batch_size or eval_batch(model_cfg, wide=True)
    model = assemble(model_or_stages) if isinstance(model_or_stages, list) else model_or_stages
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    try:
        for start in range(0, len(dataset.x_test), batch_size):
            x = dataset.x_test[start : start + batch_size].to(device)
            y = dataset.y_test[start : start + batch_size].to(device)
            logits = model(x)
            loss_sum += loss_fn(model_cfg, logits, y).item() * len(x)
            correct += (logits.argmax(-1) == y).sum().item()
            count += len(x)
    finally:
        model.train(was_training)
    accuracy = correct / count if dataset.kind == "classification" else None
    return accuracy, loss_sum / count


def train_local(
    run: RunConfig,
    num_samples: int,
    *,
    device: str = "cpu",
    shard_indices: np.ndarray | None = None,
    seed: int = 0,
    dataset: Dataset | None = None,
) -> LocalResult:
    """Train the run's whole model in one process for ``num_samples`` samples and evaluate it.

    ``shard_indices`` restricts training to one shard (as a layer0 peer would see); ``dataset``
    skips reloading when the caller already has it. The caller's global RNG state is left untouched.
    """
    data = dataset if dataset is not None else load_dataset(run.data, run.model)
    indices = np.arange(len(data.x_train)) if shard_indices is None else shard_indices
    gpus = [torch.device(device)] if str(device).startswith("cuda") else []
    with torch.random.fork_rng(devices=gpus):  # restores the GPU's generator too when training there
        torch.manual_seed(seed)  # dropout masks
        model = assemble(build_stages(run.model)).to(device)
        _, initial_loss = evaluate(model, data, run.model)
        batches = MicroBatches(data.x_train, data.y_train, indices, run.training.batch_size, seed)
        samples, train_s = _train(model, run, batches, num_samples, device)
        accuracy, loss = evaluate(model, data, run.model)
    is_lm = data.kind == "language_model"
    return LocalResult(
        accuracy=accuracy,
        test_loss=loss,
        initial_test_loss=initial_loss,
        bits_per_char=bits_per_char(loss, data.bytes_per_token) if is_lm else None,
        initial_bits_per_char=bits_per_char(initial_loss, data.bytes_per_token) if is_lm else None,
        samples=samples,
        train_s=train_s,
        samples_per_s=samples / train_s if train_s > 0 else float("inf"),
    )


def _train(model: nn.Module, run: RunConfig, batches: MicroBatches, num_samples: int, device: str) -> tuple[int, float]:
    """(samples trained, seconds): at least ``num_samples``, the last batch may overshoot."""
    optimizer = make_optimizer(model.parameters(), run.optimizer)
    model.train()
    seen = 0
    started = time.perf_counter()
    while seen < num_samples:
        x, y = next(batches)
        loss = loss_fn(run.model, model(x.to(device)), y.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        seen += len(x)
    return seen, time.perf_counter() - started
