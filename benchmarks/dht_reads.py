"""The DHT's CPU per volunteer when servers read the other swarms every heartbeat or every fifth one
(issue 15, item 1, first step; benchmarks/README.md finding 7).

Each cell is a fresh run of real `volunteer join` processes (digits MLP cut into ``--stages`` stages,
``--per-swarm`` volunteers in each swarm, heartbeat ``--heartbeat-s``, training as usual) with
``timeouts.others_every_heartbeats`` set to the cell's value (1 = every swarm every heartbeat, the
behaviour before). Once every swarm is online and ``--warmup-s`` has passed, the CPU of every process is
read over ``--window-s`` and split by kind (the volunteers' main processes, their forked DHT processes,
their p2pd daemons).

    python -m benchmarks.dht_reads --json [--every 1,5] [--validators plain,remembering] [--stages 4] [--per-swarm 2]

Prints one JSON object: per cell ``dht_cores_per_volunteer``, ``p2pd_cores_per_volunteer``,
``volunteer_cores_per_volunteer``, ``samples_per_s``, and ``dht_cpu_every5_vs_every1`` (the first cell's
value over the second's), ``dht_cpu_remembering_vs_plain`` (swarm/dht/validators.py: verdicts remembered, at
5) and ``dht_cpu_now_vs_before`` (remembering at 5 over plain at 1).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import finish, machine_notes, parser, ratio, rounded, say, write_run
from benchmarks.fleet import Fleet
from benchmarks.procstats import cpu_used
from benchmarks.staleness import present, wait_online
from swarm.dht.validators import PLAIN_ENV

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hostile import HostilePeer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    started = time.monotonic()
    cells = []
    for validators in args.validators.split(","):
        env = {PLAIN_ENV: "1" if validators == "plain" else "0"}
        for every in (int(v) for v in args.every.split(",")):
            with Fleet(prefix=f"volunteer-dhtreads-{every}-") as fleet:
                _, maddr = fleet.bootstrap()
                say(f"cell validators={validators} others_every_heartbeats={every}")
                cell = _cell(fleet, maddr, every, args, env)
                cell["validators"] = validators
                say(f"cell {validators} {every}: {rounded(cell)}")
                cells.append(cell)
    report: dict[str, Any] = {"cells": cells, "settings": vars(args), "machine": machine_notes()}
    by = {(c["validators"], c["every"]): c["dht_cores_per_volunteer"] for c in cells}
    if ("plain", 1) in by and ("plain", 5) in by:
        report["dht_cpu_every5_vs_every1"] = ratio(by[("plain", 5)], by[("plain", 1)])
    if ("plain", 5) in by and ("remembering", 5) in by:
        report["dht_cpu_remembering_vs_plain"] = ratio(by[("remembering", 5)], by[("plain", 5)])
    if ("plain", 1) in by and ("remembering", 5) in by:
        report["dht_cpu_now_vs_before"] = ratio(by[("remembering", 5)], by[("plain", 1)])
    return finish(report, "dht_reads", started, args)


def _parser() -> Any:
    out = parser("dht_reads", __doc__)
    out.add_argument("--every", default="1,5", help="timeouts.others_every_heartbeats per cell (comma-separated)")
    out.add_argument("--validators", default="plain,remembering", help="hivemind's validators (plain) or ours that "
                     "remember verdicts (swarm/dht/validators.py), per cell")
    out.add_argument("--stages", type=int, default=4)
    out.add_argument("--per-swarm", type=int, default=2)
    out.add_argument("--heartbeat-s", type=float, default=1.0)
    out.add_argument("--warmup-s", type=float, default=10.0)
    out.add_argument("--window-s", type=float, default=30.0)
    return out


def _cell(fleet: Fleet, maddr: str, every: int, args: Any, env: dict[str, str]) -> dict[str, Any]:
    from swarm.run.runconfig import RunConfig

    config = {"name": f"dhtreads-{every}-{int(time.time())}", "model": {"kind": "mlp", "stages": args.stages},
              "training": {"batch_size": 32, "in_flight": 4, "eval_every_s": 10.0},
              "timeouts": {"heartbeat_s": args.heartbeat_s, "others_every_heartbeats": every}}
    run = RunConfig.model_validate(config)
    path = write_run(fleet.workdir / "run.yaml", config)
    counts = {k: args.per_swarm for k in range(args.stages)}
    procs = [fleet.join(f"layer{k}-{m}", path, f"layer{k}", maddr, env=env) for k in counts
             for m in range(args.per_swarm)]
    reader = HostilePeer(run, [maddr], fleet.workdir / "reader.key", process_group=fleet._process_group(),
                         heartbeat_s=args.heartbeat_s)
    try:
        wait_online(reader, counts, procs)
        time.sleep(args.warmup_s)
        trained_before = sum(r.trained for r in present(reader, 0))
        before, t0 = fleet.cpu_snapshot(), time.monotonic()
        time.sleep(args.window_s)
        used, span = cpu_used(before, fleet.cpu_snapshot()), time.monotonic() - t0
        trained = sum(r.trained for r in present(reader, 0)) - trained_before
    finally:
        reader.close()
        fleet.stop(procs)
    n = len(procs)
    return {"every": every, "volunteers": n, "window_s": round(span, 1),
            "dht_cores_per_volunteer": used.get("dht", 0.0) / span / n,
            "p2pd_cores_per_volunteer": used.get("p2pd", 0.0) / span / n,
            "volunteer_cores_per_volunteer": used.get("volunteer", 0.0) / span / n,
            "samples_per_s": trained / span}


if __name__ == "__main__":
    raise SystemExit(main())
