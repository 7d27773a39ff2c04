"""The DHT's cost per peer as a run grows: heartbeat CPU and traffic per peer at 4 to 64 peers
(issue 15, item 1).

A real volunteer's DHT work each heartbeat is: store its signed record, then read the swarms it needs,
both through ``swarm.dht.membership`` (what ``volunteer/node/announcer.py`` calls). This benchmark runs that
same code for ``N`` peers whose DHT nodes are hivemind ``DHTNode``s inside one process (each with its own
identity, its own p2pd and the run's real validators, as ``volunteer join`` builds them): 64 full
volunteers (540 MiB each) do not fit this machine, 64 DHT nodes do. Peers are spread round-robin over
``--stages`` swarms; layer0's peers drive (they read what a driver reads). Records are real
``MemberRecord``s signed by each peer's identity key.

Each cell (one ``N``) runs in a child process of its own, in a network namespace of its own when the
machine allows one (root, ``unshare``), so that the loopback counters measure the DHT's traffic and
nothing else. CPU is that of the cell's process and its p2pd daemons over ``--window-s`` after
``--warmup-s``; per peer and per heartbeat.

    python -m benchmarks.dht_scale --json [--peers 4,8,16,32,64] [--heartbeat-s 5] [--window-s 40]

Prints one JSON object: per cell ``cpu_ms_per_peer_heartbeat``, ``kbytes_per_peer_heartbeat``,
``gets_per_peer_heartbeat``, ``records_read_per_peer_heartbeat``, ``empty_reads`` (reads that found no record:
failed, or a swarm nobody had announced in yet); and
``dht_cpu_per_peer_64_vs_8`` (goal <= 1.5) and ``dht_bytes_per_peer_64_vs_8``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.common import BenchmarkError, finish, machine_notes, parser, ratio, rounded, say

STAGES = 4
CELL_TIMEOUT_S = 420.0
START_AT_ONCE = 8  # DHT nodes started together (each spawns a p2pd)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cell:
        return _run_cell(args)
    if args.quick:
        args.peers, args.warmup_s, args.window_s = "4", 2.0, 5.0
    started = time.monotonic()
    cells = []
    for peers in (int(v) for v in args.peers.split(",")):
        say(f"cell: {peers} peers")
        cell = _cell_in_child(peers, args)
        say(f"cell {peers}: {rounded(cell)}")
        cells.append(cell)
    report: dict[str, Any] = {"cells": cells, "settings": {k: v for k, v in vars(args).items() if k not in ("cell", "quick")},
                              "machine": machine_notes()}
    by = {c["peers"]: c for c in cells}
    if 8 in by and 64 in by:
        report["dht_cpu_per_peer_64_vs_8"] = ratio(by[64]["cpu_ms_per_peer_heartbeat"], by[8]["cpu_ms_per_peer_heartbeat"])
        if by[8].get("kbytes_per_peer_heartbeat") is not None and by[64].get("kbytes_per_peer_heartbeat") is not None:
            report["dht_bytes_per_peer_64_vs_8"] = ratio(by[64]["kbytes_per_peer_heartbeat"],
                                                         by[8]["kbytes_per_peer_heartbeat"])
    return finish(report, "dht_scale", started, args)


def _parser() -> Any:
    out = parser("dht_scale", __doc__, quick_help="one cell of 4 peers, 2 s warm-up, 5 s window (a smoke test)")
    out.add_argument("--peers", default="4,8,16,32,64", help="peer counts, one cell each")
    out.add_argument("--stages", type=int, default=STAGES)
    out.add_argument("--heartbeat-s", type=float, default=5.0, help="the default run's heartbeat")
    # past a new peer's ramp (membership.RAMP_S: its swarm is read as if used while its peers are that young)
    out.add_argument("--warmup-s", type=float, default=30.0)
    out.add_argument("--window-s", type=float, default=40.0)
    out.add_argument("--cell", type=int, default=0, help=argparse_hidden())
    return out


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


# ----- the parent: one child per cell, in a network namespace when possible


def _cell_in_child(peers: int, args: Any) -> dict[str, Any]:
    argv = [sys.executable, "-m", "benchmarks.dht_scale", "--cell", str(peers), "--stages", str(args.stages),
            "--heartbeat-s", str(args.heartbeat_s), "--warmup-s", str(args.warmup_s), "--window-s", str(args.window_s)]
    isolated = _can_unshare()
    if isolated:
        argv = ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "cell", *argv]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=CELL_TIMEOUT_S,
                          cwd=str(Path(__file__).resolve().parents[1]))
    if done.returncode != 0:
        raise BenchmarkError(f"the cell of {peers} peers failed ({done.returncode}): {done.stderr[-2000:]}")
    cell = json.loads(done.stdout.strip().splitlines()[-1])
    cell["own_network_namespace"] = isolated
    if not isolated:
        cell["kbytes_per_peer_heartbeat"] = None  # the loopback counters would count other processes' traffic
    return cell


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, timeout=10)
    return probe.returncode == 0


# ----- the child: N peers in this process


class NodeDHT:
    """The part of ``hivemind.DHT`` that ``swarm.dht.membership.Membership`` calls (``store`` and ``get`` with
    ``return_future=True``), over a ``DHTNode`` running on the benchmark's event loop. It is the volunteer's
    ``swarm.dht.nodedht.InProcessDHT`` without a loop thread of its own: the store is the same ``RecordStores``,
    the get the same ``DHTNode.get``; one loop for all the nodes keeps 65 threads' contention for the GIL,
    which no volunteer has, out of the figures per peer."""

    def __init__(self, node: Any, loop: asyncio.AbstractEventLoop):
        from swarm.dht.nodedht import RecordStores

        self.node, self.loop = node, loop
        self.stores = RecordStores()
        self.gets = 0

    def store(self, key: Any, value: Any, expiration_time: float, subkey: Any = None, return_future: bool = False,
              beam_size: int = 20) -> Any:
        """As the volunteer's node stores its record (swarm/dht/nodedht.py ``InProcessDHT.store``)."""
        future = asyncio.run_coroutine_threadsafe(
            self.stores.store(self.node, key, subkey, value, expiration_time, beam_size), self.loop)
        return future if return_future else future.result()

    def get(self, key: Any, latest: bool = False, return_future: bool = False, **kwargs: Any) -> Any:
        self.gets += 1
        future = asyncio.run_coroutine_threadsafe(self.node.get(key, latest=latest, **kwargs), self.loop)
        return future if return_future else future.result()


