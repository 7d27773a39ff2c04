"""Typed, past-tense messages that carry engine news onto the UI thread.

The engine's listeners run on the engine's thread; they only ever ``post_message`` one of these to
the app (thread-safe in textual), so no widget is touched from another thread.
"""

from __future__ import annotations

from textual.message import Message

from volunteer.snapshot import Event, NodeSnapshot


class SnapshotUpdated(Message):
    """The engine built a new status snapshot."""

    def __init__(self, snapshot: NodeSnapshot) -> None:
        super().__init__()
        self.snapshot = snapshot


class EventRaised(Message):
    """Something happened that the volunteer should read about in the events log."""

    def __init__(self, event: Event) -> None:
        super().__init__()
        self.event = event


class EngineStopped(Message):
    """The engine stopped (``clean``: after QUIT or on its own) or did not within the leave timeout.

    ``during_startup``: QUIT came while the node was still joining or syncing; the bridge then waited only
    ``startup_abort_s`` and the caller ends what is left (nothing was announced online to take back)."""

    def __init__(self, clean: bool, during_startup: bool = False) -> None:
        super().__init__()
        self.clean = clean
        self.during_startup = during_startup
