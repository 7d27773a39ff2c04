"""The node's headless glue without a network: idle policy pauses, who may lift a pause, bandwidth cap.

The node runs here without a DHT (its announces are no-ops) and with a fake peer; the idle
observer is fake and runs inline, so every step is deterministic.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import pytest

from swarm.run.runconfig import RunConfig
from volunteer.headless import BandwidthBudget, IdleGovernor
from volunteer.node import Node, NodeOptions
from volunteer.policy import POLL_INTERVAL_S, Observation
from volunteer.prefs import IdlePrefs, ResourcePrefs
from volunteer.snapshot import Command, NodeState

RUN = RunConfig(name="headless", model={"stages": 2})
IDLE = IdlePrefs(enabled=True, idle_after_s=60, max_other_cpu_percent=100)
AWAY_S = 3600.0


class Inline:
    """An executor that runs the observation at once (the node uses a thread)."""

    def submit(self, fn, *args):
        future = Future()
        try:
            future.set_result(fn(*args))
        except Exception as exc:
            future.set_exception(exc)
        return future

    def shutdown(self, wait=True, cancel_futures=False):
        pass


class FakeObserver:
    def __init__(self, user_idle_s: float | None = AWAY_S):
        self.user_idle_s = user_idle_s
        self.calls = 0
        self.fail = False

    def observe(self) -> Observation:
        self.calls += 1
        if self.fail:
            raise RuntimeError("loginctl vanished")
        return Observation(user_idle_s=self.user_idle_s, local_time_of_day_s=12 * 3600)


class Clock:
    def __init__(self):
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


@dataclass
class Traffic:
    bytes_in: int = 0
    bytes_out: int = 0


class FakePeer:
    device = "cpu"
    worker = None

    def __init__(self):
        self.accepting = True
        self.calls: list[str] = []
        self.traffic = Traffic()
        self.final_evaluation = None

    def pause(self):
        self.accepting = False
        self.calls.append("pause")

    def resume(self):
        self.accepting = True
        self.calls.append("resume")

    def in_flight(self) -> int:
        return 0

    def start_final_evaluation(self, deadline_s: float):
        return self.final_evaluation  # None: nothing to evaluate (not layer0)

    def metrics(self):
        return self.traffic


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def observer():
    return FakeObserver()


@pytest.fixture
def node(tmp_path, observer, clock):
    node = Node(NodeOptions(run=RUN, swarm="layer1", initial_peers=[], data_dir=tmp_path, idle=IDLE,
                            control_socket=False))
    node.peer = FakePeer()
    node.governors.idle = IdleGovernor(IDLE, "cpu", observer=observer, monotonic=clock, executor=Inline())
    node.set_state(NodeState.ONLINE, "")
    return node


def tick(node, clock, seconds: float = POLL_INTERVAL_S) -> None:
    """One poll interval of the node's loop."""
    clock.now_s += seconds
    node.commands.apply_pending()
    node.governors.follow_idle_policy()
    node.governors.follow_bandwidth_cap()


def events(node) -> list[str]:
    return [event.text for event in node.snapshot().events]


def test_the_governor_observes_once_per_interval_and_decides_for_the_device(observer, clock):
    governor = IdleGovernor(IDLE, "cpu", observer=observer, monotonic=clock, executor=Inline())
    assert governor.poll().run
    assert governor.poll().run and observer.calls == 1  # not due yet
    observer.user_idle_s = 12
    clock.now_s += POLL_INTERVAL_S
    verdict = governor.poll()
    assert not verdict.run and verdict.reason == "user active 12 s ago" and observer.calls == 2
    # a GPU node may run while the user types when gpu_only_when_idle is off
    gpu = IdleGovernor(IDLE.model_copy(update={"gpu_only_when_idle": False}), "cuda", observer=observer,
                       monotonic=clock, executor=Inline())
    assert gpu.poll().run


def test_a_failing_observer_keeps_the_last_verdict(observer, clock):
    governor = IdleGovernor(IDLE, "cpu", observer=observer, monotonic=clock, executor=Inline())
    observer.user_idle_s = 5
    assert not governor.poll().run
    observer.fail = True
    clock.now_s += POLL_INTERVAL_S
    assert not governor.poll().run and governor.failures == 1


def test_the_policy_pauses_says_why_and_resumes_by_itself(node, observer, clock):
    observer.user_idle_s = 12
    tick(node, clock)
    snap = node.snapshot()
    assert snap.state == NodeState.PAUSED and snap.reason == "user active 12 s ago"
    assert node.peer.calls == ["pause"] and not node.peer.accepting
    assert "paused by the idle policy: user active 12 s ago; it resumes by itself" in events(node)

    observer.user_idle_s = 14  # the reason ages quietly: no new event, no flapping
    tick(node, clock)
    assert node.snapshot().reason == "user active 14 s ago" and len(events(node)) == 1

    observer.user_idle_s = AWAY_S
    tick(node, clock)
    assert node.snapshot().state == NodeState.ONLINE and node.snapshot().reason == ""
    assert node.peer.calls == ["pause", "resume"]


