"""`volunteer doctor`'s memory checks: what each stage of a run keeps in host memory (swarm/run/memory.py
``host_memory``) and, for a llama run, needs on a GPU (``stage_memory``), from the run config alone, against what this
machine has."""

from __future__ import annotations

from typing import Any

from volunteer_cli.commands.doctor_check import GIB, INFO, MIB, OK, WARN, Check


def memory_checks(run: Any, requested: str, disk_free: int | None = None) -> list[Check]:
    """Every run: the host memory each stage keeps (swarm/run/memory.py ``host_memory``: the live copy on a CPU, the
    guard's copy, healing's snapshots, the referee's weight versions) against the RAM available. Llama runs also:
    each stage's GPU memory from the config (weights, gradients, optimizer state, the guard's copy, activations of
    the micro-batches in flight, CUDA's own) against the GPU's free memory where there is one."""
    checks = host_memory_checks(run, requested, disk_free)
    if run.model.kind != "llama":
        return checks
    import torch

    from swarm.run.memory import stage_memory
    free = None
    if requested != "cpu" and torch.cuda.is_available():
        index = torch.device(requested).index if requested.startswith("cuda") else None
        free = torch.cuda.mem_get_info(index or 0)[0]
    precision = "bf16 autocast" if run.model.mixed_precision == "bf16" else "float32"
    section = f"GPU memory a stage needs ({precision}, batch {run.training.batch_size} x {run.model.seq_len} tokens)"
    for index in range(run.model.stages):
        need, on_cpu = stage_memory(run, index), stage_memory(run, index, cuda=False)
        detail = (f"{need.total_bytes / GIB:.2f} GiB: {need.params / 1e6:.1f} M parameters, weights + gradients "
                  f"{need.weights_bytes / GIB:.2f}, optimizer {need.optimizer_bytes / GIB:.2f}, guard copy "
                  f"{need.guard_bytes / GIB:.2f}, activations {need.activation_bytes / GIB:.2f} x "
                  f"{need.micro_batches} in flight, stashed weights {need.stash_bytes / GIB:.2f}, CUDA "
                  f"{need.overhead_bytes / GIB:.1f}")
        if free is None:
            checks.append(Check(section, f"layer{index}", INFO, f"{detail} (no GPU here: on the CPU, in float32, "
                                                                f"{on_cpu.total_bytes / GIB:.2f} GiB of RAM)"))
        elif need.total_bytes <= free:
            checks.append(Check(section, f"layer{index}", OK, f"{detail}; {free / GIB:.1f} GiB free"))
        else:
            checks.append(Check(section, f"layer{index}", WARN, f"{detail}; more than the {free / GIB:.1f} GiB free: "
                                "set model.activation_checkpointing or a smaller training.batch_size / in_flight "
                                "(a new run), or join with another GPU"))
    return checks


def host_memory_checks(run: Any, requested: str, disk_free: int | None = None) -> list[Check]:
    """Per stage, the host bytes its server keeps (by what the code keeps; tests/test_memory.py measures it), and
    whether the data dir's ``disk_free`` holds healing's snapshot files (swarm/integrity/snapshots.py)."""
    import psutil
    import torch
    from swarm.pipeline.stage.applied import replies_bytes
    from swarm.pipeline.stage.outbox import OUTBOX_MAX_DRIVERS, outbox_bytes
    from swarm.run.memory import host_memory
    from volunteer_cli.commands.common import mib_text as _mib
    gpu = requested != "cpu" and torch.cuda.is_available()
    available = psutil.virtual_memory().available
    section = "Host memory a stage keeps (" + ("on the GPU's host: weight versions" if gpu else
                                               "live copy in float32, weight versions exact") + ")"
    checks = []
    for index in range(run.model.stages):
        need = host_memory(run, index)
        host = need.ring_bytes_gpu if gpu else need.total_bytes
        outbox = outbox_bytes(run, index) + replies_bytes(run, index) if index > 0 else 0  # hops for checks, replies
        detail = (f"{_mib(host + outbox)} MiB: {need.params / 1e6:.2f} M parameters, {host / need.params:.0f} "
                  f"bytes each (live copy {_mib(need.live_bytes)}" + ("" if not gpu else " on the GPU") +
                  f", guard {_mib(need.guard_bytes)} (+{_mib(need.guard_peak_bytes - need.guard_bytes)} "
                  f"one step in 50), weight versions {_mib(host if gpu else need.ring_bytes)} (up to "
                  f"{_mib(need.ring_max(gpu))} as referees ask" + ("" if gpu or not need.stash_max_bytes else
                  f", {_mib(need.stash_max_bytes)} more held for backwards at most" + ("" if not need.predict_bytes
                  else f", {_mib(need.predict_bytes)} of it predicted weights while forwards are in flight")) +
                  f"); healing's snapshots {_mib(need.disk_bytes)} on disk)")
        if outbox:  # it grows with the run's drivers (swarm/pipeline/stage/outbox.py), up to OUTBOX_MAX_DRIVERS
            most = outbox_bytes(run, index, OUTBOX_MAX_DRIVERS) - outbox_bytes(run, index)
            detail += f" + pushed hops and replies kept {_mib(outbox)} (one driver; up to {_mib(most)} more " \
                      f"with {OUTBOX_MAX_DRIVERS} or more)"
        host += outbox
        status = OK if host <= available else WARN
        checks.append(Check(section, f"layer{index}", status, detail + ("" if status == OK else
                            f"; more than the {available / GIB:.1f} GiB available: join a swarm of another layer")))
        if disk_free is not None and need.disk_bytes > disk_free:
            checks.append(Check(section, f"layer{index}", WARN,
                                f"healing's snapshots need {need.disk_bytes / MIB:,.0f} MiB on disk, the data dir has "
                                f"{disk_free / MIB:,.0f} MiB free: they would be kept in memory instead "
                                f"({(host + need.disk_bytes) / MIB:,.0f} MiB in all); free some space or pass "
                                "--data-dir on a larger disk"))
    return checks
