"""The main screen: lays out the panels and hands each snapshot to them.

It holds no state of its own: the app decides what to show (state, banner, uptime) and calls
``show`` / ``show_status`` / ``add_event`` / ``note``; the panels do the rendering.
"""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.screen import Screen
from textual.widgets import Footer

from tui.events import EventsLog
from tui.run import PeersPanel, SwarmsPanel
from tui.status import NotTrainingBanner, StatusBar
from tui.work import WorkPanel
from volunteer.snapshot import Event, NodeSnapshot

TALL_FROM_ROWS = 32  # from this terminal height the sparklines get two rows and the run table more


class DashboardScreen(Screen[None]):
    VERTICAL_BREAKPOINTS: ClassVar[list[tuple[int, str]]] = [(0, "-short"), (TALL_FROM_ROWS, "-tall")]
    DEFAULT_CSS = """
    DashboardScreen {
        WorkPanel, SwarmsPanel, PeersPanel, EventsLog {
            border-top: solid $primary;
            border-title-color: $text;
            border-title-style: bold;
        }
        WorkPanel:focus-within, SwarmsPanel:focus-within, PeersPanel:focus-within, EventsLog:focus {
            border-top: solid $accent;
        }
        #top {
            height: auto;
        }
        WorkPanel {
            width: 1fr;
            min-width: 26;
        }
        SwarmsPanel {
            width: auto;
            max-width: 70%;
            max-height: 100%;
        }
        PeersPanel {
            height: auto;
            max-height: 40%;
        }
    }
    DashboardScreen.-short #top {
        max-height: 9;
    }
    DashboardScreen.-tall #top {
        max-height: 14;
    }
    DashboardScreen.-tall Trend {
        height: 2;
    }
    """

    def compose(self) -> ComposeResult:
        yield StatusBar()
        yield NotTrainingBanner()
        with Horizontal(id="top"):
            yield WorkPanel()
            yield SwarmsPanel()
        yield PeersPanel()
        yield EventsLog(id="events")
        yield Footer(show_command_palette=False)

    def _torn_down(self) -> bool:
        """While the app exits, the panels go before the screen: a snapshot or a timer tick that arrives then
        has nothing to draw on (querying would raise NoMatches)."""
        return not self.query(StatusBar)

    def show(self, snapshot: NodeSnapshot, now: float) -> None:
        if self._torn_down():
            return
        self.query_one(WorkPanel).show(snapshot)
        self.query_one(SwarmsPanel).show(snapshot, now)
        self.query_one(PeersPanel).show(snapshot)
        self.query_one(EventsLog).add_all(snapshot.events)
        self.query_one(EventsLog).show_log_path(snapshot.log_path)

    def show_status(self, snapshot: NodeSnapshot, *, uptime_s: float, leaving: bool, banner: str) -> None:
        if self._torn_down():
            return
        self.query_one(StatusBar).show(snapshot, uptime_s=uptime_s, leaving=leaving)
        self.query_one(NotTrainingBanner).show(banner)

    def add_event(self, event: Event) -> None:
        if not self._torn_down():
            self.query_one(EventsLog).add(event)

    def note(self, text: str, when: float) -> None:
        if not self._torn_down():
            self.query_one(EventsLog).note(text, when)

    def on_screen_resume(self) -> None:
        """Events that arrived behind the help screen could not scroll the log: catch up now."""
        self.query_one(EventsLog).scroll_end(animate=False)
