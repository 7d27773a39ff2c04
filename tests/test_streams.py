"""Streamed messages end at a mark and their caller closes first (swarm/pipeline/transport/streams.py): p2pd dropped
the last parts of ~0.4 % of 7 MiB replies when the server closed its side first."""

import asyncio
import time
from typing import AsyncIterator

import pytest
import torch
from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import runtime_pb2

from benchmarks.common import p2p_pair
from swarm.pipeline.transport import streams
from swarm.pipeline.transport.streams import StreamCut, join_request, join_stream, reply_stream, split_message
from swarm.pipeline.transport.wire import WireError, decode_tensors, encode_tensors

MIB = 2**20
X = torch.randn(3, 512, 1024)  # 6 MiB as float32: 6 parts, 6 messages


async def _items(messages):
    for message in messages:
        yield message


async def _collect(generator) -> list:
    """What the wire carries: each message as it is when yielded (a server may clear one it has sent)."""
    return [type(message).FromString(message.SerializeToString()) async for message in generator]


def _reply(asked: bool) -> list:
    out: list = []  # filled, not returned: asyncio would write the repr of a task's 6 MiB result (1 s)

    async def run():
        messages = split_message(encode_tensors([X]), b"meta", runtime_pb2.ExpertResponse)
        out.extend(await _collect(reply_stream(messages, asked)))

    asyncio.run(run())
    return out


@pytest.fixture
def nobody_closes(monkeypatch):
    monkeypatch.setattr(streams, "CLOSE_WAIT_S", 0.0)  # no caller here closes a stream: a server's hold ends at once


def _marks(messages: list) -> list[int]:
    return [i for i, message in enumerate(messages) for part in message.tensors if not part.buffer and not part.dtype]


def test_a_caller_that_asks_gets_its_reply_marked_and_stops_reading_at_the_end_mark(nobody_closes):
    marked, plain = _reply(asked=True), _reply(asked=False)
    assert len(marked) == len(plain) == 6 and _marks(marked) == [0, 5] and _marks(plain) == []  # no message more
    read: list = []

    async def server():
        for message in marked + [runtime_pb2.ExpertResponse(metadata=b"never read")]:
            read.append(message)
            yield message

    tensors, metadata = asyncio.run(join_stream(server(), 8 * MIB))
    assert metadata == b"meta" and torch.equal(decode_tensors(tensors, 8 * MIB)[0], X)
    assert len(read) == 6  # it stopped at the end mark: the stream is closed by the caller
    # a reply of one message carries both marks; a caller of an earlier version reads the plain reply as before
    (single,) = asyncio.run(_collect(reply_stream([runtime_pb2.ExpertResponse(metadata=b"m")], True)))
    assert asyncio.run(join_stream(_items([single]), MIB)) == ([], b"m")
    whole, _ = asyncio.run(join_stream(_items(plain), 8 * MIB))
    assert torch.equal(decode_tensors(whole, 8 * MIB)[0], X)


def test_a_reply_that_promised_a_mark_and_ended_without_it_was_cut_even_when_its_tensors_look_whole(nobody_closes):
    marked, plain = _reply(asked=True), _reply(asked=False)
    with pytest.raises(StreamCut, match="end mark"):
        asyncio.run(join_stream(_items(marked[:-1] + plain[-1:]), 8 * MIB))  # every part, no end mark
    with pytest.raises(StreamCut):
        asyncio.run(join_stream(_items(marked[:3]), 8 * MIB))
    # a server that marks its reply's end before a tensor's parts are in sent a malformed reply: its doing
    with pytest.raises(WireError, match="at its end mark") as short:
        asyncio.run(join_stream(_items(marked[:3] + marked[-1:]), 8 * MIB))
    assert not isinstance(short.value, ConnectionError)
    # an earlier version's reply (no marks) cut between a tensor's parts is still told apart
    with pytest.raises(StreamCut, match="after 3 of a tensor's 6 parts"):
        asyncio.run(join_stream(_items(plain[:3]), 8 * MIB))


def test_a_server_tells_a_caller_that_asks_from_one_of_an_earlier_version():
    asked = list(split_message(encode_tensors([X]), b"meta", runtime_pb2.ExpertRequest, ask_end=True))
    plain = list(split_message(encode_tensors([X]), b"meta", runtime_pb2.ExpertRequest))
    assert len(asked) == len(plain) and asked[0].uid == streams.ASK_UID and not plain[0].uid
    for messages, expected in ((asked, True), (plain, False)):
        tensors, metadata, marked = asyncio.run(join_request(_items(messages), 8 * MIB))
        assert marked is expected and metadata == b"meta" and torch.equal(decode_tensors(tensors, 8 * MIB)[0], X)


