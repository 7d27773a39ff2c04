"""Evaluations validated by replication (BOINC's way): the same test split through up to ``MAX_REPLICAS`` peers of
the last stage, each figure signed by the peer that computed it (swarm/integrity/receipts.py), and the figure
published is what the replicas agree on, not what one of them says.

Copies of a layer differ a little (averaging keeps them close, not equal), so two honest replicas agree within
``ACCURACY_TOLERANCE`` (or ``LOSS_TOLERANCE``, relative, for a language model), not exactly. Pure: figures in, a
verdict out.

A replica far from the others is left out of the published figure and **not penalised**: each replica evaluates
its own copy, and on label-skewed shards honest copies differ by far more than any tolerance (issue 28: a 4-peer
skewed run's last-stage copies evaluated 0.45-0.95 early on, and banning the "outliers" held off 30 honest peers
in 4 minutes). What a lying evaluator gains is nothing: with three replicas the median is published, with two the
worse figure, so its boast never reaches the record. Penalties belong to what can be checked: a receipt, a
tensor's content, a spot check of the same input through two copies (swarm/pipeline/control/spot_checks.py).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_REPLICAS = 3
ACCURACY_TOLERANCE = 0.05  # two honest copies of a digits-mlp last stage measured within 0.02 of each other
LOSS_TOLERANCE = 0.10  # relative


@dataclass(slots=True, frozen=True)
class Figures:
    peer: str
    accuracy: float | None  # None for a language model
    loss: float


@dataclass(slots=True, frozen=True)
class Verdict:
    accuracy: float | None
    loss: float
    validated: bool  # at least two replicas agreed
    replicas: int
    outliers: tuple[str, ...] = ()  # peers whose figure is far from the median (3 or more replicas): left out


def _key(f: Figures) -> float:
    return f.accuracy if f.accuracy is not None else -f.loss  # higher is better either way


def agree(a: Figures, b: Figures) -> bool:
    if a.accuracy is not None and b.accuracy is not None:
        return abs(a.accuracy - b.accuracy) <= ACCURACY_TOLERANCE
    return abs(a.loss - b.loss) <= LOSS_TOLERANCE * max(min(a.loss, b.loss), 1e-9)


def consensus(figures: list[Figures]) -> Verdict:
    """The figure to publish. One replica: its own, not validated. Two that agree: their mean; two that disagree:
    the worse of the two (a liar inflates; the pessimistic figure is never the liar's boast), not validated.
    Three or more: the median, validated when another replica agrees with it; the ones far from it are outliers."""
    if not figures:
        raise ValueError("no evaluation to agree on")
    if len(figures) == 1:
        f = figures[0]
        return Verdict(f.accuracy, f.loss, False, 1)
    if len(figures) == 2:
        a, b = figures
        if agree(a, b):
            accuracy = None if a.accuracy is None or b.accuracy is None else (a.accuracy + b.accuracy) / 2
            return Verdict(accuracy, (a.loss + b.loss) / 2, True, 2)
        worse = min(figures, key=_key)
        return Verdict(worse.accuracy, worse.loss, False, 2)
    ranked = sorted(figures, key=_key)
    median = ranked[len(ranked) // 2]
    outliers = tuple(f.peer for f in figures if f is not median and not agree(f, median))
    validated = len(figures) - len(outliers) >= 2
    return Verdict(median.accuracy, median.loss, validated, len(figures), outliers)
