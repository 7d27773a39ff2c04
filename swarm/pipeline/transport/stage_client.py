"""The client side of the stage RPCs (swarm/pipeline/stage/stage_rpc.py): their signatures (``StageRPC``), one call to a
stage peer, on a session, a unary message or a stream by size, and the StageError of a refusal."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator  # typing's, not collections.abc's: hivemind reads `hint._name` to detect streams

import torch
from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from swarm.pipeline.transport import sessions
from swarm.pipeline.transport.sessions import SESSION_LIMIT_BYTES, open_session, session_for
from swarm.pipeline.transport.streams import join_stream, split_message
from swarm.pipeline.transport.traffic import Traffic
from swarm.pipeline.transport.wire import (
    DEFAULT_RANK,
    UNARY_LIMIT_BYTES,
    as_proto,
    buffer_bytes,
    decode_tensors,
    encode_off_loop,
    pack_metadata,
    unpack_metadata,
)


# many calls on one long-lived stream (sessions.py, session_server.py): a raw stream handler of the stage's own
SESSION_HANDLER = "rpc_session"


def stage_namespace(run_id: str, swarm: str) -> str:
    """The P2P namespace of a swarm's stage RPCs."""
    return f"{run_id}.{swarm}"


class StageRPC(ServicerBase):
    """The stage RPCs as they travel: their names and protobuf types, which is all a stub needs. The server
    (swarm/pipeline/stage/stage_rpc.py ``StageServicer``) implements them; a client builds its stub from this class, so
    calling a stage does not import the server (no import circle). The handles keep the name they have had on the
    wire since the first version (``StageServicer.rpc_call``...), whichever class asks. The session handler
    (``SESSION_HANDLER``) is not a hivemind handler: the server registers it itself."""

    WIRE_NAME = "StageServicer"

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        handle = f"{cls.WIRE_NAME}.{method_name}"
        return handle if namespace is None else f"{namespace}::{handle}"

    async def rpc_call(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        raise NotImplementedError

    async def rpc_call_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                              context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError

    async def rpc_receipt_key(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        raise NotImplementedError


# said by a stage that refuses a tensor because it has banned its author (its reply names the author: the driver
# avoids that peer too, swarm/pipeline/control/driver_failures.py; a neighbour's word, never proof of a conviction)
BANNED_AUTHOR = "which this peer has banned"


class StageError(RuntimeError):
    """A hop failed at the remote peer; ``code`` says whether another peer can take it."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


async def call_stage(p2p: Any, peer_id: str, namespace: str, op: str, tensors: list[torch.Tensor], meta: dict,
                     *, timeout_s: float, codec: str, max_bytes: int, expect_bytes: int = 0,
                     traffic: Traffic | None = None, rank: int = DEFAULT_RANK,
                     ) -> tuple[list[torch.Tensor], dict, float]:
    """One hop: (tensors, reply metadata, seconds). Raises StageError (with ``retry_after_s``), WireError for a
    malformed reply, or a transport error/timeout. The reply's contents are checked by swarm/pipeline/transport/replies.py."""
    stub = StageRPC.get_stub(p2p, PeerID.from_base58(peer_id), namespace=namespace)
    serialized = await encode_off_loop(tensors, codec, rank)
    metadata = pack_metadata({**meta, "op": op})
    sent = buffer_bytes(serialized)
    started = time.perf_counter()
    session = None
    if sessions.enabled() and max(sent, expect_bytes) < SESSION_LIMIT_BYTES:
        session = open_session(p2p, peer_id, namespace) or \
            await asyncio.wait_for(session_for(p2p, peer_id, namespace,
                                               StageRPC._get_handle_name(namespace, SESSION_HANDLER)), timeout_s)
    if session is not None:
        left_s = max(timeout_s - (time.perf_counter() - started), 0.001)
        out_serialized, reply_meta = await session.call([as_proto(t) for t in serialized], metadata, left_s)
    elif max(sent, expect_bytes) < UNARY_LIMIT_BYTES:
        request = runtime_pb2.ExpertRequest(tensors=[as_proto(t) for t in serialized], metadata=metadata)
        reply = await asyncio.wait_for(stub.rpc_call(request), timeout_s)
        out_serialized, out_meta = list(reply.tensors), reply.metadata
    else:
        async def stream_call():
            messages = split_message(serialized, metadata, runtime_pb2.ExpertRequest, ask_end=True)
            replies = await stub.rpc_call_stream(_aiter(messages))
            return await join_stream(replies, max_bytes)

        out_serialized, out_meta = await asyncio.wait_for(stream_call(), timeout_s)
    elapsed = time.perf_counter() - started
    if session is None:
        reply_meta = unpack_metadata(out_meta)
    if traffic is not None:
        traffic.count(peer_id, inbound=buffer_bytes(out_serialized), outbound=sent, op=op)
    if not reply_meta:
        raise StageError("broken", f"{peer_id[-8:]} sent a reply without metadata (did it fail mid-reply?)")
    if reply_meta.get("ok") is not True:
        raise refusal_error(reply_meta)
    return decode_tensors(out_serialized, max_bytes, coded=True), reply_meta, elapsed


def refusal_error(reply_meta: dict) -> StageError:
    """The StageError of a refusal, with its ``retry_after_s`` (a float, or None when absent or unusable).
    Every field is a stranger's: code and text are cut short, a bad retry_after_s is ignored."""
    code = reply_meta.get("code", "error")
    text = "".join(c if c.isprintable() else "?" for c in str(reply_meta.get("error", ""))[:300])  # no escapes
    error = StageError(code[:32] if isinstance(code, str) and code.isprintable() and code else "error", text)
    retry_after_s = reply_meta.get("retry_after_s")
    ok = isinstance(retry_after_s, (int, float)) and not isinstance(retry_after_s, bool) and 0 <= retry_after_s < 1e6
    error.retry_after_s = float(retry_after_s) if ok else None
    author = reply_meta.get("author")
    error.author = author[:128] if isinstance(author, str) else ""
    return error


async def _aiter(items):
    for item in items:
        yield item
