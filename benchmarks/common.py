"""Shared by the benchmarks: statistics, the JSON report and its flags, bounded waits, run configs.

The processes a benchmark starts (and their reaping) are in benchmarks/fleet.py, which imports this
module; this module imports nothing of fleet.py, so the arrow runs one way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class BenchmarkError(RuntimeError):
    """A benchmark could not measure what it set out to; the message says what went wrong."""


# ----- statistics


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100]."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (position - low))


def ratio(numerator: float, denominator: float) -> float | None:
    if denominator is None or numerator is None or denominator <= 0 or denominator != denominator:
        return None
    return numerator / denominator


def rounded(value: Any, digits: int = 4) -> Any:
    """Round every float in a nested structure (for compact JSON)."""
    if isinstance(value, float):
        return round(value, digits) if value == value else None
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v, digits) for v in value]
    return value


def machine_notes() -> dict[str, Any]:
    """What the numbers depend on: cores, load (others' processes on a shared machine), versions."""
    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "loadavg_1m": round(load[0], 2),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def emit(report: dict[str, Any], as_json: bool) -> None:
    """The benchmark's result on stdout: one JSON line with --json, indented JSON otherwise."""
    print(json.dumps(rounded(report), indent=None if as_json else 2), flush=True)


def parser(module: str, doc: str | None, quick_help: str | None = None) -> argparse.ArgumentParser:
    """The flags every benchmark takes: --json, and --quick (a smoke test) where it has one."""
    out = argparse.ArgumentParser(prog=f"python -m benchmarks.{module}", description=doc,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    out.add_argument("--json", action="store_true", help="print the result as one line of JSON")
    if quick_help is not None:
        out.add_argument("--quick", action="store_true", help=quick_help)
    return out


def finish(report: dict[str, Any], module: str, started: float, args: argparse.Namespace) -> int:
    """Stamp the end of a run (load, duration, quick or not) on ``report``, print it, return 0."""
    if "machine" in report:
        report["machine"]["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    report["benchmark_s"] = time.monotonic() - started
    if hasattr(args, "quick"):
        report["quick"] = args.quick
    say(f"benchmarks.{module}: {report['benchmark_s']:.0f} s")
    emit(report, args.json)
    return 0


def say(text: str) -> None:
    """Progress goes to stderr so stdout stays machine-readable."""
    print(f"{time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)


# ----- waiting


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.2) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise BenchmarkError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


# ----- run configs


def write_run(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def load_run_config(path: Path) -> Any:
    from swarm.run.runconfig import RunConfig

    return RunConfig.model_validate(yaml.safe_load(path.read_text()))



# ----- penalties in the volunteers' logs

# What a volunteer logs when it holds a peer off: with no attacker in a run, every line is a penalty on an
# honest peer (issue 28: skewed data must never look like an attack). Timeouts are counted apart: holding off
# a peer that did not answer in time is no accusation.
PENALTY_LINES: dict[str, re.Pattern[str]] = {
    "stage_bans": re.compile(r"banned peer \w{8} for"),  # a stage bans a driver (strikes)
    "bad_reply": re.compile(r"bad \w+ reply from"),  # a driver holds off a stage whose reply failed a check
    "bad_author": re.compile(r"computed a tensor a stage refused"),  # a driver holds off a tensor's author
    # outvoted by two other peers and held off (not "peers A and B computed different outputs ...": said, no penalty)
    "spot_check": re.compile(r"spot check at layer\d+: peer \w+ computed an output (\(\w+\) )?two other peers disagree "
                             r"with; not using"),
    "stage0_spot_check": re.compile(r"refused a micro-batch of driver \w+: spot check|layer0 peer \w+: spot check"),
    "eval_outlier": re.compile(r"evaluated far from the others"),  # outvoted in an evaluation
    "averaging_rejected": re.compile(r"rejected \w{8}: "),  # a pulled copy refused as an outlier
    "edge_rejected": re.compile(r"rejected an edge message from"),  # an edge mode's message refused
}
TIMEOUT_LINE = re.compile(r"timed out; banned for")


def count_penalties(texts: list[str]) -> dict[str, int]:
    """How often each kind of penalty appears in these logs (``timeouts`` apart, not a penalty), and ``total``."""
    joined = "\n".join(texts)
    counts = {kind: len(pattern.findall(joined)) for kind, pattern in PENALTY_LINES.items()}
    counts["total"] = sum(counts.values())
    counts["timeouts"] = len(TIMEOUT_LINE.findall(joined))
    return counts


@contextlib.asynccontextmanager
async def p2p_pair() -> AsyncIterator[tuple[Any, Any]]:
    """Two of hivemind's P2P daemons on 127.0.0.1, the second connected to the first: ``(server, client)``, both
    shut down on the way out (benchmarks that time one RPC path, and the tests of the stream transport)."""
    from hivemind.p2p import P2P

    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        client = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                  initial_peers=[str(m) for m in await server.get_visible_maddrs()])
        try:
            yield server, client
        finally:
            await client.shutdown()
    finally:
        await server.shutdown()


def apply_overrides(config: dict[str, Any], assignments: list[str]) -> None:
    """``section.field=value`` (YAML value) into a cell's run config: an experiment on one knob, same cells."""
    import yaml

    for assignment in assignments:
        field, sep, value = assignment.partition("=")
        if not sep or not field:
            raise SystemExit(f"--set {assignment!r}: write FIELD=VALUE, e.g. integrity.fair_share_slack=1.2")
        *parents, leaf = field.split(".")
        node = config
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = yaml.safe_load(value)
