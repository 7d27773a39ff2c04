"""Sampling text from an exported llama model with this client's own modules (no transformers needed).

No key/value cache: each new token runs the whole context (at most ``seq_len`` tokens, the positions the model
was trained on) through the model again, which is plenty for the small models a volunteer run exports and
keeps the code to the modules that trained them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def next_token(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator | None) -> int:
    """One token from a (vocab,) row of logits: the likeliest at temperature 0, else sampled from the softmax of
    logits / temperature over the ``top_k`` likeliest (0: all)."""
    if temperature <= 0:
        return int(logits.argmax())
    scaled = logits.float() / temperature
    if 0 < top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator))


@torch.no_grad()
def generate_ids(model: nn.Module, prompt: list[int], max_new_tokens: int, context: int, temperature: float = 0.8,
                 top_k: int = 0, stop: int | None = None, seed: int | None = None) -> list[int]:
    """The prompt's continuation (new ids only), ending early at ``stop``."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    device = next(model.parameters()).device
    ids = list(prompt)
    new: list[int] = []
    for _ in range(max_new_tokens):
        window = torch.tensor([ids[-context:]], dtype=torch.int64, device=device)
        token = next_token(model(window)[0, -1].cpu(), temperature, top_k, generator)
        if token == stop:
            break
        ids.append(token)
        new.append(token)
    return new


def load_own_model(folder: Path) -> tuple[nn.Module, int]:
    """(the folder's model as one LlamaStage in eval mode, its context length), from config.json and
    model.safetensors alone."""
    from swarm.run.hf_export import HFExportError, read_hf_dir, stage_states_from_hf
    from swarm.run.llama import LlamaStage

    config, tensors = read_hf_dir(folder)
    module = LlamaStage(config, 0)
    try:
        module.load_state_dict(stage_states_from_hf(config, tensors)[0], strict=True)
    except RuntimeError as exc:
        raise HFExportError(f"{folder}: its weights do not fit its config.json ({exc})") from None
    return module.eval(), config.seq_len
