"""What keeping a swarm's copies together costs and gives: accuracy, pull speed, training overhead.

    python -m benchmarks.averaging --json [--quick]

prints one JSON object (progress goes to stderr). Every figure is a ratio to a baseline measured in
the same run, because absolute times on a shared 2-core machine drift:

- ``accuracy_ratio_iid`` / ``accuracy_ratio_skewed``: `volunteer demo --per-swarm 2` of the default
  digits run (4 swarms x 2 peers, Dpwa as configured) for a fixed time, then the test accuracy it
  published over the accuracy of ``swarm.run.local.train_local`` (one process, same data, model,
  optimizer and batch size) after the same number of samples. ``skewed``: the same with
  ``data.partition: label_skewed`` (8 of 10 classes per shard).
- ``pull_mb_s``: a 40 MB layer (10 x 1M float32) pulled with ``fetch_params`` from another process
  on loopback; ``raw_mb_s``: the same bytes over a plain TCP socket between the same two processes;
  ``pull_vs_hivemind``: our MB/s over hivemind's ``DecentralizedAverager.load_state_from_peers`` for the
  same tensors (uncompressed both ways). Medians of 5 transfers each, the three kinds taking turns.
- ``averaging_overhead``: pipeline samples/s with Dpwa pulls on (the default run's averaging block)
  over samples/s with them off, in one in-process 4 x 2 swarm whose pulls are switched off and on in
  alternating windows (none, dpwa, dpwa, none), so the drift of the machine's load cancels out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import sys
import threading
import time
from typing import Any

from benchmarks.common import (
    finish,
    machine_notes,
    median,
    parser as common_parser,
    ratio,
    say,
    wait_until,
    write_run,
)
from benchmarks.fleet import Fleet

LAYER_TENSORS = 10
TENSOR_NUMEL = 1_000_000  # 10 x 1M float32 = 40 MB
PULL_SWARM = "layer0"
PULL_TIMEOUT_S = 120.0
HIVEMIND_PREFIX = "pullbench"
DEMO_GRACE_S = 120.0  # start-up and shutdown of a demo beyond its time limit
FULL = {"demo_s": 75.0, "repeats": 5, "warmup_s": 4.0, "window_s": 8.0}
QUICK = {"demo_s": 60.0, "repeats": 1, "warmup_s": 2.0, "window_s": 3.0}  # both demos at once


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.serve:
        return _serve()
    settings = QUICK if args.quick else FULL
    started = time.monotonic()
    report: dict[str, Any] = {"machine": machine_notes()}
    with Fleet(prefix="volunteer-bench-averaging-") as fleet:
        parts = set(args.only or ("accuracy", "pull", "overhead"))
        if "pull" in parts:
            report.update(_pull(fleet, settings["repeats"]))
        if "overhead" in parts:
            report.update(_overhead(fleet, settings["warmup_s"], settings["window_s"]))
        if "accuracy" in parts:
            report.update(_accuracy(fleet, settings["demo_s"], together=args.quick))
    return finish(report, "averaging", started, args)


def _parser() -> argparse.ArgumentParser:
    parser = common_parser("averaging", __doc__,
                           "both demos at once, one transfer each, short windows: a smoke test, not a measurement")
    parser.add_argument("--only", choices=("accuracy", "pull", "overhead"), action="append",
                        help="run only these parts (repeatable); default: all")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the pull benchmark's server
    return parser


def _bench_run(name: str, **averaging: Any) -> Any:
    from swarm.run.runconfig import RunConfig

    return RunConfig.model_validate({"name": name, "averaging": averaging})


# ----- accuracy: the demo against the local reference
def _accuracy(fleet: Fleet, demo_s: float, together: bool) -> dict[str, Any]:
    """Both partitions; ``together`` runs the two demos at once (quick mode: a smoke test)."""
    report: dict[str, Any] = {}
    partitions = ("iid", "label_skewed")
    if together:
        demos = [_start_demo(fleet, partition, demo_s) for partition in partitions]
        for demo in demos:
            report.update(_finish_demo(fleet, *demo))
    else:
        for partition in partitions:
            report.update(_finish_demo(fleet, *_start_demo(fleet, partition, demo_s)))
    return report


def _start_demo(fleet: Fleet, partition: str, demo_s: float) -> tuple[str, Any, Any, float]:
    from volunteer.config import load_run

    run, _ = load_run(None)  # the default run: digits-mlp
    config = run.model_dump(mode="json")
    config["data"]["partition"] = partition
    path = write_run(fleet.workdir / f"{partition}.yaml", config)
    say(f"demo of {run.name} ({partition}), 4 swarms x 2 peers, {demo_s:.0f} s")
    demo = fleet.volunteer(f"demo-{partition}", "demo", "--run", str(path), "--per-swarm", "2", "--json",
                           "--target-accuracy", "1.0", "--time-limit-s", str(demo_s))
    return partition, path, demo, demo_s


def _finish_demo(fleet: Fleet, partition: str, path: Any, demo: Any, demo_s: float) -> dict[str, Any]:
    import yaml

    from swarm.run.local import train_local
    from swarm.run.runconfig import RunConfig

    key = "iid" if partition == "iid" else "skewed"
    wait_until(lambda: demo.popen.poll() is not None, demo_s + DEMO_GRACE_S, f"the {partition} demo to finish",
               interval_s=1.0)
    lines = demo.json_lines()
    if not lines or lines[-1].get("test_accuracy") is None:
        return {f"accuracy_{key}": {"error": "the demo published no evaluation", "log": demo.stderr()[-800:]}}
    result = lines[-1]
    local = train_local(RunConfig.model_validate(yaml.safe_load(path.read_text())), int(result["samples"]))
    say(f"{partition}: swarm {result['test_accuracy']:.3f} vs local {local.accuracy:.3f} "
        f"after {result['samples']} samples")
    return {
        f"accuracy_ratio_{key}": ratio(result["test_accuracy"], local.accuracy),
        f"accuracy_{key}": {"swarm": result["test_accuracy"], "local": local.accuracy, "samples": result["samples"],
                            "swarm_seconds": result["seconds"], "lost_microbatches": result["lost_microbatches"]},
    }


# ----- pull speed: our parameter service vs raw TCP vs hivemind, between two processes
class _FakeWorker:
    """A 40 MB layer; ``capture`` copies it as the stage's does (under a lock)."""

    def __init__(self, tensors: dict[str, Any]):
        self.tensors = tensors
        self.lock = threading.Lock()

    def capture(self, include_optimizer: bool = False) -> Any:
        from swarm.pipeline.stage.worker import WorkerState

        with self.lock:
            params = {name: t.clone() for name, t in self.tensors.items()}
        return WorkerState(params=params, optimizer={} if include_optimizer else None, clock=1.0, loss_ema=1.0,
                           param_version=1)


