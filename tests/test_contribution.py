"""What a volunteer sees of its own contribution, without a network: the tally across restarts, the
farewell, the device name and the session log (issue 16, item 10)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from volunteer.contribution import (
    MAX_TICK_GAP_S,
    Session,
    Tally,
    contribution_path,
    farewell,
    load_runs,
    machine_total,
    save_runs,
)
from volunteer.device import short_cpu_name
from volunteer.logfile import SessionLog, logs_to_remove
from volunteer.node.board import Board
from volunteer.node.contribution import Contribution
from volunteer.snapshot import NodeSnapshot, NodeState

PEER = "12D3KooWPeerA"
RUN_ID = "digits-mlp-0badc0de"


def test_a_session_counts_what_the_stage_served_and_the_time_online_only():
    session = Session(swarm="layer1", started_at=100.0)
    session.observe(0, 0, online=True, now_s=0.0, wall_s=100.0)
    session.observe(10, 320, online=True, now_s=1.0, wall_s=101.0)
    session.observe(12, 384, online=False, now_s=2.0, wall_s=102.0)  # paused: served work counts, time not
    session.observe(15, 480, online=True, now_s=3.0, wall_s=103.0)
    t = session.tally
    assert (t.microbatches, t.samples, t.online_s, t.sessions, t.swarms) == (15, 480, 2.0, 1, ("layer1",))
    assert (t.first_at, t.last_at) == (100.0, 103.0)


def test_a_new_stage_counts_from_zero_and_a_suspended_laptop_is_not_online_time():
    session = Session(swarm="layer0", started_at=0.0)
    session.observe(100, 3200, online=True, now_s=0.0, wall_s=0.0)
    session.observe(5, 160, online=True, now_s=3600.0, wall_s=3600.0)  # counters restarted, one-hour gap
    assert session.tally.microbatches == 105 and session.tally.samples == 3360
    assert session.tally.online_s == MAX_TICK_GAP_S


def test_the_file_keeps_every_run_and_skips_what_it_cannot_read(tmp_path: Path):
    path = contribution_path(tmp_path, PEER)
    save_runs(path, PEER, {RUN_ID: Tally(5, 160, 60.0, 1, 1.0, 2.0, ("layer1",)), "other-1": Tally(1, 32)})
    assert load_runs(path)[RUN_ID] == Tally(5, 160, 60.0, 1, 1.0, 2.0, ("layer1",))
    data = json.loads(path.read_text())
    data["runs"]["broken-2"] = {"microbatches": "many"}
    path.write_text(json.dumps(data))
    assert set(load_runs(path)) == {RUN_ID, "other-1"}
    path.write_text("{not json")
    assert load_runs(path) == {}
    assert load_runs(tmp_path / "missing.json") == {}


def test_the_machine_total_sums_every_identity_of_the_data_dir(tmp_path: Path):
    save_runs(contribution_path(tmp_path, "A"), "A", {RUN_ID: Tally(5, 160, 60.0, 2, 10.0, 20.0, ("layer0",))})
    save_runs(contribution_path(tmp_path, "B"), "B", {RUN_ID: Tally(3, 96, 30.0, 1, 5.0, 30.0, ("layer2",))})
    total = machine_total(tmp_path, RUN_ID)
    assert (total.microbatches, total.samples, total.online_s, total.sessions) == (8, 256, 90.0, 3)
    assert (total.first_at, total.last_at, total.swarms) == (5.0, 30.0, ("layer0", "layer2"))
    assert machine_total(tmp_path, "never-joined") == Tally()


def test_the_farewell_says_this_session_then_the_total_and_where_the_log_is():
    session = Tally(1234, 39488, 5400.0, 1, 0.0, 1.0, ("layer1",))
    total = Tally(9876, 316032, 40000.0, 3, 0.0, 1.0, ("layer1",))
    text = farewell(RUN_ID, session, total, "/tmp/join.log")
    assert "1,234 micro-batches (39,488 samples), 1.5 h online" in text and RUN_ID in text
    assert "9,876 micro-batches (316,032 samples), 11.1 h online over 3 sessions" in text
    assert text.endswith("Log of this session: /tmp/join.log")
    assert "In total" not in farewell(RUN_ID, session, session)  # a first session: no separate total


# ----- the node part, with a stand-in node


@dataclass
class FakeNode:
    data_dir: Path
    board: Board = field(default_factory=lambda: Board(NodeSnapshot(
        run_name="digits-mlp", run_id=RUN_ID, swarm="layer1", peer_id=PEER, state=NodeState.ONLINE)))
    swarm: str = "layer1"
    peer: object = True

    def __post_init__(self) -> None:
        self.options = SimpleNamespace(data_dir=self.data_dir)
        self.run = SimpleNamespace(run_id=RUN_ID)
        self.announcer = SimpleNamespace(metrics=None)

    def serve(self, served: int, samples: int) -> None:
        self.announcer.metrics = SimpleNamespace(served=served, samples=samples)


def test_a_restarted_node_shows_and_saves_the_total_of_its_sessions(tmp_path: Path):
    first = FakeNode(tmp_path)
    part = Contribution(first)
    first.serve(0, 0)
    part.tick(0.0)
    first.serve(10, 320)
    part.tick(1.0)
    part.close()
    assert "10 micro-batches (320 samples)" in part.farewell()

    again = FakeNode(tmp_path)  # the same identity joins again later
    part = Contribution(again)
    again.serve(0, 0)
    part.tick(0.0)
    again.serve(4, 128)
    part.tick(1.0)
    snap = again.board.snapshot()
    assert (snap.session_samples, snap.total_samples, snap.total_microbatches, snap.total_sessions) == (128, 448, 14, 2)
    part.close()
    assert load_runs(contribution_path(tmp_path, PEER))[RUN_ID].microbatches == 14
    assert "over 2 sessions" in part.farewell()
    assert Contribution(FakeNode(tmp_path)).farewell() == ""  # never served: nothing to say


# ----- the device and the session log


def test_cpu_names_keep_the_part_that_names_the_chip():
    assert short_cpu_name("Intel(R) Core(TM) i7-10700K CPU @ 3.80GHz") == "Intel Core i7-10700K"
    assert short_cpu_name("AMD Ryzen 7 5800X 8-Core Processor") == "AMD Ryzen 7 5800X"
    assert short_cpu_name("AMD Ryzen 7 PRO 4750U with Radeon Graphics") == "AMD Ryzen 7 PRO 4750U"
    assert short_cpu_name("Apple M2") == "Apple M2"


def test_old_session_logs_are_removed_oldest_first():
    names = [f"join-2026112{i}-000000-1.log" for i in range(5)] + ["notes.txt"]
    assert logs_to_remove(names, keep=3) == ["join-20261120-000000-1.log", "join-20261121-000000-1.log"]
    assert logs_to_remove(names, keep=10) == []


def test_the_session_log_gets_events_and_info_records_while_the_terminal_keeps_its_level(tmp_path: Path):
    root = logging.getLogger()
    terminal = logging.StreamHandler()
    level_before = root.level
    root.addHandler(terminal)
    root.setLevel(logging.WARNING)
    log = SessionLog(tmp_path / "logs" / "join-20261123-000000-1.log")
    try:
        logging.getLogger("volunteer.test").info("checkpoint saved")
        events = log.event_log()
        board = Board(NodeSnapshot(run_name="r", run_id="r-1", swarm="layer0", peer_id="", state=NodeState.JOINING))
        board.add_listener(events.on_snapshot, events.on_event)
        board.emit("joined the DHT as PeerA")
    finally:
        log.close()
        root.removeHandler(terminal)
        root.setLevel(level_before)
    text = log.path.read_text()
    assert "INFO volunteer.test: checkpoint saved" in text and "joined the DHT as PeerA" in text
    assert terminal.level == logging.WARNING  # -v decides what the terminal shows, not the log file


def test_status_ends_with_what_this_machine_gave_the_run(tmp_path: Path):
    from swarm.run.runconfig import RunConfig
    from volunteer_cli.commands.status import build_report, render_report

    run = RunConfig(name="digits-mlp")
    mine = Tally(9876, 316032, 40000.0, 3, 0.0, 1.0, ("layer1",))
    report = build_report(run, {}, now=100.0, this_machine=mine)
    assert report["this_machine"]["samples"] == 316032
    last = render_report(report).splitlines()[-1]
    assert last == "this machine gave the run 9,876 micro-batches (316,032 samples), 11.1 h online over 3 sessions"
    assert "this_machine" not in build_report(run, {}, now=100.0)


def test_ctl_status_shows_the_contribution_and_the_log():
    from volunteer_cli.commands.ctl import render_status

    snap = NodeSnapshot(run_name="r", run_id="r-1", swarm="layer1", peer_id="P", state=NodeState.ONLINE,
                        session_samples=320, total_microbatches=14, total_samples=448, total_online_s=5400.0,
                        total_sessions=2, log_path="/data/logs/join-1.log")
    text = render_status(snap.to_json())
    assert ("contribution: 320 samples this session; in total 14 micro-batches (448 samples), 1.5 h online over "
            "2 session(s)") in text
    assert "log: /data/logs/join-1.log" in text


def test_short_sessions_are_counted_in_seconds():
    from volunteer.contribution import format_hours

    assert (format_hours(35.0), format_hours(150.0), format_hours(5400.0)) == ("35 s", "2 min", "1.5 h")


def test_the_machine_total_says_it_sums_identities_the_farewell_counts_its_own(tmp_path: Path):
    """Issue 30, item 9: the farewell's "in total" (10,165 micro-batches over 2 sessions) differed from the total
    `status` printed (30,099 over 5) without saying why: one counts an identity, the other the machine."""
    from swarm.run.runconfig import RunConfig
    from volunteer_cli.commands.status import build_report, render_report

    run = RunConfig(name="digits-mlp")
    mine = Tally(30099, 963168, 4000.0, 5, 0.0, 1.0, ("layer1",))
    last = render_report(build_report(run, {}, now=100.0, this_machine=(mine, 3))).splitlines()[-1]
    assert last.endswith("over 5 sessions of 3 volunteer identities (a volunteer's farewell counts its own)")
    session = Tally(10, 320, 60.0, 1, 0.0, 1.0, ("layer1",))
    total = Tally(10165, 325280, 600.0, 2, 0.0, 1.0, ("layer1",))
    assert "sessions of this identity (`volunteer status` sums every identity on this machine)" in farewell(
        RUN_ID, session, total)


def test_ctl_status_says_a_stall_and_the_runs_alarms():
    """Issue 30: the dashboard said STALLED and RUN ALARM; `volunteer ctl status` said neither."""
    from volunteer_cli.commands.ctl import render_status

    snap = NodeSnapshot(run_name="r", run_id="r-1", swarm="layer0", peer_id="P", state=NodeState.ONLINE,
                        stalled_s=42.0, run_alarms=("layer1 refuses all 4 drivers: 10 strikes",))
    lines = render_status(snap.to_json()).splitlines()
    assert lines[1] == "STALLED: no micro-batch completed for 42 s while it wants to train"
    assert lines[2] == "RUN ALARM: layer1 refuses all 4 drivers: 10 strikes"
    assert "STALLED" not in render_status(NodeSnapshot(run_name="r", run_id="r-1", swarm="layer0", peer_id="P",
                                                       state=NodeState.ONLINE).to_json())


def test_ctl_status_says_how_old_a_swarms_figures_are_where_the_node_read_them_a_while_ago():
    """A node that drives nothing reads the other swarms every 25 s: `volunteer ctl status` says so, as the dashboard."""
    import time

    from volunteer.snapshot import SwarmRow
    from volunteer_cli.commands.ctl import render_status

    now = time.time()
    snap = NodeSnapshot(run_name="r", run_id="r-1", swarm="layer1", peer_id="P", state=NodeState.ONLINE,
                        swarms=(SwarmRow("layer0", 1, 1, read_at=now - 20), SwarmRow("layer1", 2, 2, read_at=now - 1)))
    (line,) = [line for line in render_status(snap.to_json()).splitlines() if line.startswith("swarms: ")]
    assert line.startswith("swarms: layer0 1 online (read 2") and line.endswith("layer1 2 online")
