"""Streamed messages: a message over ``UNARY_LIMIT_BYTES`` cut into parts, joined back once, and closed by its caller.

**Why the caller closes a stream first.** p2pd ends a stream whose server closed its side while the last parts were
still on their way as if it were complete: the server's daemon sees its local socket close, closes the libp2p stream
and resets it when its read side fails, and the reset drops what it had not sent yet. Measured on loopback (two
hivemind P2P instances, a handler that yields seven 1 MiB messages, 1,500 calls a run): 5 and 8 replies of 1,500
short. So a caller that knows this protocol asks for *marks* (``ASK_UID`` in its request's first message, a field
the stream handlers of an earlier version ignore), and a server that sees the ask marks its reply: an empty tensor
part (no bytes, no dtype, which no real part is) after its first message's parts (a promise: "this reply ends with
a mark") and after its last message's (the end), then waits for the caller to close the stream (``CLOSE_WAIT_S`` at
most; hivemind's handler ends the wait when the caller's close arrives). The caller stops reading at the end mark and
closes: the same measure, 0 of 1,500 short twice, no message more on the wire. A reply that promised a mark and
ended without it was cut (``StreamCut``, a failed connection), even when its tensors look whole.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import suppress
from typing import Any

from swarm.pipeline.transport.wire import STREAM_CHUNK_BYTES, Payload, WireError

CLOSE_WAIT_S = 10.0  # a server waits this long at most, after its end mark, for the caller to close the stream
# streams held open at once in this process, and for one caller, at most: a caller that never closes holds a coroutine
# and a p2pd stream (nothing of the reply: see reply_stream) for CLOSE_WAIT_S; past a cap a reply closes at once, as
# before (p2pd's rare cut: a failed connection, retried, nobody blamed). An honest caller closes within a round trip.
HOLDS_MAX, HOLDS_PER_CALLER = 128, 16
# caller -> when each stream held for it ends at the latest (the loops of a stage and of averaging share these): a
# hold whose loop stopped before it ended (a stage rebuilt in the process, a test's loop) expires with its deadline
_holds: dict[str, list[float]] = {}
_holds_lock = threading.Lock()
ASK_UID = "eor"  # a request's ``uid`` that asks: "mark your streamed reply's end, I close the stream first"


class StreamCut(ConnectionError):
    """A streamed message ended before a tensor's declared parts had all come, or before the end mark its
    server promised: the stream was cut (a peer that left, a reset; p2pd ends such a stream as if it were complete),
    not a malformed message. Callers treat it as a failed connection, never as the sender's fault."""


def split_message(serialized: list[Any], metadata: bytes, message_type: type, *,
                  ask_end: bool = False) -> Iterator[Any]:
    """One streamed message per chunk; metadata rides on the first. A ``Payload``'s chunks are cut straight from
    its buffer (hivemind's ``split_for_streaming`` first copies a message's whole buffer out of protobuf). A
    request with ``ask_end`` asks its server to mark its reply's end (``ASK_UID``)."""
    from hivemind.utils.streaming import split_for_streaming

    first = True
    for tensor in serialized:
        parts = (_payload_parts(tensor) if isinstance(tensor, Payload)
                 else split_for_streaming(tensor, STREAM_CHUNK_BYTES))
        for part in parts:
            message = message_type(tensors=[part], metadata=metadata if first else b"")
            if first and ask_end:
                message.uid = ASK_UID
            yield message
            first = False
    if first:
        yield message_type(tensors=[], metadata=metadata, **({"uid": ASK_UID} if ask_end else {}))


async def reply_stream(messages: Iterable[Any] | AsyncIterator[Any], asked: bool,
                       caller: str = "") -> AsyncIterator[Any]:
    """A server's streamed reply: ``messages`` as they are to a caller that did not ask; to one that did, with an
    empty part after the first message's parts (the promise) and after the last's (the end), and then held open
    until that caller (``caller``: its peer id, for the caps) closes (hivemind cancels this generator then). The
    server passes the only reference to the reply's payload (in ``messages``): a hostile caller that never closes
    must not hold a reply's memory."""
    if not asked:
        async for message in _aiter(messages):
            yield message
        return
    held = None
    async for message in _aiter(messages):
        if held is None:
            message.tensors.add()  # the promise
        else:
            yield held
        held = message
    if held is not None:
        held.tensors.add()  # the end
        yield held
        held.Clear()  # sent (hivemind writes a message before it asks for the next), and still referenced by it
        held = messages = None  # nothing of the reply is kept while the stream is held (callers drop theirs too)
        until = _take_hold(caller)
        if until is not None:
            try:
                await asyncio.sleep(CLOSE_WAIT_S)
            finally:
                _give_back(caller, until)


