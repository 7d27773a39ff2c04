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
from swarm.integrity.identity_work import identity_work  # noqa: E402
from swarm.run.runconfig import RunConfig  # noqa: E402


def _p2pd_children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if "p2pd" in p.name()}


def test_an_in_process_node_announces_reads_serves_a_replica_and_leaves_nothing(tmp_path):
    run = RunConfig.model_validate({"name": "nodedht", "integrity": {"identity_bits": 2}})
    boot = start_dht(DHTSettings(), make_validators(run.run_id, run.swarm_names, None))
    daemons_before = _p2pd_children()
    nodes = []
    try:
        maddr = [str(m) for m in boot.get_visible_maddrs()][0]
        for name in "abcdef":  # a record's replicas are remembered once num_replicas (5) other nodes exist
            identity, lock = claim_identity(None, tmp_path / name)
            validators = make_validators(run.run_id, run.swarm_names, identity)
            dht = start_node_dht(DHTSettings(initial_peers=[maddr], identity_path=identity), validators)
            membership = Membership(dht, run, validators[0].local_public_key)
            membership.work = identity_work(identity, str(dht.peer_id), run.integrity.identity_bits)
            nodes.append((dht, membership, lock))
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


class _FakeNode:
    """What Rejoin touches of a hivemind DHTNode: p2pd's peer list and connect, a ping, a lookup of our own id."""

    def __init__(self, connected: bool, answers: bool):
        from types import SimpleNamespace

        self.connected, self.answers = connected, answers
        self.dials, self.lookups = [], 0
        self.node_id, self.dht_id = "me", "dhtid"
        outer = self

        class _Client:
            async def connect(self, peer_id, addrs):
                outer.dials.append((peer_id, [str(a) for a in addrs]))
                if not outer.answers:
                    raise ConnectionError("refused")

        class _P2P:
            _client = _Client()

            async def list_peers(self):
                return [SimpleNamespace(peer_id=pid) for pid in outer.peer_ids] if outer.connected else []

        class _Protocol:
            async def call_ping(self, peer_id, validate, strict):
                return outer.dht_id if outer.answers else None

        self.p2p, self.protocol, self.peer_ids = _P2P(), _Protocol(), []

    async def find_nearest_nodes(self, ids):
        self.lookups += 1


def test_rejoin_redials_a_lost_bootstrap_peer_and_backs_off_when_it_keeps_finding_it_trimmed():
    """A restarted bootstrap peer is re-dialled at the address given (the last /p2p/ names it, even behind a
    relay) and the DHT is merged through it; found reachable but unconnected at every check (a connection manager
    trimming it), it is dialled ever less often, up to REJOIN_MAX_S; connected again, checked every REJOIN_S."""
    from swarm.dht.nodedht import REJOIN_MAX_S, REJOIN_S, Rejoin

    boot = "QmXYtkSsPxxWU6nw29W9XjqXuv1C33uDj9g5dDM3Qf8Q9F"
    relay = "QmeebRc6YBERAQGEv7NMYDoLaTqxLbV189pzhk15jFdrqB"
    node = _FakeNode(connected=False, answers=True)
    clock = [0.0]
    rejoin = Rejoin(node, [f"/ip4/10.0.0.1/tcp/31337/p2p/{boot}", f"/ip4/10.0.0.2/tcp/1/p2p/{relay}/p2p-circuit/p2p/{boot}"],
                    clock=lambda: clock[0])
    (peer_id,) = rejoin.peers
    assert peer_id.to_base58() == boot
    node.peer_ids = [peer_id]

    async def at(t):  # a check at time t of the checks' own clock
        clock[0] = t
        return await rejoin.check()

    async def scenario():
        assert await at(0.0) == 1 and node.lookups == 1
        assert node.dials[0][1] == ["/ip4/10.0.0.1/tcp/31337", f"/ip4/10.0.0.2/tcp/1/p2p/{relay}/p2p-circuit"]
        waits, last, t = [], 0.0, 0.0
        while t < 2000:  # trimmed at every check: the dials spread out
            t += 1.0
            if await at(t):
                waits.append(t - last)
                last = t
        assert waits[0] == 2 * REJOIN_S and max(waits) == REJOIN_MAX_S and waits == sorted(waits)
        node.connected = True  # connected again: nothing dialled, the short period back
        dials = len(node.dials)
        t += REJOIN_MAX_S
        assert await at(t) == 0 and len(node.dials) == dials
        node.connected, node.answers = False, False  # down: dialled every REJOIN_S, never counted
        assert await at(t + REJOIN_S) == 0 and len(node.dials) == dials + 1
        assert await at(t + 2 * REJOIN_S) == 0 and len(node.dials) == dials + 2

    asyncio.run(scenario())


def test_rejoin_merges_through_a_bootstrap_peer_that_restarted_while_p2pd_kept_it_connected():
    """p2pd re-dials a restarted bootstrap peer by itself, often before its DHT handlers are up: the link shows
    connected while that peer's DHT knows nobody (tests/test_foundation.py's restart failed 3 times in 13 so). A
    connected bootstrap peer is pinged; an answer with a new DHT id (a restart draws one) merges the DHT through it,
    with no dial; a ping its DHT does not answer yet is tried again at the next check."""
    from swarm.dht.nodedht import REJOIN_S, Rejoin

    boot = "QmXYtkSsPxxWU6nw29W9XjqXuv1C33uDj9g5dDM3Qf8Q9F"
    node = _FakeNode(connected=True, answers=True)
    clock = [0.0]
    rejoin = Rejoin(node, [f"/ip4/10.0.0.1/tcp/31337/p2p/{boot}"], clock=lambda: clock[0])
    node.peer_ids = list(rejoin.peers)

    async def at(t):
        clock[0] = t
        return await rejoin.check()

    async def scenario():
        assert await at(0.0) == 1 and node.lookups == 1, "the first answer: merged once"
        assert await at(REJOIN_S) == 0 and node.lookups == 1, "the same peer: nothing to do"
        node.answers = False  # restarted: p2pd connected again, its DHT not up yet
        assert await at(2 * REJOIN_S) == 0 and node.lookups == 1
        node.answers, node.dht_id = True, "another-dhtid"
        assert await at(3 * REJOIN_S) == 1 and node.lookups == 2, "a new DHT id: merged through it"
        assert await at(4 * REJOIN_S) == 0 and node.lookups == 2
        assert node.dials == [], "connected all along: nothing dialled"

    asyncio.run(scenario())

