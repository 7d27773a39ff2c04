"""The node's parts on their own, without a DHT: the pause/finish/resume transitions (who paused),
the command tickets, our membership record, and the swarm view the dashboard shows."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from swarm.dht.records import MemberRecord
from volunteer.node.board import Board
from volunteer.node.commands import (
    PAUSED_BY_POLICY,
    PAUSED_BY_USER,
    USER_PAUSE_REASON,
    CommandQueue,
    on_command,
    on_verdict,
)
from volunteer.node.records import build_record, run_evaluation, view_fields
from volunteer.snapshot import Command, NodeSnapshot, NodeState

ONLINE, PAUSED, FINISHING, JOINING = NodeState.ONLINE, NodeState.PAUSED, NodeState.FINISHING, NodeState.JOINING
NOW_S = 1_000_000.0


@dataclass
class Verdict:
    run: bool
    reason: str = ""


AWAY = Verdict(True)
BUSY = Verdict(False, "user active 12 s ago")


def test_a_users_pause_saves_a_checkpoint_and_takes_over_a_policy_pause():
    first = on_command(Command.PAUSE, ONLINE, None, AWAY)
    assert (first.state, first.reason, first.paused_by, first.save_checkpoint) == (
        PAUSED, USER_PAUSE_REASON, PAUSED_BY_USER, True)
    taken = on_command(Command.PAUSE, PAUSED, PAUSED_BY_POLICY, BUSY)
    assert taken.paused_by == PAUSED_BY_USER and "idle policy will not resume it" in taken.event
    assert not taken.save_checkpoint  # the policy's pause already saved
    again = on_command(Command.PAUSE, PAUSED, PAUSED_BY_USER, AWAY)
    assert again.event == "" and again.state == PAUSED


def test_commands_that_do_not_apply_to_the_state_do_nothing():
    assert on_command(Command.PAUSE, JOINING, None, None) is None  # queued commands wait for online
    assert on_command(Command.RESUME, ONLINE, None, None) is None
    assert on_command(Command.FINISH, FINISHING, PAUSED_BY_USER, None) is None
    assert on_command(Command.QUIT, ONLINE, None, None) is None  # the node stops; no state transition


def test_finish_drains_and_resume_is_held_by_a_policy_that_says_no():
    finish = on_command(Command.FINISH, ONLINE, None, None)
    assert finish.state == FINISHING and finish.paused_by == PAUSED_BY_USER
    assert on_command(Command.FINISH, PAUSED, PAUSED_BY_POLICY, None).paused_by == PAUSED_BY_USER
    held = on_command(Command.RESUME, PAUSED, PAUSED_BY_USER, BUSY)
    assert (held.state, held.reason, held.paused_by) == (PAUSED, BUSY.reason, PAUSED_BY_POLICY)
    assert "set idle.enabled: false" in held.event
    resumed = on_command(Command.RESUME, FINISHING, PAUSED_BY_USER, None)
    assert (resumed.state, resumed.reason, resumed.paused_by, resumed.event) == (ONLINE, "", None, "resumed")


def test_the_policy_lifts_only_its_own_pauses_and_ages_the_reason_quietly():
    paused = on_verdict(BUSY, ONLINE, None, "")
    assert (paused.state, paused.paused_by, paused.save_checkpoint) == (PAUSED, PAUSED_BY_POLICY, True)
    assert on_verdict(AWAY, PAUSED, PAUSED_BY_USER, USER_PAUSE_REASON) is None
    assert on_verdict(BUSY, PAUSED, PAUSED_BY_USER, USER_PAUSE_REASON) is None
    assert on_verdict(BUSY, FINISHING, PAUSED_BY_USER, "") is None  # a finish is the user's
    aged = on_verdict(Verdict(False, "user active 14 s ago"), PAUSED, PAUSED_BY_POLICY, BUSY.reason)
    assert aged.quiet and aged.reason == "user active 14 s ago"
    assert on_verdict(BUSY, PAUSED, PAUSED_BY_POLICY, BUSY.reason) is None  # same reason: nothing to say
    lifted = on_verdict(AWAY, PAUSED, PAUSED_BY_POLICY, BUSY.reason)
    assert (lifted.state, lifted.paused_by, lifted.kind) == (ONLINE, None, "resumed")


def test_a_ticket_is_applied_only_after_every_earlier_command():
    queue = CommandQueue()
    first, second = queue.put(Command.PAUSE), queue.put("resume")
    assert (first, second) == (1, 2) and not queue.wait_applied(first, 0)
    assert queue.pop() == Command.PAUSE
    queue.mark_applied()
    assert queue.wait_applied(first, 0) and not queue.wait_applied(second, 0)
    waiter = threading.Thread(target=lambda: (queue.pop(), queue.mark_applied()))
    waiter.start()
    assert queue.wait_applied(second, 5.0)
    waiter.join(5.0)
    assert queue.pop() is None


def test_the_board_replays_history_to_a_late_listener_and_survives_a_broken_one():
    board = Board(NodeSnapshot(run_name="r", run_id="r-1", swarm="layer0", peer_id="", state=JOINING))
    board.emit("joined", kind="joined")
    seen: list[str] = []
    snapshots: list[NodeSnapshot] = []

    def broken(snapshot):  # fine on the replay, then it breaks
        snapshots.append(snapshot)
        if len(snapshots) > 1:
            raise RuntimeError("a listener bug")

    board.add_listener(broken, lambda event: seen.append(event.text))
    board.publish(state=ONLINE)
    board.emit("online", kind="online")
    assert seen == ["joined", "online"] and board.snapshot().state == ONLINE
    assert [e.text for e in board.snapshot().events] == ["joined", "online"]


@dataclass
class Metrics:
    param_version: int = 7
    test_accuracy: float | None = None
    test_loss: float | None = 0.5
    eval_samples: int = 640
    trained: int = 1280
    lost: int = 2
    eval_at: float = NOW_S - 3
    eval_version: int = 6
    heals: int = 1


def test_our_record_carries_our_figures_and_none_as_minus_one():
    snap = NodeSnapshot(run_name="r", run_id="r-1", swarm="layer0", peer_id="QmMe", state=ONLINE,
                        samples_per_s=12.5, loss=None, clock=300, microbatches_served=9, test_accuracy=0.9)
    record = build_record(snap, state="online", version="0.1.0", started_at_s=NOW_S - 60, now_s=NOW_S,
                          shard=None, metrics=Metrics())
    assert (record.peer_id, record.throughput, record.loss, record.clock, record.served) == ("QmMe", 12.5, -1.0, 300, 9)
    assert (record.shard, record.param_version, record.trained, record.lost) == (-1, 7, 1280, 2)
    # only our own evaluation goes out: the snapshot's accuracy may be another peer's
    assert (record.test_accuracy, record.test_loss, record.eval_samples) == (-1.0, 0.5, 640)
    # the evaluation says when it ran and on which version of our copy; heals are counted
    assert (record.eval_at, record.eval_version, record.heals) == (NOW_S - 3, 6, 1)
    assert record.staleness_or_none is None  # not measured: -1 on the wire
    bare = build_record(snap, state="joining", version="0.1.0", started_at_s=NOW_S, now_s=NOW_S, shard=2,
                        metrics=None)
    assert (bare.shard, bare.param_version, bare.test_loss, bare.trained) == (2, 0, -1.0, 0)


def _rec(peer_id: str, state: str = "online", **fields) -> MemberRecord:
    return MemberRecord(peer_id=peer_id, state=state, version="0.1.0", started_at=NOW_S - 100,
                        updated_at=NOW_S - 2.04, **fields)


def test_the_view_marks_the_bottleneck_and_me_and_shows_the_current_evaluation():
    views = {
        "layer0": [_rec("a", throughput=10.0, loss=1.2, test_accuracy=0.5, eval_samples=100),
                   _rec("b", throughput=5.0, test_accuracy=0.7, test_loss=0.8, eval_samples=200)],
        "layer1": [_rec("me", throughput=3.0, shard=-1), _rec("c", state="paused", throughput=50.0)],
    }
    fields = view_fields(views, ["layer0", "layer1", "layer2"], "layer1", "me", NOW_S)
    rows = {row.name: row for row in fields["swarms"]}
    assert (rows["layer0"].online, rows["layer0"].throughput, rows["layer0"].best_loss) == (2, 15.0, 1.2)
    assert rows["layer2"].bottleneck and not rows["layer1"].bottleneck  # an empty swarm is the weakest
    me, other = fields["peers"]
    assert me.is_me and not other.is_me and me.age_s == 2.0 and other.state == "paused"
    # two current evaluations: the more modest (swarm/dht/published.py); no time of its own: unknown
    assert run_evaluation(views) == {"test_accuracy": 0.5, "test_loss": None, "test_at": None}
    timed = {"layer0": [_rec("a", test_accuracy=0.9, test_loss=0.3, eval_samples=900, eval_at=NOW_S - 50),
                        _rec("b", test_accuracy=0.6, test_loss=0.9, eval_samples=100, eval_at=NOW_S - 5)]}
    assert run_evaluation(timed)["test_at"] == NOW_S - 5, "the newest evaluation by its time, with its time"
    assert run_evaluation({"layer0": [_rec("a")]}) == {}


def test_a_swarm_read_a_while_ago_is_judged_as_of_its_read_and_says_how_old_it_is():
    """A peer that drives nothing reads the other swarms every 5 heartbeats (25 s): judged as of now, their live
    peers showed offline 10 s of every 25 ("online peers layer0:0!" beside micro-batches it trained on)."""
    from dataclasses import replace

    from volunteer.eventlog import format_summary
    from volunteer.snapshot import view_age_s

    read_at = NOW_S - 20
    views = {"layer0": [replace(_rec("a", stalled_s=0.0), updated_at=read_at - 2),
                        replace(_rec("gone"), updated_at=read_at - 30)],  # stale already when read: offline
             "layer1": [_rec("me")]}
    fields = view_fields(views, ["layer0", "layer1"], "layer1", "me", NOW_S, heartbeat_s=5.0,
                         read_at_s={"layer0": read_at, "layer1": NOW_S - 1})
    rows = {row.name: row for row in fields["swarms"]}
    assert (rows["layer0"].online, rows["layer0"].total, rows["layer1"].online) == (1, 2, 1)
    assert view_age_s(rows["layer0"], NOW_S) == 20 and view_age_s(rows["layer1"], NOW_S) is None
    assert fields["run_alarms"] == ()
    snapshot = NodeSnapshot(run_name="r", run_id="r-1", swarm="layer1", peer_id="me", state=NodeState.ONLINE,
                            swarms=fields["swarms"])
    line = format_summary(snapshot, now_s=NOW_S)
    assert line.endswith("online peers layer0:1 layer1:1 (some read 20 s ago)")
    # without the time of its read, a record is judged as of now, as before
    alone = view_fields(views, ["layer0", "layer1"], "layer1", "me", NOW_S, heartbeat_s=5.0)
    assert {row.name: row.online for row in alone["swarms"]} == {"layer0": 0, "layer1": 1}
    # the evaluation layer0 publishes is stale only if it was already old at that read (eval_every_s 10)
    assert not replace(snapshot, test_at=read_at - 5, eval_every_s=10.0).evaluation_stale(NOW_S)  # 25 s old now
    assert replace(snapshot, test_at=read_at - 25, eval_every_s=10.0).evaluation_stale(NOW_S)
    assert replace(snapshot, test_at=NOW_S - 25, swarms=(), eval_every_s=10.0).evaluation_stale(NOW_S)


@pytest.mark.parametrize("names", [["layer0"]])
def test_a_single_swarm_is_never_called_the_bottleneck(names):
    fields = view_fields({}, names, "layer0", "me", NOW_S)
    assert not fields["swarms"][0].bottleneck and fields["peers"] == ()


class HealthGuard:
    """A part as the lead's integrity guard will be: it ticks, publishes a state, and can stop the node."""

    def __init__(self, node, log: list[str]):
        self.node, self.log = node, log

    def tick(self, now_s: float) -> None:
        self.log.append("guard")
        self.node.set_state(PAUSED, "healing: loss exploded")
        self.node.request_stop()

    def close(self) -> None:
        self.log.append("guard closed")


def test_a_new_part_is_ticked_in_order_and_its_state_reaches_the_snapshot(tmp_path):
    from swarm.run.runconfig import RunConfig
    from volunteer.node import Node, NodeOptions

    node = Node(NodeOptions(run=RunConfig(name="parts", model={"stages": 2}), swarm="layer1", initial_peers=[],
                            data_dir=tmp_path, control_socket=False))
    log: list[str] = []
    for part in node.parts:
        part.tick = (lambda name, tick: lambda now_s: (log.append(name), tick(now_s)))(type(part).__name__, part.tick)
    node.parts.insert(node.parts.index(node.announcer), HealthGuard(node, log))
    node._serve()  # no DHT: announces are no-ops; the guard stops the loop after one round
    assert log == ["Commands", "Governors", "HeapTrimmer", "Health", "Checkpoints", "Contribution", "Completion", "Rebalancer", "Reachability", "guard",
                   "Announcer"]
    snap = node.snapshot()
    assert snap.state == PAUSED and snap.reason == "healing: loss exploded"
    node._leave()
    assert "guard closed" in log and node.snapshot().state == NodeState.OFFLINE
