"""Streamed replies cut short, and what the caller's close costs (swarm/pipeline/transport/streams.py).

p2pd ended a stream whose server closed its side while the last parts were on their way as if it were complete;
a caller that asks for marks stops reading at the reply's end mark and closes the stream first. Two hivemind P2P
peers in this process (each with its p2pd, over loopback), a handler that streams a float32 tensor of ``--mib``
MiB (1 MiB parts) as the stage's ``rpc_call_stream`` does, called ``--calls`` times each way: ``plain`` (a caller
of an earlier version: no ask, the server closes first) and ``ask``, alternated in blocks of 50. CPU from /proc
(this process and both daemons) per call.

    python -m benchmarks.stream_cuts --json [--calls 1000] [--mib 7] [--quick]

Prints ``cut_plain`` and ``cut_ask`` (replies that came back short, ``StreamCut``), ``cpu_ms_per_call_ask_vs_plain``,
and each way's figures under ``ways``. Measured in session 24 (benchmarks/README.md): 7 MiB replies, 5 of 2,500
cut without the ask and 0 of 2,500 with it, the same CPU a call.
"""

import asyncio  # no postponed annotations: hivemind reads the handler's (a local class's) as objects
import os
import time
from typing import Any, AsyncIterator

from benchmarks.common import finish, machine_notes, p2p_pair, parser, ratio, say
from benchmarks.procstats import process_cpu_seconds

BLOCK = 50  # calls in a row one way before the other's turn (the machine's drift falls on both)
WAYS = ("plain", "ask")


async def measure(calls: int, mib: int) -> dict[str, dict[str, Any]]:
    import torch
    from hivemind.p2p import P2PContext, ServicerBase
    from hivemind.proto import runtime_pb2

    from swarm.pipeline.transport.streams import StreamCut, join_request, join_stream, reply_stream, split_message
    from swarm.pipeline.transport.wire import encode_lean

    reply = encode_lean([torch.randn(mib, 2**18)])  # mib MiB as float32: one part per MiB

    class Server(ServicerBase):
        async def rpc_reply(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                            context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
            _, _, asked = await join_request(requests, 2**20)
            async for message in reply_stream(split_message(reply, b"meta", runtime_pb2.ExpertResponse), asked):
                yield message

    async def items(messages):
        for message in messages:
            yield message

    async with p2p_pair() as (server, client):
        pids = [os.getpid(), server._child.pid, client._child.pid]  # this process and both daemons (as framing.py)
        out = {way: {"calls": 0, "cut": 0, "cpu_s": 0.0, "wall_s": 0.0} for way in WAYS}
        await Server().add_p2p_handlers(server)
        stub = Server.get_stub(client, server.peer_id)
        for block in range(2 * max(1, calls // BLOCK)):
            way = WAYS[block % 2]
            cpu, wall = sum(map(process_cpu_seconds, pids)), time.monotonic()
            for _ in range(BLOCK):
                request = split_message([], b"q", runtime_pb2.ExpertRequest, ask_end=(way == "ask"))
                try:
                    await asyncio.wait_for(join_stream(await stub.rpc_reply(items(request)), 2 * mib * 2**20), 30)
                except StreamCut:
                    out[way]["cut"] += 1
            await asyncio.sleep(0.02)  # the servers' ends of this block's streams, counted in it
            figures = out[way]
            figures["calls"] += BLOCK
            figures["cpu_s"] += sum(map(process_cpu_seconds, pids)) - cpu
            figures["wall_s"] += time.monotonic() - wall
        for way, figures in out.items():
            figures["cpu_ms_per_call"] = round(1000 * figures.pop("cpu_s") / figures["calls"], 2)
            figures["ms_per_call"] = round(1000 * figures.pop("wall_s") / figures["calls"], 2)
            say(f"{way}: {figures['cut']} of {figures['calls']} cut, {figures['cpu_ms_per_call']} ms of CPU a call")
    return out


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = _parser().parse_args(argv)
    calls = 2 * BLOCK if args.quick else args.calls
    ways = asyncio.run(measure(calls, 2 if args.quick else args.mib))
    report: dict[str, Any] = {"machine": machine_notes(), "mib": 2 if args.quick else args.mib, "ways": ways,
                              "cut_plain": ways["plain"]["cut"], "cut_ask": ways["ask"]["cut"],
                              "cpu_ms_per_call_ask_vs_plain": ratio(ways["ask"]["cpu_ms_per_call"],
                                                                    ways["plain"]["cpu_ms_per_call"])}
    return finish(report, "stream_cuts", started, args)


def _parser():
    p = parser("stream_cuts", __doc__, quick_help="100 calls of 2 MiB each way: a smoke test, not a measurement")
    p.add_argument("--calls", type=int, default=1000, help="calls each way (default 1000)")
    p.add_argument("--mib", type=int, default=7, help="the reply's size in MiB (default 7)")
    return p


if __name__ == "__main__":
    raise SystemExit(main())
