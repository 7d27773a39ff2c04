"""The ``model`` section of the run config: which network is trained and how it is cut into stages.

Kinds: ``mlp`` (a classifier), ``transformer`` (a byte-level GPT-like model) and ``llama`` (a decoder
whose state dict is transformers' LlamaForCausalLM's: swarm/run/llama.py). runconfig.py re-exports it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from swarm.run.config_base import CrossFieldError, Strict


class ModelConfig(Strict):
    kind: Literal["mlp", "transformer", "llama"] = "mlp"
    stages: int = Field(4, ge=1, le=64, description="number of layer swarms (layer0 .. layer{stages-1})")
    seed: int = Field(0, description="seeds the initial weights so the first peers of a swarm agree")
    # mlp
    input_dim: int = Field(64, ge=1)
    hidden_dim: int = Field(128, ge=1)
    num_classes: int = Field(10, ge=2)
    blocks_per_stage: int = Field(1, ge=1, le=64)
    activation: Literal["relu", "gelu", "tanh"] = "relu"
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # transformer and llama
    vocab_size: int = Field(256, ge=2, description="llama: at least the tokenizer's vocabulary (data.tokenizer)")
    d_model: int = Field(128, ge=8)
    n_heads: int = Field(4, ge=1)
    d_ff: int = Field(512, ge=8, description="transformer only (llama: ffn_dim)")
    seq_len: int = Field(64, ge=2)
    # llama (swarm/run/llama.py): a state dict that transformers' LlamaForCausalLM loads
    n_kv_heads: int | None = Field(None, ge=1, description="grouped-query attention: key/value heads, a divisor of "
                                   "n_heads; unset: n_heads (plain multi-head attention)")
    ffn_dim: int | None = Field(None, ge=8, description="SwiGLU hidden width; unset: 8/3 d_model rounded up to "
                                "a multiple of multiple_of (Llama's rule)")
    multiple_of: int = Field(64, ge=1, le=4096, description="the rounding of the default ffn_dim")
    rope_theta: float = Field(10000.0, gt=0.0, description="base of the rotary position frequencies")
    rms_norm_eps: float = Field(1e-5, gt=0.0, lt=1.0)
    tie_embeddings: bool = Field(False, description="must stay false: the embedding (stage 0) and the head (the "
                                 "last stage) live on different peers")
    mixed_precision: Literal["none", "bf16"] = Field("none", description="bf16: on CUDA, compute under bf16 "
                                                     "autocast (weights and optimizer state stay float32); the CPU "
                                                     "always computes in float32")
    activation_checkpointing: bool = Field(False, description="llama: recompute each block in the backward "
                                           "instead of keeping its activations (less GPU memory, ~1/3 more compute)")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> "ModelConfig":
        if self.kind in ("transformer", "llama") and self.d_model % self.n_heads:
            raise CrossFieldError(("d_model", "n_heads"),
                                  f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")
        return self

    @model_validator(mode="after")
    def _llama_shapes(self) -> "ModelConfig":
        if self.kind != "llama":
            return self
        if self.n_heads % self.kv_heads:
            raise CrossFieldError(("n_kv_heads", "n_heads"), f"n_kv_heads ({self.n_kv_heads}) must divide n_heads "
                                  f"({self.n_heads}): each key/value head serves n_heads / n_kv_heads query heads")
        if (self.d_model // self.n_heads) % 2:
            raise CrossFieldError(("d_model", "n_heads"), f"the head width d_model / n_heads ({self.d_model} / "
                                  f"{self.n_heads}) must be even for rotary positions: change d_model or n_heads")
        if self.tie_embeddings:
            raise CrossFieldError(("tie_embeddings",), "tie_embeddings: the embedding (stage 0) and the head (the "
                                  "last stage) are trained on different peers and cannot share weights: set "
                                  "tie_embeddings: false")
        return self

    @property
    def language_model(self) -> bool:
        """Next-token targets per position (transformer, llama), not one class per sample (mlp)."""
        return self.kind in ("transformer", "llama")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def llama_ffn_dim(self) -> int:
        """ffn_dim, or Llama's default: 2/3 of 4 d_model, rounded up to a multiple of multiple_of."""
        if self.ffn_dim is not None:
            return self.ffn_dim
        hidden = int(2 * 4 * self.d_model / 3)
        return self.multiple_of * -(-hidden // self.multiple_of)
