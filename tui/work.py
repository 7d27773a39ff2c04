"""'Your work': what this machine contributes (speed and loss with their recent history, samples served
this session and in total across restarts, how stale the gradients it applies are) and what it costs (device, CPU,
memory, network)."""

from __future__ import annotations

import re

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Sparkline, Static

from tui.format import (
    format_bytes,
    format_checks,
    format_count,
    format_duration,
    format_loss,
    format_prediction,
    format_rate,
    format_staleness,
)
from volunteer.snapshot import NodeSnapshot, short_id

LABEL_WIDTH = 10  # "samples/s " and the figures below line up in one column
LINKS_SHOWN = 3  # the busiest links under "Mb/s" (ctl status --json has up to 8)
VALUE_WIDTH = 8  # "12,345" or "0.3201" right-aligned, one space before the sparkline


class Trend(Horizontal):
    """A labelled figure followed by a sparkline of its recent history."""

    DEFAULT_CSS = f"""
    Trend {{
        height: 1;
    }}
    Trend > .label {{
        width: {LABEL_WIDTH};
        color: $text-muted;
    }}
    Trend > .value {{
        width: {VALUE_WIDTH};
        text-align: right;
        padding-right: 1;
        text-style: bold;
    }}
    Trend > Sparkline {{
        width: 1fr;
        height: 100%;
    }}
    """

    def __init__(self, label: str, *, id: str) -> None:
        super().__init__(id=id)
        self._label = label

    def compose(self) -> ComposeResult:
        yield Static(self._label, classes="label")
        yield Static(classes="value")
        yield Sparkline([])

    def show(self, value: str, history: tuple[float, ...]) -> None:
        self.query_one(".value", Static).update(value)
        sparkline = self.query_one(Sparkline)
        sparkline.data = list(history)
        sparkline.display = bool(history)  # an empty sparkline draws a flat line that reads as zero


def contribution_total(snapshot: NodeSnapshot) -> Text:
    """'3.16M in 31h 10m': samples and time online over every session of this run on this machine."""
    if snapshot.total_sessions == 0:
        return Text("–")
    return Text.assemble((format_count(snapshot.total_samples), "bold"), f" in {format_duration(snapshot.total_online_s)}")


def short_device(device: str) -> str:
    """'Intel Xeon (cpu, 1 of 2 threads)' -> 'Intel Xeon (cpu)', 'NVIDIA H200 (cuda:0, 141 GiB)' -> 'NVIDIA H200
    (cuda:0)': the chip and where the stage runs; the threads and the GPU's size are in the log and `doctor`."""
    return re.sub(r" \(([^,()]+),[^()]*\)$", r" (\1)", device)


def figures_table(snapshot: NodeSnapshot) -> Table:
    """The label/value grid under the sparklines."""
    grid = Table.grid(padding=(0, 0))
    grid.add_column(style="dim", min_width=LABEL_WIDTH, no_wrap=True)
    # a value folds onto a second line rather than lose its end (at 80 columns "in total 25.7k in 2m 28" and
    # "device Intel Xeon (cp" were cut), and the rows go from the most to the least needed, so that what a short
    # terminal cuts at the bottom is the least needed (at 100x30 the staleness row pushed "reachable" out)
    grid.add_column(overflow="fold")
    # What this volunteer computed: this session, then all its sessions of the run (kept across restarts).
    # The copy's clock is in the peers table, on the row marked "you".
    grid.add_row("served", Text.assemble((format_count(snapshot.session_samples), "bold"), " samples"))
    grid.add_row("in total", contribution_total(snapshot))
    grid.add_row("reachable", reachability_text(snapshot))
    if snapshot.staleness_max is not None:  # updates between a micro-batch's forward and its backward here
        grid.add_row("staleness", Text.assemble(format_staleness(snapshot.staleness_mean, snapshot.staleness_p95,
                                                                 snapshot.staleness_max), " updates",
                                                format_prediction(snapshot.predicted_ahead)))
    if snapshot.spot_checked:  # outputs of other peers this node had recomputed and compared
        grid.add_row("checks", format_checks(snapshot.spot_checked, snapshot.spot_caught, snapshot.spot_outweighed))
    if snapshot.data_plane:  # layer0: stage to stage, or relayed by this driver (and why)
        grid.add_row("transfer", snapshot.data_plane)
    grid.add_row("device", short_device(snapshot.device))
    grid.add_row("cpu, ram", f"{snapshot.cpu_percent:.0f}%, {format_bytes(snapshot.memory_bytes)}")
    if snapshot.gpu_memory_bytes is not None:
        grid.add_row("gpu mem", format_bytes(snapshot.gpu_memory_bytes))
    grid.add_row("in, out", f"{format_bytes(snapshot.bytes_in)}, {format_bytes(snapshot.bytes_out)}")
    if snapshot.mbps_in > 0 or snapshot.mbps_out > 0:  # over the last heartbeat
        grid.add_row("Mb/s", f"{snapshot.mbps_in:.2f} in, {snapshot.mbps_out:.2f} out")
    for link in snapshot.links[:LINKS_SHOWN]:
        # the id fills the label column (8 of 10): a space on each side, or it runs into its figures
        grid.add_row(f" {short_id(link.peer_id)} ", f"{link.mbps_in:.2f} in, {link.mbps_out:.2f} out")
    return grid


REACHABILITY_WORDS = {"reachable": "yes", "unreachable": "NO: behind NAT", "local": "this machine only",
                      "checking": "checking...", "unknown": "not known yet"}


def reachability_text(snapshot: NodeSnapshot, now_s: float | None = None) -> Text:
    """Can other hosts dial this node, and how old that answer is (swarm/dht/reachability.py)."""
    import time

    words = REACHABILITY_WORDS.get(snapshot.reachability, snapshot.reachability)
    style = "bold red" if snapshot.reachability == "unreachable" else ""
    age = ""
    if snapshot.reachability_at is not None:
        age = f" ({format_duration(max(0.0, (now_s if now_s is not None else time.time()) - snapshot.reachability_at))} ago)"
    return Text.assemble((words, style), (age, "dim"))


class WorkPanel(Vertical):
    DEFAULT_CSS = """
    WorkPanel {
        height: auto;
        padding: 0 1;
    }
    WorkPanel #figures {
        height: auto;
    }
    """

    def compose(self) -> ComposeResult:
        yield Trend("samples/s", id="speed")
        yield Trend("loss", id="loss")
        yield Static(id="figures")

    def on_mount(self) -> None:
        self.border_title = "Your work"

    def show(self, snapshot: NodeSnapshot) -> None:
        self.query_one("#speed", Trend).show(format_rate(snapshot.samples_per_s), snapshot.samples_per_s_history)
        self.query_one("#loss", Trend).show(format_loss(snapshot.loss), snapshot.loss_history)
        self.query_one("#figures", Static).update(figures_table(snapshot))
