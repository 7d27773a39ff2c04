"""The parameter service: any peer can download a consistent copy of our layer, with its state.

One streaming RPC per swarm, ``ParamsServicer.rpc_fetch``, in the swarm's namespace
``{run_id}.layer{k}`` (beside the stage RPCs). The request is metadata only::

    {"op": "params", "run_id": ..., "swarm": ..., "optimizer": bool, "wire_dtype": "float32" | "float16"}

The reply streams the module's ``state_dict`` tensors (floating ones as ``wire_dtype``), then, when
asked, the optimizer state as named float32 tensors (float16 would flush Adam's second moments to
zero). Its metadata, on the first message, names the tensors and carries the copy's state::

    {"ok": true, "names": [...], "optimizer_names": [...], "clock": float, "loss": float | None,
     "param_version": int}

or ``{"ok": false, "code": "busy" | "syncing" | "wrong_run" | "rejected", "error": ...}``. The copy is
taken under the stage's lock (never half-updated) on a helper thread, so a pull neither blocks the
event loop nor waits behind queued micro-batches. At most ``MAX_CONCURRENT_SERVES`` pulls are served
at once; the others are refused as ``busy`` and try another peer.

``fetch_params`` is the client, kept plain for other callers (``volunteer export``)::

    state_dict, meta = await fetch_params(p2p, peer_id, run, "layer2", timeout_s=30, wire_dtype="float16")
    module.load_state_dict(state_dict)
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Any, AsyncIterator  # hivemind spots streaming handlers by typing.AsyncIterator only

import torch
from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from swarm.pipeline.stage.stage_rpc import Traffic, stage_namespace
from swarm.pipeline.transport.streams import ASK_UID, join_stream, reply_stream
from swarm.pipeline.transport.wire import (
    WIRE_DTYPES, WireError, decode_tensors, encode_tensors, pack_metadata, unpack_metadata,
)

logger = logging.getLogger(__name__)

PARAMS_OP = "params"
MAX_CONCURRENT_SERVES = 2
MAX_PARAMS_METADATA_BYTES = 4 * 2**20  # tensor names of a large layer do not fit wire.py's 64 KiB
MAX_NAME_CHARS = 512
PULL_CHUNK_BYTES = 3 * 2**20  # a whole layer streams in chunks this large (p2pd caps a message at 4 MiB)


class ParamsRefused(RuntimeError):
    """The peer answered but did not serve (busy, still syncing, another run); try another peer."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


