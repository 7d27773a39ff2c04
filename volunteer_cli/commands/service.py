"""`volunteer service install|uninstall [join args...]`: run a headless node as a systemd user service.

The join arguments are checked now, as `volunteer join` would check them (a typo, a bad peer
address or a run without bootstrap peers must fail here, not in a unit that restarts every 30 s or
stops at once with the reason only in journalctl), and so is the systemd user instance the unit
needs. Path arguments are made absolute, because the unit runs in the home directory.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from volunteer_cli.main import UserError

PATH_OPTIONS = ("--run", "--prefs", "--identity", "--data-dir")


def run_service(args: argparse.Namespace) -> int:
    from volunteer.service import ServiceError, install, systemd_user_problem, uninstall

    join_args = list(args.join_args)
    if join_args[:1] == ["--"]:
        join_args = join_args[1:]
    try:
        if args.action == "install":
            problems = _problems(join_args)
            systemd = systemd_user_problem()
            if systemd:
                problems.append(systemd)
            if problems:
                raise UserError("the unit could never run, so it was not installed:\n  - " + "\n  - ".join(problems))
            message = install(absolute_paths(join_args))
        else:
            if join_args:
                raise UserError(f"uninstall takes no join arguments (got {' '.join(join_args)})")
            message = uninstall()
    except ServiceError as exc:
        raise UserError(str(exc)) from None
    print(message)
    return 0


def _problems(join_args: list[str]) -> list[str]:
    """Parse them as `volunteer join` would: a flag it does not know, or a run or preferences file it
    cannot load, is a UserError at once; the problems it would find before joining are returned."""
    from volunteer_cli.main import add_join_arguments

    join = argparse.ArgumentParser(prog="volunteer join", add_help=False, exit_on_error=False)
    add_join_arguments(join)
    try:
        known, unknown = join.parse_known_args(join_args)
    except (argparse.ArgumentError, SystemExit) as exc:
        detail = f": {exc}" if isinstance(exc, argparse.ArgumentError) else ""
        raise UserError(f"not valid `volunteer join` arguments{detail}; see `volunteer join --help`") from None
    if unknown:
        raise UserError(f"`volunteer join` does not know {' '.join(unknown)}; see `volunteer join --help`")
    from volunteer.config import load_preferences, load_run

    run, _ = load_run(known.run)  # a ConfigError says what is wrong with the file, now
    if known.prefs:
        load_preferences(known.prefs)
    from swarm.dht.maddrs import check_peer_maddrs

    problems = []
    try:
        check_peer_maddrs(list(known.initial_peers or []), "--initial-peers")
    except ValueError as exc:
        problems.append(str(exc))
    if not (known.initial_peers or run.bootstrap_peers):
        problems.append(f"no bootstrap peers: run {run.name} lists none, so pass --initial-peers "
                        "/ip4/HOST/tcp/PORT/p2p/PEER_ID (`volunteer bootstrap` prints it)")
    if known.swarm != "auto" and known.swarm not in run.swarm_names:
        problems.append(f"--swarm {known.swarm}: run {run.name} has no such layer swarm; valid: "
                        f"{', '.join(run.swarm_names)}, or auto")
    return problems


def absolute_paths(join_args: list[str]) -> list[str]:
    """Path values of --run/--prefs/--identity/--data-dir become absolute (built-in run names stay)."""
    out = []
    for index, arg in enumerate(join_args):
        option, equals, value = arg.partition("=")
        previous = join_args[index - 1] if index else ""
        if equals and option in PATH_OPTIONS:
            out.append(f"{option}={_absolute(option, value)}")
        elif previous in PATH_OPTIONS:
            out.append(_absolute(previous, arg))
        else:
            out.append(arg)
    return out


def _absolute(option: str, value: str) -> str:
    path = Path(value).expanduser()
    if option == "--run" and not path.exists() and "/" not in value and not value.endswith((".yaml", ".yml")):
        return value  # a built-in run name
    return str(path.resolve())