def _layer() -> dict[str, Any]:
    import torch

    generator = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(TENSOR_NUMEL, generator=generator) for i in range(LAYER_TENSORS)}


def _serve() -> int:
    """Child process: serve the 40 MB layer three ways until stdin closes."""
    import hivemind
    from hivemind.compression import NoCompression

    from swarm.averaging.params_rpc import ParamsServicer
    from swarm.dht.dht import DHTSettings, fresh_p2p, shutdown_dht, start_dht
    from swarm.pipeline.stage.stage_rpc import stage_namespace

    layer = _layer()
    payload = b"".join(t.numpy().tobytes() for t in layer.values())
    run = _bench_run("pullbench")
    dht = start_dht(DHTSettings(), [])
    previous = signal.getsignal(signal.SIGINT)
    averager = hivemind.DecentralizedAverager(list(layer.values()), dht, prefix=HIVEMIND_PREFIX, start=True,
                                             target_group_size=2, allow_state_sharing=True,
                                             state_compression=NoCompression())
    signal.signal(signal.SIGINT, previous)  # the averager sets SIGINT to ignored (HIVEMIND_NOTES.md)

    async def register() -> None:
        p2p = await fresh_p2p(dht)
        servicer = ParamsServicer(_FakeWorker(layer), run_id=run.run_id, swarm=PULL_SWARM)
        await servicer.add_p2p_handlers(p2p, namespace=stage_namespace(run.run_id, PULL_SWARM))

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    asyncio.run_coroutine_threadsafe(register(), loop).result(60)
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_send_forever, args=(listener, payload), daemon=True).start()
    print(json.dumps({"maddrs": [str(m) for m in dht.get_visible_maddrs()], "tcp_port": listener.getsockname()[1]}),
          flush=True)
    try:
        sys.stdin.read()  # the benchmark closes our stdin to stop us
    finally:
        averager.shutdown()
        shutdown_dht(dht)
    return 0