def test_a_held_stream_keeps_nothing_of_its_reply_and_holds_are_capped_per_caller_and_in_all(monkeypatch):
    """A caller that never closes holds a coroutine and a stream for CLOSE_WAIT_S, not the reply's memory (hivemind's
    handler still references the last message it sent), and past a cap (its own, or the process's) a reply closes
    at once, as before marks."""
    async def reply(caller: str) -> tuple[int, asyncio.Future]:
        replies = reply_stream(split_message(encode_tensors([X]), b"meta", runtime_pb2.ExpertResponse), True, caller)
        sent = [await replies.__anext__() for _ in range(6)]
        after = asyncio.ensure_future(replies.__anext__())  # hivemind asks for more once the last one is sent
        await asyncio.sleep(0.05)
        return sent[-1].ByteSize(), after

    async def run() -> None:
        first = [await reply("a"), await reply("a")]
        assert [size for size, _ in first] == [0, 0] and not any(after.done() for _, after in first)  # held
        _, third = await reply("a")  # past the caller's cap: closed at once
        assert isinstance(third.exception(), StopAsyncIteration)
        _, other = await reply("b")  # another caller still gets its hold
        assert not other.done()
        for _, after in first + [(0, other)]:
            after.cancel()
        await asyncio.sleep(0.05)
        assert streams._holds == {}  # every hold given back
        # holds whose loop stopped before they ended (never given back) expire with their deadline
        streams._holds["a"] = [time.monotonic() - 1.0] * 2
        _, again = await reply("a")
        assert not again.done()
        again.cancel()
        await asyncio.sleep(0.05)
        assert streams._holds == {}

    monkeypatch.setattr(streams, "_holds", {})  # this process's other tests' holds are theirs
    monkeypatch.setattr(streams, "CLOSE_WAIT_S", 30.0)
    monkeypatch.setattr(streams, "HOLDS_PER_CALLER", 2)
    asyncio.run(run())

    async def capped() -> None:
        _, after = await reply("c")
        assert isinstance(after.exception(), StopAsyncIteration)

    monkeypatch.setattr(streams, "HOLDS_MAX", 0)  # the process's cap, whoever asks
    asyncio.run(capped())


class Echo(ServicerBase):
    """A server of streamed replies as the stage's ``rpc_call_stream`` serves them."""

    def __init__(self):
        self.held_until: list[float] = []  # when each marked reply's hold ended (the caller's close)

    async def rpc_echo(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                       context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        serialized, metadata, asked = await join_request(requests, 16 * MIB)
        messages = split_message(serialized, metadata, runtime_pb2.ExpertResponse)
        try:
            async for message in reply_stream(messages, asked):
                yield message
        finally:
            self.held_until.append(time.monotonic())


def test_over_p2pd_the_caller_closes_first_and_the_server_s_hold_ends_with_it():
    async def run():
        async with p2p_pair() as (server, client):
            echo = Echo()
            await echo.add_p2p_handlers(server)
            stub = Echo.get_stub(client, server.peer_id)
            for ask_end in (True, False):
                started = time.monotonic()
                requests = split_message(encode_tensors([X]), b"meta", runtime_pb2.ExpertRequest, ask_end=ask_end)
                replies = await asyncio.wait_for(stub.rpc_echo(_items(requests)), 10)
                tensors, metadata = await asyncio.wait_for(join_stream(replies, 16 * MIB), 10)
                assert metadata == b"meta" and torch.equal(decode_tensors(tensors, 16 * MIB)[0], X)
                deadline = time.monotonic() + 5
                while len(echo.held_until) < (1 if ask_end else 2) and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                # the server held its side open after its end mark until the caller's close, not CLOSE_WAIT_S
                assert echo.held_until[-1] - started < streams.CLOSE_WAIT_S / 2

    asyncio.run(asyncio.wait_for(run(), 60))


def test_the_stage_client_and_an_averaging_pull_ask_for_marks_and_close_first_over_p2pd():
    """The RPC clients themselves ask (a test of streams.py alone would pass if call_stage or fetch_params did not):
    a streamed hop to a stage and a pull of a copy, each against a server that serves marks and records the ask."""
    from types import SimpleNamespace

    from swarm.averaging.params_rpc import ParamsServicer, fetch_params
    from swarm.pipeline.transport.stage_client import StageRPC, call_stage
    from swarm.pipeline.transport.wire import pack_metadata

    asks: list[tuple[str, bool]] = []

    class Stage(StageRPC):
        async def rpc_call_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                                  context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
            serialized, _, asked = await join_request(requests, 16 * MIB)
            asks.append(("stage", asked))
            out = split_message(serialized, pack_metadata({"ok": True}), runtime_pb2.ExpertResponse)
            async for message in reply_stream(out, asked, str(context.remote_id)):
                yield message

    class Recorder:  # the pulls' handler, as a wrapper: the handle keeps ParamsServicer's name
        def __init__(self, params: ParamsServicer):
            self.params = params

        async def rpc_fetch(self, request: runtime_pb2.ExpertRequest,
                            context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
            asks.append(("params", request.uid == streams.ASK_UID))
            async for message in self.params.rpc_fetch(request, context):
                yield message

    run = SimpleNamespace(run_id="r", averaging=SimpleNamespace(max_state_mb=64.0))
    worker = SimpleNamespace(capture=lambda optimizer: SimpleNamespace(
        params={"w": X}, optimizer=None, clock=1.0, loss_ema=None, param_version=1))

    async def main():
        async with p2p_pair() as (server, client):
            await Stage().add_p2p_handlers(server, namespace="r.layer1")
            params = ParamsServicer(worker, run_id="r", swarm="layer1")
            await params.add_p2p_handlers(server, Recorder(params), namespace="r.layer1")
            (out,), _, _ = await call_stage(client, str(server.peer_id), "r.layer1", "forward", [X], {"mb": "m"},
                                            timeout_s=20, codec="float32", max_bytes=16 * MIB)
            state, _ = await fetch_params(client, str(server.peer_id), run, "layer1", timeout_s=20)
            assert torch.equal(out, X) and torch.equal(state["w"], X)
            deadline = time.monotonic() + 5
            while params.serving and time.monotonic() < deadline:  # its hold ends at our close, not in 10 s
                await asyncio.sleep(0.01)
            assert params.serving == 0 and params.served == 1

    asyncio.run(asyncio.wait_for(main(), 60))
    assert asks == [("stage", True), ("params", True)]
