"""What a running node tells the outside world: a plain status snapshot, events, and commands.

The engine builds a fresh ``NodeSnapshot`` on every tick and hands it to its listeners
(the TUI posts it as a message, headless mode prints a summary, ``volunteer ctl`` serves it
as JSON). Nothing here imports torch or hivemind, so the TUI and the CLI stay light.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


class NodeState(str, enum.Enum):
    JOINING = "joining"
    SYNCING = "syncing"
    ONLINE = "online"
    PAUSED = "paused"
    FINISHING = "finishing"
    HEALING = "healing"  # the copy was found sick: it serves nothing while it restores itself
    OFFLINE = "offline"


RUN_COMPLETE_PREFIX = "run complete: "  # a paused node's reason once its run reached its end (volunteer/node/completion.py)
STALE_EVAL_PERIODS = 2.0  # an evaluation older than this many eval periods is called stale


def evaluation_is_stale(age_s: float | None, eval_every_s: float) -> bool:
    """Whether a published evaluation is too old to stand for the copies as they are now."""
    return age_s is not None and age_s > STALE_EVAL_PERIODS * eval_every_s


VIEW_AGE_SHOWN_S = 10.0  # a swarm's figures read longer ago than this say their age (its own swarm: every heartbeat)


def view_age_s(row: SwarmRow, now_s: float) -> float | None:
    """How old a swarm's figures are, where it is worth saying (``VIEW_AGE_SHOWN_S``); None otherwise."""
    if row.read_at is None or now_s - row.read_at < VIEW_AGE_SHOWN_S:
        return None
    return now_s - row.read_at


LN_2 = 0.6931471805599453


def bits_per_byte(loss_nats: float) -> float:
    """A byte-level language model's cross-entropy per byte, in bits (its usual unit)."""
    return loss_nats / LN_2


def evaluation_figure(accuracy: float | None, loss: float | None) -> str:
    """'test accuracy 97.5%' for a classifier; a language model (no accuracy) in bits per byte:
    'test 2.01 bits/byte (loss 1.393 nats/byte)', a token-level model's loss per token spread over the bytes its
    tokens stand for (the demo's train loss is per token); '' when there is no evaluation."""
    if accuracy is not None:
        return f"test accuracy {accuracy * 100:.1f}%"
    if loss is not None:
        return f"test {bits_per_byte(loss):.2f} bits/byte (loss {loss:.3f} nats/byte)"
    return ""


def describe_evaluation(accuracy: float | None, loss: float | None, age_s: float | None, eval_every_s: float,
                        stale: bool | None = None) -> str:
    """'test accuracy 97.5% (12s ago)'; older than two eval periods (or ``stale``, as a node judged it: as of its
    read of the records): '... STALE, 3m 10s ago: no newer one'."""
    from volunteer.policy import format_duration

    figure = evaluation_figure(accuracy, loss)
    if not figure:
        return "no evaluation yet"
    if age_s is None:
        return f"{figure} (age unknown)"
    if evaluation_is_stale(age_s, eval_every_s) if stale is None else stale:
        return f"{figure} (STALE: measured {format_duration(age_s)} ago, no newer evaluation)"
    return f"{figure} ({format_duration(age_s)} ago)"


class Command(str, enum.Enum):
    PAUSE = "pause"  # stop taking work now (in-flight work is finished or handed back)
    FINISH = "finish"  # drain in-flight work, then pause
    RESUME = "resume"
    QUIT = "quit"  # clean leave: announce offline, shut down


class EventLevel(str, enum.Enum):
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


@dataclass(slots=True, frozen=True)
class Event:
    """Something a volunteer would want to know happened: joined, synced, averaged, banned, failed."""

    text: str
    level: EventLevel = EventLevel.INFO
    kind: str = "info"  # machine-readable tag: joined, synced, averaged, adopted, healed, banned, error...
    time: float = field(default_factory=time.time)


@dataclass(slots=True, frozen=True)
class PeerRow:
    """One peer of a swarm, as read from its membership record."""

    peer_id: str
    state: str
    age_s: float  # seconds since its last heartbeat
    version: str = ""
    throughput: float = 0.0  # samples/s it measured
    loss: float | None = None  # loss EMA of the micro-batches through it
    clock: int = 0  # samples trained into its copy
    shard: int | None = None  # data shard (layer0 only)
    is_me: bool = False


@dataclass(slots=True, frozen=True)
class LinkRow:
    """This node's traffic with one remote peer over the last heartbeat."""

    peer_id: str
    mbps_in: float
    mbps_out: float


@dataclass(slots=True, frozen=True)
class SwarmRow:
    """Totals of one layer swarm."""

    name: str
    online: int
    total: int
    throughput: float = 0.0
    best_loss: float | None = None
    bottleneck: bool = False  # the swarm with the least online throughput (or no peer at all)
    read_at: float | None = None  # wall time of the DHT read these figures come from (None: not said)


