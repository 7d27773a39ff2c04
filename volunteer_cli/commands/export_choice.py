"""Which copy of each layer `volunteer export` takes: measured here, not the records' claims (issue 25).

A record's loss is the peer's own claim (any key can publish one), so the copies the records rank best are only
the candidates: up to ``EXPORT_CANDIDATES`` per swarm are downloaded, and the exporter scores them itself on the
run's validation split (every volunteer has it; the test split stays for reporting): one swarm at a time, each
candidate in the chain of the others' current choices, the lower validation loss kept (``L x candidates`` passes,
not every combination). The chosen model's test figures are then measured here too and written into the file
(``measured``): what an export says of itself is a recomputation, never a record's claim.
"""

from __future__ import annotations

from typing import Any

EXPORT_CANDIDATES = 2  # copies per swarm downloaded and scored
VALIDATION_SAMPLES = 256  # as best-model exchange scores copies (exchange.validation_samples' default)


def chain_loss(run: Any, modules: list, x: Any, y: Any) -> float:
    """Mean loss of the chained ``modules`` on (x, y), in eval mode, without gradients."""
    import torch

    from swarm.run.models import eval_batch, loss_fn

    chunk, total = eval_batch(run.model, wide=True), 0.0  # a language model's logits stay within the chunk's bytes
    with torch.no_grad():
        for module in modules:
            module.eval()
        for start in range(0, len(x), chunk):
            h = x[start : start + chunk]
            for module in modules:
                h = module(h)
            total += float(loss_fn(run.model, h, y[start : start + chunk]).item()) * len(h)
    return total / max(len(x), 1)


def choose_copies(run: Any, delivered: dict[str, list[tuple[Any, dict]]]) -> tuple[dict, dict, list[str]]:
    """(states, donors, notes): per swarm the delivered candidate with the lowest validation loss in the chain of
    the other swarms' choices. ``delivered`` maps each swarm to its (record, state) pairs, best claim first."""
    from swarm.averaging.exchange import load_validation
    from swarm.run.models import build_stage

    def module(k: int, state: dict):
        stage = build_stage(run.model, k)
        stage.load_state_dict(state, strict=True)
        return stage

    names = run.swarm_names
    built = {name: [module(k, state) for _, state in delivered[name]] for k, name in enumerate(names)}
    choice = {name: 0 for name in names}
    notes: list[str] = []
    if any(len(options) > 1 for options in built.values()):
        x, y = load_validation(run, VALIDATION_SAMPLES)
        for name in names:
            if len(built[name]) < 2:
                continue
            losses = []
            for i in range(len(built[name])):
                chain = [built[n][i if n == name else choice[n]] for n in names]
                losses.append(chain_loss(run, chain, x, y))
            choice[name] = min(range(len(losses)), key=losses.__getitem__)
            notes.append(f"{name}: " + ", ".join(f"{delivered[name][i][0].peer_id[-8:]} {loss:.4f}"
                                                 for i, loss in enumerate(losses)))
    states = {name: delivered[name][choice[name]][1] for name in names}
    donors = {name: delivered[name][choice[name]][0] for name in names}
    return states, donors, notes


def measure(run: Any, states: dict) -> dict:
    """The exported model's test figures, computed here (swarm/run/local.py ``evaluate``)."""
    from swarm.run.data import load_dataset
    from swarm.run.local import evaluate
    from swarm.run.models import build_stage

    stages = []
    for k, name in enumerate(run.swarm_names):
        stage = build_stage(run.model, k)
        stage.load_state_dict(states[name], strict=True)
        stages.append(stage)
    dataset = load_dataset(run.data, run.model)
    accuracy, loss = evaluate(stages, dataset, run.model)
    return {"test_accuracy": accuracy, "test_loss": loss, "test_samples": len(dataset.x_test)}
