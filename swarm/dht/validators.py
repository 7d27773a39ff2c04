"""The DHT's record validators, with their verdicts remembered.

A DHT get with ``latest=True`` asks several nodes for a key and validates every copy of every subkey
they return: the same signed record is checked again and again, each time parsing the owner's RSA
key, verifying its signature and validating it against the schema. A profile of a volunteer's DHT
process (8 volunteers, 4 swarms, benchmarks/README.md) spent 31 % of its CPU in those validators.
A verdict depends only on the record's bytes (key, subkey, value, expiration time), so it is kept in a
bounded LRU and looked up first: rejections too, so a stranger replaying a bad record costs one check.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase

VERDICTS_KEPT = 4096  # ~1 KB records: a few MB at most
PLAIN_ENV = "VOLUNTEER_PLAIN_VALIDATORS"  # benchmarks only (benchmarks/dht_reads.py): "1" = hivemind's own classes


def validator_classes() -> tuple[type, type]:
    """The signature and schema validator classes a DHT of the run uses."""
    if os.environ.get(PLAIN_ENV) == "1":
        return RSASignatureValidator, SchemaValidator
    return RememberingSignatureValidator, RememberingSchemaValidator


class Verdicts:
    """A bounded LRU of validation results keyed by the record's bytes."""

    def __init__(self, size: int = VERDICTS_KEPT):
        self.size = size
        self._seen: OrderedDict[tuple, bool] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, record: DHTRecord) -> bool | None:
        key = (record.key, record.subkey, record.value, record.expiration_time)
        verdict = self._seen.get(key)
        if verdict is None:
            self.misses += 1
            return None
        self._seen.move_to_end(key)
        self.hits += 1
        return verdict

    def put(self, record: DHTRecord, verdict: bool) -> bool:
        self._seen[(record.key, record.subkey, record.value, record.expiration_time)] = verdict
        if len(self._seen) > self.size:
            self._seen.popitem(last=False)
        return verdict

    def clear(self) -> None:
        self._seen.clear()


class RememberingSignatureValidator(RSASignatureValidator):
    def __init__(self, private_key: Any = None):
        super().__init__(private_key)
        self.verdicts = Verdicts()

    def validate(self, record: DHTRecord) -> bool:
        known = self.verdicts.get(record)
        return known if known is not None else self.verdicts.put(record, super().validate(record))


class RememberingSchemaValidator(SchemaValidator):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.verdicts = Verdicts()

    def validate(self, record: DHTRecord) -> bool:
        known = self.verdicts.get(record)
        return known if known is not None else self.verdicts.put(record, super().validate(record))

    def merge_with(self, other: RecordValidatorBase) -> bool:
        merged = super().merge_with(other)
        if merged:
            self.verdicts.clear()  # the schema changed: earlier verdicts may not hold
        return merged
