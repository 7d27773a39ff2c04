"""What benchmarks.join runs in its child processes, and how it reads their timestamps.

- ``probe``: the real CLI (`volunteer join` or `volunteer status`) with timestamps around each step
  of ``PROBES[kind]`` (the first call of each), written as JSON when the command exits; ``phases``
  turns them into seconds per step.
- ``bare_child``: the bare-hivemind baseline, a plain DHT that starts, stores one value, says when,
  and stays until its stdin closes.

Both run as ``python -m benchmarks.join {PROBE_FLAG|BARE_FLAG} ...``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.fleet import LOOPBACK

PROBE_FLAG = "--probe"
BARE_FLAG = "--bare-child"
BARE_WAIT_S = 120.0

# (module or class, attribute, step name): the steps timed by the instrumented runs (first call of each)
JOIN_STEPS = [
    ("volunteer_cli.commands.common", "setup_process", "watchdog_and_signals"),
    ("swarm.dht.dht", "claim_identity", "import_hivemind_torch_and_identity"),
    ("swarm.dht.dht", "make_validators", "validators"),
    ("swarm.dht.dht", "start_dht", "dht_start"),
    ("swarm.dht.dht", "visible_maddrs", "visible_maddrs"),
    ("swarm.dht.membership.Membership", "read_all", "read_swarms"),
    ("swarm.dht.membership", "other_runs", "run_directory_check"),
    ("swarm.dht.membership", "publish_run", "run_directory_publish"),
    ("volunteer.node.Node", "_start_training", "start_training"),
    ("swarm.dht.membership.Membership", "announce", "announce"),
]
STATUS_STEPS = [
    ("volunteer_cli.commands.status", "load_run", "load_run"),
    ("volunteer_cli.commands.common", "setup_process", "watchdog_and_signals"),
    ("swarm.dht.dht", "make_validators", "import_hivemind_dht_and_validators"),  # no torch (swarm/dht/lightdht.py)
    ("swarm.dht.lightdht", "start_reader", "dht_start"),
    ("swarm.dht.membership.Membership", "read_all", "read_all"),
    ("swarm.dht.lightdht.LightDHT", "shutdown", "dht_shutdown"),
    ("volunteer_cli.commands.status", "run_status", "run_status_all_of_the_above"),  # may end in os._exit
]
PROBES = {"join": JOIN_STEPS, "status": STATUS_STEPS}


def phases(marks: dict[str, Any], steps: list[tuple[str, str, str]], spawned: float,
           end: tuple[str, float]) -> dict[str, float]:
    """Seconds per instrumented step (its first call; a step may contain another, e.g. an announce
    while the stage starts), ``between_steps`` (time in no step) and the time after the last one."""
    entered = marks["entered"]
    spans = {mark: marks[mark] for _, _, mark in steps if mark in marks}
    out = {"python_and_cli_import": entered - spawned}
    out.update({mark: stop - start for mark, (start, stop) in spans.items()})
    covered, reach = 0.0, entered
    for start, stop in sorted(spans.values()):  # length of the union of the steps' intervals
        covered += max(0.0, stop - max(start, reach))
        reach = max(reach, stop)
    out["between_steps"] = reach - entered - covered
    out[end[0]] = end[1] - reach
    out["total"] = end[1] - spawned
    return out


def probe(kind: str, out: Path, cli_args: list[str]) -> int:
    """Run the real CLI with timestamps at the end of each step of ``PROBES[kind]`` (written to ``out`` at exit)."""
    import atexit
    import importlib

    from volunteer_cli.main import main as cli_main

    def resolve(dotted: str) -> Any:
        try:
            return importlib.import_module(dotted)
        except ModuleNotFoundError:  # "package.module.Class"
            module_name, class_name = dotted.rsplit(".", 1)
            return getattr(importlib.import_module(module_name), class_name)

    targets = [(resolve(dotted), attribute, mark) for dotted, attribute, mark in PROBES[kind]]
    marks: dict[str, Any] = {"entered": time.time()}
    me = os.getpid()
    real_exit = os._exit

    def save() -> None:
        if os.getpid() == me:  # not from a forked child (the watchdog, the DHT process)
            out.write_text(json.dumps(marks))

    def exit_saving(code: int) -> None:  # commands may skip interpreter teardown with os._exit
        save()
        real_exit(code)

    atexit.register(save)
    os._exit = exit_saving  # type: ignore[assignment]

    def timed(function: Any, mark: str) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.time()
            try:
                return function(*args, **kwargs)
            finally:
                marks.setdefault(mark, (started, time.time()))  # the first call only (announce, read_all repeat)
        return wrapper

    for owner, attribute, mark in targets:
        setattr(owner, attribute, timed(getattr(owner, attribute), mark))
    return int(cli_main(cli_args) or 0)


def bare_child(maddr: str, key: str) -> int:
    """A plain hivemind DHT: start, store one value, say when, stay until stdin closes."""
    started = time.time()
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # leave through `finally`: stop the DHT and p2pd
    import hivemind
    from hivemind.utils import get_dht_time

    imported = time.time()
    dht = hivemind.DHT(initial_peers=[maddr], host_maddrs=[LOOPBACK], start=True)
    try:
        dht_started = time.time()
        dht.store(key, "here", expiration_time=get_dht_time() + 300)
        stored = time.time()
        print(json.dumps({"started": started, "imported": imported, "dht_started": dht_started, "stored": stored}),
              flush=True)
        _wait_for_stdin_eof(BARE_WAIT_S)
    finally:
        dht.shutdown()
    return 0


def _wait_for_stdin_eof(timeout_s: float) -> None:
    import select

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([sys.stdin], [], [], max(0.0, deadline - time.monotonic()))
        if ready and not sys.stdin.buffer.read1(4096):
            return
