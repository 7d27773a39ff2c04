"""The node's lifecycle: join the DHT, pick and announce a swarm, serve (tick the parts), leave cleanly.

Lifecycle: joining -> (syncing) -> online <-> paused / finishing -> offline.
The engine runs on its own thread; it reports through the board (snapshots and events) and takes
``Command``s from any thread (the TUI, or ``volunteer ctl`` through the control socket the node
serves). Everything it waits on is an Event with a timeout, so a quit or a Ctrl+C is honoured
within a fraction of a second.

The serve loop ticks its parts in order (``Node.parts``): commands, governors, health, checkpoints,
contribution, completion, the rebalancer (`--swarm auto`: ``move_to`` the bottleneck swarm), reachability
(can other hosts dial us: volunteer/node/reachability.py), then the announcer. A new part (say, a health guard) is a class with ``tick(now_s)`` and ``close()`` that
publishes snapshot fields through ``node.board.publish`` and changes state with ``node.set_state``;
it is inserted in ``parts`` before the announcer so that its state is in the next heartbeat.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from volunteer.heap import HeapTrimmer
from volunteer.node.announcer import Announcer
from volunteer.node.board import Board, Part
from volunteer.node.checkpoints import Checkpoints
from volunteer.node.commands import Commands
from volunteer.node.completion import Completion
from volunteer.node.contribution import Contribution
from volunteer.node.governors import Governors
from volunteer.node.health import Health
from volunteer.node.options import JoinError, NodeOptions, RunConflict, RunDoesNotFit
from volunteer.node.reachability import Reachability
from volunteer.node.rebalancer import Rebalancer
from volunteer.snapshot import Command, EventLevel, EventListener, NodeSnapshot, NodeState, SnapshotListener

logger = logging.getLogger(__name__)

TICK_S = 1.0  # snapshot refresh; the DHT heartbeat is slower (timeouts.heartbeat_s)
LEAVE_DRAIN_S = 5.0  # on quit, in-flight backward passes get this long to finish
LEAVE_ANNOUNCE_TIMEOUT_S = 10.0  # on quit, the last record waits this long for a DHT peer (none may be left)


class Node:
    """One volunteer serving one layer swarm. Implements the ``Engine`` protocol of snapshot.py."""

    def __init__(self, options: NodeOptions):
        self.options = options
        self.run = options.run
        self.error: str | None = None
        self.error_exit_code = 1  # the process exit status that fits ``error``
        self.swarm = options.swarm if options.swarm != "auto" else ""
        self.dht: Any = None
        self.membership: Any = None
        self.peer: Any = None  # swarm.pipeline.peer.SwarmPeer once serving
        self._receipt_seed: bytes | None = None  # our receipt key's seed, from the identity (swarm.dht.dht.receipt_seed)
        self.board = Board(NodeSnapshot(
            run_name=self.run.name, run_id=self.run.run_id, swarm=self.swarm or "auto", peer_id="",
            state=NodeState.JOINING, reason="connecting to the swarm", device=options.device,
            log_path=str(options.log_path or ""),
        ))
        self.commands = Commands(self)
        self.governors = Governors(self)
        self.checkpoints = Checkpoints(self)
        self.announcer = Announcer(self)
        self.health = Health(self)
        self.contribution = Contribution(self)
        self.completion = Completion(self)
        self.rebalancer = Rebalancer(self)
        self.reachability = Reachability(self)
        self.parts: list[Part] = [self.commands, self.governors, HeapTrimmer(), self.health, self.checkpoints,
                                  self.contribution, self.completion, self.rebalancer, self.reachability, self.announcer]
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._wake = threading.Event()
        self._serving = threading.Event()  # set once the join is done and the serve loop runs
        self.stop_requested_at_s: float | None = None  # time.monotonic() of the first quit or stop
        self._thread: threading.Thread | None = None
        self._identity_lock: Any = None
        self._control: Any = None

    # ----- Engine protocol
    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="volunteer-engine", daemon=True)
        self._thread.start()

    def snapshot(self) -> NodeSnapshot:
        return self.board.snapshot()

    def command(self, command: Command) -> int:
        """Queue a command; returns a ticket for ``wait_applied``."""
        ticket = self.commands.queue.put(command)
        if command == Command.QUIT:
            self._note_stop()
            self._stop.set()
        self._wake.set()
        return ticket

    def wait_applied(self, ticket: int, timeout: float) -> bool:
        """Wait until the engine has applied the command with this ticket (commands queue while joining)."""
        return self.commands.queue.wait_applied(ticket, timeout)

    def add_listener(self, on_snapshot: SnapshotListener, on_event: EventListener) -> None:
        self.board.add_listener(on_snapshot, on_event)

    def wait_stopped(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    def request_stop(self) -> None:
        self._note_stop()
        self._stop.set()
        self._wake.set()

    def _note_stop(self) -> None:
        if self.stop_requested_at_s is None:
            self.stop_requested_at_s = time.monotonic()

    started = property(lambda self: self._thread is not None)

    @property
    def serving(self) -> bool:
        """False while still starting (loading, DHT, sync): a stop then has nothing to hand over."""
        return self._serving.is_set()

    def abandon(self) -> None:
        """The process is about to exit during startup without waiting for this thread: remove what
        would outlive it here (the control socket); the watchdog's group holds the rest."""
        if self._control is not None:
            self._control.close()

    # ----- for the parts
    def wake(self) -> None:
        """Run the next tick now (a part saw something change)."""
        self._wake.set()

    def set_state(self, state: NodeState, reason: str) -> None:
        """Publish a new state and announce it at once (drivers route by it)."""
        self.board.publish(state=state, reason=reason)
        self.announcer.announce()

    # ----- lifecycle
    def _main(self) -> None:
        try:
            if self.options.log_path is not None:
                self.board.emit(f"log file: {self.options.log_path}", kind="log")
            self._start_control()
            self._join()
            if not self._stop.is_set():
                self._serving.set()
                self._serve()
        except JoinError as exc:
            self.error = str(exc)
            self.error_exit_code = exc.exit_code
            self.board.emit(str(exc), EventLevel.ERROR, "error")
        except Exception as exc:  # an engine bug: say it plainly, still leave cleanly
            logger.exception("engine failed")
            self.error = f"the node failed: {exc.__class__.__name__}: {exc}"
            self.board.emit(self.error, EventLevel.ERROR, "error")
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
            self._control = serve_node(self.options.data_dir, self.run.run_id, self.swarm or "auto", self)
        except ControlError as exc:
            self.board.emit(f"`volunteer ctl` cannot reach this node: {exc}", EventLevel.WARNING, "control")
            return
        self.board.emit(f"control socket: {self._control.path} (`volunteer ctl status`)", kind="control")

    def _join(self) -> None:
        emit = self.board.emit
        emit("loading the network and training libraries (hivemind, torch)", kind="joining")
        self._preflight()
        from swarm.dht.dht import (DHTStartError, IdentityInUse, claim_identity, make_validators, receipt_seed,
                                    visible_maddrs)
        from swarm.dht.nodedht import start_node_dht
        from swarm.run.optim_light import without_dynamo
        from swarm.dht.membership import Membership, least_served_swarm, publish_run

        if self._stop.is_set():  # stopped while the libraries loaded
            return
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
        emit(f"starting the DHT (bootstrap: {', '.join(options.initial_peers)})", kind="joining")
        validators = make_validators(run.run_id, run.swarm_names, identity_path)
        self._receipt_seed = receipt_seed(identity_path, run.run_id)
        without_dynamo()  # torch.optim without torch._dynamo, or its import warmed while the DHT starts
        try:
            self.dht = start_node_dht(self._dht_settings(identity_path), validators)  # in this process
        except DHTStartError as exc:
            raise JoinError(str(exc)) from None
        if self._stop.is_set():
            return
        peer_id = str(self.dht.peer_id)
        self.membership = Membership(self.dht, run, validators[0].local_public_key)
        self.board.publish(peer_id=peer_id, maddrs=tuple(visible_maddrs(self.dht)))
        emit(f"joined the DHT as {peer_id[-8:]}", kind="joined")
        # before our first record: readers ignore a record without it (swarm/integrity/identity_work.py)
        from swarm.integrity.identity_work import identity_work

        def say(text: str) -> None:
            emit(text, kind="joining")
            # what the header says while we wait (published only: announcing now would store a record without it)
            self.board.publish(reason="proving this identity's work (once per identity; see the events)")

        work = identity_work(identity_path, peer_id, run.integrity.identity_bits, should_stop=self._stop.is_set,
                             say=say)
        if work is None:  # stopped while proving it
            return
        self.membership.work = work
        self.board.publish(reason="connecting to the swarm")

        if self._stop.is_set():
            return
        self.announcer.read_views(every_swarm=True)
        self._check_other_runs(peer_id)
        publish_run(self.dht, run)
        if not self.swarm:
            self.swarm = least_served_swarm(self.announcer.views, run.swarm_names)
            emit(f"--swarm auto chose {self.swarm} (the least capacity among its serving and arriving peers)",
                 kind="joining")
        self.board.publish(swarm=self.swarm)
        if options.train:
            self._start_training()
        if self._stop.is_set():
            return
        self.set_state(NodeState.ONLINE, "")
        emit(f"online in {self.swarm} of run {run.run_id}", kind="online")

    def _preflight(self) -> None:
        """The data loads, the stages chain, the head fits the labels: checked before the DHT, so a mistake in
        the run config is one line (with the field and the fix) and leaves nothing announced."""
        from volunteer.preflight import PreflightError, check_run

        try:
            check_run(self.run, self.options.swarm)
        except PreflightError as exc:
            where = self.options.run_path or f"run {self.run.name}"
            raise RunDoesNotFit(f"{where}: {exc}") from None

    def _check_other_runs(self, me: str) -> None:
        """Another run of our name with another config: stop with how to join it while ours is empty
        (unless --new-run), else warn that we will not train together."""
        from swarm.dht.membership import other_runs
        from volunteer.node.runs import active_conflict, conflict_message, save_run_config

        run = self.run
        others = other_runs(self.dht, run)
        ours_online = sum(1 for records in self.announcer.views.values() for r in records
                          if r.state == "online" and r.peer_id != me)
        conflict = active_conflict(ours_online, others, self.options.new_run)
        if conflict is not None:
            saved = save_run_config(conflict, run, self.options.data_dir / "runs")
            raise RunConflict(conflict_message(run, conflict, saved, self.options.initial_peers))
        for other in others:
            detail = "; ".join(other.differences) if other.differences else "unknown fields"
            self.board.emit(f"another run named {run.name!r} has a different config (run id {other.run_id}, "
                            f"{other.online} online); you will not train together. Differences: {detail}",
                            EventLevel.WARNING, "run_mismatch")

    def _dht_settings(self, identity_path: Any) -> Any:
        from swarm.dht.dht import DHTSettings

        options = self.options
        return DHTSettings(
            initial_peers=options.initial_peers, host_maddrs=options.host_maddrs,
            announce_maddrs=options.announce_maddrs, identity_path=identity_path, use_relay=options.use_relay,
            use_auto_relay=options.use_auto_relay, client_mode=options.client_mode,
            start_timeout_s=self.run.timeouts.dht_start_s, process_group=options.process_group,
        )

    def _start_training(self) -> None:
        from swarm.pipeline.peer import SwarmPeer
        from swarm.dht.records import dialable
        from volunteer.device import describe_device, resolve_device, set_threads

        try:
            device = resolve_device(self.options.device)
        except ValueError as exc:
            raise JoinError(str(exc)) from None
        threads = set_threads(self.options.cpu_threads)
        described = describe_device(device, threads)
        self.governors.apply_gpu_memory_fraction(device)
        if self.swarm == "layer0":
            self.announcer.choose_shard()
        self.board.emit(f"building {self.swarm} on {described}", kind="joining")
        self.peer = SwarmPeer(self.run, self.dht, self.swarm, device=device, shard=self.announcer.shard,
                              notify=self._on_peer_notice, receipt_seed=self._receipt_seed,
                              snapshot_dir=self.checkpoints.folder())
        resume = self.checkpoints.prepare_resume()
        # A newcomer (or a checkpoint the swarm has outrun) downloads its layer before it serves or drives
        # anything; with a checkpoint to restore, no download is needed.
        # (never from a peer that says nobody can dial it: swarm/dht/reachability.py)
        sync_from = dialable(self.announcer.views.get(self.swarm, [])) if resume.state is None else None
        if sync_from is not None:  # with nobody to download from, say so rather than "downloading" (issue 30)
            others = [r for r in sync_from if r.peer_id != str(self.dht.peer_id)]
            self.set_state(NodeState.SYNCING, f"downloading {self.swarm} from its peers" if others else
                           f"no peer of {self.swarm} online yet: starting from the seeded weights")
        self.peer.start(sync_from=sync_from)
        self.checkpoints.finish_resume(resume)
        self.peer.update_views(self.announcer.views)
        self.board.publish(device=described)

    def _on_peer_notice(self, level: str, kind: str, text: str) -> None:
        self.board.emit(text, EventLevel(level) if level in ("info", "warning", "error") else EventLevel.INFO, kind)

    def _serve(self) -> None:
        self.governors.start()
        while not self._stop.is_set():
            for part in self.parts:
                part.tick(time.monotonic())
            wait_s = min(self.announcer.until_heartbeat_s(time.monotonic()), TICK_S)
            self._wake.wait(timeout=wait_s)
            self._wake.clear()

    def move_to(self, target: str, why: str) -> None:
        """Rebalancing (volunteer/node/rebalancer.py): serve ``target`` instead of our swarm. Like a leave
        and a join without the DHT: take no new work, let in-flight work finish, announce offline in the
        old swarm, checkpoint it, then download the new layer from its peers (syncing) and go online."""
        board, old = self.board, self.swarm
        board.emit(f"moving from {old} to {target}: {why}", kind="rebalance")
        self.set_state(NodeState.SYNCING, f"moving to {target}: finishing the work in flight here")
        self._stand_down(f"moved to {target}", f"moving to {target}", "rebalance")
        self.checkpoints.close()  # the next swarm claims its own checkpoint slot
        self.swarm, self.announcer.shard = target, None
        board.publish(swarm=target)
        self.set_state(NodeState.SYNCING, f"moving to {target}: downloading it from its peers")  # counted there now
        self.announcer.read_views(every_swarm=True)
        if self._stop.is_set():
            return
        try:
            self._start_training()
        except JoinError as exc:
            raise JoinError(f"could not serve {target} after moving from {old}: {exc}") from None
        if not self._stop.is_set():
            self.set_state(NodeState.ONLINE, "")
            board.emit(f"online in {target} (moved from {old})", kind="online")

    def _stand_down(self, reason: str, checkpoint_why: str, kind: str) -> None:
        """Stop serving our swarm (a leave, or a move to another): take no new work (drivers get "paused"
        and route around us), let in-flight work finish, announce offline with final figures,
        checkpoint, stop the stage."""
        board, run = self.board, self.run
        if self.peer is not None:
            self.peer.pause()
            if not self.peer.drain(LEAVE_DRAIN_S):
                board.emit("stopped with micro-batches in flight; their drivers retry them elsewhere", kind=kind)
            board.publish(**self.announcer.work_fields())
        # stopped while proving its identity's work: nothing was announced, so nothing to take back
        proven = self.membership is not None and (self.membership.work >= 0 or run.integrity.identity_bits <= 0)
        if self.membership is not None and self.swarm:
            board.publish(state=NodeState.OFFLINE, reason=reason)
        if proven and self.swarm:
            # The offline record lives exactly one record lifetime, like a heartbeat: the DHT keeps whichever
            # entry of a subkey expires later, so a longer-lived offline record would hide our own restart
            # (its first heartbeat expires sooner) until it ran out; this one always expires first.
            if self.announcer.announce(ttl_s=run.timeouts.record_ttl_s,
                                       timeout_s=min(LEAVE_ANNOUNCE_TIMEOUT_S, run.timeouts.rpc_s)):
                board.emit(f"announced offline in {self.swarm}", kind=kind)
            else:
                board.emit(f"could not announce offline (no DHT peer answered in {LEAVE_ANNOUNCE_TIMEOUT_S:.0f} s); "
                           f"our record expires within {run.timeouts.record_ttl_s:.0f} s", kind=kind)
        if self.peer is not None:
            self.checkpoints.save(checkpoint_why)
            self.peer.stop()
            self.peer = None

    def _leave(self) -> None:
        """Take no new work (drivers get "paused" and route around us), let in-flight work finish, announce
        offline with final figures, checkpoint, then stop the stage and the DHT."""
        self.governors.close()  # first: no policy verdict may resume a leaving node
        board = self.board
        self._stand_down("left the swarm", "exit", "offline")
        for part in self.parts:
            part.close()
        if self.dht is not None:
            from swarm.dht.dht import shutdown_dht

            shutdown_dht(self.dht)
            self.dht = None
        if self._identity_lock is not None:
            self._identity_lock.release()
        board.publish(state=NodeState.OFFLINE, reason=self.error or "stopped")
