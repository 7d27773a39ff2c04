"""The node's voice on the DHT: announce our record, heartbeat, read the swarms, publish what we see.

Each heartbeat (``timeouts.heartbeat_s``) refreshes our signed MemberRecord, re-reads the swarms
it needs (a driver all of them, a server its own, and the others every few heartbeats), moves a layer0 node off a shared data shard, and publishes the view (swarms, peers,
run evaluation, resources, sparklines) in the snapshot; between heartbeats only our own work
figures are refreshed. The record and the view are built by pure functions in records.py.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from volunteer import __version__
from volunteer.node.records import StallClock, build_record, run_evaluation, shown_samples_per_s, view_fields
from volunteer.snapshot import NodeState

if TYPE_CHECKING:
    from volunteer.node.core import Node

logger = logging.getLogger(__name__)

SPARKLINE_POINTS = 120
# a driver held at an empty swarm reads that swarm this often between heartbeats (its get is of an empty key: cheap),
# each read bounded by AWAITED_READ_TIMEOUT_S (the node's thread waits on it; a slow DHT is the heartbeat's to wait for)
AWAITED_READ_S = 1.0
AWAITED_READ_TIMEOUT_S = 1.0


class Announcer:
    def __init__(self, node: Node):
        self.node = node
        self.views: dict[str, list[Any]] = {}  # swarm name -> its records, as last read
        self.read_at_s: dict[str, float] = {}  # swarm name -> wall time of that read (the dashboard judges by it)
        self.shard: int | None = None  # layer0: the data shard we hold
        self.metrics: Any = None  # the stage's last metrics (swarm.pipeline.peer)
        self.started_at_s = time.time()
        self.next_beat_s = 0.0  # monotonic
        self._announced_eval_at = -1.0  # the evaluation (its wall time) our record carries
        self._early = False  # a record announced between two heartbeats for a new evaluation (one at most)
        self._awaited_read_s = float("-inf")  # monotonic: our last read of the empty swarm our driver waits on
        self._awaited_every_s = AWAITED_READ_S  # doubled by each read that failed (a slow DHT), up to a heartbeat
        self._process: Any = None
        self._history_speed: deque[float] = deque(maxlen=SPARKLINE_POINTS)
        self._history_loss: deque[float] = deque(maxlen=SPARKLINE_POINTS)
        from swarm.pipeline.transport.traffic import LinkRates

        self.rates = LinkRates()
        from swarm.dht.membership import ReadSchedule

        self.reads = ReadSchedule()  # which swarms each heartbeat reads (swarm/dht/membership.py read_period)
        self.fresh: set[str] = set()  # the swarms the last heartbeat read
        self.stall = StallClock()  # seconds online without a completed micro-batch (status, dashboard, record)
        self._said_predicting = False  # the event that weight prediction is at work here (once a process)

    def tick(self, now_s: float) -> None:
        if now_s >= self.next_beat_s:
            self.heartbeat()
            self.next_beat_s = now_s + self.node.run.timeouts.heartbeat_s
            self._early = False
        else:
            self.node.board.publish(**self.work_fields())
            # a fresh figure is published now, not up to a heartbeat later; at most one such record between two
            # heartbeats (evaluations come every 2 s on a small model: a DHT store each would triple a layer0 peer's)
            if not self._early and self._new_evaluation():
                self._early = True
                self.announce()
            self._read_awaited(now_s)

    def _read_awaited(self, now_s: float) -> None:
        """A driver held at an empty swarm reads that swarm every ``AWAITED_READ_S``, not only at heartbeats: a peer
        that came online just after a heartbeat's read waited up to a whole heartbeat (5 s on the shipped runs) to be
        routed to (`volunteer demo` sat 3 s at 0 samples with every swarm online)."""
        node = self.node
        driver = getattr(node.peer, "driver", None)
        swarm = driver.stats.waiting_for if driver is not None else ""
        if not swarm or node.membership is None or now_s - self._awaited_read_s < self._awaited_every_s:
            return
        # the flag clears only when a hop of ours passes that swarm: a paused driver keeps it for as long as it is
        # paused, and its view already has the peer that came
        if any(r.state == "online" for r in self.views.get(swarm, [])):
            return
        self._awaited_read_s = now_s
        try:
            read = node.membership.read_all([swarm], timeout_s=min(AWAITED_READ_TIMEOUT_S, node.run.timeouts.rpc_s))
        except Exception as exc:
            logger.debug("reading %s, which our driver waits on, failed: %s", swarm, exc)
            read = {}
        if swarm not in read or swarm not in node.membership.fresh:
            self._awaited_every_s = min(2 * self._awaited_every_s, node.run.timeouts.heartbeat_s)
            return
        self._awaited_every_s = AWAITED_READ_S
        self.reads.done(read)
        self.views = {**self.views, **read}
        self.read_at_s[swarm] = time.time()
        node.peer.update_views(self.views, fresh={swarm})

    def _new_evaluation(self) -> bool:
        """True once per evaluation our driver ran since the record we last announced."""
        at = self.metrics.eval_at if self.metrics is not None else -1.0
        if at <= self._announced_eval_at:
            return False
        self._announced_eval_at = at
        return True

    def until_heartbeat_s(self, now_s: float) -> float:
        return max(0.0, self.next_beat_s - now_s)

    def close(self) -> None:
        pass

    def read_views(self, every_swarm: bool = False) -> None:
        """Read the swarms this heartbeat needs (swarm/dht/membership.py read_period); the rest keep their last
        read. ``every_swarm``: all of them (joining, choosing a swarm)."""
        node = self.node
        names = node.run.swarm_names
        if not every_swarm and self.views:
            drives = node.swarm == "layer0" and node.peer is not None
            names = self.reads.due(names, node.swarm, drives, node.run.timeouts.others_every_heartbeats)
        now_s = time.time()
        read = node.membership.read_all(names) if names else {}
        fresh = node.membership.fresh if names else set()  # a failed read kept its last view: due again next beat
        self.reads.done({name: records for name, records in read.items() if name in fresh})
        self.fresh = set(fresh)
        self.views = {**self.views, **read}
        self.read_at_s.update({name: now_s for name in read})  # failed ones too: merge_view judged them now

    def choose_shard(self) -> None:
        """layer0, when joining: the shard held by the fewest online layer0 peers (rarest first)."""
        from swarm.run.data import choose_shard

        node = self.node
        held = [r.shard for r in self.views.get("layer0", []) if r.state == "online" and r.shard >= 0]
        self.shard = choose_shard(node.run.data.shards, held, tiebreak=str(node.dht.peer_id))
        node.board.emit(f"holding data shard {self.shard} of {node.run.data.shards} (rarest first)", kind="shard")

    def record(self, state: str) -> Any:
        return build_record(self.node.board.snapshot(), state=state, version=__version__,
                            started_at_s=self.started_at_s, now_s=time.time(), shard=self.shard,
                            metrics=self.metrics, movable=self.node.rebalancer.movable,
                            reachable=self.node.reachability.record_value)

    def announce(self, ttl_s: float | None = None, timeout_s: float | None = None) -> bool:
        node = self.node
        if node.membership is None or not node.swarm:
            return False
        if node.membership.work < 0 and node.run.integrity.identity_bits > 0:
            # stopped while proving our identity's work: nothing was announced, and a record without the work
            # would only make readers hold our restart's proven record off (identity_work.WorkChecks)
            return False
        state = node.board.snapshot().state.value
        try:
            if node.membership.announce(node.swarm, self.record(state), ttl_s=ttl_s, timeout_s=timeout_s):
                return True
            logger.info("announce of %s was not stored by any DHT node", node.swarm)
        except Exception as exc:
            logger.warning("announce failed: %s", exc)
        return False

    def heartbeat(self) -> None:
        node, board = self.node, self.node.board
        board.publish(**self.work_fields(), **self.traffic_fields())
        self._new_evaluation()  # this announce carries it
        self.announce()
        try:
            self.read_views()
        except Exception as exc:
            logger.warning("reading the swarms failed: %s", exc)
        if node.peer is not None:
            self.rebalance_shard()
            node.peer.update_views(self.views, fresh=self.fresh)
        snap = board.snapshot()
        self._history_speed.append(snap.samples_per_s)
        if snap.loss is not None:
            self._history_loss.append(snap.loss)
        marked = next((s.name for s in snap.swarms if s.bottleneck), None)
        board.publish(**view_fields(self.views, node.run.swarm_names, node.swarm, snap.peer_id, time.time(), marked,
                                    heartbeat_s=node.run.timeouts.heartbeat_s, read_at_s=self.read_at_s),
                      **self._resource_fields(), samples_per_s_history=tuple(self._history_speed),
                      loss_history=tuple(self._history_loss))

    def traffic_fields(self) -> dict[str, Any]:
        """Mb/s in and out since the last heartbeat, in all and on the busiest links (swarm/pipeline/transport/traffic.py)."""
        peer = self.node.peer
        if peer is None:
            return {}
        from volunteer.snapshot import LinkRow

        self.rates.update(time.monotonic(), peer.traffic)
        return {"mbps_in": round(self.rates.mbps_in, 3), "mbps_out": round(self.rates.mbps_out, 3),
                "links": tuple(LinkRow(r.peer_id, round(r.mbps_in, 3), round(r.mbps_out, 3))
                               for r in self.rates.busiest)}

    def rebalance_shard(self) -> None:
        """layer0: leave a shard another peer also holds for one nobody holds (peers that joined together)."""
        from swarm.run.data import rebalance_shard

        node = self.node
        if node.swarm != "layer0" or self.shard is None or node.peer is None:
            return
        me = str(node.dht.peer_id)
        others = {r.peer_id: r.shard for r in self.views.get("layer0", [])
                  if r.state == "online" and r.peer_id != me and r.shard >= 0}
        moved = rebalance_shard(node.run.data.shards, self.shard, me, others)
        if moved is None:
            return
        node.board.emit(f"moving to data shard {moved}: shard {self.shard} is also held by another peer and "
                        f"{moved} by nobody", kind="shard")
        self.shard = moved
        node.peer.set_shard(moved)

    def work_fields(self) -> dict[str, Any]:
        """Our own figures from the stage, and the reason while online (throttled, waiting, or none)."""
        node = self.node
        if node.peer is None:
            return {}
        from swarm.dht.membership import idle_reason
        from volunteer.device import gpu_memory_bytes

        m = node.peer.metrics()
        self.metrics = m
        if m.predicted_ahead and not self._said_predicting:
            self._said_predicting = True
            node.board.emit(f"forwards compute with the weights predicted {m.predicted_ahead} updates ahead, where "
                            "they will be when their gradients land (training.weight_prediction)", kind="predicting")
        state = node.board.snapshot().state
        fields: dict[str, Any] = dict(
            samples_per_s=round(shown_samples_per_s(m.samples_per_s, state), 2), loss=m.loss, clock=m.clock, microbatches_served=m.served,
            bytes_in=m.bytes_in, bytes_out=m.bytes_out, gpu_memory_bytes=gpu_memory_bytes(node.peer.device),
            heals=m.heals, eval_every_s=node.run.training.eval_every_s,
            spot_checked=m.spot_checked, spot_caught=m.spot_caught, spot_outweighed=m.spot_outweighed,
            data_plane=m.data_plane,
            staleness_mean=None if m.staleness_mean is None else round(m.staleness_mean, 2),
            staleness_p95=m.staleness_p95, staleness_max=m.staleness_max,
            predicted_forwards=m.predicted_forwards, predicted_ahead=m.predicted_ahead,
        )
        if m.test_accuracy is not None or m.test_loss is not None:
            fields.update(test_accuracy=m.test_accuracy, test_loss=m.test_loss,
                          test_at=m.eval_at if m.eval_at >= 0 else None)
        else:
            fields.update(run_evaluation(self.views, node.run.training.eval_every_s))
        throttled = node.governors.throttle_reason()
        # layer0 completes micro-batches (trained everywhere), every other stage serves them
        completed = m.trained if node.swarm == "layer0" else m.served
        now_s = time.monotonic()
        stalled_s = self.stall.update(completed, state == NodeState.ONLINE and throttled is None, now_s)
        fields["stalled_s"] = None if stalled_s is None else round(stalled_s, 1)
        cut_off = node.reachability.cut_off_reason()  # behind NAT, in a swarm that drivers must dial
        idle = idle_reason(self.views, node.run.swarm_names, "" if cut_off else node.swarm) if self.views else ""
        if idle and self.stall.progressed_within(node.run.timeouts.record_ttl_s, now_s):
            idle = ""  # micro-batches passed every layer a moment ago: our view is behind, not the run
        if throttled is not None and state == NodeState.ONLINE:
            fields["reason"] = throttled
        elif cut_off and state == NodeState.ONLINE:
            fields["reason"] = f"waiting: {cut_off}"
        elif idle and state == NodeState.ONLINE:  # the root cause: a layer nobody serves
            fields["reason"] = f"waiting: {idle}"
        elif m.blocked_reason and state == NodeState.ONLINE:
            fields["reason"] = f"waiting: {m.blocked_reason}"
        elif state == NodeState.ONLINE:
            fields["reason"] = ""
        return fields

    def _resource_fields(self) -> dict[str, Any]:
        try:
            import psutil

            if self._process is None:
                self._process = psutil.Process(os.getpid())
            with self._process.oneshot():
                return {"cpu_percent": self._process.cpu_percent(), "memory_bytes": self._process.memory_info().rss}
        except Exception:  # psutil missing or the process table unreadable: show no resource figures
            return {}
