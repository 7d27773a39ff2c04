"""Ctrl+C during startup: "stopping…" at once, the process gone within ~2 s, exit 130 (issue 16).

Before, a Ctrl+C while the libraries loaded was noted and ignored: the node went on to start its
DHT and exited ~15 s later with status 0 (16-69 s in the dashboard under load). Later, one that landed inside
the watchdog's fork was swallowed and hung the engine (tests/test_setup_signals.py); a late exit here sends
SIGUSR2 first, so the failure shows every thread's stack.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from fake_engine import FakeEngine, run_scenario, sample_snapshot  # noqa: E402
from procs import write_run  # noqa: E402
from textual.pilot import Pilot  # noqa: E402

from tui.app import EXIT_CLEAN, EXIT_INTERRUPTED, VolunteerApp  # noqa: E402
from volunteer.snapshot import Command, NodeState  # noqa: E402

EXIT_BOUND_S = 8.0  # STARTUP_ABORT_S (1.0) + ending the DHT process and p2pd + the exit; generous for a loaded CI
# machine (2 s on a quiet one), still far below the failures it guards against (a 15-69 s startup, the 30 s leave)
# (name, the stdout line after which Ctrl+C is pressed). "loading": as the engine starts importing torch and
# hivemind; it was "1 s after start", which on a loaded machine (the suite's last minutes) landed ~4 s before the
# process printed anything, inside the interpreter's own start, before this client's handler exists (there the
# signal was once lost, cause not found; at 0.05 s Python itself dies, "init_import_site").
POINTS = (("loading", "loading the network and training libraries"), ("dht", "starting the DHT"),
          ("joined", "joined the DHT"))
LATE_LEAVE_S = 30.0  # a stop handled after the node came online: the clean leave (QUIT_GRACE_S 15 s) and its start


def test_ctrl_c_at_any_point_of_a_headless_start_exits_130_within_two_seconds(swarm, tmp_path):
    swarm.fork = False  # a start as a user's shell makes it, imports and all: forked, "dht" came ~1 s sooner, online
    run = write_run(tmp_path / "run.yaml")
    _, maddr = swarm.bootstrap()
    joins = {name: swarm.join(run, "layer1", maddr, name=f"join-{name}") for name, _ in POINTS}
    for name, line in POINTS:
        proc = joins[name]
        proc.wait_for_output(line, timeout_s=90)
        pressed = time.monotonic()
        proc.signal(signal.SIGINT)
        try:
            code = proc.wait(EXIT_BOUND_S)
        except subprocess.TimeoutExpired:  # late: every thread's stack, to see what held the main thread
            proc.signal(signal.SIGUSR2)
            code = proc.wait(LATE_LEAVE_S + 30)
        took_s = time.monotonic() - pressed
        err = proc.stderr()
        assert "stopping…" in err, err
        if name == "joined" and code == 0 and "leaving the swarm" in err:
            # From "joined the DHT" to online takes well under a second on an empty swarm: under load the
            # signal can land after it. Then a clean leave (exit 0) is right; it must be online already.
            assert "online in layer1" in proc.stdout(), proc.stdout()
            continue
        assert took_s <= EXIT_BOUND_S and code == 130, f"{name}: exit {code} after {took_s:.1f} s\n{err}"
        assert "Traceback" not in err, err
        out = proc.stdout()
        if name == "joined" and "online in layer1" in out:
            # the same race, handled as an interrupt: under load (a fresh clone's suite, its last minutes) the node
            # came online while the signal was on its way, then withdrew its record before the prompt exit
            assert out.index("announced offline in layer1") > out.index("online in layer1"), out
            continue
        assert "online in layer1" not in out  # it never went on to serve


def test_ctrl_c_in_the_dashboard_while_joining_closes_it_at_once_with_130():
    engine = FakeEngine(sample_snapshot(state=NodeState.JOINING, reason="connecting"), stops_on_quit=False)

    took_s: list[float] = []

    async def scenario(app: VolunteerApp, pilot: Pilot) -> None:
        pressed = time.monotonic()
        await pilot.press("ctrl+c")
        while app.return_code is None and time.monotonic() - pressed < 10:
            await pilot.pause(0.02)
        took_s.append(time.monotonic() - pressed)

    app = run_scenario(engine, scenario)
    assert app.return_code == EXIT_INTERRUPTED and engine.commands == [Command.QUIT]
    assert took_s[0] < EXIT_BOUND_S  # the bridge waits STARTUP_ABORT_S, not the 30 s leave timeout


def test_q_in_the_dashboard_while_syncing_closes_it_at_once():
    engine = FakeEngine(sample_snapshot(state=NodeState.SYNCING, reason="downloading"), stops_on_quit=False)

    async def scenario(app: VolunteerApp, pilot: Pilot) -> None:
        await pilot.press("q")
        for _ in range(500):
            if app.return_code is not None:
                return
            await pilot.pause(0.02)

    app = run_scenario(engine, scenario)
    assert app.return_code == EXIT_CLEAN


def test_a_signal_that_comes_while_the_first_is_handled_neither_deadlocks_nor_runs_the_stop_twice():
    """The handler runs in the main thread between any two bytecodes: inside a critical section of the very Event it
    would set, or inside itself for a second signal. Until session 33 it set the Event there, and a second SIGTERM
    that came while the first one's ``Event.set`` held that Event's lock waited on it forever (py-spy's stacks of two
    volunteers that never left, tests/procs.py). Now it takes no lock: the Event and the callbacks are a relay
    thread's, once."""
    from volunteer.hygiene import ShutdownRequested

    shutdown = ShutdownRequested()
    shutdown.start_relay()
    calls: list[str] = []
    shutdown.on_request(lambda: calls.append("stop"))
    with shutdown.event._cond:  # as if the signal came while the main thread was inside Event.set or Event.wait
        shutdown._handle(signal.SIGTERM, None)
        shutdown._handle(signal.SIGTERM, None)
    assert shutdown.event.wait(5) and shutdown.signum == signal.SIGTERM
    deadline = time.monotonic() + 5  # the relay runs the callbacks right after it sets the Event
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # time for a second run, if there were one
    assert calls == ["stop"], "once, whatever the number of signals"
    late: list[int] = []
    shutdown.on_request(lambda: late.append(1))  # registered after the signal: called at once
    assert late == [1]
