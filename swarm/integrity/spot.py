"""Spot validation by replication (BOINC; IOTA's validators re-run a worker and require a magnitude ratio of at least
0.8 and a cosine above 0.9): a share of a driver's forward hops also goes to a second peer of the same swarm, and
the two signed outputs are compared. Copies of a layer legitimately differ a little (averaging keeps them close,
not equal), so agreement is a cosine and a norm ratio, not equality. On a disagreement a third peer arbitrates and
the odd one out is the one far from both others while they are not far from each other. Pure: tensors in, verdicts out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SPOT_SHARE = 0.03  # of forward hops, where the swarm has a second peer; as much of gradient hops


@dataclass(slots=True, frozen=True)
class Bounds:
    """When two outputs of the same input by two copies of one layer agree, and when they are far apart (no honest
    copy would have computed both). Agreement: IOTA's validators' cosine above 0.9 and magnitude ratio of at least
    0.8 (the smaller norm over the larger)."""

    min_cosine: float = 0.9
    min_norm_ratio: float = 0.8
    far_cosine: float = 0.5
    far_norm_ratio: float = 0.5
    # near enough that both corroborate each other (validated work, CreditBook) without agreeing; None: not far
    near_cosine: float | None = None
    near_norm_ratio: float | None = None

    # verdicts on a similarity already computed ((cosine, norm ratio), None: shapes differ): one pass per comparison
    def agrees(self, s: tuple[float, float] | None) -> bool:
        return s is not None and s[0] >= self.min_cosine and s[1] >= self.min_norm_ratio

    def is_far(self, s: tuple[float, float] | None) -> bool:
        return s is None or s[0] < self.far_cosine or s[1] < self.far_norm_ratio

    def is_near(self, s: tuple[float, float] | None) -> bool:
        if self.near_cosine is None:
            return not self.is_far(s)
        return s is not None and s[0] >= self.near_cosine and s[1] >= (self.near_norm_ratio or 0.0)


# Activations. Singled out only when far from both others, not merely outside agreement: honest copies differ more
# than one would hope. Measured on label-skewed digits, two copies of stage 0 trained apart for 300 steps had a
# median row cosine of 0.88 on the same inputs (0.95 on IID shards), while one copy on wrongly paired inputs had
# 0.84 (0.76). The norm ratio's far bound is 0.25, not 0.5: on label-skewed shards a copy's activations on the
# classes it trains on grow larger than the other copies' (which never see them), in the same direction. Measured
# (tests/test_stage0_spot_swarm.py, 3 honest drivers with 2 classes each, 60 s, averaging on): the author against
# both recomputations cosine 0.84-0.93 but norm ratio 0.43-0.50, the two recomputations 0.87 / 0.86-0.95; at 0.5
# that honest specialist was the odd one out and banned. A liar's scaled output (x10: ratio 0.1) or a random one
# (cosine ~0) is still far; one scaled by up to 4x is not, and the next stage clips what it does with it.
ACTIVATIONS = Bounds(far_norm_ratio=0.25)
# Input gradients (a last stage's forward_backward, a backward). Honest copies' input gradients differ far more than
# their activations: the gradient of a loss scales with each copy's error on that micro-batch, and a middle stage's
# passes through its own ReLU masks. Measured on real swarms (3 volunteers per swarm, digits, SGD with momentum, one
# in two hops checked, benchmarks.convergence_swarm): cosine median 0.86-0.89, 5th percentile 0.25-0.49, minimum
# 0.035 over 200 checks early in a label-skewed run; norm ratio median 0.81, 5th percentile 0.28, minimum 0.074. So
# "far" is pointing *against* (a cosine under -0.2: an ascent gradient, the negation of an honest one, lands near
# minus the honest cosine) or a hundred times larger or smaller. A random gradient (cosine near 0) or one scaled
# 10x is not caught here: the stage it reaches clips it around its history (swarm/integrity/clip.py).
GRADIENTS = Bounds(far_cosine=-0.2, far_norm_ratio=0.01, near_cosine=0.5, near_norm_ratio=0.2)


def similarity(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float] | None:
    """(cosine, smaller norm over larger) of two outputs, None when their shapes differ."""
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    if a.shape != b.shape:
        return None
    na, nb = float(a.norm()), float(b.norm())
    if na == 0.0 or nb == 0.0:
        return (1.0, 1.0) if na == nb else (0.0, 0.0)
    return float(a @ b) / (na * nb), min(na, nb) / max(na, nb)


def agree(a: torch.Tensor, b: torch.Tensor, bounds: Bounds = ACTIVATIONS) -> bool:
    """Two outputs of the same input by two copies of one layer: close enough to be the same computation."""
    return bounds.agrees(similarity(a, b))


def far(a: torch.Tensor, b: torch.Tensor, bounds: Bounds = ACTIVATIONS) -> bool:
    """So different that no honest copy of the same layer would have computed both from the same input."""
    return bounds.is_far(similarity(a, b))


def near(a: torch.Tensor, b: torch.Tensor, bounds: Bounds = ACTIVATIONS) -> bool:
    """Close enough to corroborate each other (validated work) without agreeing: not far (activations), or within
    the bounds' own near bound (gradients, whose not-far bound is too loose to earn credit by)."""
    return bounds.is_near(similarity(a, b))


