"""The last llama stage's head and loss in one chunked step (swarm/run/fused_loss.py): the loss and every gradient
of the unfused head and cross-entropy, without keeping a (tokens x vocabulary) tensor for the backward."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.nn import functional as F

from swarm.run import fused_loss
from swarm.run.fused_loss import linear_cross_entropy
from swarm.run.models import build_stage, loss_fn
from swarm.run.runconfig import ModelConfig

LLAMA = ModelConfig(kind="llama", stages=2, blocks_per_stage=1, d_model=32, n_heads=4, n_kv_heads=2,
                    vocab_size=300, seq_len=16, seed=3)


@pytest.mark.parametrize("rows", [1, 37, 200])
def test_the_loss_and_both_gradients_are_the_unfused_ones(monkeypatch, rows):
    monkeypatch.setattr(fused_loss, "CHUNK_BYTES", 4 * 300 * 16)  # 16 rows a chunk: several, the last one partial
    gen = torch.Generator().manual_seed(rows)
    hidden = torch.randn(rows, 24, generator=gen, requires_grad=True)
    weight = (0.1 * torch.randn(300, 24, generator=gen)).requires_grad_(True)
    targets = torch.randint(0, 300, (rows,), generator=gen)
    bias = (0.1 * torch.randn(300, generator=gen)).requires_grad_(True)
    for b in (None, bias):  # llama's head has no bias, the byte-level transformer's has one
        logits = hidden @ weight.t() if b is None else hidden @ weight.t() + b
        wrt = (hidden, weight) if b is None else (hidden, weight, b)
        expected = F.cross_entropy(logits, targets)
        wanted = torch.autograd.grad(2.5 * expected, wrt)
        loss = linear_cross_entropy(hidden, weight, targets, b)
        got = torch.autograd.grad(2.5 * loss, wrt)  # the incoming gradient scales them all
        assert torch.allclose(loss, expected, rtol=1e-6, atol=1e-6)
        for g, w in zip(got, wanted):
            assert torch.allclose(g, w, rtol=1e-5, atol=1e-8)
        with torch.no_grad():
            assert torch.allclose(linear_cross_entropy(hidden, weight, targets, b), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind,bf16", [("llama", False), ("llama", True), ("transformer", False)],
                         ids=["llama-float32", "llama-bf16", "transformer"])
def test_a_last_stage_given_targets_gives_the_loss_and_gradients_of_its_logits(kind, bf16):
    model = LLAMA.model_copy(update={"mixed_precision": "bf16" if bf16 else "none"}) if kind == "llama" else \
        ModelConfig(kind="transformer", stages=2, blocks_per_stage=1, d_model=32, n_heads=4, vocab_size=256,
                    seq_len=16, seed=3)
    fused, plain = build_stage(model, 1), build_stage(model, 1)
    if kind == "llama":
        fused.force_autocast = plain.force_autocast = bf16
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, model.seq_len, model.d_model, generator=gen)
    targets = torch.randint(0, model.vocab_size, (3, model.seq_len), generator=gen)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    fused(xs[0], targets).backward()
    expected = loss_fn(model, plain(xs[1]), targets)
    expected.backward()
    # float32: the same up to rounding; bf16: the fused head computes in float32, the unfused one under autocast
    tolerance = 2e-2 if bf16 else 1e-5
    assert torch.allclose(xs[0].grad, xs[1].grad, rtol=tolerance, atol=tolerance * xs[1].grad.abs().max())
    for (name, a), b in zip(fused.named_parameters(), plain.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=tolerance, atol=tolerance * b.grad.abs().max()), name


def test_nothing_of_tokens_by_vocabulary_is_kept_for_the_backward():
    stage = build_stage(LLAMA, 1)
    tokens = 4 * LLAMA.seq_len
    kept: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        kept.append(tensor.numel())
        return tensor

    x = torch.randn(4, LLAMA.seq_len, LLAMA.d_model, requires_grad=True)
    with saved_tensors_hooks(pack, lambda tensor: tensor):
        stage(x, torch.zeros((4, LLAMA.seq_len), dtype=torch.long)).backward()
    assert kept and max(kept) < tokens * LLAMA.vocab_size, "a (tokens x vocabulary) tensor waited for the backward"
    with saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = build_stage(LLAMA, 1)(x)
        loss_fn(LLAMA, logits, torch.zeros((4, LLAMA.seq_len), dtype=torch.long))
    assert max(kept) >= tokens * LLAMA.vocab_size, "the unfused head does keep one (what this test tells apart)"


def test_a_last_stage_evaluates_the_loss_of_its_logits_without_holding_them():
    from swarm.pipeline.stage.worker import StageWorker
    from volunteer.config import load_run

    run, _ = load_run("llm-tiny")
    worker = StageWorker(run, 1)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, run.model.seq_len, run.model.d_model, generator=gen)
    y = torch.randint(0, run.model.vocab_size, (5, run.model.seq_len), generator=gen)
    loss_sum, correct, count = worker.evaluate(x, y)
    with torch.no_grad():
        expected = loss_fn(run.model, worker.module.eval()(x), y).item() * 5
    assert count == 5 and correct == 0  # a language model's accuracy is not counted
    assert abs(loss_sum - expected) < 1e-4 * expected


def test_a_spot_check_and_a_referee_recompute_a_last_stage_as_it_trains():
    """The second copy's recomputation (StageWorker.input_gradient) and the referee's (swarm/integrity/recompute.py)
    take the loss the fused way too: the input gradient and loss of the unfused head, no weight gradient left."""
    from swarm.integrity.recompute import recompute, recompute_loss
    from swarm.pipeline.stage.worker import StageWorker
    from volunteer.config import load_run

    run, _ = load_run("llm-tiny")
    worker = StageWorker(run, 1)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, run.model.seq_len, run.model.d_model, generator=gen)
    y = torch.randint(0, run.model.vocab_size, (2, run.model.seq_len), generator=gen)
    inputs = x.clone().requires_grad_(True)
    expected = loss_fn(run.model, worker.module(inputs), y)
    (expected_grad,) = torch.autograd.grad(expected, inputs)
    loss, grad = worker.input_gradient(x, y)
    assert abs(loss - expected.item()) < 1e-5 and torch.allclose(grad, expected_grad, rtol=1e-4, atol=1e-9)
    assert all(p.grad is None for p in worker.module.parameters())
    weights = {name: t.clone() for name, t in worker.module.state_dict().items()}
    refereed = recompute(run.model, build_stage(run.model, 1), "forward_backward", weights, [x], y)
    assert torch.allclose(refereed, expected_grad, rtol=1e-4, atol=1e-9)
    assert abs(recompute_loss(run.model, build_stage(run.model, 1), weights, x, y) - expected.item()) < 1e-5
