"""Why N averaging copies learn less per sample than one process: a simulation, in one process, of the
live matrix's digits cells (issue 11, item 4), without the swarm's timing.

N copies of the digits MLP (the swarm's model, optimizer and data: ``swarm.run.models``, ``swarm.run.local``,
``swarm.run.data``) each train on their own shard, one micro-batch in turn; after each step a copy pulls a
random other copy with probability ``fetch`` and moves halfway to it (Dpwa with equal clocks). Each
copy's optimizer runs at ``lr_mult`` x the run's lr. At each point (run-wide samples) the figure is the
worst copy's test accuracy, averaged over seeds, against one process trained on as many samples (same
seeds). The live swarm adds staleness, joins and timing; this isolates the algorithm.

What it shows (benchmarks/README.md, convergence_swarm): each of N copies takes 1/N of the run's steps,
and averaging mixes the copies' displacements instead of adding them, so at equal samples a copy has
moved about as far as one process at 1/N of the samples. Pulls of a Dpwa's rate (0.1 per step) leave
the gap; only close to synchronous averaging (fetch 1.0) with N x the step size (the linear scaling
rule) closes it, and the live swarm's stale gradients make N x the step of SGD with momentum unstable.

    python -m benchmarks.copies_sim --json [--peers 1,2,4] [--fetch 0.1,0.5,1.0] [--lr-mult 1,4]
        [--optimizers sgd_momentum,adam] [--partitions iid,label_skewed] [--seeds 4]
"""

from __future__ import annotations

import copy
import itertools
import time
from typing import Any

import numpy as np

from benchmarks.common import finish, machine_notes, parser, ratio, rounded, say

OPTIMIZERS = {"sgd_momentum": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "adam": {"name": "adam", "lr": 0.001}}
POINTS = (10_000, 30_000)
QUICK = {"peers": "1,2", "fetch": "0.1", "lr_mult": "1", "optimizers": "adam", "partitions": "iid", "seeds": 1,
         "points": (1_000, 2_000)}


def simulate(optimizer: str, peers: int, fetch: float, lr_mult: float, partition: str, points: tuple[int, ...],
             seed: int) -> dict[int, float]:
    """The worst copy's test accuracy at each point (run-wide samples)."""
    import torch

    from swarm.run.data import load_dataset, make_shards
    from swarm.run.local import evaluate, make_optimizer
    from swarm.run.models import assemble, build_stages, loss_fn
    from swarm.run.runconfig import RunConfig

    opt = dict(OPTIMIZERS[optimizer], lr=OPTIMIZERS[optimizer]["lr"] * lr_mult)
    run = RunConfig.model_validate({"name": "copies-sim", "model": {"kind": "mlp", "stages": 2, "hidden_dim": 128},
                                    "data": {"partition": partition, "classes_per_shard": 5, "shards": max(2, peers)},
                                    "optimizer": opt, "training": {"batch_size": 32}})
    data = load_dataset(run.data, run.model)
    shards = make_shards(data.y_train, run.data, data.num_classes) if peers > 1 else [np.arange(len(data.y_train))]
    rng = np.random.default_rng(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        first = assemble(build_stages(run.model))
        models = [copy.deepcopy(first) for _ in range(peers)]
        optimizers = [make_optimizer(m.parameters(), run.optimizer) for m in models]
        out: dict[int, float] = {}
        samples, batch = 0, run.training.batch_size
        while len(out) < len(points):
            for i, (model, optim) in enumerate(zip(models, optimizers)):
                idx = rng.choice(shards[i], batch)
                loss = loss_fn(run.model, model(data.x_train[idx]), data.y_train[idx])
                optim.zero_grad(set_to_none=True)
                loss.backward()
                optim.step()
                samples += batch
                if peers > 1 and rng.random() < fetch:
                    other = models[int(rng.choice([k for k in range(peers) if k != i]))]
                    with torch.no_grad():
                        for mine, theirs in zip(model.parameters(), other.parameters()):
                            mine.mul_(0.5).add_(theirs, alpha=0.5)
                for point in points:
                    if point not in out and samples >= point:
                        out[point] = min(evaluate(m, data, run.model)[0] for m in models)
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    points = args.points if isinstance(args.points, tuple) else tuple(int(v) for v in args.points.split(","))
    started = time.monotonic()
    seeds = range(args.seeds)
    cells, single = [], {}
    axes = [args.optimizers.split(","), args.partitions.split(","), [int(v) for v in args.peers.split(",")],
            [float(v) for v in args.fetch.split(",")], [float(v) for v in args.lr_mult.split(",")]]
    for optimizer, partition, peers, fetch, lr_mult in itertools.product(*axes):
        if (optimizer, partition) not in single:  # one process: the same seeds, the run's lr
            runs = [simulate(optimizer, 1, 0.0, 1.0, partition, points, s) for s in seeds]
            single[(optimizer, partition)] = {p: float(np.mean([r[p] for r in runs])) for p in points}
        if peers == 1:
            continue
        runs = [simulate(optimizer, peers, fetch, lr_mult, partition, points, s) for s in seeds]
        worst = {p: float(np.mean([r[p] for r in runs])) for p in points}
        base = single[(optimizer, partition)]
        cell = {"optimizer": optimizer, "partition": partition, "peers": peers, "fetch": fetch, "lr_mult": lr_mult,
                "worst_copy": {str(p): round(worst[p], 4) for p in points},
                "one_process": {str(p): round(base[p], 4) for p in points},
                "ratios": {str(p): ratio(worst[p], base[p]) for p in points}}
        say(f"{optimizer} {partition} peers={peers} fetch={fetch} lr x{lr_mult:g}: {rounded(cell['ratios'])}")
        cells.append(cell)
    last = str(points[-1])
    report = {"cells": cells, "points": list(points), "seeds": args.seeds, "machine": machine_notes()}
    default = [c for c in cells if c["fetch"] == 0.1 and c["lr_mult"] == 1.0 and c["partition"] == "iid"]
    report["dpwa_default_worst_ratio"] = min((c["ratios"][last] for c in default), default=None)
    best = max(cells, key=lambda c: c["ratios"][last], default=None)
    report["best_ratio"] = best["ratios"][last] if best else None
    report["best_settings"] = {k: best[k] for k in ("optimizer", "partition", "peers", "fetch", "lr_mult")} if best else None
    return finish(report, "copies_sim", started, args)


def _parser() -> Any:
    out = parser("copies_sim", __doc__, quick_help="2 copies, 1 seed, to 2k samples: a smoke test")
    out.add_argument("--peers", default="1,2,4", help="copies (1 = one process, always run as the baseline)")
    out.add_argument("--fetch", default="0.1,0.5,1.0", help="chance of a pull after each step (Dpwa's default 0.1)")
    out.add_argument("--lr-mult", default="1,4", help="each copy's lr over the run's")
    out.add_argument("--optimizers", default="sgd_momentum,adam")
    out.add_argument("--partitions", default="iid,label_skewed")
    out.add_argument("--seeds", type=int, default=4)
    out.add_argument("--points", default=",".join(str(p) for p in POINTS))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
