"""Set-up shared by the long-running commands: logging, quiet libraries, the watchdog, signals."""

from __future__ import annotations

import logging
import sys

from volunteer.hygiene import ShutdownRequested, Watchdog, quiet_libraries

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_process(verbose: int) -> tuple[Watchdog, ShutdownRequested]:
    """Call first, before torch or hivemind are imported: the watchdog is forked from a small process."""
    quiet_libraries(verbose)
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format=LOG_FORMAT, datefmt="%H:%M:%S", stream=sys.stderr)
    # The handler first: a Ctrl+C from here on is a flag the command checks, never a KeyboardInterrupt raised
    # inside the fork's at-fork hooks, where Python swallows it ("Exception ignored in: _releaseLock") and
    # logging's lock stays held: the engine thread then hung at its first getLogger, the Ctrl+C lost.
    shutdown = ShutdownRequested().install()
    watchdog = Watchdog().start()
    _dump_threads_on_sigusr2()
    return watchdog, shutdown


def _dump_threads_on_sigusr2() -> None:
    """`kill -USR2 PID` prints every thread's Python stack to stderr, at once: faulthandler's handler runs in
    C, so it answers even when the main thread is stuck and a Python signal handler would wait for it."""
    import faulthandler
    import signal

    if hasattr(signal, "SIGUSR2"):
        faulthandler.register(signal.SIGUSR2, all_threads=True, chain=False)


def loopback_only(maddrs: list[str]) -> bool:
    return all("/ip4/127." in m or "/ip6/::1/" in m for m in maddrs)


def check_initial_peers(maddrs: list[str] | None) -> None:
    """``--initial-peers`` checked before anything loads: a bad address is a UserError (exit 2) with the shape."""
    from swarm.dht.maddrs import check_peer_maddrs
    from volunteer_cli.main import UserError

    try:
        check_peer_maddrs(list(maddrs or []), "--initial-peers")
    except ValueError as exc:
        raise UserError(str(exc)) from None


def check_own_maddrs(listen: list[str] | None, announce: list[str] | None = None) -> None:
    """``--listen`` and ``--announce`` checked before anything loads (p2pd refuses them only after the libraries have
    loaded, in its own words): a UserError (exit 2) with the shape."""
    from swarm.dht.maddrs import check_listen_maddrs
    from volunteer_cli.main import UserError

    try:
        check_listen_maddrs(list(listen or []), "--listen")
        check_listen_maddrs(list(announce or []), "--announce", any_port=False)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def resolve_data_dir(data_dir: str | None, prefs_path: str | None):
    """--data-dir, else the preferences' data_dir, else the user data dir (what join uses)."""
    from pathlib import Path

    from volunteer.config import load_preferences
    from volunteer.paths import user_data_dir

    prefs_dir = load_preferences(prefs_path).data_dir if not data_dir else None
    return Path(data_dir or prefs_dir or user_data_dir()).expanduser()


def mib_text(nbytes: float) -> str:
    """MiB as a person reads them: whole from 10 up, one decimal below ("0.4"), "<0.1" for a few KiB, "0" for none
    (`doctor` printed every part of a digits stage, 0.02 M parameters, as "0")."""
    mib = nbytes / 2**20
    if mib >= 10 or mib == 0:
        return f"{mib:,.0f}"
    return f"{mib:.1f}" if mib >= 0.05 else "<0.1"
