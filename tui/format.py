"""Pure text formatting for the dashboard: numbers, durations, states and the not-training line.

Everything here takes plain values and returns plain strings, so it is tested without an app,
and every fact the dashboard shows in colour is also spelled out in these words (NO_COLOR).
"""

from __future__ import annotations

import time

from swarm.dht.alarms import own_stall_alarm
from volunteer.snapshot import (
    RUN_COMPLETE_PREFIX, EventLevel, NodeSnapshot, NodeState, SwarmRow, bits_per_byte, view_age_s,
)

NO_VALUE = "–"  # shown where a figure is not known yet (no loss before the first batch)
_BYTE_UNITS = ("B", "kB", "MB", "GB", "TB", "PB")
_BYTES_PER_UNIT = 1000  # network and memory figures in SI units, like most system monitors
_WHOLE_FROM = 100  # "12.3 GB" but "800 MB": three digits are enough
_COMPACT_UNITS = ((1e9, "B"), (1e6, "M"), (1e3, "k"))
_COMPACT_FROM = 10_000  # below this a count is written in full ("9,999")
_SECONDS_PER_MINUTE = 60
_SECONDS_PER_HOUR = 3600
_SECONDS_PER_DAY = 86400
_JUST_NOW_S = 2.0  # a peer heard from within this many seconds was seen "now"

STATE_LABELS: dict[NodeState, str] = {state: state.value.upper() for state in NodeState}

# What each not-training state means when the engine gives no reason, and what the volunteer can do.
_STATE_DEFAULT_REASONS: dict[NodeState, str] = {
    NodeState.JOINING: "looking for the run's peers",
    NodeState.SYNCING: "downloading the current weights of this layer",
    NodeState.PAUSED: "paused",
    NodeState.FINISHING: "completing the work already taken, then pausing",
    NodeState.HEALING: "this copy was found sick and is restoring its last good state",
    NodeState.OFFLINE: "not connected to the run",
}
_STATE_HINTS: dict[NodeState, str] = {
    NodeState.JOINING: "training starts by itself",
    NodeState.SYNCING: "training starts by itself",
    NodeState.PAUSED: "press r to resume",
    NodeState.FINISHING: "press r to keep training",
    NodeState.HEALING: "training resumes by itself",
    NodeState.OFFLINE: "press q to leave",
}
_LEVEL_PREFIXES: dict[EventLevel, str] = {
    EventLevel.INFO: "",
    EventLevel.WARNING: "WARNING",
    EventLevel.ERROR: "ERROR",
}


def format_bytes(count: int | float) -> str:
    """1234567 -> '1.2 MB'."""
    value = float(count)
    for unit in _BYTE_UNITS:
        if abs(value) < _BYTES_PER_UNIT or unit == _BYTE_UNITS[-1]:
            decimals = 0 if unit == "B" or abs(value) >= _WHOLE_FROM else 1
            return f"{value:.{decimals}f} {unit}"
        value /= _BYTES_PER_UNIT
    raise AssertionError("unreachable: the last unit always returns")


def format_count(count: int | float) -> str:
    """Counts in full while short ('9,999'), then compact ('12.3k', '4.56M')."""
    if abs(count) < _COMPACT_FROM:
        return f"{count:,.0f}"
    for scale, suffix in _COMPACT_UNITS:
        if abs(count) >= scale:
            scaled = count / scale
            return f"{scaled:.3g}{suffix}" if abs(scaled) < 1000 else f"{scaled:,.0f}{suffix}"
    raise AssertionError("unreachable: counts from 10,000 have a unit")


def format_rate(per_s: float) -> str:
    """Samples per second: one decimal while small, whole numbers once it does not matter."""
    return f"{per_s:,.1f}" if abs(per_s) < 1000 else f"{per_s:,.0f}"


def format_loss(loss: float | None) -> str:
    if loss is None:
        return NO_VALUE
    return f"{loss:.4f}" if abs(loss) < 10 else f"{loss:.2f}"


def format_percent(fraction: float | None) -> str:
    """0.912 -> '91.2%'."""
    return NO_VALUE if fraction is None else f"{fraction * 100:.1f}%"


def format_duration(seconds: float) -> str:
    """Uptime-style: '45s', '12m 03s', '3h 07m', '2d 04h'."""
    total = max(0, int(seconds))
    if total < _SECONDS_PER_MINUTE:
        return f"{total}s"
    if total < _SECONDS_PER_HOUR:
        return f"{total // _SECONDS_PER_MINUTE}m {total % _SECONDS_PER_MINUTE:02d}s"
    if total < _SECONDS_PER_DAY:
        return f"{total // _SECONDS_PER_HOUR}h {total % _SECONDS_PER_HOUR // _SECONDS_PER_MINUTE:02d}m"
    return f"{total // _SECONDS_PER_DAY}d {total % _SECONDS_PER_DAY // _SECONDS_PER_HOUR:02d}h"


