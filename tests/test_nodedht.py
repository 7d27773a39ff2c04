"""A volunteer's DHT node in its own process (swarm/dht/nodedht.py): it stores and reads signed records with the
run's validators, serves a stage's P2P replica, fails with advice, and leaves no p2pd behind."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from swarm.dht.dht import DHTSettings, DHTStartError, claim_identity, fresh_p2p, make_validators, shutdown_dht, start_dht  # noqa: E402
from swarm.dht.membership import Membership  # noqa: E402
from swarm.dht.nodedht import start_node_dht  # noqa: E402
from swarm.dht.records import MemberRecord  # noqa: E402
from swarm.run.runconfig import RunConfig  # noqa: E402


def _p2pd_children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if "p2pd" in p.name()}


def test_an_in_process_node_announces_reads_serves_a_replica_and_leaves_nothing(tmp_path):
    run = RunConfig.model_validate({"name": "nodedht"})
    boot = start_dht(DHTSettings(), make_validators(run.run_id, run.swarm_names, None))
    daemons_before = _p2pd_children()
    nodes = []
    try:
        maddr = [str(m) for m in boot.get_visible_maddrs()][0]
        for name in "abcdef":  # a record's replicas are remembered once num_replicas (5) other nodes exist
            identity, lock = claim_identity(None, tmp_path / name)
            validators = make_validators(run.run_id, run.swarm_names, identity)
            dht = start_node_dht(DHTSettings(initial_peers=[maddr], identity_path=identity), validators)
            nodes.append((dht, Membership(dht, run, validators[0].local_public_key), lock))
        (a, membership_a, _), (b, membership_b, _) = nodes[:2]
        assert len(_p2pd_children() - daemons_before) == len(nodes)  # one daemon per node, no DHT process
        assert str(a.peer_id) != str(b.peer_id) and a.get_visible_maddrs()
        now = time.time()
        record = MemberRecord(peer_id=str(a.peer_id), state="online", version="test", started_at=now, updated_at=now)
        assert membership_a.announce("layer1", record)
        seen = membership_b.read_all(["layer1"])["layer1"]
        assert [r.peer_id for r in seen] == [str(a.peer_id)]  # signed by a's identity key, checked by b
        # the next heartbeat's store goes straight to the replicas the first one found (RecordStores)
        assert a._stores._replicas
        later = MemberRecord(peer_id=str(a.peer_id), state="paused", version="test", started_at=now,
                             updated_at=now + 1)
        assert membership_a.announce("layer1", later)
        assert [r.state for r in membership_b.read_all(["layer1"])["layer1"]] == ["paused"]
        # replicas that leave are dropped, and with too few left the next store searches again
        for dht, _, _ in nodes[3:]:
            shutdown_dht(dht)
        latest = MemberRecord(peer_id=str(a.peer_id), state="online", version="test", started_at=now,
                              updated_at=now + 2)
        assert membership_a.announce("layer1", latest)
        assert [r.updated_at for r in membership_b.read_all(["layer1"])["layer1"]] == [now + 2]

        async def replica_id() -> str:  # what a stage does on its own loop
            p2p = await fresh_p2p(a)
            try:
                return str(p2p.peer_id)
            finally:
                await p2p.shutdown()

        assert asyncio.run(replica_id()) == str(a.peer_id)
    finally:
        for dht, _, lock in nodes:
            shutdown_dht(dht)
            lock.release()
        shutdown_dht(boot)
    assert all(not dht.is_alive() for dht, _, _ in nodes)
    deadline = time.monotonic() + 10
    while _p2pd_children() - daemons_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _p2pd_children() - daemons_before


def test_a_bootstrap_peer_that_is_not_there_fails_with_advice(tmp_path):
    dead = "/ip4/127.0.0.1/tcp/9/p2p/QmaCpDMGvV2BGHeYERUEnRQAwe3N8SzbUtfsmvsqQLuvuJ"
    settings = DHTSettings(initial_peers=[dead], start_timeout_s=30)
    with pytest.raises(DHTStartError, match="bootstrap"):
        start_node_dht(settings, make_validators(None, [], None))
