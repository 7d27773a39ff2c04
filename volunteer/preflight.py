"""What can be checked before a node joins the DHT, each failure one line with the field and the fix.

A mistake found after the join costs the volunteer 10-60 s, a traceback, and litter: the run is
listed under its name in the DHT, and every later joiner of that name is warned about it. So a
node checks here first, and announces nothing until these pass:

- ``check_run``: the data loads, the model's stages chain, and the head fits the labels.
"""

from __future__ import annotations

from typing import Any

CHAIN_CHECK_BATCH = 2  # samples pushed through the stages to check that they chain


class PreflightError(ValueError):
    """A check before joining failed; the message names what to change and how."""


def _reason(exc: OSError) -> str:
    return exc.strerror or exc.__class__.__name__


# ----- the run's model against its data
def needs_data(run: Any, swarm: str) -> bool:
    """Whether a node of ``swarm`` loads the run's data: layer0 drives with it, the last stage looks its labels
    up, best-model exchange scores copies on it; an auto node may move to any swarm."""
    last = f"layer{run.model.stages - 1}"
    return swarm in ("auto", "layer0", last) or run.averaging.exchange.every_samples > 0


def check_run(run: Any, swarm: str) -> None:
    """The stages chain, and (where this node needs the data) the data loads, cuts into the run's shards, and
    fits the first stage's input and the head. Raises PreflightError with the field and the fix."""
    check_stages_chain(run.model)
    if not needs_data(run, swarm):
        return
    from swarm.run.data import load_dataset, make_shards

    try:
        dataset = load_dataset(run.data, run.model)
        make_shards(dataset.y_train, run.data, dataset.num_classes)
    except ValueError as exc:
        raise PreflightError(str(exc)) from None
    except OSError as exc:
        raise PreflightError(f"data.path {run.data.path!r}: cannot read it ({_reason(exc)})") from None
    check_data_fits(run.model, dataset)


def check_stages_chain(model: Any) -> None:
    """Push a small batch through every stage, built one at a time on the CPU: each stage must take the one
    before's output and the last must give the run's logits. (The shipped models take tens of ms; the meta
    device would need no weights, but its first use costs a join 0.5-2 s of imports.)"""
    import torch

    from swarm.run.models import build_stage, stage_input_spec, stage_output_spec

    with torch.no_grad():
        x = stage_input_spec(model, 0).example(CHAIN_CHECK_BATCH)
        for index in range(model.stages):
            problem = stage_input_spec(model, index, CHAIN_CHECK_BATCH).mismatch(x)
            if problem:
                raise PreflightError(f"model: stage {index} cannot take stage {index - 1}'s output ({problem}); "
                                     "check model.kind and its widths")
            try:
                x = build_stage(model, index).eval()(x)
            except RuntimeError as exc:
                raise PreflightError(f"model: stage {index} fails on its own input ({exc}); check model.kind and "
                                     "its widths") from None
        problem = stage_output_spec(model, model.stages - 1, CHAIN_CHECK_BATCH).mismatch(x)
        if problem:
            raise PreflightError(f"model: the last stage returns {problem}; check model.num_classes / vocab_size")


def check_data_fits(model: Any, dataset: Any) -> None:
    """The first stage takes the data's samples, and the head has an output for every label."""
    from swarm.run.models import stage_input_spec, stage_output_spec

    problem = stage_input_spec(model, 0).mismatch(dataset.x_train[:1])
    if problem:
        raise PreflightError(f"the data's samples do not fit the first stage ({problem}); "
                             "set model.input_dim (or model.seq_len) to the data's")
    outputs = stage_output_spec(model, model.stages - 1).shape[-1]
    largest = int(max(dataset.y_train.max(), dataset.y_test.max())) if len(dataset.y_train) else -1
    if largest >= outputs:
        field = "model.num_classes" if model.kind == "mlp" else "model.vocab_size"
        raise PreflightError(f"the data has labels up to {largest} but the head has {outputs} outputs; "
                             f"set {field} to at least {largest + 1}")
