"""A lone copy's referee with one driver and with several: how many of its recomputations get no verdict because the
stage no longer keeps the weights its receipt committed to (session 33).

    python -m benchmarks.lone_referee --json [--drivers 1 2] [--train-s 60] [--in-flight 8] [--quick]

Per driver count, a fresh swarm on loopback: benchmarks.pipeline's heavy run cut to 3 stages (2,048-wide layers, batch
256: a 16 MiB stage, 2 MiB activations), that many layer0 drivers and one peer in each other swarm (a lone copy: its
sampled hops are refereed, swarm/pipeline/control/spot_referee.py), ``--train-s`` of training once every driver
trains. Read from the volunteers' logs at their stop: each driver's referee counts (``refereed``, ``held``,
``unshown``: no verdict, ``convicted``), the unshown ones by which fetch failed ("its weights" or "its forward's
weights" of a forward, backward or forward_backward), each stage's weight ring (versions kept, copies grown on a
referee's ask: swarm/integrity/weights.py ``RING_COPIES_MAX``), and the drivers' checks of pushed hops that found the
hop gone from the stage's outbox. ``unshown_share`` per driver count is the figure: with 3 copies and two drivers it
was 0.36-0.65 (one driver: 0.11), with a ring that grows 0.13-0.41 (benchmarks/README.md, session 33). Beside it
(session 34): ``hidden_holds``, how often a driver held these honest lone copies off as copies that hide their
weights (SpotReferee._hidden: with one driver it must be 0), ``withheld`` (convictions for a pinned version called
gone: must be 0) and ``pins_refused`` (judged updates whose next version the stage would not keep).
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.common import finish, machine_notes, parser as common_parser, say, wait_until
from benchmarks.fleet import Fleet
from benchmarks.pipeline_swarm import sleep_checking, stop_in_order

START_TIMEOUT_S = 240.0
STOP_LINE = re.compile(r"spot checks and referee at the stop: (\{.*\})")
RING_LINE = re.compile(r"online in (layer\d)|weight versions (\{[^}]*\})")
NO_WEIGHTS = re.compile(r"no weights \((its weights|its forward's weights), of its (\w+) at version \d+\)")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.drivers, args.train_s, args.width = [2], 8.0, 256
    started = time.monotonic()
    report: dict[str, Any] = {"runs": {}}
    for drivers in args.drivers:
        with Fleet(prefix="volunteer-bench-lone-referee-", fork=True) as fleet:
            report["runs"][str(drivers)] = one_run(fleet, drivers, args)
    for drivers, run in report["runs"].items():
        report[f"unshown_share_{drivers}_drivers"] = run["unshown_share"]
    report["machine"] = machine_notes()
    return finish(report, "lone_referee", started, args)


def _parser() -> argparse.ArgumentParser:
    parser = common_parser("lone_referee", __doc__, "two drivers, 8 s of training, narrow layers: a smoke test")
    parser.add_argument("--drivers", nargs="+", type=int, default=[1, 2], help="layer0 drivers, one run each")
    parser.add_argument("--train-s", type=float, default=60.0, help="training once every driver trains")
    parser.add_argument("--in-flight", type=int, default=8, help="training.in_flight of the run")
    parser.add_argument("--width", type=int, default=2048, help="the layers' width (2,048: a 16 MiB stage)")
    return parser


def one_run(fleet: Fleet, drivers: int, args: argparse.Namespace) -> dict[str, Any]:
    from hivemind.dht.crypto import RSASignatureValidator

    from benchmarks.pipeline import Settings, _heavy_run
    from swarm.dht.membership import Membership

    settings = Settings(heavy_stages=3, heavy_in_flight=args.in_flight, heavy_width=args.width, heartbeat_s=1.0)
    run_path, run = _heavy_run(fleet, settings)
    _, maddr = fleet.bootstrap()
    reader = fleet.dht([maddr], [RSASignatureValidator()], client_mode=True)
    procs = {"layer0": [fleet.join(f"driver{m}", run_path, "layer0", maddr) for m in range(drivers)],
             "layer1": [fleet.join("layer1", run_path, "layer1", maddr)],
             "layer2": [fleet.join("layer2", run_path, "layer2", maddr)]}
    flat = [p for group in procs.values() for p in group]
    membership = Membership(reader, run, b"")
    say(f"lone referee: {drivers} driver(s), 3 stages of width {args.width}, in_flight {args.in_flight}")

    def training() -> bool:
        for proc in flat:
            proc.check_running()
        views = membership.read_all()
        online = [[r for r in views.get(f"layer{k}", []) if r.state == "online"] for k in range(3)]
        return len(online[0]) == drivers and all(len(rows) == 1 for rows in online[1:]) and \
            all(r.trained > 0 for r in online[0])

    try:
        wait_until(training, START_TIMEOUT_S, f"{drivers} driver(s) training through lone copies", interval_s=1.0)
        say(f"lone referee: training for {args.train_s:.0f} s")
        sleep_checking(args.train_s, flat)
        trained = sum(r.trained for r in membership.read("layer0"))
    finally:
        stop_in_order(fleet, procs)
    out = read_logs(Path(fleet.workdir))
    out["trained_samples"] = trained
    say(f"lone referee: {drivers} driver(s): {out['unshown']} of {out['refereed']} refereed hops without a verdict; "
        f"rings {out['rings']}")
    return out


def read_logs(folder: Path) -> dict[str, Any]:
    """What the volunteers' logs under ``folder`` say at their stop (module docstring)."""
    referees: list[dict[str, Any]] = []
    holds = 0  # lone copies held off for hiding their weights (spot_referee.SpotReferee._hidden): honest ones, here
    rings: dict[str, dict[str, int]] = {}
    failed: Counter[str] = Counter()
    push_misses = 0
    for log in sorted(folder.rglob("join-*.log")):
        swarm = None
        for line in log.read_text(errors="replace").splitlines():
            if (stop := STOP_LINE.search(line)) is not None:
                stats = ast.literal_eval(stop.group(1))
                referees.append(stats.get("referee", {}))
                holds += stats.get("hidden_holds", 0)
            for name, counts in RING_LINE.findall(line):
                swarm = name or swarm
                if counts and swarm is not None:
                    rings[swarm] = ast.literal_eval(counts)
            if (gone := NO_WEIGHTS.search(line)) is not None:
                failed[f"{gone.group(1)} of a {gone.group(2)}"] += 1
            push_misses += "did not show a pushed hop" in line
    refereed = sum(r.get("refereed", 0) for r in referees)
    unshown = sum(r.get("unshown", 0) for r in referees)
    return {
        "refereed": refereed, "held": sum(r.get("held", 0) for r in referees), "unshown": unshown,
        "convicted": sum(r.get("convicted", 0) for r in referees), "hidden_holds": holds,
        "withheld": sum(r.get("withheld", 0) for r in referees),
        "pins_refused": sum(r.get("pins_refused", 0) for r in referees),
        "unshown_share": round(unshown / refereed, 3) if refereed else None,
        "unshown_by_fetch": dict(failed),
        "rings": {swarm: {"kept": c.get("kept"), "grown": c.get("grown", 0)} for swarm, c in sorted(rings.items())},
        "push_check_misses": push_misses,
    }


if __name__ == "__main__":
    sys.exit(main())
