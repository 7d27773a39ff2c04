"""Membership records: one DHT key per swarm, one signed subkey per peer.

Key:     ``{run_id}_layer{k}``  (hivemind's SchemaValidator names keys ``{prefix}_{field}``)
Subkey:  ``b"[owner:<ssh-rsa public key>]"``; RSASignatureValidator makes only the holder of the
         private key able to write it. That key is the peer's libp2p identity key, so the peer id
         is *derived* from the subkey: a record cannot claim another peer's id.
Value:   a dict with every field of ``MemberRecord`` (msgpack), checked by a strict pydantic schema
         on every DHT node, and checked again (peer id, ranges) by ``parse_swarm`` on the reader,
         which skips a bad entry with a warning instead of failing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
from dataclasses import dataclass
from typing import Any, Dict, Optional

import pydantic.v1 as pydantic_v1

logger = logging.getLogger(__name__)

STATES = ("joining", "syncing", "online", "paused", "finishing", "healing", "offline")
ROUTABLE_STATES = frozenset({"online"})
OWNER_PREFIX = b"[owner:"
MAX_VERSION_CHARS = 64
# newer than some clients: a record without them parses with the defaults
OPTIONAL_FIELDS = frozenset({"staleness_mean", "staleness_p95", "staleness_max", "mbps_in", "mbps_out", "capacity",
                             "movable", "reachable", "stalled_s", "drivers_refused", "drivers_seen", "ban_reason",
                             "work"})
ONLINE_WITHIN_MIN_S = 10.0
ONLINE_WITHIN_HEARTBEATS = 3.0  # a record whose heartbeat is older than this many heartbeats is offline, whatever
# its DHT lifetime says (a record stored with a long expiration outlives its peer)
MAX_BAN_REASON_CHARS = 160
MAX_DRIVERS = 10**6
MAX_CAPACITY = 1e9  # samples/s: a figure above this is a lie or a bug


@dataclass(slots=True, frozen=True)
class MemberRecord:
    """What a peer says about itself. Every field is always present on the wire."""

    peer_id: str
    state: str
    version: str
    started_at: float  # DHT time the node started
    updated_at: float  # DHT time of this heartbeat
    throughput: float = 0.0  # samples/s through this peer, measured
    loss: float = -1.0  # loss EMA of micro-batches through it; -1 = none yet
    clock: int = 0  # samples trained into this copy
    param_version: int = 0  # optimizer steps applied to this copy
    shard: int = -1  # data shard (layer0 only); -1 = none
    served: int = 0  # micro-batches served
    test_accuracy: float = -1.0  # last pipeline evaluation published by this peer (layer0); -1 = none
    test_loss: float = -1.0
    eval_samples: int = 0  # run-wide samples trained when that evaluation ran
    trained: int = 0  # layer0: samples of this driver's micro-batches that completed everywhere
    lost: int = 0  # layer0: micro-batches this driver gave up
    eval_at: float = -1.0  # wall time of that evaluation; -1 = none (a reader shows its age)
    eval_version: int = -1  # param_version of this peer's copy when it evaluated; -1 = none
    heals: int = 0  # times this copy was found sick and restored itself (swarm/integrity/heal.py)
    # staleness of this copy's recent updates, in updates (swarm/pipeline/stage/staleness.py); -1 = none yet. Records of
    # clients before these fields parse with the defaults.
    staleness_mean: float = -1.0
    staleness_p95: float = -1.0
    staleness_max: int = -1
    # this peer's traffic over its last heartbeat, Mb/s (swarm/pipeline/transport/traffic.py); -1 = not published
    mbps_in: float = -1.0
    mbps_out: float = -1.0
    # samples/s this copy could train at if it computed all the time (swarm/pipeline/stage/worker.py StageStats.capacity);
    # -1 = not measured yet. movable: a `--swarm auto` volunteer that rebalancing may move (swarm/rebalance.py)
    capacity: float = -1.0
    movable: bool = False
    # can other hosts dial this peer (swarm/dht/reachability.py): 1 yes, 0 no (behind NAT: nobody routes to it,
    # pulls from it or pairs with it), -1 not known (not checked yet, or a client before the field)
    reachable: int = -1
    # seconds this peer wanted to train and completed no micro-batch (layer0: none trained everywhere; other
    # stages: none served); 0 while work flows, -1 = not published (not online, or a client before the field)
    stalled_s: float = -1.0
    # the run's online drivers this stage refuses right now (banned in its StageGate.book), of the drivers it
    # knows; -1 = not published. ban_reason: the last ban's reason ("" when none)
    drivers_refused: int = -1
    drivers_seen: int = -1
    ban_reason: str = ""
    # the proof of work of this peer id (swarm/integrity/identity_work.py); -1 = none (a client before the field).
    # Readers of a run that asks for identity work ignore a record without enough (swarm/dht/membership.py)
    work: int = -1

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def loss_or_none(self) -> float | None:
        return None if self.loss < 0 else self.loss

    @property
    def shard_or_none(self) -> int | None:
        return None if self.shard < 0 else self.shard

    @property
    def staleness_or_none(self) -> tuple[float, float, int] | None:
        """(mean, p95, max) of this copy's recent staleness, or None when it has none to report."""
        if min(self.staleness_mean, self.staleness_p95, self.staleness_max) < 0:
            return None
        return self.staleness_mean, self.staleness_p95, self.staleness_max


