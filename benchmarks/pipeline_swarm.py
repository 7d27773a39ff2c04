"""The parts of a pipeline benchmark that start a real swarm and time it, and the one-process loop it is compared
with: shared by benchmarks/pipeline.py (heavy, scaling) and pipeline_configs.py (the shipped runs), below both (no
import circle between them)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks.common import BenchmarkError, median, ratio, wait_until
from benchmarks.fleet import Fleet, Proc
from benchmarks.procstats import cpu_used

START_TIMEOUT_S = 300.0  # many processes importing torch at once on 2 cores
MEASURE_WINDOWS_MAX = 5  # a throughput window with no updated record is extended this many times at most


def join_all(fleet: Fleet, run_path: Path, maddr: str, stages: int, per_swarm: int, prefix: str,
              env: dict[str, str] | None = None) -> dict[str, list[Proc]]:
    procs: dict[str, list[Proc]] = {}
    for k in range(stages):
        swarm = f"layer{k}"
        procs[swarm] = [fleet.join(f"{prefix}-{swarm}-{m}", run_path, swarm, maddr, env=env) for m in range(per_swarm)]
    return procs


def wait_training(membership: Any, stages: int, per_swarm: int, procs: list[Proc], timeout_s: float) -> None:
    def ready() -> bool:
        for proc in procs:
            proc.check_running()
        views = membership.read_all()
        online = [[r for r in views.get(f"layer{k}", []) if r.state == "online"] for k in range(stages)]
        return all(len(rows) == per_swarm for rows in online) and all(r.trained > 0 for r in online[0])

    wait_until(ready, timeout_s, f"{per_swarm} online peer(s) in each of {stages} swarm(s), all training",
               interval_s=1.0)


def stop_in_order(fleet: Fleet, procs: dict[str, list[Proc]]) -> None:
    """Drivers (layer0) first: a leaving driver finishes its work through the stages still serving."""
    fleet.stop(procs.get("layer0", []))
    fleet.stop([p for swarm, group in procs.items() if swarm != "layer0" for p in group])


def sleep_checking(seconds: float, procs: list[Proc]) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for proc in procs:
            proc.check_running()
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def measure(fleet: Fleet, membership: Any, procs: list[Proc], warmup_s: float, window_s: float) -> dict[str, float]:
    """Samples/s summed over the layer0 drivers, and the fleet's CPU use over the same window."""
    sleep_checking(warmup_s, procs)
    before = {r.peer_id: r for r in membership.read("layer0") if r.state == "online"}
    cpu_before, wall_before = fleet.cpu_snapshot(), time.monotonic()
    # Under load a short window (--quick: 2 s) could end before any new record was read (a read that missed, a
    # heartbeat late): the window is extended, a window at a time, before the benchmark gives up.
    for _ in range(MEASURE_WINDOWS_MAX):
        sleep_checking(window_s, procs)
        after = {r.peer_id: r for r in membership.read("layer0") if r.state == "online"}
        rate, spans = 0.0, []
        for peer_id, b in after.items():
            a = before.get(peer_id)
            if a is None or b.updated_at <= a.updated_at:
                continue
            rate += (b.trained - a.trained) / (b.updated_at - a.updated_at)
            spans.append(b.updated_at - a.updated_at)
        if spans:
            break
        if not before:  # nothing read at the start: the window starts now
            before, cpu_before, wall_before = after, fleet.cpu_snapshot(), time.monotonic()
    cpu = cpu_used(cpu_before, fleet.cpu_snapshot())
    wall_after = time.monotonic()
    if not spans:
        raise BenchmarkError(f"no layer0 record was updated during {MEASURE_WINDOWS_MAX} windows of {window_s:g} s: are "
                             "the heartbeats running?")
    cores = {kind: seconds / (wall_after - wall_before) for kind, seconds in cpu.items()}
    return {"samples_per_s": rate, "cpu_cores_used": cores["total"], "samples_per_cpu_s": ratio(rate, cores["total"]),
            "cpu_cores_by_process": cores, "window_s": median(spans), "drivers": len(spans)}


# ----- efficiency: a compute-heavy pipeline against one process


class LocalLoop:
    """The training loop of swarm.run.local.train_local (same model, optimizer, batches), timed in slices."""

    def __init__(self, run: Any, warmup_batches: int):
        import numpy as np

        from swarm.run.data import MicroBatches, load_dataset
        from swarm.run.local import make_optimizer
        from swarm.run.models import assemble, build_stages

        self.run = run
        data = load_dataset(run.data, run.model)
        self.model = assemble(build_stages(run.model))
        self.optimizer = make_optimizer(self.model.parameters(), run.optimizer)
        self.batches = MicroBatches(data.x_train, data.y_train, np.arange(len(data.x_train)),
                                    run.training.batch_size, 0)
        for _ in range(warmup_batches):
            self._step()

    def _step(self) -> int:
        from swarm.run.models import loss_fn

        x, y = next(self.batches)
        loss = loss_fn(self.run.model, self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return len(x)

    def alternate(self, thread_counts: tuple[int, ...], rounds: int, slice_s: float) -> list[dict[str, float]]:
        """``rounds`` slices of each thread count, alternating (drift on a shared machine hits both alike)."""
        return [self.measure(threads, slice_s) for _ in range(rounds) for threads in thread_counts]

    def measure(self, threads: int, seconds: float) -> dict[str, float]:
        import torch

        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            self._step()  # the first step after a thread change is slower
            samples, wall, cpu = 0, time.perf_counter(), time.process_time()
            while time.perf_counter() - wall < seconds:
                samples += self._step()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        finally:
            torch.set_num_threads(previous)
        return {"threads": threads, "samples_per_s": samples / wall, "samples_per_cpu_s": samples / cpu}
