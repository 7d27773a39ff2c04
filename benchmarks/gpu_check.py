"""The first thing a session with a GPU runs: llm-small's stages on CUDA, through the stage server's own code.

    python -m benchmarks.gpu_check --json [--run llm-small] [--steps 3]

For each stage alone: a ``StageWorker`` (swarm/pipeline/stage/worker.py: the guard, the clip, the activation cache, the
bf16 autocast of llama.py) on ``cuda`` takes ``in_flight`` forwards, then their backwards (the last stage:
forward_backward, one micro-batch at a time), as a peer serving one driver does. Reported per stage: finiteness
of outputs, input gradients and weights after the steps; the peak memory torch allocated against
``volunteer doctor``'s estimate (swarm/run/memory.py, less its CUDA context allowance, which torch does not count
as allocated); tokens per second. Without CUDA the CUDA checks are skipped with a message saying so, and the
same steps run on the CPU over llm-tiny (``--cpu-run``), so the script itself is checked anywhere.

Then (by default with CUDA; ``--swarm-window-s N`` anywhere) the same run's stages as a real local swarm, one
volunteer per stage on the one device: its samples per second over the stages run one after another and over the
slowest stage alone (benchmarks/gpu_swarm.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from typing import Any

from benchmarks.common import say

MEMORY_TOLERANCE = 0.20  # the bar: the estimate within 20 % of what torch reports
WARMUP_STEPS = 1


def step_inputs(run: Any, index: int, in_flight: int, generator: Any) -> tuple[list[Any], list[Any]]:
    """One step's host tensors, as they arrive from the wire: the stage's inputs, and for each its targets (the last
    stage) or the gradient of its output. Made before the clock starts: making random activations on the host took
    half of a middle stage's step on an H200 (session 30)."""
    from swarm.run.models import stage_input_spec, stage_output_spec, target_spec

    model, batch = run.model, run.training.batch_size
    last = index == model.stages - 1
    inputs = [stage_input_spec(model, index).example(batch, generator, high=model.vocab_size) for _ in range(in_flight)]
    seconds = [target_spec(model).example(batch, generator, high=model.vocab_size) if last else
               stage_output_spec(model, index, batch).example(batch, generator) * 1e-3 for _ in inputs]
    return inputs, seconds


def check_stage(run: Any, index: int, device: str, steps: int) -> dict[str, Any]:
    import torch

    from swarm.pipeline.stage.worker import StageWorker
    from swarm.run.memory import stage_memory

    cuda = device.startswith("cuda")
    gc.collect()  # the stage checked before is gone before this one's peak is measured
    if cuda:
        torch.cuda.init()  # reset_peak_memory_stats refuses a device before CUDA is initialised ("Invalid device")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    worker = StageWorker(run, index, device=device)
    model, batch = run.model, run.training.batch_size
    in_flight = 1 if worker.is_last else (run.training.in_flight if isinstance(run.training.in_flight, int)
                                          else run.training.in_flight_max)
    generator = torch.Generator().manual_seed(index)
    finite, seconds = True, []
    for step in range(WARMUP_STEPS + steps):
        inputs, second_inputs = step_inputs(run, index, in_flight, generator)
        started = time.perf_counter()
        for k, x in enumerate(inputs):
            if worker.is_last:
                loss, grad = worker.forward_backward(f"s{step}-{k}", x, second_inputs[k])
                finite &= bool(torch.isfinite(torch.tensor(loss)))
            else:
                out = worker.forward(f"s{step}-{k}", x)
                finite &= bool(torch.isfinite(out).all())
        if not worker.is_last:
            for k, x in enumerate(inputs):
                grad = worker.backward(f"s{step}-{k}", second_inputs[k], None, None)
                finite &= grad is None or bool(torch.isfinite(grad).all())
        if cuda:
            torch.cuda.synchronize(device)
        if step >= WARMUP_STEPS:
            seconds.append(time.perf_counter() - started)
    finite &= all(bool(torch.isfinite(p).all()) for p in worker.module.parameters())
    tokens = in_flight * batch * model.seq_len
    result: dict[str, Any] = {
        "stage": index, "finite": finite, "micro_batches_per_step": in_flight,
        "step_s": round(min(seconds), 4), "tokens_per_s": round(tokens / min(seconds), 1),
        "params": sum(p.numel() for p in worker.module.parameters()),
        "weights_dtype": str(next(worker.module.parameters()).dtype),
    }
    estimate = stage_memory(run, index, cuda=cuda)
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
        expected = estimate.total_bytes - estimate.overhead_bytes
        result.update(peak_allocated_mib=round(peak / 2**20, 1), estimate_mib=round(expected / 2**20, 1),
                      estimate_ratio=round(expected / peak, 3),
                      memory_within_tolerance=abs(expected / peak - 1.0) <= MEMORY_TOLERANCE)
    else:
        result.update(estimate_mib=round(estimate.total_bytes / 2**20, 1), peak_allocated_mib=None)
    del worker
    gc.collect()
    bare = bare_step_s(run, index, device, in_flight, steps)
    result.update(bare_step_s=round(bare, 4), worker_vs_bare=round(result["step_s"] / bare, 3))
    return result


