"""Never idle without a reason: a node online at 0 samples/s says which layers have nobody (issue 16)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from fake_engine import FakeEngine, run_scenario, sample_snapshot, screen_text  # noqa: E402
from procs import write_run  # noqa: E402
from swarm.dht.membership import empty_swarms, idle_reason  # noqa: E402
from swarm.dht.records import MemberRecord  # noqa: E402
from tui.format import not_training_line  # noqa: E402
from volunteer.config import load_run  # noqa: E402
from volunteer.snapshot import NodeState  # noqa: E402
from volunteer_cli.commands.status import build_report, render_report  # noqa: E402

NAMES = ["layer0", "layer1", "layer2", "layer3"]


def _record(peer: str, state: str = "online") -> MemberRecord:
    return MemberRecord(peer_id=peer, state=state, version="t", started_at=0.0, updated_at=100.0)


def test_the_reason_names_every_layer_that_has_no_online_peer():
    lone = {"layer2": [_record("me")], "layer0": [_record("p", "paused")]}
    assert empty_swarms(lone, NAMES) == ["layer0", "layer1", "layer3"]
    assert idle_reason(lone, NAMES).startswith("layers 0, 1 and 3 have no online peer: ")
    one = {name: [_record(name)] for name in NAMES if name != "layer1"}
    assert idle_reason(one, NAMES).startswith("layer 1 has no online peer")
    assert idle_reason({name: [_record(name)] for name in NAMES}, NAMES) == ""
    just_resumed = {**one, "layer1": [_record("me", "paused")]}  # our own record, a heartbeat old
    assert idle_reason(just_resumed, NAMES, online_here="layer1") == ""


def test_the_dashboard_banner_says_why_an_online_node_does_nothing():
    reason = "waiting: " + idle_reason({"layer2": [_record("me")]}, NAMES)
    line = not_training_line(sample_snapshot(state=NodeState.ONLINE, reason=reason, samples_per_s=0.0))
    assert line.startswith("ONLINE, NOT TRAINING: layers 0, 1 and 3 have no online peer")
    assert not_training_line(sample_snapshot()) == ""  # training: no banner

    engine = FakeEngine(sample_snapshot(state=NodeState.ONLINE, reason=reason, samples_per_s=0.0))

    async def scenario(app, pilot) -> None:
        text = " ".join(screen_text(app).split())
        assert "ONLINE, NOT TRAINING: layers 0, 1 and 3 have no online peer" in text

    run_scenario(engine, scenario, size=(120, 30))


def test_status_says_the_run_trains_nothing_and_why(tmp_path):
    run, _ = load_run(str(write_run(tmp_path / "run.yaml", stages=4)))
    report = build_report(run, {"layer2": [_record("me")]}, now=100.0)
    assert report["idle_reason"].startswith("layers 0, 1 and 3 have no online peer")
    assert "  NOT TRAINING: layers 0, 1 and 3 have no online peer" in render_report(report).splitlines()[1]
    full = build_report(run, {name: [_record(name)] for name in NAMES}, now=100.0)
    assert full["idle_reason"] == "" and "NOT TRAINING" not in render_report(full)
