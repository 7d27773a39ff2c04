"""The one place that talks to the engine, so the UI thread never waits on it.

Engine → UI: the listeners run on the engine's thread and only post typed messages to the app.
UI → engine: commands go through a queue to one daemon thread, which keeps them in the order they
were pressed; after QUIT the same thread waits (bounded) for the engine to stop and reports back.
While idle it also notices an engine that stopped on its own (SIGTERM, a fatal error), so the
dashboard closes instead of showing a frozen node.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from textual.message import Message

from tui.messages import EngineStopped, EventRaised, SnapshotUpdated
from volunteer.snapshot import Command, Engine, Event, EventLevel, NodeSnapshot, NodeState

POLL_S = 0.2  # how often the command thread checks whether the dashboard or the engine has stopped
STARTUP_ABORT_S = 1.0  # a quit while joining or syncing waits this long, then the dashboard closes anyway
STARTING_STATES = frozenset({NodeState.JOINING, NodeState.SYNCING})


class EngineBridge:
    def __init__(self, engine: Engine, post: Callable[[Message], bool], *, leave_timeout_s: float) -> None:
        self._engine = engine
        self._post = post
        self._leave_timeout_s = leave_timeout_s
        self._commands: queue.Queue[Command] = queue.Queue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._send_commands, name="tui-commands", daemon=True)
        self.quit_sent = False

    def connect(self) -> NodeSnapshot:
        """Subscribe to the engine and return its latest snapshot (the engine caches it; no network)."""
        self._engine.add_listener(self._on_snapshot, self._on_event)
        self._thread.start()
        return self._engine.snapshot()

    def send(self, command: Command) -> None:
        if command is Command.QUIT:
            self.quit_sent = True
        self._commands.put(command)

    def close(self) -> None:
        """Stop delivering news; the command thread exits within POLL_S (it is a daemon either way)."""
        self._closed.set()

    def _on_snapshot(self, snapshot: NodeSnapshot) -> None:
        self._deliver(SnapshotUpdated(snapshot))

    def _on_event(self, event: Event) -> None:
        self._deliver(EventRaised(event))

    def _deliver(self, message: Message) -> None:
        if self._closed.is_set():
            return
        try:
            self._post(message)
        except RuntimeError:
            # The app's event loop closed between our check and the post: there is no screen
            # left to show this on, and the engine's thread must not die for it.
            self._closed.set()

    def _send_commands(self) -> None:
        while not self._closed.is_set():
            try:
                command = self._commands.get(timeout=POLL_S)
            except queue.Empty:
                if self._engine.wait_stopped(timeout=0):  # stopped on its own: a signal, a fatal error
                    self._deliver(EngineStopped(clean=True))
                    return
                continue
            self._send(command)
            if command is Command.QUIT:
                return

    def _send(self, command: Command) -> None:
        try:
            starting = command is Command.QUIT and self._engine.snapshot().state in STARTING_STATES
            self._engine.command(command)
            if command is Command.QUIT:
                timeout_s = min(STARTUP_ABORT_S, self._leave_timeout_s) if starting else self._leave_timeout_s
                stopped = self._engine.wait_stopped(timeout=timeout_s)
                self._deliver(EngineStopped(clean=stopped, during_startup=starting))
        except Exception as exc:  # the engine's failure must reach the volunteer, not kill this thread
            text = f"could not {command.value}: {exc}. If this keeps happening, quit and run `volunteer join` again."
            self._deliver(EventRaised(Event(text=text, level=EventLevel.ERROR, kind="error")))
            if command is Command.QUIT:
                self._deliver(EngineStopped(clean=False))
