"""Building the stages of a model from the run config.

A run's model is cut into ``model.stages`` stages, one per swarm (``layer0`` .. ``layer{L-1}``).
A volunteer builds only the stage of its swarm, so every stage must be buildable alone and get the
same initial weights as when all stages are built together: stage ``k`` is seeded from
``(model.seed, k)`` only, in a forked RNG that leaves the caller's global RNG state untouched.

Kinds:
- ``mlp``: a classifier. Stage 0 opens with ``Linear(input_dim, hidden_dim)``; every stage holds
  ``blocks_per_stage`` residual blocks ``x + dropout(act(Linear(x)))`` (the skip keeps a deep
  pipeline trainable); the last stage closes with ``Linear(hidden_dim, num_classes)`` giving logits.
  No LayerNorm before the head: in a simulation of training with 4-step-stale gradients it made
  digits training diverge, while the residual stack without it reached ~96 % (Adam, lr 1e-3).
- ``transformer``: a byte-level causal language model. Stage 0 embeds tokens and positions; every
  stage holds ``blocks_per_stage`` pre-LN blocks; the last stage closes with LayerNorm + a linear head.
- ``llama``: a BPE language model whose state dict is transformers' LlamaForCausalLM's (llama.py): stage 0
  embeds tokens, every stage holds ``blocks_per_stage`` decoder layers, the last the final norm and head.

The ``TensorSpec`` of a stage's input lets the stage server reject malformed tensors on arrival.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from swarm.run.fused_loss import linear_cross_entropy
from swarm.run.runconfig import ModelConfig

ACTIVATIONS: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}


# ----- tensor specs
@dataclass(frozen=True, slots=True)
class TensorSpec:
    """The shape and dtype a stage expects; a ``None`` dimension (the batch) matches any size."""

    shape: tuple[int | None, ...]
    dtype: torch.dtype

    def mismatch(self, tensor: torch.Tensor) -> str | None:
        """Why ``tensor`` does not fit this spec, or None when it fits."""
        if tensor.dtype != self.dtype:
            return f"dtype {tensor.dtype}, expected {self.dtype}"
        if tensor.dim() != len(self.shape) or any(
            want is not None and got != want for got, want in zip(tensor.shape, self.shape)
        ):
            return f"shape {tuple(tensor.shape)}, expected {self.shape} (None = any size)"
        return None

    def example(self, batch_size: int, generator: torch.Generator | None = None, high: int = 2) -> torch.Tensor:
        """A random tensor of this spec (``None`` dims become ``batch_size``), for tests and warm-up."""
        shape = tuple(batch_size if dim is None else dim for dim in self.shape)
        if self.dtype.is_floating_point:
            return torch.randn(shape, generator=generator, dtype=self.dtype)
        return torch.randint(0, high, shape, generator=generator, dtype=self.dtype)


def stage_input_spec(model: ModelConfig, index: int, batch_size: int | None = None) -> TensorSpec:
    """What stage ``index`` takes as input. ``batch_size=None`` gives a spec accepting any batch."""
    _check_index(model, index)
    if model.kind == "mlp":
        width = model.input_dim if index == 0 else model.hidden_dim
        return TensorSpec((batch_size, width), torch.float32)
    if index == 0:
        return TensorSpec((batch_size, model.seq_len), torch.int64)
    return TensorSpec((batch_size, model.seq_len, model.d_model), torch.float32)


def stage_output_spec(model: ModelConfig, index: int, batch_size: int | None = None) -> TensorSpec:
    """What stage ``index`` returns: the next stage's input, or logits for the last stage."""
    _check_index(model, index)
    if index + 1 < model.stages:
        return stage_input_spec(model, index + 1, batch_size)
    if model.kind == "mlp":
        return TensorSpec((batch_size, model.num_classes), torch.float32)
    return TensorSpec((batch_size, model.seq_len, model.vocab_size), torch.float32)


def target_spec(model: ModelConfig, batch_size: int | None = None) -> TensorSpec:
    """The targets carried with a micro-batch to the last stage: class ids or next-byte ids."""
    if model.kind == "mlp":
        return TensorSpec((batch_size,), torch.int64)
    return TensorSpec((batch_size, model.seq_len), torch.int64)


# ----- evaluation chunks
EVAL_BATCH_MAX = 512
# float32 activations (or logits) of one evaluation chunk, so a large LM fits a GPU and a small one's volunteer does not
# double its RSS to evaluate: at 128 MiB an llm-tiny last stage held 256 sequences' logits and their log-softmax at
# once (256 MiB; issue 42)
EVAL_BYTES_MAX = 32 << 20


