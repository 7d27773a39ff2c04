"""`volunteer export` scores the candidate copies itself (volunteer_cli/commands/export_choice.py): a record that
claims the lowest loss is only a candidate; a copy that does worse on the validation split is not exported."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from swarm.run.data import load_dataset
from swarm.run.models import assemble, build_stage, build_stages, loss_fn
from swarm.run.runconfig import RunConfig
from volunteer_cli.commands.export_choice import choose_copies, measure


def test_the_exporter_keeps_the_copy_that_scores_better_here_whatever_the_records_claim():
    run = RunConfig.model_validate({"name": "exportpick", "model": {"stages": 2, "hidden_dim": 32}})
    stages, data = build_stages(run.model), load_dataset(run.data, run.model)
    model = assemble(stages)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(150):  # a copy that learned something
        rows = torch.randint(0, len(data.x_train), (32,), generator=torch.Generator().manual_seed(step))
        loss = loss_fn(run.model, model(data.x_train[rows]), data.y_train[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    good = [stage.state_dict() for stage in stages]
    garbage = {k: torch.randn_like(v) * 3 for k, v in build_stage(run.model, 1).state_dict().items()}
    liar, honest = SimpleNamespace(peer_id="QmLiar000000"), SimpleNamespace(peer_id="QmHonest0000")
    # the liar's record claimed the lowest loss, so it is the first candidate of layer1
    delivered = {"layer0": [(honest, good[0])], "layer1": [(liar, garbage), (honest, good[1])]}
    states, donors, notes = choose_copies(run, delivered)
    assert donors["layer1"] is honest and donors["layer0"] is honest
    assert len(notes) == 1 and notes[0].startswith("layer1: ar000000") and "nest0000" in notes[0]  # last 8
    figures = measure(run, states)
    assert figures["test_accuracy"] > 0.5 and figures["test_samples"] > 0
