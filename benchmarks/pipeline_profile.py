"""Where a stage's CPU goes per micro-batch: the heavy pipeline of benchmarks.pipeline under py-spy (issue 29).

    python -m benchmarks.pipeline_profile --json [--window-s 20] [--rate 67] [--quick]

needs ``py-spy`` on PATH or next to the interpreter (``pip install py-spy``: a tool, not a dependency). Starts
the heavy run of ``benchmarks.pipeline`` (one ``volunteer join`` per stage on loopback), lets it warm up,
then samples every volunteer process with ``py-spy record --format raw`` for ``--window-s`` while counting
the micro-batches the driver finished and every process's CPU (/proc). Each stack is put in one bucket
(``BUCKETS``: the first rule that matches, leaf first), and a volunteer's CPU is split over the buckets in
proportion to its samples. Prints, per stage, CPU ms per micro-batch and per bucket, plus p2pd's and the
DHT's. py-spy sees Python frames: time in torch's C++ is charged to the Python call that entered it, which
is what the buckets need (``forward`` is the time under the model's forward call, and so on). py-spy
itself costs the sampled process a little (it stops it to read the stack unless ``--nonblocking``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.common import BenchmarkError, finish, machine_notes, parser as common_parser, say
from benchmarks.fleet import Fleet
from benchmarks.procstats import cpu_used

# (bucket, needles): a stack goes to the first bucket with a needle in one of its frames ("function (file:line)", read
# from the leaf up). A needle ending in " (" is a function name (the frame starts with it), any other a path part.
BUCKETS: list[tuple[str, tuple[str, ...]]] = [
    ("hashing (BLAKE3)", ("tensor_digest (", "ids_digest (", "digest (")),
    ("receipts (sign, verify, keys)", ("swarm/integrity/receipts.py", "stage_receipts.py", "keybook.py",
                                       "replies.py")),
    ("guard (backup, finiteness, step bound)", ("swarm/integrity/guard.py",)),
    ("clipping (norms)", ("_clip_param_grads (", "_clip_grad_out (")),
    ("checks (finiteness, bounds of inputs/outputs)", ("check_tensor (", "_check_emitted (",
                                                      "_refuse_out_of_bound (", "_within_reply_bound (",
                                                      "check_grad (", "check_input (", "check_targets (")),
    ("health/heal (norms, snapshots, collapse)", ("swarm/integrity/heal.py", "swarm/integrity/health.py",
                                                  "capture (")),
    ("optimizer step", ("torch/optim/",)),
    ("(de)serialization and copies", ("serialize_torch_tensor (", "deserialize_torch_tensor (",
                                      "split_for_streaming (", "combine_from_streaming (", "encode_tensors (",
                                      "decode_tensors (", "join_stream (", "split_message (", "codecs.py",
                                      "SerializeToString (", "FromString (", "ParseFromString (",
                                      "_read_message (", "_write_message (")),
    ("backward", ("torch/_tensor.py", "torch/autograd/")),
    ("forward", ("functional_call (", "_graph (", "torch/nn/modules/")),
    ("loss", ("loss_fn (",)),
    ("DHT and heartbeats", ("hivemind/dht/", "swarm/dht/", "volunteer/node/")),
    ("p2p/asyncio/hivemind", ("hivemind/p2p/", "asyncio/", "hivemind/utils/", "grpc", "concurrent/futures")),
]
OTHER = "other"
RECOMPUTED = "forward recomputed at backward"  # _graph under StageWorker.backward
# --nonblocking cannot always tell a waiting thread from a running one: a stack that ends in a wait is idle, and is
# left out of the split of the process's CPU
IDLE = "idle (waits)"
IDLE_LEAVES = ("select (", "wait (", "poll (", "sleep (", "_worker (")


def bucket_of(frames: list[str]) -> str:
    """The bucket of one stack (frames root first, as py-spy writes them): the innermost frame that a rule names."""
    if frames and any(_matches(frames[-1], needle) for needle in IDLE_LEAVES):
        return IDLE
    if any(_matches(f, "backward (") and "swarm/pipeline/stage/worker.py" in f for f in frames) and \
            any(_matches(f, "_graph (") for f in frames):
        return RECOMPUTED
    for frame in reversed(frames):
        for name, needles in BUCKETS:
            if any(_matches(frame, needle) for needle in needles):
                return name
    return OTHER


def thread_of(frames: list[str]) -> str:
    """The thread's name from py-spy's ``--threads`` first frame ("thread (tid): name"), numbers dropped."""
    head = frames[0] if frames and frames[0].startswith("thread (") else ""
    return head.split(": ", 1)[-1].rstrip("0123456789_") if head else "?"


def _matches(frame: str, needle: str) -> bool:
    if needle.endswith(" ("):  # a function name, with or without its class ("StageWorker._graph (...)")
        return frame.split(" (", 1)[0].rsplit(".", 1)[-1] == needle[:-2]
    return needle in frame


def parse_raw(text: str) -> tuple[Counter[str], Counter[str]]:
    """Samples per bucket and per thread from py-spy's raw (collapsed) output: ``frame;frame;... count`` per line."""
    buckets: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        buckets[bucket_of(frames)] += int(count)
        threads[thread_of(frames)] += int(count)
    return buckets, threads


def _busy_threads(path: Path) -> Counter[str]:
    """Samples per thread, idle stacks left out."""
    out: Counter[str] = Counter()
    for line in (path.read_text() if path.exists() else "").splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if stack and count.isdigit() and bucket_of(frames) != IDLE:
            out[thread_of(frames)] += int(count)
    return out


