"""The live convergence matrix (issue 11, item 4): real swarms, compared with one process at equal samples.

Each cell is a fresh run of real `volunteer join` processes on loopback: the digits MLP cut into
``--stages`` stages, ``peers`` volunteers in every swarm (every layer0 peer drives, on its own shard),
an optimizer, an averaging mode, a data partition, and optionally ``busy`` processes spinning on the
CPU (``--busy`` = the number of cores oversubscribes the machine 2x). Every ``--sample-s`` the
benchmark pulls each driver's chain of copies through the params service and evaluates it here (the
true accuracy, whatever the peers publish); the cell ends at the last sample point or its time limit.

At each sample point (digits: 10k and 30k run-wide samples, before the data set saturates) the
cell's figure is the worst chain's true accuracy at the first sample at or after the point, over
``swarm.local.train_local`` (one process, same model, optimizer, data and batch size) trained on
exactly as many samples: ``ratio`` 1.0 means the swarm learns as much from a sample as one process.

Axes (comma-separated): ``--optimizers`` sgd_momentum (lr 0.05, momentum 0.9) and adam (lr 1e-3);
the edge modes own the update, so their cells use plain SGD (lr 0.05) whatever the optimizer axis says
(one cell per mode, named ``sgd``). ``--modes`` none, dpwa, exchange (best-model exchange scored on the
validation split, over dpwa), dsgd, pdmm_isvr, admm_isvr. ``--partitions`` iid, label_skewed (5
classes per shard).

    python -m benchmarks.convergence_swarm --json [--quick] [--optimizers adam] [--busy 0,2]
        [--peers 1,2,4] [--modes none,dpwa] [--partitions iid] [--plot curves.png]

Sampling starts with the first driver that trains (the others may still be joining on a busy machine); a
sample evaluates only the chains of drivers that have trained. A curve row is (run-wide samples, worst
chain's accuracy, seconds since the first driver trained, chains evaluated).

Prints one JSON object: per cell the curve, the accuracy and ratio at each point, heals and lost
micro-batches; ``diverged_cells`` (final true accuracy of some chain at or below 0.5: chance is 0.1)
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

from benchmarks.common import finish, machine_notes, parser, ratio, rounded, say, wait_until, write_run
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
}
POINTS = (10_000, 30_000)
QUICK_POINTS = (1_000, 3_000)
DIVERGED_ACCURACY = 0.5
START_TIMEOUT_S = 300.0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    points = QUICK_POINTS if args.quick else POINTS
    axes = [args.optimizers.split(","), [int(v) for v in args.busy.split(",")], [int(v) for v in args.peers.split(",")],
            args.modes.split(","), args.partitions.split(",")]
    if args.quick:
        axes = [["adam"], [0], [1], ["none"], ["iid"]]
    cells, seen = [], set()
    started = time.monotonic()
    baseline = LocalBaseline()
    with Fleet(prefix="volunteer-convergence-") as fleet:
        _, maddr = fleet.bootstrap()
        for optimizer, busy, peers, mode, partition in itertools.product(*axes):
            optimizer = "sgd" if mode in EDGE_MODES else optimizer
            label = f"{optimizer}-{mode}-p{peers}-busy{busy}-{partition}"
            if label in seen:
                continue
            seen.add(label)
            say(f"cell {label}")
            config = cell_config(label, optimizer, mode, partition, peers, args.stages, _in_flight(args.in_flight))
            try:
                cell = _cell(fleet, maddr, label, config, peers, args.stages, busy, points, args)
                cell.update(_compare(cell, config, points, baseline))
            except Exception as exc:  # one cell the harness could not run must not lose the others
                cell = {"error": f"{exc.__class__.__name__}: {exc}"[:400]}
            cell.update(label=label, optimizer=optimizer, busy=busy, peers=peers, mode=mode, partition=partition)
            say(f"cell {label}: " + ", ".join(f"{k}={rounded(cell.get(k))}" for k in ("ratios", "final_accuracy_min",
                                                                                     "heals", "lost")))
            cells.append(cell)
    reached = [c for c in cells if c.get("ratios")]
    report = {
        "cells": cells,
        "diverged_cells": [c["label"] for c in cells if (c.get("final_accuracy_min") or 0.0) <= DIVERGED_ACCURACY],
        "worst_accuracy_ratio": min((_last_ratio(c) for c in reached), default=None),
        "worst_cell": min(reached, key=_last_ratio)["label"] if reached else None,
        "settings": {"stages": args.stages, "in_flight": args.in_flight, "points": list(points), "sample_s": args.sample_s,
                     "cell_limit_s": args.cell_limit_s, "cores": os.cpu_count()},
        "machine": machine_notes(),
    }
    if args.plot:
        report["plot"] = plot(cells, baseline, Path(args.plot))
    return finish(report, "convergence_swarm", started, args)


def _parser() -> Any:
    out = parser("convergence_swarm", __doc__, quick_help="one cell (adam, 1 peer, none, iid) to 3k samples: a smoke "
                 "test, not a measurement")
    out.add_argument("--optimizers", default="sgd_momentum,adam")
    out.add_argument("--busy", default=f"0,{os.cpu_count() or 2}", help="busy processes per cell (the number of "
                     "cores = 2x oversubscribed)")
    out.add_argument("--peers", default="1,2,4", help="peers in every swarm")
    out.add_argument("--modes", default=",".join(MODES))
    out.add_argument("--partitions", default="iid,label_skewed")
    out.add_argument("--stages", type=int, default=2)
    out.add_argument("--in-flight", default="4", help="micro-batches in flight per driver, or auto")
    out.add_argument("--sample-s", type=float, default=1.0, help="seconds between true-accuracy samples")
    out.add_argument("--cell-limit-s", type=float, default=240.0, help="a cell ends here even short of its last point")
    out.add_argument("--plot", default="", help="write the curves to this PNG (needs the `plots` extra: matplotlib)")
    return out


def _in_flight(text: str) -> int | str:
    return text if text == "auto" else int(text)


def cell_config(label: str, optimizer: str, mode: str, partition: str, peers: int, stages: int,
                in_flight: int | str = 4) -> dict[str, Any]:
    averaging: dict[str, Any] = {"mode": "dpwa" if mode == "exchange" else mode}
    if mode == "exchange":
        averaging["exchange"] = {"every_samples": 2000}
    if mode in EDGE_MODES:
        averaging["graph"] = {"kind": "ring"}
    return {
        "name": f"cv-{abs(hash((label, time.time()))) % 10**10}",  # run names are at most 48 characters
        "model": {"kind": "mlp", "stages": stages, "hidden_dim": 128},
        "data": {"partition": partition, "classes_per_shard": 5, "shards": max(2, peers)},
        "optimizer": dict(OPTIMIZERS[optimizer]),
        "averaging": averaging,
        "training": {"batch_size": 32, "in_flight": in_flight, "eval_every_s": 5.0},
        "timeouts": {"heartbeat_s": 1.0},
    }


def _cell(fleet: Fleet, maddr: str, label: str, config: dict[str, Any], peers: int, stages: int, busy: int,
          points: tuple[int, ...], args: Any) -> dict[str, Any]:
    from swarm.runconfig import RunConfig

    run = RunConfig.model_validate(config)
    path = write_run(fleet.workdir / f"{label}.yaml", config)
    counts = {k: peers for k in range(stages)}
    hogs = [fleet.start(f"{label}-busy{i}", [sys.executable, "-c", "while True: pass"]) for i in range(busy)]
    reader = HostilePeer(run, [maddr], fleet.workdir / f"{label}-reader.key", process_group=fleet._process_group(),
                         heartbeat_s=1.0)
    # the other swarms fill first and the drivers start together: a driver that trained alone while 15 processes
    # started on 2 cores put the first sample past 100k samples, and the 10k point out of reach
    procs = [fleet.join(f"{label}-layer{k}-{m}", path, f"layer{k}", maddr) for k in range(1, stages) for m in range(peers)]
    try:
        wait_until(lambda: all(len(reader.online(f"layer{k}")) >= peers for k in range(1, stages)), START_TIMEOUT_S,
                   "the swarms after layer0 online", interval_s=1.0)
        procs += [fleet.join(f"{label}-layer0-{m}", path, "layer0", maddr) for m in range(peers)]
        # sampling starts with the first driver that trains, not the last: on 2 busy cores the drivers come online
        # tens of seconds apart, and the first one alone put the first sample past 24k-153k samples
        wait_first_driver(reader, procs)
        oracle = CopyOracle(reader)
        curve, t0 = [], time.monotonic()
        while time.monotonic() - t0 < args.cell_limit_s:
            time.sleep(args.sample_s)
            drivers = present(reader, 0)
            trained = sum(r.trained for r in drivers)
            if curve:  # a driver whose record is late drops out of the sum for a read: samples never go back
                trained = max(trained, curve[-1][0])
            accuracies = true_accuracies(reader, oracle, stages, trained_only=True)
            if accuracies:
                curve.append((trained, min(accuracies), round(time.monotonic() - t0, 1), len(accuracies)))
            if trained >= points[-1] and curve and curve[-1][0] >= points[-1]:
                break
        records = {k: present(reader, k) for k in range(stages)}
    finally:
        reader.close()
        fleet.stop(procs + hogs)
    drivers = records[0]
    return {"curve": curve, "final_accuracy_min": curve[-1][1] if curve else None,
            "trained": sum(r.trained for r in drivers), "lost": sum(r.lost for r in drivers),
            "heals": sum(r.heals for rows in records.values() for r in rows),
            "samples_per_s": _rate(curve)}


def _rate(curve: list[tuple[int, float, float, int]]) -> float | None:
    """Samples per second between the first and the last sample (training began before the first one)."""
    if len(curve) < 2 or curve[-1][2] <= curve[0][2]:
        return None
    return (curve[-1][0] - curve[0][0]) / (curve[-1][2] - curve[0][2])


class LocalBaseline:
    """One process (swarm.local.train_local) at exact sample counts, cached per config (its name aside)."""

    def __init__(self) -> None:
        self.cache: dict[tuple[str, int], float] = {}
        self.curves: dict[str, list[tuple[int, float]]] = {}

    def accuracy(self, config: dict[str, Any], samples: int) -> float:
        import json

        from swarm.local import train_local
        from swarm.runconfig import RunConfig

        key_config = {k: v for k, v in config.items() if k not in ("name", "averaging", "timeouts")}
        key = (json.dumps(key_config, sort_keys=True), samples)
        if key not in self.cache:
            self.cache[key] = train_local(RunConfig.model_validate(config), samples).accuracy
            self.curves.setdefault(key[0], []).append((samples, self.cache[key]))
        return self.cache[key]


def _compare(cell: dict[str, Any], config: dict[str, Any], points: tuple[int, ...], baseline: LocalBaseline) -> dict:
    """At each point: the first sample at or after it, against one process trained on exactly as many samples."""
    out: dict[str, Any] = {"at": {}, "ratios": {}}
    for point in points:
        later = [row for row in cell["curve"] if row[0] >= point]
        if not later:
            continue
        samples, accuracy, _, chains = later[0]
        local = baseline.accuracy(config, samples)
        out["at"][str(point)] = {"samples": samples, "swarm": accuracy, "local": local, "chains": chains}
        out["ratios"][str(point)] = ratio(accuracy, local)
    return out


def _last_ratio(cell: dict[str, Any]) -> float:
    ratios = cell["ratios"]
    return ratios[max(ratios, key=int)] or 0.0


def plot(cells: list[dict[str, Any]], baseline: LocalBaseline, out: Path) -> str:
    """The cells' worst-chain curves (and one process's) against samples, one panel per partition."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "not written: matplotlib is missing (pip install -e '.[plots]')"
    partitions = sorted({c["partition"] for c in cells})
    fig, axes = plt.subplots(1, len(partitions), figsize=(7 * len(partitions), 5), squeeze=False)
    for ax, partition in zip(axes[0], partitions):
        for cell in (c for c in cells if c["partition"] == partition and c.get("curve")):
            xs, ys = zip(*[(row[0], row[1]) for row in cell["curve"]])
            ax.plot(xs, ys, label=cell["label"], linewidth=1)
        ax.set(title=f"digits, {partition}: worst chain's true test accuracy", xlabel="run-wide samples",
               ylabel="test accuracy", ylim=(0, 1))
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return str(out)


if __name__ == "__main__":
    raise SystemExit(main())
