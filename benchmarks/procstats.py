"""What a benchmark reads of a process from /proc: its CPU seconds, its resident set, its kind (a volunteer, its DHT
process, p2pd, other) and command line. Pure readers: a process that is gone reads as 0 CPU, no RSS, "?"."""

from __future__ import annotations

import os
from pathlib import Path


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of one process from /proc (0 if it is gone)."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_rss_mib(pid: int) -> float | None:
    """A process's resident set in MiB from /proc (None if it is gone)."""
    try:
        for line in (Path("/proc") / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def cpu_used(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds between two snapshots by kind, and "total", over the processes alive at both."""
    out = {"volunteer": 0.0, "dht": 0.0, "p2pd": 0.0, "other": 0.0}
    for pid, (kind, seconds) in after.items():
        if pid in before:
            out[kind] += max(0.0, seconds - before[pid][1])
    out["total"] = sum(out.values())
    return out


def process_kind(pid: int, fleet_pids: list[int], servers: tuple[int, ...] = ()) -> str:
    """"volunteer", "dht" (hivemind's DHT process, forked from a volunteer), "p2pd" or "other"; ``servers``: fork
    servers' pids (their children are volunteers, with the server's command line)."""
    line = cmdline(pid)
    if "p2pd" in line.split(" ", 1)[0]:
        return "p2pd"
    if "volunteer_cli" not in line or pid in servers:  # a fork server imports, then idles
        return "other"
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
        parent = int(stat[stat.rfind(")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return "other"
    if parent in servers:  # forked from the fork server: its command line is the server's
        return "volunteer"
    # hivemind forks the DHT process from the volunteer process: same command line, a tagged parent
    return "dht" if parent in fleet_pids and cmdline(parent) == line else "volunteer"


def cmdline(pid: int) -> str:
    """Its command line, arguments joined by spaces ("?" if it is gone)."""
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"
