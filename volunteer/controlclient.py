"""`volunteer ctl`'s end of the control socket: ask one node, or every node of a data dir.

Both ends share controlwire.py (where the sockets live, the errors, the line format); the server
and the protocol are in control.py.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path

from volunteer.controlwire import (
    MAX_CONNECTIONS, STATUS, BadMessage, ControlError, NodeNotRunning, read_line, socket_files,
)
from volunteer.snapshot import Command

logger = logging.getLogger(__name__)

MAX_REPLY_BYTES = 64 * 1024 * 1024  # a snapshot with long histories and many peers
CLIENT_TIMEOUT_S = 5.0
START_HINT = "start one with `volunteer join --headless`"


def send_command(path: str | os.PathLike, cmd: str | Command, timeout_s: float = CLIENT_TIMEOUT_S) -> dict:
    """Ask the node listening at path; its reply ({"ok": true, "snapshot": ...}) or a ControlError."""
    path = Path(path)
    cmd = cmd.value if isinstance(cmd, Command) else cmd
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(path))
        except FileNotFoundError:
            raise NodeNotRunning(f"no node is running here: {path} does not exist — {START_HINT}") from None
        except ConnectionRefusedError:
            raise NodeNotRunning(
                f"no node is running here: {path} is left from a node that stopped — {START_HINT}"
            ) from None
        except PermissionError:
            raise ControlError(f"cannot open {path}: permission denied; run this as the node's owner") from None
        except OSError as exc:
            raise ControlError(f"cannot reach the node at {path}: {exc}") from exc
        try:
            sock.sendall(json.dumps({"cmd": cmd}).encode() + b"\n")
        except OSError:
            pass  # the node hung up early: its reply, if any, says why
        try:
            line = read_line(sock, timeout_s, MAX_REPLY_BYTES)
        except BadMessage as exc:
            raise ControlError(f"the node at {path} did not answer properly: {exc}") from None
    try:
        reply = json.loads(line)
    except ValueError:
        raise ControlError(f"the node at {path} sent a garbled reply: {line[:80]!r}") from None
    if not isinstance(reply, dict) or not reply.get("ok"):
        error = reply.get("error") if isinstance(reply, dict) else None
        raise ControlError(error or f"the node at {path} sent an unexpected reply: {line[:80]!r}")
    return reply


def live_nodes(data_dir: str | os.PathLike, timeout_s: float = CLIENT_TIMEOUT_S) -> list[tuple[Path, dict]]:
    """(socket, status snapshot) of every node answering in this data dir; stale sockets are skipped.

    The sockets are asked at once, so a busy node costs one timeout, not one per socket.
    """
    from concurrent.futures import ThreadPoolExecutor

    def ask(path: Path) -> dict | None:
        try:
            return send_command(path, STATUS, timeout_s=timeout_s)["snapshot"]
        except ControlError as exc:
            logger.info("skipping %s: %s", path, exc)
            return None

    paths = socket_files(data_dir)
    if not paths:
        return []
    with ThreadPoolExecutor(max_workers=min(len(paths), MAX_CONNECTIONS)) as pool:
        answers = list(pool.map(ask, paths))
    return [(path, snapshot) for path, snapshot in zip(paths, answers) if snapshot is not None]
