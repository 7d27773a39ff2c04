"""What referees cost (issue 40's goals): the weights digest against a step, and a run's throughput with and without.

- ``digest_share_<model>``: a stage's commit of a new version (a copy of its tensors and their BLAKE3 digest,
  swarm/integrity/weights.py) over one training step of that stage (forward, backward, update) on this machine,
  one thread, for the default digits stage (hidden 128, batch 32) and benchmarks.pipeline's heavy stage (2048 wide,
  batch 256). A version is committed at most once per step (when its first hop is served).
- ``throughput_ratio`` (with ``--live``): samples per second of ``volunteer demo`` (the default run, one volunteer per
  swarm: every swarm a lone copy, the referee's most frequent case) with the referee over without it
  (``VOLUNTEER_REFEREE=0``), ``--runs`` runs each, alternating, each ``--seconds`` long.

- ``honest_failures_bf16`` / ``honest_failures_exact`` (with ``--tail``): the share of honest last-stage hops of a
  digits run (3 stages, hidden 32, Adam, batch 16, trained in one process) whose input gradient does NOT reproduce
  within the referee's tolerance when recomputed from the weights rounded to bfloat16 (session 13's commitment) and
  from the exact weights (today's), over ``--tail-hops`` hops at each of a few points of training; each a false
  conviction of an honest peer. The worst cosine of each is reported too.

    python -m benchmarks.referee --json [--live] [--run llm-tiny] [--runs 2] [--seconds 45] [--tail] [--tail-hops 1500]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

from benchmarks.common import finish, machine_notes, median, parser, ratio, say

REPEATS = 20
QUICK_REPEATS = 5
SHAPES = {"digits": dict(hidden_dim=128, batch=32, input_dim=64),
          "heavy": dict(hidden_dim=2048, batch=256, input_dim=2048)}


def digest_share(name: str, repeats: int = REPEATS) -> dict[str, float]:
    """(seconds per step, seconds per commit, their ratio) for a middle stage of shape ``name``."""
    from swarm.integrity.weights import WeightsRing
    from swarm.pipeline.stage.worker import StageWorker
    from swarm.run.runconfig import RunConfig

    shape = SHAPES[name]
    run = RunConfig.model_validate({"name": f"ref-{name}", "model": {
        "stages": 3, "hidden_dim": shape["hidden_dim"], "input_dim": shape["input_dim"]},
        "training": {"batch_size": shape["batch"]}})
    worker = StageWorker(run, 1)
    ring = WeightsRing.sized_for(worker.module)
    x = torch.randn(shape["batch"], shape["hidden_dim"]).relu()
    g = 0.01 * torch.randn(shape["batch"], shape["hidden_dim"])
    worker.ring = WeightsRing(max_bytes=1, keep_s=0.0)  # the step alone: its own commits cost ~nothing to keep
    steps, commits = [], []
    for i in range(repeats):
        started = time.perf_counter()
        worker.forward(f"m{i}", x)
        worker.backward(f"m{i}", g, None, None)
        steps.append(time.perf_counter() - started)
        started = time.perf_counter()
        ring.release_live()  # the copy of a version (taken when the weights change) and its digest
        ring.commit(worker.module, i)
        commits.append(time.perf_counter() - started)
    step_s, commit_s = median(steps[2:]), median(commits[2:])
    return {"step_ms": step_s * 1000, "commit_ms": commit_s * 1000, "share": commit_s / step_s,
            "stage_mb": sum(t.numel() * t.element_size() for t in worker.module.state_dict().values()) / 2**20}


def honest_tail(hops: int, points: tuple[int, ...] = (0, 2000, 8000)) -> dict[str, Any]:
    """How often an honest last-stage hop fails its recomputation, from bfloat16-rounded and from exact weights."""
    from torch.func import functional_call

    from swarm.integrity.recompute import compare, tolerance_for
    from swarm.run.data import load_dataset
    from swarm.run.models import assemble, build_stages, loss_fn
    from swarm.run.runconfig import RunConfig

    torch.manual_seed(0)
    run = RunConfig.model_validate({"name": "tail", "model": {"stages": 3, "hidden_dim": 32},
                                    "optimizer": {"name": "adam", "lr": 0.001}})
    data = load_dataset(run.data, run.model)
    stages = build_stages(run.model)
    model, last = assemble(stages), stages[-1]
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    tolerance = tolerance_for("forward_backward", "float32")
    failures = {"bf16": 0, "exact": 0}
    worst = {"bf16": 1.0, "exact": 1.0}
    per_point = []
    for step in range(max(points) + 1):
        if step in points:
            exact = {n: p.detach().clone() for n, p in last.named_parameters()}
            forms = {"exact": exact, "bf16": {n: t.to(torch.bfloat16).float() for n, t in exact.items()}}
            failed = {"bf16": 0, "exact": 0}
            for _ in range(hops):
                ids = torch.randint(0, len(data.y_train), (16,))
                with torch.no_grad():
                    h = stages[1](stages[0](data.x_train[ids]))
                grads = {}
                for form in ("claim", "exact", "bf16"):  # the claim: what the honest stage computes (its live weights)
                    x = h.clone().requires_grad_(True)
                    weights = dict(last.named_parameters()) if form == "claim" else forms[form]
                    loss_fn(run.model, functional_call(last, weights, (x,)), data.y_train[ids]).backward()
                    grads[form] = x.grad
                last.zero_grad()
                for form in ("exact", "bf16"):
                    finding = compare(grads["claim"], grads[form], tolerance)
                    worst[form] = min(worst[form], finding.cosine)
                    failed[form] += not finding.holds
            per_point.append({"step": step, **{f"failed_{k}": v for k, v in failed.items()}})
            failures = {k: failures[k] + failed[k] for k in failures}
            say(f"tail at step {step}: {failed['bf16']} of {hops} honest hops fail from bfloat16 weights, "
                f"{failed['exact']} from exact ones")
        ids = torch.randint(0, len(data.y_train), (16,))
        optimizer.zero_grad()
        loss_fn(run.model, model(data.x_train[ids]), data.y_train[ids]).backward()
        optimizer.step()
    total = hops * len(points)
    return {"honest_failures_bf16": failures["bf16"] / total, "honest_failures_exact": failures["exact"] / total,
            "tail": {"hops": total, "worst_cosine_bf16": worst["bf16"], "worst_cosine_exact": worst["exact"],
                     "points": per_point, "tolerance": tolerance.min_cosine}}


def live(runs: int, seconds: float, run: str = "digits-mlp") -> dict[str, Any]:
    rates: dict[str, list[float]] = {"on": [], "off": []}
    target = ["--target-bits-per-byte", "0.01"] if run.startswith("llm") or run == "charlm" else \
        ["--target-accuracy", "0.999"]  # out of reach: the run goes on for its time limit
    for i in range(runs):
        for mode in ("on", "off"):
            env = {**os.environ, "VOLUNTEER_REFEREE": "1" if mode == "on" else "0"}
            out = subprocess.run([sys.executable, "-m", "volunteer_cli", "demo", "--run", run, "--time-limit-s",
                                  str(seconds), *target, "--json"], env=env, capture_output=True, text=True,
                                 timeout=seconds + 240)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            rates[mode].append(result["samples"] / result["seconds"])
            say(f"run {i + 1} referee {mode}: {rates[mode][-1]:.0f} samples/s, lost {result['lost_microbatches']}")
    return {"samples_per_s": rates, "throughput_ratio": ratio(median(rates["on"]), median(rates["off"]))}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    started = time.monotonic()
    torch.set_num_threads(1)
    report: dict[str, Any] = {"machine": machine_notes()}
    for name in SHAPES:
        figures = digest_share(name, QUICK_REPEATS if args.quick else REPEATS)
        report[f"digest_share_{name}"] = figures["share"]
        report[name] = figures
        say(f"{name}: step {figures['step_ms']:.2f} ms, commit {figures['commit_ms']:.3f} ms "
            f"({figures['share']:.2%}), {figures['stage_mb']:.1f} MiB")
    if args.tail or args.quick:  # quick: a small sample, so the smoke run covers it
        report.update(honest_tail(50 if args.quick else args.tail_hops, (0, 200) if args.quick else (0, 2000, 8000)))
    if args.live and not args.quick:
        report.update(live(args.runs, args.seconds, args.run))
    return finish(report, "referee", started, args)


def _parser():
    out = parser("referee", __doc__, quick_help="fewer steps, no live runs (a smoke test)")
    out.add_argument("--live", action="store_true", help="also run volunteer demo with and without the referee")
    out.add_argument("--run", default="digits-mlp", help="the run --live demos (default digits-mlp; llm-tiny, charlm)")
    out.add_argument("--runs", type=int, default=2)
    out.add_argument("--seconds", type=float, default=45.0)
    out.add_argument("--tail", action="store_true", help="also count honest hops that fail their recomputation")
    out.add_argument("--tail-hops", type=int, default=1500)
    return out


if __name__ == "__main__":
    sys.exit(main())
