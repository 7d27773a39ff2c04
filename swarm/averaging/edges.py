"""The edge modes in a real swarm: DSGD, PDMM-ISVR and ADMM-ISVR over a graph of the swarm's peers.

``EdgeAveraging`` runs the nodes of swarm/ecl/updates.py (``EclNode``, ``DsgdNode``: the same classes
the simulation runs) inside a peer, in place of the optimizer:

- **Graph.** Every peer builds ``build_graph(kind, ids, K, seed)`` from the online records of its
  swarm (plus itself), so peers with the same view agree on the edges, their signs ``A_ij = -A_ji``
  and their offsets without talking. A new view (a peer joined, left, paused, or we stopped listening
  to it after a bad message) rebuilds the graph: surviving edges keep their dual, new ones start at
  the neutral dual, and ECL's common eta follows the new mean degree. Who is in the view is
  ``rules.edge_graph_members``: a peer that stopped training or crashed leaves at once, one whose
  record is only missing stays a record lifetime (``timeouts.record_ttl_s``).
- **Update.** ``StageWorker.set_update_rule``: after each backward, on the compute thread and under
  the stage's lock, the node applies the messages that arrived since the last step, then its local
  step (ECL's proximal primal update, or DSGD's SGD step) on the flattened parameters, written back
  in place. The module stays the source of truth: a best-model adoption or a newcomer's download
  changes it, and the next step starts from there.
- **Exchange: a swap** (swarm/ecl/pairing.py). The smaller id of edge (i, j) starts it at its own local
  step ``s`` when ``s % K == offset(i, j)``: its message goes to j (edge_rpc.py) from the event loop,
  at most one swap in flight per edge, and nothing on the compute thread waits for it. j answers
  with its own message on that edge, made *before* it applies ours, then applies ours; we apply the
  reply at our next step, unless the edge was rebuilt meanwhile (``EdgeGenerations``: a reply paired
  with a reset dual is dropped). A slow or departed neighbour only leaves its edge's dual stale until
  the records drop it from the graph (``timeouts.record_ttl_s``).
- **Answers.** The event loop checks a request (a neighbour in our graph that starts this edge, flat,
  finite, our size), then ``answer_now`` runs on a worker thread under the stage's lock: a norm check
  against our own copy, our message made, theirs applied. A reply gets the same checks before it is
  applied. A message that fails a check is rejected, logged and never applied, and its sender is
  left out of our graph for ``averaging.ban_s``.
- **Bounded influence** (edge_checks.py). Before it is applied, a DSGD message's step goes through an
  ``InfluenceGuard``: an outlier is rejected like a bad message, a larger step is clipped, and a
  sender whose budget for the window is spent is skipped. ECL duals keep the finite and norm checks, and
  the part of each primal step that the duals make may grow the copy's norm by at most 25 % per window, net
  (``bound_dual_pull``; counted as ``clipped``).

Threads: ``set_records``, ``answer`` and the swaps run on the event loop; ``_update`` on the compute
thread and ``answer_now`` on a worker thread, both under the stage's lock (so they never overlap); the
loop and the lock holders share only the inbox (under ``_inbox_lock``), the newest graph (a reference
swap) and the stats.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from swarm.averaging.edge_checks import DualGrowth, bound_dual_pull, bound_message, norm_problem
from swarm.averaging.edge_notices import EdgeStats, lag_warning, notice_text
from swarm.averaging.edge_rpc import BadReply, EdgeRefused, EdgeServicer, swap_edge_messages
from swarm.averaging.influence import InfluenceGuard
from swarm.averaging.rules import BanList, edge_graph_members
from swarm.ecl.graph import PeerGraph, build_graph
from swarm.ecl.pairing import EdgeGenerations, answer_swap, initiates, swaps_due
from swarm.ecl.updates import ADMM_THETA, PDMM_THETA, BadMessageError, DsgdNode, EclConfig, EclNode, common_eta
from swarm.dht.records import MemberRecord
from swarm.run.runconfig import EDGE_MODES, RunConfig
from swarm.pipeline.stage.worker import StageWorker
from swarm.pipeline.stage.stage_rpc import Traffic

logger = logging.getLogger(__name__)

INBOX_PER_SENDER = 8  # messages queued per neighbour while we do not step; the oldest go first
NOTICE_S = 30.0
FIRST_NOTICE_S = 5.0  # the first notice (and the first after the graph changes) comes early: the edges work
LAG_WINDOW = 64  # deliveries over which the lag (our steps from sending to the reply) is measured
Notify = Callable[[str, str, str], None]  # (level, kind, text)
Send = Callable[[str, torch.Tensor, int], Any]  # async (peer, message, step) -> their message; raises on failure


def node_theta(mode: str) -> float:
    return ADMM_THETA if mode == "admm_isvr" else PDMM_THETA


class EdgeAveraging:
    """One peer's edge-mode runtime (see the module doc)."""

    def __init__(self, run: RunConfig, swarm: str, me: str, worker: StageWorker, loop: asyncio.AbstractEventLoop,
                 notify: Notify, *, p2p: Any = None, traffic: Traffic | None = None, send: Send | None = None):
        if run.averaging.mode not in EDGE_MODES:
            raise ValueError(f"EdgeAveraging runs {sorted(EDGE_MODES)}, not {run.averaging.mode!r}")
        self.run = run
        self.cfg = run.averaging
        self.mode = run.averaging.mode
        self.swarm = swarm
        self.me = me
        self.worker = worker
        self.loop = loop
        self.notify = notify
        self.p2p = p2p
        self.traffic = traffic
        self._send = send or self._send_rpc
        self.stats = EdgeStats()
        self.banned = BanList()  # loop thread only
        self.guard = InfluenceGuard(self.cfg.influence)  # compute thread
        self.dual_growth = DualGrowth(self.cfg.influence.window_s)  # ECL: under the stage's lock
        self._params = [p for p in worker.module.parameters()]
        self._numels = [p.numel() for p in self._params]
        self.numel = sum(self._numels)
        self.graph = self._build([me])  # the newest graph (loop thread writes, both read)
        self._current_graph = self.graph  # the graph the node runs on (under the stage's lock)
        self.node = self._make_node(self.graph)
        self.generations = EdgeGenerations()  # under the stage's lock
        self.generations.update(self.graph.neighbours(me))
        self._inbox: dict[str, deque[tuple[int, torch.Tensor]]] = {}  # replies, with their edge's generation
        self._inbox_lock = threading.Lock()
        self._sending: dict[str, asyncio.Task] = {}  # loop thread only
        self._records: list[MemberRecord] = []  # the last view, to rebuild from after a rejection (loop thread)
        self._last_seen: dict[str, float] = {}  # graph peers: when their record last said online (loop thread)
        self.grace_s = run.timeouts.record_ttl_s  # how long a peer whose record vanished stays in the graph
        self._unreachable: set[str] = set()  # neighbours whose last message failed (loop thread)
        self._closed = False
        self._counted_since = time.monotonic()  # start of the period the next notice reports
        self._notice_at = self._counted_since - (NOTICE_S - FIRST_NOTICE_S)  # the first comes sooner
        self._noticed = EdgeStats()
        self.lags: deque[int] = deque(maxlen=LAG_WINDOW)  # loop thread only
        self._lag_warned = False

    # ----- lifecycle (loop thread)
    def start(self) -> None:
        self.worker.set_update_rule(self._update)

    async def close(self) -> None:
        self._closed = True
        self.worker.set_update_rule(None)
        tasks = list(self._sending.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def servicer(self) -> EdgeServicer:
        return EdgeServicer(self.answer, run_id=self.run.run_id, swarm=self.swarm, mode=self.mode, numel=self.numel,
                            traffic=self.traffic)

    # ----- the graph (loop thread)
    def set_records(self, records: Sequence[MemberRecord]) -> None:
        """A new view of our swarm: rebuild the graph if the set of graph peers changed."""
        self._records = list(records)
        now = time.monotonic()
        banned = self.banned.active(now)
        listed = {r.peer_id: r.state for r in records}
        self._last_seen = edge_graph_members(self._last_seen, listed, self._unreachable, now, self.grace_s)
        ids = {peer for peer in self._last_seen if peer not in banned} | {self.me}
        view = tuple(sorted(ids))
        if view == self.graph.peers:
            return
        graph = self._build(view)
        self.graph = graph  # the compute thread adopts it at the next step
        # the next notice comes soon, as the first does: the user sees at once whether the new edges work
        self._notice_at = min(self._notice_at, now - (NOTICE_S - FIRST_NOTICE_S))
        neighbours = graph.neighbours(self.me)
        shown = ", ".join(peer[-8:] for peer in neighbours) or "none"
        why = "" if len(view) > 1 else "; training alone until another peer of the swarm is online"
        self.notify("info", "graph", f"{self.mode} graph: {len(view)} peer(s), {self.cfg.graph.kind}; our "
                                     f"neighbours: {shown}; each edge exchanges every {graph.period_steps} "
                                     f"step(s){why}")

    def _build(self, ids: Sequence[str]) -> PeerGraph:
        g = self.cfg.graph
        return build_graph(g.kind, ids, g.period_steps, g.seed)

    def _make_node(self, graph: PeerGraph) -> EclNode | DsgdNode:
        flat = self._flat_params()
        lr = self.run.optimizer.lr
        if self.mode == "dsgd":
            return DsgdNode(self.me, flat, graph, lr=lr, weights=self.cfg.graph.mixing)
        return EclNode(self.me, flat, graph, EclConfig(mu=lr, eta=self._eta(graph), theta=node_theta(self.mode)))

    def _eta(self, graph: PeerGraph) -> float:
        if not graph.edges:  # no edge: eta multiplies nothing; any positive value will do
            return 1.0
        return common_eta(self.run.optimizer.lr, graph, self.cfg.graph.eta_scale)

    # ----- answers (loop thread, then a worker thread under the stage's lock)
    async def answer(self, sender: str, message: torch.Tensor, step: int) -> torch.Tensor:
        """A neighbour started a swap (edge_rpc.py already checked size and dtype): our message on that
        edge, made before theirs is applied; or raises EdgeRefused."""
        self.check_arrival(sender, message)
        reply = await self.loop.run_in_executor(None, self.answer_now, sender, message)
        self._maybe_notice()  # a peer that starts no swap (the largest id of its edges) reports here
        return reply

    def check_arrival(self, sender: str, message: torch.Tensor) -> None:
        """Loop thread: refuse a request from a stranger, a banned or wrong-way sender, or with NaNs."""
        if sender in self.banned.active(time.monotonic()):
            raise EdgeRefused("not_neighbour", "this peer is not listening to you after a bad message")
        if sender not in self.graph.neighbours(self.me):
            raise EdgeRefused("not_neighbour", "no edge to you in this peer's graph (views may differ for a "
                                               "heartbeat after a join or leave)")
        if not initiates(sender, self.me):
            raise EdgeRefused("not_initiator", "the smaller peer id starts the swaps of an edge (is one of us "
                                               "running another version?)")
        if not bool(torch.isfinite(message).all()):
            self._reject(sender, "the message holds NaN or infinite values")
            raise EdgeRefused("rejected", "the message holds NaN or infinite values")

    def answer_now(self, sender: str, message: torch.Tensor) -> torch.Tensor:
        """Under the stage's lock: check ``message``, make our message to ``sender``, then apply theirs."""
        with self.worker.lock:
            node = self.node
            graph = self._sync_node(node)
            if sender not in graph.neighbours(self.me):
                raise EdgeRefused("not_neighbour", "the edge to you was just removed from this peer's graph")
            message = message.to(node.params.device)
            problem = self._norm_problem(node, sender, message)
            if problem is None:
                try:
                    bounded = self._bounded(node, sender, message)
                    if bounded is None:  # over its budget (DSGD): answer, apply nothing
                        reply = node.make_message(sender)
                    else:
                        reply = answer_swap(node, sender, bounded)
                        self.stats.applied += 1
                except BadMessageError as exc:
                    problem = str(exc)
            if problem is not None:
                self._post_reject(sender, problem)
                raise EdgeRefused("rejected", problem)
            if isinstance(node, DsgdNode):  # DSGD mixed our copy: write it back like a step
                self._write_back(node.params)
                self.worker.stats.param_version += 1
            self.stats.answered += 1
            return reply.detach().to("cpu", copy=True)

    def _reject(self, sender: str, reason: str) -> None:
        """Loop thread: stop listening to ``sender`` for ``ban_s`` and leave it out of our graph."""
        self.banned.ban(sender, time.monotonic(), self.cfg.ban_s)
        self.stats.rejected += 1
        self.notify("warning", "rejected", f"rejected an edge message from {sender[-8:]}: {reason}; ignoring it "
                                           f"for {self.cfg.ban_s:.0f} s")
        self.set_records(self._records)  # the graph without it, now

    # ----- the update (compute thread, under the stage's lock)
    def _flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self._params])

    def _sync_node(self, node: EclNode | DsgdNode) -> PeerGraph:
        """Under the stage's lock: the node takes the module's parameters (the source of truth) and the
        newest graph (new edges start from the neutral dual of the current copy, a new generation)."""
        node.params = self._flat_params()
        graph = self.graph  # one read of the reference the loop thread swaps
        if graph is not self._current_graph:
            node.set_graph(graph)
            if isinstance(node, EclNode):
                node.config = replace(node.config, eta=self._eta(graph))
            self.generations.update(graph.neighbours(self.me))
            self._current_graph = graph
        return graph

    def _update(self) -> None:
        node = self.node
        graph = self._sync_node(node)
        self._apply_inbox(node, graph)
        grad = torch.cat([p.grad.reshape(-1) for p in self._params])  # StageWorker zero-fills missing grads
        decay = self.run.optimizer.weight_decay
        if decay:
            grad = grad + decay * node.params
        before = node.params
        node.step(grad)
        if isinstance(node, EclNode):
            share = bound_dual_pull(node, before, grad, self.dual_growth, time.monotonic())
            if share < 1.0:
                self.stats.clipped += 1
        self._write_back(node.params)
        step = self.stats.steps
        self.stats.steps += 1
        for peer in swaps_due(graph, self.me, step):
            message = node.make_message(peer).detach().to("cpu", copy=True)
            self._post(peer, message, step, self.generations.current(peer))

    def _apply_inbox(self, node: EclNode | DsgdNode, graph: PeerGraph) -> None:
        """The replies that came back since the last step, unless their edge was rebuilt meanwhile."""
        with self._inbox_lock:
            if not self._inbox:  # most steps: nothing arrived
                return
            inbox, self._inbox = self._inbox, {}
        device = node.params.device
        for sender, replies in inbox.items():
            current = [reply for generation, reply in replies if self.generations.matches(sender, generation)]
            self.stats.stale += len(replies) - len(current)
            if isinstance(node, DsgdNode):  # a DSGD message is a whole copy: the newest one subsumes the rest
                current = current[-1:]
            for reply in current:
                reply = reply.to(device)
                problem = self._norm_problem(node, sender, reply)
                try:
                    bounded = None if problem else self._bounded(node, sender, reply)
                    if bounded is not None:
                        node.on_messages({sender: bounded})
                        self.stats.applied += 1
                except BadMessageError as exc:
                    problem = str(exc)
                if problem:
                    self._post_reject(sender, problem)
                    break

    def _norm_problem(self, node: EclNode | DsgdNode, sender: str, message: torch.Tensor) -> str | None:
        return norm_problem(node, sender, message, self.cfg.max_norm_ratio)

    def _bounded(self, node: EclNode | DsgdNode, sender: str, message: torch.Tensor) -> torch.Tensor | None:
        """``bound_message`` (edge_checks.py), counted; None: over budget. Raises BadMessageError for an outlier."""
        bounded = bound_message(node, sender, message, self.guard, self._numels, self.cfg.influence, time.monotonic())
        self.stats.over_budget += bounded.message is None
        self.stats.clipped += bounded.clipped
        return bounded.message

    @torch.no_grad()
    def _write_back(self, flat: torch.Tensor) -> None:
        self.worker.ring.release_live()  # under the stage's lock: a referee may still ask for the version before
        offset = 0
        for param in self._params:
            n = param.numel()
            param.copy_(flat[offset: offset + n].view_as(param))
            offset += n

    def _post_reject(self, sender: str, reason: str) -> None:
        self._call_soon(self._reject, sender, reason)

    def _post(self, peer: str, message: torch.Tensor, step: int, generation: int | None) -> None:
        self._call_soon(self._start_send, peer, message, step, generation)

    def _call_soon(self, callback: Callable[..., None], *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closing: nothing more to send
            pass

    # ----- swaps we start (loop thread)
    def _start_send(self, peer: str, message: torch.Tensor, step: int, generation: int | None) -> None:
        if self._closed or generation is None:
            return
        running = self._sending.get(peer)
        if running is not None and not running.done():
            self.stats.skipped += 1
            return
        self._sending[peer] = asyncio.ensure_future(self._swap(peer, message, step, generation))
        self._maybe_notice()

    async def _swap(self, peer: str, message: torch.Tensor, step: int, generation: int) -> None:
        try:
            reply = await self._send(peer, message, step)
        except EdgeRefused as exc:
            self.stats.refused += 1
            level = logging.WARNING if exc.code in ("rejected", "wrong_run", "not_initiator") else logging.DEBUG
            logger.log(level, "%s did not take our edge message: %s", peer[-8:], exc)
            return
        except BadReply as exc:
            self._reject(peer, str(exc))
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # timeouts, departed peers, broken streams: the edge's dual waits
            self._unreachable.add(peer)
            self.stats.send_failed += 1
            logger.info("edge swap with %s failed: %s %s", peer[-8:], exc.__class__.__name__, exc)
            return
        self._unreachable.discard(peer)
        if not bool(torch.isfinite(reply).all()):
            self._reject(peer, "its reply holds NaN or infinite values")
            return
        with self._inbox_lock:
            self._inbox.setdefault(peer, deque(maxlen=INBOX_PER_SENDER)).append((generation, reply))
        self.stats.sent += 1
        self.lags.append(self.stats.steps - 1 - step)

    async def _send_rpc(self, peer: str, message: torch.Tensor, step: int) -> torch.Tensor:
        return await swap_edge_messages(self.p2p, peer, self.run, self.swarm, message, step,
                                        timeout_s=self.cfg.timeout_s, wire_dtype=self.cfg.wire_dtype,
                                        traffic=self.traffic)

    def lag_steps(self) -> float | None:
        """Median of our local steps between starting a swap and its reply (recent swaps)."""
        if not self.lags:
            return None
        ordered = sorted(self.lags)
        return float(ordered[len(ordered) // 2])

    def _maybe_notice(self) -> None:
        now = time.monotonic()
        if now - self._notice_at < NOTICE_S:
            return
        lag = self.lag_steps()
        self.notify("info", "averaged", notice_text(self.mode, self.stats, self._noticed, self.graph.degree(self.me),
                                                    now - self._counted_since, lag))
        self._notice_at = self._counted_since = now
        self._noticed = replace(self.stats)
        warning = lag_warning(self.mode, lag, self.cfg.graph.period_steps)
        if warning and not self._lag_warned:
            self._lag_warned = True
            self.notify("warning", "averaging", warning)
