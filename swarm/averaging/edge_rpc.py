"""The edge-swap service of the edge modes (dsgd, pdmm_isvr, admm_isvr): one two-way swap per edge exchange.

Two handlers per swarm, in the swarm's namespace ``{run_id}.layer{k}`` beside the stage and parameter
services: ``EdgeServicer.rpc_edge`` (unary) and ``rpc_edge_stream`` (for messages over wire.py's
unary limit). An exchange on edge (i, j) is a swap (swarm/ecl/pairing.py): the initiator i sends its
message, and the reply carries j's message, made *before* j applied i's. A request and a successful
reply carry exactly one tensor, the message: the layer's parameters flattened (DSGD) or the ECL dual
message ``y_ij / eta`` (same shape), as float32 or float16 (the reply travels as the request did);
the request's metadata::

    {"op": "swap", "run_id": ..., "swarm": "layer2", "mode": "pdmm_isvr", "step": 812}

``step`` is the initiator's local step (for logs and tests). The reply's metadata is ``{"ok": true}``
(with the tensor) or ``{"ok": false, "code": ..., "error": ...}`` (no tensor, nothing applied) with code

    wrong_run      another run, swarm or mode: this peer does not take the message
    not_neighbour  the receiver's graph has no edge to the sender (views differ for a heartbeat after a
                   join or leave, or the receiver stopped listening to the sender after a bad message)
    not_initiator  the sender has the larger id: the smaller id starts the swaps of an edge
    rejected       malformed: wrong size, dtype or non-finite values, or a norm far over the receiver's

The sender is the connection's authenticated libp2p peer id (``context.remote_id``), never a field of
the message, so a peer cannot speak for another. The initiator checks the reply as the responder
checked the request (size, dtype here; finite and norm in edges.py). Nothing ever waits for a swap
beyond ``timeout_s``: a lost one only delays that edge's dual (the algorithms are asynchronous).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, AsyncIterator  # hivemind spots streaming handlers by typing.AsyncIterator only

import torch
from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from swarm.pipeline.stage.stage_rpc import Traffic, stage_namespace
from swarm.pipeline.transport.streams import StreamCut, join_request, join_stream, reply_stream, split_message
from swarm.pipeline.transport.wire import (
    UNARY_LIMIT_BYTES, WireError, decode_tensors, encode_tensors, pack_metadata, unpack_metadata,
)

logger = logging.getLogger(__name__)

EDGE_OP = "swap"
MAX_STEP = 2**62

# answer(sender, message, step) -> our message on that edge, made before theirs is applied; or raises
# EdgeRefused. Runs on the event loop.
Answer = Callable[[str, torch.Tensor, int], Awaitable[torch.Tensor]]


class EdgeRefused(RuntimeError):
    """The receiver answered but did not take the message; ``code`` says why (see the module doc)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


class BadReply(RuntimeError):
    """The responder answered with a malformed message: nothing of it may be applied."""


