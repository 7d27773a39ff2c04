"""Identities that cost something (swarm/integrity/identity_work.py): the proof, its keeping, and readers that
ignore a record without it."""

from __future__ import annotations

import logging
import time

import pytest

from swarm.dht.membership import Membership
from swarm.dht.records import MemberRecord
from swarm.integrity import identity_work as iw
from swarm.run.runconfig import RunConfig

PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def test_found_work_proves_its_bits_for_its_peer_only():
    nonce = iw.find_work(PEER, 5)
    assert iw.has_work(PEER, nonce, 5)
    assert iw.zero_bits(iw.work_digest(PEER, nonce)) >= 5
    assert not iw.has_work(PEER[:-1] + "M", nonce, 5), "the work is bound to the peer id"
    assert all(iw.has_work(PEER, n, 0) for n in (-1, 0, 5)), "a run that asks for none takes any record"
    for bad in (-1, True, 2**63, "7", 1.0):
        assert not iw.has_work(PEER, bad, 1), bad


def test_the_first_nonce_found_is_the_first_that_proves_it():
    nonce = iw.find_work(PEER, 4)
    assert not any(iw.has_work(PEER, n, 4) for n in range(nonce))


def test_work_is_kept_next_to_the_identity_and_found_once(tmp_path, monkeypatch):
    identity = tmp_path / "identity-0.key"
    said: list[str] = []
    nonce = iw.identity_work(identity, PEER, 4, say=said.append)
    assert said and "identity's work (4 bits" in said[0]
    assert iw.work_path(identity).is_file()

    def no_hashing(*_args, **_kwargs):
        raise AssertionError("the kept work was not used")

    monkeypatch.setattr(iw, "find_work", no_hashing)
    assert iw.identity_work(identity, PEER, 4) == nonce
    assert iw.identity_work(identity, PEER, 2) == nonce, "work for more bits serves a run that asks for fewer"
    assert iw.load_work(identity, "QmSomeoneElse", 2) is None, "a kept nonce of another key is not ours"
    iw.work_path(identity).write_text("{not json")
    assert iw.load_work(identity, PEER, 2) is None


def test_finding_work_stops_when_asked():
    started = time.monotonic()
    assert iw.find_work(PEER, 20, should_stop=lambda: True) is None
    assert time.monotonic() - started < 5


def _record(peer: str, work: int) -> MemberRecord:
    return MemberRecord(peer_id=peer, state="online", version="t", started_at=0.0, updated_at=1.0, work=work)


def test_a_reader_ignores_records_without_the_runs_work_and_says_so_once(caplog):
    run = RunConfig.model_validate({"name": "work", "integrity": {"identity_bits": 6}})
    membership = Membership(None, run, b"")
    proven = _record(PEER, iw.find_work(PEER, 6))
    free = _record("QmFreeKey1", -1)
    wrong = _record("QmFreeKey2", proven.work)  # someone else's nonce proves nothing for this id
    assert not iw.has_work(wrong.peer_id, wrong.work, 6)
    with caplog.at_level(logging.WARNING):
        assert membership.proven([proven, free, wrong]) == [proven]
        assert membership.proven([free]) == []
    said = [r.message for r in caplog.records if "identity work" in r.message]
    assert len(said) == 2 and "FreeKey1"[-8:] in said[0], said
    nothing_asked = RunConfig.model_validate({"name": "work", "integrity": {"identity_bits": 0}})
    assert Membership(None, nothing_asked, b"").proven([free]) == [free]


def test_the_record_field_is_optional():
    from swarm.dht.records import OPTIONAL_FIELDS

    # a record of a client before the field parses with -1 (bad values: tests/test_records.py)
    assert "work" in OPTIONAL_FIELDS and _record(PEER, -1).to_wire()["work"] == -1


def test_a_verdict_costs_one_evaluation_per_peer_and_nonce(monkeypatch):
    nonce = iw.find_work(PEER, 3)
    calls = []
    real = iw.work_digest
    monkeypatch.setattr(iw, "work_digest", lambda *a: calls.append(a) or real(*a))
    iw._verified.clear()
    for _ in range(5):
        assert iw.has_work(PEER, nonce, 3) and not iw.has_work("QmFreeKey3", nonce + 1, 3)
    assert len(calls) == 2


def test_the_run_config_bounds_the_bits_and_the_default_asks_for_about_a_second():
    assert RunConfig(name="x").integrity.identity_bits == 8
    with pytest.raises(ValueError, match="identity_bits"):
        RunConfig.model_validate({"name": "x", "integrity": {"identity_bits": 21}})


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_stranger_cannot_make_a_reader_evaluate_forever(monkeypatch):
    """A junk nonce costs its author nothing and a reader one evaluation: a peer is evaluated once per hold
    whatever nonces it shows meanwhile, and one read evaluates for at most its budget."""
    clock = _Clock()
    checks = iw.WorkChecks(3, budget_s=1.0, hold_s=60.0, clock=clock)
    nonce = iw.find_work(PEER, 3)
    evaluated = []
    real = iw.work_digest
    monkeypatch.setattr(iw, "work_digest", lambda *a: evaluated.append(a) or real(*a))
    iw._verified.clear()
    honest = _record(PEER, nonce)
    for junk in range(20):  # the liar shows a new nonce at every read
        kept, refused = checks.keep([honest, _record("QmLiar", 10_000 + junk)])
        assert kept == [honest] and [r.peer_id for r in refused] == ["QmLiar"]
        clock.now += 1.0
    assert len(evaluated) == 2, "one evaluation each, not one per read"
    clock.now += 60.0
    checks.keep([_record("QmLiar", 99)])
    assert len(evaluated) == 3, "checked again after the hold"

    class SlowClock(_Clock):  # every evaluation takes 0.3 s: a budget of 1 s checks 4 records a read
        def __call__(self) -> float:
            self.now += 0.3
            return self.now

    slow = iw.WorkChecks(3, budget_s=1.0, clock=SlowClock())
    many = [_record(f"QmPeer{k}", 10_000 + k) for k in range(10)]  # nonces that cost an evaluation to refuse
    kept, refused = slow.keep(many)
    assert not kept and 0 < len(refused) < 10, "the rest wait for a later read, neither kept nor refused"
    _, refused_next = slow.keep(many)
    assert len(refused) + len(refused_next) > len(refused), "the next read goes on"


def test_a_record_without_work_costs_no_evaluation_and_does_not_hold_off_the_proven_one():
    """A volunteer stopped while proving its work (or an old client) shows no nonce: refused at once, and not held
    against its restart, whose proven record a minute's hold would have kept out."""
    clock = _Clock()
    checks = iw.WorkChecks(3, hold_s=60.0, clock=clock)
    nonce = iw.find_work(PEER, 3)
    assert checks.keep([_record(PEER, -1)]) == ([], [_record(PEER, -1)])
    clock.now += 1.0
    proven = _record(PEER, nonce)
    assert checks.keep([proven]) == ([proven], [])
