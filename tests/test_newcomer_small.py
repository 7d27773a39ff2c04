"""Issue 16's small things, as pure unit tests: no network, no processes."""

from __future__ import annotations

import io
import threading

from volunteer.eventlog import EventLog
from volunteer.snapshot import Event, EventLevel


class _FailingNode:
    """Stands in for Node: on start its join fails, it emits the error event and stops."""

    def __init__(self, text: str):
        self.text = text
        self.error: str | None = None
        self._listeners = []
        self._stopped = threading.Event()

    def add_listener(self, on_snapshot, on_event) -> None:
        self._listeners.append(on_event)

    def start(self) -> None:
        self.error = self.text
        for on_event in self._listeners:
            on_event(Event(text=self.text, level=EventLevel.ERROR, kind="error"))
        self._stopped.set()

    def wait_stopped(self, timeout=None) -> bool:
        return self._stopped.wait(timeout)


class _Shutdown:
    event = threading.Event()


def test_a_headless_join_error_is_left_to_the_exit_message_not_logged_as_well(capsys):
    from volunteer_cli.commands.join import _run_headless

    node = _FailingNode("the run's config differs from the swarm's")
    assert _run_headless(node, "human", _Shutdown()) == 0
    assert "differs" not in capsys.readouterr().out  # join prints node.error on stderr, once
    assert node.error


def test_json_lines_keep_the_error_event_for_programs():
    stream = io.StringIO()
    EventLog(stream, fmt="json").on_event(Event(text="boom", level=EventLevel.ERROR, kind="error"))
    assert '"kind": "error"' in stream.getvalue()


def test_the_human_log_still_prints_warnings():
    stream = io.StringIO()
    log = EventLog(stream, skip_kinds=frozenset({"error"}))
    log.on_event(Event(text="peer banned", level=EventLevel.WARNING, kind="banned"))
    assert "warning: peer banned" in stream.getvalue()


# ----- 0 samples/s while paused; a steady bottleneck marker

from volunteer.node.records import bottleneck_swarm, shown_samples_per_s  # noqa: E402
from volunteer.snapshot import NodeState, SwarmRow  # noqa: E402


def test_a_paused_node_shows_0_samples_per_s_at_once_not_the_windows_decay():
    assert shown_samples_per_s(12.5, NodeState.PAUSED) == 0.0
    assert shown_samples_per_s(12.5, NodeState.HEALING) == 0.0
    assert shown_samples_per_s(12.5, NodeState.ONLINE) == 12.5
    assert shown_samples_per_s(12.5, NodeState.FINISHING) == 12.5  # still draining real work


def _rows(**throughputs: float) -> list[SwarmRow]:
    return [SwarmRow(name=n, online=1 if t >= 0 else 0, total=1, throughput=max(t, 0.0), best_loss=None)
            for n, t in throughputs.items()]


def test_the_bottleneck_marker_stays_put_between_swarms_within_1_percent():
    rows = _rows(layer0=100.0, layer1=100.5, layer2=150.0)
    assert bottleneck_swarm(rows) == "layer0"
    assert bottleneck_swarm(rows, previous="layer1") == "layer1"  # 0.5 % apart: no flip
    assert bottleneck_swarm(_rows(layer0=100.0, layer1=102.0), previous="layer1") == "layer0"  # 2 %: moves


def test_a_swarm_with_nobody_online_takes_the_marker_however_close_the_rates():
    assert bottleneck_swarm(_rows(layer0=100.0, layer1=-1.0), previous="layer0") == "layer1"
    assert bottleneck_swarm(_rows(layer0=100.0)) is None  # one swarm: no bottleneck to mark


# ----- the demo leaves no /tmp/volunteer-demo-* behind unless it failed

def test_the_demo_removes_its_folder_after_a_success_or_ctrl_c_and_keeps_it_after_a_failure(tmp_path):
    from volunteer_cli.commands.demo import _clean_up

    said: list[str] = []
    for code, kept in ((0, False), (130, False), (1, True)):
        workdir = tmp_path / f"volunteer-demo-{code}"
        (workdir / "data").mkdir(parents=True)
        (workdir / "layer0-0.log").write_text("log")
        _clean_up(workdir, code, said.append)
        assert workdir.exists() == kept
    assert said == [f"the volunteers' logs are kept in {tmp_path / 'volunteer-demo-1'} (remove it when done)"]
