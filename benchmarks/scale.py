"""`python -m benchmarks.scale --json`: a large run's throughput against the optimum, with and without
live rebalancing (benchmarks/scale_sim.py drives swarm.membership.least_served_swarm and
swarm.rebalance as the node does), at 1,000 and 10,000 volunteers, with churn and uneven peers.

Each cell prints the mean and worst (after warm-up) of throughput / best split of the same peers, and
moves per peer-hour. Headline figures, each a ratio measured in this run:
- ``rebalancing_vs_optimal``: the worst cell with rebalancing (goal >= 0.95);
- ``placement_only_vs_optimal``: the worst cell where peers stay where they joined (the baseline);
- ``dht_cpu_per_peer_64_vs_8``: not measured here (real DHT processes: benchmarks/dht_reads.py), null.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from benchmarks.scale_sim import SimConfig, Simulation
from swarm.rebalance import RebalancePolicy


def cells(quick: bool) -> list[dict]:
    sizes = (1000,) if quick else (1000, 10000)
    churns = (0.0, 0.02) if quick else (0.0, 0.005, 0.02)
    return [dict(peers=n, churn=c, rebalance=r) for n in sizes for c in churns for r in (False, True)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="1,000 peers, 40 periods (about 10 s)")
    parser.add_argument("--swarms", type=int, default=8)
    parser.add_argument("--periods", type=int, default=None, help="rebalance periods per cell (default 120, quick 40)")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal spread of peer capacities")
    parser.add_argument("--hysteresis", type=float, default=RebalancePolicy().hysteresis)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    periods = args.periods or (40 if args.quick else 120)
    started, load_before = time.monotonic(), os.getloadavg()[0]
    rows = []
    for cell in cells(args.quick):
        config = SimConfig(swarms=args.swarms, periods=periods, warmup=min(20, periods // 4), sigma=args.sigma,
                           policy=RebalancePolicy(hysteresis=args.hysteresis), seed=args.seed, **cell)
        t0 = time.monotonic()
        result = Simulation(config).run()
        rows.append({**cell, **result.to_json(), "seconds": round(time.monotonic() - t0, 1)})
        if not args.json:
            print(json.dumps(rows[-1]), file=sys.stderr)
    moved = [row for row in rows if row["rebalance"]]
    kept = [row for row in rows if not row["rebalance"]]
    report = {
        "benchmark": "scale",
        "swarms": args.swarms, "periods": periods, "sigma": args.sigma, "hysteresis": args.hysteresis,
        "rebalancing_vs_optimal": min(row["throughput_vs_best"] for row in moved),
        "placement_only_vs_optimal": min(row["throughput_vs_best"] for row in kept),
        "dht_cpu_per_peer_64_vs_8": None,
        "dht_cpu_note": "not measured by this simulation; real DHT processes: python -m benchmarks.dht_reads",
        "cells": rows,
        "seconds": round(time.monotonic() - started, 1),
        "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
