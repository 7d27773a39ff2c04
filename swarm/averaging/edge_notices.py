"""What the edge modes tell the user: their counters, the periodic notice and the lag warning (pure).

Map: ``EdgeStats`` (the counters swarm/averaging/edges.py keeps), ``notice_text`` (the ``averaged``
event every NOTICE_S), ``lag_warning`` (PDMM-ISVR with swaps that come back too late, docs/ECL.md).
"""

from __future__ import annotations

from dataclasses import dataclass

PDMM_MAX_LAG_PERIODS = 2.0  # warn when PDMM's swaps lag more than this many periods (docs/ECL.md)


@dataclass(slots=True)
class EdgeStats:
    steps: int = 0  # local steps taken by the node
    sent: int = 0  # swaps we started that a neighbour answered
    answered: int = 0  # swaps a neighbour started that we answered
    send_failed: int = 0  # timed out, unreachable, broken
    skipped: int = 0  # not started: the previous swap on that edge was still on the wire
    refused: int = 0  # the neighbour answered no (its graph has no edge to us yet, or any more)
    stale: int = 0  # replies dropped: their edge was rebuilt (left and came back) while they travelled
    applied: int = 0  # messages applied to the node (replies and requests)
    rejected: int = 0  # messages refused by our checks
    clipped: int = 0  # messages applied with a clipped step (swarm/integrity/mixing.py)
    over_budget: int = 0  # messages dropped: their sender had moved our copy enough within the window


def notice_text(mode: str, now: EdgeStats, before: EdgeStats, degree: int, seconds: float, lag: float | None) -> str:
    """The periodic notice: messages out (swaps started plus answers) and in, since ``before``."""
    started, answered = now.sent - before.sent, now.answered - before.answered
    sent, applied = started + answered, now.applied - before.applied
    lost = (now.send_failed - before.send_failed) + (now.refused - before.refused)
    skipped = now.skipped - before.skipped
    return (f"{mode}: sent {sent} and applied {applied} edge message(s) with {degree} neighbour(s) in the last "
            f"{seconds:.0f} s ({started} swap(s) started, {answered} answered)"
            + (f"; replies within {lag:.0f} step(s)" if lag is not None else "")
            + (f"; {lost} not delivered" if lost else "")
            + (f"; {skipped} skipped while the previous one travelled" if skipped else ""))


def lag_warning(mode: str, lag: float | None, period_steps: int) -> str | None:
    """What to do when PDMM-ISVR's swaps come back more than PDMM_MAX_LAG_PERIODS periods late, or None."""
    if mode != "pdmm_isvr" or lag is None or lag <= PDMM_MAX_LAG_PERIODS * period_steps:
        return None
    return (f"edge swaps take {lag:.0f} local steps to come back, more than the exchange period "
            f"({period_steps}): PDMM-ISVR can diverge with stale messages (docs/ECL.md); raise "
            f"averaging.graph.period_steps or use averaging.mode admm_isvr")
