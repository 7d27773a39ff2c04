"""The control socket with a fake engine: replies, bad clients, file modes, stale sockets, other uids."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
from pathlib import Path

import pytest

from volunteer.control import (
    MAX_REQUEST_BYTES,
    ControlError,
    ControlServer,
    NodeNotRunning,
    send_command,
)
from volunteer.snapshot import Command, NodeSnapshot, NodeState

STATE_AFTER = {
    Command.PAUSE: NodeState.PAUSED,
    Command.FINISH: NodeState.FINISHING,
    Command.RESUME: NodeState.ONLINE,
    Command.QUIT: NodeState.OFFLINE,
}


class FakeEngine:
    """Just enough of the Engine protocol for the control socket."""

    def __init__(self, on_command=None):
        self.commands: list[Command] = []
        self.state = NodeState.ONLINE
        self.on_command = on_command

    def start(self) -> None:
        pass

    def snapshot(self) -> NodeSnapshot:
        return NodeSnapshot(
            run_name="demo", run_id="demo-1234abcd", swarm="layer1", peer_id="QmFakePeer", state=self.state,
            loss=float("nan"),
        )

    def command(self, command: Command) -> None:
        self.commands.append(command)
        self.state = STATE_AFTER[command]
        if self.on_command:
            self.on_command(command)

    def add_listener(self, on_snapshot, on_event) -> None:
        pass

    def wait_stopped(self, timeout: float | None = None) -> bool:
        return True


@pytest.fixture
def sock_path(tmp_path):
    return tmp_path / "node" / "control.sock"


@pytest.fixture
def engine():
    return FakeEngine()


@pytest.fixture
def server(sock_path, engine):
    server = ControlServer(sock_path, engine, connection_timeout_s=0.5)
    server.start()
    try:
        yield server
    finally:
        server.close()


def exchange(path, payload: bytes, timeout_s: float = 5.0) -> dict:
    """A raw client: send bytes as they are, read one reply line."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(str(path))
        try:
            sock.sendall(payload)
        except OSError:
            pass  # the server may hang up on an oversized request before we finish
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    return json.loads(reply)


def test_status_returns_the_snapshot_as_json(server, engine):
    reply = send_command(server.path, "status")
    assert reply["ok"] is True
    assert reply["snapshot"]["run_id"] == "demo-1234abcd"
    assert reply["snapshot"]["state"] == "online"
    assert reply["snapshot"]["loss"] is None  # NaN is not JSON
    assert engine.commands == []


@pytest.mark.parametrize("command", list(Command))
def test_commands_reach_the_engine(server, engine, command):
    reply = send_command(server.path, command.value)
    assert engine.commands == [command]
    assert reply["snapshot"]["state"] == STATE_AFTER[command].value


def test_the_client_takes_a_command_enum(server, engine):
    send_command(server.path, Command.PAUSE)
    assert engine.commands == [Command.PAUSE]


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        (b"this is not json\n", 'not JSON: send one line like {"cmd": "status"}'),
        (b'{"cmd": "explode"}\n', "unknown command 'explode'; known: status, pause, finish, resume, quit"),
        (b'["status"]\n', "unknown command None; known: status, pause, finish, resume, quit"),
        (b"\n", "empty line"),
        (b"x" * (MAX_REQUEST_BYTES + 10) + b"\n", f"line longer than {MAX_REQUEST_BYTES} bytes"),
    ],
)
def test_a_bad_request_gets_an_error_and_the_server_keeps_serving(server, engine, payload, error):
    assert exchange(server.path, payload) == {"ok": False, "error": error}
    assert send_command(server.path, "status")["ok"]
    assert engine.commands == []


def test_a_request_without_newline_is_taken_when_the_client_closes_its_side(server, engine):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(str(server.path))
        sock.sendall(b'{"cmd": "pause"}')
        sock.shutdown(socket.SHUT_WR)
        assert json.loads(sock.recv(65536))["ok"]
    assert engine.commands == [Command.PAUSE]


def test_the_client_raises_the_nodes_error(server):
    with pytest.raises(ControlError, match="unknown command 'explode'"):
        send_command(server.path, "explode")


def test_a_slow_client_does_not_block_others_and_is_dropped(sock_path, engine):
    with ControlServer(sock_path, engine, connection_timeout_s=2.0) as server:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as slow:
            slow.connect(str(server.path))
            slow.sendall(b'{"cmd": ')  # ...and nothing more
            assert send_command(server.path, "status")["ok"]
            slow.setblocking(False)
            with pytest.raises(BlockingIOError):
                slow.recv(65536)  # the slow one is still waiting: the other was not queued behind it
            slow.settimeout(5)
            assert json.loads(slow.recv(65536)) == {"ok": False, "error": "no complete line within 2 s"}


