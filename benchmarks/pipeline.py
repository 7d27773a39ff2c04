"""Pipeline throughput against one process, scaling with peers per swarm, and the cost of one hop.

    python -m benchmarks.pipeline --json [--quick] [--step-s 0.05] [--scaling-stages 2] [--heavy-codec float16]

prints one JSON object (progress goes to stderr):

- ``efficiency_heavy``: samples/s of a compute-heavy run (``heavy_stages`` stages of 2048-wide MLP
  layers, batch 256, Adam) with one real `volunteer join` process per stage on loopback, over
  samples/s of the same model, optimizer and batches trained in one process on the same machine.
  The stage processes use one torch thread each (the client's default). The one-process loop runs
  with 1 thread and with as many threads as the machine has cores, in alternating slices before and
  after the pipeline (medians: drift on a shared machine); ``efficiency_heavy`` divides by the faster
  of the two (``heavy.baseline_threads``), the fair comparison since both sides may use the machine;
  ``efficiency_heavy_vs_1_thread`` and ``efficiency_heavy_vs_<cores>_threads`` are both reported.
  ``cpu_efficiency_heavy`` compares samples per CPU-second (every process of the swarm, p2pd
  included, against the one-thread loop): it does not depend on what else runs on the machine, and
  ``heavy.cpu_ms_per_microbatch`` says where the swarm's extra CPU goes.
- ``scaling_2``, ``scaling_4``: with a simulated accelerator (``VOLUNTEER_SIMULATED_STEP_S``: each
  forward/backward sleeps ``--step-s`` on the stage's single compute thread, so the CPU is not the
  limit), throughput with 2 and 4 peers in every swarm (so 2 or 4 layer0 drivers too) over 1 peer
  per swarm. The same processes serve all three sizes: 4 per swarm first, then 2 and 1 per swarm
  after clean leaves, each measured after a warm-up.
- ``hop_overhead_ms_64k``, ``hop_overhead_ms_4m``: median time of a forward hop (``call_stage``
  to a ``StageServicer`` of another P2P peer, in-process, over loopback through both p2pd daemons)
  minus the median local forward (``dispatch``: checks and forward on the same kind of worker), for
  64 KiB and 4 MiB of activations, each sent the way call_stage chooses (on a session below
  ``sessions.SESSION_LIMIT_BYTES``, a stream of its own from there). Ratios: against an empty hop (batch 1)
  and as MB/s of activations moved both ways; ``hop_{overhead,cpu}_<size>_unary_vs_streamed`` and
  ``hop_{overhead,cpu}_<size>_session_vs_{unary,streamed}`` compare the three transports, each forced, at equal
  sizes (64 KiB to 2 MiB), in time and in CPU (this process and both p2pd daemons).
- ``driver_bytes_vs_relay``: the driver's tensor bytes per micro-batch with stages pushing to each other over
  those with the driver relaying every hop, charlm at 4 stages in one run (``data_plane``;
  benchmarks/pipeline_dataplane.py).

Throughput is read from the drivers' own membership records (``trained`` samples at ``updated_at``,
one record per heartbeat), summed over layer0 peers, after a warm-up.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.common import (
    finish,
    load_run_config,
    machine_notes,
    median,
    parser as common_parser,
    ratio,
    say,
    write_run,
)
from benchmarks.fleet import Fleet
from benchmarks.pipeline_configs import QUICK as QUICK_CONFIGS, ConfigSettings, configs
from benchmarks.pipeline_dataplane import QUICK as QUICK_DATA_PLANE, DataPlaneSettings, data_plane
from benchmarks.pipeline_hop import hops
from benchmarks.pipeline_swarm import (  # under their old names: benchmarks.wan and pipeline_profile use them here
    START_TIMEOUT_S,
    LocalLoop as _LocalLoop,
    join_all as _join_all,
    measure as _measure,
    sleep_checking as _sleep,  # noqa: F401 (benchmarks.wan, pipeline_profile)
    stop_in_order as _stop_in_order,
    wait_training as _wait_training,
)



@dataclass(slots=True, kw_only=True)
class Settings:
    heavy_stages: int = 4
    heavy_width: int = 2048
    heavy_batch: int = 256
    heavy_rows: int = 4096  # samples in the generated npz
    heavy_in_flight: int = 8
    heavy_warmup_s: float = 20.0
    heavy_window_s: float = 30.0
    heavy_codec: str = "float32"  # the heavy run's training.wire_codec (float16, int8: fewer bytes through p2pd)
    local_slices: int = 3  # per thread count, before and after the pipeline
    local_slice_s: float = 4.0
    local_warmup_batches: int = 3
    scaling_stages: int = 2
    scaling_peers: tuple[int, ...] = (4, 2, 1)
    step_s: float = 0.05
    scaling_in_flight: int = 8
    scaling_warmup_s: float = 10.0
    scaling_window_s: float = 20.0
    heartbeat_s: float = 2.0
    hop_reps: int = 25


QUICK = dict(heavy_stages=2, heavy_width=256, heavy_batch=32, heavy_rows=512, heavy_warmup_s=1.0,
             heavy_window_s=2.0, local_slices=1, local_slice_s=0.3, local_warmup_batches=1, scaling_stages=1,
             scaling_peers=(2, 1), scaling_warmup_s=1.0, scaling_window_s=2.0, heartbeat_s=0.5, hop_reps=3)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    settings = replace(Settings(**QUICK) if args.quick else Settings(), step_s=args.step_s)
    if args.scaling_stages is not None:
        settings.scaling_stages = args.scaling_stages
    settings.heavy_codec = args.heavy_codec
    if args.heavy_warmup_s is not None:
        settings.heavy_warmup_s = args.heavy_warmup_s
    if args.heavy_window_s is not None:
        settings.heavy_window_s = args.heavy_window_s
    started = time.monotonic()
    # forked volunteers: every figure here is taken in windows after the swarm trains, never of a start
    with Fleet(prefix="volunteer-bench-pipeline-", keep_workdir=bool(os.environ.get("VOLUNTEER_BENCH_KEEP")),
               fork=True) as fleet:
        report = _benchmark(fleet, settings, args)
    return finish(report, "pipeline", started, args)


def _parser() -> argparse.ArgumentParser:
    parser = common_parser("pipeline", __doc__,
                           "tiny sizes and windows, 1-stage scaling with 2 -> 1 peers: a smoke test, not a measurement")
    parser.add_argument("--step-s", type=float, default=0.05, help="simulated accelerator step for the scaling runs")
    parser.add_argument("--scaling-stages", type=int, default=None, help="stages of the scaling runs (default 2)")
    parser.add_argument("--only", choices=("hop", "heavy", "scaling", "configs", "data-plane"), action="append",
                        help="run only these parts (repeatable); default: all but data-plane under --quick")
    parser.add_argument("--heavy-codec", default="float32", choices=("float32", "float16", "int8"),
                        help="the heavy run's wire codec (training.wire_codec; default float32)")
    parser.add_argument("--heavy-warmup-s", type=float, default=None,
                        help="the heavy run's seconds of training before its window (default 20: inside the first "
                             "minute, when checks of peers new to the driver are 8x as frequent)")
    parser.add_argument("--heavy-window-s", type=float, default=None, help="the heavy run's window (default 30 s)")
    parser.add_argument("--per-swarm", type=int, default=1,
                        help="the data-plane part's volunteers per stage (default 1)")
    parser.add_argument("--data-plane-warmup-s", type=float, default=None,
                        help="the data-plane part's seconds of training before its window (default 10; checks of "
                             "peers new to a driver are 8x as frequent in a run's first minute)")
    parser.add_argument("--data-plane-window-s", type=float, default=None,
                        help="the data-plane part's measuring window (default 30 s; the checks are drawn at random: "
                             "a longer window narrows the spread)")
    parser.add_argument("--data-plane-modes", default=None,
                        help="the data-plane part's modes, comma-separated (default: push,relay,push_unchecked)")
    parser.add_argument("--runs", default=None,
                        help="the shipped runs the configs part measures, comma-separated (default: digits-mlp,charlm; "
                             "e.g. llm-tiny)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a run-config field of the configs part's runs, e.g. training.weight_prediction=0 "
                             "(the value is YAML; repeatable)")
    return parser


def _benchmark(fleet: Fleet, settings: Settings, args: argparse.Namespace) -> dict[str, Any]:
    from hivemind.dht.crypto import RSASignatureValidator

    parts = set(args.only or ("hop", "heavy", "scaling", "configs", *(() if args.quick else ("data-plane",))))
    say(f"starting a bootstrap peer (work dir {fleet.workdir})")
    _, maddr = fleet.bootstrap()
    reader = fleet.dht([maddr], [RSASignatureValidator()], client_mode=True)
    report: dict[str, Any] = {"machine": machine_notes()}
    if "hop" in parts:
        report.update(hops(fleet, maddr, settings.hop_reps))
    if "heavy" in parts:
        report.update(_heavy(fleet, maddr, reader, settings))
    if "scaling" in parts:
        report.update(_scaling(fleet, maddr, reader, settings))
    if "configs" in parts:
        chosen = QUICK_CONFIGS if args.quick else ConfigSettings()
        if args.runs:
            chosen = replace(chosen, runs=tuple(name.strip() for name in args.runs.split(",") if name.strip()))
        chosen = replace(chosen, overrides=tuple(args.set))
        report["settings_set"] = list(args.set)
        report.update(configs(fleet, maddr, reader, chosen))
    if "data-plane" in parts:
        chosen_plane = QUICK_DATA_PLANE if args.quick else DataPlaneSettings()
        chosen_plane = replace(chosen_plane, per_swarm=args.per_swarm)
        if args.data_plane_warmup_s is not None:
            chosen_plane = replace(chosen_plane, warmup_s=args.data_plane_warmup_s)
        if args.data_plane_window_s is not None:
            chosen_plane = replace(chosen_plane, window_s=args.data_plane_window_s)
        if args.data_plane_modes:
            chosen_plane = replace(chosen_plane, modes=tuple(m.strip() for m in args.data_plane_modes.split(",")))
        report.update(data_plane(fleet, maddr, reader, chosen_plane))
    report["machine"]["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    return report


# ----- run configs


def _run_config(name: str, *, stages: int, heartbeat_s: float, in_flight: int, batch: int, width: int | None = None,
                data: dict | None = None, optimizer: dict | None = None) -> dict[str, Any]:
    model: dict[str, Any] = {"kind": "mlp", "stages": stages}
    if width is not None:
        model.update(input_dim=width, hidden_dim=width, num_classes=10)
    config: dict[str, Any] = {
        "name": name,
        "model": model,
        "optimizer": optimizer or {"name": "adam", "lr": 0.001},
        "training": {"batch_size": batch, "in_flight": in_flight, "eval_every_s": 1e6},  # no evaluation
        "timeouts": {"heartbeat_s": heartbeat_s},
    }
    if data is not None:
        config["data"] = data
    return config


# ----- measuring throughput from the records







def _heavy_run(fleet: Fleet, s: Settings) -> tuple[Path, Any]:
    """The heavy run's config and its data: random features in an npz file (what is learned does not matter)."""
    import numpy as np

    data_path = fleet.workdir / "heavy.npz"
    rng = np.random.default_rng(0)
    np.savez(data_path, X=rng.standard_normal((s.heavy_rows, s.heavy_width), dtype=np.float32),
             y=rng.integers(0, 10, s.heavy_rows))
    config = _run_config("pipeheavy", stages=s.heavy_stages, heartbeat_s=s.heartbeat_s, in_flight=s.heavy_in_flight,
                         batch=s.heavy_batch, width=s.heavy_width,
                         data={"source": "npz", "path": str(data_path), "shards": 1})
    if s.heavy_codec != "float32":
        config["training"]["wire_codec"] = s.heavy_codec
    run_path = write_run(fleet.workdir / "heavy.yaml", config)
    return run_path, load_run_config(run_path)


