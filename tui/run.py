"""'The run' (every layer swarm, the bottleneck marked, test accuracy) and 'Peers' (my swarm's
members, my own row marked): read-only tables refreshed in place from each snapshot."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable

from tui.format import format_age, format_count, format_evaluation, format_loss, format_rate, swarm_note
from volunteer.snapshot import NodeSnapshot, NodeState, PeerRow, SwarmRow, short_id

Cells = tuple[str | Text, ...]

SWARM_COLUMNS = ("swarm", "peers", "samples/s", "best loss", "")
PEER_COLUMNS = ("peer", "state", "samples/s", "loss", "clock", "last seen", "")
RIGHT_ALIGNED = {"peers", "samples/s", "best loss", "loss", "clock", "last seen"}
MY_ROW_MARK = "◀ you"
ONLINE_PEER_STATE = NodeState.ONLINE.value
_BOTTLENECK_STYLE = "bold red"
_BOTTLENECK_NOTE_NO_COLOR = "bold reverse"  # red turns to a dim grey under NO_COLOR; reverse stands out
_MINE_STYLE = "bold"


def set_rows(table: DataTable, rows: Sequence[tuple[str, Cells]]) -> None:
    """Show ``rows`` (key, cells) in order; update cells in place when the keys did not change,
    so the cursor and scroll position survive the once-a-second refresh. A repeated key is shown once."""
    unique: dict[str, Cells] = {}
    for key, cells in rows:
        unique.setdefault(key, cells)
    keys = list(unique)
    if keys != [row_key.value for row_key in table.rows]:
        cursor_row = table.cursor_row
        table.clear()
        for key, cells in unique.items():
            table.add_row(*cells, key=key)
        if unique:
            table.move_cursor(row=min(cursor_row, len(unique) - 1), animate=False)
        return
    for key, cells in unique.items():
        for column_key, value in zip(table.columns, cells, strict=True):
            table.update_cell(key, column_key, value, update_width=True)


def _header(label: str) -> Text:
    return Text(label, justify="right" if label in RIGHT_ALIGNED else "left")


def _right(value: str, style: str = "") -> Text:
    return Text(value, style=style, justify="right")


def swarm_cells(swarm: SwarmRow, my_swarm: str, *, no_color: bool = False, now_s: float | None = None) -> Cells:
    if swarm.bottleneck and no_color:
        style, note_style = _MINE_STYLE, _BOTTLENECK_NOTE_NO_COLOR
    elif swarm.bottleneck:
        style = note_style = _BOTTLENECK_STYLE
    else:
        style = note_style = _MINE_STYLE if swarm.name == my_swarm else ""
    return (
        Text(swarm.name, style=style),
        _right(f"{swarm.online}/{swarm.total}", style),
        _right(format_rate(swarm.throughput), style),
        _right(format_loss(swarm.best_loss), style),
        Text(swarm_note(swarm, my_swarm, now_s), style=note_style),
    )


def peer_cells(peer: PeerRow) -> Cells:
    style = _MINE_STYLE if peer.is_me else ""
    return (
        Text(peer_label(peer), style=style),
        Text(peer.state, style=style),
        _right(format_rate(peer.throughput), style),
        _right(format_loss(peer.loss), style),
        _right(format_count(peer.clock), style),
        _right(format_age(peer.age_s), style),
        Text(MY_ROW_MARK if peer.is_me else "", style=style),
    )


def peer_label(peer: PeerRow) -> str:
    return short_id(peer.peer_id)


class ReadOnlyTable(DataTable):
    """A DataTable that scrolls with the keys but never paints a cursor that could pass for 'mine'."""

    DEFAULT_CSS = """
    ReadOnlyTable {
        height: auto;
        max-height: 100%;
        background: $surface;
    }
    """

    def __init__(self, columns: Sequence[str], *, id: str) -> None:
        super().__init__(id=id, show_cursor=False, cursor_type="row", zebra_stripes=False, cell_padding=1)
        self._column_labels = columns

    def on_mount(self) -> None:
        for label in self._column_labels:
            self.add_column(_header(label))


class SwarmsPanel(Vertical):
    DEFAULT_CSS = """
    SwarmsPanel {
        height: auto;
    }
    SwarmsPanel > ReadOnlyTable {
        width: auto;
    }
    """

    def compose(self) -> ComposeResult:
        yield ReadOnlyTable(SWARM_COLUMNS, id="swarms")

    def on_mount(self) -> None:
        self.border_title = "The run"

    def show(self, snapshot: NodeSnapshot, now: float) -> None:
        no_color = self.app.no_color
        rows = [(swarm.name, swarm_cells(swarm, snapshot.swarm, no_color=no_color, now_s=now))
                for swarm in snapshot.swarms]
        set_rows(self.query_one("#swarms", ReadOnlyTable), rows)
        count = len(snapshot.swarms)  # short: at 80 columns "1 layer swarms · acc 93.3% · 2…" lost the age
        title = f"The run: {count} swarm{'s' if count != 1 else ''}" if count else "The run: no swarm seen yet"
        if snapshot.test_accuracy is not None or snapshot.test_loss is not None:
            age_s = None if snapshot.test_at is None else max(0.0, now - snapshot.test_at)
            title += " · " + format_evaluation(snapshot.test_accuracy, snapshot.test_loss, age_s,
                                               snapshot.evaluation_stale(now))
        self.border_title = title


class PeersPanel(Vertical):
    DEFAULT_CSS = """
    PeersPanel {
        height: 1fr;
    }
    """

    def compose(self) -> ComposeResult:
        yield ReadOnlyTable(PEER_COLUMNS, id="peers")

    def on_mount(self) -> None:
        self.border_title = "Peers"

    def show(self, snapshot: NodeSnapshot) -> None:
        rows = [(peer.peer_id, peer_cells(peer)) for peer in snapshot.peers]
        set_rows(self.query_one("#peers", ReadOnlyTable), rows)
        online = sum(1 for peer in snapshot.peers if peer.state == ONLINE_PEER_STATE)
        if snapshot.peers:
            self.border_title = f"Peers in {snapshot.swarm}: {online} of {len(snapshot.peers)} online"
        else:
            self.border_title = f"Peers in {snapshot.swarm}: none seen yet"
