"""What the stage's bounds (swarm/integrity: clipping, the guarded step, fair share and bans) do to honest training.

In one process, without a network: a chain of ``StageWorker``s trained exactly as a pipeline trains
them (forward through every stage, ``forward_backward`` at the last, ``backward`` down to stage 0),
by two drivers that alternate micro-batches from their own shards, each a named requester at every
stage. The same samples train the reference model of ``swarm.run.local`` (no bounds). Prints, per setup:
accuracy of both at equal samples, the fraction of updates clipped and of steps shortened per stage,
and the guard's cost per step.

    python -m benchmarks.bounds --json [--quick]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from swarm.run.data import MicroBatches, load_dataset, make_shards
from swarm.integrity.requesters import RequesterBook
from swarm.run.local import train_local
from swarm.run.runconfig import RunConfig
from swarm.pipeline.stage.worker import StageWorker
from volunteer.config import load_run

# the bounds as good as off: clipping at 1000x the median, any step (ceiling ||theta|| / lr), no bans
UNBOUNDED = {"clip_multiplier": 1000.0, "max_step_ratio": 1.0, "ban_strikes": 1e9}
SETUPS = {
    "digits-mlp (adam)": ("configs/runs/digits-mlp.yaml", {}),
    "digits-mlp sgd momentum 0.9": ("configs/runs/digits-mlp.yaml", {"optimizer": {"name": "sgd", "lr": 0.05,
                                                                                    "momentum": 0.9}}),
    "digits-mlp label-skewed, sgd": ("configs/runs/digits-mlp.yaml", {
        "data": {"shards": 2, "partition": "label_skewed", "classes_per_shard": 5},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.0}}),
}


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(base.get(key, {}), value) if isinstance(value, dict) else value
    return out


STEP_S = 0.03  # simulated time between honest micro-batches (~30 per second, as a 2-core run)
ATTACK_PER_STEP = 4  # the attacker's requests per honest micro-batch (the measured attack ran at ~110/s)


def _attack(book: RequesterBook, stage, h: torch.Tensor, grad: torch.Tensor, step: int, now: float) -> dict:
    """Gradient ascent at stage 1: the honest micro-batch's own gradient, negated, as often as the gate allows."""
    out = {"accepted": 0, "refused": 0, "banned_at_s": None}
    for j in range(ATTACK_PER_STEP):
        if book.admit("attacker", True, now) is not None:
            out["refused"] += 1
            continue
        stage.forward(f"a{step}-{j}", h, owner="attacker")
        stage.backward(f"a{step}-{j}", -grad, None, None, owner="attacker")
        book.finished("attacker")
        report = stage.last_update
        out["accepted"] += 1
        if book.on_update("attacker", report.clip_scale, now) is not None:
            out["banned_at_s"] = now
    return out


