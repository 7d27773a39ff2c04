"""Announcing our membership record and reading the swarms' records (thin I/O over the DHT)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from swarm.dht.records import MemberRecord, as_seen, is_fresh, parse_swarm, swarm_key
from swarm.integrity.identity_work import WorkChecks
from swarm.run.runconfig import RunConfig, config_differences

logger = logging.getLogger(__name__)

RUN_DIRECTORY_PREFIX = "volunteer_runs_"  # key {prefix}{name}: subkey run_id -> canonical config json
RUN_DIRECTORY_TTL_S = 600.0


def dht_time() -> float:
    from hivemind.utils import get_dht_time

    return get_dht_time()


class Membership:
    """Our own subkey in one swarm's key, plus reads of every swarm of the run."""

    def __init__(self, dht: Any, run: RunConfig, owner_subkey: bytes):
        self.dht = dht
        self.run = run
        self.owner_subkey = owner_subkey
        self.ttl_s = run.timeouts.record_ttl_s
        self.seen: dict[str, list[MemberRecord]] = {}  # swarm -> its view after the last read_all (merge_view)
        self.fresh: set[str] = set()  # the swarms the last read_all read (the others kept their last view)
        self.work = -1  # our identity's proof of work, put in every record we store (set before the first)
        self.unproven: set[str] = set()  # peer ids whose records we ignored for lack of identity work (said once)
        self.work_checks = WorkChecks(run.integrity.identity_bits)  # the identity work of the records we read

    def announce(self, swarm: str, record: MemberRecord, ttl_s: float | None = None,
                 timeout_s: float | None = None) -> bool:
        """Store our record; False if no DHT node took it (or the DHT did not answer within ``timeout_s``,
        by default ``timeouts.rpc_s``)."""
        from swarm.dht.dht import GET_BEAM

        expiration = dht_time() + (ttl_s if ttl_s is not None else self.ttl_s)
        if self.work >= 0 and record.work != self.work:
            record = dataclasses.replace(record, work=self.work)
        future = self.dht.store(swarm_key(self.run.run_id, swarm), subkey=self.owner_subkey, value=record.to_wire(),
                                expiration_time=expiration, return_future=True, beam_size=GET_BEAM)
        return bool(_result(future, timeout_s if timeout_s is not None else self.run.timeouts.rpc_s, default=False))

    def read(self, swarm: str) -> list[MemberRecord]:
        future = latest(self.dht, swarm_key(self.run.run_id, swarm))
        found = _result(future, self.run.timeouts.rpc_s, default=None)
        return self.proven(parse_swarm(found.value if found is not None else None, now=dht_time(),
                                       heartbeat_s=self.run.timeouts.heartbeat_s))

    def proven(self, records: list[MemberRecord]) -> list[MemberRecord]:
        """The records whose peer id carries the run's identity work (swarm/integrity/identity_work.py): a peer
        without it is nobody here (not routed to, pulled from or served). Each one ignored is said once."""
        kept, refused = self.work_checks.keep(records)
        for r in refused:
            if r.peer_id not in self.unproven and len(self.unproven) < 4096:
                self.unproven.add(r.peer_id)
                logger.warning("ignoring peer %s: its record carries no proof of %d bits of identity work (a client "
                               "older than identity work, or a key made for free)", r.peer_id[-8:],
                               self.run.integrity.identity_bits)
        return kept

    def read_all(self, names: list[str] | None = None, timeout_s: float | None = None) -> dict[str, list[MemberRecord]]:
        """Every swarm (or ``names``) at once: the gets run concurrently inside the DHT process, all of them
        within ``timeout_s`` together (by default ``timeouts.rpc_s``), so a slow DHT on a loaded machine delays
        a reader by that much at most, not that much per swarm.

        Each swarm's records are merged with its last read (``merge_view``): a read that failed or came back
        without some records (a partial answer) keeps the records of the last one while their heartbeats are
        fresh, and a record whose heartbeat is stale is offline. ``self.fresh`` names the swarms read now."""
        names = self.run.swarm_names if names is None else names
        futures = {name: latest(self.dht, swarm_key(self.run.run_id, name)) for name in names}
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.run.timeouts.rpc_s)
        now = dht_time()
        self.fresh = set()
        out: dict[str, list[MemberRecord]] = {}
        for name, future in futures.items():
            read = None
            try:
                found = future.result(timeout=max(0.0, deadline - time.monotonic()))
                read = self.proven(parse_swarm(found.value if found is not None else None, now=now))
                self.fresh.add(name)
            except Exception as exc:  # a slow or failed lookup keeps the last view of that swarm, not a crash
                logger.warning("reading swarm %s failed: %s", name, exc.__class__.__name__ if not str(exc) else exc)
                future.cancel()
            out[name] = self.seen[name] = merge_view(self.seen.get(name, []), read, now,
                                                     self.run.timeouts.heartbeat_s)
        return out