def format_age(seconds: float) -> str:
    """How long ago a peer was heard from: 'now', '5s ago', '3m 10s ago'."""
    if seconds < _JUST_NOW_S:
        return "now"
    return f"{format_duration(seconds)} ago"


def format_clock_time(timestamp: float) -> str:
    """A wall-clock time of day in the local zone, for the events log."""
    return time.strftime("%H:%M:%S", time.localtime(timestamp))


def format_staleness(mean: float | None, p95: float | None, maximum: int | None) -> str:
    """Updates between a micro-batch's forward and backward here: 'avg 3.2 · p95 7 · max 9' ('–' unmeasured)."""
    if mean is None or p95 is None or maximum is None:
        return NO_VALUE
    return f"avg {mean:.1f} · p95 {p95:.0f} · max {maximum}"


def format_prediction(ahead: int) -> str:
    """Weight prediction's part of the staleness row: ' · predicted 4 ahead' (training forwards compute with the
    weights extrapolated 4 updates along the last one; short, so that the row fits the panel at 120 columns), ''
    where the latest was not predicted."""
    return f" · predicted {ahead} ahead" if ahead > 0 else ""


def format_checks(checked: int, caught: int, outweighed: int) -> str:
    """Spot checks this node ran: '212 · 1 caught', '212 · 0 caught · 2 not penalised' (accusers with less
    validated work than the accused)."""
    text = f"{format_count(checked)} · {caught} caught"
    return text + (f" · {outweighed} not penalised" if outweighed else "")


def format_evaluation(accuracy: float | None, loss: float | None, age_s: float | None, stale: bool) -> str:
    """The run's last evaluation for a title: 'acc 91.2% · 12s ago', 'acc 91.2% · STALE 3m 10s'; a
    language model's (no accuracy) in bits per byte: 'test 2.01 bits/byte · 12s ago'."""
    if accuracy is not None:
        figure = f"acc {format_percent(accuracy)}"
    elif loss is not None:
        figure = f"test {bits_per_byte(loss):.2f} bits/byte"
    else:
        figure = f"test loss {NO_VALUE}"
    if age_s is None:
        return f"{figure} · age ?"
    return f"{figure} · {'STALE ' + format_duration(age_s) if stale else format_age(age_s)}"


def state_label(state: NodeState, *, leaving: bool = False) -> str:
    return "LEAVING" if leaving else STATE_LABELS[state]


RUN_COMPLETE_HINT = "nothing more to train here; press q to leave"  # r would only pause again


def not_training_line(snapshot: NodeSnapshot, *, leaving: bool = False, silent_s: float = 0.0,
                      stale_after_s: float = float("inf")) -> str:
    """The prominent line shown while the node is not training ('' while it trains normally).

    It says what the node is doing, why, and what the volunteer can do about it; it also warns when
    the engine has gone quiet, since a frozen dashboard looks exactly like a healthy one.
    """
    if leaving:
        return "LEAVING: telling the swarm we are going offline… press q again to close without waiting"
    parts: list[str] = []
    if snapshot.state is not NodeState.ONLINE:
        reason = snapshot.reason or _STATE_DEFAULT_REASONS[snapshot.state]
        hint = RUN_COMPLETE_HINT if reason.startswith(RUN_COMPLETE_PREFIX) else _STATE_HINTS[snapshot.state]
        parts.append(f"{STATE_LABELS[snapshot.state]}: {reason} ({hint})")
    elif snapshot.reason:  # online but idle: a layer nobody serves, a bandwidth cap, a driver that waits
        parts.append(f"ONLINE, NOT TRAINING: {snapshot.reason.removeprefix('waiting: ')} (training starts by itself)")
    elif own_stall_alarm(snapshot.stalled_s, snapshot.swarm):  # online, nothing says why, and nothing completes
        parts.append(own_stall_alarm(snapshot.stalled_s, snapshot.swarm))
    parts += [f"RUN ALARM: {alarm}" for alarm in snapshot.run_alarms]
    if silent_s >= stale_after_s:
        parts.append(f"NO NEWS from the node for {format_duration(silent_s)}: it may be stuck (press q to leave)")
    return " · ".join(parts)


def swarm_note(swarm: SwarmRow, my_swarm: str, now_s: float | None = None) -> str:
    """The words that mark a swarm row, so the marking survives without colour, and its figures' age where they
    were read a while ago (a node that drives nothing reads the other swarms every few heartbeats)."""
    notes = []
    if swarm.bottleneck:
        notes.append("◀ bottleneck")
    if swarm.name == my_swarm:
        notes.append("you")
    age_s = None if now_s is None else view_age_s(swarm, now_s)
    if age_s is not None:
        notes.append(f"read {format_age(age_s)}")
    return " ".join(notes)


def level_prefix(level: EventLevel) -> str:
    """'ERROR' / 'WARNING' in front of an event line, '' for plain news."""
    return _LEVEL_PREFIXES[level]