def odd_one_out(outputs: list[torch.Tensor], bounds: Bounds = ACTIVATIONS) -> int | None:
    """Of three (or more) outputs, the index of the one that is far from every other while the others are not far
    from each other; None when there is no such single one (all close, no majority, or the odd one is merely not
    close: a copy that drifted is not a liar). "Not far", not "agree": on label-skewed shards honest copies
    disagree at the 0.9 cosine without ever being far, and requiring the two others to agree let every made-up
    output through there as "undecided"; two colluding peers could always agree exactly, so the stricter rule
    protected nobody from a frame-up."""
    n = len(outputs)
    if n < 3:
        return None
    loners = [i for i in range(n) if all(far(outputs[i], outputs[j], bounds) for j in range(n) if j != i)]
    if len(loners) != 1:
        return None
    others = [i for i in range(n) if i != loners[0]]
    if not any(far(outputs[i], outputs[j], bounds) for i in others for j in others if i != j):
        return loners[0]
    return None


# ----- stage 0's outputs, recomputed by other drivers (swarm/pipeline/control/stage0_checks.py)

AGREED, DISAGREED, AUTHOR_ODD, REPLICA_ODD, UNDECIDED, SKIPPED = (
    "agreed", "disagreed", "author_odd", "replica_odd", "undecided", "skipped")


def judge_author(author: torch.Tensor, replicas: list[torch.Tensor]) -> tuple[str, int | None]:
    """The verdict on a driver's stage-0 output against the recomputations of other layer0 copies (same sample
    ids), and the index in ``replicas`` of a replica that is the odd one out (REPLICA_ODD only).

    SKIPPED: no replica came back (a slow or absent peer is no evidence). With one replica: AGREED or DISAGREED
    (two copies cannot tell which one lies: the caller asks a third or only says it). With two or more, the first
    two: AUTHOR_ODD when the author is far from both while they are not far from each other (the one verdict that
    blames it), REPLICA_ODD
    when one replica is, AGREED when the author agrees with either, else UNDECIDED (honest copies on label-skewed
    shards disagree at 0.9 without ever being far)."""
    if not replicas:
        return SKIPPED, None
    if len(replicas) == 1:
        return (AGREED if agree(author, replicas[0]) else DISAGREED), None
    odd = odd_one_out([author, replicas[0], replicas[1]])
    if odd == 0:
        return AUTHOR_ODD, None
    if odd is not None:
        return REPLICA_ODD, odd - 1
    return (AGREED if agree(author, replicas[0]) or agree(author, replicas[1]) else UNDECIDED), None


# ----- influence earned by validated work (stage0_checks.py, spot_checks.py)

# A peer with fewer corroborated outputs than ESTABLISHED_CREDIT (with the checker) is checked NEWCOMER_FACTOR times as
# often: a stranger that lies from its first message is caught within a few of them, not ~1/share. Measured: a signed
# ascent last stage next to two honest ones at 3 % took the accuracy to 0.76 before its first catch, and a driver of
# made-up stage-0 outputs was not refused within 10 s (benchmarks.adversary).
ESTABLISHED_CREDIT = 8
NEWCOMER_FACTOR = 8.0


def checked_share(share: float, credit: int) -> float:
    """How often a peer with ``credit`` corroborated outputs is checked, given the run's ``share``."""
    return share if credit >= ESTABLISHED_CREDIT else min(1.0, share * NEWCOMER_FACTOR)


MAX_CREDITED = 4096  # peers whose credit is kept; past it the least credited quarter is forgotten


class CreditBook:
    """Per peer, the outputs of it that a spot check found corroborated (validated work). An odd one out may be
    penalised only when both peers that outvoted it have more credit than it has (``outvoted``): keys cost nothing,
    two fresh ones must not outvote a peer that did corroborated work. Not thread-safe (one event loop)."""

    def __init__(self, max_peers: int = MAX_CREDITED):
        self.credit: dict[str, int] = {}
        self.max_peers = max_peers

    def get(self, peer: str) -> int:
        return self.credit.get(peer, 0)

    def add(self, peer: str, delta: int = 1) -> None:
        self.credit[peer] = max(0, self.get(peer) + delta)
        if len(self.credit) > self.max_peers:
            for forgotten in sorted(self.credit, key=self.credit.__getitem__)[:len(self.credit) // 4]:
                del self.credit[forgotten]

    def outvoted(self, odd: str, a: str, b: str) -> bool:
        """Whether ``a`` and ``b`` may penalise ``odd``: each has more credit than it. If so ``odd`` loses all of
        its credit; if not, their standing (the lesser of the two) is taken off its own, never more."""
        standing = min(self.get(a), self.get(b))
        if standing > self.get(odd):
            self.credit.pop(odd, None)
            return True
        self.add(odd, -standing)
        return False
