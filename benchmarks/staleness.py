"""Staleness in a real swarm, and whether SGD with momentum converges (issue 11, item 3).

Each cell is a fresh run of real `volunteer join` processes on loopback: the digits MLP of
configs/runs/digits-mlp.yaml (4 stages), ``drivers`` layer0 peers with ``in_flight`` micro-batches
each, one peer in every other swarm, an optimizer, a staleness rule (``optimizer.staleness``), and
optionally ``busy`` processes that spin on the CPU (a machine other programs oversubscribe). Every
``sample_s`` the benchmark reads the records (trained samples, lost micro-batches, heals, each copy's
staleness) and pulls every copy through the params service to evaluate the pipeline here (the true
accuracy, whatever the peers publish); layer0's published evaluations give accuracy at equal samples.

    python -m benchmarks.staleness --json [--quick] [--drivers 2,4] [--busy 0,4] [--rules none,divide]
        [--optimizer sgd_momentum|adam] [--train-s 60]

Prints one JSON object: per cell the final true accuracy (mean and worst over the drivers' chains),
accuracy at equal samples (from the published evaluations), heals, lost micro-batches, samples/s
and the staleness (mean, p95, max) each swarm reported; ``diverged_cells`` lists the cells whose
final accuracy is at or below ``DIVERGED_ACCURACY``.
"""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import finish, machine_notes, parser, rounded, say, wait_until, write_run
from benchmarks.fleet import Fleet

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from copies import CopyOracle  # noqa: E402
from hostile import HostilePeer  # noqa: E402

STAGES = 4
START_TIMEOUT_S = 300.0
RULE_TAGS = {"none": "none", "divide": "div", "momentum": "mom", "divide_momentum": "divmom"}
FINAL_SAMPLES = 3  # the final accuracy is the mean over this many last samples
DIVERGED_ACCURACY = 0.5  # chance is 0.1; a converging digits run passes 0.9 within seconds
SAMPLE_POINTS = (10_000, 20_000, 30_000)  # accuracy at equal samples (run-wide, as evaluations record them)
OPTIMIZERS = {
    "sgd_momentum": {"name": "sgd", "lr": 0.05, "momentum": 0.9},  # the schema's default before this change
    "adam": {"name": "adam", "lr": 0.001},  # configs/runs/digits-mlp.yaml's
}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    drivers = [int(v) for v in args.drivers.split(",")]
    busy = [int(v) for v in args.busy.split(",")]
    rules = args.rules.split(",")
    train_s = 20.0 if args.quick else args.train_s
    if args.quick:
        drivers, busy, rules = drivers[:1], busy[:1], rules[-1:]
    started = time.monotonic()
    cells: list[dict[str, Any]] = []
    with Fleet(prefix="volunteer-staleness-") as fleet:
        _, maddr = fleet.bootstrap()
        for n_drivers, n_busy, rule in itertools.product(drivers, busy, rules):
            label = f"{args.optimizer}-{rule}-d{n_drivers}-busy{n_busy}"
            say(f"cell {label}")
            try:
                cell = _cell(fleet, maddr, label, n_drivers, n_busy, rule, args.optimizer, args.in_flight, train_s,
                             args.sample_s)
            except Exception as exc:  # one cell the harness could not run must not lose the others
                cell = {"error": f"{exc.__class__.__name__}: {exc}"[:400]}
            cell.update(label=label, drivers=n_drivers, busy=n_busy, rule=rule, optimizer=args.optimizer)
            say(f"cell {label}: {rounded(cell)}")
            cells.append(cell)
    report = {
        "cells": cells,
        "diverged_cells": [c["label"] for c in cells if (c.get("final_accuracy_min") or 0.0) <= DIVERGED_ACCURACY],
        "settings": {"stages": STAGES, "in_flight": args.in_flight, "train_s": train_s, "sample_s": args.sample_s},
        "machine": machine_notes(),
    }
    return finish(report, "staleness", started, args)