def _send_forever(listener: socket.socket, payload: bytes) -> None:
    while True:
        connection, _ = listener.accept()
        with connection:
            connection.sendall(payload)


def _pull(fleet: Fleet, repeats: int) -> dict[str, Any]:
    """The three transfers take turns (ours, raw TCP, hivemind) so the machine's load drift hits all alike."""
    say("pull benchmark: a 40 MB layer between two processes on loopback")
    server = fleet.start("pull-server", [sys.executable, "-m", "benchmarks.averaging", "--serve"], stdin_pipe=True)

    def first_line() -> dict | None:
        server.check_running()
        lines = server.json_lines()
        return lines[0] if lines else None

    info = wait_until(first_line, 180, "the pull server to start", interval_s=0.2)
    size_mb = LAYER_TENSORS * TENSOR_NUMEL * 4 / 2**20
    client = _PullClient(fleet, info["maddrs"])
    times: dict[str, list[float]] = {"pull_s": [], "raw_s": [], "hivemind_s": []}
    try:
        client.wait_for_hivemind_donor()
        for _ in range(repeats):
            times["pull_s"].append(client.ours())
            times["raw_s"].append(_time_raw(info["tcp_port"], size_mb))
            times["hivemind_s"].append(client.hivemind())
    finally:
        client.close()
        server.stop()  # closes its stdin: it shuts its averager and DHT down
    pull_mb_s, raw_mb_s, hivemind_mb_s = (size_mb / median(t) for t in times.values())
    say(f"pull {pull_mb_s:.0f} MB/s, raw TCP {raw_mb_s:.0f} MB/s, hivemind load_state_from_peers "
        f"{hivemind_mb_s:.0f} MB/s")
    return {"pull_mb_s": pull_mb_s, "raw_mb_s": raw_mb_s, "pull_vs_raw": ratio(pull_mb_s, raw_mb_s),
            "pull_vs_hivemind": ratio(pull_mb_s, hivemind_mb_s), "hivemind_mb_s": hivemind_mb_s, **times,
            "pulled_mb": size_mb}


class _PullClient:
    """This process's side: a DHT with its own P2P replica for ``fetch_params``, and a hivemind averager."""

    def __init__(self, fleet: Fleet, maddrs: list[str]):
        import hivemind
        import torch

        from swarm.dht.dht import fresh_p2p

        self.fleet = fleet
        self.donor = maddrs[0].rsplit("/p2p/", 1)[1]
        self.run = _bench_run("pullbench")
        self.dht = fleet.dht(maddrs, [])
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.p2p = self._on_loop(fresh_p2p(self.dht))
        previous = signal.getsignal(signal.SIGINT)
        self.averager = hivemind.DecentralizedAverager(
            [torch.zeros(TENSOR_NUMEL) for _ in range(LAYER_TENSORS)], self.dht, prefix=HIVEMIND_PREFIX,
            start=True, target_group_size=2, client_mode=True)
        signal.signal(signal.SIGINT, previous)  # the averager sets SIGINT to ignored (HIVEMIND_NOTES.md)

    def _on_loop(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(PULL_TIMEOUT_S)

    def ours(self) -> float:
        from swarm.averaging.params_rpc import fetch_params

        started = time.perf_counter()
        state, _ = self._on_loop(fetch_params(self.p2p, self.donor, self.run, PULL_SWARM, PULL_TIMEOUT_S))
        elapsed = time.perf_counter() - started
        assert len(state) == LAYER_TENSORS
        return elapsed

    def wait_for_hivemind_donor(self) -> None:
        """The server's averager declares itself in the DHT a little after it starts."""
        wait_until(lambda: self.averager.load_state_from_peers(timeout=PULL_TIMEOUT_S) is not None, PULL_TIMEOUT_S,
                   "hivemind's load_state_from_peers to find the server", interval_s=1.0)

    def hivemind(self) -> float:
        started = time.perf_counter()
        loaded = self.averager.load_state_from_peers(timeout=PULL_TIMEOUT_S)
        elapsed = time.perf_counter() - started
        if loaded is None or len(loaded[1]) != LAYER_TENSORS:
            raise RuntimeError("hivemind's load_state_from_peers returned nothing")
        return elapsed

    def close(self) -> None:
        try:
            self._on_loop(self.p2p.shutdown())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.averager.shutdown()
            self.fleet.close_dht(self.dht)


def _time_raw(port: int, size_mb: float) -> float:
    expected = int(size_mb * 2**20)
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=PULL_TIMEOUT_S) as connection:
        received = 0
        while received < expected:
            chunk = connection.recv(4 * 2**20)
            if not chunk:
                break
            received += len(chunk)
    if received != expected:
        raise RuntimeError(f"raw TCP: got {received} of {expected} bytes")
    return time.perf_counter() - started


