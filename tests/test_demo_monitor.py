"""What `volunteer demo` prints while it watches (pure: volunteer_cli/commands/demo_monitor.py), and that its
volunteers run nicer than the monitor the user watches (a real child process)."""

from __future__ import annotations

import os
import signal

import pytest

from swarm.dht.records import MemberRecord
from volunteer_cli.commands.demo import CHILD_NICE, Children, Target
from volunteer_cli.commands.demo_monitor import Monitor, read_figures
from volunteer_cli.forkserver import Forked, available as forks_available

NAMES = ["layer0", "layer1"]


def _views(online: int, trained: int = 0, accuracy: float = -1.0, eval_at: float = -1.0) -> dict:
    def record(swarm: str, i: int) -> MemberRecord:
        return MemberRecord(peer_id=f"{swarm}-{i}", state="online", version="t", started_at=0.0, updated_at=1.0,
                            trained=trained if swarm == "layer0" and i == 0 else 0,
                            test_accuracy=accuracy if swarm == "layer0" else -1.0, eval_samples=trained,
                            eval_at=eval_at if swarm == "layer0" else -1.0)

    return {name: [record(name, i) for i in range(online if name == "layer0" else 4)] for name in NAMES}


def test_a_stall_counts_from_when_every_swarm_came_online_not_from_the_start():
    monitor = Monitor(NAMES, started=0.0)
    assert monitor.observe(read_figures(_views(0), NAMES), now=10.0, wall=10.0) == ["waiting for layer0 to come online"]
    lines = monitor.observe(read_figures(_views(4), NAMES), now=42.0, wall=42.0)
    assert lines[0] == "all swarms online after 42 s; training"
    assert "peers layer0:4 layer1:4" in lines[1]  # every online peer, not one per swarm
    assert not monitor.stall_notice_due(44.0)  # 2 s after training could start, not 44 s after the demo did
    monitor.observe(read_figures(_views(4), NAMES), now=50.0, wall=50.0)
    assert monitor.stall_notice_due(53.0) and round(monitor.stalled_s(53.0)) == 11
    monitor.observe(read_figures(_views(4, trained=320), NAMES), now=54.0, wall=54.0)
    assert not monitor.stall_notice_due(60.0)


def test_every_figure_that_may_be_stale_says_how_old_it_is():
    monitor = Monitor(NAMES, started=0.0)
    lines = monitor.observe(read_figures(_views(4, trained=640, accuracy=0.786, eval_at=88.0), NAMES),
                            now=100.0, wall=100.0)
    assert "test acc 78.6% (12 s ago)" in lines[-1]
    # the DHT did not answer for 9 s: the line says the figures are that old
    lines = monitor.observe(read_figures(_views(4, trained=640), NAMES), now=102.0, wall=102.0, read_age_s=9.0)
    assert lines[-1].endswith("(the DHT did not answer: figures read 9 s ago)")


def test_a_target_short_of_one_is_not_rounded_up_to_100_percent():
    assert str(Target("accuracy", 0.999)) == "99.9% test accuracy"
    assert str(Target("accuracy", 0.95)) == "95% test accuracy"


@pytest.mark.parametrize("way", ["forked", "execed"])
def test_the_volunteers_run_nicer_than_the_monitor(tmp_path, monkeypatch, way):
    """Forked from the demo's fork server (which runs CHILD_NICE nicer) or exec'ed with the hook (no fork server)."""
    if way == "execed":
        monkeypatch.setenv("VOLUNTEER_DEMO_EXEC", "1")
    children = Children(tmp_path)
    assert (children.forks is not None) == (way == "forked" and forks_available())
    proc = children.start("probe", ["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--identity",
                                    str(tmp_path / "probe.key")])  # a child that stays until stopped
    assert isinstance(proc, Forked) == (children.forks is not None)  # not an exec that fell back unnoticed
    try:
        nice = os.getpriority(os.PRIO_PROCESS, proc.pid)
        assert nice >= os.getpriority(os.PRIO_PROCESS, 0) + CHILD_NICE
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        if children.forks is not None:
            children.forks.close()


def test_the_bootstrap_address_is_read_past_the_log_lines_before_it():
    """`volunteer demo -vv` stopped with "the bootstrap peer printed something unexpected" at hivemind's first debug
    line (session 27): the bootstrap peer's stdout and stderr share its log, and its JSON line comes after them."""
    from types import SimpleNamespace

    from volunteer_cli.commands.demo import _bootstrap_address
    from volunteer_cli.main import UserError

    def address(text: str) -> str:
        children = SimpleNamespace(log=lambda name: text)
        proc = SimpleNamespace(poll=lambda: None)
        return _bootstrap_address(children, proc, SimpleNamespace(event=SimpleNamespace(is_set=lambda: False)))

    debug = "Nov 30 10:58:55.914 [DEBUG] [hivemind.utils.mpfuture] Initializing MPFuture backend for pid 4108\n"
    json_line = '{"maddrs": ["/ip4/127.0.0.1/tcp/1/p2p/QmX"], "peer_id": "QmX"}\n'
    assert address(debug + json_line) == "/ip4/127.0.0.1/tcp/1/p2p/QmX"
    assert address(json_line + debug) == "/ip4/127.0.0.1/tcp/1/p2p/QmX"
    with pytest.raises(UserError, match="unexpected"):
        address(debug + '{"no maddrs": 1}\n')
