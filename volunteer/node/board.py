"""The node's notice board: the current snapshot, the recent events, and who listens to them.

Every part of the node publishes through here (``publish`` for snapshot fields, ``emit`` for
events), so listeners (the TUI, the headless log, the control socket) see one consistent stream.
Listeners run on the publishing thread; a broken listener is logged, never fatal to the engine.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import replace
from typing import Any, Protocol

from volunteer.snapshot import Event, EventLevel, EventListener, NodeSnapshot, SnapshotListener

logger = logging.getLogger(__name__)

EVENT_HISTORY = 200  # events replayed to a listener that arrives late
SNAPSHOT_EVENTS = 50  # the most recent events carried in every snapshot


class Board:
    def __init__(self, initial: NodeSnapshot):
        self._lock = threading.Lock()
        self._snapshot = initial
        self._events: deque[Event] = deque(maxlen=EVENT_HISTORY)
        self._snapshot_listeners: list[SnapshotListener] = []
        self._event_listeners: list[EventListener] = []

    def snapshot(self) -> NodeSnapshot:
        with self._lock:
            return self._snapshot

    def publish(self, **changes: Any) -> None:
        """Change snapshot fields (names of ``NodeSnapshot``) and hand the new snapshot to the listeners."""
        with self._lock:
            self._snapshot = replace(self._snapshot, **changes)
            snapshot = self._snapshot
            listeners = list(self._snapshot_listeners)
        for listener in listeners:
            try:
                listener(snapshot)
            except Exception:
                logger.exception("snapshot listener failed")

    def emit(self, text: str, level: EventLevel = EventLevel.INFO, kind: str = "info") -> None:
        event = Event(text=text, level=level, kind=kind)
        with self._lock:
            self._events.append(event)
            listeners = list(self._event_listeners)
            self._snapshot = replace(self._snapshot, events=tuple(list(self._events)[-SNAPSHOT_EVENTS:]))
        for listener in listeners:
            try:
                listener(event)
            except Exception:  # a broken listener must not take the engine down
                logger.exception("event listener failed")

    def add_listener(self, on_snapshot: SnapshotListener, on_event: EventListener) -> None:
        """Listen from now on; the event history and the current snapshot are replayed at once."""
        with self._lock:
            self._snapshot_listeners.append(on_snapshot)
            self._event_listeners.append(on_event)
            history = list(self._events)
            current = self._snapshot
        for event in history:
            on_event(event)
        on_snapshot(current)


class Part(Protocol):
    """One named part of a serving node (volunteer/node/core.py), ticked once per loop and closed on leave; each
    publishes through the board."""

    def tick(self, now_s: float) -> None: ...  # now_s: time.monotonic()

    def close(self) -> None: ...
