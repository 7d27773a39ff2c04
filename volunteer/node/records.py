"""Pure builders between the node's figures and the DHT: our MemberRecord, and the snapshot's view
of the swarms (rows per swarm and per peer, the run's newest published evaluation).

Plain functions over plain data (records, a snapshot, the stage's metrics), tested without a network.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from volunteer.snapshot import NodeSnapshot, NodeState, PeerRow, SwarmRow

NO_FIGURE = -1.0  # what a record carries for a figure it does not have (loss, accuracy)
BOTTLENECK_MARGIN = 0.01  # another swarm must be this much slower to take the bottleneck marker over
TRAINING_STATES = (NodeState.ONLINE, NodeState.FINISHING)  # the states whose measured rate is shown


def shown_samples_per_s(measured: float, state: NodeState) -> float:
    """Our rate as the snapshot and record show it: 0 at once while paused (or not training), instead of
    the measured window's slow decay over ``THROUGHPUT_WINDOW_S``."""
    return measured if state in TRAINING_STATES else 0.0


class StallClock:
    """Seconds the node wanted to train (``wants``) and completed no micro-batch (``completed``, a counter that
    grows with each one). Counted from when training could start (the node came online, a pause or a throttle
    ended), never from before; None while the node does not want to train."""

    def __init__(self) -> None:
        self.completed = -1
        self.since_s: float | None = None
        self.progress_s: float | None = None  # when the counter last grew (None: not seen grow yet)

    def update(self, completed: int, wants: bool, now_s: float) -> float | None:
        if self.completed >= 0 and completed != self.completed:
            self.progress_s = now_s
        if not wants or self.since_s is None or completed != self.completed:
            self.since_s = now_s if wants else None
        self.completed = completed
        return None if self.since_s is None else max(0.0, now_s - self.since_s)

    def progressed_within(self, window_s: float, now_s: float) -> bool:
        """A micro-batch completed in the last ``window_s``: every layer had a peer a moment ago."""
        return self.progress_s is not None and now_s - self.progress_s <= window_s


def bottleneck_swarm(swarms: list[SwarmRow], previous: str | None = None,
                     margin: float = BOTTLENECK_MARGIN) -> str | None:
    """The swarm to mark as the bottleneck: one with no peer online, else the least throughput. The swarm
    marked last time keeps the marker while it is within ``margin`` of the weakest (no flipping between
    swarms that go at the same pace). None for a run of one swarm."""
    if len(swarms) < 2:
        return None
    weakest = min(swarms, key=lambda s: (s.online > 0, s.throughput, s.online))
    kept = next((s for s in swarms if s.name == previous), None)
    if (kept is not None and (kept.online > 0) == (weakest.online > 0)
            and kept.throughput <= weakest.throughput * (1 + margin)):
        return kept.name
    return weakest.name


def build_record(snap: NodeSnapshot, *, state: str, version: str, started_at_s: float, now_s: float,
                 shard: int | None, metrics: Any, movable: bool = False, reachable: int = -1) -> Any:
    """Our membership record from the snapshot and the stage's last metrics (None before training)."""
    from swarm.dht.records import MemberRecord

    m = metrics
    return MemberRecord(
        peer_id=snap.peer_id,
        state=state,
        version=version,
        started_at=float(started_at_s),
        updated_at=float(now_s),
        throughput=float(snap.samples_per_s),
        loss=float(snap.loss) if snap.loss is not None else NO_FIGURE,
        clock=int(snap.clock),
        served=int(snap.microbatches_served),
        shard=shard if shard is not None else -1,
        param_version=int(m.param_version) if m else 0,
        # only our own evaluations (layer0); the snapshot may show one copied from another peer
        test_accuracy=_or(m.test_accuracy if m else None, NO_FIGURE),
        test_loss=_or(m.test_loss if m else None, NO_FIGURE),
        eval_samples=int(m.eval_samples) if m else 0,
        trained=int(m.trained) if m else 0,
        lost=int(m.lost) if m else 0,
        eval_at=float(m.eval_at) if m else NO_FIGURE,
        eval_version=int(m.eval_version) if m else -1,
        heals=int(m.heals) if m else 0,
        **_staleness_fields(m),
        mbps_in=round(float(snap.mbps_in), 3),
        mbps_out=round(float(snap.mbps_out), 3),
        capacity=_capacity(m),
        movable=bool(movable),
        reachable=int(reachable),
        stalled_s=round(float(snap.stalled_s), 1) if snap.stalled_s is not None else NO_FIGURE,
        **_refusal_fields(m),
    )


