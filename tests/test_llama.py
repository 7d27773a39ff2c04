"""model.kind llama: stages that chain, seed alone, train, keep float32 master weights under bf16 autocast,
and whose state dicts carry transformers' LlamaForCausalLM names."""

import pytest
import torch
from pydantic import ValidationError

from swarm.run.llama import LlamaStage, apply_rotary, autocast_context
from swarm.run.models import assemble, build_stage, build_stages, loss_fn, stage_input_spec, stage_output_spec
from swarm.run.runconfig import ModelConfig

LLAMA = ModelConfig(kind="llama", stages=3, blocks_per_stage=2, d_model=32, n_heads=4, n_kv_heads=2,
                    vocab_size=300, seq_len=16, seed=5)
BATCH = 3


def _ids(model: ModelConfig = LLAMA, batch: int = BATCH) -> torch.Tensor:
    return stage_input_spec(model, 0).example(batch, torch.Generator().manual_seed(0), high=model.vocab_size)


def test_stages_chain_through_their_specs_and_give_float32_logits():
    x = _ids()
    for index, stage in enumerate(build_stages(LLAMA)):
        assert stage_input_spec(LLAMA, index).mismatch(x) is None
        x = stage(x)
        assert stage_output_spec(LLAMA, index, BATCH).mismatch(x) is None
    assert x.shape == (BATCH, LLAMA.seq_len, LLAMA.vocab_size)


def test_a_stage_built_alone_has_the_weights_it_has_among_all():
    together = build_stages(LLAMA)
    for index in range(LLAMA.stages):
        alone = build_stage(LLAMA, index).state_dict()
        assert alone.keys() == together[index].state_dict().keys()
        assert all(torch.equal(alone[k], together[index].state_dict()[k]) for k in alone)
    other_seed = build_stage(LLAMA.model_copy(update={"seed": 6}), 1).state_dict()
    key = "layers.0.self_attn.q_proj.weight"
    assert not torch.equal(other_seed[key], together[1].state_dict()[key])


def test_the_state_dicts_use_llamas_names_and_the_ends_hold_embedding_and_head():
    first, middle, last = (set(stage.state_dict()) for stage in build_stages(LLAMA))
    block = {f"layers.{i}.{name}" for i in range(2) for name in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
        "input_layernorm.weight", "post_attention_layernorm.weight")}
    assert first == block | {"embed_tokens.weight"}
    assert middle == block
    assert last == block | {"norm.weight", "lm_head.weight"}
    k_proj = build_stage(LLAMA, 1).layers[0].self_attn.k_proj.weight
    assert k_proj.shape == (2 * 8, 32), "grouped-query attention: n_kv_heads x head_dim key outputs"


def test_attention_is_causal_a_later_token_never_changes_an_earlier_output():
    model = LLAMA.model_copy(update={"stages": 1})
    stage = build_stage(model, 0).eval()
    x = _ids(model, 1)
    changed = x.clone()
    changed[0, -1] = (x[0, -1] + 1) % model.vocab_size
    with torch.no_grad():
        a, b = stage(x), stage(changed)
    assert torch.allclose(a[:, :-1], b[:, :-1], atol=1e-6)
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_rotary_keeps_norms_and_position_zero():
    x = torch.randn(1, 2, 5, 8)
    cos, sin = build_stage(LLAMA, 0).rotary(5, torch.device("cpu"))
    rotated = apply_rotary(x, cos, sin)
    assert torch.allclose(rotated.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert torch.allclose(rotated[:, :, 0], x[:, :, 0])


def test_a_few_steps_lower_the_loss_of_the_assembled_stages():
    model = LLAMA.model_copy(update={"vocab_size": 16})
    net = assemble(build_stages(model))
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3)
    x = torch.arange(BATCH * model.seq_len).view(BATCH, -1) % 16  # a counting pattern: next token = +1
    y = (x + 1) % 16
    losses = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: a second thread only spins, 20x slower on a loaded 2-core machine
    try:
        for _ in range(30):
            loss = loss_fn(model, net(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    assert losses[-1] < 0.5 * losses[0]


def test_bf16_autocast_computes_in_bf16_but_keeps_float32_weights_grads_and_outputs():
    model = LLAMA.model_copy(update={"mixed_precision": "bf16"})
    stage = build_stage(model, 1)
    assert not torch.is_autocast_enabled("cpu")
    with autocast_context("cpu", "bf16"):
        assert not torch.is_autocast_enabled("cpu"), "the CPU computes in float32 unless forced"
    stage.force_autocast = True
    seen = []
    stage.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    x = torch.randn(BATCH, model.seq_len, model.d_model, requires_grad=True)
    out = stage(x)
    assert seen == [torch.bfloat16], "the block computed under bf16 autocast"
    assert out.dtype == torch.float32, "the wire and the next stage see float32"
    out.square().mean().backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in stage.parameters())
    assert x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()
    reference = build_stage(model, 1)
    assert torch.allclose(reference(x), out, atol=0.1), "bf16 stays close to the float32 result"


def test_activation_checkpointing_gives_the_same_gradients():
    plain = build_stage(LLAMA, 1)
    recomputed = build_stage(LLAMA.model_copy(update={"activation_checkpointing": True}), 1)
    x = torch.randn(BATCH, LLAMA.seq_len, LLAMA.d_model)
    for stage in (plain, recomputed):
        stage(x).square().mean().backward()
    for a, b in zip(plain.parameters(), recomputed.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6)


@pytest.mark.parametrize("update, field", [
    ({"n_kv_heads": 3}, "n_kv_heads"),
    ({"d_model": 36, "n_heads": 12}, "n_heads"),  # head width 3: odd, no rotary pairs
    ({"tie_embeddings": True}, "tie_embeddings"),
])
def test_bad_llama_shapes_are_refused_naming_the_field(update, field):
    with pytest.raises(ValidationError, match=field):
        ModelConfig(**{**LLAMA.model_dump(), **update})


def test_the_default_ffn_width_is_llamas_rule():
    assert LLAMA.llama_ffn_dim == 128  # 8/3 x 32 = 85.3, rounded up to a multiple of 64
    assert LLAMA.model_copy(update={"ffn_dim": 100}).llama_ffn_dim == 100
    assert isinstance(build_stage(LLAMA, 0), LlamaStage)
