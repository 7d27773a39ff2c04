"""`volunteer join`: serve a layer swarm, with the dashboard or headless."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from volunteer_cli.main import UserError
from volunteer.config import load_preferences, load_run

# TCP only. With QUIC as well (the default until issue 25 item 9's network-lab proof), two volunteers on two hosts of
# the lab connected over QUIC and every layer download between them was cut short ("the stream ended early, 4 of 8
# tensors", every try, with or without a rate limit), so a newcomer started from the seeded weights and export
# failed; over TCP the same downloads succeed (QUIC on loopback worked: not a fault of our streams, not found
# further). A volunteer gains nothing from QUIC that it needs (no hole punching here); a cut download costs a run.
DEFAULT_VOLUNTEER_LISTEN = ["/ip4/0.0.0.0/tcp/0"]
QUIT_GRACE_S = 15.0
STARTUP_ABORT_S = 1.0  # a stop during startup ends the process within this (plus ~0.5 s to end the DHT)
EXIT_SIGNAL_BASE = 128  # a stop by SIGINT exits 130, by SIGTERM 143 (the shell's convention)
POLL_S = 0.2


def run_join(args: argparse.Namespace) -> int:
    from swarm.dht.lightdht import light_hivemind

    # A volunteer needs hivemind's DHT, P2P and tensor codecs, not its averaging, MoE and optimizer packages:
    # importing only the submodules it uses takes ~0.6 s of CPU off every start (swarm/dht/lightdht.py).
    light_hivemind()
    run, run_path = load_run(args.run)
    prefs = load_preferences(args.prefs)
    valid = run.swarm_names
    if args.swarm != "auto" and args.swarm not in valid:
        raise UserError(
            f"--swarm {args.swarm}: run {run.name} has no such layer swarm; "
            f"valid: {', '.join(valid)}, or auto"
        )
    from volunteer_cli.commands.common import check_initial_peers, check_own_maddrs

    check_initial_peers(args.initial_peers)
    check_own_maddrs(args.listen, args.announce)
    initial_peers = args.initial_peers or run.bootstrap_peers
    if not initial_peers:
        raise UserError(
            "no bootstrap peers: pass --initial-peers MADDR, or list bootstrap_peers in the run config. "
            "To host one: `volunteer bootstrap` prints the address to pass"
        )

    data_dir, identity = _check_local(args, prefs)

    from volunteer_cli.commands.common import setup_process

    watchdog, shutdown = setup_process(args.verbose)
    _lower_priority(prefs.resources.low_priority)  # before the node's threads and DHT process: they inherit it
    from volunteer.heap import limit_arenas

    limit_arenas()  # before the node's threads: each would take an arena of its own (volunteer/heap.py)
    from volunteer.node import Node, NodeOptions

    from volunteer.logfile import open_session_log

    session_log = open_session_log(data_dir)
    node = Node(
        NodeOptions(
            run=run,
            run_path=run_path,
            swarm=args.swarm,
            rebalance_s=args.rebalance_s,
            initial_peers=list(initial_peers),
            data_dir=data_dir,
            identity_path=identity,
            host_maddrs=args.listen or prefs.network.listen or DEFAULT_VOLUNTEER_LISTEN,
            announce_maddrs=args.announce or prefs.network.announce,
            use_relay=prefs.network.use_relay,
            use_auto_relay=prefs.network.use_auto_relay,
            client_mode=prefs.network.client_mode,
            device=args.device or prefs.device,
            cpu_threads=prefs.resources.max_cpu_threads,
            process_group=watchdog.pgid,
            idle=prefs.idle,
            resources=prefs.resources,
            new_run=args.new_run,
            log_path=session_log.path if session_log is not None else None,
        )
    )
    if session_log is not None:
        file_log = session_log.event_log()
        node.add_listener(file_log.on_snapshot, file_log.on_event)
    _dump_tasks_on_sigusr1(node)
    screen = _Screen()
    shutdown.on_request(node.request_stop)
    shutdown.on_request(lambda: screen.say_stopping(node))
    code = EXIT_SIGNAL_BASE + signal.SIGINT  # if the dashboard or the log fails on its way out
    dashboard = not args.headless and sys.stdin.isatty() and sys.stdout.isatty()
    try:
        if dashboard:
            code = _run_dashboard(node, shutdown, screen)
        else:
            code = _run_headless(node, args.log_format, shutdown)
    finally:
        node.request_stop()
        if not node.serving and not node.wait_stopped(_startup_wait_s(node)):
            _abandon_startup(node, watchdog, _interrupted_code(shutdown) if shutdown.signum else code)
        node.wait_stopped(QUIT_GRACE_S)
        watchdog.stop()
        _say_farewell(node, session_log, json_lines=not dashboard and args.log_format == "json")
    if node.error:
        print(f"volunteer join: {node.error}", file=sys.stderr)
        return node.error_exit_code
    if shutdown.signum is not None and not node.serving:
        return _interrupted_code(shutdown)
    return code


def _check_local(args: argparse.Namespace, prefs) -> tuple[Path, Path | None]:
    """The data dir and the identity's folder take files, and no other process listens on our ports: checked
    before anything loads (volunteer/preflight.py). Returns the data dir (created) and the identity file."""
    from volunteer.paths import user_data_dir
    from volunteer.preflight import check_listen_free, check_writable_parent, private_dir

    data_dir = private_dir(Path(args.data_dir or prefs.data_dir or user_data_dir()).expanduser(), "data dir",
                           "pass --data-dir with a folder you can write to (or set data_dir in your preferences)")
    identity = args.identity or prefs.identity_path
    identity_path = Path(identity).expanduser() if identity else None
    if identity_path is not None:
        check_writable_parent(identity_path, "identity", "pass --identity with a path in a folder you can write to")
    if args.listen:
        check_listen_free(args.listen, "--listen")
    elif prefs.network.listen:  # unset: DEFAULT_VOLUNTEER_LISTEN, port 0 (a free one): nothing to check
        check_listen_free(prefs.network.listen, "network.listen (preferences)")
    return data_dir, identity_path


def _say_farewell(node, session_log, json_lines: bool) -> None:
    """What this node gave the run, this session and in total, on stdout (after the dashboard let go of the
    screen; a JSON line for --log-format json) and in the log; nothing if it never served."""
    import json

    text = node.contribution.farewell()
    if text:
        print(json.dumps(node.contribution.farewell_json()) if json_lines else text, flush=True)
    if session_log is not None:
        if text:
            session_log.stream.write(text + "\n")
        session_log.close()


def _lower_priority(low_priority: bool) -> None:
    import logging

    from volunteer.priority import lower_priority

    done = lower_priority(low_priority)
    if done:
        logging.getLogger(__name__).info("running at low priority: %s (resources.low_priority: false to turn off)",
                                         ", ".join(done))


class _Screen:
    """Who owns the terminal: a signal's "stopping…" is printed unless the dashboard draws the screen."""

    def __init__(self) -> None:
        self.dashboard = False

    def say_stopping(self, node) -> None:
        if self.dashboard:
            return
        what = "leaving the swarm" if node.serving else "abandoning the start"
        print(f"stopping… ({what}; press Ctrl+C again to exit at once)", file=sys.stderr, flush=True)