def train_chain(run: RunConfig, samples: int, seed: int = 0, attack_from: int | None = None) -> dict:
    torch.manual_seed(seed)
    data = load_dataset(run.data, run.model)
    shards = make_shards(data.y_train, run.data, data.num_classes)
    drivers = {"driver-a": MicroBatches(data.x_train, data.y_train, shards[0], run.training.batch_size, 1),
               "driver-b": MicroBatches(data.x_train, data.y_train, shards[1 % len(shards)], run.training.batch_size, 2)}
    workers = [StageWorker(run, k) for k in range(run.model.stages)]
    guard_s, seen, step = 0.0, 0, 0
    book = RequesterBook(run.integrity)
    attack = {"accepted": 0, "refused": 0, "banned_at_s": None}
    while seen < samples:
        name = list(drivers)[step % 2]
        now = step * STEP_S
        x, y = next(drivers[name])
        mb = f"m{step}"
        hs = [x]
        for k, worker in enumerate(workers[:-1]):
            hs.append(worker.forward(mb, hs[-1], owner=name if k else ""))
        _, grad = workers[-1].forward_backward(mb, hs[-1], y, owner=name)
        for k in range(len(workers) - 2, -1, -1):
            if k == 1:
                book.admit(name, True, now)
                book.finished(name)
                grad_at_1 = grad
            grad = workers[k].backward(mb, grad, None, None, owner=name if k else "")
            if k == 1:
                book.on_update(name, workers[1].last_update.clip_scale, now)
        if attack_from is not None and seen >= attack_from:
            part = _attack(book, workers[1], hs[1], grad_at_1, step, now)
            for key in ("accepted", "refused"):
                attack[key] += part[key]
            attack["banned_at_s"] = attack["banned_at_s"] or part["banned_at_s"]
        seen += len(x)
        step += 1
    for worker in workers:
        guard_s += _guard_cost_s(worker)
    accuracy = _accuracy(workers, data)
    honest_bans = [b.requester for b in book.bans if b.requester != "attacker"]
    result = {
        "accuracy": accuracy,
        "honest_drivers_banned": honest_bans,
        "updates_per_stage": step,
        "param_grad_clipped_fraction": [round(w.grad_norms.clipped_fraction, 4) for w in workers],
        "grad_out_clipped_fraction": [round(w.grad_out_rms.clipped_fraction, 4) for w in workers[:-1]],
        "step_shortened_fraction": [round(w.guard.scaled_steps / max(w.guard.steps, 1), 4) for w in workers],
        "guard_ms_per_step_mean_over_stages": round(guard_s * 1e3 / len(workers), 4),
    }
    if attack_from is not None:
        result["attack"] = {"accepted": attack["accepted"], "refused": attack["refused"],
                            "banned_after_s": None if attack["banned_at_s"] is None
                            else round(attack["banned_at_s"] - attack_from / run.training.batch_size * STEP_S, 2)}
    return result


def _guard_cost_s(worker: StageWorker, repeats: int = 50) -> float:
    """Mean seconds of the guard's own work (backup, finiteness check, step bound) around a no-op update."""
    for p in worker.module.parameters():
        p.grad = torch.zeros_like(p)
    started = time.perf_counter()
    for _ in range(repeats):
        worker.guard.run(lambda: None)
    return (time.perf_counter() - started) / repeats


@torch.no_grad()
def _accuracy(workers: list[StageWorker], data) -> float:
    h = data.x_test
    for worker in workers:
        h = worker.infer(h)
    return float((h.argmax(-1) == data.y_test).float().mean())


def charlm_guard_cost_ms() -> float:
    run = load_run("configs/runs/charlm.yaml")[0]
    worker = StageWorker(run, 1)
    x = torch.randn(run.training.batch_size, run.model.seq_len, run.model.d_model)
    worker.forward("w", x)
    worker.backward("w", torch.randn_like(x), None, None)  # creates the optimizer state the guard copies
    return round(_guard_cost_s(worker) * 1e3, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    samples = 8_000 if args.quick else 30_000
    out: dict = {"samples": samples}
    for label, (path, extra) in SETUPS.items():
        base = load_run(path)[0]
        run = RunConfig.model_validate(_merge(base.model_dump(), extra))
        result = train_chain(run, samples)
        unbounded = RunConfig.model_validate(_merge(run.model_dump(), {"integrity": UNBOUNDED}))
        result["accuracy_without_bounds"] = train_chain(unbounded, samples)["accuracy"]
        data = load_dataset(run.data, run.model)
        result["reference_accuracy_one_process"] = train_local(run, samples, dataset=data).accuracy
        out[label] = result
        attacked = train_chain(run, samples, attack_from=samples // 2)
        out[label + ", ascent attacker at layer1 from half-way"] = {
            "accuracy": attacked["accuracy"], "honest_drivers_banned": attacked["honest_drivers_banned"],
            **attacked["attack"]}
    out["charlm_layer1_guard_ms_per_step"] = charlm_guard_cost_ms()
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
