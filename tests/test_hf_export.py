"""A llama run's stages exported as a folder that transformers loads, with the logits of the stages chained."""

from __future__ import annotations

import json

import pytest
import torch

from swarm.run.hf_export import (
    HFExportError, hf_state_dict, read_hf_dir, stage_states_from_hf, write_hf_dir,
)
from swarm.run.models import assemble, build_stage, build_stages
from swarm.run.runconfig import ModelConfig
from swarm.run.tokenizer import BUNDLED_TOKENIZER

transformers = pytest.importorskip("transformers")

MODEL = ModelConfig(kind="llama", stages=3, blocks_per_stage=2, d_model=64, n_heads=4, n_kv_heads=2,
                    vocab_size=2048, seq_len=32, seed=11, rope_theta=500000.0)
LOGITS_ATOL = 1e-4


def _trained_a_little(model: ModelConfig) -> list[torch.nn.Module]:
    """Stages moved off their initialisation (RMSNorm weights of 1 would hide a swapped norm)."""
    stages = build_stages(model)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(3)
        for stage in stages:
            for param in stage.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.01)
    return [stage.eval() for stage in stages]


def test_transformers_loads_the_export_and_computes_the_same_logits(tmp_path):
    stages = _trained_a_little(MODEL)
    files = write_hf_dir(tmp_path, MODEL, [stage.state_dict() for stage in stages], BUNDLED_TOKENIZER)
    assert sorted(f.name for f in files) == ["config.json", "model.safetensors", "tokenizer.json",
                                             "tokenizer_config.json"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(loaded).__name__ == "LlamaForCausalLM"
    ids = torch.randint(0, MODEL.vocab_size, (2, MODEL.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = assemble(stages)(ids)
        theirs = loaded(input_ids=ids).logits
    assert theirs.shape == ours.shape
    diff = float((ours - theirs).abs().max())
    assert diff < LOGITS_ATOL, f"max |logit difference| {diff}"
    assert sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for s in stages for p in s.parameters())


def test_autotokenizer_loads_the_runs_tokenizer_and_encodes_as_ours(tmp_path):
    from tokenizers import Tokenizer

    write_hf_dir(tmp_path, MODEL, [build_stage(MODEL, k).state_dict() for k in range(MODEL.stages)], BUNDLED_TOKENIZER)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = Tokenizer.from_file(str(BUNDLED_TOKENIZER))
    text = "def main():\n    return sorted(items, key=len)  # ünïcode"
    assert theirs(text)["input_ids"] == ours.encode(text).ids
    assert theirs.decode(ours.encode(text).ids) == text
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["eos_token_id"] == theirs.eos_token_id == 0


def test_the_folder_loads_back_into_our_own_modules_as_one_stage(tmp_path):
    stages = _trained_a_little(MODEL)
    write_hf_dir(tmp_path, MODEL, [stage.state_dict() for stage in stages], BUNDLED_TOKENIZER)
    whole, tensors = read_hf_dir(tmp_path)
    assert (whole.stages, whole.blocks_per_stage, whole.kv_heads, whole.rope_theta) == (1, 6, 2, 500000.0)
    single = build_stage(whole, 0)
    single.load_state_dict(stage_states_from_hf(whole, tensors)[0], strict=True)
    ids = torch.randint(0, MODEL.vocab_size, (1, 20))
    with torch.no_grad():
        assert torch.allclose(single.eval()(ids), assemble(stages)(ids), atol=1e-5)


def test_layer_names_count_across_stages_and_a_stranger_tensor_is_refused():
    states = [build_stage(MODEL, k).state_dict() for k in range(MODEL.stages)]
    names = hf_state_dict(MODEL, states)
    assert "model.layers.5.mlp.down_proj.weight" in names and "model.layers.6.mlp.down_proj.weight" not in names
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= set(names)
    assert torch.equal(names["model.layers.2.self_attn.q_proj.weight"], states[1]["layers.0.self_attn.q_proj.weight"])
    states[1]["extra.weight"] = torch.zeros(1)
    with pytest.raises(HFExportError, match="extra.weight"):
        hf_state_dict(MODEL, states)


def test_export_format_hf_refuses_a_run_that_is_not_llama_before_any_download(tmp_path):
    from volunteer.config import load_run
    from volunteer_cli.commands.export import _hf_export_checks
    from volunteer_cli.main import UserError

    with pytest.raises(UserError, match="use --format pt"):
        _hf_export_checks(load_run("charlm")[0], tmp_path / "out")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="writes a folder"):
        _hf_export_checks(load_run("llm-tiny")[0], tmp_path / "file")
    assert _hf_export_checks(load_run("llm-tiny")[0], tmp_path / "out") == BUNDLED_TOKENIZER


def test_evaluation_chunks_keep_a_large_vocabularys_logits_bounded():
    from swarm.run.models import EVAL_BATCH_MAX, EVAL_BYTES_MAX, eval_batch

    big = MODEL.model_copy(update={"vocab_size": 32768, "seq_len": 1024, "d_model": 768, "n_heads": 12})
    one_sequence = 1024 * 32768 * 4  # 128 MiB of logits: a chunk never holds less than one sequence
    assert eval_batch(big, wide=True) * one_sequence <= max(EVAL_BYTES_MAX, one_sequence)
    assert eval_batch(big.model_copy(update={"seq_len": 64}), wide=True) * 64 * 32768 * 4 <= EVAL_BYTES_MAX
    assert eval_batch(big) > eval_batch(big, wide=True) >= 1
    assert eval_batch(ModelConfig(kind="mlp")) == EVAL_BATCH_MAX
    assert eval_batch(ModelConfig(kind="transformer"), wide=True) == EVAL_BATCH_MAX, "charlm keeps its chunks"
