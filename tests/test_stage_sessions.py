"""Stage calls on one long-lived stream per peer (swarm/pipeline/transport/sessions.py): real hivemind P2P peers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import functools
from typing import AsyncIterator

import pytest
import torch
from hivemind.p2p import P2P, P2PContext, ServicerBase
from hivemind.proto import runtime_pb2

from benchmarks.common import p2p_pair
from swarm.pipeline.transport import frames, sessions
from swarm.pipeline.transport.session_server import MAX_REQUEST_BYTES, SessionHandlers, _serve, serve_stream
from swarm.pipeline.transport.stage_client import SESSION_HANDLER
from swarm.pipeline.transport.sessions import SessionBroken, session_for
from swarm.pipeline.stage.stage_rpc import call_stage
from swarm.pipeline.transport.wire import pack_metadata, unpack_metadata

NS = "sessions-test"
HANDLE = f"{NS}::EchoServicer.rpc_session"
LEAN_HANDLE = f"{NS}::LeanEcho.session"


async def serve_session(requests, handle, max_running: int | None = None):
    """A session served through hivemind's protobuf stream handler, as a stage of an earlier version served it: the
    stage's own rule (session_server._serve), its replies yielded as each call is done."""
    done: asyncio.Queue = asyncio.Queue()

    async def send(message) -> None:
        done.put_nowait(message)

    async def serve() -> None:
        try:
            await _serve(requests, handle, max_running or sessions.MAX_RUNNING, send)
        finally:
            done.put_nowait(None)

    server = asyncio.create_task(serve())
    try:
        while (message := await done.get()) is not None:
            yield message
    finally:  # the caller left or the test ends
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)


