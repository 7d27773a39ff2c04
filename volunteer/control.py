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
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import selectors
import socket
import stat
import struct
import tempfile
import threading
import time
from pathlib import Path

from volunteer.snapshot import Command, Engine

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 64 * 1024
MAX_REPLY_BYTES = 64 * 1024 * 1024  # a snapshot with long histories and many peers
CONNECTION_TIMEOUT_S = 2.0  # per connection: a client that is slower gets an error and is dropped
CLIENT_TIMEOUT_S = 5.0
STALE_PROBE_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 16
MAX_SOCKET_PATH_BYTES = 107  # sun_path is 108 bytes with its NUL
SOCKET_MODE = 0o600
DIR_MODE = 0o700
SHUTDOWN_JOIN_S = CONNECTION_TIMEOUT_S + 1.0
_RECV_BYTES = 65536
STATUS = "status"
COMMANDS: dict[str, Command | None] = {STATUS: None, **{command.value: command for command in Command}}
START_HINT = "start one with `volunteer join --headless`"
APPLY_WAIT_S = 2.0  # how long a reply waits for the engine to apply the command
CONTROL_DIR_NAME = "control"
SOCKET_SUFFIX = ".sock"
MAX_SOCKETS_PER_SWARM = 16  # volunteers of one run and swarm sharing one data dir
SOCKET_NAME_ALLOWANCE = 48  # bytes kept for '/<run_id>-<swarm>-N.sock' before the short dir is used


class ControlError(Exception):
    """The control socket cannot be served or asked; the message says what to do."""


class NodeNotRunning(ControlError):
    """Nothing listens at the control socket's path."""


class SocketInUse(ControlError):
    """A live node already answers at this path."""


class _BadRequest(Exception):
    pass


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
        except _BadRequest as exc:
            return _error(str(exc))
        command = COMMANDS[cmd]
        if command is not None:
            ticket = self._engine.command(command)
            wait_applied = getattr(self._engine, "wait_applied", None)
            if ticket is not None and wait_applied is not None and command != Command.QUIT:
                wait_applied(ticket, APPLY_WAIT_S)
        return {"ok": True, "snapshot": _json_safe(self._engine.snapshot().to_json())}


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
        except _BadRequest as exc:
            raise ControlError(f"the node at {path} did not answer properly: {exc}") from None
    try:
        reply = json.loads(line)
    except ValueError:
        raise ControlError(f"the node at {path} sent a garbled reply: {line[:80]!r}") from None
    if not isinstance(reply, dict) or not reply.get("ok"):
        error = reply.get("error") if isinstance(reply, dict) else None
        raise ControlError(error or f"the node at {path} sent an unexpected reply: {line[:80]!r}")
    return reply


def read_line(conn: socket.socket, timeout_s: float, max_bytes: int) -> bytes:
    """One line (without its newline) before a deadline; a dribbling peer cannot stretch it."""
    deadline_s = time.monotonic() + timeout_s
    data = bytearray()
    while True:
        remaining_s = deadline_s - time.monotonic()
        if remaining_s <= 0:
            raise _BadRequest(f"no complete line within {timeout_s:g} s")
        conn.settimeout(remaining_s)
        try:
            chunk = conn.recv(_RECV_BYTES)
        except TimeoutError:
            raise _BadRequest(f"no complete line within {timeout_s:g} s") from None
        except OSError as exc:
            raise _BadRequest(f"connection failed: {exc}") from None
        newline = chunk.find(b"\n")
        data += chunk if newline < 0 else chunk[:newline]
        if len(data) > max_bytes:
            raise _BadRequest(f"line longer than {max_bytes} bytes")
        if newline >= 0 or not chunk:  # a peer that closes its side without a newline sent one line too
            break
    if not data:
        raise _BadRequest("empty line")
    return bytes(data)


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
        raise _BadRequest('not JSON: send one line like {"cmd": "status"}') from None
    cmd = request.get("cmd") if isinstance(request, dict) else None
    if cmd not in COMMANDS:
        raise _BadRequest(f"unknown command {cmd!r}; known: {', '.join(COMMANDS)}")
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


# ----- where the sockets live, and finding them


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


def socket_files(data_dir: str | os.PathLike) -> list[Path]:
    directory = control_dir(data_dir)
    try:
        return sorted(path for path in directory.iterdir() if path.name.endswith(SOCKET_SUFFIX))
    except OSError:
        return []


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
