"""The single-process reference trainer reaches the accuracy the distributed run is held to."""

from pathlib import Path

import pytest
import torch
import yaml

from swarm.run.local import evaluate, make_optimizer, train_local
from swarm.run.models import build_stages
from swarm.run.runconfig import OptimizerConfig, RunConfig

RUNS = Path(__file__).resolve().parents[1] / "configs" / "runs"


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models train faster on one thread, and the test machine is shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(name: str, **overrides) -> RunConfig:
    raw = yaml.safe_load((RUNS / f"{name}.yaml").read_text())
    for block, values in overrides.items():
        raw[block] = {**raw.get(block, {}), **values}
    return RunConfig.model_validate(raw)


def test_digits_mlp_reaches_95_percent_locally():
    result = train_local(_run("digits-mlp"), 40_000)
    assert result.accuracy >= 0.95
    assert result.test_loss < result.initial_test_loss and result.bits_per_char is None


def test_charlm_loss_falls_on_a_tiny_corpus(tmp_path):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    run = _run("charlm", data={"path": str(corpus), "test_fraction": 0.1, "sha256": None})  # its own corpus, unpinned
    result = train_local(run, 320)
    assert result.accuracy is None
    assert result.bits_per_char < result.initial_bits_per_char - 2.0


def test_train_local_is_reproducible_and_leaves_the_global_rng_alone():
    run = _run("digits-mlp")
    torch.manual_seed(5)
    state = torch.get_rng_state()
    first, second = train_local(run, 640, seed=1), train_local(run, 640, seed=1)
    assert torch.equal(torch.get_rng_state(), state)
    assert first.test_loss == second.test_loss


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_make_optimizer_uses_the_configured_learning_rate(name):
    stages = build_stages(_run("digits-mlp").model)
    optimizer = make_optimizer(stages[0].parameters(), OptimizerConfig(name=name, lr=0.125))
    assert optimizer.param_groups[0]["lr"] == 0.125


def test_evaluate_accepts_a_list_of_stages():
    from swarm.run.data import load_dataset

    run = _run("digits-mlp")
    accuracy, loss = evaluate(build_stages(run.model), load_dataset(run.data, run.model), run.model)
    assert 0.0 <= accuracy <= 1.0 and loss > 0.0