def _parser() -> Any:
    out = parser("staleness", __doc__, quick_help="one cell, 20 s: a smoke test, not a measurement")
    out.add_argument("--drivers", default="2,4", help="layer0 peers per cell (comma-separated)")
    out.add_argument("--busy", default="0,4", help="busy processes spinning on the CPU per cell (comma-separated)")
    out.add_argument("--rules", default="none,divide", help="optimizer.staleness values (comma-separated)")
    out.add_argument("--optimizer", default="sgd_momentum", choices=tuple(OPTIMIZERS))
    out.add_argument("--in-flight", type=int, default=8, help="micro-batches in flight per driver")
    out.add_argument("--train-s", type=float, default=60.0, help="seconds of training per cell")
    out.add_argument("--sample-s", type=float, default=3.0, help="seconds between samples")
    return out


def run_config(name: str, optimizer: str, rule: str, in_flight: int) -> dict[str, Any]:
    return {
        "name": name,
        "model": {"kind": "mlp", "stages": STAGES, "hidden_dim": 128},
        "optimizer": {**OPTIMIZERS[optimizer], "staleness": rule},
        "training": {"batch_size": 32, "in_flight": in_flight, "eval_every_s": 5.0},
        "timeouts": {"heartbeat_s": 1.0},
    }


def _cell(fleet: Fleet, maddr: str, label: str, drivers: int, busy: int, rule: str, optimizer: str,
          in_flight: int, train_s: float, sample_s: float) -> dict[str, Any]:
    from swarm.run.runconfig import RunConfig

    config = run_config(f"st-{RULE_TAGS[rule]}-{optimizer[:4]}-d{drivers}b{busy}-{int(time.time())}", optimizer, rule,
                        in_flight)  # run names are at most 48 characters
    run = RunConfig.model_validate(config)
    path = write_run(fleet.workdir / f"{label}.yaml", config)
    counts = {0: drivers, **{k: 1 for k in range(1, STAGES)}}
    procs = [fleet.join(f"{label}-layer{k}-{m}", path, f"layer{k}", maddr) for k, n in counts.items() for m in range(n)]
    hogs = [fleet.start(f"{label}-busy{i}", [sys.executable, "-c", "while True: pass"]) for i in range(busy)]
    reader = HostilePeer(run, [maddr], fleet.workdir / f"{label}-reader.key", process_group=fleet._process_group(),
                         heartbeat_s=1.0)
    try:
        wait_online(reader, counts, procs)
        oracle = CopyOracle(reader)
        samples, t0 = [], time.monotonic()
        while time.monotonic() - t0 < train_s:
            time.sleep(sample_s)
            samples.append(_sample(reader, oracle, time.monotonic() - t0))
        records = {k: present(reader, k) for k in range(STAGES)}
    finally:
        reader.close()
        fleet.stop(procs + hogs)
    return _figures(samples, records, train_s)


def wait_online(reader: HostilePeer, counts: dict[int, int], procs: list[Any]) -> None:
    def ready() -> bool:
        for proc in procs:
            proc.check_running()
        online = {k: reader.online(f"layer{k}") for k in counts}
        return all(len(online[k]) >= n for k, n in counts.items()) and sum(r.trained for r in online[0]) > 0

    wait_until(ready, START_TIMEOUT_S, "every swarm online and layer0 training", interval_s=1.0)


def wait_first_driver(reader: HostilePeer, procs: list[Any]) -> None:
    """Until one layer0 driver is online and has trained (the others may still be joining)."""
    def ready() -> bool:
        for proc in procs:
            proc.check_running()
        return any(r.trained > 0 for r in reader.online("layer0"))

    wait_until(ready, START_TIMEOUT_S, "a layer0 driver online and training", interval_s=0.5)


def present(reader: HostilePeer, k: int) -> list[Any]:
    """The peers of a swarm that have not left (a copy that is healing, or whose heartbeat is late on a busy
    machine, still holds weights to evaluate), ordered by peer id."""
    return [r for r in reader.membership.read(f"layer{k}") if r.state != "offline" and r.peer_id != reader.peer_id]


