"""'Events': the node's news in order (joined, synced, averaged, adopted, healed, banned) and
its problems, with ERROR / WARNING written out so they read without colour."""

from __future__ import annotations

import os
from collections import deque

from rich.table import Table
from rich.text import Text
from textual.events import Resize
from textual.widgets import RichLog

from tui.format import format_clock_time, level_prefix
from volunteer.snapshot import Event, EventLevel

MAX_ENTRIES = 500  # the log keeps at least this many events; older ones scroll away for good
_TRIM_BATCH = 100  # drop old entries this many at a time, since each trim re-renders the log
_REMEMBERED_EVENTS = 2 * MAX_ENTRIES  # more than any snapshot's recent-events tail
_LEVEL_STYLES = {EventLevel.INFO: "", EventLevel.WARNING: "bold yellow", EventLevel.ERROR: "bold red"}
# Under NO_COLOR red and yellow turn into dim greys: problems are bold instead, their badge reversed.
_LEVEL_STYLES_NO_COLOR = {EventLevel.INFO: "", EventLevel.WARNING: "bold", EventLevel.ERROR: "bold"}
_LOCAL_STYLE = "italic"


def _line(when: float, text: Text) -> Table:
    """Time, then text; a long text wraps under itself, not under the time."""
    grid = Table.grid(padding=(0, 1), expand=True)
    grid.add_column(style="dim", no_wrap=True)
    grid.add_column(ratio=1)
    grid.add_row(format_clock_time(when), text)
    return grid


def event_entry(event: Event, *, no_color: bool = False) -> Table:
    prefix = level_prefix(event.level)
    style = (_LEVEL_STYLES_NO_COLOR if no_color else _LEVEL_STYLES)[event.level]
    text = Text()
    if prefix:
        text.append(prefix, style=f"reverse {style}")
        text.append(" ")
    text.append(event.text, style=style)
    return _line(event.time, text)


def _home_relative(path: str) -> str:
    home = os.path.expanduser("~")
    return "~" + path[len(home):] if home not in ("", "/") and path.startswith(home + os.sep) else path


class EventsLog(RichLog):
    """Writes each event once, whether it came as an EventRaised message, in a snapshot's tail, or both."""

    DEFAULT_CSS = """
    EventsLog {
        height: 1fr;
        background: $surface;
        scrollbar-size-vertical: 1;
        overflow-y: auto;
        overflow-x: hidden;
        scrollbar-gutter: stable;
    }
    """

    def __init__(self, *, id: str) -> None:
        super().__init__(id=id, wrap=True, markup=False, highlight=False)
        self._seen: deque[Event] = deque(maxlen=_REMEMBERED_EVENTS)
        self._seen_set: set[Event] = set()
        self._entries: deque[Table] = deque()
        self._wrapped_width = 0

    def on_mount(self) -> None:
        self.border_title = "Events"

    def show_log_path(self, path: str) -> None:
        """Where these events are kept after the dashboard closes (volunteer/logfile.py)."""
        title = f"Events · log {_home_relative(path)}" if path else "Events"
        if self.border_title != title:
            self.border_title = title

    def add(self, event: Event) -> None:
        if event in self._seen_set:
            return
        if len(self._seen) == self._seen.maxlen:
            self._seen_set.discard(self._seen[0])
        self._seen.append(event)
        self._seen_set.add(event)
        self._append(event_entry(event, no_color=self.app.no_color))

    def add_all(self, events: tuple[Event, ...]) -> None:
        for event in events:
            self.add(event)

    def note(self, text: str, when: float) -> None:
        """A line about something the volunteer did (pressed p), not news from the engine."""
        self._append(_line(when, Text(f"you: {text}", style=_LOCAL_STYLE)))

    def _append(self, entry: Table) -> None:
        self._entries.append(entry)
        if len(self._entries) < MAX_ENTRIES + _TRIM_BATCH:
            self.write(entry, expand=True)
            return
        for _ in range(_TRIM_BATCH):
            self._entries.popleft()
        self._rewrap()

    def on_resize(self, event: Resize) -> None:
        """Re-wrap every entry at the new width (RichLog keeps lines as first rendered)."""
        width = event.size.width
        if self._size_known and width != self._wrapped_width:
            self._rewrap()
        self._wrapped_width = width

    def _rewrap(self) -> None:
        self.clear()
        for entry in self._entries:
            self.write(entry, expand=True)