def test_a_pause_the_user_asked_for_is_never_lifted_by_the_policy(node, observer, clock):
    node.command(Command.PAUSE)
    tick(node, clock)
    assert node.snapshot().reason == "paused by you"
    observer.user_idle_s = 3
    tick(node, clock)
    observer.user_idle_s = AWAY_S
    for _ in range(3):
        tick(node, clock)
    assert node.snapshot().state == NodeState.PAUSED and node.snapshot().reason == "paused by you"
    assert node.peer.calls == ["pause"]
    node.command(Command.RESUME)
    tick(node, clock)
    assert node.snapshot().state == NodeState.ONLINE and node.peer.accepting


def test_the_users_pause_takes_over_a_policy_pause(node, observer, clock):
    observer.user_idle_s = 3
    tick(node, clock)
    ticket = node.command(Command.PAUSE)
    tick(node, clock)
    assert node.wait_applied(ticket, 0)
    assert node.snapshot().reason == "paused by you"
    observer.user_idle_s = AWAY_S
    tick(node, clock)
    assert node.snapshot().state == NodeState.PAUSED  # the user's now: only `ctl resume` lifts it


def test_resume_while_the_user_is_at_the_machine_stays_paused_and_says_why(node, observer, clock):
    node.command(Command.PAUSE)
    tick(node, clock)
    observer.user_idle_s = 7
    tick(node, clock)
    node.command(Command.RESUME)
    tick(node, clock, seconds=0)
    snap = node.snapshot()
    assert snap.state == NodeState.PAUSED and snap.reason == "user active 7 s ago"
    assert any("the idle policy keeps this node paused" in text for text in events(node))
    observer.user_idle_s = AWAY_S
    tick(node, clock)
    assert node.snapshot().state == NodeState.ONLINE  # the policy's pause now, so the policy lifts it


def test_finish_drains_then_pauses_and_the_policy_leaves_it_alone(node, observer, clock):
    node.command(Command.FINISH)
    tick(node, clock)
    assert node.snapshot().state == NodeState.FINISHING and not node.peer.accepting
    node.commands.check_finishing()  # the fake peer has nothing in flight
    assert node.snapshot().state == NodeState.PAUSED and node.snapshot().reason == "finished, paused by you"
    tick(node, clock)
    assert node.snapshot().state == NodeState.PAUSED


def test_layer0_finishing_evaluates_without_blocking_then_pauses_and_a_pause_meanwhile_wins(node, observer, clock):
    """The final evaluation runs on the peer's loop: the engine keeps ticking and says what it waits for."""
    published = []
    node.announcer.work_fields = lambda: published.append(1) or {}  # the fake peer has no figures
    node.peer.final_evaluation = Future()
    node.command(Command.FINISH)
    tick(node, clock)
    node.commands.check_finishing()
    snap = node.snapshot()
    assert snap.state == NodeState.FINISHING and snap.reason == "evaluating the pipeline once more, then pausing"
    node.commands.check_finishing()  # still running: nothing changes
    assert node.snapshot().state == NodeState.FINISHING
    node.peer.final_evaluation.set_result(True)
    node.commands.check_finishing()
    assert node.snapshot().state == NodeState.PAUSED and node.snapshot().reason == "finished, paused by you"
    assert published  # the figure of the final evaluation reaches the record at the pause

    observer.user_idle_s = AWAY_S
    node.command(Command.RESUME)
    tick(node, clock)
    assert node.snapshot().state == NodeState.ONLINE
    node.peer.final_evaluation = Future()
    node.command(Command.FINISH)
    tick(node, clock)
    node.commands.check_finishing()
    assert node.snapshot().state == NodeState.FINISHING
    node.command(Command.PAUSE)  # the user does not want to wait for it
    tick(node, clock)
    assert node.snapshot().state == NodeState.PAUSED and node.peer.final_evaluation.cancelled()


def test_the_bandwidth_budget_throttles_over_the_cap_and_releases_at_half_a_bucket(clock):
    budget = BandwidthBudget(8.0, monotonic=clock, burst_s=10.0)  # 1 MB/s, a 10 MB bucket
    assert not budget.update(0)
    clock.now_s += 1
    assert not budget.update(10_000_000)  # a burst the bucket holds
    clock.now_s += 1
    assert budget.update(12_000_000)  # over: refuse new work
    clock.now_s += 4
    assert budget.update(12_000_000)  # refilling, not yet half
    clock.now_s += 2
    assert not budget.update(12_000_000)
    assert not BandwidthBudget(0.0).update(10**12)  # 0 = no cap


def test_a_throttled_node_refuses_work_but_stays_online_and_says_why(tmp_path, clock):
    node = Node(NodeOptions(run=RUN, swarm="layer1", initial_peers=[], data_dir=tmp_path,
                            resources=ResourcePrefs(bandwidth_mbit_s=8.0), control_socket=False))
    node.peer = FakePeer()
    node.set_state(NodeState.ONLINE, "")
    node.governors.budget = BandwidthBudget(8.0, monotonic=clock, burst_s=1.0)
    node.governors.follow_bandwidth_cap()
    node.peer.traffic.bytes_out = 3_000_000
    tick(node, clock, seconds=1)
    assert not node.peer.accepting and node.snapshot().state == NodeState.ONLINE
    assert "bandwidth cap" in events(node)[-1]
    node.command(Command.PAUSE)  # a pause and a resume while throttled keep it refusing
    node.command(Command.RESUME)
    tick(node, clock, seconds=0)
    assert not node.peer.accepting
    tick(node, clock, seconds=5)
    assert node.peer.accepting and node.peer.calls[-1] == "resume"
