"""The edge-message service of the edge modes (dsgd, pdmm_isvr, admm_isvr): one push per edge exchange.

Two handlers per swarm, in the swarm's namespace ``{run_id}.layer{k}`` beside the stage and parameter
services: ``EdgeServicer.rpc_edge`` (unary) and ``rpc_edge_stream`` (for messages over wire.py's
unary limit). A request carries exactly one tensor, the message: the layer's parameters flattened
(DSGD) or the ECL dual message ``y_ij / eta`` (same shape), as float32 or float16; and metadata::

    {"op": "edge", "run_id": ..., "swarm": "layer2", "mode": "pdmm_isvr", "step": 812}

``step`` is the sender's local step (for logs and tests). The reply is metadata only:
``{"ok": true}`` or ``{"ok": false, "code": ..., "error": ...}`` with code

    wrong_run      another run, swarm or mode: this peer does not take the message
    not_neighbour  the receiver's graph has no edge to the sender (views differ for a heartbeat after a
                   join or leave, or the receiver stopped listening to the sender after a bad message)
    rejected       malformed: wrong size, dtype or non-finite values; nothing of it was applied

The sender is the connection's authenticated libp2p peer id (``context.remote_id``), never a field of
the message, so a peer cannot speak for another. Sending is fire-and-forget from the caller's point
of view: nothing waits for a message, and a lost one only delays that edge's dual (the algorithms are
asynchronous by design).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, AsyncIterator  # hivemind spots streaming handlers by typing.AsyncIterator only

import torch
from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from swarm.stage_rpc import Traffic, stage_namespace
from swarm.wire import (
    UNARY_LIMIT_BYTES, WireError, decode_tensors, encode_tensors, join_stream, pack_metadata, split_message,
    unpack_metadata,
)

logger = logging.getLogger(__name__)

EDGE_OP = "edge"
MAX_STEP = 2**62

# receive(sender, message, step) -> None, or raises EdgeRefused; runs on the event loop
Receive = Callable[[str, torch.Tensor, int], None]


class EdgeRefused(RuntimeError):
    """The receiver answered but did not take the message; ``code`` says why (see the module doc)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


class EdgeServicer(ServicerBase):
    """Takes edge messages for one peer. Built with no arguments it only lends its signatures to stubs."""

    def __init__(self, receive: Receive | None = None, *, run_id: str = "", swarm: str = "", mode: str = "",
                 numel: int = 0, traffic: Traffic | None = None):
        self.receive = receive
        self.run_id = run_id
        self.swarm = swarm
        self.mode = mode
        self.numel = numel
        self.traffic = traffic or Traffic()

    async def rpc_edge(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        self.traffic.bytes_in += sum(len(t.buffer) for t in request.tensors)
        reply = self._handle(list(request.tensors), request.metadata, str(context.remote_id))
        return runtime_pb2.ExpertResponse(metadata=pack_metadata(reply))

    async def rpc_edge_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                              context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        try:
            serialized, metadata = await join_stream(requests, self._max_bytes())
            self.traffic.bytes_in += sum(len(t.buffer) for t in serialized)
            reply = self._handle(serialized, metadata, str(context.remote_id))
        except WireError as exc:
            reply = _refusal("rejected", str(exc))
        yield runtime_pb2.ExpertResponse(metadata=pack_metadata(reply))

    def _max_bytes(self) -> int:
        return self.numel * 4 + 4096  # float32 at most, plus serialization headers

    def _handle(self, serialized: list[Any], metadata: bytes, sender: str) -> dict:
        reply = self._check_and_receive(serialized, metadata, sender)
        if reply.get("code") == "rejected":
            logger.warning("rejected an edge message from %s: %s", sender[-8:], reply["error"])
        elif reply.get("code") == "wrong_run":
            logger.info("refused an edge message from %s: %s", sender[-8:], reply["error"])
        return reply

    def _check_and_receive(self, serialized: list[Any], metadata: bytes, sender: str) -> dict:
        try:
            meta = unpack_metadata(metadata)
            if meta.get("op") != EDGE_OP:
                return _refusal("rejected", "expected op 'edge'")
            if (meta.get("run_id"), meta.get("swarm"), meta.get("mode")) != (self.run_id, self.swarm, self.mode):
                return _refusal("wrong_run", f"this peer takes {self.mode} messages of {self.run_id}/{self.swarm}")
            step = meta.get("step")
            if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < MAX_STEP:
                return _refusal("rejected", "step must be a non-negative integer")
            tensors = decode_tensors(serialized, self._max_bytes())
            if len(tensors) != 1:
                return _refusal("rejected", f"expected one tensor, got {len(tensors)}")
            (message,) = tensors
            if message.dtype not in (torch.float32, torch.float16) or message.dim() != 1 or message.numel() != self.numel:
                return _refusal("rejected", f"expected a flat float tensor of {self.numel} values, got "
                                            f"{message.dtype} of shape {tuple(message.shape)}")
            assert self.receive is not None
            self.receive(sender, message.float(), step)
            return {"ok": True}
        except EdgeRefused as exc:
            return _refusal(exc.code, str(exc).split(": ", 1)[-1])
        except WireError as exc:
            return _refusal("rejected", str(exc))


def _refusal(code: str, error: str) -> dict:
    return {"ok": False, "code": code, "error": error[:500]}


async def send_edge_message(p2p: Any, peer_id: str, run: Any, swarm: str, message: torch.Tensor, step: int, *,
                            timeout_s: float, wire_dtype: str = "float32", traffic: Traffic | None = None) -> None:
    """Push one edge message to ``peer_id``. Raises ``EdgeRefused`` (the peer answered no),
    ``asyncio.TimeoutError``, or ``ConnectionError`` (unreachable, broken stream)."""
    stub = EdgeServicer.get_stub(p2p, PeerID.from_base58(peer_id), namespace=stage_namespace(run.run_id, swarm))
    serialized = encode_tensors([message.reshape(-1)], wire_dtype)
    metadata = pack_metadata({"op": EDGE_OP, "run_id": run.run_id, "swarm": swarm, "mode": run.averaging.mode,
                              "step": int(step)})
    sent = sum(len(t.buffer) for t in serialized)

    async def call() -> bytes:
        if sent < UNARY_LIMIT_BYTES:
            reply = await stub.rpc_edge(runtime_pb2.ExpertRequest(tensors=serialized, metadata=metadata))
            return reply.metadata
        replies = await stub.rpc_edge_stream(_aiter(split_message(serialized, metadata, runtime_pb2.ExpertRequest)))
        _, raw = await join_stream(replies, 4096)
        return raw

    try:
        raw = await asyncio.wait_for(call(), timeout_s)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        raise
    except Exception as exc:  # p2pd and stream errors come in many classes; callers need one
        raise ConnectionError(f"edge message to {peer_id[-8:]} failed: {exc.__class__.__name__}: {exc}") from exc
    if traffic is not None:
        traffic.bytes_out += sent
    reply = unpack_metadata(raw)
    if not reply.get("ok"):
        raise EdgeRefused(str(reply.get("code", "error"))[:40], str(reply.get("error", ""))[:500])


async def _aiter(items):
    for item in items:
        yield item