class SimPeer:
    """One volunteer's heartbeat on the DHT, through the same calls a node makes."""

    def __init__(self, index: int, swarm: str, dht: NodeDHT, run: Any, signer: Any):
        from swarm.dht.membership import Membership, ReadSchedule
        from swarm.dht.records import peer_id_from_public_key, public_key_of_subkey
        from swarm.integrity.identity_work import find_work

        self.peer_id = peer_id_from_public_key(public_key_of_subkey(signer.local_public_key))
        self.index, self.swarm, self.dht, self.run = index, swarm, dht, run
        self.membership = Membership(dht, run, signer.local_public_key)
        self.membership.work = find_work(self.peer_id, run.integrity.identity_bits) or 0
        self.started_at = time.time()
        self.beats = 0
        self.records_read = 0
        self.empty_reads = 0
        self.views: dict[str, list[Any]] = {}
        self.schedule = ReadSchedule()  # the node's own (volunteer/node/announcer.py)

    def record(self) -> Any:
        from swarm.dht.records import MemberRecord

        now = time.time()
        return MemberRecord(peer_id=self.peer_id, state="online", version="bench", started_at=self.started_at,
                            updated_at=now, throughput=100.0 + self.index, loss=1.5, clock=self.beats * 64,
                            param_version=self.beats, shard=self.index if self.swarm == "layer0" else -1,
                            served=self.beats * 4, capacity=200.0, reachable=1)

    def heartbeat(self) -> None:
        self.membership.announce(self.swarm, self.record())
        names = self.run.swarm_names
        if self.views:
            names = self.schedule.due(names, self.swarm, self.swarm == "layer0", self.run.timeouts.others_every_heartbeats)
        read = self.membership.read_all(names) if names else {}
        self.schedule.done(read)
        for name in names:
            self.records_read += len(read[name])
            if not read[name]:
                self.empty_reads += 1
        self.views.update(read)
        self.beats += 1


def _run_cell(args: Any) -> int:
    import logging

    logging.basicConfig(level=logging.ERROR)
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "ERROR")
    result = asyncio.run(_cell(args.cell, args))
    print(json.dumps(rounded(result)), flush=True)
    return 0