# ----- overhead: one in-process swarm, averaging switched off and on in alternating windows
def _overhead(fleet: Fleet, warmup_s: float, window_s: float) -> dict[str, Any]:
    """Alternating windows on the same peers cancel most of the drift of a shared machine's load."""
    from volunteer.config import load_run

    run, _ = load_run(None)  # the default run, its averaging block as configured (Dpwa)
    rates = _alternating_rates(fleet, run, warmup_s, window_s)
    say(f"samples/s without averaging {rates['none']:.0f}, with {rates['dpwa']:.0f}")
    return {"averaging_overhead": ratio(rates["dpwa"], rates["none"]), "overhead_rates": rates}


def _alternating_rates(fleet: Fleet, run: Any, warmup_s: float, window_s: float) -> dict[str, float]:
    """Samples/s of a 2-peers-per-swarm pipeline in this process, its records fed by hand each second."""
    from swarm.pipeline.peer import SwarmPeer
    from swarm.dht.records import MemberRecord

    first = fleet.dht([], [])
    maddrs = [str(m) for m in first.get_visible_maddrs()]
    peers: dict[str, list[SwarmPeer]] = {name: [] for name in run.swarm_names}
    dhts = [first]
    try:
        for name in run.swarm_names[::-1]:  # drivers last, so they find every swarm up
            for shard in range(2):
                dht = fleet.dht(maddrs, [])
                dhts.append(dht)
                peer = SwarmPeer(run, dht, name, shard=shard, evaluate=False)
                peer.start()
                peers[name].append(peer)
        everyone = [p for group in peers.values() for p in group]

        def views() -> dict[str, list[MemberRecord]]:
            now = time.time()
            return {name: [MemberRecord(peer_id=str(p.dht.peer_id), state="online", version="bench", started_at=now,
                                        updated_at=now, clock=int(p.worker.stats.clock),
                                        loss=p.worker.stats.loss_ema or -1.0,
                                        shard=p.shard if p.shard is not None else -1)
                           for p in group] for name, group in peers.items()}

        def window(seconds: float) -> float:
            before, started = sum(p.driver.stats.trained for p in peers["layer0"]), time.monotonic()
            deadline = started + seconds
            while time.monotonic() < deadline:
                current = views()
                for peer in everyone:
                    peer.update_views(current)
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            return (sum(p.driver.stats.trained for p in peers["layer0"]) - before) / (time.monotonic() - started)

        window(warmup_s)
        samples: dict[str, list[float]] = {"none": [], "dpwa": []}
        for mode in ("none", "dpwa", "dpwa", "none"):
            for peer in everyone:
                peer.averaging._pulls_enabled = mode == "dpwa"
            samples[mode].append(window(window_s / 2))
        pulls = sum(p.averaging.stats.averaged for p in everyone)
        return {"none": sum(samples["none"]) / 2, "dpwa": sum(samples["dpwa"]) / 2, "pulls_applied": pulls}
    finally:
        for peer in [p for group in peers.values() for p in group]:
            peer.stop()
        for dht in dhts:
            fleet.close_dht(dht)


if __name__ == "__main__":
    sys.exit(main())