def _sample(reader: HostilePeer, oracle: CopyOracle, t: float) -> dict[str, Any]:
    drivers = present(reader, 0)
    published = [(r.eval_samples, r.test_accuracy) for r in drivers if r.test_accuracy >= 0]
    return {"t": t, "trained": sum(r.trained for r in drivers), "lost": sum(r.lost for r in drivers),
            "evaluations": published, "true": true_accuracies(reader, oracle)}


def true_accuracies(reader: HostilePeer, oracle: CopyOracle, stages: int = STAGES, *,
                    trained_only: bool = False, measure: Any = None) -> list[float]:
    """The pipeline through each driver's layer0 copy and the other swarms' first peer, evaluated here
    (a copy that cannot be pulled right now leaves its chain out of this sample). ``trained_only``: only
    drivers that have trained a sample (one still joining or syncing holds no copy of its own yet).
    ``measure``: what to take of each pulled chain (default: its test accuracy)."""
    views = {k: present(reader, k) for k in range(stages)}
    out = []
    for driver in views[0]:
        if trained_only and (driver.state in ("joining", "syncing") or driver.trained <= 0):
            continue
        chain = {"layer0": driver.peer_id, **{f"layer{k}": views[k][0].peer_id for k in range(1, stages) if views[k]}}
        if len(chain) < stages:
            continue
        try:
            oracle.pull(chain, timeout_s=10.0)
        except Exception as exc:  # a busy or healing copy: a gap in the series, said on stderr
            say(f"pull failed: {exc.__class__.__name__}: {exc}")
            continue
        out.append(oracle.test_accuracy() if measure is None else measure(oracle))
    return out


def accuracy_at(evaluations: list[tuple[int, float]], samples: int) -> float | None:
    """The first published accuracy at or after ``samples`` run-wide samples (None if none got there)."""
    later = sorted(e for e in evaluations if e[0] >= samples)
    return later[0][1] if later else None


def _figures(samples: list[dict[str, Any]], records: dict[int, list[Any]], train_s: float) -> dict[str, Any]:
    evaluations = sorted({e for s in samples for e in s["evaluations"]})
    tail = [s["true"] for s in samples[-FINAL_SAMPLES:] if s["true"]]
    final = [sum(values) / len(values) for values in zip(*tail)] if tail and len({len(v) for v in tail}) == 1 else \
        [a for values in tail for a in values]
    last = samples[-1] if samples else {"trained": 0, "lost": 0}
    first = samples[0] if samples else last
    span_s = (samples[-1]["t"] - samples[0]["t"]) if len(samples) > 1 else train_s
    staleness = {}
    for k, rows in records.items():
        figures = [r.staleness_or_none for r in rows if r.staleness_or_none is not None]
        staleness[f"layer{k}"] = ({"mean": max(f[0] for f in figures), "p95": max(f[1] for f in figures),
                                   "max": max(f[2] for f in figures)} if figures else None)
    return {
        # true accuracy of each driver's chain, averaged over the last FINAL_SAMPLES samples
        "final_accuracy_mean": sum(final) / len(final) if final else None,
        "final_accuracy_min": min(final) if final else None,
        "accuracy_at_samples": {str(n): accuracy_at(evaluations, n) for n in SAMPLE_POINTS},
        "true_accuracy_at_samples": {str(n): accuracy_at([(s["trained"], min(s["true"])) for s in samples
                                                          if s["true"]], n) for n in SAMPLE_POINTS},
        "best_published_accuracy": max((a for _, a in evaluations), default=None),
        "trained": last["trained"], "lost": last["lost"],
        "samples_per_s": (last["trained"] - first["trained"]) / span_s if span_s > 0 else None,
        "heals": {f"layer{k}": sum(r.heals for r in rows) for k, rows in records.items()},
        "staleness": staleness,
        "losses": {f"layer{k}": [r.loss_or_none for r in rows] for k, rows in records.items()},
        "true_accuracy_curve": [(round(s["t"]), s["trained"], [round(a, 3) for a in s["true"]]) for s in samples],
    }


if __name__ == "__main__":
    raise SystemExit(main())
