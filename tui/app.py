"""The dashboard app and its entry point, ``run_dashboard(engine)``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import ClassVar

from textual.app import App
from textual.binding import Binding, BindingType

from tui.bridge import EngineBridge
from tui.dashboard import DashboardScreen
from tui.format import not_training_line
from tui.help import HelpScreen
from tui.messages import EngineStopped, EventRaised, SnapshotUpdated
from volunteer.snapshot import Command, Engine, NodeSnapshot, NodeState

LEAVE_TIMEOUT_S = 30.0  # after q, wait this long for the engine to announce offline and stop
STALE_AFTER_S = 15.0  # warn when no snapshot arrived for this long (the engine ticks every second or so)
TICK_S = 1.0  # how often uptime and staleness are redrawn between snapshots
EXIT_CLEAN = 0
EXIT_NOT_STOPPED = 1  # the engine did not confirm it stopped in time, or the volunteer would not wait
EXIT_INTERRUPTED = 130  # ctrl+c before the node was online: the start was abandoned (as a shell's SIGINT)

# Which keys make sense in which state; the others are greyed out in the footer.
_ACTION_STATES: dict[str, frozenset[NodeState]] = {
    "pause": frozenset(NodeState) - {NodeState.PAUSED},
    "finish": frozenset({NodeState.ONLINE}),
    "resume": frozenset({NodeState.PAUSED, NodeState.FINISHING}),
}
_COMMAND_NOTES: dict[Command, str] = {
    Command.PAUSE: "pause requested: stopping work now",
    Command.FINISH: "finish requested: completing the work already taken, then pausing",
    Command.RESUME: "resume requested",
    Command.QUIT: "quit requested: leaving the swarm",
}


class VolunteerApp(App[int]):
    """Shows the engine's snapshots and events; sends the volunteer's commands back."""

    TITLE = "volunteer"
    ENABLE_COMMAND_PALETTE = False
    AUTO_FOCUS = None
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("p", "pause", "Pause"),
        Binding("f", "finish", "Finish+pause"),
        Binding("r", "resume", "Resume"),
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("ctrl+c", "interrupt", "Quit", show=False, priority=True),
    ]

    def __init__(self, engine: Engine, *, now: Callable[[], float] = time.time,
                 leave_timeout_s: float = LEAVE_TIMEOUT_S, stale_after_s: float = STALE_AFTER_S) -> None:
        super().__init__()
        self._engine = engine
        self._now = now
        self._leave_timeout_s = leave_timeout_s
        self._stale_after_s = stale_after_s
        self._bridge: EngineBridge | None = None
        self._snapshot: NodeSnapshot | None = None
        self._snapshot_received_at = 0.0
        self.leaving = False
        self.interrupted = False  # ctrl+c, not q
        self.dashboard = DashboardScreen()

    @property
    def quit_sent(self) -> bool:
        return self._bridge is not None and self._bridge.quit_sent

    async def on_mount(self) -> None:
        await self.push_screen(self.dashboard)  # composed once this returns, so snapshots can be shown
        self._bridge = EngineBridge(self._engine, self.post_message, leave_timeout_s=self._leave_timeout_s)
        self._show(self._bridge.connect())
        self.set_interval(TICK_S, self._refresh_status)

    def on_unmount(self) -> None:
        if self._bridge is not None:
            self._bridge.close()

    # -- engine news -------------------------------------------------------------------------

    def on_snapshot_updated(self, message: SnapshotUpdated) -> None:
        self._show(message.snapshot)

    def on_event_raised(self, message: EventRaised) -> None:
        self.dashboard.add_event(message.event)

    def on_engine_stopped(self, message: EngineStopped) -> None:
        if message.during_startup:  # abandoned on purpose; the caller ends what is still loading
            self._finish_with(EXIT_INTERRUPTED if self.interrupted else EXIT_CLEAN)
            return
        self._finish_with(EXIT_CLEAN if message.clean else EXIT_NOT_STOPPED)

    def _show(self, snapshot: NodeSnapshot) -> None:
        state_changed = self._snapshot is None or self._snapshot.state is not snapshot.state
        self._snapshot = snapshot
        self._snapshot_received_at = self._now()
        self.dashboard.show(snapshot, self._now())
        self._refresh_status()
        if state_changed:
            self.refresh_bindings()

    def _refresh_status(self) -> None:
        snapshot = self._snapshot
        if snapshot is None:
            return
        now = self._now()
        silent_s = now - self._snapshot_received_at
        banner = not_training_line(snapshot, leaving=self.leaving, silent_s=silent_s, stale_after_s=self._stale_after_s)
        self.dashboard.show_status(snapshot, uptime_s=now - snapshot.started_at, leaving=self.leaving, banner=banner)

    # -- the volunteer's keys ----------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        allowed_states = _ACTION_STATES.get(action)
        if allowed_states is None:
            return True
        if self.leaving or self._snapshot is None or self._snapshot.state not in allowed_states:
            return None  # shown greyed out: the key exists, it just does nothing right now
        return True

    def action_pause(self) -> None:
        self._send(Command.PAUSE)

    def action_finish(self) -> None:
        self._send(Command.FINISH)

    def action_resume(self) -> None:
        self._send(Command.RESUME)

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            self.screen.dismiss(None)
        else:
            self.push_screen(HelpScreen())

    async def action_interrupt(self) -> None:
        """ctrl+c: as q, but a start it abandons exits 130, like a shell's Ctrl+C."""
        self.interrupted = True
        await self.action_quit()

    async def action_quit(self) -> None:
        """q and ctrl+c: a clean leave; pressed again while leaving, exit without waiting."""
        if self.leaving:
            self._finish_with(EXIT_NOT_STOPPED)
            return
        self.leaving = True
        while isinstance(self.screen, HelpScreen):
            self.pop_screen()
        self._send(Command.QUIT)
        self._refresh_status()
        self.refresh_bindings()

    def _finish_with(self, code: int) -> None:
        self.exit(result=code, return_code=code)

    def _send(self, command: Command) -> None:
        assert self._bridge is not None, "keys are only handled once the app is mounted"
        self._bridge.send(command)
        self.dashboard.note(_COMMAND_NOTES[command], self._now())


def run_dashboard(engine: Engine, *, leave_timeout_s: float = LEAVE_TIMEOUT_S) -> int:
    """Run the dashboard in this terminal until the volunteer quits; return the process exit code.

    The caller has already called ``engine.start()``: the app only subscribes with
    ``engine.add_listener`` when it mounts and reads ``engine.snapshot()`` once, so the same
    started engine serves headless mode and the control socket too. q or ctrl+c sends
    ``Command.QUIT`` and waits up to ``leave_timeout_s`` for ``engine.wait_stopped``.

    The dashboard also closes by itself when the engine stops on its own (a signal handled by
    the caller, a fatal error): the caller reports why.

    Returns 0 after a clean leave or once the engine stopped, 1 when the engine did not confirm
    it stopped in time, the volunteer pressed q twice, or the app failed. If the app ends
    without having sent QUIT (it crashed), QUIT is sent here so the engine never keeps training
    behind a closed dashboard; the caller may still ``engine.wait_stopped`` before it exits.
    """
    app = VolunteerApp(engine, leave_timeout_s=leave_timeout_s)
    try:
        app.run()
    finally:
        if not app.quit_sent and not engine.wait_stopped(timeout=0):
            engine.command(Command.QUIT)
    return app.return_code if app.return_code is not None else EXIT_NOT_STOPPED