def merge_view(previous: list[MemberRecord], read: list[MemberRecord] | None, now: float,
               heartbeat_s: float) -> list[MemberRecord]:
    """One swarm's view after a read: ``read`` (None when it failed) with the records of ``previous`` it lacks
    while their heartbeats are fresh, the newest heartbeat per peer, and every stale record offline
    (records.py ``as_seen``). A DHT answer can miss records (a node that did not answer in time): without the
    merge, a swarm of 8 online peers could read as 1 for a heartbeat."""
    best: dict[str, MemberRecord] = {r.peer_id: r for r in previous if is_fresh(r, now, heartbeat_s)}
    for record in read or []:
        seen = best.get(record.peer_id)
        if seen is None or record.updated_at >= seen.updated_at:
            best[record.peer_id] = record
    if read is None:
        best.update({r.peer_id: r for r in previous if r.peer_id not in best})  # a failed read forgets nobody
    return [as_seen(r, now, heartbeat_s) for r in sorted(best.values(), key=lambda r: r.peer_id)]


READ_RECORDS_PER_BEAT = 4  # records of one swarm a peer takes in per heartbeat, on average, once the swarm is large
ARRIVING_STATES = frozenset({"joining", "syncing"})  # brief: a swarm with such a peer is read at its users' rate
# ... for this many reads in a row at most: a record that says "joining" forever (anyone can publish one) would
# otherwise make every server read that swarm five times as often for as long as it likes
ARRIVING_MAX_READS = 12
RAMP_S = 20.0  # a peer's figures climb for this long after its start
MAX_READ_PERIOD_BEATS = 12  # but a swarm it uses is read at least this often (1 min at the default heartbeat)


def read_period(peers_seen: int, uses: bool, others_every: int) -> int:
    """Heartbeats between two reads of one swarm.

    A get returns the whole swarm (every record, from each node that stores it), so a reader that re-read
    it every heartbeat would pay in proportion to the swarm's size, and the run in proportion to its square
    (benchmarks/dht_scale.py). A swarm a peer uses (its own: averaging partners, its peers table; every
    swarm for a driver, which routes through them) is read every heartbeat while it has at most
    ``READ_RECORDS_PER_BEAT`` peers, and then once per that many of its peers: about the same number of
    records per heartbeat at any size, in views a few heartbeats old (a driver learns of a dead peer from
    its hops first; a newcomer waits a few heartbeats longer to be routed to), up to
    ``MAX_READ_PERIOD_BEATS``: the cost is flat up to 48 peers per swarm and grows past it, where a view a
    minute old would be too stale (a swarm's key split into buckets is the step after; docs/ARCHITECTURE.md).
    The swarms a peer does not use (the dashboard's swarm table, the run's end) are read ``others_every``
    times less often."""
    base = min(MAX_READ_PERIOD_BEATS, max(1, math.ceil(peers_seen / READ_RECORDS_PER_BEAT)))
    return base if uses else base * max(1, others_every)


