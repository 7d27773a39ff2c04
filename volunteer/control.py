"""The local control socket of a headless node: `volunteer ctl status|pause|finish|resume|quit`.

A Unix domain socket in the node's data dir (mode 0600 in a 0700 dir); on Linux the server also
checks the peer's uid (SO_PEERCRED) and refuses other users. Elsewhere the file modes alone guard it.

Protocol: one JSON line per connection each way.
    request  {"cmd": "status" | "pause" | "finish" | "resume" | "quit"}
    reply    {"ok": true, "snapshot": {...NodeSnapshot.to_json()...}}  or  {"ok": false, "error": "..."}
Every command answers with the snapshot taken after the engine applied it (engines with a
``wait_applied(ticket, timeout_s)`` method, like the node, are waited on for up to
``APPLY_WAIT_S``; others answer at once). A bad request (not JSON, unknown command, over 64 KiB,
too slow) gets an error reply; each connection has its own thread and deadline, so one bad client
never blocks the others or the server.

Where: ``<data_dir>/control/<run_id>-<swarm>.sock`` (``auto`` until the node has chosen its swarm;
``-2``, ``-3``... when another live node of the same run and swarm holds the name). A socket's path
has at most 107 bytes: for a deeper data dir the sockets live in ``$XDG_RUNTIME_DIR/volunteer/<hash of
the data dir>/`` (or ``<temp dir>/volunteer-<uid>/<hash>/``), which ctl computes the same way. ``volunteer
ctl`` finds the nodes of a data dir by asking every socket there (``live_nodes``).

This file is the node's end (``ControlServer``, ``serve_node``). `volunteer ctl`'s end is
controlclient.py, and what both ends share (where the sockets live, the errors, reading one line)
is controlwire.py; their names are importable from here too, as they always were.
"""

from __future__ import annotations

import json
import logging
import math
import os
import selectors
import socket
import stat
import struct
import threading
from pathlib import Path

from volunteer.controlclient import (  # noqa: F401  (re-exported: importers of volunteer.control)
    CLIENT_TIMEOUT_S, MAX_REPLY_BYTES, START_HINT, live_nodes, send_command,
)
from volunteer.controlwire import (  # noqa: F401  (re-exported: importers of volunteer.control)
    COMMANDS, CONTROL_DIR_NAME, MAX_CONNECTIONS, MAX_SOCKET_PATH_BYTES, SOCKET_NAME_ALLOWANCE, SOCKET_SUFFIX,
    STATUS, BadMessage, ControlError, NodeNotRunning, SocketInUse, control_dir, read_line, short_control_root,
    socket_files, socket_path,
)
from volunteer.snapshot import Command, Engine

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 64 * 1024
CONNECTION_TIMEOUT_S = 2.0  # per connection: a client that is slower gets an error and is dropped
STALE_PROBE_TIMEOUT_S = 1.0
SOCKET_MODE = 0o600
DIR_MODE = 0o700
SHUTDOWN_JOIN_S = CONNECTION_TIMEOUT_S + 1.0
APPLY_WAIT_S = 2.0  # how long a reply waits for the engine to apply the command
MAX_SOCKETS_PER_SWARM = 16  # volunteers of one run and swarm sharing one data dir


