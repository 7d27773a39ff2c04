"""hivemind's stream framing, written in one piece and read with a bound (issue 41, item 4).

A message on a hivemind stream is a type byte (``P2P.MESSAGE_MARKER`` or ``P2P.ERROR_MARKER``), an 8-byte big-endian
length and a serialized protobuf. hivemind's ``P2P.send_protobuf`` writes those as three or more ``write`` calls
(the payload in 64 KiB chunks): on an idle socket each one is a system call, and p2pd forwards each read it gets as a
frame of its own on the libp2p stream (a yamux frame, an encryption, a TCP send; the same again on the far side).
Stage sessions write each message here as one ``write`` instead: the same bytes on the wire, so either side may be
hivemind's. hivemind's reader also takes whatever length the peer declares; ``read_messages`` refuses one over
``MAX_FRAME_BYTES`` before buffering it (the stream is dropped as broken).

An error-typed message ends a stream (hivemind's ``P2P.END_OF_STREAM``, or an ``RPCError`` from a failing handler).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from google.protobuf.message import DecodeError, Message
from hivemind.p2p import P2P

MESSAGE, ERROR, HEADER_LEN, BYTEORDER = P2P.MESSAGE_MARKER, P2P.ERROR_MARKER, P2P.HEADER_LEN, P2P.BYTEORDER
# a reply: calls whose request or expected reply pass SESSION_LIMIT_BYTES (2 MiB) keep their own stream, and p2pd
# caps a unary message at 4 MiB: a reply of 16 MiB is no session message of an honest peer of any version (a request
# is bounded tighter: session_server.py)
MAX_FRAME_BYTES = 16 * 2**20

M = TypeVar("M", bound=Message)


class FrameError(ConnectionError):
    """The stream carried something that is not a message this side reads: it is dropped, never parsed on."""


class Ended(Exception):
    """The peer ended its side of the stream with an error-typed message (``message``: its text, if any)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def frame(payload: bytes, marker: bytes = MESSAGE) -> bytes:
    return marker + len(payload).to_bytes(HEADER_LEN, BYTEORDER) + payload


def write_message(writer: asyncio.StreamWriter, message: Message) -> None:
    """One ``write`` for the whole message (a copy of at most a session's 2 MiB, against two more system calls and
    two more frames on the libp2p stream); the caller awaits ``writer.drain()`` where it must not run ahead."""
    writer.write(frame(message.SerializeToString()))


def write_end(writer: asyncio.StreamWriter) -> None:
    """hivemind's end of a request stream (``P2P.END_OF_STREAM``: an empty ``RPCError``, error-typed)."""
    writer.write(frame(P2P.END_OF_STREAM.SerializeToString(), ERROR))


async def read_message(reader: asyncio.StreamReader, message_type: type[M], max_bytes: int = MAX_FRAME_BYTES) -> M:
    """The next message; ``Ended`` at an error-typed one, ``asyncio.IncompleteReadError`` where the stream ends,
    ``FrameError`` for an unknown type byte, a length over ``max_bytes`` or bytes that do not parse."""
    marker = await reader.readexactly(1)
    if marker not in (MESSAGE, ERROR):
        raise FrameError(f"unknown message type {marker!r}")
    length = int.from_bytes(await reader.readexactly(HEADER_LEN), BYTEORDER)
    if length > max_bytes:
        raise FrameError(f"a message of {length} bytes (at most {max_bytes})")
    data = await reader.readexactly(length)
    if marker == ERROR:
        raise Ended(_error_text(data))
    message = message_type()
    try:
        message.ParseFromString(data)
    except DecodeError as exc:
        raise FrameError(f"a message that does not parse: {exc}") from None
    return message


async def read_messages(reader: asyncio.StreamReader, message_type: type[M],
                        max_bytes: int = MAX_FRAME_BYTES) -> AsyncIterator[M]:
    """Messages until the peer ends its side (an error-typed message); ``asyncio.IncompleteReadError`` where the stream
    was cut instead, FrameError as read_message."""
    while True:
        try:
            message = await read_message(reader, message_type, max_bytes)
        except Ended:
            return
        yield message


def _error_text(data: bytes) -> str:
    from hivemind.proto.p2pd_pb2 import RPCError

    error: Any = RPCError()
    try:
        error.ParseFromString(data)
    except DecodeError:
        return "an unreadable error"
    return str(error.message)[:200]
