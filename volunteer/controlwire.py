"""What both ends of the control socket share: where the sockets live, the errors, one line each way.

The node serves (control.py), `volunteer ctl` asks (controlclient.py); the protocol itself is
described in control.py's docstring.
"""

from __future__ import annotations

import hashlib
import os
import socket
import tempfile
import time
from pathlib import Path

from volunteer.snapshot import Command

MAX_CONNECTIONS = 16  # requests a node answers at once; a client asks at most this many nodes at once too
MAX_SOCKET_PATH_BYTES = 107  # sun_path is 108 bytes with its NUL
_RECV_BYTES = 65536
STATUS = "status"
COMMANDS: dict[str, Command | None] = {STATUS: None, **{command.value: command for command in Command}}
CONTROL_DIR_NAME = "control"
SOCKET_SUFFIX = ".sock"
SOCKET_NAME_ALLOWANCE = 48  # bytes kept for '/<run_id>-<swarm>-N.sock' before the short dir is used


class ControlError(Exception):
    """The control socket cannot be served or asked; the message says what to do."""


class NodeNotRunning(ControlError):
    """Nothing listens at the control socket's path."""


class SocketInUse(ControlError):
    """A live node already answers at this path."""


class BadMessage(Exception):
    """A line that is not one: too slow, too long, empty, or not the JSON the protocol expects."""


def read_line(conn: socket.socket, timeout_s: float, max_bytes: int) -> bytes:
    """One line (without its newline) before a deadline; a dribbling peer cannot stretch it."""
    deadline_s = time.monotonic() + timeout_s
    data = bytearray()
    while True:
        remaining_s = deadline_s - time.monotonic()
        if remaining_s <= 0:
            raise BadMessage(f"no complete line within {timeout_s:g} s")
        conn.settimeout(remaining_s)
        try:
            chunk = conn.recv(_RECV_BYTES)
        except TimeoutError:
            raise BadMessage(f"no complete line within {timeout_s:g} s") from None
        except OSError as exc:
            raise BadMessage(f"connection failed: {exc}") from None
        newline = chunk.find(b"\n")
        data += chunk if newline < 0 else chunk[:newline]
        if len(data) > max_bytes:
            raise BadMessage(f"line longer than {max_bytes} bytes")
        if newline >= 0 or not chunk:  # a peer that closes its side without a newline sent one line too
            break
    if not data:
        raise BadMessage("empty line")
    return bytes(data)


# ----- where the sockets live


def control_dir(data_dir: str | os.PathLike) -> Path:
    """``<data_dir>/control``, or where that is too long for a socket's path (a deep home or temp dir),
    a private dir named by a hash of the data dir under $XDG_RUNTIME_DIR (or the temp dir): node and
    ctl compute the same place from the data dir alone."""
    home = Path(data_dir) / CONTROL_DIR_NAME
    if len(os.fsencode(home.absolute())) + SOCKET_NAME_ALLOWANCE <= MAX_SOCKET_PATH_BYTES:
        return home
    digest = hashlib.sha256(os.fsencode(home.absolute())).hexdigest()[:16]
    return short_control_root() / digest


def short_control_root() -> Path:
    """Our own dir for control sockets when a data dir is too deep: $XDG_RUNTIME_DIR/volunteer (per user,
    0700 by systemd) or <temp dir>/volunteer-<uid>."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir():
        return Path(runtime) / "volunteer"
    return Path(tempfile.gettempdir()) / f"volunteer-{os.getuid()}"


def socket_path(data_dir: str | os.PathLike, run_id: str, swarm: str, index: int = 0) -> Path:
    """``<data_dir>/control/<run_id>-<swarm>.sock``; index 1, 2... gives ``-2.sock``, ``-3.sock``."""
    suffix = f"-{index + 1}" if index else ""
    return control_dir(data_dir) / f"{run_id}-{swarm}{suffix}{SOCKET_SUFFIX}"


def socket_files(data_dir: str | os.PathLike) -> list[Path]:
    directory = control_dir(data_dir)
    try:
        return sorted(path for path in directory.iterdir() if path.name.endswith(SOCKET_SUFFIX))
    except OSError:
        return []
