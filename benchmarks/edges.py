"""The edge modes in the real swarm: accuracy of each averaging mode on label-skewed data.

    python -m benchmarks.edges --json [--quick] [--classes-per-shard 8 4] [--modes pdmm_isvr none ...]
                              [--per-swarm 4] [--graph random] [--demo-s 60]

prints one JSON object (progress goes to stderr). For each skew and each mode, ``volunteer demo --run
digits-ecl --per-swarm N`` (2 swarms x N peers, default 2, real processes on 127.0.0.1; the run with only
``averaging.mode``, ``averaging.graph.kind`` and ``data.classes_per_shard`` changed, and ``data.shards``
set to N so that each layer0 peer trains on its own classes only) trains for a fixed time, then its final test
accuracy is divided by the accuracy of ``swarm.run.local.train_local`` (one process, all the data, the same
model, optimizer and batch size) after the same number of samples: ``ratio`` 1.0 means the swarm
learned as well per sample as one machine with all the data. ``none`` (no averaging: every copy
trains on what reaches it) and ``dpwa`` (pulls, clock interpolation) are our baselines; every mode
uses the same plain SGD (the edge modes require it), so only the averaging differs.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks.common import finish, machine_notes, parser as common_parser, ratio, say, wait_until, write_run
from benchmarks.fleet import Fleet

MODES = ("none", "dpwa", "dsgd", "pdmm_isvr", "admm_isvr")
PER_SWARM = 2  # peers per swarm by default (all layer0 peers drive, each on its own shard)
FULL = {"demo_s": 45.0}
QUICK = {"demo_s": 20.0}
GRACE_S = 120.0  # a demo's start-up and shutdown beyond its time limit


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    settings = dict(QUICK if args.quick else FULL)
    if args.demo_s:
        settings["demo_s"] = args.demo_s
    modes = tuple(args.modes or (("none", "pdmm_isvr") if args.quick else MODES))
    skews = tuple(args.classes_per_shard or ((8,) if args.quick else (8, 5)))
    started = time.monotonic()
    report: dict[str, Any] = {"machine": machine_notes(), "demo_s": settings["demo_s"], "per_swarm": args.per_swarm,
                              "graph": args.graph}
    with Fleet(prefix="volunteer-bench-edges-") as fleet:
        for classes in skews:
            rows = {mode: _demo(fleet, mode, classes, settings["demo_s"], args.per_swarm, args.graph)
                    for mode in modes}
            report[f"classes_per_shard_{classes}"] = rows
            report[f"ratio_classes_{classes}"] = {mode: row.get("ratio") for mode, row in rows.items()}
    return finish(report, "edges", started, args)


def _parser() -> argparse.ArgumentParser:
    parser = common_parser("edges", __doc__, "two modes, one skew, short demos: a smoke test")
    parser.add_argument("--modes", nargs="+", choices=MODES, help=f"default: all ({', '.join(MODES)})")
    parser.add_argument("--classes-per-shard", nargs="+", type=int,
                        help="skews to run (default: 8, and 5: the two peers hold disjoint halves of the classes)")
    parser.add_argument("--per-swarm", type=int, default=PER_SWARM, help=f"peers per swarm (default {PER_SWARM})")
    parser.add_argument("--graph", choices=["ring", "double_ring", "random"], default="ring",
                        help="the edge modes' graph (default ring)")
    parser.add_argument("--demo-s", type=float, help="seconds each demo trains (default 45, --quick 20)")
    return parser


def _demo(fleet: Fleet, mode: str, classes: int, demo_s: float, per_swarm: int, graph: str) -> dict[str, Any]:
    import yaml

    from swarm.run.local import train_local
    from swarm.run.runconfig import RunConfig
    from volunteer.config import load_run

    run, _ = load_run("digits-ecl")
    config = run.model_dump(mode="json")
    config["name"] = f"edges-{mode.replace('_', '-')}-{classes}-{per_swarm}-{graph.replace('_', '-')}"
    config["averaging"]["mode"] = mode
    config["averaging"]["graph"]["kind"] = graph
    config["data"]["classes_per_shard"] = classes
    config["data"]["shards"] = per_swarm  # one shard per layer0 peer: nobody covers another's classes
    path = write_run(fleet.workdir / f"{config['name']}.yaml", config)
    say(f"{mode}, {classes} classes per shard, {graph}: demo of 2 swarms x {per_swarm} peers for {demo_s:.0f} s")
    demo = fleet.volunteer(f"demo-{config['name']}", "demo", "--run", str(path), "--per-swarm", str(per_swarm),
                           "--json",
                           "--target-accuracy", "1.0", "--time-limit-s", str(demo_s))
    wait_until(lambda: demo.popen.poll() is not None, demo_s + GRACE_S, f"the {mode} demo to finish", interval_s=1.0)
    lines = demo.json_lines()
    if not lines or lines[-1].get("test_accuracy") is None:
        return {"error": "the demo published no evaluation", "log": demo.stderr()[-800:]}
    result = lines[-1]
    local = train_local(RunConfig.model_validate(yaml.safe_load(path.read_text())), int(result["samples"]))
    say(f"{mode}: swarm {result['test_accuracy']:.3f} vs local {local.accuracy:.3f} after {result['samples']} samples")
    return {"ratio": ratio(result["test_accuracy"], local.accuracy), "swarm": result["test_accuracy"],
            "local": local.accuracy, "samples": result["samples"], "seconds": result["seconds"],
            "lost_microbatches": result["lost_microbatches"]}


if __name__ == "__main__":
    raise SystemExit(main())