def _py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise BenchmarkError("py-spy is not installed: pip install py-spy (a profiling tool, not a dependency)")
    return found


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from benchmarks import pipeline

    settings = replace(pipeline.Settings(**pipeline.QUICK) if args.quick else pipeline.Settings())
    started = time.monotonic()
    with Fleet(prefix="volunteer-bench-profile-") as fleet:
        report = _profile(fleet, settings, args)
    return finish(report, "pipeline_profile", started, args)


def _parser() -> argparse.ArgumentParser:
    parser = common_parser("pipeline_profile", __doc__, "the quick pipeline settings: a smoke test")
    parser.add_argument("--window-s", type=float, default=20.0, help="seconds sampled")
    parser.add_argument("--rate", type=int, default=20, help="py-spy samples per second")
    parser.add_argument("--blocking", action="store_true",
                        help="py-spy pauses a process to read its stacks (exact stacks, but it slows the pipeline "
                        "down several times at 67 Hz)")
    parser.add_argument("--raw-dir", type=Path, default=None, help="keep py-spy's raw stacks here")
    parser.add_argument("--run", default="heavy", help="heavy (benchmarks.pipeline's), or a run of configs/runs "
                        "(digits-mlp, charlm) without evaluation (benchmarks/pipeline_configs.py)")
    return parser


def _profile(fleet: Fleet, s: Any, args: argparse.Namespace) -> dict[str, Any]:
    from hivemind.dht.crypto import RSASignatureValidator

    from benchmarks import pipeline
    from swarm.dht.membership import Membership

    spy = _py_spy()
    _, maddr = fleet.bootstrap()
    reader = fleet.dht([maddr], [RSASignatureValidator()], client_mode=True)
    if args.run == "heavy":
        run_path, run = pipeline._heavy_run(fleet, s)
    else:
        from benchmarks.common import load_run_config, write_run
        from benchmarks.pipeline_configs import training_only

        run_path = write_run(fleet.workdir / f"{args.run}.yaml", training_only(args.run, s.heartbeat_s))
        run = load_run_config(run_path)
    s = replace(s, heavy_stages=run.model.stages, heavy_batch=run.training.batch_size)
    procs = pipeline._join_all(fleet, run_path, maddr, s.heavy_stages, 1, "profile")
    flat = [p for group in procs.values() for p in group]
    membership = Membership(reader, run, b"")
    report: dict[str, Any] = {"machine": machine_notes(), "window_s": args.window_s, "rate": args.rate}
    try:
        pipeline._wait_training(membership, s.heavy_stages, 1, flat, pipeline.START_TIMEOUT_S)
        say(f"profile: training; warm-up {s.heavy_warmup_s:.0f} s, then py-spy for {args.window_s:.0f} s")
        pipeline._sleep(s.heavy_warmup_s, flat)
        before = {r.peer_id: r for r in membership.read("layer0") if r.state == "online"}
        cpu_before, wall = fleet.cpu_snapshot(), time.monotonic()
        spies = {swarm: _record(spy, group[0].pid, args, fleet.workdir / f"{swarm}.raw")
                 for swarm, group in procs.items()}
        for spy_proc in spies.values():
            spy_proc.wait(timeout=args.window_s + 60)
        cpu = fleet.cpu_snapshot()
        wall = time.monotonic() - wall
        after = {r.peer_id: r for r in membership.read("layer0") if r.state == "online"}
    finally:
        pipeline._stop_in_order(fleet, procs)
    microbatches = sum(after[p].trained - before[p].trained for p in after if p in before) / s.heavy_batch
    if microbatches <= 0:
        raise BenchmarkError("no micro-batch finished in the window")
    per_pid = {pid: seconds - cpu_before[pid][1] for pid, (_, seconds) in cpu.items() if pid in cpu_before}
    kinds = cpu_used(cpu_before, cpu)
    report["microbatches"] = microbatches
    report["cpu_ms_per_microbatch"] = {kind: 1000 * v / microbatches for kind, v in kinds.items()}
    report["stages"] = {}
    for swarm, group in procs.items():
        counts, threads = parse_raw((fleet.workdir / f"{swarm}.raw").read_text() if (fleet.workdir / f"{swarm}.raw").exists()
                           else "")
        idle = counts.pop(IDLE, 0)
        threads = _busy_threads(fleet.workdir / f"{swarm}.raw")
        total = sum(counts.values()) or 1
        ms = 1000 * per_pid.get(group[0].pid, 0.0) / microbatches
        report["stages"][swarm] = {
            "cpu_ms_per_microbatch": ms, "samples": sum(counts.values()), "idle_samples": idle,
            "buckets_ms": {name: ms * n / total for name, n in counts.most_common()},
            "threads_ms": {name: ms * n / total for name, n in threads.most_common()},
        }
        say(f"{swarm}: {ms:.0f} ms/mb: " + ", ".join(f"{k} {ms * n / total:.0f}" for k, n in counts.most_common()))
    report["wall_s"] = wall
    if args.raw_dir is not None:
        args.raw_dir.mkdir(parents=True, exist_ok=True)
        for swarm in procs:
            if (fleet.workdir / f"{swarm}.raw").exists():
                shutil.copy(fleet.workdir / f"{swarm}.raw", args.raw_dir / f"{swarm}.raw")
    return report


def _record(spy: str, pid: int, args: argparse.Namespace, out: Path) -> subprocess.Popen:
    argv = [spy, "record", "--pid", str(pid), "--duration", str(int(args.window_s)), "--rate", str(args.rate),
            "--format", "raw", "--threads", "--output", str(out)]
    if not args.blocking:
        argv.append("--nonblocking")
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy())


if __name__ == "__main__":
    sys.exit(main())
