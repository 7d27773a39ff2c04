"""A stage's own work per micro-batch, step by step, in one process on one thread (issue 29).

    python -m benchmarks.stage_split --json [--reps 20] [--width 2048] [--batch 256] [--stage 1]

Runs what a middle stage of the heavy pipeline does for one micro-batch, through the real code: the request's
tensors as they arrive (a stream's parts joined, decoded), the receipt digests, ``dispatch`` of ``forward``
and of ``backward`` on a ``StageWorker`` of the heavy run, the reply encoded, digested and cut into stream
parts. Every named step is wrapped by a timer on thread CPU time (exclusive: a step's children are
counted as theirs), so the split adds up to the total. What is not here is the network: p2pd, hivemind's
RPC machinery and the event loop (benchmarks.pipeline_hop and benchmarks.pipeline_profile measure those).
``compute`` figures (forward, backward, optimizer) are the floor: the one-process loop does them too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections import defaultdict
from typing import Any

from benchmarks.common import finish, machine_notes, parser as common_parser, say


class Timers:
    """Exclusive thread-CPU time per step name, for functions wrapped with ``wrap``."""

    def __init__(self) -> None:
        self.exclusive: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list[Any]] = []  # [name, started, children's time]
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        """Time ``owner.attr`` under ``name`` (skipped when ``owner`` has no such attribute: another version)."""
        if not hasattr(owner, attr):
            return
        original = getattr(owner, attr)
        timers = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            with timers.section(name):
                return original(*args, **kwargs)

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, original))

    @contextlib.contextmanager
    def section(self, name: str):
        """Time a block (generators and coroutines cannot be wrapped: their work happens after the call returns)."""
        frame = [name, time.thread_time(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            self._stack.pop()
            spent = time.thread_time() - frame[1]
            self.exclusive[name] += spent - frame[2]
            self.calls[name] += 1
            if self._stack:
                self._stack[-1][2] += spent

    def restore(self) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)
        self._undo.clear()


def _heavy_run(width: int, batch: int, stages: int) -> Any:
    from swarm.run.runconfig import RunConfig

    return RunConfig.model_validate({
        "name": "split", "model": {"kind": "mlp", "stages": stages, "input_dim": width, "hidden_dim": width,
                                   "num_classes": 10},
        "optimizer": {"name": "adam", "lr": 0.001},
        "training": {"batch_size": batch, "in_flight": 8},
        "data": {"source": "npz", "path": "/nonexistent.npz", "shards": 1},
    })


def split(reps: int, width: int, batch: int, stage: int, stages: int = 4) -> dict[str, Any]:
    import torch

    from hivemind.proto import runtime_pb2
    from swarm.integrity import receipts
    from swarm.integrity import guard as guard_module
    from swarm.pipeline.stage import worker as stage_module
    from swarm.pipeline.stage import stage_rpc
    from swarm.pipeline.transport import wire
    try:  # split and join live in streams.py since session 24 (an earlier commit measured: wire.py)
        from swarm.pipeline.transport import streams
    except ImportError:
        streams = wire
    from swarm.pipeline.stage.worker import StageWorker

    torch.set_num_threads(1)
    run = _heavy_run(width, batch, stages)
    worker = StageWorker(run, stage)
    max_bytes = int(run.training.max_payload_mb * 2**20)
    timers = Timers()
    for owner, attr, name in [
        (stage_rpc, "decode_tensors", "wire: decode"), (wire, "encode_tensors", "wire: encode"),
        (receipts, "tensor_digest", "receipts: BLAKE3 digest"),
        (StageWorker, "check_input", "checks: input"), (StageWorker, "check_grad", "checks: output gradient"),
        (StageWorker, "_graph", "forward (graph)"), (StageWorker, "_check_emitted", "checks: emitted finite"),
        (StageWorker, "_refuse_out_of_bound", "checks: outputs in bound"),
        (StageWorker, "_within_reply_bound", "checks: reply bound"),
        (StageWorker, "_clip_grad_out", "clip: output gradient"), (StageWorker, "_clip_param_grads", "clip: param grads"),
        (StageWorker, "_apply", "apply: bookkeeping"), (StageWorker, "forward", "forward: bookkeeping"),
        (StageWorker, "backward", "backward: bookkeeping"),
        (torch.Tensor, "backward", "backward (autograd)"),
        (guard_module.StepGuard, "run", "guard: bookkeeping"), (guard_module.StepGuard, "_backup", "guard: backup copy"),
        (guard_module, "_copy_into", "guard: backup copy"), (guard_module.StepGuard, "_moves", "guard: moves"),
        (guard_module, "_all_finite", "guard: finiteness"), (guard_module.StepGuard, "_bound_steps", "guard: step bound"),
        (worker, "_update", "optimizer step"),
    ]:
        timers.wrap(owner, attr, name)
    if hasattr(wire, "encode_lean"):
        timers.wrap(wire, "encode_lean", "wire: encode")
    _ = stage_module  # the worker module is wrapped through StageWorker
    x = torch.randn(batch, width)
    g = torch.randn(batch, width) * 1e-3
    encode = getattr(wire, "encode_lean", wire.encode_tensors)  # the stage's encoder (before issue 29: encode_tensors)
    # what arrives: the stream's messages as bytes off the socket (the sender's work is not the stage's)
    arrived = [[m.SerializeToString() for m in streams.split_message(encode([t]), b"", runtime_pb2.ExpertRequest)]
               for t in (x, g)]
    loop = asyncio.new_event_loop()

    async def messages(raw: list[bytes]):
        for data in raw:
            yield runtime_pb2.ExpertRequest.FromString(data)  # what hivemind's stream handler hands us

    def one(mb: str) -> None:
        for op, raw in (("forward", arrived[0]), ("backward", arrived[1])):
            with timers.section("wire: parse and join the stream's parts"):
                serialized, _ = loop.run_until_complete(streams.join_stream(messages(raw), max_bytes))
            tensors = stage_rpc.decode_tensors(serialized, max_bytes, coded=True)
            receipts.tensor_digest(serialized[0])
            out, _ = stage_rpc.dispatch(worker, op, tensors, {"mb": mb})
            reply = encode(out)
            receipts.tensor_digest(reply[0])
            with timers.section("wire: cut into parts and serialize"):
                for message in streams.split_message(reply, b"", runtime_pb2.ExpertResponse):
                    message.SerializeToString()  # what hivemind's stream writer does with it

    for i in range(3):
        one(f"warm-{i}")
    timers.exclusive.clear()
    cpu = time.thread_time()
    for i in range(reps):
        one(f"mb-{i}")
    total = time.thread_time() - cpu
    timers.restore()
    steps = {name: 1000 * spent / reps for name, spent in sorted(timers.exclusive.items(), key=lambda kv: -kv[1])}
    steps["unwrapped (dispatch, event loop)"] = 1000 * total / reps - sum(steps.values())
    compute = sum(steps.get(k, 0.0) for k in ("forward (graph)", "backward (autograd)", "optimizer step"))
    return {"ms_per_microbatch": 1000 * total / reps, "compute_ms": compute,
            "overhead_vs_compute": (1000 * total / reps - compute) / compute, "steps_ms": steps}


def main(argv: list[str] | None = None) -> int:
    parser = common_parser("stage_split", __doc__)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--stage", type=int, default=1)
    args = parser.parse_args(argv)
    started = time.monotonic()
    report = {"machine": machine_notes(), **split(args.reps, args.width, args.batch, args.stage)}
    for name, ms in report["steps_ms"].items():
        say(f"{name:45s} {ms:8.2f} ms")
    say(f"{'total':45s} {report['ms_per_microbatch']:8.2f} ms (compute {report['compute_ms']:.1f})")
    return finish(report, "stage_split", started, argparse.Namespace(json=args.json))


if __name__ == "__main__":
    sys.exit(main())
