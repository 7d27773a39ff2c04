"""The second half of benchmarks.gpu_check: the run's stages as a real local swarm (a bootstrap peer and one
``volunteer join`` per stage on loopback, every one on the machine's default device: all on the one GPU where
there is one), its training samples per second over those of the same stages run one after another in one
process (the per-stage figures the first half measured), and over the slowest stage alone (what a perfect
pipeline would reach).

The run is the checked run with the shipped byte corpus (llm-tiny's data block: nothing to download), evaluation
off and a short heartbeat: what is timed is training.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import load_run_config, ratio, say, write_run
from benchmarks.fleet import Fleet
from benchmarks.pipeline_configs import NO_EVALUATION_S, RUNS_DIR
from benchmarks.pipeline_swarm import START_TIMEOUT_S, join_all, measure, stop_in_order, wait_training

HEARTBEAT_S = 2.0


def swarm_run(name: str, batch_size: int | None) -> dict[str, Any]:
    """Run ``name`` (a shipped run, or a run YAML's path) on the shipped corpus (llm-tiny's data), evaluation off,
    a short heartbeat."""
    path = Path(name).expanduser() if name.endswith((".yaml", ".yml")) else RUNS_DIR / f"{name}.yaml"
    config = yaml.safe_load(path.read_text())
    name = config.get("name", path.stem)
    config["data"] = yaml.safe_load((RUNS_DIR / "llm-tiny.yaml").read_text())["data"]
    config["training"]["eval_every_s"] = NO_EVALUATION_S
    if batch_size:
        config["training"]["batch_size"] = batch_size
    config.setdefault("timeouts", {})["heartbeat_s"] = HEARTBEAT_S
    config["name"] = f"gpu-check-{name}"
    return config


def in_sequence_samples_per_s(stages: list[dict[str, Any]], batch: int) -> tuple[float, float]:
    """Samples/s of the stages run one after another by one process, and of the slowest stage alone."""
    per_mb = [s["step_s"] / s["micro_batches_per_step"] for s in stages]
    return batch / sum(per_mb), batch / max(per_mb)


class GpuUtilisation:
    """The GPU's utilisation (NVML, through torch) every 0.5 s while the block runs: how much of the time a kernel ran
    (session 30: 0-33 %, ~10 % on average, before the float16 fix). None where there is no GPU or no NVML."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="gpu-utilisation", daemon=True)

    def __enter__(self) -> "GpuUtilisation":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _sample(self) -> None:
        try:
            import torch

            if not torch.cuda.is_available():
                return
            while not self._stop.wait(self.interval_s):
                self.samples.append(float(torch.cuda.utilization(0)))
        except Exception as exc:  # no NVML (pynvml / nvidia-ml-py): the figure is absent, the run goes on
            say(f"swarm: GPU utilisation not read ({exc.__class__.__name__}: {exc})")

    def summary(self) -> dict[str, float] | None:
        if not self.samples:
            return None
        return {"mean": round(sum(self.samples) / len(self.samples), 1), "max": max(self.samples),
                "samples": len(self.samples)}


def last_data_plane(lines: list[dict[str, Any]], now: float) -> dict[str, Any] | None:
    """How a driver's micro-batches travelled ("stage to stage 96%"; a relayed hop crosses the driver twice), from
    its last summary line of `--log-format json` (one every 30 s, volunteer/eventlog.py), with its age."""
    said = [line for line in lines if line.get("type") == "summary" and line.get("data_plane")]
    return None if not said else {"said": said[-1]["data_plane"], "age_s": round(now - said[-1]["time"], 1)}


def swarm_throughput(name: str, batch_size: int | None, stages: list[dict[str, Any]], warmup_s: float,
                     window_s: float) -> dict[str, Any]:
    from hivemind.dht.crypto import RSASignatureValidator

    from swarm.dht.membership import Membership

    with Fleet(prefix="volunteer-gpu-check-", keep_workdir=bool(os.environ.get("VOLUNTEER_BENCH_KEEP"))) as fleet:
        run_path: Path = write_run(fleet.workdir / "swarm.yaml", swarm_run(name, batch_size))
        run = load_run_config(run_path)
        say(f"swarm: a bootstrap peer and {run.model.stages} volunteers of {run.run_id} (work dir {fleet.workdir})")
        _, maddr = fleet.bootstrap()
        reader = fleet.dht([maddr], [RSASignatureValidator()], client_mode=True)
        procs = join_all(fleet, run_path, maddr, run.model.stages, 1, "gpu")
        flat = [p for group in procs.values() for p in group]
        try:
            membership = Membership(reader, run, b"")
            wait_training(membership, run.model.stages, 1, flat, START_TIMEOUT_S)
            say(f"swarm: training; {warmup_s:g} s of warm-up, then a {window_s:g} s window")
            with GpuUtilisation() as utilisation:
                swarm = measure(fleet, membership, flat, warmup_s, window_s)
            swarm["gpu_utilisation_percent"] = utilisation.summary()
            swarm["data_plane"] = last_data_plane(procs["layer0"][0].json_lines(), time.time())
        except BaseException:
            for proc in flat:  # what the volunteers said is the only clue to a failure on a machine given back
                say(f"swarm: {proc.name} stderr tail: {proc.stderr()[-2000:]}")
            raise
        finally:
            stop_in_order(fleet, procs)
    batch = run.training.batch_size
    sequence, slowest = in_sequence_samples_per_s(stages, batch)
    return {"run": run.run_id, "batch_size": batch, "in_flight": run.training.in_flight, "pipeline": swarm,
            "stages_in_sequence_samples_per_s": round(sequence, 3), "slowest_stage_samples_per_s": round(slowest, 3),
            "swarm_vs_stages_in_sequence": ratio(swarm["samples_per_s"], sequence),
            "swarm_vs_slowest_stage": ratio(swarm["samples_per_s"], slowest)}
