"""A foreground `volunteer join` yields to the user: the lowest CPU priority (nice 19) and the idle I/O class.

BOINC runs all its work at idle priority; the systemd unit already does (``Nice=19``,
``IOSchedulingClass=idle`` in service.py). ``lower_priority`` gives a foreground join the same, best
effort: each step that the OS refuses (or that does not exist here) is skipped with a reason, never
fatal. Set ``resources.low_priority: false`` in volunteer.yaml to train at normal priority.
``VOLUNTEER_LOW_PRIORITY=0`` (or 1) overrides the preference for one process tree: the demo, the
tests and the benchmarks set 0, so their figures on a shared machine stay comparable with earlier ones.

On Linux the nice value and the I/O priority belong to each thread, and a new thread or process takes
its creator's: call this before the node starts its threads and its DHT process (they inherit it);
threads that already run are changed one by one through /proc/self/task.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

LOW_PRIORITY_NICE = 19  # the lowest CPU priority, as the unit's Nice=19
ENV_OVERRIDE = "VOLUNTEER_LOW_PRIORITY"  # "0" or "1": overrides resources.low_priority
TASKS_DIR = Path("/proc/self/task")


@dataclass(frozen=True)
class PriorityPlan:
    nice: int | None  # the nice value to set; None: leave it (already as low, or turned off)
    io_idle: bool  # put the process in the idle I/O class (Linux only)


def plan_priority(low_priority: bool, current_nice: int, platform: str = sys.platform) -> PriorityPlan:
    """What to change. Never raises the priority: a nicer process (the systemd unit, `nice volunteer
    join`) stays as nice as it is."""
    if not low_priority:
        return PriorityPlan(nice=None, io_idle=False)
    nice = LOW_PRIORITY_NICE if current_nice < LOW_PRIORITY_NICE else None
    return PriorityPlan(nice=nice, io_idle=platform.startswith("linux"))


def wanted(preference: bool, env: Mapping[str, str]) -> bool:
    """The preference, unless ``VOLUNTEER_LOW_PRIORITY`` says 0 or 1."""
    override = env.get(ENV_OVERRIDE, "").strip()
    return {"0": False, "1": True}.get(override, preference)


def lower_priority(preference: bool) -> list[str]:
    """Apply ``plan_priority`` to this process's threads; returns what it did, or why it could not."""
    low_priority = wanted(preference, os.environ)
    try:
        current = os.getpriority(os.PRIO_PROCESS, 0)
    except (AttributeError, OSError) as exc:  # no getpriority (Windows): nothing to lower with
        return [f"CPU priority unchanged: {exc.__class__.__name__}: {exc}"]
    plan = plan_priority(low_priority, current)
    done: list[str] = []
    if plan.nice is not None:
        done.append(_for_each_thread("CPU priority nice %d" % plan.nice,
                                     lambda tid: os.setpriority(os.PRIO_PROCESS, tid, plan.nice)))
    if plan.io_idle:
        done.append(_for_each_thread("idle I/O class", _io_idle))
    return done


def _thread_ids() -> list[int]:
    try:
        return sorted(int(name) for name in os.listdir(TASKS_DIR))
    except OSError:
        return [0]  # no /proc: this thread only


def _for_each_thread(what: str, apply) -> str:
    tids, failed = _thread_ids(), []
    for tid in tids:
        try:
            apply(tid)
        except Exception as exc:  # best effort: a thread that ended, a refused call; say which
            failed.append(f"{exc.__class__.__name__}: {exc}")
    if failed:
        return f"{what}: not applied to {len(failed)} of {len(tids)} threads ({failed[0]})"
    return what


def _io_idle(tid: int) -> None:
    import psutil

    psutil.Process(tid or os.getpid()).ionice(psutil.IOPRIO_CLASS_IDLE)