def _refusal_fields(metrics: Any) -> dict[str, Any]:
    """The drivers our stage refuses right now, of those it knows, and why (StageGate.refusals); -1 when unknown."""
    from swarm.dht.records import MAX_BAN_REASON_CHARS

    refused, seen = getattr(metrics, "drivers_refused", -1), getattr(metrics, "drivers_seen", -1)
    return {"drivers_refused": int(refused), "drivers_seen": int(seen),
            "ban_reason": str(getattr(metrics, "ban_reason", ""))[:MAX_BAN_REASON_CHARS]}


def _capacity(metrics: Any) -> float:
    capacity = getattr(metrics, "capacity", None)
    return round(float(capacity), 3) if capacity is not None and 0 < capacity < 1e9 else NO_FIGURE


def _staleness_fields(metrics: Any) -> dict[str, Any]:
    """Our copy's recent staleness for the record; -1 for each figure not measured yet."""
    mean, p95, maximum = (getattr(metrics, f"staleness_{k}", None) for k in ("mean", "p95", "max"))
    return {"staleness_mean": _or(mean, NO_FIGURE), "staleness_p95": _or(p95, NO_FIGURE),
            "staleness_max": int(maximum) if maximum is not None else -1}


def run_evaluation(views: dict[str, list[Any]], eval_every_s: float = 10.0) -> dict[str, Any]:
    """The run's evaluation for peers that do not evaluate: the median of the layer0 peers' current ones
    (swarm/dht/published.py: one record's claim of 1.0 moves nothing)."""
    from swarm.dht.published import representative_evaluation

    latest, _ = representative_evaluation(views.get("layer0", []), eval_every_s)
    if latest is None:
        return {}
    return {"test_accuracy": latest.test_accuracy if latest.test_accuracy >= 0 else None,
            "test_loss": latest.test_loss if latest.test_loss >= 0 else None,
            "test_at": latest.eval_at if latest.eval_at >= 0 else None}


def view_fields(views: dict[str, list[Any]], swarm_names: list[str], swarm: str, me: str,
                now_s: float, previous_bottleneck: str | None = None, heartbeat_s: float | None = None,
                read_at_s: dict[str, float] | None = None) -> dict[str, Any]:
    """The snapshot's ``swarms`` (with the bottleneck marked, see ``bottleneck_swarm``), ``peers`` (our swarm's
    records) and the run's ``alarms`` (swarm/dht/alarms.py). With ``heartbeat_s``, a record whose heartbeat was
    stale when its swarm was last read (``read_at_s``: wall time per swarm; ``now_s`` for a swarm not in it) shows
    offline (records.py ``as_seen``), and each swarm's row says when that read was. A record is judged as of its
    read, not as of now: a peer that drives nothing reads the other swarms every 5 heartbeats, and judged as of now
    their live peers showed offline 10 s of every 25 (a layer1 volunteer's status said "layer0:0!" while it trained
    on layer0's micro-batches, and its run alarms were computed from that)."""
    from swarm.dht.alarms import run_alarms
    from swarm.dht.membership import summarize
    from swarm.dht.records import as_seen

    read_at_s = read_at_s or {}
    if heartbeat_s is not None:
        views = {name: [as_seen(r, min(now_s, read_at_s.get(name, now_s)), heartbeat_s) for r in records]
                 for name, records in views.items()}

    swarms = []
    for name in swarm_names:
        online, throughput, best_loss = summarize(views.get(name, []))
        swarms.append(SwarmRow(name=name, online=online, total=len(views.get(name, [])),
                               throughput=throughput, best_loss=best_loss, read_at=read_at_s.get(name)))
    marked = bottleneck_swarm(swarms, previous_bottleneck)
    swarms = [replace(s, bottleneck=(s.name == marked)) for s in swarms]
    peers = tuple(
        PeerRow(
            peer_id=r.peer_id, state=r.state, age_s=round(max(0.0, now_s - r.updated_at), 1), version=r.version,
            throughput=r.throughput, loss=r.loss_or_none, clock=r.clock, shard=r.shard_or_none,
            is_me=(r.peer_id == me),
        )
        for r in views.get(swarm, [])
    )
    return {"swarms": tuple(swarms), "peers": peers, "run_alarms": tuple(run_alarms(views, swarm_names))}


def _or(value: float | None, default: float) -> float:
    return float(value) if value is not None else default
