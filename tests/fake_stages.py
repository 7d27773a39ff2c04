"""Fake remote stages for driver tests: the driver's real code, a real stage-0 worker, and peers that
answer (or do not) through a stand-in for ``call_stage``. No network: fast, and every behaviour is exact.

A peer's behaviour is a function ``(op, tensors, meta) -> (tensors, reply meta)`` or one of the
names in BEHAVIOURS. Every call is recorded in ``FakeSwarm.calls`` as (peer, op, tensors, meta).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from swarm.run.data import load_dataset, make_shards
from swarm.pipeline.control.driver import PipelineDriver
from swarm.run.models import stage_input_spec, stage_output_spec
from swarm.run.runconfig import RunConfig
from swarm.pipeline.stage.worker import StageWorker
from swarm.pipeline.stage.push import PUSH_OPS, SHOW_OP
from swarm.integrity.receipts import NO_FIGURES, Receipt, ReceiptKey, figures_digest, loss_digest, tensor_digest
from swarm.pipeline.stage.stage_rpc import refusal_error
from swarm.pipeline.transport.wire import serialize_once


def honest(run: RunConfig, k: int) -> Callable:
    """Right shapes, small values, a finite loss: what a healthy stage answers."""

    inputs: dict[str, torch.Tensor] = {}  # mb -> the input of its forward (a backward's gradient depends on it)

    def answer(op, tensors, meta):
        batch = tensors[0].shape[0]
        if op in ("forward", "infer"):
            if op == "forward":
                inputs[meta.get("mb", "")] = tensors[0]
            return [torch.full(tuple(d or batch for d in stage_output_spec(run.model, k).shape), 0.1)], {"ok": True}
        if op in ("backward", "forward_backward", "backward_check", "forward_backward_check"):
            # tiny: the same gradient every time never stops pushing, and a larger one overflowed the real layer0
            # copy within a few hundred updates (its guard then refused them, as it should)
            # and zero-mean: a constant one pushed every output of layer0 down until each of its ReLUs died (its
            # collapse rule then, rightly, called the copy sick); a function of the input, as a real stage's is,
            # so a spot check's recomputation at another honest peer agrees with it
            x = tensors[0] if op.startswith("forward_backward") else tensors[1] if len(tensors) == 2 else \
                inputs.pop(meta.get("mb", ""), None)
            shape = tuple(d or batch for d in stage_input_spec(run.model, k).shape)
            grad = 1e-4 * torch.sin(1000.0 * x.float()) if x is not None and tuple(x.shape) == shape else \
                1e-4 * torch.randn(shape)
            return [grad], {"ok": True, "loss": 0.5} if op.startswith("forward_backward") else {"ok": True}
        if op == "evaluate":
            return [], {"ok": True, "loss_sum": 0.5 * batch, "correct": batch // 2, "count": batch}
        raise AssertionError(op)

    return answer


def refusing(code: str, **extra) -> Callable:
    def answer(op, tensors, meta):
        return [], {"ok": False, "code": code, "error": f"fake {code}", **extra}

    return answer


def malformed(kind: str, run: RunConfig, k: int) -> Callable:
    """A last stage that says ok and sends something unusable."""
    good = honest(run, k)

    def answer(op, tensors, meta):
        out, reply = good(op, tensors, meta)
        if kind == "no_tensor":
            return [], reply
        if kind == "wrong_shape":
            return [torch.zeros(3, 7)], reply
        if kind == "nan":
            return [torch.full_like(out[0], float("nan"))], reply
        if kind == "huge":
            return [torch.full_like(out[0], 3e38)], reply
        if kind == "garbage_meta":
            return out, {"ok": True, "loss": "a lot"}
        if kind == "nan_loss":
            return out, {"ok": True, "loss": float("nan")}
        raise AssertionError(kind)

    return answer


BLACK_HOLE = "black_hole"


class FakeSwarm:
    """Peers by id (``{swarm: {peer: behaviour}}``) and the ``call`` the driver uses to reach them. Each answer takes
    ``service_s``: 10 ms, where 2 ms had the driver's lanes and its stage-0 copy train flat out for every second a
    test drives (the suite is bound by its CPU; test_driver_hops 44 -> 30 s of CPU, test_spot_checks 17 -> 9,
    test_route_losses 15 -> 8, the same assertions)."""

    def __init__(self, peers: dict[str, dict[str, Callable | str]], service_s: float = 0.01):
        self.peers = peers
        self.service_s = service_s
        self.calls: list[tuple[str, str, list[torch.Tensor], dict, float]] = []
        self.run_id = ""  # set by make_driver: what the fake peers' receipts name
        self.keys: dict[str, ReceiptKey] = {}
        self.inputs: dict[tuple[str, str], tuple[bytes, bytes]] = {}  # (peer, mb) -> its forward's input digest, ids

    async def call(self, p2p, peer_id, namespace, op, tensors, meta, *, timeout_s, codec, max_bytes,
                   expect_bytes=0, traffic=None, rank=8):
        swarm = namespace.rsplit(".", 1)[1]
        behaviour = self.peers[swarm][peer_id]
        if op in PUSH_OPS or op == SHOW_OP:  # fake peers are relayed to (an older client's answer): these tests are
            raise refusal_error({"ok": False, "code": "rejected", "error": f"unknown op {op!r}"})  # the relay's
        self.calls.append((peer_id, op, tensors, dict(meta), time.monotonic()))
        started = time.perf_counter()

        async def serve():
            if behaviour == BLACK_HOLE:
                await asyncio.Event().wait()  # accepts the request, never answers
            await asyncio.sleep(self.service_s)
            return behaviour(op, tensors, meta)

        out, reply = await asyncio.wait_for(serve(), timeout_s)
        if reply.get("ok") is not True:
            raise refusal_error(reply)
        return out, {**reply, **self._receipt(peer_id, swarm, op, meta, out, reply)}, time.perf_counter() - started

    def _receipt(self, peer_id: str, swarm: str, op: str, meta: dict, out: list, reply: dict) -> dict:
        """What a real stage signs on its reply (swarm/pipeline/stage/stage_receipts.py), so the driver's checks hold."""
        if "rc" in reply or not isinstance(meta.get("rc"), list):  # a behaviour that signs (or forges) its own
            return {}
        key = self.keys.setdefault(peer_id, ReceiptKey(peer_id))
        mb = meta.get("mb", "")
        received = [Receipt.from_wire(r) for r in meta["rc"]]
        if op in ("backward", "backward_check"):
            link = self.inputs.get((peer_id, mb)) if len(received) == 1 else (received[1].output, received[1].ids)
            link = link or (b"\0" * 16, b"\0" * 16)
        else:
            link = (received[0].output, received[0].ids)
        if op == "forward":
            self.inputs[(peer_id, mb)] = link
        if op == "evaluate" and all(name in reply for name in ("loss_sum", "correct", "count")):
            output = figures_digest(reply["loss_sum"], reply["correct"], reply["count"])
        elif out and isinstance(out[0], torch.Tensor):
            output = tensor_digest(serialize_once(out[0]))
        else:
            output = b"\0" * 16
        loss = reply.get("loss") if op in ("forward_backward", "forward_backward_check") else None
        figures = loss_digest(loss) if isinstance(loss, (int, float)) and not isinstance(loss, bool) else NO_FIGURES
        receipt = key.sign(self.run_id, mb, op, int(swarm.removeprefix("layer")), 0, link[0], output, link[1],
                           figures=figures)
        return {"rc": receipt.to_wire(), "rk": key.public}

    def calls_to(self, peer: str, op: str | None = None) -> list:
        return [c for c in self.calls if c[0] == peer and (op is None or c[1] == op)]


