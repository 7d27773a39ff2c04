"""The server's side of a stage session (sessions.py has the caller's): many calls on one stream, each answered as
soon as it is done, in any order, with its call id in the reply's metadata (``"cid"``).

``serve_stream`` reads and writes the stream itself (a stage registers it as a binary stream handler: one read loop,
each reply one ``write``, frames.py); the rule of what a session runs is ``_serve``'s, whatever carries the messages
(tests/test_stage_sessions.py also serves it through hivemind's protobuf stream handler, as a stage of an earlier
version did: the wire is the same, so callers and servers of either kind talk to each other).

What a session runs: at most ``max_running`` calls at once (more are answered ``busy``, unread); when the caller ends
its side, what it asked is answered, then the server ends its own; when the caller leaves (a cut stream) or the node
stops, every call still running is cancelled (an update whose compute began is finished by the stage itself:
``StageServicer._handle``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from swarm.pipeline.transport import sessions
from swarm.pipeline.transport.frames import FrameError, read_messages, write_message
from swarm.pipeline.transport.stage_client import SESSION_HANDLER
from swarm.pipeline.transport.wire import pack_metadata, refusal_meta

logger = logging.getLogger(__name__)

# an honest caller sends a call on a session only under sessions.SESSION_LIMIT_BYTES of tensors (plus its metadata:
# receipts, a route): twice that bounds what one request may make this stage buffer and parse (the 16 MiB of
# frames.MAX_FRAME_BYTES is for replies, whose size a caller only estimates)
MAX_REQUEST_BYTES = 2 * sessions.SESSION_LIMIT_BYTES

Handle = Callable[[runtime_pb2.ExpertRequest], Awaitable[tuple[list[Any], dict]]]


async def _serve(requests: AsyncIterator[runtime_pb2.ExpertRequest], handle: Handle, max_running: int,
                 send: Callable[[runtime_pb2.ExpertResponse], Awaitable[None]]) -> None:
    running: set[asyncio.Task] = set()

    def reply(cid: str, tensors: list[Any], meta: dict) -> runtime_pb2.ExpertResponse:
        return runtime_pb2.ExpertResponse(tensors=tensors, metadata=pack_metadata({**meta, "cid": cid}))

    async def one(cid: str, request: runtime_pb2.ExpertRequest) -> None:
        try:
            tensors, meta = await handle(request)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # _handle answers every refusal itself: this is a bug of ours, said as one
            logger.exception("a session call failed")
            tensors, meta = [], refusal_meta("broken", f"the stage failed: {exc.__class__.__name__}")
        await send(reply(cid, tensors, meta))

    try:
        async for request in requests:
            cid = request.uid[:sessions.MAX_CALL_ID_CHARS]
            if len(running) >= max_running:
                await send(reply(cid, [], refusal_meta("busy", f"over {max_running} calls at once on one session",
                                                       retry_after_s=0.2)))
                continue
            task = asyncio.create_task(one(cid, request))
            running.add(task)
            task.add_done_callback(running.discard)
        while running:  # the caller ended its side: answer what it asked, then end ours
            await asyncio.wait(set(running))
    finally:  # the caller left or the node stops: nothing of this session may outlive it on the loop
        for task in list(running):
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)


async def serve_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handle: Handle,
                       max_running: int | None = None, peer: str = "") -> None:
    """Serve one session on a raw stream until the caller ends it, leaves, or sends what is no message (dropped)."""

    async def send(message: runtime_pb2.ExpertResponse) -> None:
        if writer.is_closing():
            return
        try:
            write_message(writer, message)
            await writer.drain()  # a caller that does not read holds its own calls, not the loop's memory
        except (ConnectionError, OSError):  # the caller left: the read loop ends with the stream
            pass

    try:
        await _serve(read_messages(reader, runtime_pb2.ExpertRequest, MAX_REQUEST_BYTES), handle,
                     max_running or sessions.MAX_RUNNING, send)
    except FrameError as exc:
        logger.info("a session from %s was dropped: %s", peer[-8:] or "a peer", exc)
    except (asyncio.IncompleteReadError, ConnectionError, OSError):  # the caller left: its calls end with it
        pass
    finally:
        writer.close()


class SessionHandlers:
    """A stage servicer's session handler (``SESSION_HANDLER``), registered beside hivemind's handlers for its
    ``rpc_*`` methods as a raw stream handler that reads and writes its stream itself (``serve_stream``: hivemind's
    stream handler passed each message through a queue, three generators and three writes). Each call is served by
    ``_one_message`` exactly as a unary call from the stream's authenticated remote peer."""

    session_tasks: set[asyncio.Task]  # the sessions served now (a stop cancels them)

    def session_cap(self) -> int:
        return sessions.MAX_RUNNING

    async def _one_message(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> tuple[list[Any], dict]:
        raise NotImplementedError

    async def add_p2p_handlers(self, p2p: Any, wrapper: Any = None, *, namespace: str | None = None,
                               balanced: bool = False) -> None:
        await super().add_p2p_handlers(p2p, wrapper, namespace=namespace, balanced=balanced)  # type: ignore[misc]
        name = self._get_handle_name(namespace, SESSION_HANDLER)  # type: ignore[attr-defined]
        await p2p.add_binary_stream_handler(name, functools.partial(self._session, p2p.peer_id, name), balanced)

    async def remove_p2p_handlers(self, p2p: Any, *, namespace: str | None = None) -> None:
        await super().remove_p2p_handlers(p2p, namespace=namespace)  # type: ignore[misc]
        await p2p.remove_binary_stream_handler(self._get_handle_name(namespace, SESSION_HANDLER))  # type: ignore

    async def _session(self, local_id: Any, name: str, stream_info: Any, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> None:
        context = P2PContext(handle_name=name, local_id=local_id, remote_id=stream_info.peer_id)
        # served in a task of its own, which a stop cancels: this one is asyncio's task for p2pd's connection, whose
        # end asyncio 3.11 reads with task.exception() (a cancelled one would log a traceback at every stop)
        serving = asyncio.create_task(serve_stream(reader, writer, functools.partial(self._one_message,
                                                                                     context=context),
                                                   self.session_cap(), peer=str(stream_info.peer_id)))
        self.session_tasks.add(serving)
        try:
            await serving
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # this task itself is cancelled, not only the session
                serving.cancel()
                raise
        finally:
            self.session_tasks.discard(serving)
