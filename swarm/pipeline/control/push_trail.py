"""What a push brings back to its driver (swarm/pipeline/control/push_driver.py), and what is wrong with a trail."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from swarm.integrity.receipts import Receipt

AVOID_S = 60.0  # a peer whose push failed or broke is relayed this long
# A pushed micro-batch that the next peer refused with one of these says nothing against the link between the two
# peers (its shards, its driver, its load, its tensors): the driver relays that one and keeps pushing there. Relaying
# for a minute on a ``wrong_shard`` (two drivers' views of layer0 a heartbeat apart) cost stage to stage for nothing.
NOT_THE_LINK = frozenset({"wrong_shard", "busy", "healing", "paused", "rate_limited", "need_input", "unknown_driver",
                          "key_pending", "unknown_signer", "banned", "rejected", "bad_author", "spot_check"})


def link_failed(failed: object, route: list[str]) -> str | None:
    """The peer of ``route`` that a partial push's ``push_failed`` could not be pushed to for want of a link (relay to
    it for a while), or None: nothing named, or the next peer answered a refusal of this micro-batch (NOT_THE_LINK)."""
    if not isinstance(failed, dict):
        return None
    peer, code = failed.get("peer"), failed.get("code")
    if not isinstance(peer, str) or peer not in route:
        return None
    return None if isinstance(code, str) and code in NOT_THE_LINK else peer


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


