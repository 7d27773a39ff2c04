"""What a volunteer's machine pays to serve a stage (issue 42): host bytes per stage parameter, a volunteer's RSS over
the floor of ``import torch, hivemind``, and CPU from process start to online.

    python -m benchmarks.footprint --json [--runs digits-mlp llm-tiny] [--train-s 30] [--quick]

prints one JSON object (progress on stderr):

- ``host_bytes``: per run (digits-mlp, llm-tiny, llm-small) and stage, the bytes of the distinct tensor storages a
  trained stage server holds beside its activations (the live copy, gradients, optimizer state, the guard's
  buffers, the referee's ring filled to its bound, healing's snapshots while in memory: ``swarm/run/memory.py
  held_bytes``), against ``host_memory`` (what `volunteer doctor` shows): ``per_param`` (bytes per parameter beyond
  the ring's fixed floor), ``fixed_mib`` and ``measured_vs_estimate``; healing's snapshots are written to files as a
  node writes them (``snapshots_on_disk_mib``, ``disk_vs_estimate``). Stages are built and trained in this process
  (a few updates each, batch 2); llm-small's stages have 25-27 M parameters.
- ``volunteers``: per run in ``--runs``, a real swarm on loopback (a bootstrap peer, one `volunteer join` per
  stage), training for ``--train-s`` after every volunteer is online; the layer1 volunteer's RSS (the median of
  samples every 0.5 s over the second half, and their range: it moves by ~100 MiB within a second) and, at the end, PSS
  (``/proc/PID/smaps_rollup``; anonymous and file-backed; its peak, VmHWM), against a process that did ``import torch, hivemind``
  and waits, measured in the same run (``floor_rss_mib``). ``over_floor_mib`` is the goal's left side and
  ``allowance_mib`` its right (100 MiB + 24 bytes per stage parameter). Also each volunteer's CPU seconds from
  spawn to its "online in" event (``cpu_to_online_s``, the python process alone: its p2pd and DHT helpers are
  separate processes, reported beside it); a first start proves its new identity's work (``integrity.identity_bits``,
  ~1 s of CPU at the default 8 bits, once per identity), so layer1 then starts again in the same data directory
  (``restart_cpu_to_online_s``: its identity's work and its checkpoint kept, as at a volunteer's later starts).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import finish, load_run_config, machine_notes, median, parser as common_parser, say, \
    wait_until, write_run
from benchmarks.fleet import Fleet, Proc, tagged_pids
from benchmarks.procstats import process_cpu_seconds
from benchmarks.pipeline_configs import RUNS_DIR

MIB = 2**20
ALLOWANCE_FIXED_MIB = 100
ALLOWANCE_PER_PARAM = 24
START_TIMEOUT_S = 240.0
FLOOR_CODE = "import sys, torch, hivemind; print('ready', flush=True); sys.stdin.read()"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.runs, args.train_s, args.host_runs = ["digits-mlp"], 3.0, ["digits-mlp"]
    started = time.monotonic()
    report: dict[str, Any] = {"host_bytes": {name: host_bytes(name) for name in args.host_runs}}
    with Fleet(prefix="volunteer-bench-footprint-") as fleet:
        report["volunteers"] = {name: volunteer_memory(fleet, name, args.train_s) for name in args.runs}
    report["machine"] = machine_notes()
    return finish(report, "footprint", started, args)


def _parser() -> argparse.ArgumentParser:
    parser = common_parser("footprint", __doc__)
    parser.add_argument("--runs", nargs="+", default=["digits-mlp", "llm-tiny"], help="runs to start a swarm of")
    parser.add_argument("--host-runs", nargs="+", default=["digits-mlp", "llm-tiny", "llm-small"],
                        help="runs whose stages are trained in-process for host_bytes")
    parser.add_argument("--train-s", type=float, default=30.0, help="training before the volunteer is measured")
    parser.add_argument("--quick", action="store_true", help="digits only, 3 s of training: a smoke test")
    return parser


# ----- host bytes per stage parameter, in-process


def host_bytes(name: str) -> dict[str, Any]:
    import torch

    from swarm.integrity.heal import Healer
    from swarm.integrity.snapshots import SnapshotStore
    from swarm.integrity.weights import RING_COPIES
    from swarm.pipeline.stage.worker import StageWorker
    from swarm.run.memory import held_bytes, host_memory
    from swarm.run.models import stage_input_spec, target_spec
    from volunteer.config import load_run

    run, _ = load_run(name)
    out: dict[str, Any] = {}
    folder = tempfile.mkdtemp(prefix="volunteer-bench-footprint-")
    gen = torch.Generator().manual_seed(0)
    high = run.model.vocab_size if run.model.kind == "llama" else run.model.num_classes
    for index in range(run.model.stages):
        say(f"host bytes: {name} layer{index}: building and training the stage in-process")
        worker = StageWorker(run, index)
        worker.ring.keep_s = float("inf")  # the ring fills to its memory bound however slow the updates here
        # healing's snapshots in files, as a volunteer keeps them (swarm/integrity/snapshots.py)
        healer = Healer(worker, notify=lambda *a: None, store=SnapshotStore(Path(folder)))
        expected = host_memory(run, index)
        version_bytes = max(1, int(expected.ring_copies_bytes / RING_COPIES))
        steps = min(400, max(6, int(expected.ring_bytes / version_bytes) + 2))
        batch = 2
        for i in range(steps):
            x = stage_input_spec(run.model, index).example(batch, gen, high=high)
            if worker.is_last:
                worker.forward_backward(f"m{i}", x, target_spec(run.model).example(batch, gen, high=high))
            else:
                y = worker.forward(f"m{i}", x)
                worker.backward(f"m{i}", 1e-3 * torch.randn(y.shape, generator=gen), None, None)
            if i in (1, steps - 2):
                healer.take_snapshot()
        healer.store.settle()
        held = held_bytes(worker, healer)
        on_disk = sum(f.stat().st_size for f in healer.store.directory.glob("*.pt"))
        out[f"layer{index}"] = {
            "params": expected.params,
            "per_param": round((held - expected.fixed_bytes) / expected.params, 2),
            "estimate_per_param": round(expected.per_param, 2),
            "fixed_mib": round(expected.fixed_bytes / MIB, 1),
            "measured_mib": round(held / MIB, 1),
            "measured_vs_estimate": round(held / expected.total_bytes, 3),
            "versions_kept": len(worker.ring),
            "snapshots_on_disk_mib": round(on_disk / MIB, 1),
            "disk_vs_estimate": round(on_disk / expected.disk_bytes, 3),
        }
        healer.close()
        del worker, healer
    shutil.rmtree(folder, ignore_errors=True)
    return out


# ----- a volunteer's RSS over the floor, and its CPU to online


def memory_kib(pid: int) -> dict[str, int]:
    """smaps_rollup of one process in KiB: Rss, Pss, Anonymous, and VmHWM (its peak RSS) from status; 0s once gone."""
    try:
        text = (Path("/proc") / str(pid) / "smaps_rollup").read_text()
        status = (Path("/proc") / str(pid) / "status").read_text()
    except OSError:
        return {"Rss": 0, "Pss": 0, "Anonymous": 0, "VmHWM": 0}
    fields = {line.split(":")[0]: int(line.split()[1]) for line in text.splitlines()[1:] if line.endswith("kB")}
    peak = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)
    return {**{key: fields.get(key, 0) for key in ("Rss", "Pss", "Anonymous")}, "VmHWM": peak}


def _floor(fleet: Fleet) -> dict[str, float]:
    proc = fleet.start("floor", [sys.executable, "-c", FLOOR_CODE], stdin_pipe=True)
    wait_until(lambda: proc.check_running() or "ready" in proc.stdout(), START_TIMEOUT_S, "import torch, hivemind")
    time.sleep(0.5)
    kib = memory_kib(proc.pid)
    proc.stop()
    return {"rss_mib": kib["Rss"] / 1024, "pss_mib": kib["Pss"] / 1024, "anon_mib": kib["Anonymous"] / 1024}


def _online_cpu(procs: dict[str, Proc]) -> dict[str, float]:
    """Poll every volunteer until it says "online in"; its python process's CPU seconds at that moment."""
    cpu: dict[str, float] = {}

    def all_online() -> bool:
        for swarm, proc in procs.items():
            proc.check_running()
            if swarm not in cpu and any(line.get("type") == "event" and
                                        str(line.get("text", "")).startswith("online in ") for line in proc.json_lines()):
                cpu[swarm] = process_cpu_seconds(proc.pid)
        return len(cpu) == len(procs)

    wait_until(all_online, START_TIMEOUT_S, "every volunteer to come online", interval_s=0.02)
    return cpu


