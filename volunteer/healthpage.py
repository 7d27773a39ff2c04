"""The run health page (`volunteer status --serve PORT`): pure parts, no network.

For the people who organise a run: every swarm's coverage, throughput and bottleneck, every peer
(state, throughput, version, how long since its heartbeat), and the run's evaluation over time as a
plot. ``History`` keeps the points a long-lived reader has seen; ``render_page`` turns a status report
(``volunteer_cli.commands.status.build_report``) and the history into one HTML page (no script: it
reloads itself); ``page_data`` is the same content for the JSON endpoint.

Everything on the page that comes from a record is a stranger's text (a version string can hold
markup): it is escaped, never interpolated raw.
"""

from __future__ import annotations

import html
import json
import logging
import math
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HISTORY_POINTS = 2000  # ~2.8 h at one read per 5 s
PLOT_W, PLOT_H, PLOT_PAD = 640, 240, 40


@dataclass(frozen=True)
class Point:
    at: float  # unix time of the read
    samples: int  # run-wide samples of the evaluation
    accuracy: float | None
    loss: float | None
    throughput: float  # the bottleneck swarm's samples/s (the pipeline cannot go faster)


class History:
    """The run's evaluation and throughput as this reader saw them, one point per new evaluation. With ``path``
    the points are kept in a JSON-lines file: a page started again (or later) shows the run's curve from the
    first evaluation it ever read, not from when it started. A line that does not parse is skipped."""

    def __init__(self, max_points: int = HISTORY_POINTS, path: Path | None = None):
        self.points: deque[Point] = deque(maxlen=max_points)
        self.path = path
        if path is not None:
            self._load(path)

    def _load(self, path: Path) -> None:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError:
            return
        for line in lines:
            try:
                point = Point(**json.loads(line))
            except (ValueError, TypeError):
                continue
            if not self.points or point.samples > self.points[-1].samples:
                self.points.append(point)

    def _keep(self, point: Point) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(asdict(point)) + "\n")
        except OSError as exc:  # a read-only or full disk: the page goes on with what it has in memory
            logging.getLogger(__name__).warning("could not keep the run's history in %s: %s", self.path, exc)
            self.path = None

    def add(self, report: dict[str, Any], now: float) -> bool:
        """Add the report's evaluation if it is newer than the last point (True if added)."""
        ev = report.get("evaluation")
        if not ev:
            return False
        samples = int(ev.get("samples") or 0)
        if self.points and samples <= self.points[-1].samples:
            return False
        loss = ev.get("test_loss")
        self.points.append(Point(at=now, samples=samples, accuracy=ev.get("test_accuracy"),
                                 loss=loss if loss is not None and loss >= 0 else None,
                                 throughput=pipeline_throughput(report)))
        self._keep(self.points[-1])
        return True

    def to_json(self) -> list[dict[str, Any]]:
        return [asdict(p) for p in self.points]


def pipeline_throughput(report: dict[str, Any]) -> float:
    """The slowest swarm's online throughput: what the pipeline as a whole can pass (samples/s)."""
    summary = report.get("summary", {})
    return min((s["throughput"] for s in summary.values()), default=0.0)


def bottleneck(report: dict[str, Any]) -> str | None:
    """The swarm that limits the run: one with no peer online, else the least throughput."""
    from volunteer.node.records import bottleneck_swarm
    from volunteer.snapshot import SwarmRow

    rows = [SwarmRow(name=name, online=s["online"], total=s["total"], throughput=s["throughput"], best_loss=None)
            for name, s in report.get("summary", {}).items()]
    return bottleneck_swarm(rows)


def page_data(report: dict[str, Any], history: History, read_at: float | None, now: float,
              error: str = "") -> dict[str, Any]:
    """The JSON endpoint: the report, the history, the bottleneck, and how old the read is."""
    return {"report": report, "history": history.to_json(), "bottleneck": bottleneck(report) if report else None,
            "read_at": read_at, "age_s": None if read_at is None else round(max(0.0, now - read_at), 1),
            "error": error}


