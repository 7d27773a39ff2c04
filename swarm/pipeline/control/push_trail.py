"""What a push brings back to its driver (swarm/pipeline/control/push_driver.py), and what is wrong with a trail."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from swarm.integrity.receipts import Receipt

AVOID_S = 60.0  # a peer whose push failed or broke is relayed this long


class TrailError(ValueError):
    """A push's answer whose receipts, tensors or figures do not hold together."""


@dataclass(slots=True)
class Pushed:
    """What came back: a full micro-batch (``grad`` and ``loss``), or a partial one the driver relays on from
    stage ``partial_at`` + 1 (``h``: that stage's input)."""

    served_by: dict[int, str] = field(default_factory=dict)
    forwards: dict[int, Receipt] = field(default_factory=dict)
    grad: torch.Tensor | None = None
    loss: float | None = None
    partial_at: int = 0
    h: torch.Tensor | None = None
    # recovered after a broken push with the last stage's update applied: the backward relayed on from stage
    # ``back_from`` (``grad`` and its receipt ``grad_receipt``: the gradient of that stage's output), ``inputs`` the
    # inputs the driver could get of the stages before it (a backward elsewhere needs its input)
    back_from: int = 0
    grad_receipt: Receipt | None = None
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)


