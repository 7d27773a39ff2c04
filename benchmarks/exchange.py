"""Best-model exchange on label-skewed shards: no exchange vs the reported-loss rule vs the validation rule.

    python -m benchmarks.exchange [--json] [--epochs 100] [--classes-per-shard 2 5 8] [--nodes 8]

A simulation with the project's own parts: the run's data split (swarm/run/data.py, with its validation
split), label-skewed shards (``make_shards``), the simulator (swarm/ecl/simulate.py) with nodes of
random speed, and the exchange rules the swarm runs (swarm/ecl/gossip.py: ``BestModelExchange`` is
the old rule, lowest self-reported training-loss EMA; ``ValidatedExchange`` scores copies on the
validation split with ``draw_candidates`` and ``exchange_winner``, the functions
swarm/averaging/agent.py uses). Every method gets the same data, initial weights, step size, batch
size and number of epochs; the figure is the node-averaged TEST accuracy at the end (the validation
split is never trained on and the test split never decides anything). The rules run every epoch.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

METHODS = ("none", "loss_rule", "validation_2", "validation_all")
LR = {"softmax": 0.4, "mlp": 0.4}
BATCH = 16
MARGIN_LOSS_RULE = 0.05  # the old default of averaging.exchange.margin
MARGIN = 0.02  # averaging.exchange.margin's default for the validation rule


def run(method: str, model_name: str, classes_per_shard: int, nodes: int, epochs: int, seed: int) -> dict:
    import numpy as np
    import torch
    from torch.nn import functional as F

    from swarm.run.data import load_dataset, make_shards
    from swarm.ecl.gossip import BestModelExchange, SgdNode, ValidatedExchange
    from swarm.ecl.graph import build_graph
    from swarm.ecl.models import FlatClassifier
    from swarm.ecl.simulate import SimConfig, simulate
    from swarm.ecl.study import MODELS, BatchOracle, peer_ids
    from swarm.run.runconfig import DataConfig, ModelConfig

    data = DataConfig(source="digits", shards=nodes, partition="label_skewed", classes_per_shard=classes_per_shard,
                      split_seed=seed)
    dataset = load_dataset(data, ModelConfig(kind="mlp", input_dim=64, num_classes=10))
    shards = make_shards(dataset.y_train, data, 10)
    model = FlatClassifier(MODELS[model_name])
    initial = model.init(seed)
    peers = peer_ids(nodes)
    rebuild = lambda ids: build_graph("ring", ids, 8, seed)
    graph = rebuild(peers)
    swarm = {p: SgdNode(p, initial, graph, lr=LR[model_name]) for p in peers}
    oracles = {p: BatchOracle(model, dataset.x_train[s], dataset.y_train[s], BATCH, seed=seed * 1000 + i)
               for i, (p, s) in enumerate(zip(peers, shards))}
    ticks_per_epoch = math.ceil(np.mean([len(s) for s in shards]) / BATCH)
    every = ticks_per_epoch * BATCH

    @torch.no_grad()
    def validation_loss(params: torch.Tensor) -> float:
        return float(F.cross_entropy(model.logits(params, dataset.x_val), dataset.y_val))

    hook = None
    if method == "loss_rule":
        hook = BestModelExchange(every, BATCH, margin=MARGIN_LOSS_RULE)
    elif method.startswith("validation"):
        count = 2 if method == "validation_2" else nodes - 1
        hook = ValidatedExchange(every, BATCH, validation_loss, candidates=count, margin=MARGIN, seed=seed)
    evaluate = lambda params: float(np.mean([model.accuracy(w, dataset.x_test, dataset.y_test)
                                             for w in params.values()]))
    sim = SimConfig(ticks=epochs * ticks_per_epoch, eval_every_ticks=ticks_per_epoch, seed=seed,
                    speed_range=(0.5, 1.0))
    result = simulate(swarm, oracles, rebuild, evaluate, sim, hook)
    out = {"accuracy": round(result.metrics[-1], 4), "accuracy_mid": round(result.metrics[len(result.metrics) // 2], 4)}
    if isinstance(hook, ValidatedExchange):
        out["adoptions_per_exchange"] = round(hook.adoptions / max(1, hook.exchanges), 3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.exchange", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="one line of JSON")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--classes-per-shard", type=int, nargs="+", default=[2, 5, 8])
    parser.add_argument("--models", nargs="+", default=["softmax", "mlp"])
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    started = time.perf_counter()
    report: dict = {"nodes": args.nodes, "epochs": args.epochs, "seed": args.seed, "cells": {}}
    for model_name in args.models:
        for k in args.classes_per_shard:
            cell = {m: run(m, model_name, k, args.nodes, args.epochs, args.seed) for m in METHODS}
            report["cells"][f"{model_name}/{k}_classes_per_shard"] = cell
            print(model_name, k, {m: v["accuracy"] for m, v in cell.items()}, file=sys.stderr, flush=True)
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
