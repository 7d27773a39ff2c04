"""What micro-batches in flight cost learning, with and without weight stashing, at equal samples (issue 41's charlm goal).

    python -m benchmarks.stashing --json [--run charlm] [--samples 8000] [--seeds 0,1] [--in-flight 4] [--predict 2]
    [--ways stashed,unstashed,predicted] [--quick]

Real stage workers (``swarm.pipeline.stage.worker.StageWorker``: the guard, clipping, the staleness rule, the
referee's ring) of every stage of the run in one process, no network, driven in the pipeline's schedule: each stage
takes the oldest op waiting for it, one op a stage a tick, every stage in the same tick; a forward goes on to the
next stage, the last stage runs its forward and backward at once and sends the gradient back; stage 0's backward ends
the micro-batch and the driver starts the next one, so ``--in-flight`` micro-batches are always on their way. Each
stage's staleness (updates between a micro-batch's forward and its backward there) is what the real pipeline sees
with one driver (3, 2, 1, 0 at 4 stages and 4 in flight), with none of its timing noise. Four ways, each from the
same seed: one micro-batch in flight (one process's learning per sample: no staleness), ``--in-flight`` with weight
stashing (``training.weight_stashing``), without it, and stashed with weight prediction (``training.weight_prediction``
``--predict``: forwards at the weights extrapolated along the last update by that many times the stage's staleness,
swarm/integrity/prediction.py).
Reported per seed and way: the test loss (and bits per byte for a language model, accuracy for a classifier) after
``--samples`` samples; ``*_vs_one`` is a way's test loss
over the one-in-flight way's of the same seed, its mean over seeds the headline (1.0: nothing lost to pipelining).
"""

from __future__ import annotations

import collections
import math
import sys
import time
from typing import Any

from benchmarks.common import finish, machine_notes, parser, ratio, say


def train(run_name: str, in_flight: int, stashing: bool, samples: int, seed: int,
          predicting: float = 0.0) -> dict[str, Any]:
    import torch

    from swarm.pipeline.stage.worker import StageWorker
    from swarm.run.data import MicroBatches, load_dataset
    from swarm.run.local import evaluate
    from volunteer.config import load_run

    run, _ = load_run(run_name)
    run = run.model_copy(update={"training": run.training.model_copy(
        update={"weight_stashing": stashing, "weight_prediction": predicting})})
    torch.manual_seed(seed)
    data = load_dataset(run.data, run.model)
    stages = run.model.stages
    workers = [StageWorker(run, index) for index in range(stages)]
    batches = MicroBatches(data.x_train, data.y_train, torch.arange(len(data.x_train)), run.training.batch_size, seed)
    queues: list[collections.deque] = [collections.deque() for _ in range(stages)]
    staleness: list[list[int]] = [[] for _ in range(stages)]
    started, count, seen = time.perf_counter(), 0, 0

    def start_one() -> None:
        nonlocal count, seen
        x, ids = batches.next_with_ids()
        queues[0].append(("forward", f"mb{count}", x, data.y_train[ids]))
        count, seen = count + 1, seen + len(ids)

    for _ in range(in_flight):
        start_one()
    while seen < samples:
        sent = []
        for index, worker in enumerate(workers):
            if not queues[index]:
                continue
            op, mb, tensor, targets = queues[index].popleft()
            if op == "forward" and index < stages - 1:
                sent.append((index + 1, ("forward", mb, worker.forward(mb, tensor), targets)))
            elif op == "forward":
                _, grad = worker.forward_backward(mb, tensor, targets)
                sent.append((index - 1, ("backward", mb, grad, None)))
            else:
                grad = worker.backward(mb, tensor, None, None)
                staleness[index].append(worker.last_update.staleness if worker.last_update else 0)
                if index > 0:
                    sent.append((index - 1, ("backward", mb, grad, None)))
                else:
                    start_one()
        for index, item in sent:
            queues[index].append(item)
    accuracy, loss = evaluate([worker.module for worker in workers], data, run.model)
    out = {"test_loss": loss, "samples": seen, "train_s": time.perf_counter() - started,
           "predicted_forwards": sum(worker.predicted for worker in workers),
           "staleness_mean": [round(sum(v) / len(v), 2) if v else 0.0 for v in staleness]}
    if data.kind == "language_model":
        out["bits_per_byte"] = loss / math.log(2) / data.bytes_per_token
    else:
        out["accuracy"] = accuracy
    return out


def main(argv: list[str] | None = None) -> int:
    args_parser = parser("stashing", __doc__.split("\n\n")[0], "digits-mlp, 640 samples, one seed: a smoke test")
    args_parser.add_argument("--run", default="charlm", help="a built-in run name or a run YAML (default charlm)")
    args_parser.add_argument("--samples", type=int, default=8000, help="samples each way trains (default 8000)")
    args_parser.add_argument("--seeds", default="0,1", help="comma-separated seeds (default 0,1)")
    args_parser.add_argument("--in-flight", type=int, default=4, help="micro-batches in flight (default 4)")
    args_parser.add_argument("--predict", type=float, default=2.0, help="training.weight_prediction of the predicted "
                             "way: how many times its staleness a stage looks ahead (default 2, charlm's)")
    args_parser.add_argument("--ways", default="stashed,unstashed,predicted",
                             help="comma-separated ways to train beside one micro-batch in flight (the baseline, "
                             "always trained): stashed, unstashed, predicted (default all three)")
    args = args_parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.run, args.samples, args.seeds = "digits-mlp", 640, "0"
    started = time.monotonic()
    import torch

    torch.set_num_threads(1)
    report: dict[str, Any] = {"run": args.run, "samples": args.samples, "in_flight": args.in_flight,
                              "predict": args.predict, "seeds": {},
                              "machine": machine_notes()}
    every_way = {"stashed": (args.in_flight, True, 0.0), "unstashed": (args.in_flight, False, 0.0),
                 "predicted": (args.in_flight, True, args.predict)}
    chosen = [name.strip() for name in args.ways.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in every_way]
    if unknown or not chosen:
        args_parser.error(f"--ways: {', '.join(unknown) or 'none given'}: choose from {', '.join(every_way)}")
    report["ways"] = chosen
    ratios: dict[str, list[float]] = {name: [] for name in chosen}
    for seed in (int(s) for s in args.seeds.split(",")):
        ways = {"one_in_flight": (1, True, 0.0), **{name: every_way[name] for name in chosen}}
        results = {}
        for name, (in_flight, stashing, predicting) in ways.items():
            results[name] = train(args.run, in_flight, stashing, args.samples, seed, predicting)
            say(f"seed {seed} {name}: {results[name]}")
        for name in ratios:
            value = ratio(results[name]["test_loss"], results["one_in_flight"]["test_loss"])
            results[f"{name}_vs_one"] = value
            if value is not None:
                ratios[name].append(value)
        report["seeds"][str(seed)] = results
    for name, values in ratios.items():
        report[f"{name}_loss_vs_one_in_flight"] = sum(values) / len(values) if values else None
    return finish(report, "stashing", started, args)


if __name__ == "__main__":
    sys.exit(main())
