"""swarm/dht/hivemind_fixes.py: a reply that meets a call cancelled by its timeout must not end the P2P
client's read loop (hivemind 1.1.12's loop dies on it, and every later call of that client times out)."""

from __future__ import annotations

import asyncio
import uuid

from swarm.dht import hivemind_fixes


def _frame(message) -> bytes:
    body = message.SerializeToString()
    size, prefix = len(body), bytearray()
    while True:
        byte, size = size & 0x7F, size >> 7
        prefix.append(byte | (0x80 if size else 0))
        if not size:
            return bytes(prefix) + body


class _Client:
    """What the read loop touches of hivemind's ControlClient."""

    def __init__(self):
        self._pending_calls: dict = {}
        self._handler_tasks: dict = {}


async def _replies_after_a_timeout(read_loop) -> tuple[asyncio.Future, asyncio.Future, asyncio.Task]:
    from hivemind.proto import p2pd_pb2 as p2pd_pb

    client = _Client()
    late, live = uuid.uuid4(), uuid.uuid4()
    loop = asyncio.get_running_loop()
    client._pending_calls = {late: loop.create_future(), live: loop.create_future()}
    client._pending_calls[late].cancel()  # its call timed out; its task has not yet popped it
    reader = asyncio.StreamReader()
    for call_id, payload in ((late, b"too late"), (live, b"on time")):
        reader.feed_data(_frame(p2pd_pb.PersistentConnectionResponse(
            callId=call_id.bytes, callUnaryResponse=p2pd_pb.CallUnaryResponse(response=payload))))
    task = asyncio.create_task(read_loop(client, reader))
    await asyncio.sleep(0.1)
    return client._pending_calls[late], client._pending_calls[live], task


def test_a_reply_to_a_timed_out_call_does_not_end_the_read_loop():
    async def main():
        late, live, task = await _replies_after_a_timeout(hivemind_fixes.read_from_persistent_conn)
        assert late.cancelled() and live.result() == b"on time"
        assert not task.done(), "still reading"
        task.cancel()

    asyncio.run(asyncio.wait_for(main(), 10))


def test_hiveminds_own_loop_dies_on_it_which_is_why_the_fix_exists():
    original = hivemind_fixes.original_read_loop()
    assert original is not hivemind_fixes.read_from_persistent_conn

    async def main():
        _, live, task = await _replies_after_a_timeout(original)
        assert task.done() and isinstance(task.exception(), asyncio.InvalidStateError)
        assert not live.done(), "the reply that came next was never read"

    asyncio.run(asyncio.wait_for(main(), 10))


def test_apply_installs_the_fixed_loop_once():
    from hivemind.p2p.p2p_daemon_bindings.control import ControlClient

    hivemind_fixes.apply()
    hivemind_fixes.apply()
    assert ControlClient._read_from_persistent_conn is hivemind_fixes.read_from_persistent_conn
