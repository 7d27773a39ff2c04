"""Membership records: only the owner can write its subkey, and readers skip bad entries."""

from __future__ import annotations

import logging
import time

import pytest

from swarm.dht import DHTSettings, ensure_identity, make_validators, shutdown_dht, start_dht
from swarm.membership import Membership, least_served_swarm
from swarm.records import MemberRecord, parse_member, parse_swarm, swarm_key
from swarm.runconfig import RunConfig

RUN = RunConfig.model_validate({"name": "rec", "model": {"stages": 2}})


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
            peers.append((dht, Membership(dht, RUN, validators[0].local_public_key)))
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

    from swarm.records import MemberRecord, peer_id_from_public_key

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    subkey = b"[owner:" + public + b"]"
    now = time.time()
    good = MemberRecord(peer_id=peer_id_from_public_key(public), state="online", version="t", started_at=now - 9,
                        updated_at=now, test_accuracy=0.9, eval_at=now - 3, eval_version=5, heals=1)
    assert parse_member(subkey, good.to_wire(), now) == good
    for bad in ({"eval_at": now + 3600}, {"eval_at": float("nan")}, {"heals": -1_000_000}):
        assert parse_member(subkey, {**good.to_wire(), **bad}, now) is None, bad


def test_a_peer_that_drives_nothing_reads_the_other_swarms_every_few_heartbeats():
    from swarm.membership import swarms_to_read

    names = ["layer0", "layer1", "layer2", "layer3"]
    server = [swarms_to_read(names, "layer2", False, beat, 5) for beat in range(10)]
    assert server[0] == server[5] == names  # every fifth heartbeat: the dashboard's swarm table and the run's end
    assert all(server[b] == ["layer2"] for b in (1, 2, 3, 4, 6, 7, 8, 9))  # its own swarm: partners, peers table
    assert all(swarms_to_read(names, "layer0", True, beat, 5) == names for beat in range(10))  # a driver routes
    assert swarms_to_read(names, "layer2", False, 3, 1) == names
    # per heartbeat, 8 volunteers (2 per swarm, 2 drivers) read 2 x 4 + 6 x (1 + 3/5) = 17.6 swarms, not 32
    per_beat = sum(len(swarms_to_read(names, own, own == "layer0", beat, 5)) for beat in range(5)
                   for own in names for _ in range(2)) / 5
    assert per_beat == pytest.approx(17.6)