class ControlServer:
    """Serves the control socket from a background thread: ``start()``, then ``close()`` (idempotent)."""

    def __init__(
        self,
        path: str | os.PathLike,
        engine: Engine,
        *,
        expected_uid: int | None = None,  # tests inject another uid to see a refusal
        connection_timeout_s: float = CONNECTION_TIMEOUT_S,
    ):
        self.path = Path(path)
        self._engine = engine
        self._expected_uid = os.getuid() if expected_uid is None else expected_uid
        self._connection_timeout_s = connection_timeout_s
        self._listener: socket.socket | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._socket_inode: int | None = None
        self._thread: threading.Thread | None = None
        self._handlers: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> None:
        if self._thread is not None:
            return
        _check_path_length(self.path)
        _prepare_private_dir(self.path.parent)
        _remove_stale_socket(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(self.path))
            os.chmod(self.path, SOCKET_MODE)  # the 0700 dir already keeps others out while it is wider
            listener.listen(MAX_CONNECTIONS)
        except OSError as exc:
            listener.close()
            raise ControlError(f"cannot listen on {self.path}: {exc}") from exc
        listener.setblocking(False)
        self._socket_inode = self.path.stat().st_ino
        self._listener = listener
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._serve, name="volunteer-control", daemon=True)
        self._thread.start()
        logger.info("control socket listening on %s", self.path)

    def close(self) -> None:
        with self._lock:
            if self._closed or self._thread is None:  # closed already, or never started
                return
            self._closed = True
        self._wake_w.send(b"x")
        self._thread.join(SHUTDOWN_JOIN_S)
        self._listener.close()
        self._unlink_own_socket()
        with self._lock:
            handlers = [thread for thread in self._handlers if thread is not threading.current_thread()]
        for thread in handlers:  # a handler may be the one closing us (a "quit" command)
            thread.join(SHUTDOWN_JOIN_S)
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> ControlServer:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _unlink_own_socket(self) -> None:
        try:
            if self.path.stat().st_ino == self._socket_inode:  # a newer node may own the path by now
                self.path.unlink()
        except FileNotFoundError:
            pass
        if self.path.parent.parent == short_control_root():  # a deep data dir's hashed dir: leave no litter
            try:
                self.path.parent.rmdir()
            except OSError:
                pass  # another node of this data dir still listens there

    def _serve(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while not self._closed:
                for key, _ in selector.select():
                    if key.fileobj is self._wake_r:
                        return
                    self._accept()

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            logger.warning("control socket: accept failed: %s", exc)
            return
        conn.setblocking(True)
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._handlers = {thread for thread in self._handlers if thread.is_alive()}
            busy = len(self._handlers) >= MAX_CONNECTIONS
            if not busy:
                thread = threading.Thread(target=self._handle, args=(conn,), name="volunteer-control-conn", daemon=True)
                self._handlers.add(thread)
        if busy:
            _send_reply(conn, _error(f"busy: {MAX_CONNECTIONS} requests in progress, try again"), timeout_s=0.1)
            conn.close()
        else:
            thread.start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                reply = self._reply_to(conn)
            except Exception as exc:  # the engine failed on this command; the server goes on
                logger.exception("control socket: request failed")
                reply = _error(f"the node failed to answer: {exc}")
            _send_reply(conn, reply, timeout_s=self._connection_timeout_s)

    def _reply_to(self, conn: socket.socket) -> dict:
        uid = peer_uid(conn)
        if uid is not None and uid != self._expected_uid:
            logger.warning("control socket: refused a connection from uid %d", uid)
            return _error(f"refused: uid {uid} does not own this node; run `volunteer ctl` as its owner")
        try:
            cmd = _parse_request(read_line(conn, self._connection_timeout_s, MAX_REQUEST_BYTES))
        except BadMessage as exc:
            return _error(str(exc))
        command = COMMANDS[cmd]
        if command is not None:
            ticket = self._engine.command(command)
            wait_applied = getattr(self._engine, "wait_applied", None)
            if ticket is not None and wait_applied is not None and command != Command.QUIT:
                wait_applied(ticket, APPLY_WAIT_S)
        return {"ok": True, "snapshot": _json_safe(self._engine.snapshot().to_json())}


def serve_node(data_dir: str | os.PathLike, run_id: str, swarm: str, engine: Engine) -> ControlServer:
    """Start a ControlServer at the first free socket name of this run and swarm."""
    for index in range(MAX_SOCKETS_PER_SWARM):
        server = ControlServer(socket_path(data_dir, run_id, swarm, index), engine)
        try:
            server.start()
        except SocketInUse:
            continue
        return server
    raise ControlError(
        f"{MAX_SOCKETS_PER_SWARM} nodes of {run_id}/{swarm} already listen in {control_dir(data_dir)}"
    )


def peer_uid(conn: socket.socket) -> int | None:
    """The connecting process's uid (Linux SO_PEERCRED); None where the OS does not say."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def _parse_request(line: bytes) -> str:
    try:
        request = json.loads(line)
    except ValueError:
        raise BadMessage('not JSON: send one line like {"cmd": "status"}') from None
    cmd = request.get("cmd") if isinstance(request, dict) else None
    if cmd not in COMMANDS:
        raise BadMessage(f"unknown command {cmd!r}; known: {', '.join(COMMANDS)}")
    return cmd


def _error(message: str) -> dict:
    return {"ok": False, "error": message}


def _send_reply(conn: socket.socket, reply: dict, timeout_s: float) -> None:
    try:
        conn.settimeout(timeout_s)
        conn.sendall(json.dumps(reply, allow_nan=False).encode() + b"\n")
    except OSError as exc:
        logger.debug("control socket: client left before the reply: %s", exc)


def _json_safe(value):
    """NaN and infinities become null: strict JSON parsers (jq, browsers) reject them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


def _check_path_length(path: Path) -> None:
    if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
        raise ControlError(
            f"the control socket path {path} is longer than {MAX_SOCKET_PATH_BYTES} bytes; choose a shorter data dir"
        )


def _prepare_private_dir(directory: Path) -> None:
    if directory.parent == short_control_root():  # in a shared temp dir: its parent must be ours and private too
        _prepare_private_dir_itself(directory.parent)
    _prepare_private_dir_itself(directory)


def _prepare_private_dir_itself(directory: Path) -> None:
    directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise ControlError(f"{directory} is not a directory; move it away so the node can listen there")
    if info.st_uid != os.getuid():
        raise ControlError(f"{directory} belongs to uid {info.st_uid}, not you; choose a data dir of your own")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(directory, DIR_MODE)  # it holds the node's identity key and checkpoints too


def _remove_stale_socket(path: Path) -> None:
    """A socket file that refuses connections was left by a crashed node: replace it."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise ControlError(f"{path} exists and is not a socket; move it away so the node can listen there")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(STALE_PROBE_TIMEOUT_S)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            logger.info("replacing the stale control socket %s", path)
            path.unlink(missing_ok=True)
            return
        except OSError as exc:
            raise ControlError(f"cannot check {path}: {exc}") from exc
    raise SocketInUse(
        f"another node is already running here ({path} answers); stop it with `volunteer ctl quit` "
        "or give this one another data dir"
    )
