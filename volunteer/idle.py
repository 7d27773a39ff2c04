"""Is the user at this machine, and is it busy with something else? What the node and the doctor call.

The thin I/O half of the idle policy (``policy.decide`` is the pure half): ``IdleObserver`` gathers
one ``policy.Observation`` per poll from the idle sources (idlesources.py: logind, X, terminals) and
from other programs' CPU and GPU use and the battery (busy.py); ``probe_sources`` says what works on
this machine for `volunteer doctor`. A desktop nobody can measure, or a machine with no idle source
(macOS, Windows for now), makes the idle time unknown rather than "idle", and the policy follows
``idle.run_when_idle_unknown`` (default: stay paused, and say why): we never train under a working
user's hands.

The sources' and meters' names are importable from here too, where the node and the tests have
always found them.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from volunteer.busy import (  # noqa: F401  (re-exported: importers of volunteer.idle)
    CPU_PROBE_S, CpuSample, OtherCpuMeter, gpu_reading, on_battery, other_cpu_percent, other_cpu_percent_between,
    own_tree_cpu_s, own_tree_pids, read_cpu_sample,
)
from volunteer.idlesources import (  # noqa: F401  (re-exported: importers of volunteer.idle)
    BLIND_DESKTOP_DETAIL, COMMAND_TIMEOUT_S, LOGIND, NO_SOURCE_DETAIL, TTY, X11, CommandFailed, IdleReading,
    IdleSource, Runner, combine_readings, default_sources, local_displays, logind_from_sessions, logind_reading,
    parse_property_blocks, query_x_idle_ms, run_command, tty_reading, x11_reading,
)
from volunteer.policy import Observation, format_duration

SOURCE_RETRY_S = 30.0  # a source that does not work here is asked again this often, not every poll
GPU_POLL_S = 10.0  # nvidia-smi costs ~50 ms of CPU: ask less often than the idle sources


@dataclass(frozen=True, slots=True)
class SourceReport:
    """One line of `volunteer doctor`."""

    name: str
    works: bool
    detail: str


class IdleObserver:
    """Gathers one ``Observation`` per call: cheap enough for every ``policy.POLL_INTERVAL_S``.

    A source that does not work here is asked again only every ``SOURCE_RETRY_S`` (its last
    reading stands meanwhile); nvidia-smi only every ``GPU_POLL_S`` and only if ``watch_gpu``.
    """

    def __init__(
        self,
        own_pids: Sequence[int] = (),
        *,
        watch_gpu: bool = False,
        sources: Sequence[IdleSource] | None = None,
        cpu_meter: OtherCpuMeter | None = None,
        battery: Callable[[], bool | None] = on_battery,
        gpu: Callable[[Iterable[int]], tuple[bool | None, str]] = gpu_reading,
        wall_clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ):
        self._own_pids = list(own_pids) or [os.getpid()]
        self._watch_gpu = watch_gpu
        self._sources = list(default_sources() if sources is None else sources)
        self._cpu_meter = cpu_meter or OtherCpuMeter()
        self._battery, self._gpu = battery, gpu
        self._wall_clock, self._monotonic = wall_clock, monotonic
        self._unavailable: dict[int, tuple[float, IdleReading]] = {}  # source index -> (retry at, reading)
        self._gpu_busy: bool | None = None
        self._gpu_read_at_s = -math.inf

    def observe(self) -> Observation:
        now_s = self._wall_clock()
        user_idle_s, idle_detail = combine_readings(self.readings(now_s))
        local = time.localtime(now_s)
        return Observation(
            user_idle_s=user_idle_s,
            local_time_of_day_s=local.tm_hour * 3600 + local.tm_min * 60 + local.tm_sec,
            other_cpu_percent=self._cpu_meter.sample(self._own_pids),
            on_battery=self._battery(),
            other_gpu_busy=self._read_gpu(),
            idle_detail=idle_detail,
        )

    def readings(self, now_s: float) -> list[IdleReading]:
        readings = []
        for index, source in enumerate(self._sources):
            retry_at_s, cached = self._unavailable.get(index, (-math.inf, None))
            if cached is not None and self._monotonic() < retry_at_s:
                readings.append(cached)
                continue
            reading = source(now_s)
            if reading.idle_s is None:
                self._unavailable[index] = (self._monotonic() + SOURCE_RETRY_S, reading)
            else:
                self._unavailable.pop(index, None)
            readings.append(reading)
        return readings

    def _read_gpu(self) -> bool | None:
        if self._watch_gpu and self._monotonic() - self._gpu_read_at_s >= GPU_POLL_S:
            self._gpu_read_at_s = self._monotonic()
            self._gpu_busy, _ = self._gpu(self._own_pids)
        return self._gpu_busy


def probe_sources(
    sources: Sequence[IdleSource] | None = None,
    own_pids: Sequence[int] = (),
    runner: Runner = run_command,
    cpu_probe_s: float = CPU_PROBE_S,
) -> list[SourceReport]:
    """What works on this machine, for `volunteer doctor` (takes about cpu_probe_s)."""
    own_pids = list(own_pids) or [os.getpid()]
    sources = default_sources(runner) if sources is None else sources
    readings = [source(time.time()) for source in sources]
    reports = [SourceReport(r.source, r.idle_s is not None, r.detail) for r in readings]
    if not sources:
        reports.append(SourceReport("idle", False, f"no idle source on {sys.platform}"))
    idle_s, detail = combine_readings(readings)
    verdict = detail if idle_s is None else f"user away for {format_duration(idle_s)}"
    if idle_s == math.inf:
        verdict = "nobody is using this machine"
    reports.append(SourceReport("user idle time", idle_s is not None, verdict))
    cpu_percent = other_cpu_percent(own_pids, cpu_probe_s)
    cpu_detail = "cannot measure" if cpu_percent is None else f"other programs use {cpu_percent:.0f}% CPU"
    reports.append(SourceReport("other cpu", cpu_percent is not None, cpu_detail))
    battery = on_battery()
    battery_detail = {None: "no battery (or unknown)", True: "on battery", False: "on mains power"}[battery]
    reports.append(SourceReport("battery", battery is not None, battery_detail))
    gpu_busy, gpu_detail = gpu_reading(own_pids, runner)
    reports.append(SourceReport("gpu", gpu_busy is not None, gpu_detail))
    return reports
