"""Tensors on the wire: (de)serialization, streaming of large payloads, and checks on arrival.

A message is a hivemind ``ExpertRequest``/``ExpertResponse``: tensors plus msgpack metadata.
Payloads under ``UNARY_LIMIT_BYTES`` (512 KiB) travel in one unary call (~1 ms round trip); larger
ones are streamed in ``STREAM_CHUNK_BYTES`` parts (cheaper in CPU from there; p2pd caps unary at 4 MiB): streams.py.

Everything that arrives is untrusted: ``decode`` checks the declared sizes before touching the
buffers and raises ``WireError`` (never anything else) for a malformed or oversized message;
``check_tensor`` then checks dtype, shape and finiteness against what the stage expects.

Float tensors travel in the run's codec (swarm/pipeline/transport/codecs.py: float32, float16, int8, lowrank). A
framed codec (int8, lowrank) sends one uint8 tensor per float tensor; only callers that pass
``coded=True`` (the stage RPCs) accept those. A decoded tensor remembers the payload it came from, and
``encode_tensors`` relays that payload unchanged: the driver forwards a stage's output to the next stage
byte for byte, without coding it a second time, so the next stage can check it against the signer's
receipt (swarm/integrity/receipts.py: receipts sign the digest of what travels). ``serialize_once`` gives
a tensor of our own the same property (stage 0's output, which the driver signs).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from swarm.pipeline.transport import codecs
from swarm.run.models import TensorSpec
from swarm.run.runconfig import DEFAULT_WIRE_RANK as DEFAULT_RANK
from swarm.run.runconfig import WIRE_CODECS

# Above this, stream: p2pd's persistent-connection (unary) path costs 1.6-2x the CPU of a stream from
# 1 MiB up, while below ~256 KiB a unary call is as cheap or cheaper (benchmarks/README.md, finding 2).
UNARY_LIMIT_BYTES = 512 * 1024
STREAM_CHUNK_BYTES = 1024 * 1024
MAX_METADATA_BYTES = 64 * 1024
MAX_TENSORS = 8
WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16}
FRAMED_CODECS = frozenset({"int8", "lowrank"})
OFF_LOOP_VALUES = 65536  # a framed tensor this large is coded on a worker thread, not the RPC loop
_RELAY_ATTR = "_wire_payload"
_ALLOWED_DTYPES = {"float32", "float16", "int64", "bfloat16"}


class WireError(ValueError):
    """A message that must be rejected; the text is sent back to the caller."""


@dataclass(slots=True)
class Payload:
    """A serialized tensor held as one byte buffer, in place of hivemind's ``runtime_pb2.Tensor`` (same fields):
    a streamed tensor joined once (``streams.join_stream``), or a float32 tensor of ours seen as bytes without a copy
    (``encode_lean``). Protobuf hands out a fresh copy of a bytes field on every access, and hivemind's own
    join and (de)serialization copy 2 MiB four times more (benchmarks/README.md, issue 29); a payload is
    copied once on arrival and a tensor decoded from it shares its buffer. ``as_proto`` makes the message."""

    dtype: str
    size: list[int]
    compression: int
    buffer: bytearray | memoryview
    requires_grad: bool = False


def as_proto(item: Any) -> Any:
    """The ``runtime_pb2.Tensor`` of a payload (a protobuf message is returned as it is)."""
    if not isinstance(item, Payload):
        return item
    from hivemind.proto import runtime_pb2

    return runtime_pb2.Tensor(buffer=bytes(item.buffer), size=item.size, dtype=item.dtype,
                              compression=item.compression, requires_grad=item.requires_grad)


def buffer_bytes(items: Iterable[Any]) -> int:
    """Bytes of the items' buffers (a protobuf message's buffer is copied to be measured: those are small, unary,
    or coded; the large float32 tensors of the stage RPCs travel as payloads)."""
    return sum(len(item.buffer) for item in items)


def payload_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def encode_tensors(tensors: list[torch.Tensor], codec: str = "float32", rank: int = DEFAULT_RANK) -> list[Any]:
    """Serialize; floating tensors travel in ``codec`` (float16 halves the bytes, int8 quarters them,
    lowrank sends rank-``rank`` int8 factors); other tensors (sample ids) travel as they are."""
    from hivemind.compression import serialize_torch_tensor
    from hivemind.proto import runtime_pb2

    if codec not in WIRE_CODECS:
        raise ValueError(f"codec must be one of {', '.join(WIRE_CODECS)}, got {codec!r}")
    out = []
    for tensor in tensors:
        relayed = getattr(tensor, _RELAY_ATTR, None)
        if relayed is not None:
            out.append(as_proto(relayed))  # protobuf messages, always (encode_lean keeps payloads as they are)
            continue
        tensor = tensor.detach().cpu()
        if tensor.is_floating_point() and codec in FRAMED_CODECS and tensor.dim() >= 1 and tensor.numel():
            buffer = codecs.encode(tensor, codec, rank)
            out.append(runtime_pb2.Tensor(buffer=buffer, size=[len(buffer)], dtype="uint8", requires_grad=False))
            continue
        if tensor.is_floating_point() and codec == "float16" and tensor.dtype == torch.float32:
            out.append(as_proto(_float16_payload(tensor)))  # hivemind's bytes, in torch (_float16_payload)
            continue
        out.append(serialize_torch_tensor(tensor, runtime_pb2.CompressionType.NONE))
    return out


def encode_lean(tensors: list[torch.Tensor], codec: str = "float32", rank: int = DEFAULT_RANK) -> list[Any]:
    """``encode_tensors`` for the stage RPCs: a float32 tensor sent as float32 becomes a ``Payload`` over the
    tensor's own memory (no copy: the stream's parts are cut from it, ``streams.split_message``); everything else as
    ``encode_tensors`` does. The tensor must not be written afterwards (ours never are: outputs and gradients
    we computed and send as they are)."""
    out = []
    for tensor in tensors:
        relayed = getattr(tensor, _RELAY_ATTR, None)
        if relayed is not None:
            out.append(relayed)
        elif tensor.dtype == torch.float32 and codec == "float32" and tensor.device.type == "cpu":
            flat = tensor.detach().contiguous()
            view = memoryview(flat.numpy()).cast("B") if flat.numel() else memoryview(b"")
            out.append(Payload(dtype="float32", size=list(flat.shape), compression=0, buffer=view))
        elif tensor.dtype == torch.float32 and codec == "float16" and tensor.device.type == "cpu":
            out.append(_float16_payload(tensor))
        else:
            out.extend(encode_tensors([tensor], codec, rank))
    return out


def _float16_payload(tensor: torch.Tensor) -> Payload:
    """A float32 tensor in hivemind's FLOAT16 compression, byte for byte what ``Float16Compression.compress`` makes
    (clamped to float16's range, then rounded), in torch's vectorised conversion: 1.3 ms for 8 x 1,024 x 768 values
    here against hivemind's 5.8 ms (its float32 copy, and a copy into the message)."""
    half = tensor.detach().clamp(FP16_MIN, FP16_MAX).to(torch.float16).contiguous()
    view = memoryview(half.numpy()).cast("B") if half.numel() else memoryview(b"")
    return Payload(dtype="float32", size=list(half.shape), compression=FLOAT16, buffer=view)


def serialize_once(tensor: torch.Tensor, codec: str = "float32", rank: int = DEFAULT_RANK) -> Any:
    """Serialize ``tensor`` now and make every later ``encode_tensors`` of it send these bytes: the payload whose
    digest a receipt signs is then the payload that travels."""
    (item,) = encode_lean([tensor], codec, rank)
    setattr(tensor, _RELAY_ATTR, item)
    return item


def payload_of(tensor: torch.Tensor) -> Any | None:
    """The serialized payload a decoded (or ``serialize_once``d) tensor came from, or None."""
    return getattr(tensor, _RELAY_ATTR, None)


def carry_payload(source: torch.Tensor, converted: torch.Tensor) -> torch.Tensor:
    """``converted`` (e.g. ``source.to(dtype)``) relays ``source``'s payload: it is the same values."""
    item = getattr(source, _RELAY_ATTR, None)
    if item is not None and converted is not source:
        setattr(converted, _RELAY_ATTR, item)
    return converted


async def encode_off_loop(tensors: list[torch.Tensor], codec: str = "float32", rank: int = DEFAULT_RANK) -> list[Any]:
    """``encode_tensors`` on a worker thread when coding would hold the RPC loop (a lowrank charlm activation
    takes ~15 ms to code), inline otherwise."""
    import asyncio

    if codec in FRAMED_CODECS and sum(t.numel() for t in tensors) >= OFF_LOOP_VALUES:
        return await asyncio.to_thread(encode_lean, tensors, codec, rank)
    return encode_lean(tensors, codec, rank)


def coded_bytes(shape: tuple[int, ...], codec: str, rank: int = DEFAULT_RANK) -> int:
    """About how many bytes a float tensor of ``shape`` takes on the wire in ``codec`` (to choose unary or stream
    for a reply of that shape before it exists)."""
    numel = math.prod(shape)
    if codec == "float16":
        return 2 * numel
    if codec not in FRAMED_CODECS or not shape:
        return 4 * numel
    framed = codecs.int8_size(numel)
    cols = shape[-1]
    rows = numel // max(cols, 1)
    rank = min(rank, rows, cols)
    if codec == "lowrank" and len(shape) >= 2 and codecs.lowrank_pays(rows, cols, rank):
        framed = codecs.int8_size(rows * rank) + codecs.int8_size(rank * cols)
    return framed + 8 + 4 * len(shape)


def decode_tensors(serialized: list[Any], max_bytes: int, *, coded: bool = False) -> list[torch.Tensor]:
    """Deserialize untrusted tensors, checking declared sizes before allocating anything; with ``coded``,
    framed codec payloads (uint8) are accepted and decoded to float32."""
    if len(serialized) > MAX_TENSORS:
        raise WireError(f"too many tensors ({len(serialized)} > {MAX_TENSORS})")
    total = 0
    tensors = []
    for item in serialized:
        framed = coded and item.dtype == "uint8"
        if item.dtype not in _ALLOWED_DTYPES and not framed:
            raise WireError(f"dtype {item.dtype!r} is not accepted")
        if any(dim < 0 for dim in item.size) or len(item.size) > 8:
            raise WireError("malformed tensor shape")
        total += _declared_bytes(item, framed)
        if total > max_bytes:
            raise WireError(f"payload larger than the {max_bytes / 2**20:.0f} MiB this stage accepts")
        tensors.append(_decode_framed(item, max_bytes) if framed else _decode_plain(item))
    return tensors


def _declared_bytes(item: Any, framed: bool) -> int:
    """Bytes the item becomes in float32, from what it declares (a framed payload: from its header)."""
    if not framed:
        return math.prod(item.size) * 4
    if item.compression != 0 or list(item.size) != [len(item.buffer)]:
        raise WireError("malformed coded tensor (compressed, or its size is not its buffer's length)")
    try:
        return codecs.decoded_numel(item.buffer) * 4
    except codecs.CodecError as exc:
        raise WireError(f"malformed coded tensor: {exc}") from None


def _decode_framed(item: Any, max_bytes: int) -> torch.Tensor:
    try:
        tensor = codecs.decode(item.buffer, max_bytes)
    except codecs.CodecError as exc:
        raise WireError(f"malformed coded tensor: {exc}") from None
    except Exception as exc:  # a hostile buffer can fail in many ways; all of them are a rejection
        raise WireError(f"malformed coded tensor ({exc.__class__.__name__})") from None
    if not math.isfinite(peak_abs(tensor)):  # finite factors can still multiply past float32's range
        raise WireError("malformed coded tensor: it decodes to non-finite values")
    setattr(tensor, _RELAY_ATTR, item)
    return tensor


_PLAIN_DTYPES = {"float32": torch.float32, "float16": torch.float16, "int64": torch.int64}
FLOAT16 = 2  # hivemind's runtime_pb2.CompressionType.FLOAT16 (tests/test_codecs.py checks it)
FP16_MIN, FP16_MAX = torch.finfo(torch.float16).min, torch.finfo(torch.float16).max


def _decode_plain(item: Any) -> torch.Tensor:
    from hivemind.compression import deserialize_torch_tensor

    if isinstance(item, Payload) and item.compression == 0 and item.dtype in _PLAIN_DTYPES:
        tensor = _from_payload(item)
        setattr(tensor, _RELAY_ATTR, item)
        return tensor
    if item.compression == FLOAT16 and item.dtype == "float32":
        tensor = _from_float16(item)
        setattr(tensor, _RELAY_ATTR, item)
        return tensor
    try:
        tensor = deserialize_torch_tensor(as_proto(item)).detach()
    except Exception as exc:  # a hostile buffer can fail in many ways; all of them are a rejection
        raise WireError(f"malformed tensor ({exc.__class__.__name__})") from None
    setattr(tensor, _RELAY_ATTR, item)
    return tensor


def peak_abs(tensor: torch.Tensor) -> float:
    """The largest magnitude in ``tensor``, in one pass without a temporary (``aminmax``; 0.0 when empty). NaN and
    infinity propagate, so the peak is finite exactly when every value is: one call is both the finiteness check
    and the bound check (``isfinite(t).all()`` alone cost 10x as much: a bool tensor, then a second pass)."""
    if not tensor.numel():
        return 0.0
    low, high = (float(v) for v in torch.aminmax(tensor.detach()))
    if math.isnan(low) or math.isnan(high):
        return math.nan
    return max(-low, high)


def _from_payload(item: Payload) -> torch.Tensor:
    """The tensor over the payload's own buffer (no copy), its length checked against what it declares."""
    dtype = _PLAIN_DTYPES[item.dtype]
    numel = math.prod(item.size)
    if len(item.buffer) != numel * dtype.itemsize:
        raise WireError(f"malformed tensor: {len(item.buffer)} bytes for {numel} values of {item.dtype}")
    if numel == 0:
        return torch.empty(item.size, dtype=dtype)
    return torch.frombuffer(item.buffer, dtype=dtype).view(item.size)


def _from_float16(item: Any) -> torch.Tensor:
    """A FLOAT16-compressed float32 tensor, widened by torch (what hivemind's ``Float16Compression.extract`` does
    through numpy, ~15x slower: 10.5 against 0.7 ms for 8 x 1,024 x 768 values here, and the largest item of an
    H200 stage's RPC loop, session 30), its length checked against what it declares."""
    size = tuple(item.size)
    numel = math.prod(size)
    buffer = item.buffer  # a protobuf message hands out a copy per access: read once
    if len(buffer) != numel * 2:
        raise WireError(f"malformed tensor: {len(buffer)} bytes for {numel} float16 values")
    if numel == 0:
        return torch.empty(size, dtype=torch.float32)
    if isinstance(buffer, bytes) or (isinstance(buffer, memoryview) and buffer.readonly):
        buffer = bytearray(buffer)  # torch warns on read-only memory; a unary message's few hundred KiB, copied
    return torch.frombuffer(buffer, dtype=torch.float16).view(size).to(torch.float32)


def check_tensor(tensor: torch.Tensor, spec: TensorSpec, what: str, max_batch: int) -> torch.Tensor:
    """Dtype, shape and finite values against the stage's expectation; returns the tensor in spec dtype."""
    if tensor.is_floating_point() and spec.dtype.is_floating_point:
        tensor = tensor.to(spec.dtype)
    problem = spec.mismatch(tensor)
    if problem:
        raise WireError(f"{what}: {problem}")
    if tensor.shape[0] > max_batch or tensor.shape[0] == 0:
        raise WireError(f"{what}: batch of {tensor.shape[0]} outside 1..{max_batch}")
    if tensor.is_floating_point() and not math.isfinite(peak_abs(tensor)):
        raise WireError(f"{what}: contains NaN or infinite values")
    return tensor


def pack_metadata(meta: dict[str, Any]) -> bytes:
    from hivemind.utils import MSGPackSerializer

    return MSGPackSerializer.dumps(meta)


def unpack_metadata(raw: bytes, max_bytes: int = MAX_METADATA_BYTES) -> dict[str, Any]:
    from hivemind.utils import MSGPackSerializer

    if len(raw) > max_bytes:
        raise WireError("metadata too large")
    try:
        meta = MSGPackSerializer.loads(raw) if raw else {}
    except Exception:
        raise WireError("malformed metadata") from None
    if not isinstance(meta, dict):
        raise WireError("metadata is not a mapping")
    return meta


def refusal_meta(code: str, error: str, retry_after_s: float | None = None) -> dict:
    """A refusal's reply metadata: ``{"ok": false, "code", "error", ["retry_after_s"]}``."""
    reply = {"ok": False, "code": code, "error": error[:500]}
    if retry_after_s is not None:
        reply["retry_after_s"] = round(float(retry_after_s), 3)
    return reply
