"""``model.kind: llama``: a decoder-only language model in plain torch, cut into stages.

The blocks are Llama's (RMSNorm before attention and MLP, rotary positions, grouped-query attention through
``F.scaled_dot_product_attention``, SwiGLU MLP, no biases, untied head). A stage's state dict uses
transformers' ``LlamaForCausalLM`` names without the ``model.`` prefix and with the block index local to the
stage (``layers.0.self_attn.q_proj.weight``), so hf_export.py maps stage ``k``'s block ``i`` to
``model.layers.{k * blocks_per_stage + i}`` and nothing is reshaped: the rotary convention is transformers'
(``rotate_half`` over the two halves of a head), so its model computes the same logits from the same tensors.

Mixed precision: with ``model.mixed_precision: bf16`` a stage on CUDA computes under bf16 autocast while its
parameters (and so the optimizer's state) stay float32; its output is float32 whatever it computed in, so
the wire and the next stage see the same dtype as from a CPU peer. The CPU computes in float32 unless a
caller forces autocast (``force_autocast``: tests exercise the bf16 path without a GPU).
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from swarm.run.fused_loss import linear_cross_entropy
from swarm.run.runconfig import ModelConfig

INIT_STD = 0.02  # transformers' initializer_range for Llama


def autocast_context(device_type: str, mixed_precision: str, force: bool = False) -> AbstractContextManager:
    """bf16 autocast where the run asks for it and the device is CUDA (or ``force``); float32 otherwise."""
    enabled = mixed_precision == "bf16" and (device_type == "cuda" or force)
    return torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=enabled)


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, computed in float32 whatever the input dtype (as transformers does)."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Rotary(nn.Module):
    """cos and sin of the rotary angles for positions 0..T-1 (float32); a buffer kept out of the state dict."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, steps: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(device_type=device.type, enabled=False):
            positions = torch.arange(steps, device=device, dtype=torch.float32)
            angles = torch.outer(positions, self.inv_freq.to(device))
            both = torch.cat((angles, angles), dim=-1)
            return both.cos(), both.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, steps, head_dim); cos, sin: (steps, head_dim)."""
    return x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, model: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads = model.n_heads, model.kv_heads
        self.head_dim = model.d_model // model.n_heads
        self.q_proj = nn.Linear(model.d_model, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(model.d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(model.d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, model.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, steps, _ = x.shape
        q = self.q_proj(x).view(batch, steps, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, steps, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, steps, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.n_kv_heads != self.n_heads:  # query head h reads key/value head h // (n_heads / n_kv_heads)
            repeat = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, steps, self.n_heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, model: ModelConfig):
        super().__init__()
        hidden = model.llama_ffn_dim
        self.gate_proj = nn.Linear(model.d_model, hidden, bias=False)
        self.up_proj = nn.Linear(model.d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, model.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, model: ModelConfig):
        super().__init__()
        self.self_attn = Attention(model)
        self.mlp = SwiGLU(model)
        self.input_layernorm = RMSNorm(model.d_model, model.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(model.d_model, model.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaStage(nn.Module):
    """Stage ``index``: the token embedding on stage 0, ``blocks_per_stage`` decoder layers, the final norm and
    head on the last stage. Input: token ids (stage 0) or the residual stream; output: the residual stream or
    logits, float32 either way."""

    def __init__(self, model: ModelConfig, index: int):
        super().__init__()
        self.is_first, self.is_last = index == 0, index == model.stages - 1
        self.mixed_precision = model.mixed_precision
        self.checkpointing = model.activation_checkpointing
        self.force_autocast = False  # tests: run the bf16 path on the CPU
        if self.is_first:
            self.embed_tokens = nn.Embedding(model.vocab_size, model.d_model)
        self.layers = nn.ModuleList(DecoderLayer(model) for _ in range(model.blocks_per_stage))
        if self.is_last:
            self.norm = RMSNorm(model.d_model, model.rms_norm_eps)
            self.lm_head = nn.Linear(model.d_model, model.vocab_size, bias=False)
        self.rotary = Rotary(model.d_model // model.n_heads, model.rope_theta)
        self._init_weights(model)

    def _init_weights(self, model: ModelConfig) -> None:
        """Normal(0, 0.02) as transformers initialises Llama; the projections back into the residual stream
        scaled by 1/sqrt(2 x layers) (GPT-2's rule) so the stream's variance does not grow with depth."""
        depth_scale = 1.0 / math.sqrt(2 * model.stages * model.blocks_per_stage)
        for name, param in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                continue
            std = INIT_STD * depth_scale if name.endswith(("o_proj.weight", "down_proj.weight")) else INIT_STD
            nn.init.normal_(param, mean=0.0, std=std)

    fuses_loss = True  # the last stage's forward(x, targets) is its training loss (swarm/run/fused_loss.py)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (the last stage) or the residual stream; with ``targets`` (the last stage) the mean cross-entropy
        of its logits, computed without holding them (swarm/run/fused_loss.py)."""
        with autocast_context(x.device.type, self.mixed_precision, self.force_autocast):
            hidden = self.embed_tokens(x) if self.is_first else x
            cos, sin = self.rotary(hidden.shape[1], hidden.device)
            for layer in self.layers:
                if self.checkpointing and self.training and torch.is_grad_enabled():
                    hidden = checkpoint(layer, hidden, cos, sin, use_reentrant=False)
                else:
                    hidden = layer(hidden, cos, sin)
            if self.is_last:
                hidden = self.norm(hidden)
                if targets is not None:
                    return linear_cross_entropy(hidden, self.lm_head.weight, targets)
                hidden = self.lm_head(hidden)
        return hidden.float()


def llama_stage(model: ModelConfig, index: int) -> LlamaStage:
    return LlamaStage(model, index)