def _heavy(fleet: Fleet, maddr: str, reader: Any, s: Settings) -> dict[str, Any]:
    from swarm.dht.membership import Membership

    run_path, run = _heavy_run(fleet, s)
    cores = os.cpu_count() or 1
    say(f"heavy: one process, 1 and {cores} thread(s), {s.heavy_stages} stages of width {s.heavy_width}, "
        f"batch {s.heavy_batch}")
    loop = _LocalLoop(run, s.local_warmup_batches)
    slices = loop.alternate((1, cores), s.local_slices, s.local_slice_s)
    procs = _join_all(fleet, run_path, maddr, s.heavy_stages, 1, "heavy")
    flat = [p for group in procs.values() for p in group]
    membership = Membership(reader, run, b"")
    try:
        _wait_training(membership, s.heavy_stages, 1, flat, START_TIMEOUT_S)
        say(f"heavy: all stages training; warm-up {s.heavy_warmup_s:.0f} s, window {s.heavy_window_s:.0f} s")
        swarm = _measure(fleet, membership, flat, s.heavy_warmup_s, s.heavy_window_s)
    finally:
        _stop_in_order(fleet, procs)
    slices += loop.alternate((1, cores), s.local_slices, s.local_slice_s)
    local = {n: median([x["samples_per_s"] for x in slices if x["threads"] == n]) for n in (1, cores)}
    local_cpu_1 = median([x["samples_per_cpu_s"] for x in slices if x["threads"] == 1])
    # a window without a sample (a stalled run) is a figure to report, not a crash that loses the others
    per_mb = {kind: 1000 * used / (swarm["samples_per_s"] / s.heavy_batch) if swarm["samples_per_s"] else None
              for kind, used in swarm["cpu_cores_by_process"].items()}
    best = max(local, key=lambda n: local[n])
    say(f"heavy: pipeline {swarm['samples_per_s']:.0f} samples/s on {swarm['cpu_cores_used']:.2f} cores; "
        f"one process: {local[1]:.0f} (1 thread) / {local[cores]:.0f} ({cores} threads), medians of "
        f"{2 * s.local_slices} slices")
    return {
        "efficiency_heavy": ratio(swarm["samples_per_s"], local[best]),
        "efficiency_heavy_vs_1_thread": ratio(swarm["samples_per_s"], local[1]),
        f"efficiency_heavy_vs_{cores}_threads": ratio(swarm["samples_per_s"], local[cores]),
        # against the fastest single slice: what one process reaches when the machine is least contended
        "efficiency_heavy_vs_best_slice": ratio(swarm["samples_per_s"], max(x["samples_per_s"] for x in slices)),
        "cpu_efficiency_heavy": ratio(swarm["samples_per_cpu_s"], local_cpu_1),
        "heavy": {
            "model": {"stages": s.heavy_stages, "width": s.heavy_width, "batch": s.heavy_batch,
                      "optimizer": "adam", "in_flight": s.heavy_in_flight, "wire_codec": s.heavy_codec},
            "pipeline": swarm,
            "stage_threads": 1,
            "warmup_s": s.heavy_warmup_s,
            "window_s": s.heavy_window_s,
            "local_samples_per_s": {str(n): rate for n, rate in local.items()},
            "local_samples_per_cpu_s_1_thread": local_cpu_1,
            "baseline_threads": best,  # the faster one-process configuration in this run
            "local_slices": slices,
            "cpu_ms_per_microbatch": {"local_1_thread": 1000 * s.heavy_batch / local_cpu_1, "pipeline": per_mb},
        },
    }