class _MemberValueSchema(pydantic_v1.BaseModel):
    """Strict types: SchemaValidator rejects any record that would need a conversion."""

    peer_id: pydantic_v1.StrictStr
    state: pydantic_v1.StrictStr
    version: pydantic_v1.StrictStr
    started_at: pydantic_v1.StrictFloat
    updated_at: pydantic_v1.StrictFloat
    throughput: pydantic_v1.StrictFloat
    loss: pydantic_v1.StrictFloat
    clock: pydantic_v1.StrictInt
    param_version: pydantic_v1.StrictInt
    shard: pydantic_v1.StrictInt
    served: pydantic_v1.StrictInt
    test_accuracy: pydantic_v1.StrictFloat
    test_loss: pydantic_v1.StrictFloat
    eval_samples: pydantic_v1.StrictInt
    trained: pydantic_v1.StrictInt
    lost: pydantic_v1.StrictInt
    eval_at: pydantic_v1.StrictFloat
    eval_version: pydantic_v1.StrictInt
    heals: pydantic_v1.StrictInt
    # optional: records of clients before the staleness fields are still valid on this node
    staleness_mean: Optional[pydantic_v1.StrictFloat] = None
    staleness_p95: Optional[pydantic_v1.StrictFloat] = None
    staleness_max: Optional[pydantic_v1.StrictInt] = None
    mbps_in: Optional[pydantic_v1.StrictFloat] = None
    mbps_out: Optional[pydantic_v1.StrictFloat] = None
    capacity: Optional[pydantic_v1.StrictFloat] = None
    movable: Optional[pydantic_v1.StrictBool] = None
    reachable: Optional[pydantic_v1.StrictInt] = None
    stalled_s: Optional[pydantic_v1.StrictFloat] = None
    drivers_refused: Optional[pydantic_v1.StrictInt] = None
    drivers_seen: Optional[pydantic_v1.StrictInt] = None
    ban_reason: Optional[pydantic_v1.constr(strict=True, max_length=MAX_BAN_REASON_CHARS)] = None  # type: ignore[valid-type]
    work: Optional[pydantic_v1.StrictInt] = None

    class Config:
        extra = pydantic_v1.Extra.forbid


def membership_schema(swarm_names: list[str]) -> type[pydantic_v1.BaseModel]:
    """A pydantic (v1) model with one field per swarm, for hivemind's SchemaValidator."""
    from hivemind.dht.schema import BytesWithPublicKey

    fields = {name: (Optional[Dict[BytesWithPublicKey, _MemberValueSchema]], None) for name in swarm_names}
    return pydantic_v1.create_model("MembershipSchema", **fields)  # type: ignore[call-overload]


def dialable(records: list[MemberRecord], me: str = "") -> list[MemberRecord]:
    """The records of peers other hosts can dial (not ``reachable: 0``, behind NAT), and ``me``'s own:
    whom routing, pulls, downloads and exports may dial (swarm/dht/reachability.py)."""
    return [r for r in records if r.reachable != 0 or r.peer_id == me]


def swarm_key(run_id: str, swarm: str) -> str:
    return f"{run_id}_{swarm}"


# ----- peer id <-> public key


def peer_id_from_public_key(ssh_public_key: bytes) -> str:
    """The libp2p peer id of an RSA key given in OpenSSH form (the form hivemind puts in subkeys)."""
    import multihash
    from cryptography.hazmat.primitives import serialization
    from hivemind.proto import crypto_pb2
    from hivemind.p2p.p2p_daemon_bindings.datastructures import PeerID

    key = serialization.load_ssh_public_key(ssh_public_key)
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


def public_key_of_subkey(subkey: Any) -> bytes | None:
    if not isinstance(subkey, bytes) or not subkey.startswith(OWNER_PREFIX) or not subkey.endswith(b"]"):
        return None
    return subkey[len(OWNER_PREFIX) : -1]


# ----- reading


