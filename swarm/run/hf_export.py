"""A llama run's stages as a folder that transformers loads (``AutoModelForCausalLM.from_pretrained(DIR)``).

The folder: ``config.json`` (LlamaConfig's fields), ``model.safetensors`` (the stages' tensors under
LlamaForCausalLM's names), ``tokenizer.json`` (the run's, copied) and ``tokenizer_config.json``. Nothing here
imports transformers: the names are a plain mapping (a stage's ``layers.i.`` is the model's
``model.layers.{k * blocks_per_stage + i}.``), and the reverse mapping lets ``volunteer generate`` load such a
folder into our own modules as one stage holding every layer.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from swarm.run.runconfig import ModelConfig

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
TOKENIZER_FILE, TOKENIZER_CONFIG_FILE = "tokenizer.json", "tokenizer_config.json"
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class HFExportError(ValueError):
    """The stages or the folder do not make (or are not) a Llama model of this shape."""


def hf_config(model: ModelConfig, end_of_text: int | None) -> dict:
    """config.json: LlamaConfig's fields for this run's model (transformers 4.x and 5.x read them)."""
    if model.kind != "llama":
        raise HFExportError(f"only model.kind llama exports to transformers (this run's is {model.kind})")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": model.vocab_size, "hidden_size": model.d_model, "intermediate_size": model.llama_ffn_dim,
        "num_hidden_layers": model.stages * model.blocks_per_stage, "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.kv_heads, "head_dim": model.d_model // model.n_heads, "hidden_act": "silu",
        "max_position_embeddings": model.seq_len, "rms_norm_eps": model.rms_norm_eps, "rope_theta": model.rope_theta,
        "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "tie_word_embeddings": False, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": end_of_text, "eos_token_id": end_of_text, "torch_dtype": "float32",
    }


def model_config_from_hf(config: Mapping) -> ModelConfig:
    """The one-stage ModelConfig that holds every layer of a Llama config.json (for ``volunteer generate``)."""
    if config.get("model_type") != "llama":
        raise HFExportError(f"{CONFIG_FILE}: model_type {config.get('model_type')!r}, expected 'llama'")
    rope_theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    try:
        return ModelConfig(
            kind="llama", stages=1, blocks_per_stage=config["num_hidden_layers"], vocab_size=config["vocab_size"],
            d_model=config["hidden_size"], n_heads=config["num_attention_heads"],
            n_kv_heads=config.get("num_key_value_heads"), ffn_dim=config["intermediate_size"],
            seq_len=config["max_position_embeddings"], rope_theta=rope_theta,
            rms_norm_eps=config.get("rms_norm_eps", 1e-5), tie_embeddings=bool(config.get("tie_word_embeddings")),
        )
    except (KeyError, ValueError) as exc:
        raise HFExportError(f"{CONFIG_FILE} is not a Llama config this client can build: {exc}") from None


def hf_state_dict(model: ModelConfig, stage_states: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM's state dict assembled from the stages' state dicts (stage order)."""
    if len(stage_states) != model.stages:
        raise HFExportError(f"{len(stage_states)} stage state(s) for model.stages {model.stages}")
    out: dict[str, torch.Tensor] = {}
    for index, state in enumerate(stage_states):
        for key, tensor in state.items():
            out[_hf_name(model, index, key)] = tensor.detach().to("cpu", torch.float32).contiguous()
    return out


def _hf_name(model: ModelConfig, index: int, key: str) -> str:
    layer = _LAYER_KEY.match(key)
    if layer:
        local = int(layer.group(1))
        if local >= model.blocks_per_stage:
            raise HFExportError(f"stage {index}: {key} is past model.blocks_per_stage ({model.blocks_per_stage})")
        return f"model.layers.{index * model.blocks_per_stage + local}.{layer.group(2)}"
    if key.startswith(("embed_tokens.", "norm.")):
        return f"model.{key}"
    if key.startswith("lm_head."):
        return key
    raise HFExportError(f"stage {index}: {key} is not a Llama tensor")


def stage_states_from_hf(model: ModelConfig, hf_state: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The reverse of hf_state_dict: each stage's state dict, from LlamaForCausalLM's names."""
    states: list[dict[str, torch.Tensor]] = [{} for _ in range(model.stages)]
    for name, tensor in hf_state.items():
        layer = _HF_LAYER_KEY.match(name)
        if layer:
            index, local = divmod(int(layer.group(1)), model.blocks_per_stage)
            if index >= model.stages:
                raise HFExportError(f"{name}: the model has {model.stages * model.blocks_per_stage} layers")
            states[index][f"layers.{local}.{layer.group(2)}"] = tensor
        elif name.startswith("model.embed_tokens."):
            states[0][name.removeprefix("model.")] = tensor
        elif name.startswith("model.norm."):
            states[-1][name.removeprefix("model.")] = tensor
        elif name.startswith("lm_head."):
            states[-1][name] = tensor
        # anything else (a rotary buffer some versions save) is not a parameter of ours
    return states


def write_hf_dir(out: Path, model: ModelConfig, stage_states: list[Mapping[str, torch.Tensor]],
                 tokenizer_file: Path) -> list[Path]:
    """Write the folder (created if missing); returns the files written."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    from swarm.run.tokenizer import end_of_text_id, hf_tokenizer_config

    tensors = hf_state_dict(model, stage_states)
    end_of_text = end_of_text_id(Tokenizer.from_file(str(tokenizer_file)))
    out.mkdir(parents=True, exist_ok=True)
    files = [out / CONFIG_FILE, out / WEIGHTS_FILE, out / TOKENIZER_FILE, out / TOKENIZER_CONFIG_FILE]
    files[0].write_text(json.dumps(hf_config(model, end_of_text), indent=2) + "\n")
    save_file(tensors, str(files[1]), metadata={"format": "pt"})
    shutil.copyfile(tokenizer_file, files[2])
    files[3].write_text(json.dumps(hf_tokenizer_config(model.seq_len), indent=2) + "\n")
    return files


def read_hf_dir(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(one-stage ModelConfig, LlamaForCausalLM state dict) of an exported folder, without transformers."""
    from safetensors.torch import load_file

    config_file, weights_file = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    for file in (config_file, weights_file):
        if not file.is_file():
            raise HFExportError(f"{folder}: no {file.name} (make the folder with `volunteer export --format hf`)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise HFExportError(f"{config_file}: not readable JSON ({exc})") from None
    return model_config_from_hf(config), load_file(str(weights_file))
