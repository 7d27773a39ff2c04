"""benchmarks.pipeline, one hop: a forward to a ``StageServicer`` of another P2P peer (in this process,
over loopback through both p2pd daemons) against the same forward on a local worker, for sizes from
an empty hop to 4 MiB, on a session, unary and streamed (see benchmarks/pipeline.py for the figures it reports)."""

from __future__ import annotations

import asyncio
import os
import random
import time
from typing import Any

from benchmarks.common import BenchmarkError, median, ratio, say
from benchmarks.fleet import Fleet
from benchmarks.procstats import process_cpu_seconds

KIB = 1024
MIB = 1024 * 1024
# A narrow layer keeps the 4 MiB hop's compute small, so the overhead is most of it; 256, not 64 (until this
# session's figures): a forward at stage 1 names its sample ids in its metadata (8 bytes a row, stage-0 spot checks),
# and 4 MiB of 64-wide rows were 16,384 of them, 128 KiB of ids, over the 64 KiB metadata bound. At 256, 32 KiB.
HOP_WIDTH = 256
# name -> (activation bytes, transport): "default" lets call_stage choose (a session below
# sessions.SESSION_LIMIT_BYTES, a stream of its own from there); "session" / "unary" / "stream" force one, to compare
# them at equal sizes.
HOP_CASES = {"empty": (4 * HOP_WIDTH, "default"), "64k": (64 * KIB, "default"), "4m": (4 * MIB, "default")}
HOP_COMPARED = ("64k", "256k", "1m", "2m")
HOP_COMPARED_BYTES = {"64k": 64 * KIB, "256k": 256 * KIB, "1m": MIB, "2m": 2 * MIB}
HOP_CASES.update({f"{name}_{transport}": (HOP_COMPARED_BYTES[name], transport)
                  for name in HOP_COMPARED for transport in ("session", "unary", "stream")})
P2PD_UNARY_CAP_BYTES = 4 * MIB  # p2pd's persistent-connection message limit
HOP_TIMEOUT_S = 60.0


def hops(fleet: Fleet, maddr: str, reps: int) -> dict[str, Any]:
    """The ``hop_*`` figures of benchmarks.pipeline (see its docstring), ``reps`` rounds of every case."""
    from swarm.pipeline.peer import SwarmPeer
    from swarm.run.runconfig import RunConfig

    biggest = max(size for size, _ in HOP_CASES.values()) // (4 * HOP_WIDTH)
    run = RunConfig.model_validate({
        "name": "hopbench", "model": {"stages": 3, "hidden_dim": HOP_WIDTH},
        "training": {"batch_size": biggest, "in_flight": 1}, "timeouts": {"rpc_s": HOP_TIMEOUT_S},
    })
    say("hop: a stage server and a client, two P2P peers in this process")
    server_dht = fleet.dht([maddr], [])
    client_dht = fleet.dht([maddr], [])
    peer = SwarmPeer(run, server_dht, "layer1", evaluate=False)
    try:
        peer.start()
        # stages serve only the run's online layer0 drivers: the client's record, as a heartbeat hands it in
        from swarm.dht.records import MemberRecord

        now = time.time()
        peer.update_views({"layer0": [MemberRecord(peer_id=str(client_dht.peer_id), state="online", version="bench",
                                                   started_at=now, updated_at=now, shard=0)]})
        timings = asyncio.run(_hop_timings(run, client_dht, peer, reps, [os.getpid(), *fleet.in_process_helpers()]))
    finally:
        peer.stop()
        fleet.close_dht(client_dht)
        fleet.close_dht(server_dht)
    failures = timings.pop("failures")
    report: dict[str, Any] = {}
    detail: dict[str, Any] = {}
    empty = timings["empty"]["hop_ms"] - timings["empty"]["local_ms"]
    for name, t in timings.items():
        overhead = t["hop_ms"] - t["local_ms"]
        size, transport = HOP_CASES[name]
        moved = 2 * size  # activations out and back
        detail[name] = {**t, "overhead_ms": overhead, "bytes_each_way": size, "transport": transport,
                        "mb_per_s": ratio(moved / MIB, overhead / 1000), "vs_empty_hop": ratio(overhead, empty)}
        if name != "empty":
            report[f"hop_overhead_ms_{name}"] = overhead
    report["hop_overhead_4m_vs_64k"] = ratio(report["hop_overhead_ms_4m"], report["hop_overhead_ms_64k"])
    for name in HOP_COMPARED:
        report[f"hop_overhead_{name}_unary_vs_streamed"] = ratio(report[f"hop_overhead_ms_{name}_unary"],
                                                                 report[f"hop_overhead_ms_{name}_stream"])
        report[f"hop_cpu_{name}_unary_vs_streamed"] = ratio(timings[f"{name}_unary"]["cpu_ms"],
                                                             timings[f"{name}_stream"]["cpu_ms"])
        for other, said in (("unary", "unary"), ("stream", "streamed")):
            report[f"hop_overhead_{name}_session_vs_{said}"] = ratio(report[f"hop_overhead_ms_{name}_session"],
                                                                     report[f"hop_overhead_ms_{name}_{other}"])
            report[f"hop_cpu_{name}_session_vs_{said}"] = ratio(timings[f"{name}_session"]["cpu_ms"],
                                                                timings[f"{name}_{other}"]["cpu_ms"])
    from swarm.pipeline.transport.wire import UNARY_LIMIT_BYTES

    from swarm.pipeline.transport.sessions import SESSION_LIMIT_BYTES

    report["hop_unary_limit_bytes"] = UNARY_LIMIT_BYTES
    report["hop_session_limit_bytes"] = SESSION_LIMIT_BYTES
    report["hop"] = {"width": HOP_WIDTH, "op": "forward", "sizes": detail, "failures": failures}
    return report


