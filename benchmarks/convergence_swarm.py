"""The live convergence matrix (issue 11, item 4): real swarms, compared with one process at equal samples.

Each cell is a fresh run of real `volunteer join` processes on loopback: the digits MLP cut into
``--stages`` stages, ``peers`` volunteers in every swarm (every layer0 peer drives, on its own shard),
an optimizer, an averaging mode, a data partition, and optionally ``busy`` processes spinning on the
CPU (``--busy`` = the number of cores oversubscribes the machine 2x). Every ``--sample-s`` the
benchmark pulls each driver's chain of copies through the params service and evaluates it here (the
true accuracy, whatever the peers publish); the cell ends at the last sample point or its time limit.

At each sample point (digits: 10k and 30k run-wide samples, before the data set saturates) the
cell's figure is the worst chain's true accuracy at the first sample at or after the point, over
``swarm.run.local.train_local`` (one process, same model, optimizer, data and batch size) trained on
exactly as many samples: ``ratio`` 1.0 means the swarm learns as much from a sample as one process.

Axes (comma-separated): ``--optimizers`` sgd_momentum (lr 0.05, momentum 0.9) and adam (lr 1e-3);
the edge modes own the update, so their cells use plain SGD (lr 0.05) whatever the optimizer axis says
(one cell per mode, named ``sgd``). ``--modes`` none, dpwa, exchange (best-model exchange scored on the
validation split, over dpwa), dsgd, pdmm_isvr, admm_isvr. ``--partitions`` iid, label_skewed (5
classes per shard).

    python -m benchmarks.convergence_swarm --json [--quick] [--optimizers adam] [--busy 0,2]
        [--peers 1,2,4] [--modes none,dpwa] [--partitions iid] [--plot curves.png]
        [--run charlm] [--repeats 3] [--step-s 0.03] [--fetch-probability 0.1] [--set integrity.fair_share_slack=1.2]

``--run charlm`` runs the shipped byte-level transformer (configs/runs/charlm.yaml, cut into ``--stages``
stages, IID, AdamW): each chain's test loss in bits per byte against one process at equal sequences
(``worst_loss_ratio``, the worst cell's; goal <= 1.05). ``--repeats`` runs every cell again and reports
the mean ratio and its range: one run of a cell varies by a few points. ``--step-s`` simulates an
accelerator (each forward and backward takes at least that long): on quiet CPUs 30k digits samples take
about 10 s, so without it a cell measures the swarm's first seconds (joins, first syncs, first DHT
reads) rather than its steady state.

Sampling starts with the first driver that trains (the others may still be joining on a busy machine); a
sample evaluates only the chains of drivers that have trained. A curve row is (run-wide samples, worst
chain's accuracy, seconds since the first driver trained, chains evaluated, the chains' mean accuracy).

Prints one JSON object: per cell the curve, the accuracy and ratio at each point, heals and lost
micro-batches; ``diverged_cells`` (the worst chain's final true accuracy at or below 0.2, chance being 0.1, or below half the
best it reached)
and ``worst_accuracy_ratio`` (the worst cell's ratio at the last point it reached). ``--quick`` runs one
small cell to 3k samples: a smoke test, not a measurement.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (apply_overrides, count_penalties, finish, machine_notes, parser, rounded, say, wait_until,
                               write_run)
from benchmarks.convergence_compare import (  # noqa: F401  (re-exported: tests/test_convergence_matrix.py)
    DIVERGED_ACCURACY,
    DIVERGED_BPB,
    LM_RUNS,
    LocalBaseline,
    _chance_bits,
    _compare,
    _diverged,
    _last_ratio,
    _rate,
    bits_per_byte,
    combine,
)
from benchmarks.fleet import Fleet
from benchmarks.staleness import present, true_accuracies, wait_first_driver

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from copies import CopyOracle  # noqa: E402
from hostile import HostilePeer  # noqa: E402

EDGE_MODES = ("dsgd", "pdmm_isvr", "admm_isvr")
MODES = ("none", "dpwa", "exchange", *EDGE_MODES)
OPTIMIZERS = {
    "sgd_momentum": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    "adam": {"name": "adam", "lr": 0.001},
    "sgd": {"name": "sgd", "lr": 0.05, "momentum": 0.0},  # the edge modes' (configs/runs/digits-ecl.yaml)
    "adamw": {"name": "adamw", "lr": 0.002, "weight_decay": 0.01},  # charlm's (configs/runs/charlm.yaml)
}
POINTS = (10_000, 30_000)
CHARLM_POINTS = (3_000, 8_000)  # sequences of 64 bytes; one process: ~2.9 bits/byte at 3k, ~2.4 at 8k
QUICK_POINTS = (1_000, 3_000)
START_TIMEOUT_S = 300.0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    lm = args.run in LM_RUNS
    points = QUICK_POINTS if args.quick else CHARLM_POINTS if lm else POINTS
    if args.points:
        points = tuple(int(v) for v in args.points.split(","))
    axes = [args.optimizers.split(","), [int(v) for v in args.busy.split(",")], [int(v) for v in args.peers.split(",")],
            args.modes.split(","), args.partitions.split(",")]
    if args.quick:
        axes = [["adamw" if lm else "adam"], [0], [1], ["none"], ["iid"]]
    if lm:  # a language model has no labels to skew
        axes[4] = ["iid"]
    cells, seen = [], set()
    started = time.monotonic()
    baseline = LocalBaseline()
    with Fleet(prefix="volunteer-convergence-", keep_workdir=args.keep_logs) as fleet:
        if args.keep_logs:
            say(f"the volunteers' logs are kept in {fleet.workdir}")
        _, maddr = fleet.bootstrap()
        for optimizer, busy, peers, mode, partition in itertools.product(*axes):
            optimizer = "sgd" if mode in EDGE_MODES else optimizer
            label = f"{optimizer}-{mode}-p{peers}-busy{busy}-{partition}" + ("-rival" if args.rival else "")
            if mode in EDGE_MODES and args.graph != "ring":
                label += f"-{args.graph}"
            if label in seen:
                continue
            seen.add(label)
            runs = []
            for repeat in range(args.repeats):
                say(f"cell {label}" + (f", run {repeat + 1} of {args.repeats}" if args.repeats > 1 else ""))
                config = cell_config(label, optimizer, mode, partition, peers, args.stages, _in_flight(args.in_flight),
                                     fetch_probability=args.fetch_probability, run=args.run,
                                     pull_budget=args.pull_budget, graph=args.graph, staleness=args.staleness)
                apply_overrides(config, args.set)
                try:
                    # each repeat's processes (and logs, with --keep-logs) under their own names; the run is the same
                    tag = label + (f"-r{repeat + 1}" if args.repeats > 1 else "")
                    one = _cell(fleet, maddr, tag, config, peers, args.stages, busy, points, args)
                    one.update(_compare(one, config, points, baseline))
                except Exception as exc:  # one cell the harness could not run must not lose the others
                    one = {"error": f"{exc.__class__.__name__}: {exc}"[:400]}
                runs.append(one)
            cell = combine(runs)
            cell.update(label=label, optimizer=optimizer, busy=busy, peers=peers, mode=mode, partition=partition)
            shown = ("ratios", "mean_ratios", "honest_penalties", "final_accuracy_min", "final_bits_per_byte_max", "heals", "lost", "error")
            cell["honest_penalties"] = cell.get("penalties", {}).get("total", 0)  # no attacker in this benchmark
            say(f"cell {label}: " + ", ".join(f"{k}={rounded(cell[k])}" for k in shown if k in cell))
            cells.append(cell)
    reached = [c for c in cells if c.get("ratios")]
    report = {
        "cells": cells,
        # no attacker anywhere: every penalty (a ban, a rejected copy or edge message) fell on an honest peer
        "honest_penalties": {c["label"]: c["honest_penalties"] for c in cells if c.get("honest_penalties")},
        "diverged_cells": [c["label"] for c in cells if "error" not in c and _diverged(c, lm, _chance_bits(args.run))],
        "error_cells": [c["label"] for c in cells if "error" in c],  # the harness could not run them
        # digits: the worst cell's accuracy over one process's; charlm: the worst cell's test loss over one
        # process's (bits per byte, higher is worse; goal <= 1.05)
        "worst_accuracy_ratio": None if lm else min((_last_ratio(c) for c in reached), default=None),
        "worst_loss_ratio": max((_last_ratio(c) for c in reached), default=None) if lm else None,
        "worst_cell": (max if lm else min)(reached, key=_last_ratio)["label"] if reached else None,
        # the same over the mean of the samples near the last point (window_ratios): less noisy
        "worst_window_ratio": (max if lm else min)((_last_ratio(c, "window_ratios") for c in reached
                                                     if c.get("window_ratios")), default=None),
        "settings": {"run": args.run, "stages": args.stages, "in_flight": args.in_flight, "points": list(points),
                     "sample_s": args.sample_s,
                     "cell_limit_s": args.cell_limit_s, "cores": os.cpu_count(),
                     "fetch_probability": args.fetch_probability, "step_s": args.step_s,
                     "pull_budget": args.pull_budget, "graph": args.graph, "rival": args.rival,
                     "staleness": args.staleness or "divide_momentum"},
        "machine": machine_notes(),
    }
    if args.plot:
        from benchmarks.convergence_plot import plot

        report["plot"] = plot(cells, Path(args.plot))
    return finish(report, "convergence_swarm", started, args)


def _parser() -> Any:
    out = parser("convergence_swarm", __doc__, quick_help="one cell (adam, 1 peer, none, iid) to 3k samples: a smoke "
                 "test, not a measurement")
    out.add_argument("--optimizers", default="sgd_momentum,adam")
    out.add_argument("--keep-logs", action="store_true", help="keep the volunteers' logs, one set per repeat "
                     "(printed path): to find out which check fired on an honest peer")
    out.add_argument("--busy", default=f"0,{os.cpu_count() or 2}", help="busy processes per cell (the number of "
                     "cores = 2x oversubscribed)")
    out.add_argument("--peers", default="1,2,4", help="peers in every swarm")
    out.add_argument("--modes", default=",".join(MODES))
    out.add_argument("--partitions", default="iid,label_skewed")
    out.add_argument("--run", choices=("digits", *LM_RUNS), default="digits", help="digits: the MLP, by test "
                     "accuracy; charlm: the byte-level transformer (configs/runs/charlm.yaml, iid only, optimizer "
                     "adamw), by test loss in bits per byte at equal sequences; llm-tiny: the Llama-style model over "
                     "BPE tokens (configs/runs/llm-tiny.yaml), likewise")
    out.add_argument("--points", default="", help="sample counts to compare at (default: 10000,30000 for digits, "
                     "3000,8000 for charlm)")
    out.add_argument("--step-s", type=float, default=0.0, help="a simulated accelerator: each forward and backward "
                     "takes at least this long (VOLUNTEER_SIMULATED_STEP_S), so that the run spans minutes, as a real "
                     "one does, instead of the ~10 s that 30k digits samples take on 4 quiet CPU chains")
    out.add_argument("--repeats", type=int, default=1, help="runs per cell (their mean ratio and range are reported)")
    out.add_argument("--fetch-probability", type=float, default=0.1, help="averaging.fetch_probability: the chance "
                     "of a Dpwa pull per step")
    out.add_argument("--pull-budget", type=float, default=0.0, help="averaging.pull_budget (0: off)")
    out.add_argument("--staleness", default="", help="optimizer.staleness for every cell (default: the schema's, "
                     "divide_momentum)")
    out.add_argument("--graph", choices=("ring", "double_ring", "random"), default="ring", help="the edge modes' "
                     "peer graph (averaging.graph.kind)")
    out.add_argument("--rival", action="store_true", help="a second run of the same shape (its own name, the same "
                     "number of volunteers) trains on this machine throughout each cell: competing swarms")
    out.add_argument("--stages", type=int, default=2)
    out.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                     help="a run-config field for every cell, e.g. integrity.fair_share_slack=1.2 (the value is YAML)")
    out.add_argument("--in-flight", default="4", help="micro-batches in flight per driver, or auto")
    out.add_argument("--sample-s", type=float, default=1.0, help="seconds between true-accuracy samples")
    out.add_argument("--cell-limit-s", type=float, default=240.0, help="a cell ends here even short of its last point")
    out.add_argument("--plot", default="", help="write the curves to this PNG (needs the `plots` extra: matplotlib)")
    return out


def _in_flight(text: str) -> int | str:
    return text if text == "auto" else int(text)


def cell_config(label: str, optimizer: str, mode: str, partition: str, peers: int, stages: int,
                in_flight: int | str = 4, fetch_probability: float = 0.1, run: str = "digits",
                pull_budget: float = 0.0, graph: str = "ring", staleness: str = "") -> dict[str, Any]:
    averaging: dict[str, Any] = {"mode": "dpwa" if mode == "exchange" else mode}
    if fetch_probability != 0.1:
        averaging["fetch_probability"] = fetch_probability
    if pull_budget > 0:
        averaging["pull_budget"] = pull_budget
    optimizer_cfg = dict(OPTIMIZERS[optimizer], **({"staleness": staleness} if staleness else {}))
    if mode == "exchange":
        averaging["exchange"] = {"every_samples": 2000}
    if mode in EDGE_MODES:
        averaging["graph"] = {"kind": graph}
    config = {
        "name": f"cv-{abs(hash((label, time.time()))) % 10**10}",  # run names are at most 48 characters
        "model": {"kind": "mlp", "stages": stages, "hidden_dim": 128},
        "data": {"partition": partition, "classes_per_shard": 5, "shards": max(2, peers)},
        "optimizer": optimizer_cfg,
        "averaging": averaging,
        "training": {"batch_size": 32, "in_flight": in_flight, "eval_every_s": 5.0},
        "timeouts": {"heartbeat_s": 1.0},
    }
    if run in LM_RUNS:  # the shipped run's model and data (the pinned corpus), cut into ``stages`` stages
        import yaml

        shipped = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "runs" / f"{run}.yaml").read_text())
        config["model"] = {**shipped["model"], "stages": stages}
        config["data"] = {**shipped["data"], "shards": max(2, peers)}
        config["training"]["batch_size"] = shipped["training"]["batch_size"]
        if optimizer == "adamw":  # the run's own AdamW (charlm's is OPTIMIZERS' adamw)
            config["optimizer"] = shipped["optimizer"]
    return config


def _cell(fleet: Fleet, maddr: str, label: str, config: dict[str, Any], peers: int, stages: int, busy: int,
          points: tuple[int, ...], args: Any) -> dict[str, Any]:
    from swarm.run.runconfig import RunConfig

    run = RunConfig.model_validate(config)
    path = write_run(fleet.workdir / f"{label}.yaml", config)
    hogs = [fleet.start(f"{label}-busy{i}", [sys.executable, "-c", "while True: pass"]) for i in range(busy)]
    if args.rival:  # a second run of the same shape training on this machine throughout the cell (issue 30, item 1)
        rival_config = dict(config, name=f"rival-{config['name']}"[:48])
        rival_path = write_run(fleet.workdir / f"{label}-rival.yaml", rival_config)
        hogs += [fleet.join(f"{label}-rival-layer{k}-{m}", rival_path, f"layer{k}", maddr)
                 for k in range(stages) for m in range(peers)]
    reader = HostilePeer(run, [maddr], fleet.workdir / f"{label}-reader.key", process_group=fleet._process_group(),
                         heartbeat_s=1.0)
    # the other swarms fill first and the drivers start together: a driver that trained alone while 15 processes
    # started on 2 cores put the first sample past 100k samples, and the 10k point out of reach
    env = {"VOLUNTEER_SIMULATED_STEP_S": str(args.step_s)} if args.step_s > 0 else None
    procs = [fleet.join(f"{label}-layer{k}-{m}", path, f"layer{k}", maddr, env=env) for k in range(1, stages)
             for m in range(peers)]
    try:
        wait_until(lambda: all(len(reader.online(f"layer{k}")) >= peers for k in range(1, stages)), START_TIMEOUT_S,
                   "the swarms after layer0 online", interval_s=1.0)
        procs += [fleet.join(f"{label}-layer0-{m}", path, "layer0", maddr, env=env) for m in range(peers)]
        # sampling starts with the first driver that trains, not the last: on 2 busy cores the drivers come online
        # tens of seconds apart, and the first one alone put the first sample past 24k-153k samples
        wait_first_driver(reader, procs)
        oracle = CopyOracle(reader)
        lm = run.model.language_model
        measure, worst = (bits_per_byte, max) if lm else (None, min)
        curve, t0 = [], time.monotonic()
        while time.monotonic() - t0 < args.cell_limit_s:
            time.sleep(args.sample_s)
            drivers = present(reader, 0)
            trained = sum(r.trained for r in drivers)
            if curve:  # a driver whose record is late drops out of the sum for a read: samples never go back
                trained = max(trained, curve[-1][0])
            figures = true_accuracies(reader, oracle, stages, trained_only=True, measure=measure)
            if figures:
                curve.append((trained, worst(figures), round(time.monotonic() - t0, 1), len(figures),
                              round(sum(figures) / len(figures), 4)))
            if trained >= points[-1] and curve and curve[-1][0] >= points[-1]:
                break
        records = {k: present(reader, k) for k in range(stages)}
    finally:
        reader.close()
        fleet.stop(procs + hogs)
    penalties = count_penalties([p.stdout() + p.stderr() for p in procs])
    drivers = records[0]
    final = curve[-1][1] if curve else None
    return {"curve": curve, **({"final_bits_per_byte_max": final} if lm else {"final_accuracy_min": final}),
            "trained": sum(r.trained for r in drivers), "lost": sum(r.lost for r in drivers),
            "heals": sum(r.heals for rows in records.values() for r in rows),
            "samples_per_s": _rate(curve), "penalties": penalties}


if __name__ == "__main__":
    raise SystemExit(main())