def _take_hold(caller: str) -> float | None:
    """A held stream for ``caller``: its deadline, or None past a cap (the caller's, or the process's)."""
    now = time.monotonic()
    with _holds_lock:
        for who, deadlines in list(_holds.items()):
            deadlines[:] = [until for until in deadlines if until > now]
            if not deadlines:
                del _holds[who]
        if len(_holds.get(caller, ())) >= HOLDS_PER_CALLER or sum(map(len, _holds.values())) >= HOLDS_MAX:
            return None
        until = now + CLOSE_WAIT_S
        _holds.setdefault(caller, []).append(until)
        return until


def _give_back(caller: str, until: float) -> None:
    with _holds_lock:
        deadlines = _holds.get(caller, [])
        if until in deadlines:
            deadlines.remove(until)
        if not deadlines:
            _holds.pop(caller, None)


async def _aiter(messages: Iterable[Any] | AsyncIterator[Any]) -> AsyncIterator[Any]:
    if isinstance(messages, AsyncIterator):
        async for message in messages:
            yield message
    else:
        for message in messages:
            yield message


def _payload_parts(item: Payload) -> Iterator[Any]:
    from hivemind.proto import runtime_pb2

    view = memoryview(item.buffer)
    starts = range(0, len(view), STREAM_CHUNK_BYTES)
    yield runtime_pb2.Tensor(compression=item.compression, buffer=bytes(view[:STREAM_CHUNK_BYTES]), chunks=len(starts),
                             size=item.size, dtype=item.dtype, requires_grad=item.requires_grad)
    for start in starts[1:]:
        yield runtime_pb2.Tensor(buffer=bytes(view[start : start + STREAM_CHUNK_BYTES]))


async def join_stream(stream: AsyncIterator[Any], max_bytes: int) -> tuple[list[Payload], bytes]:
    """Collect a streamed reply: (one ``Payload`` per tensor, metadata), refusing oversized streams. A tensor's
    parts are joined once into one buffer, which its decoded tensor then shares (``decode_tensors``). A tensor's
    first part declares how many it has (``chunks``, hivemind's and ours): fewer before the next tensor or the end
    raise ``StreamCut``, as does a reply that promised an end mark and ended without it. At its end mark the reply is
    complete: the stream is closed here, before its server closes it."""
    tensors, metadata, _ = await _join(stream, max_bytes, reply=True)
    return tensors, metadata


async def join_request(requests: AsyncIterator[Any], max_bytes: int) -> tuple[list[Payload], bytes, bool]:
    """A server's ``join_stream`` of a streamed request: (tensors, metadata, whether the caller asked for marks).
    Marks in a request mean nothing (a caller's are not parts: skipped)."""
    return await _join(requests, max_bytes, reply=False)


async def _join(stream: AsyncIterator[Any], max_bytes: int, *, reply: bool) -> tuple[list[Payload], bytes, bool]:
    metadata = b""
    tensors: list[Payload] = []
    head: Any = None
    parts: list[bytes] = []
    received = 0
    first, promised, ended, asked = True, False, False, False
    async for message in stream:
        if message.metadata:
            metadata = message.metadata
        if not reply and message.uid == ASK_UID:
            asked = True
        for part in message.tensors:
            buffer = part.buffer  # read once: protobuf copies a bytes field on every access
            if not buffer and not part.dtype:  # a mark: the promise in the first message, the end after it
                ended = promised
                promised = promised or first
                continue
            received += len(buffer)
            if received > max_bytes:
                raise WireError(f"stream larger than the {max_bytes / 2**20:.0f} MiB this stage accepts")
            if part.dtype and parts:
                tensors.append(_joined(head, parts, ended=False))
                parts = []
            if not parts:
                head = part
            parts.append(buffer)
        first = False
        if ended and reply:
            break
    if ended and reply and hasattr(stream, "aclose"):
        with suppress(Exception):
            await stream.aclose()  # the caller closes first: its server is waiting for it (reply_stream)
    if reply and promised and not ended:
        raise StreamCut("the stream ended before the end mark its server promised")
    if parts:
        tensors.append(_joined(head, parts, ended=ended))
    return tensors, metadata, asked


def _joined(head: Any, parts: list[bytes], *, ended: bool) -> Payload:
    if head.chunks > len(parts):
        text = f"the stream ended after {len(parts)} of a tensor's {head.chunks} parts"
        if ended:  # its server marked the reply's end: a short tensor is its doing
            raise WireError(f"{text}, at its end mark")
        raise StreamCut(text)
    return Payload(dtype=head.dtype, size=list(head.size), compression=int(head.compression),
                   buffer=bytearray().join(parts), requires_grad=head.requires_grad)
