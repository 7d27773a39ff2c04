"""Membership records: only the owner can write its subkey, and readers skip bad entries."""

from __future__ import annotations

import logging
import time

import pytest

from swarm.dht.dht import DHTSettings, ensure_identity, make_validators, shutdown_dht, start_dht
from swarm.dht.membership import Membership, least_served_swarm
from swarm.dht.records import MemberRecord, parse_member, parse_swarm, swarm_key
from swarm.integrity.identity_work import identity_work
from swarm.run.runconfig import RunConfig

RUN = RunConfig.model_validate({"name": "rec", "model": {"stages": 2}, "integrity": {"identity_bits": 2}})


def _record(peer_id: str, **changes) -> MemberRecord:
    now = time.time()
    fields = dict(peer_id=peer_id, state="online", version="t", started_at=now, updated_at=now)
    fields.update(changes)
    return MemberRecord(**fields)


@pytest.fixture
def two_peers(tmp_path):
    dhts = []
    try:
        peers = []
        for name in ("a", "b"):
            identity = tmp_path / f"{name}.key"
            ensure_identity(identity)
            validators = make_validators(RUN.run_id, RUN.swarm_names, identity)
            initial = [str(m) for m in dhts[0].get_visible_maddrs()] if dhts else []
            dht = start_dht(DHTSettings(initial_peers=initial, identity_path=identity), validators)
            dhts.append(dht)
            membership = Membership(dht, RUN, validators[0].local_public_key)
            membership.work = identity_work(identity, str(dht.peer_id), RUN.integrity.identity_bits)
            peers.append((dht, membership))
        yield peers
    finally:
        for dht in dhts:
            shutdown_dht(dht)


def test_forged_record_for_another_peers_subkey_is_rejected(two_peers, caplog):
    (dht_a, member_a), (dht_b, member_b) = two_peers
    a_id, b_id = str(dht_a.peer_id), str(dht_b.peer_id)
    assert member_a.announce("layer0", _record(a_id, loss=1.0))

    # B writes into A's subkey: it cannot sign for A's key, so every node refuses the value.
    forged = _record(a_id, state="offline", loss=0.0)
    stored = dht_b.store(swarm_key(RUN.run_id, "layer0"), subkey=member_a.owner_subkey, value=forged.to_wire(),
                         expiration_time=time.time() + 30)
    assert stored is False
    # B announces with its own key but claims A's peer id: the reader sees the key mismatch.
    assert member_b.announce("layer0", _record(a_id, loss=0.0))
    with caplog.at_level(logging.WARNING):
        records = member_a.read("layer0")
    assert [(r.peer_id, r.state, r.loss) for r in records] == [(a_id, "online", 1.0)]
    assert "signing key does not own" in caplog.text
    # And a value that breaks the schema is refused outright.
    bad = dict(_record(b_id).to_wire(), clock="many")
    assert dht_b.store(swarm_key(RUN.run_id, "layer0"), subkey=member_b.owner_subkey, value=bad,
                       expiration_time=time.time() + 30) is False


def test_parser_skips_garbage_without_crashing(caplog):
    now = time.time()
    entries = {b"no-owner": {"peer_id": "x"}, b"[owner:junk]": "not a dict", 7: None, b"[owner:x]": {"state": 1}}
    with caplog.at_level(logging.WARNING):
        assert parse_swarm(entries, now) == []
    assert parse_member(b"[owner:junk]", {"peer_id": "Qm"}, now) is None
    assert caplog.text.count("skipping a bad membership record") >= 4


def test_auto_swarm_is_least_served_with_ties_to_lowest():
    names = ["layer0", "layer1", "layer2"]
    views = {"layer0": [_record("p1"), _record("p2")], "layer1": [_record("p3")],
             "layer2": [_record("p4"), _record("p5", state="offline")]}
    assert least_served_swarm(views, names) == "layer1"
    assert least_served_swarm({}, names) == "layer0"
    views["layer1"].append(_record("p6"))
    assert least_served_swarm(views, names) == "layer2"
    # a newcomer still downloading counts: the next newcomer goes elsewhere
    views["layer2"].append(_record("p7", state="syncing"))
    assert least_served_swarm(views, names) == "layer0"


