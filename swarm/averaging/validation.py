"""Scoring copies of one layer on the run's validation split, by the peer that may adopt one.

Best-model exchange (agent.py) compares copies by what they do on data every volunteer has: the
validation split of the run's data set (swarm/run/data.py; never the test split, never trained on).
The adopter measures every score itself, on parameters it pulled: a stranger's self-reported loss
never decides (a liar's copy scores what it is worth), and under label-skewed shards the copy with
the lowest training loss is the one with the easiest shard, not the best one.

A stage is one layer of a pipeline, so a copy of layer k has a validation loss only together with
copies of the other layers. The adopter builds that context itself (the decision):
- it pulls one copy of every other layer from a random online peer of that swarm (checked like any
  pull: names, shapes, dtypes, finite values, a norm within ``max_norm_ratio`` of the seeded layer);
- it runs the validation inputs through layers 0..k-1 once, then each copy of layer k (its own and
  every candidate) followed by the same layers k+1..L-1, and compares the mean cross-entropy.
Why this and not the alternatives:
- the same context for every copy makes it a paired comparison: which copy of layer k works better
  with the rest of the model as the swarms hold it now; a context slightly off moves every score alike;
- routing validation micro-batches through the live swarms would let the last stage's reply (taken
  on trust) and the routing decide, and would load every swarm with extra work;
- a first-order proxy on our own activations and gradients (no other layer) is cheap but only valid
  for small moves, and an exchange is a large one;
- the cost is small and paid rarely (once per ``exchange.every_samples``): L-1 pulls of one layer and
  (1 + candidates) forward passes over ``exchange.validation_samples`` samples.
What a hostile context can do: it never touches our copy; it can only bias the comparison, and a
copy it favours is still adopted through the bounded-influence rules (one bounded step at most),
with a fresh random context at the next exchange.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from swarm.run.models import loss_fn
from swarm.run.runconfig import ModelConfig

SCORE_BATCH = 128  # samples per forward pass while scoring (bounds the memory of a charlm context)


@dataclass(frozen=True, slots=True)
class Score:
    """A copy's mean validation loss (nats; inf when non-finite) and accuracy (None for a language model)."""

    loss: float
    accuracy: float | None


def validation_subset(x_val: torch.Tensor, y_val: torch.Tensor, max_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``max_samples`` validation samples: every peer scores on the same ones."""
    if len(x_val) == 0:
        raise ValueError("the run has no validation split: set data.validation_fraction above 0")
    return x_val[:max_samples], y_val[:max_samples]


@torch.no_grad()
def score_copies(model: ModelConfig, before: Sequence[nn.Module], scratch: nn.Module,
                 copies: Mapping[str, Mapping[str, torch.Tensor]], after: Sequence[nn.Module],
                 x: torch.Tensor, y: torch.Tensor) -> dict[str, Score]:
    """Each copy of one layer loaded into ``scratch`` between the context layers ``before`` and
    ``after``, scored on (x, y). The inputs to the layer are computed once for all copies."""
    modules = [*before, scratch, *after]
    was_training = [m.training for m in modules]
    for module in modules:
        module.eval()
    try:
        inputs = [_through(before, x[i : i + SCORE_BATCH]) for i in range(0, len(x), SCORE_BATCH)]
        scores = {}
        for name, state in copies.items():
            scratch.load_state_dict(state)
            scores[name] = _score(model, scratch, after, inputs, y)
        return scores
    finally:
        for module, training in zip(modules, was_training):
            module.train(training)


def _through(modules: Sequence[nn.Module], h: torch.Tensor) -> torch.Tensor:
    for module in modules:
        h = module(h)
    return h


def _score(model: ModelConfig, layer: nn.Module, after: Sequence[nn.Module], inputs: list[torch.Tensor],
           y: torch.Tensor) -> Score:
    loss_sum, correct, count, start = 0.0, 0, 0, 0
    for h in inputs:
        targets = y[start : start + len(h)]
        start += len(h)
        logits = _through(after, layer(h))
        loss_sum += loss_fn(model, logits, targets).item() * len(h)
        correct += int((logits.argmax(-1) == targets).sum().item())
        count += targets.numel()
    loss = loss_sum / max(1, start)
    accuracy = correct / count if model.kind == "mlp" and count else None
    return Score(loss if math.isfinite(loss) else math.inf, accuracy)
