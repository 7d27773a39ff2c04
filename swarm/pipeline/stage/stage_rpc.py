"""The stage server's RPCs over hivemind's P2P, and the client call the driver uses.

Three handlers per stage, in the namespace ``{run_id}.layer{k}``: ``rpc_session`` (many calls on one long-lived
stream: swarm/pipeline/transport/sessions.py), ``rpc_call`` (unary: a peer without sessions) and ``rpc_call_stream`` (for
payloads over the session and unary limits). All take tensors plus metadata
``{"op": ..., "mb": micro-batch id, ...}`` and dispatch on ``op``:

    forward           [x]            -> [y]
    backward          [g] or [g, x]  -> [grad x]       metadata: loss (float, from the last stage)
    forward_backward  [x, ids]       -> [grad x]       reply metadata: loss    (last stage only)
    infer             [x]            -> [y]            no update, eval mode
    evaluate          [x, ids]       -> []             reply metadata: loss_sum, correct, count
    infer (stage 0)   [ids]          -> [y]            stage 0 recomputed on train-split rows, for a layer1 peer's
                                                       spot check (swarm/pipeline/stage/stage0_replicas.py)
    forward_backward_check  [x, ids] -> [grad x]       reply metadata: loss; nothing applied (last stage: a
                                                       driver's spot check of another peer's forward_backward)
    backward_check    [g, x]         -> [grad x]       nothing applied (a spot check of another peer's backward)

A ``forward`` at stage 1 also carries its sample ids in metadata ``ids`` (int64 bytes, the ids its stage-0
receipt names): a share of them is recomputed by other layer0 peers (swarm/pipeline/control/stage0_checks.py) and a
micro-batch whose author is the odd one out is refused (``spot_check``) before stage 1 answers it.

``ids`` are int64 row indices into the run's train split (forward_backward) or test split (evaluate):
the last stage looks the targets up in its own copy of the run's data (swarm/integrity/labels.py);
targets never come from the wire. Only online layer0 peers of the run are served, each within its
fair share, and a driver that keeps sending rejected or clipped updates is banned for a
while (swarm/pipeline/stage/stage_gate.py). Every update is clipped and guarded at the stage (swarm/pipeline/stage/worker.py).

Replies carry ``{"ok": true}`` or ``{"ok": false, "code": ..., "error": ..., ["retry_after_s": s]}``
with code ``rejected`` (malformed: never applied), ``paused`` (this peer takes no new work),
``healing`` (this copy is sick and restoring itself: swarm/integrity/health.py), ``need_input``
(backward without the input at a peer that has no saved activations), ``busy`` (over your fair share
or too many requests queued: retry after), ``banned`` (not before retry_after_s), ``unknown_driver``
(no online layer0 record of you here yet: retry after), ``key_pending`` (the receipt key of a tensor's signer is
still being fetched: ask again after retry_after_s) or ``wrong_shard`` (sample ids outside your
shards: drop the micro-batch) or ``spot_check`` (stage 1: your stage-0 output is far from two other layer0 peers'
recomputations of it). The full table is in docs/ARCHITECTURE.md "Stage RPCs".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import replace
from typing import Any, AsyncIterator  # typing's, not collections.abc's: hivemind reads `hint._name` to detect streams

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from swarm.integrity.health import SickCopy
from swarm.integrity.labels import WrongShard
from swarm.pipeline.stage.applied import DUPLICATE_CODE, AppliedLedger, Ran, Replies
from swarm.pipeline.stage.fair_queue import FairQueue
from swarm.pipeline.stage.worker import NeedInput, StageWorker
from swarm.pipeline.stage.stage0_replicas import ReplicaService
from swarm.pipeline.stage.stage0_rpc import Stage0Ops, Stage0Refused
from swarm.pipeline.transport.stage_client import (  # noqa: F401 (re-exported)
    BANNED_AUTHOR,
    StageError,
    StageRPC,
    call_stage,
    refusal_error,
    stage_namespace,
)
from swarm.pipeline.transport import sessions
from swarm.pipeline.transport.session_server import SessionHandlers
from swarm.pipeline.stage.stage_gate import SERVED_OPS, UPDATE_OPS, Outcome, StageGate
from swarm.pipeline.stage.stage_ops import ContentError, Request, check_op_here, dispatch  # noqa: F401  (dispatch re-exported)
from swarm.pipeline.stage.stage_receipts import NeedChain, ReceiptDesk, ReceiptRefusal, Vouched
from swarm.pipeline.stage.convictions import CONVICTION_OP
from swarm.pipeline.stage.push import PUSH_OPS, SHOW_OP
from swarm.pipeline.stage.weights_rpc import WEIGHTS_OP, WeightsDoor
from swarm.pipeline.transport.streams import StreamCut, join_request, reply_stream, split_message
from swarm.pipeline.transport.traffic import Traffic  # noqa: F401  (re-exported: the RPC modules count their bytes in it)
from swarm.pipeline.transport.wire import (
    DEFAULT_RANK,
    WireError,
    as_proto,
    buffer_bytes,
    decode_tensors,
    encode_off_loop,
    pack_metadata,
    refusal_meta as _refusal,
    unpack_metadata,
)

logger = logging.getLogger(__name__)

COMMITTED_KEY = "_committed"  # in _run's reply, never on the wire: popped before signing
LOSS_OPS = frozenset({"forward_backward", "forward_backward_check"})  # their receipts sign the loss they report
NEW_WORK_OPS = frozenset({"forward", "forward_backward", "infer", "evaluate", "forward_backward_check",
                          "backward_check"}) | PUSH_OPS


LASTING_OPS = UPDATE_OPS | PUSH_OPS  # served to their end once their compute began (StageServicer._handle)


class StageServicer(SessionHandlers, Stage0Ops, StageRPC):
    """Serves one stage worker. Built with no arguments it only lends its signatures to stubs."""

    def __init__(self, worker: StageWorker | None = None, executor: Executor | None = None, *, max_bytes: int = 0,
                 codec: str = "float32", rank: int = DEFAULT_RANK, is_accepting: Callable[[], bool] = lambda: True,
                 traffic: Traffic | None = None, gate: StageGate | None = None, desk: ReceiptDesk | None = None):
        self.worker = worker
        self.replicas: ReplicaService | None = None  # stage 0: recomputations for layer1's spot checks
        self.spot0: Any = None  # stage 1: a Stage0Checker (swarm/pipeline/control/stage0_checks.py)
        self.gate = gate
        self.desk = desk  # receipts: checked on requests, signed on replies (None: tests of the RPC alone)
        self.fair = FairQueue(executor)  # the compute thread serves requesters in turn (swarm/pipeline/stage/fair_queue.py)
        self.executor = executor
        self.max_bytes = max_bytes
        self.codec = codec  # activations and gradients leave in the run's codec (swarm/pipeline/transport/codecs.py)
        self.rank = rank
        self.is_accepting = is_accepting
        self.traffic = traffic or Traffic()
        self.active = 0  # requests being served right now (a leaving peer waits for these)
        self.session_tasks: set[asyncio.Task] = set()  # hivemind's tasks that run our sessions (ended at a stop)
        self.finishing: set[asyncio.Future] = set()  # requests whose callers left while their compute ran (_handle)
        self.shown = WeightsDoor()  # the committed weights a referee asks to see (swarm/pipeline/stage/weights_rpc.py)
        self.convictions: Any = None  # a ConvictionDesk: referees' evidence re-checked here (convictions.py)
        self.push: Any = None  # a PushServer: micro-batches pushed to us and on by us (push.py)
        self.applied = AppliedLedger()  # one update per micro-batch here, however often it arrives (applied.py)
        self.replies = Replies()  # ... and a resend of one is answered as the first copy was

    async def rpc_call(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        tensors, meta = await self._one_message(request, context)
        return runtime_pb2.ExpertResponse(tensors=tensors, metadata=pack_metadata(meta))

    async def _one_message(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> tuple[list[Any], dict]:
        """A call that came in one message (unary, or on a session): its reply's tensors and metadata, bytes counted."""
        remote = str(context.remote_id)
        self.traffic.count(remote, inbound=buffer_bytes(request.tensors), op="served")
        serialized, meta = await self._handle(list(request.tensors), request.metadata, context)
        self.traffic.count(remote, outbound=buffer_bytes(serialized), op="served")
        return [as_proto(t) for t in serialized], meta

    async def rpc_call_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                              context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        asked = False  # whether the caller closes the stream at our reply's end mark (streams.py)
        try:
            serialized, metadata, asked = await join_request(requests, self.max_bytes)
            self.traffic.count(str(context.remote_id), inbound=buffer_bytes(serialized), op="served")
            out, meta = await self._handle(serialized, metadata, context)
        except (WireError, StreamCut) as exc:  # a cut request never ends (no end-of-stream): a sender's doing
            out, meta = [], _refusal("rejected", str(exc))
        self.traffic.count(str(context.remote_id), outbound=buffer_bytes(out), op="served")
        messages = split_message(out, pack_metadata(meta), runtime_pb2.ExpertResponse)
        serialized = out = None  # the messages hold the reply alone (reply_stream drops it before a hold)
        async for message in reply_stream(messages, asked, str(context.remote_id)):
            yield message

    def session_cap(self) -> int:
        # the gate's own cap per driver decides; the session's only bounds what one stream holds
        per_driver = self.gate.cfg.max_in_flight_per_requester if self.gate is not None else 0
        return max(sessions.MAX_RUNNING, 2 * per_driver)

    async def end_sessions(self, timeout_s: float) -> None:
        """End every session served here (a stop): each handler closes its stream as it ends."""
        tasks = [task for task in self.session_tasks if not task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
            await asyncio.sleep(0.05)  # hivemind's handler notices its processing task ended, and closes the stream
        finishing = list(self.finishing)  # requests whose compute ran when their caller left: their update is applied
        if finishing:
            _, late = await asyncio.wait(finishing, timeout=timeout_s)
            for work in late:
                work.cancel()

    async def rpc_receipt_key(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """This peer's receipt key, asked of it over its own connection (swarm/pipeline/transport/keybook.py)."""
        key = self.desk.key.public if self.desk is not None else b""
        return runtime_pb2.ExpertResponse(metadata=pack_metadata({"key": key}))

    async def _handle(self, serialized: list[Any], metadata: bytes, context: Any) -> tuple[list[Any], dict]:
        """A request, served to its end once its compute began, whether or not its caller is still there: a caller
        that leaves (a cut stream, a dead pushing stage) does not take back an update the compute thread applies, so
        what follows it (the signed reply kept for a resend, the claim on its micro-batch, a push's outbox and its
        "running" mark) must still happen. Before then, a caller that leaves takes its request with it. (Only ops
        that may apply an update: the task costs ~20 us a request.)"""
        try:
            meta = unpack_metadata(metadata)
        except WireError as exc:
            return [], _refusal("rejected", str(exc))
        self.active += 1
        op = meta.get("op")
        if not isinstance(op, str) or op not in LASTING_OPS:  # (a hostile op may be unhashable: _serve refuses it)
            try:
                return await self._serve(serialized, meta, context)
            finally:
                self.active -= 1
        work = asyncio.ensure_future(self._serve(serialized, meta, context))
        work.add_done_callback(self._served)
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            if work in self.fair.started:
                self.finishing.add(work)  # ended by end_sessions at the latest
            else:
                work.cancel()
            raise

    def _served(self, work: asyncio.Future) -> None:
        self.active -= 1
        left = work in self.finishing
        self.finishing.discard(work)
        error = None if work.cancelled() else work.exception()  # retrieved here: its caller may have left
        if left and error is not None:
            logger.error("a request whose caller left failed", exc_info=error)

    async def _serve(self, serialized: list[Any], meta: dict, context: Any) -> tuple[list[Any], dict]:
        requester = str(context.remote_id)
        op = meta.get("op")
        if op == WEIGHTS_OP:  # a referee's request: anyone may ask, within the door's rate (weights_rpc.py)
            return await self.shown.serve(self.worker, requester, meta,
                                          may_pin=self.gate is None or self.gate.view.knows(requester))
        if op == CONVICTION_OP and self.convictions is not None:  # evidence against a signer, re-checked here
            try:
                return await self.convictions.receive(requester, decode_tensors(serialized, self.max_bytes, coded=True),
                                                      meta)
            except WireError as exc:
                return [], _refusal("rejected", str(exc))
        if op == SHOW_OP and self.push is not None:  # a driver asks what a pushed hop of its micro-batch carried
            return self.push.show(requester, meta)
        if not isinstance(op, str) or op not in SERVED_OPS | PUSH_OPS:
            if self.gate is not None:
                self.gate.strike(requester, "a request with an unknown op")
            return [], _refusal("rejected", f"unknown op {str(op)[:40]!r}")
        if op in NEW_WORK_OPS and not self.is_accepting():
            return [], _refusal("paused", "this peer is paused and takes no new work")
        if op in PUSH_OPS:
            if self.push is None:
                # not in push_trail.NOT_THE_LINK: its drivers relay to it for a while instead of asking at every hop
                return [], _refusal("no_push", "this peer does not take pushed micro-batches")
            return await self.push.serve(self, requester, op, meta, serialized)
        if op == "infer" and self.replicas is not None and self.worker is not None and self.worker.index == 0:
            return await self._serve_replica(requester, serialized, meta)
        if self.gate is not None:
            refusal = await self.gate.admit(requester, op)
            if refusal is not None:
                return [], _refusal(refusal.code, refusal.error, refusal.retry_after_s)
        out, reply, outcome = await self.admitted(requester, requester, op, meta, serialized)
        if self.gate is not None:
            self.gate.settle(requester, outcome)
        return out, reply

    async def admitted(self, requester: str, sender: str, op: str, meta: dict, serialized: list[Any],
                       ) -> tuple[list[Any], dict, Outcome]:
        """An admitted request: checked, run, signed. ``requester``: the driver whose micro-batch it is (its fair share,
        its shards, the owner of the saved activations); ``sender``: the peer it came from (the requester itself, or
        the stage before us that pushed it: swarm/pipeline/stage/push.py). The Outcome is the caller's to settle: a strike
        for a malformed request lands on its sender, never on a driver whose micro-batch a stage pushed."""
        outcome = Outcome()
        vouched = Vouched()

        def strike(text: str) -> Outcome:  # the request's form is its sender's doing
            return Outcome(strike=text) if sender == requester else Outcome(author=sender, author_strike=text)

        mb = meta.get("mb") if op in UPDATE_OPS else None
        if isinstance(mb, str) and not self.applied.claim(requester, mb):  # one update per micro-batch (applied.py)
            again = await self.replies.again(requester, mb, op, meta.get("rc"), sender)
            if again is not None:  # a resend of what ran here: the reply it got, nothing applied twice
                return again[0], again[1], outcome
            return [], _refusal(DUPLICATE_CODE, f"micro-batch {mb[:40]} has already been applied here: its gradient "
                                "is lost, do not resend it"), outcome
        ran, result = Ran(), None
        if isinstance(mb, str):
            self.replies.begin(requester, mb, op, meta.get("rc"), sender)
        try:
            result = await self._admitted(requester, sender, op, meta, serialized, vouched, strike, ran)
            return result
        finally:
            if isinstance(mb, str):
                kept = result is not None and ran.applied and result[1].get("ok") is True
                self.replies.finish(requester, mb, result[:2] if kept else None)
                if not ran.applied:
                    self.applied.release(requester, mb)

    async def _admitted(self, requester: str, sender: str, op: str, meta: dict, serialized: list[Any],
                        vouched: Vouched, strike: Callable[[str], Outcome], ran: Ran) -> tuple[list[Any], dict, Outcome]:
        outcome = Outcome()
        try:
            check_op_here(self.worker, op)
            tensors = decode_tensors(serialized, self.max_bytes, coded=True)
            if self.desk is not None:
                vouched = await self.desk.check(requester, op, meta, tensors)
                refusal = self._banned_author(vouched)
                if refusal is not None:
                    return [], refusal, outcome
            check = self._start_stage0_check(requester, op, meta, tensors, vouched)
            if check is not None and op == "forward_backward":  # it applies the update: the verdict comes first
                await self._stage0_verdict(check, requester, None)
            request = Request(requester=requester, gate=self.gate, source=vouched.authors.get(0, ""))
            out, reply, outcome = await self.fair.run(requester, _run, self.worker, op, tensors, meta, request)
            ran.applied = outcome.applied
            committed = reply.pop(COMMITTED_KEY, None)
            if check is not None and op == "forward":
                await self._stage0_verdict(check, requester, meta.get("mb"))
            # An update clipped to nothing at a backward is its gradient's signer's doing. At the last stage the update
            # comes from our own loss on inputs an upstream stage computed from inputs further up: a heavy clip there
            # could be any of them, so it is nobody's strike (the step bound has already held the update).
            outcome = replace(outcome, author=vouched.applied_author) if op == "backward" else \
                replace(outcome, clip_scale=1.0)
            out, reply = await self._signed(requester, op, vouched, out, reply, committed)
            return out, reply, outcome
        except Stage0Refused as exc:  # its author is already struck, by the check itself
            return [], _refusal("spot_check", str(exc)), outcome
        except NeedInput:
            return [], _refusal("need_input", "no saved activations here: send the input"), outcome
        except NeedChain:
            return [], _refusal("need_input", "no saved activations here: send the input and its receipts"), outcome
        except ReceiptRefusal as exc:
            if exc.strike:
                logger.warning("refused a request from %s: %s: %s", sender[-8:], exc.code, exc)
                outcome = strike(f"{exc.code}: {str(exc)[:120]}")
            return [], _refusal(exc.code, str(exc), exc.retry_after_s), outcome
        except SickCopy as exc:
            return [], _refusal("healing", f"this copy is sick and healing ({exc}): ask another peer"), outcome
        except WrongShard as exc:
            # a shard closed only by our grace view: the driver's read may have missed the same record; else a strike
            # only for a driver told so and going on (integrity/labels.py ShardRefusals). The sample ids are the
            # driver's, signed in its stage-0 receipt, whoever brought them.
            gate = self.gate
            struck = not exc.excusable and gate is not None and gate.shard_refusals.strikes(requester)
            outcome = Outcome(strike="sample ids outside its shards after it was told") if struck else Outcome()
            return [], _refusal("wrong_shard", str(exc)), outcome
        except ContentError as exc:  # a tensor whose receipt holds: its signer computed it wrong
            author = vouched.authors.get(exc.index, "") or sender
            logger.warning("rejected a tensor computed by %s (relayed by %s): %s", author[-8:], sender[-8:], exc)
            if author == requester:
                outcome = Outcome(strike=f"rejected: {str(exc)[:120]}")
            else:
                outcome = Outcome(author=author, author_strike=f"sent a wrong tensor: {str(exc)[:120]}")
            code = "rejected" if author in (requester, sender) else "bad_author"
            return [], {**_refusal(code, str(exc)), "author": author}, outcome
        except (WireError, ValueError, TypeError) as exc:  # StepRefused is a ValueError: nothing was applied
            logger.warning("rejected a request from %s: %s", sender[-8:], exc)
            return [], _refusal("rejected", str(exc)), strike(f"rejected: {str(exc)[:120]}")

    def _banned_author(self, vouched: Vouched) -> dict | None:
        """A tensor computed by a peer this stage has banned is refused, whoever relays it (no strike on the relay)."""
        if self.gate is None:
            return None
        now = time.monotonic()
        for author in set(vouched.authors.values()):
            if author and self.gate.book.banned(author, now):
                return {**_refusal("bad_author", f"its tensor was computed by {author[-8:]}, {BANNED_AUTHOR} for "
                                   "sending wrong tensors: use another peer of its swarm"), "author": author}
        return None

    async def _signed(self, requester: str, op: str, vouched: Vouched, out: list[torch.Tensor],
                      reply: dict, committed: tuple[int, bytes, bytes] | None = None) -> tuple[list[Any], dict]:
        """Encode the reply once, and sign the digest of exactly those bytes and of the weights it was computed with
        (``committed``: (version, weights digest, its forward's weights digest), taken on the compute thread as the op
        ran)."""
        serialized = await encode_off_loop(out, self.codec, self.rank)
        if self.desk is not None:
            figures = (reply["loss_sum"], reply["correct"], reply["count"]) if op == "evaluate" else None
            version, weights, forward_weights = committed if committed is not None else \
                (*self.worker.committed, self.worker.forward_weights)
            reply = {**reply, "rk": self.desk.key.public,
                     "rc": self.desk.sign(requester, op, vouched, serialized, version, figures, weights, forward_weights,
                                          reply.get("loss") if op in LOSS_OPS else None)}
        return serialized, reply


def _run(worker: StageWorker, op: Any, tensors: list[torch.Tensor], meta: dict,
         request: Request) -> tuple[list[torch.Tensor], dict, Outcome]:
    """dispatch, then (still on the compute thread, before another request can step) what the bounds did."""
    worker.last_update = None
    out, reply = dispatch(worker, op, tensors, meta, request)
    # the weights this op ran with, taken before another op can run
    reply = {**reply, COMMITTED_KEY: (*worker.committed, worker.forward_weights)}
    report = worker.last_update
    if op not in UPDATE_OPS or report is None:
        return out, reply, Outcome()
    return out, reply, Outcome(applied=True, clip_scale=report.clip_scale)


def make_servicer(worker: StageWorker, executor: Executor, *, max_bytes: int, codec: str,
                  is_accepting: Callable[[], bool], traffic: Traffic, gate: StageGate | None = None,
                  rank: int = DEFAULT_RANK, desk: ReceiptDesk | None = None) -> StageServicer:
    return StageServicer(worker, executor, max_bytes=max_bytes, codec=codec, rank=rank, is_accepting=is_accepting,
                         traffic=traffic, gate=gate, desk=desk)