def test_an_engine_failure_is_an_error_reply_not_a_dead_server(sock_path):
    def fail(command):
        raise RuntimeError("checkpoint disk full")

    with ControlServer(sock_path, FakeEngine(on_command=fail)) as server:
        with pytest.raises(ControlError, match="the node failed to answer: checkpoint disk full"):
            send_command(server.path, "pause")
        assert send_command(server.path, "status")["ok"]


def test_quit_may_close_the_server_from_its_own_handler(sock_path):
    holder = {}
    engine = FakeEngine(on_command=lambda command: holder["server"].close())
    holder["server"] = server = ControlServer(sock_path, engine)
    server.start()
    assert send_command(sock_path, "quit")["snapshot"]["state"] == "offline"
    assert not sock_path.exists()
    server.close()


def test_the_socket_is_0600_in_a_0700_dir(server, sock_path):
    assert stat.S_ISSOCK(os.stat(sock_path).st_mode)
    assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(sock_path.parent).st_mode) == 0o700


def test_an_open_data_dir_is_made_private(tmp_path, engine):
    data_dir = tmp_path / "data"
    data_dir.mkdir(mode=0o755)
    os.chmod(data_dir, 0o755)
    with ControlServer(data_dir / "control.sock", engine):
        assert stat.S_IMODE(os.stat(data_dir).st_mode) == 0o700


def test_another_uid_is_refused(sock_path, engine):
    with ControlServer(sock_path, engine, expected_uid=os.getuid() + 1) as server:
        reply = exchange(server.path, b'{"cmd": "quit"}\n')
    assert reply["ok"] is False
    assert reply["error"].startswith(f"refused: uid {os.getuid()} does not own this node")
    assert engine.commands == []


def test_a_stale_socket_from_a_crashed_node_is_replaced(sock_path, engine):
    sock_path.parent.mkdir(mode=0o700)
    crashed = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    crashed.bind(str(sock_path))
    crashed.close()  # the file stays, nobody listens
    with pytest.raises(NodeNotRunning, match="left from a node that stopped"):
        send_command(sock_path, "status")
    with ControlServer(sock_path, engine) as server:
        assert send_command(server.path, "status")["ok"]


def test_a_running_node_is_not_replaced(server, sock_path, engine):
    with pytest.raises(ControlError, match="another node is already running here"):
        ControlServer(sock_path, engine).start()
    assert send_command(sock_path, "status")["ok"]


def test_a_file_that_is_not_a_socket_is_left_alone(sock_path, engine):
    sock_path.parent.mkdir(mode=0o700)
    sock_path.write_text("precious")
    with pytest.raises(ControlError, match="is not a socket"):
        ControlServer(sock_path, engine).start()
    assert sock_path.read_text() == "precious"


def test_no_node_running_says_how_to_start_one(sock_path):
    with pytest.raises(NodeNotRunning) as raised:
        send_command(sock_path, "status")
    assert str(raised.value) == (
        f"no node is running here: {sock_path} does not exist — start one with `volunteer join --headless`"
    )


def test_a_path_too_long_for_a_unix_socket_is_a_clear_error(tmp_path, engine):
    with pytest.raises(ControlError, match="choose a shorter data dir"):
        ControlServer(tmp_path / ("d" * 120) / "control.sock", engine).start()


def test_close_is_idempotent_and_removes_the_socket(sock_path, engine):
    server = ControlServer(sock_path, engine)
    server.close()  # never started: nothing to do
    server.start()
    threads_before = {thread.name for thread in threading.enumerate()}
    assert "volunteer-control" in threads_before
    server.close()
    server.close()
    assert not sock_path.exists()
    assert "volunteer-control" not in {thread.name for thread in threading.enumerate()}
    with pytest.raises(NodeNotRunning):
        send_command(sock_path, "status")


def test_many_clients_at_once(server, engine):
    replies = []

    def ask():
        replies.append(send_command(server.path, "status")["ok"])

    clients = [threading.Thread(target=ask) for _ in range(12)]
    for client in clients:
        client.start()
    for client in clients:
        client.join(5)
    assert replies == [True] * 12


def test_a_data_dir_too_deep_for_a_socket_path_gets_a_short_private_dir_that_ctl_finds(tmp_path, engine, monkeypatch):
    from volunteer.control import control_dir, live_nodes, serve_node, short_control_root

    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    deep = tmp_path / ("d" * 100) / "data"
    server = serve_node(deep, "testrun-0123abcd", "layer1", engine)
    try:
        assert server.path.parent == control_dir(deep) and server.path.parent.parent == short_control_root()
        assert stat.S_IMODE(server.path.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(short_control_root().stat().st_mode) == 0o700
        [(found, snapshot)] = live_nodes(deep)
        assert found == server.path and snapshot["swarm"] == engine.snapshot().swarm
    finally:
        server.close()
    assert not server.path.parent.exists(), "the hashed dir is removed with its last socket"
    assert control_dir(Path("/tmp/d")) == Path("/tmp/d/control")  # a data dir short enough keeps its sockets
