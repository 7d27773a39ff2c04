"""Run-level alarms computed from every swarm's records (pure): what status, the dashboard, the health page and
the demo print once, loudly, instead of one log line per peer.

- a stage that refuses every driver ("layer1 refuses all 4 drivers: 10 strikes, the last: ..."): nothing
  passes it, whatever the drivers do;
- drivers that want to train and complete nothing ("no micro-batch completed for 42 s by 4 of 4 drivers").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the dashboard imports this module: no pydantic at import
    from swarm.dht.records import MemberRecord

STALL_ALARM_S = 15.0  # a driver that completed no micro-batch for this long while online is stalled


def _online(records: list[MemberRecord]) -> list[MemberRecord]:
    return [r for r in records if r.state == "online"]


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def refusal_alarm(name: str, records: list[MemberRecord]) -> str:
    """'layer1 refuses all 4 drivers: <the last ban's reason>' when every online peer of the swarm that
    publishes its refusals refuses every online driver it knows of; "" otherwise."""
    publishing = [r for r in _online(records) if r.drivers_refused >= 0 and r.drivers_seen >= 0]
    if not publishing or not all(0 < r.drivers_seen <= r.drivers_refused for r in publishing):
        return ""
    drivers = max(r.drivers_seen for r in publishing)
    reason = next((r.ban_reason for r in publishing if r.ban_reason), "") or "they are banned"
    who = name if len(publishing) == 1 else f"{name} ({_plural(len(publishing), 'peer')}, each)"
    return f"{who} refuses all {_plural(drivers, 'driver')}: {reason}; no micro-batch can pass it"


def stalled_drivers(views: dict[str, list[MemberRecord]], threshold_s: float = STALL_ALARM_S) -> list[MemberRecord]:
    """The online layer0 drivers that completed no micro-batch for ``threshold_s`` while they wanted to train."""
    return [r for r in _online(views.get("layer0", [])) if r.stalled_s >= threshold_s]


def stall_alarm(views: dict[str, list[MemberRecord]], threshold_s: float = STALL_ALARM_S) -> str:
    """'no micro-batch completed for 42 s by 4 of 4 drivers'; "" when none is stalled."""
    stalled = stalled_drivers(views, threshold_s)
    if not stalled:
        return ""
    drivers = [r for r in _online(views.get("layer0", [])) if r.stalled_s >= 0]
    longest = max(r.stalled_s for r in stalled)
    return (f"no micro-batch completed for {longest:.0f} s by {len(stalled)} of "
            f"{_plural(max(len(drivers), len(stalled)), 'driver')}")


def own_stall_alarm(stalled_s: float | None, swarm: str, threshold_s: float = STALL_ALARM_S) -> str:
    """This node's own stall, in words ("" below ``threshold_s``): a driver completes micro-batches, a stage
    serves them."""
    if stalled_s is None or stalled_s < threshold_s:
        return ""
    what = "completed no micro-batch" if swarm == "layer0" else "served no micro-batch"
    return f"STALLED: this node {what} for {stalled_s:.0f} s while it wants to train"


def run_alarms(views: dict[str, list[MemberRecord]], swarm_names: list[str]) -> list[str]:
    """Every alarm of the run, the refusing stages first (the cause) and the stall after (its effect)."""
    alarms = [text for text in (refusal_alarm(name, views.get(name, [])) for name in swarm_names) if text]
    stall = stall_alarm(views)
    return alarms + ([stall] if stall else [])