class ReadSchedule:
    """Which swarms a heartbeat reads (``read_period`` for each), from when each was last read and how many
    peers it had then."""

    def __init__(self) -> None:
        self.beat = 0
        self.read_at: dict[str, int] = {}  # swarm -> beat of its last read
        self.sizes: dict[str, int] = {}  # swarm -> records in that read
        self.arriving: dict[str, int] = {}  # swarm -> reads in a row with a peer still joining or syncing
        self.empty: dict[str, int] = {}  # swarm -> reads in a row that found it empty

    def due(self, swarm_names: list[str], own: str, drives: bool, others_every: int) -> list[str]:
        out = []
        for name in swarm_names:
            # a swarm with a peer on its way in is read as if used, until it is in: a server's dashboard showed
            # the other swarms' new peers as "0/1" online (and the wrong swarm as the bottleneck) for ~30 s while
            # it already trained through them
            # so is a swarm found empty, as long (a server that started before the other swarms' peers showed them
            # "0/0", the bottleneck, for 25 s while it already trained through them; one empty for good is not
            # read by every server every heartbeat)
            uses = drives or name == own or own not in swarm_names or \
                any(0 < reads.get(name, 0) <= ARRIVING_MAX_READS for reads in (self.arriving, self.empty))
            last = self.read_at.get(name)
            if last is None or self.beat - last >= read_period(self.sizes.get(name, 0), uses, others_every):
                out.append(name)
        return out

    def done(self, read: dict[str, list[Any]]) -> None:
        """After the reads of this heartbeat (``read``: swarm -> records as read; a failed read is empty and
        is retried at the next heartbeat)."""
        for name, records in read.items():
            self.read_at[name] = self.beat
            self.sizes[name] = len(records)
            if any(_arriving(r) for r in records):
                self.arriving[name] = self.arriving.get(name, 0) + 1
            else:
                self.arriving.pop(name, None)
            if records:
                self.empty.pop(name, None)
            else:
                self.empty[name] = self.empty.get(name, 0) + 1
        self.beat += 1


def _arriving(record: Any) -> bool:
    """On its way in: joining or syncing, or online with nothing served yet or for less than ``RAMP_S`` since its
    start (its figures still climb: read once, a new driver showed 320 samples/s of its 2,700, and the dashboard's
    bottleneck mark, for five heartbeats)."""
    state = getattr(record, "state", "")
    if state in ARRIVING_STATES:
        return True
    young = getattr(record, "updated_at", 0.0) - getattr(record, "started_at", float("-inf")) < RAMP_S
    return state == "online" and (getattr(record, "served", 1) == 0 or young)


def latest(dht: Any, key: str) -> Any:
    """A future of the key's newest value, every subkey merged, crawling only the nodes that store it
    (swarm/dht/dht.py GET_BEAM)."""
    from swarm.dht.dht import GET_BEAM

    return dht.get(key, latest=True, return_future=True, beam_size=GET_BEAM)


def _result(future: Any, timeout_s: float, default: Any) -> Any:
    """Every DHT call is bounded: a dead DHT process must not hang the node."""
    try:
        return future.result(timeout=timeout_s)
    except Exception as exc:
        logger.warning("DHT call failed: %s", exc.__class__.__name__ if not str(exc) else exc)
        future.cancel()
        return default


def publish_run(dht: Any, run: RunConfig) -> None:
    """List this run under its name, so a volunteer with another config of the same name learns why."""
    future = dht.store(RUN_DIRECTORY_PREFIX + run.name, subkey=run.run_id,
                       value=json.dumps(run.canonical(), sort_keys=True),
                       expiration_time=dht_time() + RUN_DIRECTORY_TTL_S, return_future=True)
    _result(future, run.timeouts.rpc_s, default=False)


@dataclass(slots=True, frozen=True)
class OtherRun:
    """Another run with our run's name: where its config differs from ours, and how many peers it has online."""

    run_id: str
    differences: list[str]
    config: dict  # its canonical config, as listed in the run directory
    online: int = 0


def other_run_configs(dht: Any, run: RunConfig) -> dict[str, dict]:
    """Run id -> canonical config of the other runs listed under our run's name."""
    found = _result(latest(dht, RUN_DIRECTORY_PREFIX + run.name), run.timeouts.rpc_s, None)
    if found is None or not isinstance(found.value, dict):
        return {}
    out: dict[str, dict] = {}
    for run_id, item in found.value.items():
        if run_id == run.run_id or not isinstance(run_id, str):
            continue
        try:
            theirs = json.loads(item.value)
            if not isinstance(theirs, dict):
                raise ValueError("not a mapping")
        except (ValueError, TypeError, AttributeError):
            logger.warning("skipping a malformed run directory entry for %r", run_id[:40])
            continue
        out[run_id] = theirs
    return out


def conflicting_runs(dht: Any, run: RunConfig) -> dict[str, list[str]]:
    """Other run ids that share our run's name, with the fields where their configs differ."""
    mine = run.canonical()
    return {run_id: config_differences(mine, theirs)[:8] for run_id, theirs in other_run_configs(dht, run).items()}


