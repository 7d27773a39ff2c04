"""Spot validation by replication (BOINC; IOTA's validators re-run a worker and require a magnitude ratio of at least
0.8 and a cosine above 0.9): a share of a driver's forward hops also goes to a second peer of the same swarm, and
the two signed outputs are compared. Copies of a layer legitimately differ a little (averaging keeps them close,
not equal), so agreement is a cosine and a norm ratio, not equality. On a disagreement a third peer arbitrates and
the odd one out is the one that disagrees with both others. Pure: tensors in, verdicts out.
"""

from __future__ import annotations

import torch

SPOT_SHARE = 0.03  # of forward hops, where the swarm has a second peer
MIN_COSINE = 0.9
MIN_NORM_RATIO = 0.8  # the smaller norm over the larger


def agree(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two outputs of the same input by two copies of one layer: close enough to be the same computation."""
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    if a.shape != b.shape:
        return False
    na, nb = float(a.norm()), float(b.norm())
    if na == 0.0 or nb == 0.0:
        return na == nb
    cosine = float(a @ b) / (na * nb)
    return cosine >= MIN_COSINE and min(na, nb) / max(na, nb) >= MIN_NORM_RATIO


def odd_one_out(outputs: list[torch.Tensor]) -> int | None:
    """Of three (or more) outputs, the index of the one that agrees with no other while the others agree among
    themselves; None when there is no such single one (all agree, or no majority)."""
    n = len(outputs)
    if n < 3:
        return None
    agrees = [[i != j and agree(outputs[i], outputs[j]) for j in range(n)] for i in range(n)]
    loners = [i for i in range(n) if not any(agrees[i])]
    if len(loners) != 1:
        return None
    others = [i for i in range(n) if i != loners[0]]
    if all(agrees[i][j] for i in others for j in others if i != j):
        return loners[0]
    return None