def make_driver(run: RunConfig, fake: FakeSwarm) -> tuple[PipelineDriver, ThreadPoolExecutor]:
    dataset = load_dataset(run.data, run.model)
    shards = make_shards(dataset.y_train, run.data, dataset.num_classes)
    executor = ThreadPoolExecutor(max_workers=1)
    fake.run_id = run.run_id
    driver = PipelineDriver(run, StageWorker(run, 0), None, executor, dataset, shards, 0, peer_tag="test",
                            call=fake.call, receipt_key=ReceiptKey("QmTestDriver"))
    # fake peers compute from no weights, so they can show none: disputes among them go to the vote as before the
    # referee (which tests/test_referee.py tests against real stages)
    driver.spot.referee = None
    for swarm, peers in fake.peers.items():
        driver.set_peers(swarm, list(peers))
    return driver, executor


MAX_DRIVE_S = 30.0  # a loaded machine may need this long for the micro-batches a test asks for


def drive(run: RunConfig, fake: FakeSwarm, seconds: float, during: Callable | None = None,
          min_microbatches: int = 0, until: Callable[[PipelineDriver], bool] | None = None) -> PipelineDriver:
    """Run the driver's lanes for ``seconds`` (``during(driver)``: a coroutine run alongside), then until
    ``min_microbatches`` completed and ``until(driver)`` holds (at most MAX_DRIVE_S in all: a busy machine is slow,
    not broken), then stop."""
    driver, executor = make_driver(run, fake)

    async def main():
        task = asyncio.create_task(driver.run_forever())
        try:
            if during is not None:
                await during(driver)
            await asyncio.sleep(seconds)
            deadline = asyncio.get_running_loop().time() + MAX_DRIVE_S
            while (driver.stats.microbatches < min_microbatches or (until is not None and not until(driver))) \
                    and asyncio.get_running_loop().time() < deadline:
                if task.done():
                    break
                await asyncio.sleep(0.1)
            if task.done():
                raise AssertionError(f"the driver ended while it should train: {task.exception()!r}")
        finally:
            driver.stop()
            task.cancel()  # lanes waiting on a black hole end now, not at their timeout
            await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 30)

    try:
        asyncio.run(main())
    finally:
        executor.shutdown(wait=False)
    return driver