async def _cell(peers: int, args: Any) -> dict[str, Any]:
    import psutil
    from hivemind.dht.node import DHTNode
    from hivemind.dht.validation import CompositeValidator
    from hivemind.p2p import P2P

    from swarm.dht.dht import NODE_TUNING, _apply_hivemind_fixes, make_validators
    from swarm.run.runconfig import RunConfig

    _apply_hivemind_fixes()
    run = RunConfig.model_validate({"name": "dhtscale", "model": {"stages": args.stages},
                                    "timeouts": {"heartbeat_s": args.heartbeat_s},
                                    # work sized for hundreds of simulated peers; readers still check each record's
                                    "integrity": {"identity_bits": 2}})
    loop = asyncio.get_running_loop()
    workdir = Path(tempfile.mkdtemp(prefix="volunteer-dhtscale-"))
    nodes: list[Any] = []
    try:
        loopback = ["/ip4/127.0.0.1/tcp/0"]
        boot_identity = workdir / "boot.key"
        P2P.generate_identity(str(boot_identity))
        boot = await DHTNode.create(host_maddrs=loopback, identity_path=str(boot_identity),
                                    record_validator=CompositeValidator(make_validators(run.run_id, run.swarm_names, boot_identity)),
                                    **NODE_TUNING)
        nodes.append(boot)
        initial = [str(m) for m in await boot.p2p.get_visible_maddrs()]
        sims: list[SimPeer] = []

        async def start_peer(index: int) -> tuple[Any, Any]:
            identity = workdir / f"peer-{index}.key"
            P2P.generate_identity(str(identity))
            validators = make_validators(run.run_id, run.swarm_names, identity)
            node = await DHTNode.create(initial_peers=initial, host_maddrs=loopback, identity_path=str(identity),
                                        record_validator=CompositeValidator(validators), **NODE_TUNING)
            nodes.append(node)  # as each starts: a failure of another still stops it
            return node, validators[0]

        # started together: each waits ~1 s on its p2pd and its first contact (64 peers took a minute one by one)
        for start in range(0, peers, START_AT_ONCE):
            started = await asyncio.gather(*(start_peer(i) for i in range(start, min(peers, start + START_AT_ONCE))))
            for offset, (node, signer) in enumerate(started):
                index = start + offset
                sims.append(SimPeer(index, run.swarm_names[index % len(run.swarm_names)], NodeDHT(node, loop), run,
                                    signer))
        say(f"  {peers} peers up")
        stop = threading.Event()
        pool = ThreadPoolExecutor(max_workers=min(16, peers))
        driver = threading.Thread(target=_beat_all, args=(sims, run.timeouts.heartbeat_s, pool, stop), daemon=True)
        driver.start()
        await asyncio.sleep(args.warmup_s)
        me = psutil.Process()
        before = _cpu(me), _lo_bytes(), {s.index: (s.beats, s.dht.gets, s.records_read, s.empty_reads) for s in sims}
        t0 = time.monotonic()
        await asyncio.sleep(args.window_s)
        after = _cpu(me), _lo_bytes(), {s.index: (s.beats, s.dht.gets, s.records_read, s.empty_reads) for s in sims}
        window = time.monotonic() - t0
        stop.set()
        await loop.run_in_executor(None, driver.join, 30)
        pool.shutdown(wait=True)
        beats = sum(after[2][i][0] - before[2][i][0] for i in after[2])
        gets = sum(after[2][i][1] - before[2][i][1] for i in after[2])
        records = sum(after[2][i][2] - before[2][i][2] for i in after[2])
        failures = sum(after[2][i][3] - before[2][i][3] for i in after[2])
        python_s, p2pd_s = after[0][0] - before[0][0], after[0][1] - before[0][1]
        cpu_s = python_s + p2pd_s
        lo = (after[1] - before[1]) if after[1] is not None and before[1] is not None else None
        return {
            "peers": peers, "stages": args.stages, "window_s": window, "heartbeats": beats,
            "heartbeats_per_peer_s": beats / peers / window,
            "cpu_cores": cpu_s / window,
            "cpu_ms_per_peer_heartbeat": 1000.0 * cpu_s / max(1, beats),
            "python_ms_per_peer_heartbeat": 1000.0 * python_s / max(1, beats),
            "p2pd_ms_per_peer_heartbeat": 1000.0 * p2pd_s / max(1, beats),
            "kbytes_per_peer_heartbeat": None if lo is None else lo / 1000.0 / max(1, beats),
            "gets_per_peer_heartbeat": gets / max(1, beats),
            "records_read_per_peer_heartbeat": records / max(1, beats),
            "empty_reads": failures,
            "loadavg_1m": round(os.getloadavg()[0], 2),
        }
    finally:
        for node in reversed(nodes):
            try:
                await asyncio.wait_for(node.shutdown(), 10)
            except Exception as exc:  # p2pd may be gone; keep stopping the others
                say(f"  stopping a DHT node: {exc}")
        shutil.rmtree(workdir, ignore_errors=True)


def _beat_all(sims: list[SimPeer], heartbeat_s: float, pool: ThreadPoolExecutor, stop: threading.Event) -> None:
    """Each peer beats every ``heartbeat_s`` at its own phase (as real peers, which started at different times)."""
    rng = random.Random(0)
    due = {s.index: time.monotonic() + rng.uniform(0, heartbeat_s) for s in sims}
    running: dict[int, Future] = {}
    while not stop.is_set():
        now = time.monotonic()
        for sim in sims:
            if due[sim.index] <= now and (sim.index not in running or running[sim.index].done()):
                running[sim.index] = pool.submit(sim.heartbeat)
                due[sim.index] = now + heartbeat_s
        stop.wait(0.02)
    for future in running.values():
        try:
            future.result(timeout=60)
        except Exception as exc:
            say(f"  a heartbeat failed: {exc}")


def _cpu(process: Any) -> tuple[float, float]:
    """CPU seconds of this process (the DHT nodes, their validators, the reads) and of its children (p2pd)."""
    daemons = 0.0
    for child in process.children(recursive=True):
        try:
            daemons += sum(child.cpu_times()[:2])
        except Exception:  # a daemon that just exited
            pass
    return sum(process.cpu_times()[:2]), daemons


def _lo_bytes() -> int | None:
    """Bytes sent on loopback in this network namespace (/proc/net/dev)."""
    try:
        for line in Path("/proc/net/dev").read_text().splitlines():
            name, _, data = line.partition(":")
            if name.strip() == "lo":
                return int(data.split()[8])
    except (OSError, ValueError, IndexError):
        return None
    return None


if __name__ == "__main__":
    sys.exit(main())