def _startup_wait_s(node) -> float:
    """What is left of STARTUP_ABORT_S since the first stop request (the dashboard may have waited already)."""
    if not node.started or node.stop_requested_at_s is None:
        return 0.0
    return max(0.0, STARTUP_ABORT_S - (time.monotonic() - node.stop_requested_at_s))


def _interrupted_code(shutdown) -> int:
    return EXIT_SIGNAL_BASE + (shutdown.signum or signal.SIGINT)


def _abandon_startup(node, watchdog, code: int) -> None:
    """A stop during startup that the engine could not honour in STARTUP_ABORT_S (it is inside an import,
    the DHT start or a download): nothing was announced online, so nothing needs a clean leave. End the
    DHT process and p2pd now, and exit."""
    import logging
    import os

    from volunteer.hygiene import end_process, kill_group_now

    node.abandon()
    print("stopped before joining the swarm", file=sys.stderr, flush=True)
    # The engine thread is still loading: what it says as the DHT vanishes under it is noise now.
    logging.disable(logging.CRITICAL)
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())
    if watchdog.pgid is not None:
        kill_group_now(watchdog.pgid, spare=watchdog.pid)
    watchdog.stop()
    end_process(code, handlers=False)  # the loading thread's imports hold locks the handlers may want


def _run_headless(node, log_format: str, shutdown) -> int:
    from volunteer.eventlog import EventLog

    # The fatal error that ends the node is printed once, on stderr, as join exits; the human log
    # leaves it out (JSON lines keep it: a program reading them needs the event).
    log = EventLog(fmt=log_format, skip_kinds=frozenset({"error"}) if log_format == "human" else frozenset())
    node.add_listener(log.on_snapshot, log.on_event)
    if shutdown.event.is_set():  # Ctrl+C while the command set up: do not start loading at all
        return 0
    node.start()
    while not node.wait_stopped(POLL_S) and not shutdown.event.is_set():
        pass
    return 0


def _run_dashboard(node, shutdown, screen: _Screen) -> int:
    try:
        from tui.app import run_dashboard  # imported here: headless nodes never load textual
    except ImportError:  # textual missing from a broken install: the same engine, headless
        return _run_headless(node, "human", shutdown)
    if shutdown.event.is_set():  # Ctrl+C while textual loaded: do not take the screen at all
        return 0
    node.start()
    screen.dashboard = True
    try:
        return run_dashboard(node)
    finally:
        screen.dashboard = False


def _dump_tasks_on_sigusr1(node) -> None:
    """`kill -USR1 PID` prints every task of the node's RPC loop with its stack to stderr: what a node that
    trains nothing is waiting on (threads: py-spy)."""
    if not hasattr(signal, "SIGUSR1"):
        return

    def dump(signum, frame) -> None:
        import asyncio
        import sys

        peer = node.peer
        if peer is None:
            print("no peer yet: nothing to dump", file=sys.stderr, flush=True)
            return

        def in_loop() -> None:
            tasks = asyncio.all_tasks(peer._loop)
            print(f"--- {len(tasks)} tasks of the RPC loop", file=sys.stderr)
            for task in tasks:
                task.print_stack(limit=12, file=sys.stderr)
            sys.stderr.flush()

        peer._loop.call_soon_threadsafe(in_loop)

    signal.signal(signal.SIGUSR1, dump)
