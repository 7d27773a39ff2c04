"""Best-model exchange scored on shared data: the validation split and the scoring, without a network."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from swarm.averaging.validation import score_copies, validation_subset
from swarm.run.data import load_dataset, make_shards
from swarm.ecl.gossip import SgdNode, ValidatedExchange
from swarm.ecl.graph import build_graph
from swarm.run.models import assemble, build_stage, build_stages, loss_fn
from swarm.run.runconfig import DataConfig, ModelConfig, RunConfig

MLP = ModelConfig(kind="mlp", stages=4, input_dim=64, num_classes=10)


def test_the_validation_split_is_held_out_of_training_and_leaves_the_test_split_as_it_was():
    data = DataConfig(source="digits")
    dataset = load_dataset(data, MLP)
    without = load_dataset(DataConfig(source="digits", validation_fraction=0.0), MLP)
    assert torch.equal(dataset.x_test, without.x_test), "the published test split does not move"
    assert len(dataset.x_train) + len(dataset.x_val) == len(without.x_train) and len(without.x_val) == 0
    rows = lambda x: {tuple(r) for r in x.numpy().round(4).tolist()}
    assert not rows(dataset.x_val) & rows(dataset.x_test), "never the test split"
    counts = np.bincount(dataset.y_val.numpy(), minlength=10)
    assert counts.min() >= 15, f"every class is in it: {counts}"
    again = load_dataset(data, MLP)
    assert torch.equal(again.x_val, dataset.x_val), "every volunteer has the same one"
    shards = make_shards(dataset.y_train, DataConfig(source="digits", shards=4), 10)
    assert sum(len(s) for s in shards) == len(dataset.y_train), "shards cut the train split only"


def test_a_text_corpus_holds_out_the_sequences_before_its_test_tail(tmp_path):
    corpus = bytes(range(256)) * 8
    path = tmp_path / "corpus.txt"
    path.write_bytes(corpus)
    lm = ModelConfig(kind="transformer", seq_len=8, vocab_size=256, d_model=8, n_heads=2, d_ff=8)
    dataset = load_dataset(DataConfig(source="text", path=str(path), test_fraction=0.1, validation_fraction=0.1), lm)
    n = len(corpus) // 9
    assert len(dataset.x_train) + len(dataset.x_val) + len(dataset.x_test) == n
    assert len(dataset.x_val) == round(0.1 * n)
    first_val = len(dataset.x_train)
    assert dataset.x_val[0, 0].item() == corpus[first_val * 9] and dataset.y_val[0, -1].item() == corpus[first_val * 9 + 8]


def test_exchange_without_a_validation_split_is_refused_with_the_fields_to_change():
    with pytest.raises(ValueError, match="validation_fraction"):
        RunConfig(name="x", data={"validation_fraction": 0.0}, averaging={"exchange": {"every_samples": 1000}})
    with pytest.raises(ValueError, match="leave less than 10 %"):
        DataConfig(test_fraction=0.5, validation_fraction=0.45)


def test_a_middle_layer_is_scored_with_the_rest_of_the_pipeline_as_the_whole_model_would_be():
    dataset = load_dataset(DataConfig(source="digits"), MLP)
    x, y = validation_subset(dataset.x_val, dataset.y_val, 64)
    stages = build_stages(MLP)
    torch.manual_seed(1)
    other = {k: v + 0.3 * torch.randn_like(v) for k, v in stages[1].state_dict().items()}
    broken = {k: torch.full_like(v, math.nan) for k, v in stages[1].state_dict().items()}
    scores = score_copies(MLP, stages[:1], build_stage(MLP, 1), {"own": stages[1].state_dict(), "other": other,
                                                                 "broken": broken}, stages[2:], x, y)
    with torch.no_grad():
        expected = loss_fn(MLP, assemble(stages).eval()(x), y).item()
        stages[1].load_state_dict(other)
        expected_other = loss_fn(MLP, assemble(stages).eval()(x), y).item()
    assert scores["own"].loss == pytest.approx(expected, rel=1e-5)
    assert scores["other"].loss == pytest.approx(expected_other, rel=1e-5)
    assert scores["broken"].loss == math.inf, "a copy that breaks scores worst"
    assert 0.0 <= scores["own"].accuracy <= 1.0
    with pytest.raises(ValueError, match="validation_fraction"):
        validation_subset(dataset.x_val[:0], dataset.y_val[:0], 64)


def test_the_validation_rule_adopts_the_copy_that_is_better_on_shared_data_not_the_one_that_fits_its_shard():
    # Two nodes: "a" fits its own shard (low training loss, bad on the shared set), "b" is the general
    # copy. The reported-loss rule would give "b" the copy of "a"; the validation rule does the reverse.
    graph = build_graph("ring", ["a", "b"], 1, 0)
    nodes = {"a": SgdNode("a", torch.tensor([2.0]), graph, lr=0.1), "b": SgdNode("b", torch.tensor([0.1]), graph, lr=0.1)}
    hook = ValidatedExchange(4, 4, score=lambda p: float(p.abs()), candidates=1, margin=0.02)
    hook(0, nodes, {"a": 0.01, "b": 1.0})
    assert float(nodes["a"].params) == pytest.approx(0.1) and float(nodes["b"].params) == pytest.approx(0.1)
    assert hook.adoptions == 1 and hook.exchanges == 2