def parse_member(subkey: Any, value: Any, now: float) -> MemberRecord | None:
    """One record from the DHT, or None (with a warning) if anything about it is wrong."""
    try:
        if not isinstance(value, dict):
            raise ValueError(f"value is a {type(value).__name__}, not a mapping")
        known = {f.name for f in dataclasses.fields(MemberRecord)}
        record = MemberRecord(**{k: v for k, v in value.items()
                                 if k in known and not (v is None and k in OPTIONAL_FIELDS)})
        public_key = public_key_of_subkey(subkey)
        if public_key is None:
            raise ValueError("subkey carries no owner key")
        if peer_id_from_public_key(public_key) != record.peer_id:
            raise ValueError(f"record claims peer id {record.peer_id[-8:]} that its signing key does not own")
        if record.state not in STATES:
            raise ValueError(f"unknown state {record.state!r}")
        for name in ("throughput", "updated_at", "started_at"):
            number = getattr(record, name)
            if not isinstance(number, (int, float)) or not math.isfinite(number) or number < 0:
                raise ValueError(f"{name} is not a finite non-negative number")
        if len(record.version) > MAX_VERSION_CHARS:
            raise ValueError("version string too long")
        if record.updated_at > now + 60:
            raise ValueError("heartbeat from the future")
        # An evaluation cannot be newer than the heartbeat that publishes it: a future eval_at would make a
        # stranger's figure the run's "newest" and never stale (status picks evaluations by their time).
        if not math.isfinite(record.eval_at) or record.eval_at > record.updated_at:
            raise ValueError("evaluation time after the heartbeat that publishes it")
        if record.heals < 0 or record.eval_version < -1:
            raise ValueError("negative heals or evaluation version")
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= -1 for v in
                   (record.staleness_mean, record.staleness_p95, record.staleness_max)):
            raise ValueError("staleness figures must be finite numbers, -1 for none")
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and -1 <= v < 1e6
                   for v in (record.mbps_in, record.mbps_out)):
            raise ValueError("traffic figures must be finite Mb/s below 10^6, -1 for none")
        if not (isinstance(record.capacity, (int, float)) and math.isfinite(record.capacity)
                and (record.capacity == -1 or 0 < record.capacity < MAX_CAPACITY)):
            raise ValueError("capacity must be finite samples/s above 0 and below 10^9, -1 for none")
        if not isinstance(record.movable, bool):
            raise ValueError("movable must be true or false")
        if isinstance(record.reachable, bool) or record.reachable not in (-1, 0, 1):
            raise ValueError("reachable must be 1, 0 or -1")
        if not (isinstance(record.stalled_s, (int, float)) and math.isfinite(record.stalled_s)
                and -1 <= record.stalled_s < 1e9):
            raise ValueError("stalled_s must be finite seconds, -1 for none")
        counts = (record.drivers_refused, record.drivers_seen)
        if not all(isinstance(v, int) and not isinstance(v, bool) and -1 <= v <= MAX_DRIVERS for v in counts):
            raise ValueError("driver counts must be integers from -1 to 10^6")
        if not isinstance(record.ban_reason, str) or len(record.ban_reason) > MAX_BAN_REASON_CHARS:
            raise ValueError(f"ban_reason must be text of at most {MAX_BAN_REASON_CHARS} characters")
        if isinstance(record.work, bool) or not isinstance(record.work, int) or not -1 <= record.work < 2**63:
            raise ValueError("work must be an integer from -1 to 2^63 - 1")
        return record
    except (TypeError, ValueError) as exc:
        logger.warning("skipping a bad membership record: %s", exc)
        return None


def is_fresh(record: MemberRecord, now: float, heartbeat_s: float) -> bool:
    """Whether the record's heartbeat is recent enough to stand for its peer (``ONLINE_WITHIN_HEARTBEATS``, and never
    less than ``ONLINE_WITHIN_MIN_S``: with 1 s heartbeats on a loaded machine a 3 s window made live peers flicker
    offline, and drivers stopped routing to them)."""
    return now - record.updated_at <= max(ONLINE_WITHIN_HEARTBEATS * heartbeat_s, ONLINE_WITHIN_MIN_S)


def as_seen(record: MemberRecord, now: float, heartbeat_s: float) -> MemberRecord:
    """The record as a reader must take it: a peer whose heartbeat stopped is offline, even while the DHT still
    keeps a record that says otherwise (a long expiration, a crash after a store)."""
    if record.state == "offline" or is_fresh(record, now, heartbeat_s):
        return record
    return dataclasses.replace(record, state="offline", throughput=0.0, stalled_s=-1.0)


def parse_swarm(entries: dict[Any, Any] | None, now: float, heartbeat_s: float | None = None) -> list[MemberRecord]:
    """All valid records of one swarm, newest heartbeat first per peer id.

    ``entries`` is the ``{subkey: ValueWithExpiration}`` dict from ``dht.get(key, latest=True)``. With
    ``heartbeat_s``, a record whose heartbeat is stale is taken as offline (``as_seen``).
    """
    best: dict[str, MemberRecord] = {}
    for subkey, item in (entries or {}).items():
        value = getattr(item, "value", item)
        record = parse_member(subkey, value, now)
        if record is None:
            continue
        seen = best.get(record.peer_id)
        if seen is None or record.updated_at > seen.updated_at:
            best[record.peer_id] = record
    records = sorted(best.values(), key=lambda r: r.peer_id)
    return records if heartbeat_s is None else [as_seen(r, now, heartbeat_s) for r in records]
