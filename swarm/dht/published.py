"""What a reader takes from the figures layer0 records publish about the run: an evaluation, a clock.

A record's figures are its own claims: any key can publish a layer0 record (keys cost nothing), with an accuracy
of 1.0 after 2^62 samples, kept fresh. So nothing a reader acts on (what `status` shows, whether the run reached its
target and every volunteer pauses, what a node's dashboard says of the run) is the boldest claim: it is the median
of the drivers' current figures (of two, the more modest), which one liar cannot set while honest drivers publish
too. Honest drivers' figures differ (each evaluates its own chain; each copy has its own clock), so readers also get
how many figures the choice was made from. Pure: records in, a record out.
"""

from __future__ import annotations

from typing import Any

CURRENT_PERIODS = 3  # an evaluation within this many evaluation periods of the newest is current


def published_evaluations(records: list[Any]) -> list[Any]:
    return [r for r in records if r.test_accuracy >= 0 or r.test_loss >= 0]


def evaluated_at(record: Any) -> float:
    """The evaluation's own time (records before it carried one: the heartbeat that published it)."""
    return record.eval_at if record.eval_at >= 0 else record.updated_at


def _better(record: Any) -> float:
    return record.test_accuracy if record.test_accuracy >= 0 else -record.test_loss  # higher is better either way


def representative_evaluation(records: list[Any], eval_every_s: float) -> tuple[Any | None, list[Any]]:
    """Among the records' published evaluations within ``CURRENT_PERIODS`` periods of the newest: the median
    record (of an even count, the lower middle: the more modest figure), and the current records it was chosen
    from. (None, []) when no record published an evaluation."""
    published = published_evaluations(records)
    if not published:
        return None, []
    newest = max(evaluated_at(r) for r in published)
    current = [r for r in published if evaluated_at(r) >= newest - CURRENT_PERIODS * eval_every_s]
    ranked = sorted(current, key=_better)
    return ranked[(len(ranked) - 1) // 2], current


def representative_clock(records: list[Any]) -> int:
    """The median clock of the records (of an even count, the lower middle), 0 for none: how far the layer's
    copies have trained, where one record's claim of 2^62 samples moves nothing."""
    clocks = sorted(r.clock for r in records)
    return clocks[(len(clocks) - 1) // 2] if clocks else 0