def eval_batch(model: ModelConfig, wide: bool = False) -> int:
    """Samples per evaluation chunk: EVAL_BATCH_MAX, fewer for a language model whose chunk would pass
    EVAL_BYTES_MAX of activations between stages (``wide``: of logits, the last stage's own sub-chunks)."""
    if not model.language_model:
        return EVAL_BATCH_MAX
    width = model.vocab_size if wide else model.d_model
    return max(1, min(EVAL_BATCH_MAX, EVAL_BYTES_MAX // (model.seq_len * width * 4)))


# ----- loss
def loss_fn(model: ModelConfig, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy in nats; the language model's (B, T, V) logits are flattened per token."""
    if model.language_model:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return F.cross_entropy(logits, targets)


def fuses_loss(module: nn.Module) -> bool:
    """Whether ``module`` is a last stage whose ``forward(x, targets)`` is its loss (a language model's head fused with
    it: swarm/run/fused_loss.py)."""
    return getattr(module, "fuses_loss", False) and getattr(module, "is_last", False)


def stage_loss(model: ModelConfig, module: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor,
               targets: torch.Tensor) -> torch.Tensor:
    """The last stage's training loss with ``params``: a language model's head (llama's, the byte-level transformer's)
    fuses with the loss and holds no whole logits (``fuses_loss``), the same up to float rounding as ``loss_fn`` of
    the logits, which the MLP takes."""
    from torch.func import functional_call

    if fuses_loss(module):
        return functional_call(module, params, (x, targets))
    return loss_fn(model, functional_call(module, params, (x,)), targets)


def backward_root(outputs: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """A scalar whose gradient with respect to ``outputs`` is ``grad`` bit for bit (the product's backward is 1.0 *
    grad): what ``outputs.backward(grad)`` computes, without a gradient tensor. Given one, torch's autograd imports
    ``torch.fx.experimental.symbolic_shapes`` and sympy at its first backward: +34 MiB of RSS and 0.45 s of CPU in
    every stage process but the last (whose loss is a scalar), measured."""
    return (outputs * grad).sum()


def bits_per_char(loss_nats: float, bytes_per_token: float = 1.0) -> float:
    """Cross-entropy per byte in bits, the usual unit for language models: a BPE token's loss is spread over
    the ``bytes_per_token`` bytes it stands for on average (1 for byte-level models)."""
    return loss_nats / math.log(2) / bytes_per_token


def perplexity(loss_nats: float) -> float:
    """exp of the mean cross-entropy per token (capped where it would overflow)."""
    return math.exp(min(loss_nats, 700.0))


# ----- mlp
class ResidualBlock(nn.Module):
    """``x + dropout(act(Linear(x)))``: the skip keeps gradients alive through many stages."""

    def __init__(self, width: int, activation: str, dropout: float):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.act = ACTIVATIONS[activation]()
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.act(self.linear(x)))


def _mlp_stage(model: ModelConfig, index: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    if index == 0:
        layers += [nn.Linear(model.input_dim, model.hidden_dim), ACTIVATIONS[model.activation]()]
    layers += [ResidualBlock(model.hidden_dim, model.activation, model.dropout) for _ in range(model.blocks_per_stage)]
    if index == model.stages - 1:
        layers.append(nn.Linear(model.hidden_dim, model.num_classes))
    return nn.Sequential(*layers)


# ----- transformer
class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, steps, width = x.shape
        q, k, v = self.qkv(x).view(batch, steps, 3, self.n_heads, width // self.n_heads).permute(2, 0, 3, 1, 4)
        drop = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, steps, width))


class TransformerBlock(nn.Module):
    """Pre-LN block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``; stable without warm-up tricks."""

    def __init__(self, model: ModelConfig):
        super().__init__()
        self.ln_attn = nn.LayerNorm(model.d_model)
        self.attn = CausalSelfAttention(model.d_model, model.n_heads, model.dropout)
        self.ln_mlp = nn.LayerNorm(model.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(model.d_model, model.d_ff),
            ACTIVATIONS[model.activation](),
            nn.Linear(model.d_ff, model.d_model),
            nn.Dropout(model.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class Embedding(nn.Module):
    """Byte tokens plus learned positions; accepts sequences up to ``seq_len`` long."""

    def __init__(self, model: ModelConfig):
        super().__init__()
        self.tokens = nn.Embedding(model.vocab_size, model.d_model)
        self.positions = nn.Parameter(torch.randn(model.seq_len, model.d_model) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions[: ids.shape[1]]


class TransformerStage(nn.Sequential):
    """A byte-level transformer's stage: its layers in order (a Sequential's parameter names); on the last stage,
    ``forward(x, targets)`` is the training loss, its head fused with it (swarm/run/fused_loss.py)."""

    fuses_loss = True

    def __init__(self, *layers: nn.Module, is_last: bool):
        super().__init__(*layers)
        self.is_last = is_last

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None or not self.is_last:
            return super().forward(x)
        *body, head = self
        for layer in body:
            x = layer(x)
        return linear_cross_entropy(x, head.weight, targets, head.bias)


def _transformer_stage(model: ModelConfig, index: int) -> nn.Sequential:
    layers: list[nn.Module] = [Embedding(model)] if index == 0 else []
    layers += [TransformerBlock(model) for _ in range(model.blocks_per_stage)]
    if index == model.stages - 1:
        layers += [nn.LayerNorm(model.d_model), nn.Linear(model.d_model, model.vocab_size)]
    return TransformerStage(*layers, is_last=index == model.stages - 1)


# ----- building
def stage_seed(model: ModelConfig, index: int) -> int:
    """A 63-bit seed that depends on (model.seed, index) only, well mixed so stages don't correlate."""
    entropy = np.random.SeedSequence([model.seed % 2**64, index])
    return int(entropy.generate_state(1, dtype=np.uint64)[0]) >> 1


def build_stage(model: ModelConfig, index: int) -> nn.Module:
    """Stage ``index`` with its deterministic initial weights, built on CPU in float32."""
    _check_index(model, index)
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(stage_seed(model, index))  # the CPU's only: manual_seed would reseed CUDA
        if model.kind == "llama":
            from swarm.run.llama import llama_stage

            return llama_stage(model, index)
        return _mlp_stage(model, index) if model.kind == "mlp" else _transformer_stage(model, index)


def build_stages(model: ModelConfig) -> list[nn.Module]:
    return [build_stage(model, index) for index in range(model.stages)]


def assemble(stages: list[nn.Module]) -> nn.Sequential:
    """The stages chained into one module, for local training and evaluation (shares parameters)."""
    return nn.Sequential(*stages)


def _check_index(model: ModelConfig, index: int) -> None:
    if not 0 <= index < model.stages:
        raise ValueError(f"stage index {index} is outside model.stages ({model.stages}): use 0..{model.stages - 1}")