def test_an_evaluation_from_the_future_or_negative_heals_are_skipped():
    """A stranger's record must not make its evaluation the run's newest forever (status picks by time)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    from swarm.dht.records import MemberRecord, peer_id_from_public_key

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    subkey = b"[owner:" + public + b"]"
    now = time.time()
    good = MemberRecord(peer_id=peer_id_from_public_key(public), state="online", version="t", started_at=now - 9,
                        updated_at=now, test_accuracy=0.9, eval_at=now - 3, eval_version=5, heals=1)
    assert parse_member(subkey, good.to_wire(), now) == good
    for bad in ({"eval_at": now + 3600}, {"eval_at": float("nan")}, {"heals": -1_000_000},
                {"work": -2}, {"work": 2**63}, {"work": True}):
        assert parse_member(subkey, {**good.to_wire(), **bad}, now) is None, bad


def _reads(own: str, drives: bool, sizes: dict[str, int], beats: int, others_every: int = 5) -> list[list[str]]:
    """The swarms each of ``beats`` heartbeats reads, every swarm having ``sizes[name]`` peers."""
    from swarm.dht.membership import ReadSchedule

    schedule, out = ReadSchedule(), []
    for _ in range(beats):
        names = schedule.due(list(sizes), own, drives, others_every)
        out.append(names)
        schedule.done({name: [object()] * sizes[name] for name in names})
    return out


def test_a_peer_that_drives_nothing_reads_the_other_swarms_every_few_heartbeats():
    names = ["layer0", "layer1", "layer2", "layer3"]
    small = dict.fromkeys(names, 2)
    server = _reads("layer2", False, small, 10)
    assert server[0] == server[5] == names  # every fifth heartbeat: the dashboard's swarm table and the run's end
    assert all(server[b] == ["layer2"] for b in (1, 2, 3, 4, 6, 7, 8, 9))  # its own swarm: partners, peers table
    assert all(beat == names for beat in _reads("layer0", True, small, 10))  # a driver routes through all
    assert all(beat == names for beat in _reads("layer2", False, small, 4, others_every=1))
    # per heartbeat, 8 volunteers (2 per swarm, 2 drivers) read 2 x 4 + 6 x (1 + 3/5) = 17.6 swarms, not 32
    per_beat = sum(len(beat) for own in names for _ in range(2) for beat in _reads(own, own == "layer0", small, 5)) / 5
    assert per_beat == pytest.approx(17.6)


def test_a_large_swarm_is_read_less_often_so_that_the_records_read_per_heartbeat_stay_flat():
    from swarm.dht.membership import MAX_READ_PERIOD_BEATS, READ_RECORDS_PER_BEAT

    names = ["layer0", "layer1", "layer2", "layer3"]
    beats = 3200  # long enough that the first read (every swarm, at join) does not count
    per_beat = {}
    for size in (1, 2, 4, 16, 48, 256):
        sizes = dict.fromkeys(names, size)
        records = 0
        for own, drives in (("layer0", True), ("layer2", False)):
            records += sum(sum(sizes[n] for n in beat) for beat in _reads(own, drives, sizes, beats))
        per_beat[size] = records / beats / 2
    assert per_beat[2] == pytest.approx((8 + 2 * (1 + 3 / 5)) / 2, rel=0.05)  # as before: small runs read all
    # a driver reads each swarm's records about READ_RECORDS_PER_BEAT per heartbeat, a server about one swarm's worth
    assert max(v for size, v in per_beat.items() if size <= 48) <= (4 + 1 + 3 / 5) * READ_RECORDS_PER_BEAT / 2 * 1.05
    assert per_beat[48] <= per_beat[4] * 1.05  # flat: 12 times the peers, no more records per heartbeat
    # past 48 peers a swarm is still read once a minute (a staler view would mislead): the cost grows again
    assert per_beat[256] == pytest.approx(per_beat[48] * 256 / 48, rel=0.05)
    read_at = [i for i, beat in enumerate(_reads("layer1", False, dict.fromkeys(names, 1000), 100)) if "layer1" in beat]
    assert {b - a for a, b in zip(read_at, read_at[1:])} == {MAX_READ_PERIOD_BEATS}
    # a driver's view of a swarm of 16 is at most 4 heartbeats old; its own swarm's too
    reads = _reads("layer0", True, dict.fromkeys(names, 16), 12)
    assert [b for b, beat in enumerate(reads) if "layer3" in beat] == [0, 4, 8]


def test_a_swarm_with_a_peer_on_its_way_in_is_read_every_heartbeat_until_it_is_in():
    """Session 10: a server's dashboard showed the other swarms' new peers as "0/1" online, and the wrong swarm as
    the bottleneck, for ~30 s while it already trained through them (other swarms are read every 5th heartbeat)."""
    from types import SimpleNamespace

    from swarm.dht.membership import ReadSchedule

    names = ["layer0", "layer1", "layer2"]
    schedule = ReadSchedule()
    joining, online = SimpleNamespace(state="joining"), SimpleNamespace(state="online")
    schedule.done({"layer0": [joining], "layer1": [online], "layer2": [online]})
    assert schedule.due(names, "layer1", False, 5) == ["layer0", "layer1"], "layer0's newcomer: read again at once"
    schedule.done({"layer0": [SimpleNamespace(state="syncing")], "layer1": [online]})
    assert schedule.due(names, "layer1", False, 5) == ["layer0", "layer1"]
    schedule.done({"layer0": [online], "layer1": [online]})
    assert schedule.due(names, "layer1", False, 5) == ["layer1"], "in: back to every fifth heartbeat"


def test_a_swarm_found_empty_is_read_again_at_the_next_heartbeat_until_it_has_peers():
    """A server that started before the other swarms' peers read them empty: it reads them again at once (an empty
    read costs no records) instead of showing them "0/0" for five heartbeats while it trains through them, and
    again while their peers have served nothing (their figures are a heartbeat away); a swarm empty for good is
    read at the ordinary rate after ARRIVING_MAX_READS reads."""
    from types import SimpleNamespace

    from swarm.dht.membership import ARRIVING_MAX_READS, ReadSchedule

    names = ["layer0", "layer1", "layer2"]
    schedule = ReadSchedule()
    online = SimpleNamespace(state="online")
    schedule.done({"layer0": [], "layer1": [online], "layer2": []})
    assert schedule.due(names, "layer1", False, 5) == names
    schedule.done({"layer0": [SimpleNamespace(state="online", served=0)], "layer1": [online], "layer2": []})
    assert schedule.due(names, "layer1", False, 5) == names, "layer0's peer has served nothing yet: its figures come"
    started = SimpleNamespace(state="online", served=3, started_at=100.0, updated_at=110.0)
    schedule.done({"layer0": [started], "layer1": [online], "layer2": []})
    assert schedule.due(names, "layer1", False, 5) == names, "started 10 s ago: its figures still climb"
    schedule.done({"layer0": [SimpleNamespace(state="online", served=30, started_at=100.0, updated_at=130.0)],
                   "layer1": [online], "layer2": []})
    assert schedule.due(names, "layer1", False, 5) == ["layer1", "layer2"], "layer0 has a peer: every fifth again"
    for _ in range(ARRIVING_MAX_READS - 3):  # layer2 found empty read after read
        schedule.done({"layer1": [online], "layer2": []})
    assert "layer2" not in schedule.due(names, "layer1", False, 5), "empty for good: the ordinary rate again"


def test_a_record_that_says_joining_forever_does_not_keep_every_server_reading_its_swarm():
    """Anyone can publish a record; one stuck at "joining" boosts its swarm's reads for ARRIVING_MAX_READS reads in
    a row, then the swarm is read at the ordinary rate again."""
    from types import SimpleNamespace

    from swarm.dht.membership import ARRIVING_MAX_READS, ReadSchedule

    names = ["layer0", "layer1"]
    schedule = ReadSchedule()
    stuck = [SimpleNamespace(state="joining")]
    reads = 0
    for _ in range(ARRIVING_MAX_READS + 20):
        due = schedule.due(names, "layer1", False, 5)
        reads += "layer0" in due
        schedule.done({name: stuck if name == "layer0" else [] for name in due})
    assert reads <= ARRIVING_MAX_READS + 1 + 20 // 5, reads


def test_a_failed_read_is_retried_at_the_next_heartbeat():
    from swarm.dht.membership import ReadSchedule

    schedule = ReadSchedule()
    schedule.done({"layer1": [object()] * 16})
    schedule.done({})
    assert schedule.due(["layer1"], "layer1", False, 5) == []  # 16 peers: read again 4 heartbeats later
    schedule.done({"layer1": []})  # ... unless the read came back empty (failed, or the swarm emptied)
    assert schedule.due(["layer1"], "layer1", False, 5) == ["layer1"]


def test_a_driver_counts_reads_of_layer0_not_heartbeats_when_it_decides_a_shard_is_unheld():
    from swarm.pipeline.peer import HELD_MEMORY_VIEWS, HeldShards
    from swarm.dht.records import MemberRecord

    holder = MemberRecord(peer_id="holder", state="online", version="v", started_at=1.0, updated_at=2.0, shard=1)
    held = HeldShards()
    held.note([holder], me="me")
    held.note([], me="me")  # a read that missed the holder's record (a loaded machine)
    for _ in range(2 * HELD_MEMORY_VIEWS):  # ... kept for heartbeats until layer0's next read
        held.note([], me="me", fresh=False)
    assert held.unheld(3) == [0, 2]  # one missed read is not "nobody holds shard 1"
    for _ in range(HELD_MEMORY_VIEWS - 1):
        held.note([], me="me")
    assert held.unheld(3) == [0, 1, 2]  # HELD_MEMORY_VIEWS reads in a row without it: shard 1 is free
