"""The help screen (?): what the keys do and what the dashboard's words mean.

It fits whole, with no scrolling, in an 80x24 terminal (tests/tui_snapshots/help_80x24.txt): add a
line only with one taken away.
"""

from __future__ import annotations

from typing import ClassVar

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

KEYS: tuple[tuple[str, str], ...] = (
    ("p", "pause now; work in flight is handed back"),
    ("f", "finish the work already taken, then pause"),
    ("r", "resume training"),
    ("q, ctrl+c", "quit: leave the swarm cleanly; again: exit at once"),
    ("tab", "focus a table or the events log; arrows scroll it"),
)  # "?" and escape close the help: the box's subtitle says so

GLOSSARY: tuple[tuple[str, str], ...] = (
    ("swarm", "the peers holding one layer of the model; you are in one"),
    ("samples/s", "training samples per second: yours, or a whole swarm's"),
    ("loss", "how wrong the model still is (lower is better)"),
    ("clock", "samples trained into a copy of the layer so far"),
    ("bottleneck", "the slowest swarm: the whole run goes at its pace"),
    ("batches", "micro-batches that went through your layer"),
    ("averaged", "blended your weights with peers' copies to stay in step"),
    ("adopted", "took a peer's copy that scored better on held-out data"),
    ("healing", "your copy went bad; it restores its last good state"),
    ("banned", "a peer sent bad results and is ignored for a while"),
    ("greyed keys", "do nothing in the current state (r while training)"),
)

KEY_COLUMN_WIDTH = max(len(key) for key, _ in KEYS + GLOSSARY)  # both lists line up


def two_columns(rows: tuple[tuple[str, str], ...], key_style: str) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style=key_style, no_wrap=True, min_width=KEY_COLUMN_WIDTH)
    table.add_column()
    for key, text in rows:
        table.add_row(key, text)
    return table


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    HelpScreen {
        align: center middle;
    }
    HelpScreen > VerticalScroll {
        scrollbar-size-vertical: 1;
        width: 94%;
        max-width: 88;
        height: auto;
        max-height: 90%;
        border: round $accent;
        border-title-align: center;
        background: $surface;
        padding: 0 1;
    }
    HelpScreen Static {
        height: auto;
    }
    HelpScreen .heading {
        text-style: bold;
        margin-top: 1;
    }
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "close", "Close help"),
        Binding("question_mark", "close", "Close help", key_display="?"),
    ]

    def compose(self) -> ComposeResult:
        with VerticalScroll() as box:
            box.border_title = "Help"
            box.border_subtitle = "escape or ? to close"
            yield Static(Text("Keys", style="bold"))
            yield Static(two_columns(KEYS, "bold"))
            yield Static("What the words mean", classes="heading")
            yield Static(two_columns(GLOSSARY, "bold"))

    def action_close(self) -> None:
        self.dismiss(None)
