"""volunteer/preflight.py as plain functions: what a node checks before it joins (no processes, no network)."""

from __future__ import annotations

import numpy as np
import pytest

from swarm.run.runconfig import RunConfig
from volunteer.preflight import PreflightError, check_run, needs_data


def run_of(**sections) -> RunConfig:
    return RunConfig.model_validate({"name": "t", **sections})


@pytest.mark.parametrize("sections, says", [
    ({"model": {"input_dim": 32}}, "has 64 features; set model.input_dim to 64"),
    ({"model": {"num_classes": 5}}, "model.num_classes (5) must exceed the largest label"),
    ({"data": {"source": "npz", "path": "/nonexistent/x.npz"}}, "data.path '/nonexistent/x.npz' does not exist"),
    ({"data": {"shards": 4096}}, "data.shards (4096) exceeds"),
    ({"model": {"kind": "transformer"}}, "needs model.kind 'mlp'"),
])
def test_a_run_whose_model_does_not_fit_its_data_is_refused_with_the_field(sections, says):
    with pytest.raises(PreflightError) as caught:
        check_run(run_of(**sections), "auto")
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_an_npz_of_other_width_names_the_input_dim_to_set(tmp_path):
    path = tmp_path / "mine.npz"
    np.savez(path, X=np.zeros((40, 20), dtype=np.float32), y=np.arange(40) % 4)
    with pytest.raises(PreflightError, match="has 20 features; set model.input_dim to 20"):
        check_run(run_of(data={"source": "npz", "path": str(path)}), "layer0")
    check_run(run_of(data={"source": "npz", "path": str(path)}, model={"input_dim": 20, "num_classes": 4}), "layer0")


def test_the_shipped_kinds_chain_and_fit_their_data():
    check_run(run_of(), "auto")
    check_run(run_of(model={"kind": "transformer", "stages": 3, "activation": "gelu", "d_model": 32, "d_ff": 64,
                            "seq_len": 16}, data={"source": "text"}), "auto")


def test_only_nodes_that_read_the_data_need_it():
    run = run_of(model={"stages": 4})
    assert [needs_data(run, s) for s in ("auto", "layer0", "layer1", "layer2", "layer3")] == [
        True, True, False, False, True]
    assert needs_data(run_of(averaging={"exchange": {"every_samples": 100}}), "layer1")
    # a middle stage of a run whose data file it does not hold still serves
    check_run(run_of(data={"source": "npz", "path": "/nonexistent/x.npz"}), "layer1")