def volunteer_memory(fleet: Fleet, name: str, train_s: float) -> dict[str, Any]:
    import yaml

    from swarm.run.memory import host_memory

    floor = _floor(fleet)
    config = yaml.safe_load((RUNS_DIR / f"{name}.yaml").read_text())
    config["name"] = f"footprint-{name}"
    run_path = write_run(fleet.workdir / f"{name}.yaml", config)
    run = load_run_config(run_path)
    bootstrap, maddr = fleet.bootstrap()
    say(f"volunteers: {name}: {run.model.stages} volunteers joining")
    started = time.monotonic()
    procs = {f"layer{k}": fleet.join(f"{name}-layer{k}", run_path, f"layer{k}", maddr)
             for k in range(run.model.stages)}
    try:
        cpu = _online_cpu(procs)
        all_online_s = time.monotonic() - started
        say(f"volunteers: {name}: all online after {all_online_s:.1f} s; training {train_s:.0f} s")
        deadline = time.monotonic() + train_s
        samples = []  # layer1's RSS every 0.5 s over the second half of the training (its working set moves a lot)
        while time.monotonic() < deadline:
            for proc in procs.values():
                proc.check_running()
            if deadline - time.monotonic() < train_s / 2:
                samples.append(memory_kib(procs["layer1"].pid)["Rss"] / 1024)
            time.sleep(0.5)
        layer1 = procs["layer1"]
        kib = memory_kib(layer1.pid)
        samples.append(kib["Rss"] / 1024)
        helpers = {pid: memory_kib(pid)["Rss"] / 1024 for pid in tagged_pids(fleet.tag)
                   if pid not in {p.pid for p in procs.values()} and pid != bootstrap.pid}
    finally:
        fleet.stop([procs["layer0"]])
        fleet.stop([p for swarm, p in procs.items() if swarm != "layer0"])
    try:  # a volunteer's next start: its identity's work and its checkpoint are kept (the first start proves the work)
        again = fleet.join(f"{name}-layer1-again", run_path, "layer1", maddr)
        restart_cpu = _online_cpu({"layer1": again})["layer1"]
        fleet.stop([again])
    finally:
        fleet.stop([bootstrap])
    params = host_memory(run, 1).params
    rss = median(samples)
    allowance = ALLOWANCE_FIXED_MIB + ALLOWANCE_PER_PARAM * params / MIB
    return {
        "layer1_params": params,
        "layer1_rss_mib": round(rss, 1),  # the median of the samples
        "layer1_rss_range_mib": [round(min(samples), 1), round(max(samples), 1)],
        "layer1_pss_mib": round(kib["Pss"] / 1024, 1),
        "layer1_anon_mib": round(kib["Anonymous"] / 1024, 1),
        "layer1_peak_rss_mib": round(kib["VmHWM"] / 1024, 1),
        "floor_rss_mib": round(floor["rss_mib"], 1),
        "floor_anon_mib": round(floor["anon_mib"], 1),
        "over_floor_mib": round(rss - floor["rss_mib"], 1),
        "allowance_mib": round(allowance, 1),
        "within_allowance": rss - floor["rss_mib"] <= allowance,
        "cpu_to_online_s": {k: round(v, 2) for k, v in cpu.items()},
        "cpu_to_online_median_s": round(median(list(cpu.values())), 2),
        "restart_cpu_to_online_s": round(restart_cpu, 2),  # layer1 again, as a volunteer's later starts are
        "all_online_s": round(all_online_s, 1),
        "helper_processes_rss_mib": round(sum(helpers.values()), 1),
    }


if __name__ == "__main__":
    sys.exit(main())
