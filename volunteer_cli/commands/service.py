"""`volunteer service install|uninstall [join args...]`: run a headless node as a systemd user service.

The join arguments are checked now (a typo must fail here, not in a unit that restarts every 30 s)
and path arguments are made absolute, because the unit runs in the home directory.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from volunteer_cli.main import UserError

PATH_OPTIONS = ("--run", "--prefs", "--identity", "--data-dir")


def run_service(args: argparse.Namespace) -> int:
    from volunteer.service import ServiceError, install, uninstall

    join_args = list(args.join_args)
    if join_args[:1] == ["--"]:
        join_args = join_args[1:]
    try:
        if args.action == "install":
            message = install(absolute_paths(_checked(join_args)))
        else:
            if join_args:
                raise UserError(f"uninstall takes no join arguments (got {' '.join(join_args)})")
            message = uninstall()
    except ServiceError as exc:
        raise UserError(str(exc)) from None
    print(message)
    return 0


def _checked(join_args: list[str]) -> list[str]:
    """Parse them as `volunteer join` would; a mistake is a UserError naming the argument."""
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

    if known.run:
        load_run(known.run)  # a ConfigError says what is wrong with the file, now
    if known.prefs:
        load_preferences(known.prefs)
    return join_args


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