def bare_step_s(run: Any, index: int, device: str, in_flight: int, steps: int) -> float:
    """The same stage as a bare torch module with the run's optimizer: the same micro-batches per step, each moved to
    the device, forward, backward, an optimizer step, its output and input gradient back on the host (what any stage
    server must do), but no StageWorker (guard, clipping, checks, the receipts' weight versions). ``step_s`` over
    this is what the stage server adds (an H200's middle llm-small stage, session 30: 2.7x)."""
    import torch

    from swarm.run.local import make_optimizer
    from swarm.run.models import build_stage, loss_fn

    model = run.model
    last = index == model.stages - 1
    stage = build_stage(model, index).to(device)
    optimizer = make_optimizer(stage.parameters(), run.optimizer)
    generator = torch.Generator().manual_seed(index)
    seconds = []
    for step in range(WARMUP_STEPS + steps):
        inputs, second_inputs = step_inputs(run, index, in_flight, generator)
        started = time.perf_counter()
        for x, second in zip(inputs, second_inputs):
            x = x.to(device)
            if x.is_floating_point():
                x.requires_grad_(True)
            out = stage(x)
            if last:
                loss_fn(model, out, second.to(device)).backward()
            else:
                out.detach().cpu()
                out.backward(second.to(device))
            if x.grad is not None:
                x.grad.cpu()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        if step >= WARMUP_STEPS:
            seconds.append(time.perf_counter() - started)
    return min(seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default="llm-small", help="the run whose stages run on CUDA (default llm-small)")
    parser.add_argument("--cpu-run", default="llm-tiny", help="without CUDA: the run whose stages run on the CPU")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per stage (after one warm-up)")
    parser.add_argument("--batch-size", type=int, default=None, help="override training.batch_size")
    parser.add_argument("--swarm-window-s", type=float, default=None,
                        help="the local swarm's timed window (default 30 s with CUDA, 0 = no swarm without)")
    parser.add_argument("--swarm-warmup-s", type=float, default=20.0, help="the swarm's training before its window")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    import torch

    from volunteer.config import load_run

    cuda = torch.cuda.is_available()
    run, _ = load_run(args.run if cuda else args.cpu_run)
    if args.batch_size:
        run = run.model_copy(update={"training": run.training.model_copy(update={"batch_size": args.batch_size})})
    report: dict[str, Any] = {"cuda": cuda, "run": run.run_id, "torch": torch.__version__,
                              "mixed_precision": run.model.mixed_precision, "batch_size": run.training.batch_size,
                              "seq_len": run.model.seq_len}
    if cuda:
        report["device"] = torch.cuda.get_device_name(0)
        report["bf16_supported"] = torch.cuda.is_bf16_supported()
    else:
        report["skipped"] = (f"no CUDA device (torch {torch.__version__}): the CUDA checks (bf16 autocast, peak memory "
                             f"against doctor's estimate) are skipped; the same steps ran on the CPU over {run.name}")
        say(report["skipped"])
    device = "cuda:0" if cuda else "cpu"
    stages = []
    for index in range(run.model.stages):
        say(f"stage {index} of {run.run_id} on {device}")
        stages.append(check_stage(run, index, device, args.steps))
    report["stages"] = stages
    report["all_finite"] = all(s["finite"] for s in stages)
    if cuda:
        report["memory_within_tolerance"] = all(s["memory_within_tolerance"] for s in stages)
        torch.cuda.empty_cache()  # the volunteers below share the GPU
    window_s = args.swarm_window_s if args.swarm_window_s is not None else (30.0 if cuda else 0.0)
    if window_s > 0:
        from benchmarks.gpu_swarm import swarm_throughput

        report["swarm"] = swarm_throughput(args.run if cuda else args.cpu_run, args.batch_size, stages,
                                           args.swarm_warmup_s, window_s)
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    return 0 if report["all_finite"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