def other_runs(dht: Any, run: RunConfig) -> list[OtherRun]:
    """The other runs of our name, each with its online peers counted over all its swarms (read concurrently)."""
    mine = run.canonical()
    configs = other_run_configs(dht, run)
    work_checks: dict[str, WorkChecks] = {}
    futures = {}
    for run_id, theirs in configs.items():
        stages = theirs.get("model", {}).get("stages") if isinstance(theirs.get("model"), dict) else None
        for k in range(stages if isinstance(stages, int) and 0 < stages <= 64 else 0):
            futures[(run_id, k)] = latest(dht, swarm_key(run_id, f"layer{k}"))
    online: dict[str, int] = dict.fromkeys(configs, 0)
    now = dht_time()
    for (run_id, _), future in futures.items():
        found = _result(future, run.timeouts.rpc_s, None)
        records = [r for r in parse_swarm(found.value if found is not None else None, now=now) if r.state == "online"]
        # free keys must not make another run look busy either (its checks bounded as ours: WorkChecks)
        checks = work_checks.setdefault(run_id, WorkChecks(_identity_bits(configs[run_id])))
        online[run_id] += len(checks.keep(records)[0])
    return [OtherRun(run_id, config_differences(mine, theirs)[:8], theirs, online[run_id])
            for run_id, theirs in configs.items()]


def _identity_bits(config: dict) -> int:
    """The identity work another run's published config asks for (a run before the field: none)."""
    integrity = config.get("integrity")
    bits = integrity.get("identity_bits", 0) if isinstance(integrity, dict) else 0
    return bits if isinstance(bits, int) and not isinstance(bits, bool) and 0 <= bits <= 20 else 99  # proves nothing


def summarize(records: list[MemberRecord]) -> tuple[int, float, float | None]:
    """(online peers, their total throughput, best loss) of one swarm."""
    online = [r for r in records if r.state == "online"]
    losses = [r.loss for r in records if r.loss >= 0 and r.state in ("online", "paused", "finishing")]
    return len(online), sum(r.throughput for r in online), (min(losses) if losses else None)


def empty_swarms(records_by_swarm: dict[str, list[MemberRecord]], swarm_names: list[str],
                 online_here: str = "") -> list[str]:
    """The swarms with no online peer: while any is empty, no sample can pass the pipeline.

    ``online_here``: the swarm an online node serves itself (its own record in the view may be a
    heartbeat old, e.g. still "paused" right after a resume). A peer that other hosts cannot dial (behind
    NAT, ``reachable`` 0) serves nobody, except in layer0, whose peers drive and need no inbound connection."""
    return [name for name in swarm_names
            if name != online_here and not any(r.state == "online" and (r.reachable != 0 or name == "layer0")
                                               for r in records_by_swarm.get(name, []))]


def idle_reason(records_by_swarm: dict[str, list[MemberRecord]], swarm_names: list[str], online_here: str = "") -> str:
    """Why the whole run trains nothing (every layer is needed for a sample), in words; "" when no layer is empty.

    E.g. "layers 0, 1 and 3 have no online peer: every sample passes every layer, so nothing trains
    until volunteers join them"."""
    empty = empty_swarms(records_by_swarm, swarm_names, online_here)
    if not empty:
        return ""
    numbers = [name.removeprefix("layer") for name in empty]
    listed = numbers[0] if len(numbers) == 1 else f"{', '.join(numbers[:-1])} and {numbers[-1]}"
    which = f"layer {listed} has" if len(numbers) == 1 else f"layers {listed} have"
    them = "it" if len(numbers) == 1 else "them"
    return f"{which} no online peer: every sample passes every layer, so nothing trains until volunteers join {them}"


def age_s(record: MemberRecord, now: float | None = None) -> float:
    return max(0.0, (now if now is not None else time.time()) - record.updated_at)


def least_served_swarm(records_by_swarm: dict[str, list[MemberRecord]], swarm_names: list[str]) -> str:
    """``--swarm auto`` at join: the swarm with the least capacity among its peers that serve or are
    arriving (joining, syncing, healing: a burst of newcomers must not all pick the swarm that looked
    emptiest). Capacities are the records' own figures, a peer without one counting as its swarm's
    median (swarm/rebalance.py ``loads_from_records``); with no figures at all, the fewest peers. Ties go
    to the fewest peers, then the lowest index."""
    from swarm.rebalance import loads_from_records

    loads = loads_from_records(records_by_swarm, swarm_names)
    return min(swarm_names, key=lambda name: (loads[name].capacity, loads[name].peers, swarm_names.index(name)))
