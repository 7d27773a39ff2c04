"""What signed hop receipts cost a micro-batch, against the compute of that micro-batch in one process.

For each shape (the default run, digits-mlp, and ``benchmarks.pipeline``'s heavy run: 4 stages of a 2048-wide
MLP, batch 256), the same process measures:

- ``compute_ms``: one micro-batch's forward and backward and an Adam step through every stage, in one process on
  one torch thread (CPU time of the work the pipeline exists to do, without threads spinning at a barrier);
- ``receipt_ms``: everything receipts add to that micro-batch across the pipeline, done here for real on tensors of
  the run's shapes: per hop the driver digests and signs (stage 0) or digests and verifies (a reply), and the
  stage digests and verifies the request's receipt and digests and signs its reply (a backward also carries the
  gradient's receipt). Forward hops 1..L-1, backward hops L-2..1, stage 0's own receipt.

Prints one JSON object with ``receipt_cost_vs_compute_<shape>`` = receipt_ms / compute_ms (the issue's bound is
on pipeline throughput, whose CPU per micro-batch is larger than one process's compute: this ratio is the
stricter one).

    python -m benchmarks.receipts --json [--reps 20]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks.common import finish, machine_notes, median, parser, rounded, say

SHAPES = {
    "default": {"name": "digits", "model": {"stages": 4, "hidden_dim": 128}, "training": {"batch_size": 64}},
    "heavy": {"name": "heavy", "model": {"stages": 4, "hidden_dim": 2048, "input_dim": 2048},
              "training": {"batch_size": 256}},
}


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = _parser().parse_args(argv)
    report: dict[str, Any] = {"machine": machine_notes()}
    for name, cfg in SHAPES.items():
        figures = measure(cfg, args.reps)
        report[name] = figures
        report[f"receipt_cost_vs_compute_{name}"] = figures["receipt_ms"] / figures["compute_ms"]
        say(f"{name}: receipts {figures['receipt_ms']:.2f} ms per micro-batch, compute {figures['compute_ms']:.1f} ms")
    return finish(rounded(report), "receipts", started, args)


def measure(cfg: dict, reps: int) -> dict[str, float]:
    import torch

    from swarm.run.models import build_stages, stage_input_spec, stage_output_spec
    from swarm.run.runconfig import RunConfig

    torch.set_num_threads(1)  # CPU time of real work: idle threads spinning at a barrier would inflate the compute
    run = RunConfig.model_validate(cfg)
    batch, stages = run.training.batch_size, build_stages(run.model)
    optimizers = [torch.optim.Adam(s.parameters(), lr=1e-3) for s in stages]
    x = torch.randn(batch, run.model.input_dim)
    y = torch.randint(0, run.model.num_classes, (batch,))
    compute = []
    for _ in range(reps + 1):
        started = time.process_time()
        out = x
        for stage in stages:
            out = stage(out)
        torch.nn.functional.cross_entropy(out, y).backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        compute.append(time.process_time() - started)
    shapes = [(batch, *[d or batch for d in stage_output_spec(run.model, k, batch).shape[1:]])
              for k in range(run.model.stages - 1)]
    inputs = [(batch, *[d or batch for d in stage_input_spec(run.model, k, batch).shape[1:]])
              for k in range(1, run.model.stages)]
    receipts = [_receipts_of_one_microbatch(run.run_id, shapes, inputs, batch) for _ in range(reps + 1)]
    return {"compute_ms": 1000 * median(compute[1:]), "receipt_ms": 1000 * median(receipts[1:]), "reps": reps}


def _receipts_of_one_microbatch(run_id: str, activations: list[tuple], gradients: list[tuple], batch: int) -> float:
    """CPU seconds of every receipt step of one micro-batch through len(activations)+1 stages."""
    import torch

    from swarm.integrity.receipts import ids_digest, signature_valid, tensor_digest
    from swarm.pipeline.transport.wire import encode_tensors

    keys = _keys()
    tensors = [encode_tensors([torch.randn(shape)])[0] for shape in activations]  # serialized outside the clock:
    grads = [encode_tensors([torch.randn(shape)])[0] for shape in gradients]  # the wire costs them anyway
    ids = torch.arange(batch)
    started = time.process_time()
    ids_d = ids_digest(ids)
    previous = None
    for k, item in enumerate(tensors):  # forwards: the signer digests and signs; the driver and the next stage
        receipt = keys[k].sign(run_id, "mb", "forward", k, 0, previous.output if previous else ids_d,
                               tensor_digest(item), ids_d)
        for _ in range(2):  # the driver checks the reply, the next stage checks the request
            tensor_digest(item)
            signature_valid(receipt, keys[k].public)
        previous = receipt
    for k, item in enumerate(grads):  # backwards and the last stage's forward_backward, the same steps
        receipt = keys[k + 1].sign(run_id, "mb", "backward", k + 1, 0, b"\0" * 16, tensor_digest(item), ids_d)
        for _ in range(2):
            tensor_digest(item)
            signature_valid(receipt, keys[k + 1].public)
    return time.process_time() - started


_KEYS: list[Any] = []


def _keys() -> list[Any]:
    from swarm.integrity.receipts import ReceiptKey

    if not _KEYS:
        _KEYS.extend(ReceiptKey(f"QmStage{k}") for k in range(8))
    return _KEYS


def _parser() -> argparse.ArgumentParser:
    p = parser("receipts", __doc__)
    p.add_argument("--reps", type=int, default=20, help="micro-batches measured per shape (median)")
    return p


if __name__ == "__main__":
    raise SystemExit(main())