@dataclass(slots=True, frozen=True)
class NodeSnapshot:
    run_name: str
    run_id: str
    swarm: str
    peer_id: str
    state: NodeState
    reason: str = ""  # why the node is not training, in plain words ("" while it trains)
    started_at: float = field(default_factory=time.time)
    device: str = "cpu"
    # my work
    samples_per_s: float = 0.0
    loss: float | None = None
    clock: int = 0
    microbatches_served: int = 0
    samples_per_s_history: tuple[float, ...] = ()
    loss_history: tuple[float, ...] = ()
    # this volunteer's contribution to the run (volunteer/contribution.py): this session, and all sessions of
    # this identity, kept in the data dir across restarts
    session_samples: int = 0
    session_online_s: float = 0.0
    total_microbatches: int = 0
    total_samples: int = 0
    total_online_s: float = 0.0
    total_sessions: int = 0
    log_path: str = ""  # this session's log file ("" when there is none)
    # run-wide figures published by layer0 evaluators
    test_accuracy: float | None = None
    test_loss: float | None = None
    test_at: float | None = None  # wall time of that evaluation (None: its time is unknown)
    eval_every_s: float = 10.0  # the run's evaluation period: a figure older than 2 periods is stale
    heals: int = 0  # times this copy was found sick and restored itself
    # spot checks this node ran (swarm/pipeline/peer_metrics.py): replicated outputs compared, odd ones out
    # penalised, and odd ones out not penalised because their accusers had less validated work here
    spot_checked: int = 0
    spot_caught: int = 0
    spot_outweighed: int = 0
    # layer0: how its micro-batches travel ("stage to stage 96% · 2 peers relayed now"; "" elsewhere)
    data_plane: str = ""
    # staleness of this copy's recent updates (updates applied between a micro-batch's forward and its
    # backward here); None before the first update
    staleness_mean: float | None = None
    staleness_p95: float | None = None
    staleness_max: int | None = None
    # weight prediction: training forwards computed with weights predicted this many updates ahead (0: none)
    predicted_forwards: int = 0
    predicted_ahead: int = 0
    # resources
    cpu_percent: float = 0.0
    memory_bytes: int = 0
    gpu_memory_bytes: int | None = None
    bytes_in: int = 0
    bytes_out: int = 0
    mbps_in: float = 0.0  # over the last heartbeat (swarm/pipeline/transport/traffic.py)
    mbps_out: float = 0.0
    links: tuple[LinkRow, ...] = ()  # the busiest links over the last heartbeat, busiest first
    # the run
    swarms: tuple[SwarmRow, ...] = ()
    peers: tuple[PeerRow, ...] = ()  # my swarm's peers
    events: tuple[Event, ...] = ()  # most recent last
    maddrs: tuple[str, ...] = ()
    # can other hosts dial this node (swarm/dht/reachability.py): reachable, unreachable, unknown, local or
    # checking; the detail says who dialled what, reachability_at (wall time) how old the verdict is
    reachability: str = "unknown"
    reachability_detail: str = ""
    reachability_at: float | None = None
    # seconds this node wanted to train and completed no micro-batch (None while it does not want to); the
    # run's alarms, computed from every swarm's records (swarm/dht/alarms.py: a stage that refuses every
    # driver, stalled drivers)
    stalled_s: float | None = None
    run_alarms: tuple[str, ...] = ()

    @property
    def evaluation_age_s(self) -> float | None:
        return None if self.test_at is None else max(0.0, time.time() - self.test_at)

    def evaluation_stale(self, now_s: float | None = None) -> bool:
        """Whether the evaluation was already old when this node last read layer0's records, which publish it: a
        node that drives nothing reads them every few heartbeats, and judged by its age now a fresh evaluation
        showed STALE most of the time."""
        if self.test_at is None:
            return False
        read_at = next((s.read_at for s in self.swarms if s.name == "layer0" and s.read_at is not None), None)
        now_s = time.time() if now_s is None else now_s
        at = now_s if read_at is None else min(now_s, read_at)
        return evaluation_is_stale(max(0.0, at - self.test_at), self.eval_every_s)

    @property
    def uptime_s(self) -> float:
        return max(0.0, time.time() - self.started_at)

    @property
    def short_peer_id(self) -> str:
        return short_id(self.peer_id)

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["state"] = self.state.value
        data["uptime_s"] = round(self.uptime_s, 1)
        age = self.evaluation_age_s
        data["evaluation_age_s"] = None if age is None else round(age, 1)
        data["evaluation_stale"] = self.evaluation_stale()
        for event in data["events"]:
            event["level"] = event["level"].value if isinstance(event["level"], EventLevel) else event["level"]
        return data


def short_id(peer_id: str, length: int = 8) -> str:
    """The tail of a peer id: the head of base58 libp2p ids is always the same few characters."""
    return peer_id[-length:] if len(peer_id) > length else peer_id


SnapshotListener = Callable[[NodeSnapshot], None]
EventListener = Callable[[Event], None]


class Engine(Protocol):
    """What the TUI, the headless logger and the control socket need from a running node.

    Listeners are called from the engine's own thread: a UI must hand the data over to
    its own thread (textual: ``app.post_message`` / ``call_from_thread``).
    """

    def start(self) -> None: ...

    def snapshot(self) -> NodeSnapshot: ...

    def command(self, command: Command) -> None: ...

    def add_listener(self, on_snapshot: SnapshotListener, on_event: EventListener) -> None: ...

    def wait_stopped(self, timeout: float | None = None) -> bool: ...
