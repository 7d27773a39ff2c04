"""The shipped runs as pipelines against one process, in samples per CPU-second (the ``configs`` part of
benchmarks.pipeline; issue 29).

For each run of ``configs/runs`` named (digits-mlp, charlm): one ``volunteer join`` per stage on loopback,
the run's own model, data, optimizer, batch and ``in_flight``, with evaluation and averaging left out (a
2 s heartbeat, no evaluation: what is measured is training). Its samples per CPU-second (every process of
the swarm, p2pd and DHT included) over those of the same model, optimizer and batches trained in one
process on one thread (``benchmarks.pipeline_swarm.LocalLoop``, in slices before and after): ``cpu_efficiency_<run>``.
The samples per second of both are reported too (``<run>.pipeline`` / ``<run>.local``), and the swarm's CPU
per micro-batch by process kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import apply_overrides, load_run_config, median, ratio, say, write_run
from benchmarks.fleet import Fleet
from benchmarks.pipeline_swarm import START_TIMEOUT_S, LocalLoop, join_all, measure, stop_in_order, wait_training

RUNS_DIR = Path(__file__).resolve().parents[1] / "configs" / "runs"
NO_EVALUATION_S = 1e6


@dataclass(slots=True, kw_only=True)
class ConfigSettings:
    runs: tuple[str, ...] = ("digits-mlp", "charlm")
    warmup_s: float = 15.0
    window_s: float = 30.0
    heartbeat_s: float = 2.0
    local_slices: int = 3  # before and after the pipeline
    local_slice_s: float = 3.0
    local_warmup_batches: int = 5
    overrides: tuple[str, ...] = ()  # --set: run-config fields of every run measured (e.g. weight prediction off)


QUICK = ConfigSettings(runs=("digits-mlp",), warmup_s=1.0, window_s=2.0, heartbeat_s=0.5, local_slices=1,
                       local_slice_s=0.3, local_warmup_batches=1)


def training_only(name: str, heartbeat_s: float, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """The shipped run ``name`` with evaluation off and a short heartbeat (what is timed is training), and
    ``overrides`` (``section.field=value``) set."""
    config = yaml.safe_load((RUNS_DIR / f"{name}.yaml").read_text())
    apply_overrides(config, list(overrides))
    config["training"]["eval_every_s"] = NO_EVALUATION_S
    config.setdefault("timeouts", {})["heartbeat_s"] = heartbeat_s
    config["name"] = f"bench-{name}"
    return config


def why_stalled(membership: Any, run: Any) -> dict[str, list[dict[str, Any]]]:
    """Each swarm's records where a window trained nothing: stalled seconds, drivers a stage refuses, and why."""
    return {name: [{"peer": r.peer_id[-8:], "state": r.state, "stalled_s": r.stalled_s,
                    "drivers_refused": r.drivers_refused, "ban_reason": r.ban_reason}
                   for r in membership.read(name)] for name in run.swarm_names}


def configs(fleet: Fleet, maddr: str, reader: Any, s: ConfigSettings) -> dict[str, Any]:
    from swarm.dht.membership import Membership

    report: dict[str, Any] = {}
    for name in s.runs:
        run_path = write_run(fleet.workdir / f"{name}.yaml", training_only(name, s.heartbeat_s, s.overrides))
        run = load_run_config(run_path)
        stages = run.model.stages
        say(f"configs: {name}: one process, 1 thread, then {stages} stages")
        loop = LocalLoop(run, s.local_warmup_batches)
        slices = loop.alternate((1,), s.local_slices, s.local_slice_s)
        procs = join_all(fleet, run_path, maddr, stages, 1, name)
        flat = [p for group in procs.values() for p in group]
        membership = Membership(reader, run, b"")
        try:
            wait_training(membership, stages, 1, flat, START_TIMEOUT_S)
            swarm = measure(fleet, membership, flat, s.warmup_s, s.window_s)
            stalled = None if swarm["samples_per_s"] else why_stalled(membership, run)
        finally:
            stop_in_order(fleet, procs)
        slices += loop.alternate((1,), s.local_slices, s.local_slice_s)
        local_cpu = median([x["samples_per_cpu_s"] for x in slices])
        batch = run.training.batch_size
        # a window without a sample (a stalled run) is a figure to report, not a crash that loses the others
        per_mb = {kind: 1000 * used / (swarm["samples_per_s"] / batch) if swarm["samples_per_s"] else None
                  for kind, used in swarm["cpu_cores_by_process"].items()}
        report[f"cpu_efficiency_{name}"] = ratio(swarm["samples_per_cpu_s"], local_cpu)
        report[name] = {
            "pipeline": swarm,
            "local_samples_per_s_1_thread": median([x["samples_per_s"] for x in slices]),
            "local_samples_per_cpu_s_1_thread": local_cpu,
            "local_slices": slices,
            "cpu_ms_per_microbatch": {"local_1_thread": 1000 * batch / local_cpu, "pipeline": per_mb},
            "batch": batch, "in_flight": run.training.in_flight,
        }
        if stalled is not None:  # a stalled run is a finding (a false verdict banned session 17's charlm driver)
            report[name]["stalled"] = stalled
            say(f"configs: {name}: WARNING: the pipeline trained nothing in the window; what its records said: "
                f"{stalled} (VOLUNTEER_BENCH_KEEP=1 keeps the volunteers' logs)")
        say(f"configs: {name}: pipeline {swarm['samples_per_cpu_s']:.0f} samples per CPU-s "
            f"({swarm['samples_per_s']:.0f}/s on {swarm['cpu_cores_used']:.2f} cores), one process {local_cpu:.0f}")
    return report
