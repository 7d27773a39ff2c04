"""Convergence study of the decentralized optimizers on heterogeneous digits shards (docs/ECL.md).

    python -m benchmarks.convergence_ecl --json [--out DIR] [--epochs E] [--graph random] [--nodes N]

prints one JSON object, method -> model -> final node-averaged test accuracy (the single-node
"reference" is the baseline measured in the same run), and writes one accuracy-per-epoch plot per
model into --out. ``--tune`` instead picks each method's step size on a validation split and prints
the choices; ``--eta-study`` measures a common eta against the authors' per-node eta;
``--ordering-study`` compares how a swarm peer pairs an edge exchange (the one-way pushes it used to
make, the swap it makes now) with the reference simulator, with lag and out-of-phase step counters.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEFAULT_OUT = Path("benchmarks/results")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    torch.set_num_threads(1)
    from swarm.ecl import study

    config = study.StudyConfig(epochs=args.epochs, graph=args.graph, seed=args.seed, nodes=args.nodes,
                               classes_per_shard=args.classes_per_shard, dual_init=args.dual_init,
                               delay_ticks=args.delay_ticks)
    started = time.perf_counter()
    if args.tune:
        report = _tune(study, config)
    elif args.eta_study:
        report = _eta_study(study, config)
    elif args.ordering_study:
        from benchmarks.ecl_ordering import ordering_study

        report = ordering_study(study, config)
    else:
        curves = _curves(study, config)
        report = {method: {model: round(curve[-1], 4) for model, curve in by_model.items()}
                  for method, by_model in curves.items()}
        _plot(curves, config, args.out)
    print(f"convergence_ecl: {time.perf_counter() - started:.1f} s", file=sys.stderr)
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.convergence_ecl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the result as one line of JSON")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"folder for the plots (default {DEFAULT_OUT})")
    parser.add_argument("--epochs", type=int, default=200, help="epochs of every method (default 200)")
    parser.add_argument("--graph", choices=["ring", "double_ring", "random"], default="random")
    parser.add_argument("--nodes", type=int, default=8, help="nodes (a live swarm's peers) (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="seeds data split, shards, graph, speeds, init")
    parser.add_argument("--classes-per-shard", type=int, default=8, help="classes each node holds (default 8 of 10)")
    parser.add_argument("--dual-init", choices=["neutral", "zero"], default="neutral",
                        help="ECL: a new edge's dual (default neutral; zero is the paper's)")
    parser.add_argument("--delay-ticks", type=int, default=0,
                        help="messages arrive this many ticks after they were made (default 0)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--tune", action="store_true", help="choose step sizes on a validation split instead")
    mode.add_argument("--eta-study", action="store_true", help="common vs per-node eta instead")
    mode.add_argument("--ordering-study", action="store_true",
                      help="one-way pushes vs the paired swap vs the reference, on quadratics and digits")
    return parser


def _curves(study, config) -> dict[str, dict[str, list[float]]]:
    problem = study.load_problem(config)
    return {method: {model: study.run_method(method, model, study.TUNED_STEP_SIZES[method][model], problem, config)
                     for model in study.MODELS}
            for method in study.METHODS}


def _tune(study, config) -> dict:
    problem = study.load_problem(config, validation=True)
    report: dict = {}
    for method in study.METHODS:
        for model in study.MODELS:
            chosen, scores = study.tune(method, model, config, problem=problem)
            report.setdefault(method, {})[model] = {"chosen": chosen, "validation": scores}
            print(f"  tuned {method}/{model}: {chosen}", file=sys.stderr, flush=True)
    return report


def _eta_study(study, config) -> dict:
    from swarm.ecl.quadratic import QuadraticRun, optimum_distances, run_quadratic

    quadratics: dict = {}
    for graph in ("ring", "random"):
        for per_node in (False, True):
            result, b = run_quadratic(QuadraticRun(graph=graph, period_steps=config.period_steps, ticks=8000,
                                                   step_size=0.5, per_node_eta=per_node, seed=config.seed))
            to_optimum, spread = optimum_distances(result.final_params, b)
            key = "per_node_eta" if per_node else "common_eta"
            quadratics.setdefault(graph, {})[key] = {"initial_distance": result.metrics[0],
                                                     "distance_to_optimum": to_optimum, "node_spread": spread}
    digits: dict = {}
    problem = study.load_problem(config)
    for per_node in (False, True):
        variant = study.with_overrides(config, per_node_eta=per_node)
        key = "per_node_eta" if per_node else "common_eta"
        for model in study.MODELS:
            step = study.TUNED_STEP_SIZES["pdmm_isvr"][model]
            curve = study.run_method("pdmm_isvr", model, step, problem, variant)
            digits.setdefault(key, {})[model] = round(curve[-1], 4)
    return {"quadratic_pdmm": quadratics, "digits_pdmm_test_accuracy": digits}


def _plot(curves: dict[str, dict[str, list[float]]], config, out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        print("convergence_ecl: matplotlib is missing, no plots (pip install 'volunteer[plots]')", file=sys.stderr)
        return
    out.mkdir(parents=True, exist_ok=True)
    models = next(iter(curves.values())).keys()
    for model in models:
        figure, axes = pyplot.subplots(figsize=(7, 4.5))
        for method, by_model in curves.items():
            style = "k--" if method == "reference" else "-"
            axes.plot(range(len(by_model[model])), by_model[model], style, label=method, linewidth=1.2)
        axes.set(xlabel="epoch", ylabel="node-averaged test accuracy", ylim=(0.6, 1.0),
                 title=f"{model}: {config.nodes} nodes, {config.graph} graph, K={config.period_steps}, "
                       f"{config.classes_per_shard}/10 classes per node")
        axes.grid(alpha=0.3)
        axes.legend(loc="lower right", fontsize=8)
        figure.tight_layout()
        path = out / f"ecl_convergence_{model}.png"
        figure.savefig(path, dpi=110)
        pyplot.close(figure)
        print(f"convergence_ecl: wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
