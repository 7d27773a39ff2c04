"""Headless output: one line per event and a periodic summary, human-readable or JSON lines."""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import TextIO

from volunteer.snapshot import Event, EventLevel, NodeSnapshot, short_id, view_age_s


def _clock(timestamp: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(timestamp))


def format_summary(snap: NodeSnapshot, now_s: float | None = None) -> str:
    now_s = time.time() if now_s is None else now_s
    parts = [f"{snap.state.value}"]
    if snap.reason:
        parts[0] += f" ({snap.reason})"
    parts.append(f"{snap.swarm}")
    if snap.samples_per_s:
        parts.append(f"{snap.samples_per_s:.1f} samples/s")
    if snap.loss is not None:
        parts.append(f"loss {snap.loss:.3f}")
    if snap.clock:
        parts.append(f"clock {snap.clock}")
    if snap.test_accuracy is not None:
        parts.append(f"test acc {snap.test_accuracy:.1%}")
    swarms = " ".join(f"{s.name}:{s.online}{'!' if s.online == 0 else ''}" for s in snap.swarms)
    if swarms:
        ages = [age for age in (view_age_s(s, now_s) for s in snap.swarms) if age is not None]
        parts.append(f"online peers {swarms}" + (f" (some read {max(ages):.0f} s ago)" if ages else ""))
    return " | ".join(parts)


class EventLog:
    """Listener pair for ``Engine.add_listener`` that writes to a stream (stdout by default)."""

    def __init__(self, stream: TextIO | None = None, fmt: str = "human", summary_every_s: float = 30.0,
                 skip_kinds: frozenset[str] = frozenset()):
        self.stream = stream or sys.stdout
        self.fmt = fmt
        self.skip_kinds = skip_kinds  # event kinds someone else prints (join prints the fatal "error" at exit)
        self.summary_every_s = summary_every_s
        self._last_summary = 0.0
        self._lock = threading.Lock()

    def on_event(self, event: Event) -> None:
        if event.kind in self.skip_kinds:
            return
        if self.fmt == "json":
            self._write(json.dumps({"time": round(event.time, 3), "type": "event", "kind": event.kind,
                                    "level": event.level.value, "text": event.text}))
        else:
            marker = {EventLevel.WARNING: "warning: ", EventLevel.ERROR: "error: "}.get(event.level, "")
            self._write(f"{_clock(event.time)} {marker}{event.text}")

    def on_snapshot(self, snap: NodeSnapshot) -> None:
        now = time.monotonic()
        if not snap.peer_id or now - self._last_summary < self.summary_every_s:
            return
        self._last_summary = now
        if self.fmt == "json":
            data = snap.to_json()
            data.pop("events", None)
            data.pop("samples_per_s_history", None)
            data.pop("loss_history", None)
            data["type"] = "summary"
            data["time"] = round(time.time(), 3)
            self._write(json.dumps(data))
        else:
            self._write(f"{_clock(time.time())} [{short_id(snap.peer_id)}] {format_summary(snap)}")

    def _write(self, line: str) -> None:
        with self._lock:
            try:
                self.stream.write(line + "\n")
                self.stream.flush()
            except (BrokenPipeError, ValueError):
                pass  # the reader went away (e.g. `| head`): keep running, stop writing
