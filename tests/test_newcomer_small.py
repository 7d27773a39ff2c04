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