def plot_svg(points: list[Point], width: int = PLOT_W, height: int = PLOT_H) -> str:
    """Test accuracy (or, for a language model, test loss) against run-wide samples, as inline SVG."""
    use_accuracy = any(p.accuracy is not None for p in points)
    series = [(p.samples, p.accuracy if use_accuracy else p.loss) for p in points]
    series = [(x, y) for x, y in series if y is not None and math.isfinite(y)]
    label = "test accuracy" if use_accuracy else "test loss"
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
            f'aria-label="{label} against samples">')
    frame = (f'<rect x="{PLOT_PAD}" y="10" width="{width - PLOT_PAD - 10}" height="{height - PLOT_PAD - 10}" '
             f'fill="none" stroke="#999"/>')
    if not series:
        return (head + frame + f'<text x="{width // 2}" y="{height // 2}" text-anchor="middle">no evaluation '
                f'yet: the curve starts with the first one a driver publishes</text></svg>')
    xs, ys = [x for x, _ in series], [y for _, y in series]
    if len(series) == 1:  # one evaluation: a dot and its figure, not an empty box with an axis of x..x+1
        left, top = PLOT_PAD, 10
        cx, cy = left + (width - PLOT_PAD - 10) / 2, top + (height - PLOT_PAD - 10) / 2
        return (head + frame + f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="4" fill="#1f77b4"/>'
                f'<text x="{cx:.1f}" y="{cy - 10:.1f}" text-anchor="middle">{label} {ys[0]:.3g} after {xs[0]:,} '
                f'samples: the only evaluation so far</text></svg>')
    x0, x1 = min(xs), max(max(xs), min(xs) + 1)
    y0, y1 = (0.0, 1.0) if use_accuracy else (min(ys), max(max(ys), min(ys) + 1e-6))
    left, top, w, h = PLOT_PAD, 10, width - PLOT_PAD - 10, height - PLOT_PAD - 10

    def at(x: float, y: float) -> str:
        return f"{left + (x - x0) / (x1 - x0) * w:.1f},{top + h - (y - y0) / (y1 - y0) * h:.1f}"

    line = " ".join(at(x, y) for x, y in series)
    axes = (f'<text x="{left}" y="{height - 8}">{x0:,} samples</text>'
            f'<text x="{width - 10}" y="{height - 8}" text-anchor="end">{x1:,}</text>'
            f'<text x="4" y="{top + 10}">{y1:.3g}</text><text x="4" y="{top + h}">{y0:.3g}</text>'
            f'<text x="{width // 2}" y="{height - 8}" text-anchor="middle">{label}</text>')
    return head + frame + f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{line}"/>' + axes + "</svg>"


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    return f"{seconds:.0f} s ago" if seconds < 120 else f"{seconds / 60:.0f} min ago"


def _evaluation_html(report: dict[str, Any]) -> str:
    ev = report.get("evaluation")
    if not ev:
        return "<p>No evaluation published yet.</p>"
    if ev.get("test_accuracy") is not None:
        figure = f"test accuracy {ev['test_accuracy'] * 100:.1f} %"
    else:
        figure = f"test loss {ev['test_loss']:.3f}"
    age = f", measured {_age(ev['age_s'])}" if ev.get("age_s") is not None else ", time not published"
    stale = ' <strong class="stale">STALE: no newer evaluation</strong>' if ev.get("stale") else ""
    return (f'<p id="evaluation">{_e(figure)} after {int(ev["samples"]):,} samples{_e(age)}'
            f' (by {_e(str(ev["by"])[-8:])}){stale}</p>')


def _swarms_html(report: dict[str, Any], marked: str | None) -> str:
    rows = []
    for name, s in report.get("summary", {}).items():
        flags = []
        if s["empty"]:
            flags.append("NO ONLINE PEER: the pipeline cannot pass this layer")
        if name == marked:
            flags.append("bottleneck")
        if s.get("stalled_s"):
            flags.append(f"no micro-batch completed for {s['stalled_s']:.0f} s")
        heals = report.get("heals", {}).get(name, 0)
        rows.append(f'<tr class="swarm{" bottleneck" if name == marked else ""}"><td>{_e(name)}</td>'
                    f'<td>{s["online"]} / {s["total"]}</td><td>{s["throughput"]:.1f}</td><td>{heals}</td>'
                    f'<td>{_e("; ".join(flags))}</td></tr>')
    return ('<table id="swarms"><tr><th>swarm</th><th>online / peers</th><th>samples/s</th><th>heals</th>'
            '<th></th></tr>' + "".join(rows) + "</table>")


def _mbps(peer: dict[str, Any]) -> str:
    if peer.get("mbps_in") is None or peer.get("mbps_out") is None:
        return "-"
    return f"{float(peer['mbps_in']):.2f} / {float(peer['mbps_out']):.2f}"


REACHABLE_TEXT = {True: "yes", False: "no (behind NAT)", None: "not known"}