class EchoServicer(ServicerBase):
    """Answers each session call with its own metadata after ``delay_s`` (from the request), or never (``hang``)."""

    def __init__(self):
        self.sessions_opened = 0
        self.unary_calls = 0

    @staticmethod
    async def handle(quit_now: asyncio.Event, request):
        meta = unpack_metadata(request.metadata)
        if meta.get("quit"):  # this session's stream ends after this reply, calls still waiting on it or not
            quit_now.set()
        if meta.get("hang"):
            await asyncio.Event().wait()
        await asyncio.sleep(meta.get("delay_s", 0.0))
        return list(request.tensors), {"ok": True, "echo": meta.get("n")}

    async def rpc_session(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                          context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        self.sessions_opened += 1
        quit_now = asyncio.Event()
        async for reply in serve_session(requests, functools.partial(self.handle, quit_now)):
            yield reply
            if quit_now.is_set():
                return


class LeanEcho(EchoServicer):
    """The same, served as a stage serves its sessions: a raw stream handler that reads and writes the frames itself
    (swarm/pipeline/transport/session_server.py ``serve_stream``), under the name ``LEAN_HANDLE``."""

    async def add_p2p_handlers(self, p2p, *, namespace):
        await super().add_p2p_handlers(p2p, namespace=namespace)
        await p2p.add_binary_stream_handler(LEAN_HANDLE, self.lean_session)

    async def lean_session(self, stream_info, reader, writer):
        self.sessions_opened += 1
        quit_now = asyncio.Event()
        serving = asyncio.create_task(serve_stream(reader, writer, functools.partial(self.handle, quit_now)))
        quitting = asyncio.create_task(quit_now.wait())
        await asyncio.wait({serving, quitting}, return_when=asyncio.FIRST_COMPLETED)
        if quit_now.is_set():
            await asyncio.sleep(0.1)  # the reply that said so goes out first
        for task in (serving, quitting):
            task.cancel()
        await asyncio.gather(serving, quitting, return_exceptions=True)

    async def rpc_call(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        self.unary_calls += 1
        return runtime_pb2.ExpertResponse(tensors=request.tensors, metadata=pack_metadata({"ok": True}))


class Flooder(ServicerBase):
    """A hostile peer: answers every call, after a flood of replies to calls nobody made."""

    async def rpc_session(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                          context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for request in requests:
            for n in range(sessions.MAX_UNMATCHED + 8):
                yield runtime_pb2.ExpertResponse(metadata=pack_metadata({"ok": True, "cid": f"x{n}"}) if n % 2
                                                 else b"\xc1 garbage")
            yield runtime_pb2.ExpertResponse(metadata=pack_metadata({"ok": True, "cid": request.uid}))


class UnaryOnly(ServicerBase):
    """An older peer: the stage handlers without ``rpc_session`` (registered under StageServicer's names)."""

    def __init__(self):
        self.unary_calls = 0

    async def rpc_call(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        self.unary_calls += 1
        return runtime_pb2.ExpertResponse(tensors=request.tensors, metadata=pack_metadata({"ok": True}))


UnaryOnly.__name__ = "StageServicer"  # hivemind names a handler by its class: a stub of ours finds this one


@pytest.fixture(params=["hivemind", "lean"])
def echo(request):
    """A session server either way: hivemind's stream handler (an older stage), or the stage's own (LeanEcho)."""
    return (EchoServicer(), HANDLE) if request.param == "hivemind" else (LeanEcho(), LEAN_HANDLE)


def with_peers(body, servicer):
    async def main():
        async with p2p_pair() as (server, client):
            try:
                await servicer.add_p2p_handlers(server, namespace=NS)
                return await asyncio.wait_for(body(server, client), 60)
            finally:
                sessions.close_sessions(client)

    return asyncio.run(main())


def request_meta(n: int, **extra) -> bytes:
    return pack_metadata({"n": n, **extra})


def test_concurrent_calls_share_one_session_and_each_reply_finds_its_call(echo):
    servicer, handle = echo

    async def body(server, client):
        session = await session_for(client, str(server.peer_id), NS, handle)
        assert session is not None

        async def one(n):  # the first calls answer last: replies come back out of order
            tensors, meta = await session.call([], request_meta(n, delay_s=0.02 * (16 - n)), timeout_s=20)
            return meta["echo"]

        echoes = await asyncio.gather(*(one(n) for n in range(16)))
        assert echoes == list(range(16))
        again = await session_for(client, str(server.peer_id), NS, handle)
        assert again is session and servicer.sessions_opened == 1 and servicer.unary_calls == 0

    with_peers(body, servicer)


def test_a_broken_session_fails_its_waiting_calls_and_the_next_call_opens_another(echo):
    servicer, handle = echo

    async def body(server, client):
        session = await session_for(client, str(server.peer_id), NS, handle)
        waiting = asyncio.create_task(session.call([], request_meta(1, hang=True), timeout_s=30))
        await asyncio.sleep(0.3)
        _, meta = await session.call([], request_meta(2, quit=True), timeout_s=10)  # the server ends the stream
        with pytest.raises(SessionBroken):
            await asyncio.wait_for(waiting, 5)
        assert session.closed
        fresh = await session_for(client, str(server.peer_id), NS, handle)
        assert fresh is not session
        _, meta = await fresh.call([], request_meta(3), timeout_s=10)
        assert meta["echo"] == 3 and servicer.sessions_opened == 2

    with_peers(body, servicer)


def test_a_timed_out_call_is_dropped_and_a_session_that_answers_nothing_is_closed(echo):
    servicer, handle = echo

    async def body(server, client):
        session = await session_for(client, str(server.peer_id), NS, handle)
        _, meta = await session.call([], request_meta(0), timeout_s=10)
        with pytest.raises(TimeoutError):
            await session.call([], request_meta(1, hang=True), timeout_s=0.3)
        assert not session.closed and not session.waiting  # one timeout: a slow stage, not a dead session
        _, meta = await session.call([], request_meta(2), timeout_s=10)  # a reply in between clears the count
        assert meta["echo"] == 2
        for n in (3, 4):
            with pytest.raises(TimeoutError):
                await session.call([], request_meta(n, hang=True), timeout_s=0.3)
        assert session.closed  # two in a row with nothing answered: the next call opens a new one
        fresh = await session_for(client, str(server.peer_id), NS, handle)
        assert fresh is not session and (await fresh.call([], request_meta(5), timeout_s=10))[1]["echo"] == 5

    with_peers(body, servicer)


def test_a_peer_without_sessions_gets_unary_calls():
    servicer = UnaryOnly()

    async def body(server, client):
        x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        for _ in range(3):
            (out,), reply, _ = await call_stage(client, str(server.peer_id), NS, "forward", [x], {}, timeout_s=10,
                                                codec="float32", max_bytes=2**20)
            assert torch.equal(out, x) and reply["ok"] is True
        assert servicer.unary_calls == 3
        assert sessions._NO_SESSION_UNTIL[client]  # asked once, then unary for NO_SESSION_S

    with_peers(body, servicer)


def test_a_session_runs_at_most_max_running_calls_at_once(monkeypatch):
    monkeypatch.setattr(sessions, "MAX_RUNNING", 4)

    async def main():
        gate = asyncio.Event()

        async def handle(request):
            await gate.wait()
            return [], {"ok": True}

        async def requests():
            for n in range(6):
                yield runtime_pb2.ExpertRequest(uid=str(n))
            await asyncio.sleep(0.2)
            gate.set()

        replies = []
        async for reply in serve_session(requests(), handle):
            replies.append(unpack_metadata(reply.metadata))
        return replies

    replies = asyncio.run(asyncio.wait_for(main(), 10))
    busy = [r for r in replies if r.get("code") == "busy"]
    assert [r["cid"] for r in busy] == ["4", "5"] and busy[0]["retry_after_s"] > 0
    assert sorted(r["cid"] for r in replies if r.get("ok")) == ["0", "1", "2", "3"]  # answered after the input ended


def test_a_peer_that_floods_its_session_with_replies_nobody_asked_for_loses_the_session():
    async def body(server, client):
        session = await session_for(client, str(server.peer_id), NS, "sessions-test::Flooder.rpc_session")
        with pytest.raises(SessionBroken, match="nobody made"):
            await session.call([], request_meta(1), timeout_s=10)
        assert session.closed

    with_peers(body, Flooder())


def test_a_peer_that_cannot_be_reached_fails_the_call_at_once_without_a_unary_retry():
    async def body(server, client):
        gone = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        gone_id = str(gone.peer_id)
        await gone.shutdown()
        with pytest.raises(SessionBroken, match="could not open a session"):
            await asyncio.wait_for(session_for(client, gone_id, NS, HANDLE), 30)
        assert (gone_id, NS) not in sessions._NO_SESSION_UNTIL.get(client, {})  # the next call tries a session again

    with_peers(body, EchoServicer())


def test_a_retired_session_still_answers_the_calls_waiting_on_a_busy_peer(echo):
    """Two timeouts with nothing answered retire a session; a slow call already waiting on it is not failed (a busy
    machine is not a broken stream): it gets its reply, then the session closes, and new calls use a new one."""
    servicer, handle = echo

    async def body(server, client):
        session = await session_for(client, str(server.peer_id), NS, handle)
        slow = asyncio.create_task(session.call([], request_meta(1, delay_s=1.5), timeout_s=20))
        for n in (2, 3):
            with pytest.raises(TimeoutError):
                await session.call([], request_meta(n, hang=True), timeout_s=0.3)
        assert session.retired and not session.closed
        fresh = await session_for(client, str(server.peer_id), NS, handle)
        assert fresh is not session and (await fresh.call([], request_meta(4), timeout_s=10))[1]["echo"] == 4
        assert (await asyncio.wait_for(slow, 10))[1]["echo"] == 1
        assert session.closed

    with_peers(body, servicer)


def test_a_caller_of_hivemind_s_own_stream_framing_is_served_by_the_stage_s_session_handler():
    """The wire is the same either way: hivemind's stream caller (a peer of an older version) against serve_stream."""
    async def body(server, client):
        async def requests():
            for n in range(3):
                yield runtime_pb2.ExpertRequest(uid=str(n), metadata=request_meta(n, delay_s=0.05 * (3 - n)))

        replies = client._iterate_protobuf_stream_handler(server.peer_id, LEAN_HANDLE, requests(),
                                                          runtime_pb2.ExpertResponse)
        echoes = sorted([unpack_metadata(reply.metadata)["echo"] async for reply in await replies])
        assert echoes == [0, 1, 2]

    with_peers(body, LeanEcho())


@pytest.mark.parametrize("garbage", [b"\x00" + (2**40).to_bytes(8, "big"), b"\x07" + bytes(8),
                                     b"\x00" + (MAX_REQUEST_BYTES + 1).to_bytes(8, "big")],
                         ids=["a length of a terabyte", "an unknown message type",
                              "a request over the session's bound"])
def test_a_stream_that_carries_no_message_is_dropped_unread_and_the_server_serves_on(garbage, caplog):
    servicer = LeanEcho()

    async def body(server, client):
        _, reader, writer = await client.call_binary_stream_handler(server.peer_id, LEAN_HANDLE)
        writer.write(garbage)
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 10) == b""  # the server ended the stream, answering nothing
        writer.close()
        session = await session_for(client, str(server.peer_id), NS, LEAN_HANDLE)
        assert (await session.call([], request_meta(1), timeout_s=10))[1]["echo"] == 1

    with caplog.at_level("INFO", logger="swarm.pipeline.transport.session_server"):
        with_peers(body, servicer)
    assert "was dropped" in caplog.text


def test_a_caller_that_cuts_its_stream_cancels_its_running_calls_on_the_server():
    """A cut stream is not an ended one: nothing is left running for a caller that is gone."""
    started, cancelled = asyncio.Event(), []

    async def handle(request):
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(request.uid)
            raise

    class Hanging(LeanEcho):
        async def lean_session(self, stream_info, reader, writer):
            await serve_stream(reader, writer, handle)

    async def body(server, client):
        _, reader, writer = await client.call_binary_stream_handler(server.peer_id, LEAN_HANDLE)
        frames.write_message(writer, runtime_pb2.ExpertRequest(uid="7"))
        await asyncio.wait_for(started.wait(), 10)
        writer.close()  # no end-of-stream message: the caller is gone
        for _ in range(100):
            if cancelled:
                break
            await asyncio.sleep(0.05)
        assert cancelled == ["7"]

    with_peers(body, Hanging())


class MiniStage(SessionHandlers, ServicerBase):
    """A stage's session handler on its own (StageServicer's mixin): each call hangs until the stop."""

    def __init__(self):
        self.session_tasks = set()
        self.calls = 0

    async def _one_message(self, request, context):
        self.calls += 1
        await asyncio.Event().wait()


def test_a_stop_ends_the_stage_s_sessions_without_a_traceback_and_their_callers_hear_it(caplog):
    """A stop cancels each session's own task, never asyncio's task of p2pd's connection (asyncio 3.11 logs a
    cancelled one's end as an error with a traceback: tests/test_ctl.py found it in a volunteer's stderr)."""
    servicer = MiniStage()

    async def body(server, client):
        session = await session_for(client, str(server.peer_id), NS, f"{NS}::MiniStage.{SESSION_HANDLER}")
        waiting = asyncio.create_task(session.call([], request_meta(1), timeout_s=30))
        await wait_for_async(lambda: servicer.calls == 1)
        for task in list(servicer.session_tasks):  # what StageServicer.end_sessions does at a stop
            task.cancel()
        with pytest.raises(SessionBroken):
            await asyncio.wait_for(waiting, 10)
        await asyncio.sleep(0.2)
        assert not servicer.session_tasks

    with caplog.at_level("WARNING"):
        with_peers(body, servicer)
    assert "Exception in callback" not in caplog.text and "Traceback" not in caplog.text


async def wait_for_async(condition, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.02)


def test_a_peer_that_served_sessions_and_stops_serving_them_is_leaving_not_an_older_version(caplog):
    """A stopping stage removes its handlers before it goes: its callers fail the call (it is retried elsewhere)
    and keep asking it for sessions, instead of saying it is an older version and calling it unary for a minute."""
    servicer = LeanEcho()

    async def body(server, client):
        session = await session_for(client, str(server.peer_id), NS, LEAN_HANDLE)
        assert (await session.call([], request_meta(1), timeout_s=10))[1]["echo"] == 1
        await server.remove_binary_stream_handler(LEAN_HANDLE)
        session.close()
        try:
            fresh = await asyncio.wait_for(session_for(client, str(server.peer_id), NS, LEAN_HANDLE), 10)
        except sessions.SessionUnopened as exc:
            assert "no longer serves" in str(exc)
        else:  # p2pd may open a stream to a protocol it saw the peer serve, and hear the refusal only later
            assert fresh is not None and fresh is not session
            with pytest.raises(SessionBroken):
                await fresh.call([], request_meta(2), timeout_s=10)
        assert not sessions._NO_SESSION_UNTIL.get(client)

    with caplog.at_level("INFO", logger="swarm.pipeline.transport.sessions"):
        with_peers(body, servicer)
    assert "older version" not in caplog.text
