"""Two fixes to hivemind 1.1.12: unary calls that time out must not kill the P2P client's read loop (a loaded
machine needs it), and a stream message is refused by its announced size before it is read (a stranger's).

``ControlClient._read_from_persistent_conn`` (hivemind/p2p/p2p_daemon_bindings/control.py) hands each
reply of the daemon to the future of its call with ``set_result``. A call that timed out is cancelled,
and so is its future, but the future leaves ``_pending_calls`` only when the cancelled task runs again.
A reply that arrives in between meets a cancelled future: ``set_result`` raises ``InvalidStateError``,
the read loop ends, and from then on no reply and no incoming request of that client is ever read. Every
call through it times out; the node looks online and trains nothing. Measured: 32 volunteers on 2 cores
(`benchmarks.soak`), 5 of 8 drivers froze this way within 4 minutes, their lanes cycling through
30-second timeouts while the stages sat idle (asyncio task dumps: the read task was gone).

``apply()`` replaces that method with one that skips futures that are already done (the reply of a
call nobody waits for any more is dropped, as hivemind meant) and logs, instead of ending, on anything
else a single message does. Idempotent; applied on import of swarm.dht.dht (before hivemind forks its DHT
process, which inherits it).

The second: ``P2P.receive_raw_data`` reads a stream message's 8-byte length and then that many bytes, whatever the
length says, before anything of ours can look at it. Measured (issue 25): one 300 MiB part from a stranger took a
stage's RSS from 610 to 1,363 MB before the stage's own 256 MiB check refused it, and nothing needs a peer's
identity or a record to send it. ``receive_raw_data`` (patched in) refuses a length over ``MAX_FRAME_BYTES``
without reading on; hivemind's stream handler logs the error and closes the stream, a caller reading replies gets
the error as a failed call. Our own stream messages are at most 3 MiB (swarm/pipeline/transport/wire.py STREAM_CHUNK_BYTES
1 MiB, swarm/averaging/params_rpc.py PULL_CHUNK_BYTES 3 MiB) plus at most 64 KiB of metadata; unary calls go
through the daemon's persistent connection, which p2pd caps at 4 MiB.
"""

from __future__ import annotations

import asyncio
import logging
from uuid import UUID

logger = logging.getLogger(__name__)

_APPLIED = False
_ORIGINAL = None  # hivemind's own loop, kept for tests/test_hivemind_fixes.py
MAX_FRAME_BYTES = 8 * 2**20


class FrameTooLarge(ValueError):
    """A stream message announced more bytes than this node reads in one message."""


async def receive_raw_data(reader: asyncio.StreamReader) -> bytes:
    """hivemind's ``P2P.receive_raw_data``, refusing a message longer than ``MAX_FRAME_BYTES`` by its header."""
    from hivemind.p2p.p2p_daemon import P2P

    header = await reader.readexactly(P2P.HEADER_LEN)
    length = int.from_bytes(header, P2P.BYTEORDER)
    if length > MAX_FRAME_BYTES:
        raise FrameTooLarge(f"a stream message announced {length:,} bytes, over the {MAX_FRAME_BYTES:,} this node "
                            "reads in one message: refused unread")
    return await reader.readexactly(length)


def _settle(future: asyncio.Future | None, result=None, exception: BaseException | None = None) -> None:
    """Complete a call's future unless it is gone or done (cancelled by a timeout)."""
    if future is None or future.done():
        return
    if exception is not None:
        future.set_exception(exception)
    else:
        future.set_result(result)


async def read_from_persistent_conn(self, reader: asyncio.StreamReader) -> None:
    """hivemind's loop, with every completion of a call's future guarded (the module doc)."""
    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError, read_pbmsg_safe
    from hivemind.proto import p2pd_pb2 as p2pd_pb
    from hivemind.utils.asyncio import cancel_task_if_running

    while True:
        resp = p2pd_pb.PersistentConnectionResponse()
        try:
            await read_pbmsg_safe(reader, resp)
        except asyncio.IncompleteReadError:
            break
        try:
            call_id = UUID(bytes=resp.callId)
            pending = self._pending_calls.get(call_id)
            if resp.HasField("callUnaryResponse"):
                if resp.callUnaryResponse.HasField("response"):
                    _settle(pending, resp.callUnaryResponse.response)
                elif resp.callUnaryResponse.HasField("error"):
                    _settle(pending, exception=P2PHandlerError(resp.callUnaryResponse.error.decode(errors="ignore")))
            elif resp.HasField("requestHandling"):
                handler_task = asyncio.create_task(self._handle_persistent_request(call_id, resp.requestHandling))
                self._handler_tasks[call_id] = handler_task
            elif call_id in self._handler_tasks and resp.HasField("cancel"):
                cancel_task_if_running(self._handler_tasks[call_id])
            elif pending is not None and resp.HasField("daemonError"):
                _settle(pending, exception=P2PDaemonError(resp.daemonError.message))
            elif pending is not None:
                _settle(pending, None)
        except Exception:  # one odd message must not end the loop that every later reply needs
            logger.exception("a message from the p2p daemon could not be handled; reading on")


def apply() -> None:
    global _APPLIED, _ORIGINAL
    if _APPLIED:
        return
    from hivemind.p2p.p2p_daemon import P2P
    from hivemind.p2p.p2p_daemon_bindings.control import ControlClient

    _ORIGINAL = ControlClient.__dict__["_read_from_persistent_conn"]
    ControlClient._read_from_persistent_conn = read_from_persistent_conn
    P2P.receive_raw_data = staticmethod(receive_raw_data)
    _APPLIED = True


def original_read_loop():
    """hivemind's own read loop, whether or not apply() ran."""
    from hivemind.p2p.p2p_daemon_bindings.control import ControlClient

    return _ORIGINAL if _ORIGINAL is not None else ControlClient.__dict__["_read_from_persistent_conn"]
