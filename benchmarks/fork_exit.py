"""What a child of the fork server pays at its end (volunteer_cli/forkserver_process.py, issue 42: the suite forks
hundreds of processes, the demo one per volunteer).

    python -m benchmarks.fork_exit --json [--children 5] [--quick]

This process imports what the fork server preloads, optionally freezes it as the server does (``gc.freeze``), then
forks children that end at once, each way in turn, and reads each child's CPU from ``wait4``:

- ``finalize``: ``raise SystemExit(0)``, the interpreter's finalization (what every forked child did before
  session 28): the collection of the inherited heap writes to every object's header, so it also copies the pages
  the fork shared;
- ``end_process``: the exit handlers, then ``os._exit`` (``volunteer/hygiene.py``: how a child ends now);
- ``collect``: a full ``gc.collect()`` in the child, unfrozen and frozen (what a child's own full collections cost).

Prints each way's median CPU seconds and ``end_process_vs_finalize`` (measured in session 28: 0.59-1.49 s
against 0.04-0.06 s, the machine's speed varying over the day).
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from typing import Any

from benchmarks.common import finish, machine_notes, parser, ratio, say


def _child_cpu(way: str) -> float:
    """Fork a child that does ``way`` and ends; its CPU seconds (user + system) from wait4."""
    pid = os.fork()
    if pid == 0:
        try:
            if way == "finalize":
                os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nothing the child prints reaches our JSON
                raise SystemExit(0)
            if way == "end_process":
                from volunteer.hygiene import end_process

                end_process(0)
            gc.collect()  # "collect"
        finally:
            if way != "finalize":
                os._exit(0)
    _, _, usage = os.wait4(pid, 0)
    return usage.ru_utime + usage.ru_stime


def measure(children: int) -> dict[str, Any]:
    from volunteer_cli.forkserver_process import _preload

    started = time.process_time()
    _preload()
    say(f"imported what the fork server preloads in {time.process_time() - started:.1f} s of CPU; "
        f"{len(gc.get_objects())} objects tracked")
    ways: dict[str, list[float]] = {"finalize": [], "end_process": [], "collect": [], "collect_frozen": []}
    for _ in range(children):
        for way in ("finalize", "end_process", "collect"):
            ways[way].append(_child_cpu(way))
        gc.freeze()
        ways["collect_frozen"].append(_child_cpu("collect"))
        gc.unfreeze()
    medians = {way: round(statistics.median(cpu), 4) for way, cpu in ways.items()}
    return {"children_per_way": children, "cpu_s": medians, "all_cpu_s": ways,
            "end_process_vs_finalize": ratio(medians["end_process"], medians["finalize"]),
            "collect_frozen_vs_unfrozen": ratio(medians["collect_frozen"], medians["collect"])}


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args_parser = parser("fork_exit", __doc__.split("\n\n")[0], "2 children a way: a smoke test")
    args_parser.add_argument("--children", type=int, default=5, help="children forked per way")
    args = args_parser.parse_args(argv)
    report = measure(2 if args.quick else args.children)
    report["machine"] = machine_notes()
    say(f"a child's CPU at its end: finalize {report['cpu_s']['finalize']:.3f} s, end_process "
        f"{report['cpu_s']['end_process']:.3f} s; a full collection {report['cpu_s']['collect']:.3f} s, frozen "
        f"{report['cpu_s']['collect_frozen']:.3f} s")
    return finish(report, "fork_exit", started, args)


if __name__ == "__main__":
    sys.exit(main())
