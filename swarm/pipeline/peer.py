"""A peer's training runtime: its stage worker served over RPC, and (on layer0) the driver and evaluator.

Runs an asyncio loop on its own thread, with a replica of the DHT's P2P daemon connection; compute happens on one
separate thread (torch is not re-entrant-friendly and one stage wants one core). The node (volunteer/node/) feeds
it the swarms' records and reads ``metrics()``; every method here is safe to call from the node's thread. Every
peer also serves its layer's parameters (swarm/averaging/params_rpc.py) and keeps its copy close to the swarm's
(swarm/averaging): a newcomer downloads its layer in ``start(sync_from=...)`` before it serves or drives anything.
What it checks of what it is sent beside its gate: swarm/pipeline/peer_checks.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import uvloop

from swarm.dht.records import MemberRecord, dialable
from swarm.integrity.receipts import verification_stats
from swarm.run.runconfig import EDGE_MODES, RunConfig
from swarm.pipeline.peer_checks import attach_checks, prefetch_keys
from swarm.pipeline.peer_eval import Evaluations
from swarm.pipeline.peer_metrics import PeerMetrics, collect_metrics
from swarm.pipeline.peer_views import HELD_MEMORY_VIEWS, HeldShards  # noqa: F401  (HELD_MEMORY_VIEWS re-exported)
from swarm.pipeline.transport.sessions import close_sessions
from swarm.pipeline.stage.worker import StageWorker
from swarm.pipeline.stage.stage_gate import StageGate
from swarm.pipeline.stage.stage_rpc import Traffic, make_servicer, stage_namespace

logger = logging.getLogger(__name__)

SETUP_TIMEOUT_S = 60.0
DRAIN_TIMEOUT_S = 60.0
TEARDOWN_TASKS_S = 2.0  # the sessions this stage serves get this long to end at a stop, once cancelled
DRAIN_STALLED_S = 1.5  # a drain gives up when none of our hops has answered for this long
CLAIM_GRACE_HEARTBEATS = 3  # a new shard claim stays open to the other drivers this long (integrity/labels.py)

Notify = Callable[[str, str, str], None]  # (level, kind, text)


class SwarmPeer:
    def __init__(self, run: RunConfig, dht: Any, swarm: str, *, device: str = "cpu", shard: int | None = None,
                 notify: Notify | None = None, evaluate: bool = True, receipt_seed: bytes | None = None,
                 snapshot_dir: Any = None):
        self.run = run
        self.dht = dht
        self.swarm = swarm
        self.index = int(swarm.removeprefix("layer"))
        self.device = device
        self.shard = shard
        self.notify = notify or (lambda level, kind, text: None)
        self.evaluate_enabled = evaluate
        self.traffic = Traffic()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"compute-{swarm}")
        self.worker: StageWorker | None = None
        self.driver: Any = None
        self.p2p: Any = None
        self._servicer: Any = None
        self.gate: StageGate | None = None  # who may ask our stage (swarm/pipeline/stage/stage_gate.py)
        self._params_servicer: Any = None
        self._dial_back_servicer: Any = None
        self._held = HeldShards()  # shards held by other drivers, in the last reads of layer0
        self.averaging: Any = None  # swarm.averaging.agent.SwarmAveraging
        self.allreduce: Any = None  # swarm.averaging.allreduce.GroupAverager (mode allreduce)
        self.edges: Any = None  # swarm.averaging.edges.EdgeAveraging (modes dsgd, pdmm_isvr, admm_isvr)
        self._edge_servicer: Any = None
        self._synced = False
        self._loop = uvloop.new_event_loop()  # libuv's loop: ~5 % less CPU a digits micro-batch than asyncio's
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"rpc-{swarm}", daemon=True)
        self._tasks: list[asyncio.Task] = []
        self._accepting = True
        self.healer: Any = None  # swarm.integrity.heal.Healer
        self.snapshot_dir = snapshot_dir  # healing's snapshots go to files there (None: kept in memory)
        self.evaluations = Evaluations(run, self.notify, accepting=lambda: self._accepting)  # on layer0
        # receipts (swarm/integrity/receipts.py): our per-run signing key (derived from the identity when the node
        # passes a seed, so a restarted peer keeps it) and the keys of the peers whose receipts we check
        from swarm.integrity.receipts import ReceiptKey
        from swarm.pipeline.transport.keybook import KeyBook, fetch_receipt_key

        from swarm.dht.reachability import RecentAnswers

        self.reach_answers = RecentAnswers()  # the dial-backs' answers of the last 30 s (reachability retries)
        self.receipt_key = ReceiptKey(str(dht.peer_id), receipt_seed)
        self.keys = KeyBook(lambda peer_id, swarm: fetch_receipt_key(self.p2p, run.run_id, peer_id, swarm))

    # ----- lifecycle
    def start(self, sync_from: list[MemberRecord] | None = None) -> None:
        """Build the stage, register its RPCs, start the driver on layer0. Blocks until serving. ``sync_from``: our
        swarm's records; a newcomer first downloads its layer from one of them (``None``: the seeded initial weights)."""
        from swarm.integrity.heal import Healer
        from swarm.integrity.snapshots import SnapshotStore

        self.worker = StageWorker(self.run, self.index, self.device)
        self.healer = Healer(self.worker, self.notify, store=SnapshotStore(self.snapshot_dir, self.notify))
        self.worker.add_step_hook(self.healer.on_step)
        self._thread.start()
        sync_s = self.run.averaging.sync_timeout_s if sync_from is not None else 0.0
        asyncio.run_coroutine_threadsafe(self._setup(sync_from), self._loop).result(SETUP_TIMEOUT_S + sync_s)

    async def _setup(self, sync_from: list[MemberRecord] | None = None) -> None:
        from swarm.dht.dht import fresh_p2p

        from swarm.pipeline.stage.stage_receipts import ReceiptDesk

        self.p2p = await fresh_p2p(self.dht)
        self.gate = await self._make_gate()
        self._servicer = make_servicer(
            self.worker, self.executor, max_bytes=int(self.run.training.max_payload_mb * 2**20),
            codec=self.run.training.codec, rank=self.run.training.wire_rank, is_accepting=lambda: self._accepting,
            traffic=self.traffic, gate=self.gate,
            desk=ReceiptDesk(self.run.run_id, self.index, self.receipt_key, self.keys))
        attach_checks(self)  # convictions re-checked, stage 0's outputs recomputed, pushes (swarm/pipeline/peer_checks.py)
        await self._servicer.add_p2p_handlers(self.p2p, namespace=stage_namespace(self.run.run_id, self.swarm))
        from swarm.dht.reachability import DialBackServicer, namespace

        self._dial_back_servicer = DialBackServicer(self.run.run_id)
        await self._dial_back_servicer.add_p2p_handlers(self.p2p, namespace=namespace(self.run.run_id))
        await self._start_averaging(sync_from)
        self.healer.take_snapshot()  # the starting copy (seeded or downloaded) is the first good one
        self._tasks.append(asyncio.create_task(self._guard(self.healer.watch(self.executor), "healer")))
        if self.index == 0:
            await self._start_driver()

    async def _make_gate(self) -> StageGate:
        """Who may ask this stage, and (last stage) the run's targets by sample id."""
        from swarm.run.data import load_dataset, make_shards
        from swarm.integrity.labels import LabelSource
        from swarm.dht.membership import Membership

        loop = asyncio.get_running_loop()
        labels = None
        if self.worker.is_last:
            dataset = await loop.run_in_executor(self.executor, load_dataset, self.run.data, self.run.model)
            shards = make_shards(dataset.y_train, self.run.data, dataset.num_classes)
            labels = LabelSource(dataset.y_train, dataset.y_test, shards)
        reader = Membership(self.dht, self.run, b"")

        async def read_drivers() -> list[MemberRecord]:
            return await loop.run_in_executor(None, reader.read, "layer0")

        # a shard claim reaches the other drivers at their next read: a read each heartbeat, plus one missed
        gate = StageGate(self.run.integrity, labels=labels, refresh=read_drivers, notify=self.notify,
                         cache=self.worker.cache, swarm=self.swarm, balance=self.run.data.partition == "label_skewed",
                         claim_grace_s=CLAIM_GRACE_HEARTBEATS * self.run.timeouts.heartbeat_s)
        self.worker.on_probation = lambda owner: gate.book.on_probation(owner, time.monotonic())
        return gate

    async def _start_averaging(self, sync_from: list[MemberRecord] | None) -> None:
        from swarm.averaging.agent import SwarmAveraging
        from swarm.averaging.params_rpc import ParamsServicer
        from swarm.averaging.sync import sync_layer

        me = str(self.dht.peer_id)
        self._params_servicer = ParamsServicer(self.worker, run_id=self.run.run_id, swarm=self.swarm,
                                               is_ready=lambda: self._synced, traffic=self.traffic)
        await self._params_servicer.add_p2p_handlers(self.p2p, namespace=stage_namespace(self.run.run_id, self.swarm))
        self.averaging = SwarmAveraging(self.run, self.swarm, me, self.worker, self.p2p, self.executor, self._loop,
                                        self.notify, traffic=self.traffic)
        if sync_from is not None:
            await sync_layer(self.averaging, sync_from)
        self._synced = True
        self.averaging.start()
        mode = self.run.averaging.mode
        if mode == "allreduce":
            from swarm.averaging.allreduce import GroupAverager

            self.allreduce = GroupAverager(self.averaging)
            await self.allreduce.start()
        elif mode in EDGE_MODES:
            from swarm.averaging.edges import EdgeAveraging

            self.edges = EdgeAveraging(self.run, self.swarm, me, self.worker, self._loop, self.notify, p2p=self.p2p,
                                       traffic=self.traffic)
            self._edge_servicer = self.edges.servicer()
            await self._edge_servicer.add_p2p_handlers(self.p2p, namespace=stage_namespace(self.run.run_id, self.swarm))
            self.edges.start()

    async def _start_driver(self) -> None:
        from swarm.run.data import load_dataset, make_shards
        from swarm.pipeline.control.driver import PipelineDriver

        loop = asyncio.get_running_loop()
        dataset = await loop.run_in_executor(self.executor, load_dataset, self.run.data, self.run.model)
        shards = make_shards(dataset.y_train, self.run.data, dataset.num_classes)
        shard = self.shard if self.shard is not None else 0
        self._serve_replicas(dataset)
        self.driver = PipelineDriver(
            self.run, self.worker, self.p2p, self.executor, dataset, shards, shard % len(shards),
            peer_tag=str(self.dht.peer_id)[-8:], seed=shard, traffic=self.traffic, keys=self.keys,
            notify=lambda level, text: self.notify(level, "pipeline", text), receipt_key=self.receipt_key)
        self._tasks.append(asyncio.create_task(self._guard(self.driver.run_forever(), "driver")))
        self.evaluations.driver, self.evaluations.worker = self.driver, self.worker
        if self.evaluate_enabled:
            self._tasks.append(asyncio.create_task(self._guard(self.evaluations.run_forever(), "evaluator")))

    def _serve_replicas(self, dataset: Any) -> None:
        """Stage 0 recomputes its output on sample ids for layer1's spot checks (swarm/pipeline/stage/stage0_replicas.py),
        for the online layer1 peers of the last views only."""
        from swarm.pipeline.stage.stage0_replicas import ReplicaDoor, ReplicaService

        x_train = dataset.x_train
        self._servicer.replicas = ReplicaService(ReplicaDoor(), lambda ids: x_train[ids], len(x_train),
                                                 self.run.training.batch_size)

    async def _guard(self, coro: Any, name: str) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("%s failed", name)
            self.notify("error", "error", f"the {name} failed: {exc.__class__.__name__}: {exc}")

    def start_final_evaluation(self, deadline_s: float) -> concurrent.futures.Future | None:
        """layer0, when it finishes (our weights have stopped moving): one more evaluation of the pipeline,
        run on our loop so the node's engine keeps ticking. Retried until ``deadline_s`` from now (a hop can
        time out on a busy machine, a stage can be between peers). None when there is nothing to evaluate;
        else a future of True (published) or False (it could not run: the user was told why)."""
        if self.driver is None or self.driver.stats.trained == 0 or not self._thread.is_alive():
            return None
        return asyncio.run_coroutine_threadsafe(self.evaluations.final(time.monotonic() + deadline_s), self._loop)

    def reset_good_snapshot(self) -> None:
        """The copy was replaced from outside (a checkpoint restored): make it the last good one."""
        if self.healer is not None:
            self.healer.take_snapshot()

    def stop(self) -> None:
        """Stop the driver, unregister the RPCs, stop the loop. Idempotent; bounded in time."""
        if not self._thread.is_alive():
            self.executor.shutdown(wait=False, cancel_futures=True)
            if self.healer is not None:
                self.healer.close()
            return

        async def _teardown() -> None:
            replies = getattr(self._servicer, "replies", None)
            logger.info("at the stop: receipt signatures %s; resends replayed %s; tensor bytes (in, out) by op %s; "
                        "weight versions %s", verification_stats(), getattr(replies, "replayed", 0), self.traffic.by_op,
                        {**w.ring.counts(), "declined": w.health.declined} if (w := self.worker) is not None else "-")
            if self.driver is not None:
                self.driver.stop()
            if self._servicer is not None and self._servicer.spot0 is not None:
                await self._servicer.spot0.close()
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            for part in (self.allreduce, self.edges, self.averaging):
                if part is not None:
                    await part.close()
            for servicer in (self._edge_servicer, self._params_servicer, self._servicer):
                if servicer is not None and self.p2p is not None:
                    try:
                        await servicer.remove_p2p_handlers(self.p2p, namespace=stage_namespace(self.run.run_id, self.swarm))
                    except Exception as exc:
                        logger.debug("removing %s: %s", servicer.__class__.__name__, exc)
            if self._servicer is not None and self.p2p is not None:
                # sessions others hold with this stage end while the loop runs (a coroutine left pending is closed
                # later by the garbage collector, on a stopped loop, and says so on stderr)
                await self._servicer.end_sessions(TEARDOWN_TASKS_S)
            if self._dial_back_servicer is not None and self.p2p is not None:
                from swarm.dht.reachability import namespace

                try:
                    await self._dial_back_servicer.remove_p2p_handlers(self.p2p, namespace=namespace(self.run.run_id))
                except Exception as exc:
                    logger.debug("removing the dial-back handler: %s", exc)
            if self.p2p is not None:
                await asyncio.gather(*close_sessions(self.p2p), return_exceptions=True)
                try:
                    await self.p2p.shutdown()
                except Exception as exc:
                    logger.debug("p2p replica shutdown: %s", exc)

        try:
            asyncio.run_coroutine_threadsafe(_teardown(), self._loop).result(10.0)
        except Exception as exc:
            logger.debug("teardown: %s", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.healer is not None:
            self.healer.close()

    # ----- work control
    def pause(self) -> None:
        """Stop taking new work now; backward passes of in-flight micro-batches are still served."""
        self._accepting = False
        if self.driver is not None:
            self._loop.call_soon_threadsafe(self.driver.pause)

    def resume(self) -> None:
        self._accepting = True
        if self.driver is not None:
            self._loop.call_soon_threadsafe(self.driver.resume)

    def drain(self, timeout_s: float = DRAIN_TIMEOUT_S, stop: threading.Event | None = None,
              stalled_s: float = DRAIN_STALLED_S) -> bool:
        """After pause(): wait until our own micro-batches are done and our cached forwards used. Gives up
        early when nothing moves for ``stalled_s``, or for twice our slowest micro-batch lately (a pushed one is
        one call: nothing moves here until it is back): no hop of ours answered, no micro-batch ended and nobody's
        request is being computed here (when the whole run stops at once, or the next swarm left before us,
        our lanes only retry peers that are gone; waiting for them was 5 s of every leave)."""
        deadline = time.monotonic() + timeout_s
        stalled_s = max(stalled_s, 2 * self.driver.round_trip_s) if self.driver is not None else stalled_s
        progress, moved_at = self._progress(), time.monotonic()
        while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
            if self.in_flight() == 0:
                return True
            now, seen = time.monotonic(), self._progress()
            if seen != progress or (self._servicer is not None and self._servicer.active):
                progress, moved_at = seen, now
            elif now - moved_at >= stalled_s:
                break
            time.sleep(0.1)
        return self.in_flight() == 0

    def _progress(self) -> tuple[int, ...]:
        stats = self.driver.stats if self.driver is not None else None
        return (stats.hops_ok, stats.trained, stats.lost, stats.refused) if stats is not None else ()

    def in_flight(self) -> int:
        """Our own micro-batches in the pipeline plus requests being computed here right now.

        Saved forwards waiting for a backward do not count: if we leave, their driver re-sends the
        input to another peer of the swarm, so nothing is lost by not waiting for them.
        """
        driving = 0
        if self.driver is not None and not self.driver.stats.waiting_for:  # stuck at an empty swarm: nothing to wait for
            driving = self.driver.in_flight
        return driving + (self._servicer.active if self._servicer is not None else 0)

    # ----- views and metrics
    def check_reachability(self, responders: list[str]) -> Any:
        """Ask some of responders (peer ids) to dial us back (swarm/dht/reachability.py): a concurrent future
        of the Verdict, so the caller's loop does not wait."""
        from swarm.dht.reachability import check_reachability

        return asyncio.run_coroutine_threadsafe(check_reachability(self.p2p, self.run.run_id, responders,
                                                                   recent=self.reach_answers), self._loop)

    def update_views(self, views: dict[str, list[MemberRecord]], fresh: set[str] | None = None) -> None:
        """The swarms as last read; ``fresh``: the swarms read this heartbeat (None: all of them). A swarm is
        not read every heartbeat (swarm/dht/membership.py ``read_period``): what counts reads (which shards the
        last reads showed held, the gate's last views of the drivers) takes a view only when it is new, so
        that one read that missed a record is not counted as several."""
        layer0_fresh = fresh is None or "layer0" in fresh
        self.evaluations.note_views(views)
        if self.gate is not None and layer0_fresh:  # every driver, reachable or not: the labels need each one's shard
            self._loop.call_soon_threadsafe(self.gate.set_drivers, list(views.get("layer0", [])))
        # Nobody dials a peer that says it cannot be dialled (behind NAT): no route, pull or edge to it. A peer
        # that cannot be dialled itself takes no edges either (its neighbours would wait on swaps it cannot
        # answer), and it still pulls and drives, since that dials out.
        me = str(self.dht.peer_id)
        every = views
        views = {name: dialable(records, me) for name, records in views.items()}
        mine = [r for r in views.get(self.swarm, []) if r.peer_id == me]
        if self.averaging is not None:
            self._loop.call_soon_threadsafe(self.averaging.set_records, list(views.get(self.swarm, [])))
        if self.edges is not None:
            cut_off = bool(mine) and mine[0].reachable == 0
            self._loop.call_soon_threadsafe(self.edges.set_records, mine if cut_off else list(views.get(self.swarm, [])))
        if self.averaging is not None:
            self._loop.call_soon_threadsafe(self.averaging.set_views, dict(views))
        prefetch_keys(self, views)
        replicas = self._servicer.replicas if self._servicer is not None else None
        if replicas is not None:  # who may ask our stage 0 to recompute: the online layer1 peers
            callers = [r.peer_id for r in every.get("layer1", []) if r.state == "online"]
            self._loop.call_soon_threadsafe(replicas.door.set_callers, callers)
        if self.driver is None:
            return
        online = {name: [r.peer_id for r in records if r.state == "online"] for name, records in views.items()}
        self._held.note(every.get("layer0", []), me, fresh=layer0_fresh)
        unheld = self._held.unheld(len(self.driver.shards))

        def apply() -> None:
            for name, ids in online.items():
                if name != "layer0":
                    self.driver.set_peers(name, ids)
            self.driver.cover_shards(unheld)
            self.driver.others_seen_at = time.monotonic() if set(online.get("layer0", ())) - {me} else \
                self.driver.others_seen_at
        self._loop.call_soon_threadsafe(apply)

    def set_shard(self, shard: int) -> None:
        """layer0: drive our micro-batches from another shard (the next views recompute the coverage)."""
        self.shard = shard
        if self.driver is not None:
            self._loop.call_soon_threadsafe(self.driver.set_own_shard, shard % len(self.driver.shards))

    def metrics(self) -> PeerMetrics:
        assert self.worker is not None
        heal = self.healer.status() if self.healer is not None else None
        return collect_metrics(self.worker, self.traffic, self.in_flight(), heal, self.driver, self.evaluations,
                               self.gate, self._servicer.spot0 if self._servicer is not None else None)
