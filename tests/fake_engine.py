"""A scripted stand-in for the node engine, for the TUI's tests (and anyone else's).

``FakeEngine`` implements the ``Engine`` protocol from volunteer.snapshot: it hands out the
snapshot it was given, records every command, delivers snapshots and events to its listeners
from a separate thread (like the real engine), and stops when told to quit. ``sample_snapshot``
builds a fully populated, deterministic snapshot: every time in it derives from ``T0``.
``run_scenario`` and ``screen_text`` drive the dashboard headless on it (textual and rich are
imported only there, so engine-only tests can use the fake without them).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING

from volunteer.snapshot import (
    Command,
    Event,
    EventLevel,
    EventListener,
    NodeSnapshot,
    NodeState,
    PeerRow,
    SnapshotListener,
    SwarmRow,
)

if TYPE_CHECKING:
    from textual.app import App
    from textual.pilot import Pilot

    from tui.app import VolunteerApp

T0 = 1_700_000_000.0  # the node started here (2023-11-14 22:13:20 UTC)
UPTIME_S = 3723.0  # 1h 02m 03s
NOW = T0 + UPTIME_S  # what the app's clock says during tests
MY_PEER_ID = "12D3KooWMyOwnPeerIdXk9Q2mZt"
DELIVERY_TIMEOUT_S = 5.0  # emit() waits at most this long for the listener thread


def fixed_now() -> float:
    return NOW


def sample_events() -> tuple[Event, ...]:
    return (
        Event(f"joined layer3 as {MY_PEER_ID[-8:]}", kind="joined", time=T0 + 2),
        Event("synced layer3 from 7Hk2aBcD (clock 1.20M)", kind="synced", time=T0 + 9),
        Event("averaged with 7Hk2aBcD and Qr5tUvWx (factor 0.50)", kind="averaged", time=T0 + 600),
        Event("adopted the model from 7Hk2aBcD: test loss 0.31 < 0.35", kind="adopted", time=T0 + 1200),
        Event("banned Zz9yXwVu for 15m: it sent NaN gradients twice", level=EventLevel.WARNING, kind="banned",
              time=T0 + 2400),
        Event("could not reach layer4: no peer answered for 60s. Training waits; nothing to do unless it lasts"
              " (then check your firewall or restart)", level=EventLevel.ERROR, kind="error", time=T0 + 3600),
    )


def sample_swarms() -> tuple[SwarmRow, ...]:
    return (
        SwarmRow("layer0", online=5, total=5, throughput=980.0, best_loss=0.2981),
        SwarmRow("layer1", online=4, total=4, throughput=812.5, best_loss=0.3012),
        SwarmRow("layer2", online=3, total=4, throughput=640.2, best_loss=0.3107),
        SwarmRow("layer3", online=3, total=3, throughput=590.0, best_loss=0.3150),
        SwarmRow("layer4", online=1, total=2, throughput=212.0, best_loss=0.3333, bottleneck=True),
    )


def sample_peers() -> tuple[PeerRow, ...]:
    return (
        PeerRow("12D3KooWPeerAAAA7Hk2aBcD", "online", age_s=1.0, throughput=240.0, loss=0.3150, clock=1_234_567),
        PeerRow(MY_PEER_ID, "online", age_s=0.0, throughput=200.5, loss=0.3201, clock=1_230_000, is_me=True),
        PeerRow("12D3KooWPeerBBBBQr5tUvWx", "online", age_s=4.0, throughput=149.5, loss=0.3188, clock=1_229_000),
        PeerRow("12D3KooWPeerCCCCLm3nOpQr", "syncing", age_s=75.0, throughput=0.0, loss=None, clock=0),
    )


def sample_snapshot(**changes: object) -> NodeSnapshot:
    """A busy, healthy node of layer3 of a 5-layer run; ``changes`` override any field."""
    snapshot = NodeSnapshot(
        run_name="mnist-mlp",
        run_id="mnist-mlp-3f2a91c0",
        swarm="layer3",
        peer_id=MY_PEER_ID,
        state=NodeState.ONLINE,
        started_at=T0,
        device="NVIDIA H200 (cuda:0, 141 GiB)",
        samples_per_s=200.5,
        loss=0.3201,
        clock=1_230_000,
        microbatches_served=12_345,
        session_samples=395_040,
        session_online_s=3_600.0,
        total_microbatches=98_765,
        total_samples=3_160_480,
        total_online_s=112_200.0,  # 31h 10m
        total_sessions=7,
        log_path=os.path.expanduser("~/.local/share/volunteer/logs/join-20231114-221320-4242.log"),  # shown with ~
        samples_per_s_history=tuple(150.0 + 10 * (i % 6) + i for i in range(40)),
        loss_history=tuple(0.9 * 0.97**i + 0.3 for i in range(40)),
        test_accuracy=0.9123,
        test_at=NOW - 12.0,
        test_loss=0.2810,
        cpu_percent=34.0,
        memory_bytes=2_100_000_000,
        gpu_memory_bytes=12_300_000_000,
        bytes_in=1_234_000_000,
        bytes_out=800_000_000,
        swarms=sample_swarms(),
        peers=sample_peers(),
        events=sample_events(),
    )
    return dataclasses.replace(snapshot, **changes)


class FakeEngine:
    """Implements the Engine protocol with scripted data and a record of the commands received."""

    def __init__(self, snapshot: NodeSnapshot | None = None, *, stops_on_quit: bool = True,
                 fail_on: Command | None = None) -> None:
        self._snapshot = snapshot if snapshot is not None else sample_snapshot()
        self._stops_on_quit = stops_on_quit
        self._fail_on = fail_on
        self._listeners: list[tuple[SnapshotListener, EventListener]] = []
        self._lock = threading.Condition()
        self._stopped = threading.Event()
        self.commands: list[Command] = []
        self.started = False

    # -- the Engine protocol -----------------------------------------------------------------

    def start(self) -> None:
        self.started = True

    def snapshot(self) -> NodeSnapshot:
        return self._snapshot

    def command(self, command: Command) -> None:
        with self._lock:
            self.commands.append(command)
            self._lock.notify_all()
        if command is self._fail_on:
            raise RuntimeError(f"scripted failure on {command.value}")
        if command is Command.QUIT and self._stops_on_quit:
            self._stopped.set()

    def add_listener(self, on_snapshot: SnapshotListener, on_event: EventListener) -> None:
        self._listeners.append((on_snapshot, on_event))

    def wait_stopped(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    # -- driving it from a test --------------------------------------------------------------

    @property
    def listener_count(self) -> int:
        return len(self._listeners)

    def stop(self) -> None:
        """The engine stopped on its own (or, with stops_on_quit=False, finally after QUIT)."""
        self._stopped.set()

    def emit(self, snapshot: NodeSnapshot | None = None, events: tuple[Event, ...] = ()) -> None:
        """Deliver a new snapshot and/or events to the listeners from another thread, as the engine does."""
        if snapshot is not None:
            self._snapshot = snapshot
        self._on_engine_thread(lambda: self._deliver(snapshot, events))

    def wait_for_commands(self, count: int, timeout_s: float = DELIVERY_TIMEOUT_S) -> list[Command]:
        """The commands received once there are ``count`` of them (or the timeout passed)."""
        with self._lock:
            self._lock.wait_for(lambda: len(self.commands) >= count, timeout=timeout_s)
            return list(self.commands)

    def _deliver(self, snapshot: NodeSnapshot | None, events: tuple[Event, ...]) -> None:
        for on_snapshot, on_event in self._listeners:
            for event in events:
                on_event(event)
            if snapshot is not None:
                on_snapshot(snapshot)

    @staticmethod
    def _on_engine_thread(work: Callable[[], None]) -> None:
        thread = threading.Thread(target=work, name="fake-engine")
        thread.start()
        thread.join(DELIVERY_TIMEOUT_S)


@contextlib.contextmanager
def utc_timezone() -> Iterator[None]:
    """Event times print as HH:MM:SS in the local zone: pin it so screen snapshots are stable."""
    saved = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = saved
        time.tzset()


Scenario = Callable[["VolunteerApp", "Pilot"], Awaitable[None]]


def run_scenario(engine: FakeEngine, scenario: Scenario, *, size: tuple[int, int] = (80, 24),
                 now: Callable[[], float] = fixed_now, **app_options: object) -> VolunteerApp:
    """Run the dashboard headless on ``engine``, play ``scenario`` with a Pilot, return the app."""
    from tui.app import VolunteerApp

    async def play() -> VolunteerApp:
        app = VolunteerApp(engine, now=now, **app_options)
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            await scenario(app, pilot)
        return app

    with utc_timezone():
        return asyncio.run(play())


def screen_text(app: App) -> str:
    """The screen as plain text, as a volunteer without colour would read it (modals included)."""
    from rich.console import Console

    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=True,
                      color_system=None, record=True, legacy_windows=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return "\n".join(line.rstrip() for line in console.export_text(styles=False).splitlines())