# ----- scaling with peers per swarm (simulated accelerator)


def _scaling(fleet: Fleet, maddr: str, reader: Any, s: Settings) -> dict[str, Any]:
    from swarm.dht.membership import Membership

    most = max(s.scaling_peers)
    config = _run_config("pipescale", stages=s.scaling_stages, heartbeat_s=s.heartbeat_s,
                         in_flight=s.scaling_in_flight, batch=32)
    run_path = write_run(fleet.workdir / "scale.yaml", config)
    run = load_run_config(run_path)
    membership = Membership(reader, run, b"")
    say(f"scaling: {most} peers in each of {s.scaling_stages} swarms, simulated step {s.step_s * 1000:.0f} ms, "
        f"in_flight {s.scaling_in_flight}")
    procs = _join_all(fleet, run_path, maddr, s.scaling_stages, most, "scale",
                      env={"VOLUNTEER_SIMULATED_STEP_S": str(s.step_s)})
    results: dict[int, dict[str, float]] = {}
    try:
        for per_swarm in sorted(s.scaling_peers, reverse=True):
            _stop_in_order(fleet, {swarm: group[per_swarm:] for swarm, group in procs.items()})
            procs = {swarm: group[:per_swarm] for swarm, group in procs.items()}
            flat = [p for group in procs.values() for p in group]
            _wait_training(membership, s.scaling_stages, per_swarm, flat, START_TIMEOUT_S)
            results[per_swarm] = _measure(fleet, membership, flat, s.scaling_warmup_s, s.scaling_window_s)
            say(f"scaling: {per_swarm} per swarm: {results[per_swarm]['samples_per_s']:.0f} samples/s "
                f"({results[per_swarm]['cpu_cores_used']:.2f} cores busy)")
    finally:
        _stop_in_order(fleet, procs)
    base = results[1]["samples_per_s"]
    # the bound: every stage's compute thread busy (2 steps per micro-batch and stage: forward + backward)
    ideal_1 = run.training.batch_size / (2 * s.step_s)
    report: dict[str, Any] = {f"scaling_{m}": ratio(results[m]["samples_per_s"], base) for m in results if m > 1}
    report["scaling"] = {
        "stages": s.scaling_stages, "step_s": s.step_s, "in_flight": s.scaling_in_flight, "batch": 32,
        "per_swarm": {str(m): results[m] for m in sorted(results)},
        "ideal_samples_per_s_1": ideal_1,
        "utilization_1": ratio(base, ideal_1),
    }
    return report


if __name__ == "__main__":
    sys.exit(main())
