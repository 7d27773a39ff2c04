"""The DHT's validators remember their verdicts (swarm/dht/validators.py): the same signed record returned by
several nodes, heartbeat after heartbeat, is checked once; a changed byte is checked again."""

from __future__ import annotations

import dataclasses

from hivemind.dht.validation import CompositeValidator, DHTRecord

from swarm.dht.dht import make_validators


def _signed(validators, value: bytes, expiration: float = 1e10) -> DHTRecord:
    composite = CompositeValidator(validators)
    owner = validators[0].local_public_key
    record = DHTRecord(key=b"run-1_layer0", subkey=owner, value=value, expiration_time=expiration)
    return dataclasses.replace(record, value=composite.sign_value(record)), composite


def test_a_verdict_is_remembered_and_a_changed_record_is_checked_again(monkeypatch):
    from hivemind.dht.crypto import RSASignatureValidator

    validators = make_validators(None, ["layer0"], None)
    record, composite = _signed(validators, b"\x81\xa1a\x01")
    checks = []
    real = RSASignatureValidator.validate
    monkeypatch.setattr(RSASignatureValidator, "validate", lambda self, r: checks.append(r) or real(self, r))
    assert all(composite.validate(record) for _ in range(5))
    assert len(checks) == 1 and validators[0].verdicts.hits == 4
    forged = dataclasses.replace(record, value=record.value.replace(b"\x01", b"\x02", 1))
    assert not composite.validate(forged) and not composite.validate(forged)  # a rejection is remembered too
    assert len(checks) == 2
    later = dataclasses.replace(record, expiration_time=record.expiration_time + 1)  # the signature covers it
    assert not composite.validate(later)


def test_the_memory_is_bounded():
    from swarm.dht.validators import Verdicts

    verdicts = Verdicts(size=3)
    records = [DHTRecord(key=b"k", subkey=bytes([i]), value=b"v", expiration_time=1.0) for i in range(5)]
    for r in records:
        verdicts.put(r, True)
    assert verdicts.get(records[0]) is None and verdicts.get(records[4]) is True
