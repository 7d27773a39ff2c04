"""The dashboard's words and numbers, as plain functions (no app needed)."""

from __future__ import annotations

import pytest
from fake_engine import sample_snapshot, utc_timezone

from tui.format import (
    format_age,
    format_bytes,
    format_clock_time,
    format_count,
    format_duration,
    format_loss,
    format_rate,
    level_prefix,
    not_training_line,
    state_label,
    swarm_note,
)
from volunteer.snapshot import EventLevel, NodeState, SwarmRow


@pytest.mark.parametrize(("count", "text"), [(0, "0 B"), (999, "999 B"), (1_234, "1.2 kB"), (12_300_000_000, "12.3 GB"),
                                             (800_000_000, "800 MB")])
def test_bytes_read_like_a_system_monitor(count: int, text: str) -> None:
    assert format_bytes(count) == text


@pytest.mark.parametrize(("count", "text"), [(0, "0"), (9_999, "9,999"), (12_345, "12.3k"), (1_230_000, "1.23M"),
                                             (4_560_000_000, "4.56B")])
def test_counts_stay_short(count: int, text: str) -> None:
    assert format_count(count) == text


def test_rates_and_losses_keep_a_readable_precision() -> None:
    assert format_rate(200.54) == "200.5"
    assert format_rate(12_345.6) == "12,346"
    assert format_loss(0.32014) == "0.3201"
    assert format_loss(None) == "–"  # no loss before the first batch


@pytest.mark.parametrize(("seconds", "text"), [(0, "0s"), (59.9, "59s"), (3723, "1h 02m"), (75, "1m 15s"),
                                               (2 * 86400 + 4 * 3600, "2d 04h")])
def test_durations(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_a_peer_heard_from_just_now_reads_now() -> None:
    assert format_age(0.5) == "now"
    assert format_age(75) == "1m 15s ago"


def test_training_node_has_no_banner() -> None:
    assert not_training_line(sample_snapshot()) == ""


@pytest.mark.parametrize(("state", "reason", "expected"), [
    (NodeState.PAUSED, "on battery power", "PAUSED: on battery power (press r to resume)"),
    (NodeState.PAUSED, "", "PAUSED: paused (press r to resume)"),
    (NodeState.JOINING, "", "JOINING: looking for the run's peers (training starts by itself)"),
    (NodeState.SYNCING, "downloading layer3 from 7Hk2aBcD", "SYNCING: downloading layer3 from 7Hk2aBcD"),
    (NodeState.FINISHING, "", "FINISHING: completing the work already taken, then pausing (press r to keep"),
    (NodeState.OFFLINE, "no bootstrap peer answered", "OFFLINE: no bootstrap peer answered (press q to leave)"),
])
def test_not_training_says_why_and_what_to_do(state: NodeState, reason: str, expected: str) -> None:
    assert not_training_line(sample_snapshot(state=state, reason=reason)).startswith(expected)


def test_leaving_and_silence_are_announced() -> None:
    assert not_training_line(sample_snapshot(), leaving=True).startswith("LEAVING")
    quiet = not_training_line(sample_snapshot(), silent_s=45, stale_after_s=15)
    assert quiet.startswith("NO NEWS from the node for 45s")
    assert state_label(NodeState.ONLINE, leaving=True) == "LEAVING"


def test_swarm_marks_are_words() -> None:
    assert swarm_note(SwarmRow("layer4", 1, 2, bottleneck=True), my_swarm="layer3") == "◀ bottleneck"
    assert swarm_note(SwarmRow("layer3", 3, 3), my_swarm="layer3") == "you"
    assert swarm_note(SwarmRow("layer1", 3, 3), my_swarm="layer3") == ""
    # figures read a while ago say their age (a node that drives nothing reads the other swarms every 25 s)
    assert swarm_note(SwarmRow("layer1", 3, 3, read_at=100.0), my_swarm="layer3", now_s=120.0) == "read 20s ago"
    assert swarm_note(SwarmRow("layer3", 3, 3, read_at=115.0), my_swarm="layer3", now_s=120.0) == "you"


def test_problems_carry_a_word_not_only_a_colour() -> None:
    assert level_prefix(EventLevel.WARNING) == "WARNING"
    assert level_prefix(EventLevel.ERROR) == "ERROR"
    assert level_prefix(EventLevel.INFO) == ""


def test_event_times_are_local_wall_clock() -> None:
    with utc_timezone():
        assert format_clock_time(3723) == "01:02:03"


def test_an_evaluation_always_says_how_old_it_is():
    from tui.format import format_evaluation
    from volunteer.snapshot import describe_evaluation, evaluation_is_stale

    assert format_evaluation(0.9123, 0.3, 12.0, stale=False) == "acc 91.2% · 12s ago"
    assert format_evaluation(0.9123, 0.3, 190.0, stale=True) == "acc 91.2% · STALE 3m 10s"
    assert format_evaluation(None, 2 * 0.6931471805599453, None, stale=False) == "test 2.00 bits/byte · age ?"
    assert not evaluation_is_stale(20.0, 10.0) and evaluation_is_stale(20.1, 10.0)
    assert not evaluation_is_stale(None, 10.0)
    assert "STALE" in describe_evaluation(0.97, 0.1, 25.0, 10.0)
    assert describe_evaluation(0.97, 0.1, 5.0, 10.0) == "test accuracy 97.0% (5 s ago)"
    assert describe_evaluation(None, 1.3863, 5.0, 10.0) == "test 2.00 bits/byte (loss 1.386 nats/byte) (5 s ago)"


def test_spot_checks_are_shown_with_what_came_of_them() -> None:
    """The dashboard's "checks" row and `volunteer ctl status`: outputs of other peers this node had recomputed,
    the odd ones out penalised, and those left unpunished because their accusers had less validated work."""
    from tui.format import format_checks
    from volunteer_cli.commands.ctl import render_status

    assert format_checks(212, 1, 0) == "212 · 1 caught"
    assert format_checks(1500, 0, 2) == "1,500 · 0 caught · 2 not penalised"
    text = render_status({"state": "online", "spot_checked": 40, "spot_caught": 1, "spot_outweighed": 2})
    assert "spot checks 40 (1 caught, 2 not penalised: their accusers had less validated work)" in text
    assert "spot checks" not in render_status({"state": "online", "spot_checked": 0})


def test_how_a_drivers_micro_batches_travel_is_said_where_it_drives():
    """layer0's status and dashboard say how its micro-batches travel (stage to stage, or relayed by it, and why)."""
    from swarm.pipeline.control.push_driver import Pusher
    from volunteer_cli.commands.ctl import render_status

    pusher = Pusher.__new__(Pusher)
    pusher.pushed, pusher.relayed, pusher.partial, pusher.recovered = 96, 3, 1, 0
    pusher.avoid, pusher.cannot = {"a": float("inf"), "b": 0.0}, {"c"}
    assert pusher.describe() == "stage to stage 96% · 2 peers relayed now"
    pusher.pushed = pusher.relayed = pusher.partial = 0
    assert pusher.describe() == ""  # nothing driven yet: nothing said
    assert "transfer stage to stage 96%" in render_status({"state": "online", "data_plane": "stage to stage 96%"})
    assert "transfer" not in render_status({"state": "online", "data_plane": ""})