class EdgeServicer(ServicerBase):
    """Answers edge swaps for one peer. Built with no arguments it only lends its signatures to stubs."""

    def __init__(self, answer: Answer | None = None, *, run_id: str = "", swarm: str = "", mode: str = "",
                 numel: int = 0, traffic: Traffic | None = None):
        self.answer = answer
        self.run_id = run_id
        self.swarm = swarm
        self.mode = mode
        self.numel = numel
        self.traffic = traffic or Traffic()

    async def rpc_edge(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        remote = str(context.remote_id)
        self.traffic.count(remote, inbound=sum(len(t.buffer) for t in request.tensors))
        reply, tensors = await self._handle(list(request.tensors), request.metadata, remote)
        self.traffic.count(remote, outbound=sum(len(t.buffer) for t in tensors))
        return runtime_pb2.ExpertResponse(tensors=tensors, metadata=pack_metadata(reply))

    async def rpc_edge_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                              context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        asked = False  # whether the caller closes the stream at our reply's end mark (streams.py)
        try:
            serialized, metadata, asked = await join_request(requests, self._max_bytes())
            self.traffic.count(str(context.remote_id), inbound=sum(len(t.buffer) for t in serialized))
            reply, tensors = await self._handle(serialized, metadata, str(context.remote_id))
        except (WireError, StreamCut) as exc:  # a cut request never ends (no end-of-stream): a sender's doing
            reply, tensors = _refusal("rejected", str(exc)), []
        self.traffic.count(str(context.remote_id), outbound=sum(len(t.buffer) for t in tensors))
        parts = split_message(tensors, pack_metadata(reply), runtime_pb2.ExpertResponse)
        serialized = tensors = None  # the parts hold the reply alone (reply_stream drops it before a hold)
        async for part in reply_stream(parts, asked, str(context.remote_id)):
            yield part

    def _max_bytes(self) -> int:
        return max_message_bytes(self.numel)

    async def _handle(self, serialized: list[Any], metadata: bytes, sender: str) -> tuple[dict, list[Any]]:
        """(reply metadata, serialized reply tensors)."""
        reply, tensors = await self._check_and_answer(serialized, metadata, sender)
        if reply.get("code") == "rejected":
            logger.warning("rejected an edge message from %s: %s", sender[-8:], reply["error"])
        elif reply.get("code") in ("wrong_run", "not_initiator"):
            logger.info("refused an edge message from %s: %s", sender[-8:], reply["error"])
        return reply, tensors

    async def _check_and_answer(self, serialized: list[Any], metadata: bytes, sender: str) -> tuple[dict, list[Any]]:
        try:
            meta = unpack_metadata(metadata)
            if meta.get("op") != EDGE_OP:
                return _refusal("rejected", f"expected op {EDGE_OP!r} (a peer of another version?)"), []
            if (meta.get("run_id"), meta.get("swarm"), meta.get("mode")) != (self.run_id, self.swarm, self.mode):
                return _refusal("wrong_run", f"this peer takes {self.mode} messages of {self.run_id}/{self.swarm}"), []
            step = meta.get("step")
            if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < MAX_STEP:
                return _refusal("rejected", "step must be a non-negative integer"), []
            tensors = decode_tensors(serialized, self._max_bytes())
            if len(tensors) != 1:
                return _refusal("rejected", f"expected one tensor, got {len(tensors)}"), []
            (message,) = tensors
            problem = shape_problem(message, self.numel)
            if problem:
                return _refusal("rejected", problem), []
            assert self.answer is not None
            ours = await self.answer(sender, message.float(), step)
            return {"ok": True}, encode_tensors([ours.reshape(-1)], _wire_dtype_of(serialized[0]))
        except EdgeRefused as exc:
            return _refusal(exc.code, str(exc).split(": ", 1)[-1]), []
        except WireError as exc:
            return _refusal("rejected", str(exc)), []


def max_message_bytes(numel: int) -> int:
    return numel * 4 + 4096  # float32 at most, plus serialization headers


def shape_problem(message: torch.Tensor, numel: int) -> str | None:
    """Why ``message`` is not a flat float tensor of ``numel`` values, or None."""
    if message.dtype not in (torch.float32, torch.float16) or message.dim() != 1 or message.numel() != numel:
        return (f"expected a flat float tensor of {numel} values, got {message.dtype} of shape "
                f"{tuple(message.shape)}")
    return None


def _wire_dtype_of(serialized: Any) -> str:
    return "float16" if serialized.compression == runtime_pb2.CompressionType.FLOAT16 else "float32"


def _refusal(code: str, error: str) -> dict:
    return {"ok": False, "code": code, "error": error[:500]}


async def swap_edge_messages(p2p: Any, peer_id: str, run: Any, swarm: str, message: torch.Tensor, step: int, *,
                             timeout_s: float, wire_dtype: str = "float32",
                             traffic: Traffic | None = None) -> torch.Tensor:
    """Swap messages with ``peer_id``: send ours, return theirs (float32, our message's size; made before
    they applied ours). Raises ``EdgeRefused`` (the peer answered no), ``BadReply`` (its reply is malformed),
    ``asyncio.TimeoutError``, or ``ConnectionError`` (unreachable, broken stream)."""
    stub = EdgeServicer.get_stub(p2p, PeerID.from_base58(peer_id), namespace=stage_namespace(run.run_id, swarm))
    flat = message.reshape(-1)
    serialized = encode_tensors([flat], wire_dtype)
    metadata = pack_metadata({"op": EDGE_OP, "run_id": run.run_id, "swarm": swarm, "mode": run.averaging.mode,
                              "step": int(step)})
    sent = sum(len(t.buffer) for t in serialized)
    limit = max_message_bytes(flat.numel())

    async def call() -> tuple[list[Any], bytes]:
        if sent < UNARY_LIMIT_BYTES:
            reply = await stub.rpc_edge(runtime_pb2.ExpertRequest(tensors=serialized, metadata=metadata))
            return list(reply.tensors), reply.metadata
        requests = split_message(serialized, metadata, runtime_pb2.ExpertRequest, ask_end=True)
        replies = await stub.rpc_edge_stream(_aiter(requests))
        return await join_stream(replies, limit)

    try:
        tensors, raw = await asyncio.wait_for(call(), timeout_s)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        raise
    except Exception as exc:  # p2pd and stream errors come in many classes; callers need one
        raise ConnectionError(f"edge swap with {peer_id[-8:]} failed: {exc.__class__.__name__}: {exc}") from exc
    if traffic is not None:
        traffic.count(peer_id, inbound=sum(len(t.buffer) for t in tensors), outbound=sent)
    reply = unpack_metadata(raw)
    if not reply.get("ok"):
        raise EdgeRefused(str(reply.get("code", "error"))[:40], str(reply.get("error", ""))[:500])
    try:
        decoded = decode_tensors(tensors, limit)
    except WireError as exc:
        raise BadReply(f"malformed reply: {exc}") from exc
    problem = "expected one tensor" if len(decoded) != 1 else shape_problem(decoded[0], flat.numel())
    if problem:
        raise BadReply(f"malformed reply: {problem}")
    return decoded[0].float()


async def send_edge_message(p2p: Any, peer_id: str, run: Any, swarm: str, message: torch.Tensor, step: int, *,
                            timeout_s: float, wire_dtype: str = "float32", traffic: Traffic | None = None) -> None:
    """A swap whose reply is dropped: for callers (tests, probes) that only check the peer takes ours."""
    await swap_edge_messages(p2p, peer_id, run, swarm, message, step, timeout_s=timeout_s, wire_dtype=wire_dtype,
                             traffic=traffic)


async def _aiter(items):
    for item in items:
        yield item
