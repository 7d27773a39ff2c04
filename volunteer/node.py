"""The node engine: join the DHT, pick and announce a swarm, heartbeat, serve commands, leave cleanly.

Lifecycle: joining -> (syncing) -> online <-> paused / finishing -> offline.
The engine runs on its own thread; it reports through listeners (snapshots and events) and takes
``Command``s from any thread (the TUI, or ``volunteer ctl`` through the control socket the node
serves). Everything it waits on is an Event with a timeout, so a quit or a Ctrl+C is honoured
within a fraction of a second.

Who paused: a pause the user asked for (ctl, TUI) is only ever lifted by the user; a pause the
idle policy made (``prefs.idle``, see headless.py) is lifted by the policy. The snapshot's
``reason`` always says why the node is not training. Checkpoints (checkpoint.py) are saved on
pause, on exit and every ``resources.checkpoint_interval_s``, and restored on restart.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from swarm.runconfig import RunConfig
from volunteer import __version__
from volunteer.prefs import IdlePrefs, ResourcePrefs
from volunteer.snapshot import (
    Command,
    Event,
    EventLevel,
    EventListener,
    NodeSnapshot,
    NodeState,
    PeerRow,
    SnapshotListener,
    SwarmRow,
)

logger = logging.getLogger(__name__)

EVENT_HISTORY = 200
SPARKLINE_POINTS = 120
TICK_S = 1.0  # snapshot refresh; the DHT heartbeat is slower (timeouts.heartbeat_s)
OFFLINE_TTL_S = 60.0  # a clean leave stays visible as "offline" this long
LEAVE_DRAIN_S = 5.0  # on quit, in-flight backward passes get this long to finish
LEAVE_ANNOUNCE_TIMEOUT_S = 10.0 # on quit, the last record waits this long for a DHT peer (none may be left)
FINAL_EVAL_TIMEOUT_S = 15.0  # layer0's evaluation when it finishes (drain, evaluate, pause)
PAUSED_BY_USER = "user"
PAUSED_BY_POLICY = "policy"
USER_PAUSE_REASON = "paused by you"


class JoinError(RuntimeError):
    """The node could not join; the message says why and what to try."""


@dataclass(slots=True, kw_only=True)
class NodeOptions:
    run: RunConfig
    swarm: str  # "layerK" or "auto"
    initial_peers: list[str]
    data_dir: Path
    identity_path: Path | None = None
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    use_relay: bool = True
    use_auto_relay: bool = False
    client_mode: bool = False
    device: str = "cpu"
    cpu_threads: int = 0
    process_group: int | None = None
    train: bool = True  # False: announce membership only (no stage, no driver)
    idle: IdlePrefs = field(default_factory=IdlePrefs)  # when to train (idle.enabled: only while the user is away)
    resources: ResourcePrefs = field(default_factory=ResourcePrefs)
    control_socket: bool = True  # serve `volunteer ctl` at <data_dir>/control/<run_id>-<swarm>.sock


class Node:
    """One volunteer serving one layer swarm. Implements the ``Engine`` protocol of snapshot.py."""

    def __init__(self, options: NodeOptions):
        self.options = options
        self.run = options.run
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._snapshot_listeners: list[SnapshotListener] = []
        self._event_listeners: list[EventListener] = []
        self._events: deque[Event] = deque(maxlen=EVENT_HISTORY)
        self._thread: threading.Thread | None = None
        self._pending: deque[Command] = deque()
        self.error: str | None = None
        self._swarm = options.swarm if options.swarm != "auto" else ""
        self._snapshot = NodeSnapshot(
            run_name=self.run.name,
            run_id=self.run.run_id,
            swarm=self._swarm or "auto",
            peer_id="",
            state=NodeState.JOINING,
            reason="connecting to the swarm",
            device=options.device,
        )
        self.dht: Any = None
        self.membership: Any = None
        self._identity_lock: Any = None
        self._started_at_dht = time.time()
        self._views: dict[str, list[Any]] = {}
        self._metrics: Any = None
        self._process: Any = None
        self.peer: Any = None  # swarm.peer.SwarmPeer once serving
        self._shard: int | None = None
        self._history_speed: deque[float] = deque(maxlen=SPARKLINE_POINTS)
        self._history_loss: deque[float] = deque(maxlen=SPARKLINE_POINTS)
        self._commands_sent = 0
        self._commands_applied = 0
        self._applied = threading.Condition(self._lock)
        self._paused_by: str | None = None  # PAUSED_BY_USER or PAUSED_BY_POLICY while not online
        self._accepting = True  # mirrors the peer's pause()/resume()
        self._throttled = False
        self._control: Any = None
        self._governor: Any = None
        self._budget: Any = None
        self._checkpointer: Any = None

    # ----- Engine protocol
    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="volunteer-engine", daemon=True)
        self._thread.start()

    def snapshot(self) -> NodeSnapshot:
        with self._lock:
            return self._snapshot

    def command(self, command: Command) -> int:
        """Queue a command; returns a ticket for ``wait_applied``."""
        with self._lock:
            self._pending.append(Command(command))
            self._commands_sent += 1
            ticket = self._commands_sent
        if command == Command.QUIT:
            self._stop.set()
        self._wake.set()
        return ticket

    def wait_applied(self, ticket: int, timeout: float) -> bool:
        """Wait until the engine has applied the command with this ticket (commands queue while joining)."""
        with self._applied:
            return self._applied.wait_for(lambda: self._commands_applied >= ticket, timeout)

    def add_listener(self, on_snapshot: SnapshotListener, on_event: EventListener) -> None:
        with self._lock:
            self._snapshot_listeners.append(on_snapshot)
            self._event_listeners.append(on_event)
            history = list(self._events)
            current = self._snapshot
        for event in history:
            on_event(event)
        on_snapshot(current)

    def wait_stopped(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    def request_stop(self) -> None:
        self._stop.set()
        self._wake.set()

    # ----- internals
    def _emit(self, text: str, level: EventLevel = EventLevel.INFO, kind: str = "info") -> None:
        event = Event(text=text, level=level, kind=kind)
        with self._lock:
            self._events.append(event)
            listeners = list(self._event_listeners)
            self._snapshot = replace(self._snapshot, events=tuple(list(self._events)[-50:]))
        for listener in listeners:
            try:
                listener(event)
            except Exception:  # a broken listener must not take the engine down
                logger.exception("event listener failed")

    def _publish(self, **changes: Any) -> None:
        with self._lock:
            self._snapshot = replace(self._snapshot, **changes)
            snapshot = self._snapshot
            listeners = list(self._snapshot_listeners)
        for listener in listeners:
            try:
                listener(snapshot)
            except Exception:
                logger.exception("snapshot listener failed")

    def _main(self) -> None:
        try:
            self._start_control()
            self._join()
            if not self._stop.is_set():
                self._serve()
        except JoinError as exc:
            self.error = str(exc)
            self._emit(str(exc), EventLevel.ERROR, "error")
        except Exception as exc:  # an engine bug: say it plainly, still leave cleanly
            logger.exception("engine failed")
            self.error = f"the node failed: {exc.__class__.__name__}: {exc}"
            self._emit(self.error, EventLevel.ERROR, "error")
        finally:
            self._leave()
            if self._control is not None:
                self._control.close()
            self._stopped.set()

    def _start_control(self) -> None:
        """Serve `volunteer ctl`; a node without its socket still trains (and says so)."""
        if not self.options.control_socket:
            return
        from volunteer.control import ControlError, serve_node

        try:
            self._control = serve_node(self.options.data_dir, self.run.run_id, self._swarm or "auto", self)
        except ControlError as exc:
            self._emit(f"`volunteer ctl` cannot reach this node: {exc}", EventLevel.WARNING, "control")
            return
        self._emit(f"control socket: {self._control.path} (`volunteer ctl status`)", kind="control")

    def _join(self) -> None:
        self._emit("loading the network and training libraries (hivemind, torch)", kind="joining")
        from swarm.dht import DHTSettings, DHTStartError, IdentityInUse, claim_identity, make_validators, start_dht
        from swarm.membership import Membership, conflicting_runs, least_served_swarm, publish_run

        options, run = self.options, self.run
        if not options.initial_peers:
            raise JoinError(
                "no bootstrap peers: pass --initial-peers MADDR or list bootstrap_peers in the run config. "
                "To start one: `volunteer bootstrap` prints the address to pass"
            )
        try:
            identity_path, self._identity_lock = claim_identity(options.identity_path, options.data_dir)
        except IdentityInUse as exc:
            raise JoinError(str(exc)) from None
        self._emit(f"starting the DHT (bootstrap: {', '.join(options.initial_peers)})", kind="joining")
        validators = make_validators(run.run_id, run.swarm_names, identity_path)
        settings = DHTSettings(
            initial_peers=options.initial_peers,
            host_maddrs=options.host_maddrs,
            announce_maddrs=options.announce_maddrs,
            identity_path=identity_path,
            use_relay=options.use_relay,
            use_auto_relay=options.use_auto_relay,
            client_mode=options.client_mode,
            start_timeout_s=run.timeouts.dht_start_s,
            process_group=options.process_group,
        )
        try:
            self.dht = start_dht(settings, validators)
        except DHTStartError as exc:
            raise JoinError(str(exc)) from None
        if self._stop.is_set():
            return
        peer_id = str(self.dht.peer_id)
        from swarm.dht import visible_maddrs

        self.membership = Membership(self.dht, run, validators[0].local_public_key)
        self._publish(peer_id=peer_id, maddrs=tuple(visible_maddrs(self.dht)))
        self._emit(f"joined the DHT as {peer_id[-8:]}", kind="joined")

        for other, diffs in conflicting_runs(self.dht, run).items():
            detail = "; ".join(diffs) if diffs else "unknown fields"
            self._emit(
                f"another run named {run.name!r} is active with a different config (run id {other}); "
                f"you will not train together. Differences: {detail}",
                EventLevel.WARNING,
                "run_mismatch",
            )
        publish_run(self.dht, run)

        self._views = self.membership.read_all()
        if not self._swarm:
            self._swarm = least_served_swarm(self._views, run.swarm_names)
            self._emit(f"--swarm auto chose {self._swarm} (fewest online peers)", kind="joining")
        self._publish(swarm=self._swarm)
        if options.train:
            self._start_training()
        if self._stop.is_set():
            return
        self._set_state(NodeState.ONLINE, "")
        self._emit(f"online in {self._swarm} of run {run.run_id}", kind="online")

    def _start_training(self) -> None:
        from swarm.data import choose_shard
        from swarm.peer import SwarmPeer
        from volunteer.device import describe_device, resolve_device, set_threads

        try:
            device = resolve_device(self.options.device)
        except ValueError as exc:
            raise JoinError(str(exc)) from None
        set_threads(self.options.cpu_threads)
        self._apply_gpu_memory_fraction(device)
        if self._swarm == "layer0":
            held = [r.shard for r in self._views.get("layer0", []) if r.state == "online" and r.shard >= 0]
            self._shard = choose_shard(self.run.data.shards, held, tiebreak=str(self.dht.peer_id))
            self._emit(f"holding data shard {self._shard} of {self.run.data.shards} (rarest first)", kind="shard")
        self._emit(f"building {self._swarm} on {describe_device(device)}", kind="joining")
        self.peer = SwarmPeer(self.run, self.dht, self._swarm, device=device, shard=self._shard,
                              notify=self._on_peer_notice)
        resume = self._prepare_resume()
        # A newcomer (or a checkpoint the swarm has outrun) downloads its layer before it serves or drives
        # anything; with a checkpoint to restore, no download is needed.
        sync_from = list(self._views.get(self._swarm, [])) if resume.state is None else None
        if sync_from is not None:
            self._set_state(NodeState.SYNCING, f"downloading {self._swarm} from its peers")
        self.peer.start(sync_from=sync_from)
        self._finish_resume(resume)
        self.peer.update_views(self._views)
        self._publish(device=describe_device(device))

    def _on_peer_notice(self, level: str, kind: str, text: str) -> None:
        self._emit(text, EventLevel(level) if level in ("info", "warning", "error") else EventLevel.INFO, kind)

    def _serve(self) -> None:
        heartbeat_s = self.run.timeouts.heartbeat_s
        next_beat = 0.0
        self._start_governors()
        while not self._stop.is_set():
            self._apply_commands()
            self._check_finishing()
            self._follow_idle_policy()
            self._follow_bandwidth_cap()
            if self._checkpointer is not None and self._checkpointer.due():
                self._save_checkpoint(f"every {self._checkpointer.interval_s:g} s", periodic=True)
            now = time.monotonic()
            if now >= next_beat:
                self._heartbeat()
                next_beat = now + heartbeat_s
            else:
                self._publish(**self._work_fields())
            self._wake.wait(timeout=max(0.0, min(next_beat - time.monotonic(), TICK_S)))
            self._wake.clear()

    def _check_finishing(self) -> None:
        if self.snapshot().state == NodeState.FINISHING and (self.peer is None or self.peer.in_flight() == 0):
            self._emit("finished in-flight work, now paused", kind="paused")
            if self.peer is not None and self.peer.evaluate_now(FINAL_EVAL_TIMEOUT_S):
                self._publish(**self._work_fields())  # layer0: what the swarm reached, published at the pause
            self._set_state(NodeState.PAUSED, f"finished, {USER_PAUSE_REASON}")
            self._save_checkpoint("paused")

    def _apply_commands(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    return
                command = self._pending.popleft()
            try:
                self._apply_command(command)
                self._announce()
            finally:
                with self._applied:
                    self._commands_applied += 1
                    self._applied.notify_all()

    def _apply_command(self, command: Command) -> None:
        state = self.snapshot().state
        if command == Command.PAUSE and state in (NodeState.ONLINE, NodeState.FINISHING, NodeState.PAUSED):
            was_policy = state == NodeState.PAUSED and self._paused_by == PAUSED_BY_POLICY
            self._paused_by = PAUSED_BY_USER
            self._set_state(NodeState.PAUSED, USER_PAUSE_REASON)
            self._sync_accepting()
            if was_policy:
                self._emit("paused by you: the idle policy will not resume it; `volunteer ctl resume` will",
                           kind="paused")
            elif state != NodeState.PAUSED:
                self._emit("paused: no new work is taken; in-flight backward passes still complete", kind="paused")
                self._save_checkpoint("paused")
        elif command == Command.FINISH and state == NodeState.ONLINE:
            self._paused_by = PAUSED_BY_USER
            self._set_state(NodeState.FINISHING, "finishing in-flight work, then pausing")
            self._sync_accepting()
            self._emit("finishing: draining in-flight micro-batches", kind="finishing")
        elif command == Command.FINISH and state == NodeState.PAUSED:
            self._paused_by = PAUSED_BY_USER
            self._set_state(NodeState.PAUSED, USER_PAUSE_REASON)
        elif command == Command.RESUME and state in (NodeState.PAUSED, NodeState.FINISHING):
            self._paused_by = None
            verdict = self._governor.verdict if self._governor is not None else None
            if verdict is not None and not verdict.run:  # the user's pause is lifted; the policy's still holds
                self._paused_by = PAUSED_BY_POLICY
                self._set_state(NodeState.PAUSED, verdict.reason)
                self._emit(f"resume: the idle policy keeps this node paused ({verdict.reason}); set idle.enabled: "
                           "false in your preferences to train while you use this machine", kind="paused")
            else:
                self._set_state(NodeState.ONLINE, "")
                self._emit("resumed", kind="resumed")
            self._sync_accepting()
        elif command == Command.QUIT:
            self._stop.set()

    # ----- the machine comes first: idle policy, bandwidth cap, GPU memory
    def _start_governors(self) -> None:
        from volunteer.headless import BandwidthBudget, IdleGovernor

        if self.options.idle.enabled:
            device = self.peer.device if self.peer is not None else self.options.device
            self._governor = IdleGovernor(self.options.idle, device, wake=self._wake.set)
            self._emit("idle mode: training only while this machine is idle (see `volunteer doctor`)", kind="idle")
        if self.options.resources.bandwidth_mbit_s > 0 and self.peer is not None:
            self._budget = BandwidthBudget(self.options.resources.bandwidth_mbit_s)

    def _follow_idle_policy(self) -> None:
        """Pause when the policy says so, resume only the pauses it made."""
        if self._governor is None:
            return
        verdict = self._governor.poll()
        if verdict is None:
            return
        state = self.snapshot().state
        if not verdict.run and state == NodeState.ONLINE:
            self._paused_by = PAUSED_BY_POLICY
            self._set_state(NodeState.PAUSED, verdict.reason)
            self._sync_accepting()
            self._emit(f"paused by the idle policy: {verdict.reason}; it resumes by itself", kind="paused")
            self._save_checkpoint("paused")
        elif state == NodeState.PAUSED and self._paused_by == PAUSED_BY_POLICY:
            if verdict.run:
                self._paused_by = None
                self._set_state(NodeState.ONLINE, "")
                self._sync_accepting()
                self._emit("resumed: the idle policy allows training again", kind="resumed")
            elif verdict.reason != self.snapshot().reason:
                self._publish(reason=verdict.reason)  # "user active 12 s ago" ages; no event, no announce

    def _follow_bandwidth_cap(self) -> None:
        if self._budget is None or self.peer is None:
            return
        m = self.peer.metrics()
        throttled = self._budget.update(m.bytes_in + m.bytes_out)
        if throttled != self._throttled:
            self._throttled = throttled
            self._sync_accepting()
            if throttled:
                self._emit(self._budget.reason(), kind="throttled")

    def _sync_accepting(self) -> None:
        """The stage takes new work only while online and under the bandwidth cap."""
        if self.peer is None:
            return
        accepting = self.snapshot().state == NodeState.ONLINE and not self._throttled
        if accepting != self._accepting:
            self._accepting = accepting
            if accepting:
                self.peer.resume()
            else:
                self.peer.pause()

    def _apply_gpu_memory_fraction(self, device: str) -> None:
        from volunteer.headless import apply_gpu_memory_fraction

        fraction = self.options.resources.gpu_memory_fraction
        try:
            if apply_gpu_memory_fraction(device, fraction):
                self._emit(f"using at most {fraction:.0%} of the GPU's memory", kind="joining")
        except (RuntimeError, ValueError) as exc:
            self._emit(f"could not cap the GPU memory at {fraction:.0%}: {exc}", EventLevel.WARNING, "joining")

    # ----- checkpoints
    def _prepare_resume(self) -> Any:
        """Before the stage is built: read our checkpoint and decide whether to continue from it."""
        from volunteer import checkpoint
        from volunteer.paths import node_dir

        try:
            path, lock = checkpoint.claim_slot(node_dir(self.options.data_dir, self.run.run_id, self._swarm))
        except (checkpoint.CheckpointError, OSError) as exc:
            self._emit(f"no checkpoints for this node: {exc}", EventLevel.WARNING, "checkpoint")
            return checkpoint.Resume(None)
        self._checkpointer = checkpoint.Checkpointer(
            path, self.run.run_id, self._swarm, self.options.resources.checkpoint_interval_s,
            notify=lambda level, text: self._emit(text, EventLevel(level), "checkpoint"), lock=lock,
        )
        return checkpoint.prepare_resume(path, self.run.run_id, self._swarm, self._views.get(self._swarm, []),
                                         self.snapshot().peer_id, can_sync=self._can_download_layer())

    def _finish_resume(self, resume: Any) -> None:
        """Once the stage is built: load the checkpoint (under the worker's lock) and say what happened."""
        from volunteer import checkpoint

        if resume.state is not None:
            try:
                checkpoint.restore(self.peer.worker, resume.state)
            except checkpoint.CheckpointError as exc:
                checkpoint.move_aside(self._checkpointer.path, checkpoint.CORRUPT_SUFFIX)
                self._emit(f"not using the checkpoint: {exc}", EventLevel.WARNING, "checkpoint")
                return
            self._checkpointer.mark_restored(resume.state)
        if resume.message:
            self._emit(resume.message, EventLevel.WARNING if resume.warning else EventLevel.INFO, "checkpoint")

    def _can_download_layer(self) -> bool:
        """Whether this node can take its layer from peers instead of a checkpoint the swarm has outrun.

        Yes: _start_training passes ``sync_from`` to SwarmPeer.start (swarm/averaging/sync.py), which
        downloads the layer from a peer, or keeps the weights it has when no peer answers.
        """
        return True

    def _save_checkpoint(self, why: str, periodic: bool = False) -> None:
        if self._checkpointer is not None and self.peer is not None and self.peer.worker is not None:
            try:
                self._checkpointer.save(self.peer.worker, why, periodic)
            except Exception as exc:  # capturing failed (a torch error): training goes on, the user is told
                logger.exception("checkpoint capture failed")
                self._emit(f"could not save a checkpoint: {exc}", EventLevel.WARNING, "checkpoint")

    def _set_state(self, state: NodeState, reason: str) -> None:
        self._publish(state=state, reason=reason)
        self._announce()

    def _record(self, state: str) -> Any:
        from swarm.records import MemberRecord

        snap = self.snapshot()
        return MemberRecord(
            peer_id=snap.peer_id,
            state=state,
            version=__version__,
            started_at=float(self._started_at_dht),
            updated_at=float(time.time()),
            throughput=float(snap.samples_per_s),
            loss=float(snap.loss) if snap.loss is not None else -1.0,
            clock=int(snap.clock),
            served=int(snap.microbatches_served),
            shard=self._shard if self._shard is not None else -1,
            param_version=int(self._metrics.param_version) if self._metrics else 0,
            # only our own evaluations (layer0); the snapshot may show one copied from another peer
            test_accuracy=_or(self._metrics.test_accuracy if self._metrics else None, -1.0),
            test_loss=_or(self._metrics.test_loss if self._metrics else None, -1.0),
            eval_samples=int(self._metrics.eval_samples) if self._metrics else 0,
            trained=int(self._metrics.trained) if self._metrics else 0,
            lost=int(self._metrics.lost) if self._metrics else 0,
        )

    def _rebalance_shard(self) -> None:
        """layer0: leave a shard another peer also holds for one nobody holds (peers that joined together)."""
        from swarm.data import rebalance_shard

        if self._swarm != "layer0" or self._shard is None or self.peer is None:
            return
        me = str(self.dht.peer_id)
        others = {r.peer_id: r.shard for r in self._views.get("layer0", [])
                  if r.state == "online" and r.peer_id != me and r.shard >= 0}
        moved = rebalance_shard(self.run.data.shards, self._shard, me, others)
        if moved is None:
            return
        self._emit(f"moving to data shard {moved}: shard {self._shard} is also held by another peer and "
                   f"{moved} by nobody", kind="shard")
        self._shard = moved
        self.peer.set_shard(moved)

    def _announce(self, ttl_s: float | None = None, timeout_s: float | None = None) -> bool:
        if self.membership is None or not self._swarm:
            return False
        state = self.snapshot().state.value
        try:
            if self.membership.announce(self._swarm, self._record(state), ttl_s=ttl_s, timeout_s=timeout_s):
                return True
            logger.info("announce of %s was not stored by any DHT node", self._swarm)
        except Exception as exc:
            logger.warning("announce failed: %s", exc)
        return False

    def _heartbeat(self) -> None:
        self._publish(**self._work_fields())
        self._announce()
        try:
            self._views = self.membership.read_all()
        except Exception as exc:
            logger.warning("reading the swarms failed: %s", exc)
        if self.peer is not None:
            self._rebalance_shard()
            self.peer.update_views(self._views)
        self._history_speed.append(self.snapshot().samples_per_s)
        if self.snapshot().loss is not None:
            self._history_loss.append(self.snapshot().loss)
        self._publish(**self._view_fields(), **self._resource_fields(),
                      samples_per_s_history=tuple(self._history_speed), loss_history=tuple(self._history_loss))

    def _work_fields(self) -> dict[str, Any]:
        if self.peer is None:
            return {}
        from volunteer.device import gpu_memory_bytes

        m = self.peer.metrics()
        self._metrics = m
        fields: dict[str, Any] = dict(
            samples_per_s=round(m.samples_per_s, 2), loss=m.loss, clock=m.clock, microbatches_served=m.served,
            bytes_in=m.bytes_in, bytes_out=m.bytes_out, gpu_memory_bytes=gpu_memory_bytes(self.peer.device),
        )
        if m.test_accuracy is not None or m.test_loss is not None:
            fields.update(test_accuracy=m.test_accuracy, test_loss=m.test_loss)
        else:
            fields.update(self._run_evaluation())
        state = self.snapshot().state
        if self._throttled and state == NodeState.ONLINE:
            fields["reason"] = self._budget.reason()
        elif m.blocked_reason and state == NodeState.ONLINE:
            fields["reason"] = f"waiting: {m.blocked_reason}"
        elif state == NodeState.ONLINE:
            fields["reason"] = ""
        return fields

    def _run_evaluation(self) -> dict[str, Any]:
        """The newest evaluation any layer0 peer published (for peers that do not evaluate)."""
        published = [r for r in self._views.get("layer0", []) if r.test_accuracy >= 0 or r.test_loss >= 0]
        if not published:
            return {}
        latest = max(published, key=lambda r: r.eval_samples)
        return {"test_accuracy": latest.test_accuracy if latest.test_accuracy >= 0 else None,
                "test_loss": latest.test_loss if latest.test_loss >= 0 else None}

    def _view_fields(self) -> dict[str, Any]:
        from swarm.membership import summarize

        now = time.time()
        me = self.snapshot().peer_id
        swarms = []
        for name in self.run.swarm_names:
            online, throughput, best_loss = summarize(self._views.get(name, []))
            swarms.append(SwarmRow(name=name, online=online, total=len(self._views.get(name, [])),
                                   throughput=throughput, best_loss=best_loss))
        if swarms:
            weakest = min(swarms, key=lambda s: (s.online > 0, s.throughput, s.online))
            swarms = [replace(s, bottleneck=(s is weakest and len(swarms) > 1)) for s in swarms]
        peers = tuple(
            PeerRow(
                peer_id=r.peer_id, state=r.state, age_s=round(max(0.0, now - r.updated_at), 1), version=r.version,
                throughput=r.throughput, loss=r.loss_or_none, clock=r.clock, shard=r.shard_or_none,
                is_me=(r.peer_id == me),
            )
            for r in self._views.get(self._swarm, [])
        )
        return {"swarms": tuple(swarms), "peers": peers}

    def _resource_fields(self) -> dict[str, Any]:
        try:
            import psutil

            if self._process is None:
                self._process = psutil.Process(os.getpid())
            with self._process.oneshot():
                return {"cpu_percent": self._process.cpu_percent(), "memory_bytes": self._process.memory_info().rss}
        except Exception:
            return {}

    def _leave(self) -> None:
        if self._governor is not None:
            self._governor.close()
        if self.peer is not None:
            # Take no new work (drivers get "paused" and route around us), let in-flight work finish,
            # then announce offline with final figures.
            self.peer.pause()
            if not self.peer.drain(LEAVE_DRAIN_S):
                self._emit("left with micro-batches in flight; their drivers retry them elsewhere", kind="offline")
            self._publish(**self._work_fields())
        if self.membership is not None and self._swarm:
            self._publish(state=NodeState.OFFLINE, reason="left the swarm")
            if self._announce(ttl_s=max(OFFLINE_TTL_S, self.run.timeouts.record_ttl_s),
                              timeout_s=min(LEAVE_ANNOUNCE_TIMEOUT_S, self.run.timeouts.rpc_s)):
                self._emit("announced offline", kind="offline")
            else:
                self._emit(f"could not announce offline (no DHT peer answered in {LEAVE_ANNOUNCE_TIMEOUT_S:.0f} s); "
                           f"our record expires within {self.run.timeouts.record_ttl_s:.0f} s", kind="offline")
        if self.peer is not None:
            self._save_checkpoint("exit")
            self.peer.stop()
            self.peer = None
        if self._checkpointer is not None:
            self._checkpointer.close()
        if self.dht is not None:
            from swarm.dht import shutdown_dht

            shutdown_dht(self.dht)
            self.dht = None
        if self._identity_lock is not None:
            self._identity_lock.release()
        self._publish(state=NodeState.OFFLINE, reason=self.error or "stopped")


def _or(value: float | None, default: float) -> float:
    return float(value) if value is not None else default