def _peers_html(report: dict[str, Any]) -> str:
    rows = []
    for name, peers in report.get("swarms", {}).items():
        for p in peers:
            loss = f"{p['loss']:.3f}" if p.get("loss") is not None else "-"
            rows.append(f'<tr class="peer state-{_e(p["state"])}"><td>{_e(name)}</td>'
                        f'<td title="{_e(p["peer_id"])}">{_e(str(p["peer_id"])[-8:])}</td><td>{_e(p["state"])}</td>'
                        f'<td>{p["throughput"]:.1f}</td><td>{loss}</td><td>{_mbps(p)}</td>'
                        f'<td class="reachable">{_e(REACHABLE_TEXT.get(p.get("reachable"), "not known"))}</td><td>{_e(p["version"])}</td>'
                        f'<td>{_e(_age(p["age_s"]))}</td><td class="work">{_e(_work(name, p))}</td>'
                        f'<td class="stalled">{_stalled(p)}</td><td class="refuses">{_e(_refuses(p))}</td></tr>')
    return ('<table id="peers"><tr><th>swarm</th><th>peer</th><th>state</th><th>samples/s</th><th>loss</th>'
            '<th>Mb/s in / out</th><th>dialled from outside</th><th>version</th><th>heartbeat</th><th>work done</th>'
            '<th>without progress</th><th>refuses drivers</th></tr>' + "".join(rows) + "</table>")


def _work(swarm: str, peer: dict[str, Any]) -> str:
    """What the peer did for the run: a driver trains samples, every other stage serves micro-batches (it trains
    none of its own: "trained 0" read as idle for every peer of layers 1-3)."""
    if swarm == "layer0":
        return f"trained {int(peer.get('trained') or 0):,} samples"
    return f"served {int(peer.get('served') or 0):,} micro-batches"


def _stalled(peer: dict[str, Any]) -> str:
    """Seconds the peer wanted to train and completed no micro-batch ("-" when not published)."""
    return "-" if peer.get("stalled_s") is None else f"{float(peer['stalled_s']):.0f} s"


def _refuses(peer: dict[str, Any]) -> str:
    if peer.get("drivers_refused") is None:
        return "-"
    text = f"{int(peer['drivers_refused'])} of {int(peer.get('drivers_seen') or 0)}"
    return text + (f": {peer['ban_reason']}" if peer.get("drivers_refused") and peer.get("ban_reason") else "")


STYLE = ("body{font-family:sans-serif;margin:1.5em;max-width:70em}table{border-collapse:collapse;margin:.5em 0}"
         "td,th{border:1px solid #ccc;padding:.2em .6em;text-align:left}.bottleneck{background:#fff3cd}"
         ".stale,.error{color:#b00}.state-healing{color:#b60}.state-offline{color:#999}")


def render_page(data: dict[str, Any], refresh_s: int = 5) -> str:
    """One self-contained HTML page from ``page_data``: no script, it reloads every ``refresh_s``."""
    report = data.get("report") or {}
    head = (f'<!doctype html><html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{refresh_s}">'
            f'<title>run {_e(report.get("run_id", "?"))}: health</title><style>{STYLE}</style></head><body>')
    read = (f'<p id="read">read from the DHT {_e(_age(data.get("age_s")))}'
            f'{" (this page reloads every " + str(refresh_s) + " s)"}</p>')
    error = f'<p class="error" id="error">last read failed: {_e(data["error"])}</p>' if data.get("error") else ""
    if not report:
        return head + "<h1>Run health</h1>" + read + error + "<p>Waiting for the first read of the DHT.</p></body></html>"
    status = []
    if report.get("complete"):
        status.append(f'<p id="complete">RUN COMPLETE: {_e(report["complete"])}</p>')
    if report.get("idle_reason"):
        status.append(f'<p id="idle" class="error">NOT TRAINING: {_e(report["idle_reason"])}</p>')
    status += [f'<p class="error alarm">RUN ALARM: {_e(alarm)}</p>' for alarm in report.get("alarms", [])]
    points = [Point(**p) for p in data.get("history", [])]
    return (head + f'<h1>Run {_e(report["run_id"])}</h1>' + read + error + "".join(status)
            + _evaluation_html(report) + '<div id="plot">' + plot_svg(points) + "</div><h2>Swarms</h2>"
            + _swarms_html(report, data.get("bottleneck")) + "<h2>Peers</h2>" + _peers_html(report)
            + '<p>JSON: <a href="/api/status">/api/status</a></p></body></html>')
