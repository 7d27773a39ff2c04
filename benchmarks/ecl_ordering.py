"""``python -m benchmarks.convergence_ecl --ordering-study``: how a swarm peer pairs an edge exchange.

Three settings a swarm meets, 8 nodes, K = 8, random node speeds U[0.5, 1]:
- ``ring``: a ring, no lag, step counters that start together;
- ``ring_lag2_phase``: a ring, messages delivered 2 steps late (a swap's reply 4), step counters that
  start out of phase (peers that joined at different times);
- ``random``: the study's random graph, no lag, counters together.

For each, three orderings (swarm/ecl/live_sim.py): ``reference`` (the simulator: both messages made,
then both applied, on one global clock, the same lag), ``oneway`` (each end pushes at its own step and
the receiver applies before it makes its own: the swarm before the pairing fix) and ``swap`` (the swarm
now). Digits: softmax, PDMM-ISVR and ADMM-ISVR at their tuned step sizes, test accuracy averaged over the
nodes after ``--epochs``. Quadratics: the worst node's distance to the optimum at 2k and 16k steps
(mu 0.5, exact gradients, start 1.09).
"""

from __future__ import annotations

import sys

SETTINGS: dict[str, dict] = {
    "ring": {"graph": "ring", "delay_ticks": 0, "out_of_phase": False},
    "ring_lag2_phase": {"graph": "ring", "delay_ticks": 2, "out_of_phase": True},
    "random": {"graph": "random", "delay_ticks": 0, "out_of_phase": False},
}
ORDERINGS = ("reference", "oneway", "swap")
METHODS = ("pdmm_isvr", "admm_isvr")
QUADRATIC_TICKS = 16_000
QUADRATIC_EVAL_TICKS = 2_000


def ordering_study(study, config) -> dict:
    from swarm.ecl.quadratic import QuadraticRun, run_quadratic
    from swarm.ecl.updates import ADMM_THETA, PDMM_THETA

    problem = study.load_problem(config)
    report: dict = {"digits_softmax": {}, "quadratic_worst_distance": {}}
    for name, setting in SETTINGS.items():
        for method in METHODS:
            for ordering in ORDERINGS:
                variant = study.with_overrides(config, ordering=ordering, **setting)
                curve = study.run_method(method, "softmax", study.TUNED_STEP_SIZES[method]["softmax"], problem,
                                         variant)
                report["digits_softmax"].setdefault(name, {}).setdefault(method, {})[ordering] = round(curve[-1], 4)
                theta = PDMM_THETA if method == "pdmm_isvr" else ADMM_THETA
                run = QuadraticRun(ordering=ordering, theta=theta, period_steps=config.period_steps, step_size=0.5,
                                   ticks=QUADRATIC_TICKS, speed_range=config.speed_range, seed=config.seed, **setting)
                result, _ = run_quadratic(run, eval_every_ticks=QUADRATIC_EVAL_TICKS)
                distances = {"2k": float(f"{result.metrics[1]:.3g}"), "16k": float(f"{result.metrics[-1]:.3g}")}
                report["quadratic_worst_distance"].setdefault(name, {}).setdefault(method, {})[ordering] = distances
                print(f"  {name} {method} {ordering}: digits {curve[-1]:.4f}, quadratic {distances}",
                      file=sys.stderr, flush=True)
    return report
