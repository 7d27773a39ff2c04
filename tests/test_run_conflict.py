"""A changed run config stops with the differences and how to join the active run, unless --new-run (issue 16)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from procs import wait_until, write_run  # noqa: E402
from swarm.dht.dht import DHTSettings, make_validators, shutdown_dht, start_dht  # noqa: E402
from swarm.dht.membership import OtherRun  # noqa: E402
from volunteer.config import load_run  # noqa: E402
from volunteer.node import Node, NodeOptions  # noqa: E402
from volunteer.node.runs import active_conflict, conflict_message, save_run_config  # noqa: E402
from volunteer.snapshot import NodeState  # noqa: E402


def _other(run_id: str, online: int) -> OtherRun:
    return OtherRun(run_id, ["optimizer.lr: ours 0.002, theirs 0.001"], {}, online)


def test_stop_only_for_a_live_run_while_ours_is_empty_and_not_when_told_to_go_alone():
    busy, idle = _other("r-busy", 3), _other("r-idle", 0)
    assert active_conflict(0, [idle, busy], new_run=False) is busy
    assert active_conflict(0, [idle], new_run=False) is None  # only listed: nobody to join
    assert active_conflict(2, [busy], new_run=False) is None  # our run is live too: join ours
    assert active_conflict(0, [busy], new_run=True) is None


def test_the_saved_config_is_the_active_run_and_the_message_says_how_to_use_it(tmp_path):
    theirs, _ = load_run(str(write_run(tmp_path / "a.yaml", optimizer="{lr: 0.001}")))
    mine, _ = load_run(str(write_run(tmp_path / "b.yaml", optimizer="{lr: 0.002}")))
    other = OtherRun(theirs.run_id, ["optimizer.lr: ours 0.002, theirs 0.001"], theirs.canonical(), 2)
    saved = save_run_config(other, mine, tmp_path / "runs")
    assert saved is not None and load_run(str(saved))[0].run_id == theirs.run_id
    text = conflict_message(mine, other, saved, ["/ip4/x"])
    assert "Differences: optimizer.lr: ours 0.002, theirs 0.001" in text
    assert f"volunteer join --run {saved} --initial-peers /ip4/x" in text and "--new-run" in text
    forged = OtherRun("testrun-00000000", [], theirs.canonical(), 1)  # its config is not that run id
    assert save_run_config(forged, mine, tmp_path / "runs") is None


def _node(run, maddr: str, tmp: Path, name: str, **extra) -> Node:
    node = Node(NodeOptions(run=run, swarm="layer0", initial_peers=[maddr], data_dir=tmp / name,
                            train=False, control_socket=False, **extra))
    node.start()
    wait_until(lambda: node.snapshot().state == NodeState.ONLINE or node.wait_stopped(0), 60, what=f"{name}")
    return node


def test_a_changed_config_stops_with_the_active_runs_config_or_goes_alone_when_asked(tmp_path):
    theirs, _ = load_run(str(write_run(tmp_path / "a.yaml", optimizer="{lr: 0.001}")))
    mine, _ = load_run(str(write_run(tmp_path / "b.yaml", optimizer="{lr: 0.002}")))
    boot = start_dht(DHTSettings(), make_validators(None, [], None))
    nodes = []
    try:
        maddr = [str(m) for m in boot.get_visible_maddrs()][0]
        nodes.append(_node(theirs, maddr, tmp_path, "active"))
        assert nodes[-1].error is None, nodes[-1].error

        nodes.append(_node(mine, maddr, tmp_path, "changed"))
        changed = nodes[-1]
        assert changed.wait_stopped(30) and changed.error_exit_code == 2
        assert "Differences: optimizer.lr: ours 0.002, theirs 0.001" in changed.error
        saved = tmp_path / "changed" / "runs" / f"{theirs.run_id}.yaml"
        assert f"--run {saved}" in changed.error and load_run(str(saved))[0].run_id == theirs.run_id

        nodes.append(_node(mine, maddr, tmp_path, "alone", new_run=True))
        assert nodes[-1].error is None and nodes[-1].snapshot().state == NodeState.ONLINE
    finally:
        for node in nodes:
            node.request_stop()
            node.wait_stopped(30)
        shutdown_dht(boot)
