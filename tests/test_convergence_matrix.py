"""The live convergence matrix's own logic (benchmarks/convergence_swarm.py), without a swarm: the cells'
run configs are valid runs, repeats combine into a mean and a range, and divergence is judged per kind."""

from __future__ import annotations

import pytest

from benchmarks.convergence_swarm import DIVERGED_BPB, _diverged, cell_config, combine
from swarm.run.runconfig import RunConfig


@pytest.mark.parametrize("mode", ["none", "dpwa", "exchange", "dsgd", "pdmm_isvr", "admm_isvr"])
def test_every_digits_cell_is_a_valid_run(mode):
    config = cell_config("x", "sgd" if mode in ("dsgd", "pdmm_isvr", "admm_isvr") else "adam", mode, "label_skewed",
                         4, 2, fetch_probability=0.3)
    run = RunConfig.model_validate(config)
    assert run.data.shards == 4 and run.model.stages == 2
    assert run.averaging.fetch_probability == 0.3
    assert (run.averaging.exchange.every_samples > 0) == (mode == "exchange")


def test_a_charlm_cell_trains_the_shipped_corpus_in_the_cells_stages():
    run = RunConfig.model_validate(cell_config("x", "adamw", "dpwa", "iid", 2, 2, run="charlm"))
    shipped = RunConfig.model_validate({**__import__("yaml").safe_load(open("configs/runs/charlm.yaml")),
                                        "bootstrap_peers": []})
    assert run.model.kind == "transformer" and run.model.stages == 2
    assert run.data.sha256 == shipped.data.sha256 and run.optimizer.name == "adamw"


def test_an_llm_tiny_cell_trains_the_shipped_model_with_its_own_optimizer_and_batch():
    import yaml

    run = RunConfig.model_validate(cell_config("x", "adamw", "none", "iid", 1, 2, run="llm-tiny"))
    shipped = yaml.safe_load(open("configs/runs/llm-tiny.yaml"))
    assert run.model.kind == "llama" and run.model.stages == 2
    assert run.data.tokenizer_sha256 == shipped["data"]["tokenizer_sha256"]
    assert run.training.batch_size == shipped["training"]["batch_size"]
    assert run.optimizer.lr == shipped["optimizer"]["lr"]
    # bits per byte, as one process reports them: diverged is judged against a uniform guess over its tokens
    assert not _diverged({"final_bits_per_byte_max": 1.4}, lm=True, chance_bits=3.04)
    assert _diverged({"final_bits_per_byte_max": 2.9}, lm=True, chance_bits=3.04)


def test_repeats_give_the_mean_and_range_at_points_every_run_reached():
    runs = [{"ratios": {"10000": 0.9, "30000": 0.96}, "final_accuracy_min": 0.93, "lost": 1, "heals": 0},
            {"ratios": {"10000": 0.8, "30000": 0.98}, "final_accuracy_min": 0.91, "lost": 0, "heals": 2},
            {"ratios": {"10000": 0.7}, "final_accuracy_min": 0.6, "lost": 0, "heals": 0},
            {"error": "TimeoutError: the swarms after layer0 online"}]
    cell = combine(runs)
    assert cell["ratios"] == {"10000": pytest.approx(0.8)}  # the third run never reached 30k
    assert cell["ratio_ranges"] == {"10000": [0.7, 0.9]}
    assert cell["final_accuracy_min"] == 0.6 and cell["lost"] == 1 and cell["heals"] == 2
    assert len(cell["runs"]) == 4
    assert combine([{"error": "x"}]) == {"error": "x"}


def test_divergence_is_low_accuracy_for_digits_and_no_learning_for_charlm():
    assert _diverged({"final_accuracy_min": 0.15}, lm=False) and not _diverged({"final_accuracy_min": 0.9}, lm=False)
    assert not _diverged({"final_accuracy_min": 0.48, "curve": [(10_000, 0.5, 1.0, 4)]}, lm=False), \
        "5 classes of 10 per shard without averaging top out near 0.5"
    assert _diverged({"final_accuracy_min": 0.4, "curve": [(10_000, 0.9, 1.0, 4), (20_000, 0.4, 2.0, 4)]}, lm=False)
    assert _diverged({"final_bits_per_byte_max": DIVERGED_BPB + 0.1}, lm=True)
    assert _diverged({"final_bits_per_byte_max": float("nan")}, lm=True)
    assert not _diverged({"final_bits_per_byte_max": 2.8}, lm=True)


def test_the_window_ratio_averages_the_samples_near_a_point_that_saw_every_chain():
    from benchmarks.convergence_swarm import _compare

    class Flat:
        def accuracy(self, config, samples):
            return 0.9

    curve = [(2_000, 0.9, 1.0, 2), (8_500, 0.6, 2.0, 4), (10_100, 0.72, 3.0, 4), (11_900, 0.81, 4.0, 4),
             (12_500, 0.2, 5.0, 4), (11_000, 0.1, 3.5, 3)]
    out = _compare({"curve": curve}, {}, (10_000,), Flat())
    assert out["ratios"]["10000"] == pytest.approx(0.8)  # the first sample at or after the point
    assert out["window_ratios"]["10000"] == pytest.approx((0.6 + 0.72 + 0.81) / 3 / 0.9)  # 3 chains, 12.5k: out