async def _hop_timings(run: Any, client_dht: Any, peer: Any, reps: int,
                       cpu_pids: list[int]) -> dict[str, dict[str, float]]:
    """Every case once per round in a shuffled order, ``reps`` rounds after a warm-up round: a
    load spike on a shared machine hits all cases alike instead of one. ``cpu_ms`` is the CPU the
    hop cost this process and both p2pd daemons (mean: /proc counts in clock ticks)."""
    import torch
    from hivemind import DHT
    from hivemind.p2p import P2P

    from swarm.pipeline.stage.worker import StageWorker

    p2p = await P2P.replicate(await client_dht.run_coroutine(DHT._get_p2p_daemon_listen_maddr, return_future=True))
    local = StageWorker(run, 1)
    inputs = {name: torch.randn(size // (4 * HOP_WIDTH), HOP_WIDTH) for name, (size, _) in HOP_CASES.items()}
    samples: dict[str, dict[str, list[float]]] = {name: {"hop": [], "rpc": [], "local": [], "cpu": [], "receipt": []}
                                                  for name in HOP_CASES}
    failures: list[str] = []
    try:
        order = list(HOP_CASES)
        for round_ in range(reps + 1):
            random.Random(round_).shuffle(order)  # whatever follows a 4 MiB hop pays a little: spread it
            for name in order:
                size, transport = HOP_CASES[name]
                try:
                    timing = await _one_hop(p2p, peer, local, run, inputs[name], f"hop-{name}-{round_}", size,
                                            transport, cpu_pids)
                except BenchmarkError as exc:  # reported, and retried once under a new id: one hiccup must
                    failures.append(str(exc))  # not end the whole benchmark
                    say(str(exc))
                    timing = await _one_hop(p2p, peer, local, run, inputs[name], f"hop-{name}-{round_}-retry", size,
                                            transport, cpu_pids)
                if round_:  # round 0 warms up
                    for key, value in timing.items():
                        samples[name][key].append(value)
    finally:
        await p2p.shutdown()
    out = {name: {"hop_ms": 1000 * median(t["hop"]), "rpc_ms": 1000 * median(t["rpc"]),
                  "local_ms": 1000 * median(t["local"]), "cpu_ms": 1000 * sum(t["cpu"]) / len(t["cpu"]),
                  "receipt_ms": 1000 * median(t["receipt"]), "reps": reps} for name, t in samples.items()}
    for name, t in out.items():
        say(f"hop {name}: {t['hop_ms']:.2f} ms (local forward {t['local_ms']:.2f} ms, receipts {t['receipt_ms']:.3f} ms)")
    out["failures"] = failures  # type: ignore[assignment]
    return out


async def _one_hop(p2p: Any, peer: Any, local: Any, run: Any, x: Any, mb: str, size: int, transport: str,
                   cpu_pids: list[int]) -> dict[str, float]:
    """One forward hop to ``peer`` and the same forward on a local worker: seconds of each, and CPU. The hop is what a
    driver does: serialize its stage-0 output once, sign its receipt, call, check the reply's receipt
    (swarm/integrity/receipts.py); ``receipt`` is the part of it those receipt steps took."""
    import torch

    import swarm.pipeline.transport.sessions as sessions
    import swarm.pipeline.transport.stage_client as stage_client
    import swarm.pipeline.stage.stage_rpc as stage_rpc
    from swarm.integrity.receipts import ids_digest, tensor_digest
    from swarm.pipeline.transport.replies import Vouch, check_receipt
    from swarm.pipeline.stage.stage0_replicas import ids_bytes
    from swarm.pipeline.transport.wire import serialize_once

    key, keys = _driver_keys(p2p)
    x = x.clone()  # a fresh stage-0 output, serialized anew, as the driver's is each micro-batch
    ids = torch.arange(x.shape[0], dtype=torch.int64)
    # call_stage reads these at each call: force the transport
    defaults = stage_client.UNARY_LIMIT_BYTES, stage_client.SESSION_LIMIT_BYTES, sessions.ENABLED
    if transport != "default":
        sessions.ENABLED = transport == "session"
        stage_client.SESSION_LIMIT_BYTES = P2PD_UNARY_CAP_BYTES
        stage_client.UNARY_LIMIT_BYTES = P2PD_UNARY_CAP_BYTES - 1 if transport == "unary" else 0
    try:
        cpu = sum(process_cpu_seconds(pid) for pid in cpu_pids)
        started = time.perf_counter()
        ids_d = ids_digest(ids)
        signed = key.sign(run.run_id, mb, "forward", 0, 0, ids_d, tensor_digest(serialize_once(x)), ids_d)
        receipt_s = time.perf_counter() - started
        try:
            (y,), reply, rpc_s = await stage_rpc.call_stage(
                p2p, str(peer.dht.peer_id), stage_rpc.stage_namespace(run.run_id, "layer1"), "forward", [x],
                {"mb": mb, "rc": [signed.to_wire()], "rk": key.public, "ids": ids_bytes(ids)}, timeout_s=HOP_TIMEOUT_S,
                codec="float32",
                max_bytes=int(run.training.max_payload_mb * MIB), expect_bytes=size)
            checked = time.perf_counter()
            check_receipt(1, "forward", Vouch(run.run_id, mb, signed.output, ids_d), str(peer.dht.peer_id), [y], reply,
                          keys)
            receipt_s += time.perf_counter() - checked
        except Exception as exc:
            raise BenchmarkError(f"hop {mb} ({size} bytes, {transport}) failed: {exc.__class__.__name__}: {exc}") from exc
        hop_s = time.perf_counter() - started
        cpu = sum(process_cpu_seconds(pid) for pid in cpu_pids) - cpu
    finally:
        stage_client.UNARY_LIMIT_BYTES, stage_client.SESSION_LIMIT_BYTES, sessions.ENABLED = defaults
    if y.shape != x.shape:
        raise BenchmarkError(f"the hop returned {tuple(y.shape)}, expected {tuple(x.shape)}")
    with peer.worker.lock:  # drop the saved graph: no backward follows in this benchmark
        peer.worker.cache.pop(mb, time.monotonic())
    started = time.perf_counter()
    stage_rpc.dispatch(local, "forward", [x], {"mb": mb})
    local_s = time.perf_counter() - started
    local.cache.pop(mb, time.monotonic())
    return {"hop": hop_s, "rpc": rpc_s, "local": local_s, "cpu": cpu, "receipt": receipt_s}


_KEYS: dict[str, Any] = {}


def _driver_keys(p2p: Any) -> tuple[Any, Any]:
    """The benchmark driver's receipt key and the keys it learns from replies (one pair per client)."""
    from swarm.integrity.receipts import ReceiptKey
    from swarm.pipeline.transport.keybook import KeyBook

    peer_id = str(p2p.peer_id)
    if peer_id not in _KEYS:
        _KEYS[peer_id] = (ReceiptKey(peer_id), KeyBook())
    return _KEYS[peer_id]
