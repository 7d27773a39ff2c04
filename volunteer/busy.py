"""Is this machine busy with something else? Other programs' CPU and GPU use, and the battery.

The node's own process tree never counts as "other": a volunteer must not pause for its own work.
Like the idle sources (idlesources.py), every reading fails soft: None and a reason, never a raise.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import psutil

from volunteer.idlesources import COMMAND_TIMEOUT_S, CommandFailed, Runner, run_command

logger = logging.getLogger(__name__)

CPU_PROBE_S = 0.5


@dataclass(frozen=True, slots=True)
class CpuSample:
    at_s: float  # wall clock
    total_s: float  # CPU time of all CPUs, busy or idle
    busy_s: float
    own_s: Mapping[int, tuple[float, float]]  # our processes: pid -> (create time, CPU time)


def other_cpu_percent_between(previous: CpuSample, current: CpuSample) -> float | None:
    """CPU % of everything but our own processes between two samples (of the whole machine, 0-100)."""
    total_s = current.total_s - previous.total_s
    if total_s <= 0:
        return None
    own_s = 0.0
    for pid, (created_s, cpu_s) in current.own_s.items():
        before = previous.own_s.get(pid)
        if before is not None and before[0] == created_s:
            own_s += cpu_s - before[1]
        elif created_s >= previous.at_s:
            own_s += cpu_s  # born since the previous sample
    busy_s = current.busy_s - previous.busy_s - own_s
    return min(100.0, max(0.0, 100.0 * busy_s / total_s))


def read_cpu_sample(own_pids: Iterable[int]) -> CpuSample:
    times = psutil.cpu_times()
    # Linux counts guest time inside user and nice too
    total_s = sum(times) - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)
    idle_s = times.idle + getattr(times, "iowait", 0.0)
    return CpuSample(at_s=time.time(), total_s=total_s, busy_s=total_s - idle_s, own_s=own_tree_cpu_s(own_pids))


def own_tree_cpu_s(own_pids: Iterable[int]) -> dict[int, tuple[float, float]]:
    own: dict[int, tuple[float, float]] = {}
    for process in _tree(own_pids):
        try:
            with process.oneshot():
                cpu = process.cpu_times()
                own[process.pid] = (process.create_time(), cpu.user + cpu.system)
        except psutil.Error:
            continue  # exited meanwhile
    return own


def own_tree_pids(own_pids: Iterable[int]) -> set[int]:
    return {process.pid for process in _tree(own_pids)}


def _tree(own_pids: Iterable[int]) -> list[psutil.Process]:
    processes = []
    for pid in own_pids:
        try:
            root = psutil.Process(pid)
            processes += [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
    return processes


class OtherCpuMeter:
    """Other programs' CPU % since the previous call (None on the first call); our process tree excluded."""

    def __init__(self, read_sample: Callable[[Iterable[int]], CpuSample] = read_cpu_sample):
        self._read_sample = read_sample
        self._previous: CpuSample | None = None

    def sample(self, own_pids: Iterable[int]) -> float | None:
        current = self._read_sample(own_pids)
        previous, self._previous = self._previous, current
        return None if previous is None else other_cpu_percent_between(previous, current)


def other_cpu_percent(own_pids: Iterable[int], interval_s: float = CPU_PROBE_S) -> float | None:
    """One blocking measurement over interval_s (for `volunteer doctor`); a node keeps an OtherCpuMeter."""
    own_pids = list(own_pids)
    meter = OtherCpuMeter()
    meter.sample(own_pids)
    threading.Event().wait(interval_s)
    return meter.sample(own_pids)


def on_battery(sensors_battery: Callable[[], object] | None = None) -> bool | None:
    """True on battery, False on mains, None without a battery (or when the OS does not say)."""
    sensors_battery = sensors_battery or getattr(psutil, "sensors_battery", None)
    if sensors_battery is None:
        return None
    try:
        battery = sensors_battery()
    except Exception as exc:  # psutil reads odd sysfs files; a broken one must not stop the node
        logger.debug("cannot read the battery: %s", exc)
        return None
    plugged = getattr(battery, "power_plugged", None) if battery is not None else None
    return None if plugged is None else not plugged


def gpu_reading(own_pids: Iterable[int], runner: Runner = run_command) -> tuple[bool | None, str]:
    """Whether a program outside our process tree computes on an NVIDIA GPU (None: cannot tell)."""
    try:
        output = runner(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], COMMAND_TIMEOUT_S)
    except CommandFailed as exc:
        return None, str(exc)
    pids = {int(line) for line in (line.strip() for line in output.splitlines()) if line.isdigit()}
    others = sorted(pids - own_tree_pids(own_pids))
    if others:
        return True, f"other programs on the GPU: pid {', '.join(map(str, others))}"
    return False, "no other program computes on the GPU"
