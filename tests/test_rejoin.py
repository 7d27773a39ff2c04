"""A volunteer that quits and joins again at once is online again within one heartbeat (real DHT, in process).

The DHT keeps whichever entry of a subkey expires later, so an offline record that outlived the
heartbeats hid the restarted node (and stalled every pipeline through it) for ~45 s (issue 16).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from procs import wait_until, write_run  # noqa: E402
from swarm.dht.maddrs import peer_maddr_problem  # noqa: E402
from swarm.dht.dht import DHTSettings, make_validators, shutdown_dht, start_dht  # noqa: E402
from swarm.dht.membership import Membership  # noqa: E402
from volunteer.config import load_run  # noqa: E402
from volunteer.node import Node, NodeOptions  # noqa: E402
from volunteer.snapshot import NodeState  # noqa: E402

HEARTBEAT_S = 1.0  # record lifetime 3 s; the old offline record lived 60 s
READ_SLACK_S = 1.0  # one DHT store and get on a loaded loopback


def _node(run, maddr: str, identity: Path, data_dir: Path) -> Node:
    node = Node(NodeOptions(run=run, swarm="layer1", initial_peers=[maddr], data_dir=data_dir,
                            identity_path=identity, train=False, control_socket=False))
    node.start()
    wait_until(lambda: node.snapshot().state == NodeState.ONLINE or node.error, 60, what="the node online")
    assert node.error is None, node.error
    return node


def _state(observer: Membership, peer_id: str) -> str | None:
    return next((r.state for r in observer.read("layer1") if r.peer_id == peer_id), None)


def test_a_restarted_node_is_seen_online_within_one_heartbeat(tmp_path):
    run, _ = load_run(str(write_run(tmp_path / "run.yaml", heartbeat_s=HEARTBEAT_S)))
    boot = start_dht(DHTSettings(), make_validators(None, [], None))
    node = None
    try:
        maddr = [str(m) for m in boot.get_visible_maddrs()][0]
        assert peer_maddr_problem(maddr) is None  # what `volunteer bootstrap` prints passes our own check
        observer = Membership(boot, run, b"")
        identity = tmp_path / "me.key"
        node = _node(run, maddr, identity, tmp_path / "data")
        peer_id = node.snapshot().peer_id
        wait_until(lambda: _state(observer, peer_id) == "online", 10, what="the first online record")

        node.request_stop()  # the dashboard's q
        assert node.wait_stopped(30)
        assert _state(observer, peer_id) == "offline"

        node = _node(run, maddr, identity, tmp_path / "data")  # the same `volunteer join`, at once
        assert node.snapshot().peer_id == peer_id
        online_at = time.monotonic()
        wait_until(lambda: _state(observer, peer_id) == "online", HEARTBEAT_S + READ_SLACK_S,
                   interval_s=0.1, what="the restarted node's online record")
        assert time.monotonic() - online_at <= HEARTBEAT_S + READ_SLACK_S
    finally:
        if node is not None:
            node.request_stop()
            node.wait_stopped(30)
        shutdown_dht(boot)
