"""The top of the dashboard: who and where I am (run, swarm, peer), my state, uptime and client version, and,
while the node is not training, a banner that says why and what to do."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Static

from tui.format import format_duration, state_label
from volunteer import __version__
from volunteer.snapshot import NodeSnapshot


def run_label(snapshot: NodeSnapshot) -> str:
    """Run ids usually embed the name ("mnist-3f2a91c0"): show the name only when it adds something."""
    if not snapshot.run_name or snapshot.run_id.startswith(snapshot.run_name):
        return snapshot.run_id
    return f"{snapshot.run_name} ({snapshot.run_id})"


class StatusBar(Horizontal):
    """One line: run, swarm and peer id on the left; state badge, uptime and this client's version on the
    right (the version peers' records carry, to compare when something differs)."""

    DEFAULT_CSS = """
    StatusBar {
        height: 1;
        background: $panel;
    }
    StatusBar #identity {
        width: 1fr;
        padding: 0 1;
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }
    StatusBar #state {
        width: auto;
        padding: 0 1;
        text-style: bold;
        background: $warning;
        color: $text;
    }
    StatusBar #state.-online {
        background: $success;
    }
    StatusBar #state.-offline, StatusBar #state.-leaving {
        background: $error;
    }
    StatusBar #uptime {
        width: auto;
        padding: 0 1;
    }
    """

    def compose(self) -> ComposeResult:
        yield Static(id="identity")
        yield Static(id="state")
        yield Static(id="uptime")

    def show(self, snapshot: NodeSnapshot, *, uptime_s: float, leaving: bool) -> None:
        identity = Text.assemble(
            ("run ", "dim"), run_label(snapshot),
            ("  swarm ", "dim"), (snapshot.swarm, "bold"),
            ("  peer ", "dim"), snapshot.short_peer_id,
        )
        self.query_one("#identity", Static).update(identity)
        badge = self.query_one("#state", Static)
        badge.update(state_label(snapshot.state, leaving=leaving))
        badge.set_classes(f"-{'leaving' if leaving else snapshot.state.value}")
        self.query_one("#uptime", Static).update(
            Text.assemble(f"up {format_duration(uptime_s)}", (f"  v{__version__}", "dim")))


class NotTrainingBanner(Static):
    """The reason the node is not training, impossible to miss; hidden while it trains."""

    DEFAULT_CSS = """
    NotTrainingBanner {
        height: auto;
        padding: 0 1;
        background: $warning;
        color: $text;
        text-style: bold;
        display: none;
    }
    NotTrainingBanner.-shown {
        display: block;
    }
    """

    def show(self, line: str) -> None:
        self.update(line)
        self.set_class(bool(line), "-shown")