class ParamsServicer(ServicerBase):
    """Serves one stage worker's parameters. Built with no arguments it only lends its signature to stubs."""

    def __init__(self, worker: Any = None, *, run_id: str = "", swarm: str = "",
                 is_ready: Callable[[], bool] = lambda: True, traffic: Traffic | None = None,
                 max_concurrent: int = MAX_CONCURRENT_SERVES):
        self.worker = worker
        self.run_id = run_id
        self.swarm = swarm
        self.is_ready = is_ready
        self.traffic = traffic or Traffic()
        self.max_concurrent = max_concurrent
        self.serving = 0
        self.served = 0  # copies sent in full

    async def rpc_fetch(self, request: runtime_pb2.ExpertRequest,
                        context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        refusal = self._refusal(request.metadata)
        if refusal is not None:
            yield runtime_pb2.ExpertResponse(metadata=pack_metadata({"ok": False, **refusal}))
            return
        meta = unpack_metadata(request.metadata, MAX_PARAMS_METADATA_BYTES)
        self.serving += 1
        try:
            copy = self._copy(meta, str(context.remote_id))
            async for message in reply_stream(copy, request.uid == ASK_UID, str(context.remote_id)):
                yield message
        finally:
            self.serving -= 1

    async def _copy(self, meta: dict, peer: str) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        state = await asyncio.to_thread(self.worker.capture, bool(meta.get("optimizer")))
        optimizer = state.optimizer or {}
        reply = pack_metadata({
            "ok": True, "names": list(state.params), "optimizer_names": list(optimizer),
            "clock": float(state.clock), "loss": state.loss_ema, "param_version": int(state.param_version),
        })
        tensors = [(t, str(meta.get("wire_dtype"))) for t in state.params.values()]
        tensors += [(t, "float32") for t in optimizer.values()]  # float16 would flush Adam's 2nd moments
        async for message in _stream(tensors, reply, self.traffic, peer):
            yield message
        self.served += 1

    def _refusal(self, raw: bytes) -> dict | None:
        try:
            meta = unpack_metadata(raw, MAX_PARAMS_METADATA_BYTES)
        except WireError as exc:
            return {"code": "rejected", "error": str(exc)}
        if meta.get("op") != PARAMS_OP or meta.get("wire_dtype") not in WIRE_DTYPES:
            return {"code": "rejected", "error": "expected op 'params' with wire_dtype float32 or float16"}
        if meta.get("run_id") != self.run_id or meta.get("swarm") != self.swarm:
            return {"code": "wrong_run", "error": f"this peer serves {self.run_id}/{self.swarm}"}
        if not self.is_ready():
            return {"code": "syncing", "error": "this peer is still downloading its layer"}
        if self.serving >= self.max_concurrent:
            return {"code": "busy", "error": f"already serving {self.serving} copies"}
        return None


async def _stream(tensors: list[tuple[torch.Tensor, str]], metadata: bytes,
                  traffic: Traffic, peer: str) -> AsyncIterator[runtime_pb2.ExpertResponse]:
    """Serialize tensor by tensor while the previous ones are on the wire; the metadata rides first."""
    from hivemind.utils.streaming import split_for_streaming

    first = True
    for tensor, wire_dtype in tensors:
        if tensor.numel() * tensor.element_size() >= PULL_CHUNK_BYTES:
            (serialized,) = await asyncio.to_thread(encode_tensors, [tensor], wire_dtype)
        else:
            (serialized,) = encode_tensors([tensor], wire_dtype)
        traffic.count(peer, outbound=len(serialized.buffer))
        for part in split_for_streaming(serialized, PULL_CHUNK_BYTES):
            yield runtime_pb2.ExpertResponse(tensors=[part], metadata=metadata if first else b"")
            first = False
    if first:
        yield runtime_pb2.ExpertResponse(tensors=[], metadata=metadata)


# ----- client


async def fetch_params(p2p: Any, peer_id: str, run: Any, swarm: str, timeout_s: float, wire_dtype: str = "float32",
                       *, with_optimizer: bool = False, max_bytes: int | None = None,
                       traffic: Traffic | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Download a peer's copy of ``swarm``'s layer: ``(state_dict, meta)``.

    ``meta``: ``peer_id``, ``clock`` (samples trained into the copy), ``loss`` (its loss EMA or None),
    ``param_version``, ``bytes`` received and ``seconds`` taken; with ``with_optimizer`` also
    ``optimizer_state`` (named tensors, see swarm/run/optim_state.py). The whole call is bounded by
    ``timeout_s``. Raises ``ParamsRefused`` (the peer declined), ``WireError`` (a ValueError: a malformed
    or oversized reply), ``asyncio.TimeoutError``, or ``ConnectionError`` (the peer is unreachable or
    the stream broke). The tensors are *not* checked against a layer:
    that is ``checks.check_params``' job, since only the caller knows its own copy.
    """
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"wire_dtype must be one of {sorted(WIRE_DTYPES)}, got {wire_dtype!r}")
    limit = max_bytes if max_bytes is not None else int(run.averaging.max_state_mb * 2**20)
    stub = ParamsServicer.get_stub(p2p, PeerID.from_base58(peer_id), namespace=stage_namespace(run.run_id, swarm))
    request = runtime_pb2.ExpertRequest(metadata=pack_metadata({
        "op": PARAMS_OP, "run_id": run.run_id, "swarm": swarm, "optimizer": with_optimizer, "wire_dtype": wire_dtype,
    }), uid=ASK_UID)
    started = time.perf_counter()

    async def call() -> tuple[list[Any], bytes]:
        stream = await stub.rpc_fetch(request)
        return await join_stream(stream, limit)

    try:
        serialized, raw = await asyncio.wait_for(call(), timeout_s)
    except (asyncio.TimeoutError, asyncio.CancelledError, WireError):
        raise
    except Exception as exc:  # p2pd and stream errors come in many classes; callers need one
        raise ConnectionError(f"pulling {swarm} from {peer_id[-8:]} failed: {exc.__class__.__name__}: {exc}") from exc
    received = sum(len(t.buffer) for t in serialized)
    if traffic is not None:
        traffic.count(peer_id, inbound=received)
    reply = unpack_metadata(raw, MAX_PARAMS_METADATA_BYTES)
    if not reply:  # no metadata at all: the stream was cut before its first message (the peer left, a reset)
        raise ConnectionError(f"pulling {swarm} from {peer_id[-8:]}: the stream ended before the reply's metadata")
    if not reply.get("ok"):
        raise ParamsRefused(str(reply.get("code", "error"))[:40], str(reply.get("error", ""))[:500])
    names, optimizer_names = _names(reply.get("names")), _names(reply.get("optimizer_names", []))
    named = len(names) + len(optimizer_names)
    if len(serialized) < named or (serialized and _cut_short(serialized[-1])):
        # a stream that ended early is a network fault, not a hostile reply: the caller retries, bans nobody
        raise ConnectionError(f"pulling {swarm} from {peer_id[-8:]}: the stream ended early ({len(serialized)} of "
                              f"{named} tensors)")
    if named != len(serialized) or len(set(names)) != len(names):
        raise WireError(f"the reply names {named} tensors but carries {len(serialized)}")
    tensors = _decode_each(serialized, limit)
    meta: dict[str, Any] = {
        "peer_id": peer_id, "clock": _number(reply.get("clock"), "clock"), "loss": _loss(reply.get("loss")),
        "param_version": _count(reply.get("param_version")), "bytes": received,
        "seconds": time.perf_counter() - started,
    }
    if with_optimizer:
        meta["optimizer_state"] = dict(zip(optimizer_names, tensors[len(names):]))
    return dict(zip(names, tensors[: len(names)])), meta


_ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8}


def _cut_short(item: Any) -> bool:
    """A plain tensor whose buffer is shorter than its declared shape needs: the last part of a stream that broke."""
    width = _ITEM_BYTES.get(item.dtype)
    if width is None or item.compression != 0 or any(d < 0 for d in item.size):
        return False
    return len(item.buffer) < width * math.prod(item.size)


def _decode_each(serialized: list[Any], max_bytes: int) -> list[torch.Tensor]:
    """wire.decode_tensors caps a message at a few tensors; a layer has many, so decode one by one."""
    out, budget = [], max_bytes
    for item in serialized:
        (tensor,) = decode_tensors([item], budget)
        budget -= tensor.numel() * 4
        out.append(tensor)
    return out


def _names(value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(n, str) and 0 < len(n) <= MAX_NAME_CHARS for n in value):
        raise WireError("malformed tensor names")
    return value


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise WireError(f"malformed {what}")
    return float(value)


def _loss(value: Any) -> float | None:
    return None if value is None else _number(value, "loss")


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise WireError("malformed param_version")
    return value
