"""Does framing cost Python time on a stage session's stream? hivemind's framing against one write per message.

A stage session (swarm/pipeline/transport/sessions.py) writes each message with hivemind's ``P2P.send_raw_data``: a
type byte, an 8-byte length and the payload in 64 KiB chunks, each a ``write`` (a send system call while the socket
takes it, a copy into asyncio's buffer after). The alternative measured here: the length and the payload in one
``write``, and a reader whose buffer holds a whole message (asyncio's default pauses the socket every 128 KiB).
Two P2P peers in this process (each with its p2pd, over loopback), an echo handler, ``--reps`` round trips per size
and way, the ways alternated twice; CPU from /proc (this process, both daemons) per round trip.

    python -m benchmarks.framing --json [--reps 200] [--quick]

Prints ``python_cpu_<size>_lean_vs_hivemind`` (this process's CPU per round trip, one write over hivemind's framing)
and the same for the daemons, with the figures under ``sizes``. Measured in session 17 (benchmarks/README.md): 1 MiB
each way 2.5-3.4 ms of Python's CPU either way, p2pd's 6-10 ms: framing is not where the Python time goes.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from benchmarks.common import finish, machine_notes, median, p2p_pair, parser, ratio, say
from benchmarks.procstats import process_cpu_seconds

SIZES = {"32k": 32 * 1024, "256k": 256 * 1024, "1m": 1024 * 1024}
WAYS = ("hivemind", "lean")
BIG_READER_LIMIT = 2**24


async def _send(way: str, payload: bytes, writer: asyncio.StreamWriter) -> None:
    from hivemind.p2p import P2P

    if way == "lean":
        writer.write(len(payload).to_bytes(8, "big") + payload)
        await writer.drain()
    else:
        await P2P.send_raw_data(payload, writer)


async def _receive(reader: asyncio.StreamReader) -> bytes:
    header = await reader.readexactly(8)
    return await reader.readexactly(int.from_bytes(header, "big"))


async def measure(reps: int) -> dict[str, Any]:
    async with p2p_pair() as (server, client):
        way_now = {"way": WAYS[0]}

        async def echo(_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            way = way_now["way"]
            if way == "lean":
                reader._limit = BIG_READER_LIMIT  # asyncio's own attribute: no public setter after the stream exists
            try:
                while True:
                    await _send(way, await _receive(reader), writer)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass

        await server.add_binary_stream_handler("framing-echo", echo)
        pids = [os.getpid(), server._child.pid, client._child.pid]
        out: dict[str, Any] = {}
        for name, size in SIZES.items():
            payload = os.urandom(size)
            runs: dict[str, list[tuple[float, float, float]]] = {way: [] for way in WAYS}
            for way in (*WAYS, *WAYS):
                way_now["way"] = way
                _, reader, writer = await client.call_binary_stream_handler(server.peer_id, "framing-echo")
                if way == "lean":
                    reader._limit = BIG_READER_LIMIT
                for _ in range(max(2, reps // 20)):  # warm-up
                    await _send(way, payload, writer)
                    await _receive(reader)
                before, started = [process_cpu_seconds(p) for p in pids], time.perf_counter()
                for _ in range(reps):
                    await _send(way, payload, writer)
                    await _receive(reader)
                wall, after = time.perf_counter() - started, [process_cpu_seconds(p) for p in pids]
                writer.close()
                used = [(b - a) * 1000 / reps for a, b in zip(before, after)]
                runs[way].append((wall * 1000 / reps, used[0], used[1] + used[2]))
            out[name] = {way: {"round_trip_ms": median([r[0] for r in rs]), "python_cpu_ms": median([r[1] for r in rs]),
                               "p2pd_cpu_ms": median([r[2] for r in rs])} for way, rs in runs.items()}
            say(f"{name}: " + "; ".join(f"{way} {f['round_trip_ms']:.2f} ms, Python {f['python_cpu_ms']:.2f} ms, "
                                        f"p2pd {f['p2pd_cpu_ms']:.2f} ms of CPU" for way, f in out[name].items()))
    return out


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = _parser().parse_args(argv)
    reps = 20 if args.quick else args.reps
    report: dict[str, Any] = {"machine": machine_notes(), "reps": reps, "sizes": asyncio.run(measure(reps))}
    for name, figures in report["sizes"].items():
        for part in ("python_cpu", "p2pd_cpu"):
            report[f"{part}_{name}_lean_vs_hivemind"] = ratio(figures["lean"][f"{part}_ms"],
                                                               figures["hivemind"][f"{part}_ms"])
    return finish(report, "framing", started, args)


def _parser():
    p = parser("framing", __doc__, quick_help="20 round trips a size: a smoke test, not a measurement")
    p.add_argument("--reps", type=int, default=200, help="round trips per size and way, each way measured twice")
    return p


if __name__ == "__main__":
    raise SystemExit(main())
