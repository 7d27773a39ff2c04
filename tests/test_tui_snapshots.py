"""Whole-screen snapshots of the dashboard as plain text, compared with tests/tui_snapshots/*.txt.

Plain text on purpose: it is what a volunteer reads with NO_COLOR, so a snapshot that still makes
sense proves state, bottleneck, my row and problems are conveyed by words, not colour alone; and it
does not churn when textual's theme colours change. Times are fixed (FakeEngine's clock, UTC).

After an intended change of the screen, regenerate and review the diff:
    VOLUNTEER_UPDATE_SNAPSHOTS=1 python -m pytest -q tests/test_tui_snapshots.py && git diff tests/tui_snapshots
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest
from fake_engine import FakeEngine, run_scenario, sample_snapshot, screen_text
from textual.pilot import Pilot

from tui.app import VolunteerApp
from volunteer.snapshot import NodeState

SNAPSHOT_DIR = Path(__file__).parent / "tui_snapshots"
UPDATE_ENV = "VOLUNTEER_UPDATE_SNAPSHOTS"


def check_snapshot(name: str, text: str) -> None:
    path = SNAPSHOT_DIR / f"{name}.txt"
    if os.environ.get(UPDATE_ENV):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n", encoding="utf-8")
        return
    if not path.exists():
        pytest.fail(f"no snapshot {path}; create it with {UPDATE_ENV}=1")
    expected = path.read_text(encoding="utf-8").rstrip("\n")
    if text != expected:
        diff = "\n".join(difflib.unified_diff(expected.splitlines(), text.splitlines(), "stored", "now", lineterm=""))
        pytest.fail(f"the screen differs from {path.name} (regenerate with {UPDATE_ENV}=1 if intended):\n{diff}")


def capture(engine: FakeEngine, size: tuple[int, int], *keys: str) -> str:
    captured: list[str] = []

    async def scenario(app: VolunteerApp, pilot: Pilot) -> None:
        if keys:
            await pilot.press(*keys)
            await pilot.pause()
        captured.append(screen_text(app))

    run_scenario(engine, scenario, size=size)
    return captured[0]


@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])
def test_main_screen(size: tuple[int, int]) -> None:
    width, height = size
    check_snapshot(f"main_{width}x{height}", capture(FakeEngine(), size))


def test_paused_screen_puts_the_reason_first() -> None:
    paused = sample_snapshot(state=NodeState.PAUSED, reason="on battery power", samples_per_s=0.0)
    check_snapshot("paused_80x24", capture(FakeEngine(paused), (80, 24)))


def test_joining_screen_before_any_figure() -> None:
    joining = sample_snapshot(
        state=NodeState.JOINING, reason="", device="cpu", samples_per_s=0.0, loss=None, clock=0,
        microbatches_served=0, samples_per_s_history=(), loss_history=(), test_accuracy=None, test_loss=None,
        gpu_memory_bytes=None, bytes_in=0, bytes_out=0, swarms=(), peers=(), events=(),
        session_samples=0, session_online_s=0.0, total_microbatches=0, total_samples=0, total_online_s=0.0,
        total_sessions=0,  # a first join: nothing given yet
    )
    check_snapshot("joining_80x24", capture(FakeEngine(joining), (80, 24)))


def test_help_screen() -> None:
    check_snapshot("help_80x24", capture(FakeEngine(), (80, 24), "question_mark"))


def test_a_stall_and_a_refusing_stage_are_shown_on_top():
    stalled = sample_snapshot(samples_per_s=0.0, stalled_s=42.0, run_alarms=(
        "layer1 refuses all 4 drivers: 10 strikes, the last: wrong shard; no micro-batch can pass it",))
    check_snapshot("stalled_80x24", capture(FakeEngine(stalled), (80, 24)))


@pytest.mark.parametrize("size", [(80, 24), (100, 30)], ids=["80x24", "100x30"])
def test_no_figure_of_your_work_is_cut_or_pushed_out(size: tuple[int, int]) -> None:
    """Issue 30, item 9: at 80x24 "in total 25.7k in 2m 28" and "device Intel Xeon (cp" lost their ends, and at
    100x30 the staleness row pushed "reachable" off the panel. A long value now folds onto a second line and the
    rows run from the most to the least needed."""
    snapshot = sample_snapshot(device="Intel Xeon Platinum 8480C (cpu, 1 of 2 threads)", total_samples=25_712,
                               total_online_s=148.0, total_sessions=2, staleness_mean=1.2, staleness_p95=3.0,
                               staleness_max=4, reachability="local", links=())
    screen = capture(FakeEngine(snapshot), size)
    cut = screen.splitlines()[1].index("The run")  # the figures column, beside the run's table
    left = "\n".join(line[:cut] for line in screen.splitlines())
    flat = " ".join(left.split())
    assert "25.7k in 2m 28s" in flat, left
    assert "reachable this machine only" in flat, left
    if size[1] >= 30:  # 24 rows leave the panel 7: the least needed rows go at the bottom
        assert "staleness avg 1.2 · p95 3 · max 4 updates" in flat, left
        assert "device Intel Xeon Platinum 8480C (cpu)" in flat, left


def test_a_links_peer_id_does_not_run_into_its_figures() -> None:
    """Session 10, a real terminal: the busiest links' rows read "   vWQSs2ni30.57 in, 30.55 out" (the id filled
    the label column)."""
    from rich.console import Console

    from tui.work import figures_table
    from volunteer.snapshot import LinkRow

    snapshot = sample_snapshot(mbps_in=30.57, mbps_out=30.55,
                               links=(LinkRow("QmPeerAAAAvWQSs2ni", 30.57, 30.55),))
    console = Console(width=60, record=True, color_system=None)
    console.print(figures_table(snapshot))
    text = console.export_text()
    assert "Mb/s      30.57 in, 30.55 out" in text, text
    row = next(line for line in text.splitlines() if "in, 30.55 out" in line and "Mb/s" not in line)
    assert row.split() == ["vWQSs2ni", "30.57", "in,", "30.55", "out"], row
