"""`volunteer service install|uninstall`: a systemd *user* unit that runs a headless node.

The unit runs ``<this python> -m volunteer_cli join --headless --swarm auto [args]`` at the lowest
CPU and I/O priority, restarts it after a crash, and keeps /tmp shared (no PrivateTmp), so the X
idle source still finds the display's socket. We only write files; the returned text tells the
user which `systemctl --user` commands to run, so nothing here needs systemd to be testable.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

UNIT_NAME = "volunteer.service"
MARKER = "# Written by `volunteer service install`"
RESTART_DELAY_S = 30
STOP_TIMEOUT_S = 60  # a clean leave: finish in-flight work, save a checkpoint, announce offline
USAGE_ERROR_STATUS = 2  # volunteer_cli's exit status for a mistake the user must fix
OOM_SCORE_ADJUST = 500  # if memory runs out, the kernel should pick us before the owner's programs
ENABLE_HINT = "systemctl --user daemon-reload && systemctl --user enable --now volunteer.service"
_SAFE_ARG = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")  # needs no quotes (% is escaped anyway)


class ServiceError(Exception):
    """The unit cannot be written or removed; the message says what to do."""


def unit_path(env: Mapping[str, str] | None = None, home: Path | None = None) -> Path:
    """~/.config/systemd/user/volunteer.service, honouring $XDG_CONFIG_HOME."""
    env = os.environ if env is None else env
    config_home = env.get("XDG_CONFIG_HOME") or str((home or Path.home()) / ".config")
    return Path(config_home) / "systemd" / "user" / UNIT_NAME


def systemd_user_problem(env: Mapping[str, str] | None = None, uid: int | None = None) -> str | None:
    """None when a systemd user instance runs for this user (its private socket exists), else what is missing.

    Without one, `systemctl --user` fails and the unit would never start (containers, WSL without
    systemd, a session over su or ssh without lingering)."""
    env = os.environ if env is None else env
    runtime = env.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid() if uid is None else uid}"
    socket = Path(runtime) / "systemd" / "private"
    if socket.exists():
        return None
    return (f"no systemd user instance runs for you (no {socket}), so `systemctl --user` cannot start the unit. "
            "Log in to a session with systemd (or `loginctl enable-linger` as your user), or run "
            "`volunteer join --headless` under your own supervisor")


def join_argv(join_args: Sequence[str] = (), python: str = sys.executable) -> list[str]:
    """The node's command line; --headless and --swarm auto unless join_args say otherwise."""
    argv = [python, "-m", "volunteer_cli", "join"]
    if "--headless" not in join_args:
        argv.append("--headless")
    if not any(arg == "--swarm" or arg.startswith("--swarm=") for arg in join_args):
        argv += ["--swarm", "auto"]
    return argv + list(join_args)


def render_unit(join_args: Sequence[str] = (), python: str = sys.executable) -> str:
    exec_start = " ".join(quote_arg(arg) for arg in join_argv(join_args, python))
    return f"""{MARKER}; remove it with `volunteer service uninstall`.
[Unit]
Description=volunteer: train a shared neural network while this computer is idle

[Service]
Type=simple
ExecStart={exec_start}
WorkingDirectory=%h
Environment=PYTHONUNBUFFERED=1
# never in the owner's way: the lowest CPU and I/O priority, first to go if memory runs out
Nice=19
CPUSchedulingPolicy=idle
IOSchedulingClass=idle
OOMScoreAdjust={OOM_SCORE_ADJUST}
Restart=on-failure
RestartSec={RESTART_DELAY_S}
# exit status {USAGE_ERROR_STATUS} is a mistake in the config or flags: restarting cannot fix it
RestartPreventExitStatus={USAGE_ERROR_STATUS}
TimeoutStopSec={STOP_TIMEOUT_S}
# SIGTERM to the main process only: it announces offline, saves a checkpoint and stops its DHT
# process and p2pd in order; whatever is left after TimeoutStopSec is SIGKILLed
KillMode=mixed
# no PrivateTmp: idle detection needs the X server's socket in /tmp/.X11-unix

[Install]
WantedBy=default.target
"""


def quote_arg(arg: str) -> str:
    """One ExecStart word: systemd expands % specifiers and $ variables, so both are escaped."""
    if "\n" in arg or "\r" in arg:
        raise ServiceError(f"argument {arg!r} has a line break; a unit file cannot hold it")
    escaped = arg.replace("%", "%%").replace("$", "$$")
    if _SAFE_ARG.match(arg):
        return escaped
    return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'


def install(join_args: Sequence[str] = (), path: Path | None = None, python: str = sys.executable) -> str:
    """Write (or update) the unit; the text tells the user how to enable it."""
    path = path or unit_path()
    text = render_unit(join_args, python)
    previous = _read(path)
    if previous is not None and not previous.startswith(MARKER):
        raise ServiceError(f"{path} exists and was not written by volunteer; move it away, then install again")
    if previous == text:
        return f"The service is already installed at {path} (unchanged).\nTo start it now and at login: {ENABLE_HINT}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f".{path.name}.tmp")
        scratch.write_text(text)
        os.replace(scratch, path)
    except OSError as exc:
        raise ServiceError(f"cannot write {path}: {exc}") from exc
    verb = "Installed" if previous is None else "Updated"
    return (
        f"{verb} the service at {path}.\n"
        f"To start it now and at every login: {ENABLE_HINT}\n"
        "To keep it training after you log out: loginctl enable-linger\n"
        "Follow it with: journalctl --user -u volunteer.service -f"
    )


def uninstall(path: Path | None = None) -> str:
    """Remove the unit and its enablement link; the text tells the user how to stop a running node."""
    path = path or unit_path()
    previous = _read(path)
    if previous is None:
        return f"The service is not installed (no {path}); nothing to do."
    if not previous.startswith(MARKER):
        raise ServiceError(f"{path} was not written by volunteer; remove it yourself if you want it gone")
    wants_link = path.parent / "default.target.wants" / UNIT_NAME
    try:
        if wants_link.is_symlink():
            wants_link.unlink()
        path.unlink()
    except OSError as exc:
        raise ServiceError(f"cannot remove {path}: {exc}") from exc
    return (
        f"Removed the service {path}; it will not start at login any more.\n"
        "If it is running now, stop it with: systemctl --user stop volunteer.service && systemctl --user daemon-reload"
    )


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ServiceError(f"cannot read {path}: {exc}") from exc
