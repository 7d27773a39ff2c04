"""A peer of the tests' own that joins a run's swarm over the real DHT and P2P, announces itself
``online``, and answers stage RPCs the way the test wants: never (a black hole), with malformed
replies, or honestly.

``honest`` is a last stage: a real StageWorker behind the labels-by-id protocol (the targets are
looked up in the run's data by the sample ids the driver sends). Once the stage server does this
itself, a real ``volunteer join`` can take this role.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from swarm.run.data import load_dataset
from swarm.dht.dht import DHTSettings, ensure_identity, fresh_p2p, make_validators, shutdown_dht, start_dht
from swarm.dht.membership import Membership
from swarm.dht.records import MemberRecord
from swarm.run.runconfig import RunConfig
from swarm.pipeline.stage.worker import StageWorker
from swarm.pipeline.stage import stage_rpc
from swarm.pipeline.stage.stage_rpc import stage_namespace
from swarm.integrity.receipts import Receipt, ReceiptKey
from swarm.pipeline.transport.keybook import KeyBook
from swarm.pipeline.stage.stage_receipts import ReceiptDesk, Vouched
from swarm.integrity.identity_work import identity_work
from swarm.pipeline.transport.wire import decode_tensors, encode_tensors, unpack_metadata

MALFORMED_KINDS = ("no_tensor", "wrong_shape", "nan", "garbage_meta", "huge")
SETUP_TIMEOUT_S = 60.0


class StageServicer(stage_rpc.StageServicer):
    """hivemind names a handler after its class: same name as the real servicer, so drivers reach it."""

    def __init__(self, impostor: "Impostor"):
        super().__init__(max_bytes=64 * 2**20)
        self.impostor = impostor

    async def _handle(self, serialized, metadata, context):
        meta = unpack_metadata(metadata)
        if meta.get("op") == "weights" and self.impostor.mode == "honest":  # shows what it committed to, as a real stage
            return await self.shown.serve(self.impostor.worker, str(context.remote_id), meta)
        out, reply = await self.impostor.answer(decode_tensors(serialized, self.max_bytes), meta)
        items = encode_tensors(out)
        if self.impostor.mode == "honest" and reply.get("ok"):  # signs what it computed, as a real stage does
            received = Receipt.from_wire(meta["rc"][0])
            vouched = Vouched(mb=meta["mb"], input=received.output, ids=received.ids)
            op = meta["op"]
            figures = (reply["loss_sum"], reply["correct"], reply["count"]) if op == "evaluate" else None
            version, weights = reply.pop("committed")
            loss = reply.get("loss") if op in ("forward_backward", "forward_backward_check") else None
            reply = {**reply, "rc": self.impostor.desk.sign(str(context.remote_id), op, vouched, items, version, figures,
                                                           weights, loss=loss), "rk": self.impostor.desk.key.public}
        return items, reply


class Impostor:
    """``mode``: "black_hole", "malformed" (cycles through MALFORMED_KINDS) or "honest"."""

    def __init__(self, run: RunConfig, swarm: str, maddr: str, mode: str, identity: Path):
        self.run, self.swarm, self.mode = run, swarm, mode
        self.index = int(swarm.removeprefix("layer"))
        self.requests = 0
        self.answered = 0
        ensure_identity(identity)  # the record's peer id must be the one its signing key owns
        validators = make_validators(run.run_id, run.swarm_names, identity)
        self.dht = start_dht(DHTSettings(initial_peers=[maddr], identity_path=identity), validators)
        self.peer_id = str(self.dht.peer_id)
        self.membership = Membership(self.dht, run, validators[0].local_public_key)
        self.membership.work = identity_work(identity, self.peer_id, run.integrity.identity_bits)  # as a stranger pays
        self.worker = StageWorker(run, self.index) if mode == "honest" else None
        self.desk = ReceiptDesk(run.run_id, self.index, ReceiptKey(self.peer_id), KeyBook())
        self.dataset = load_dataset(run.data, run.model) if mode == "honest" else None
        self.executor = ThreadPoolExecutor(max_workers=1)
        self._stop = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._threads = [threading.Thread(target=self._loop.run_forever, daemon=True),
                         threading.Thread(target=self._heartbeat, daemon=True)]
        self._p2p = None
        self._servicer: StageServicer | None = None
        self._started_at = time.time()

    def __enter__(self) -> "Impostor":
        self._threads[0].start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(SETUP_TIMEOUT_S)
        self._threads[1].start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._threads[1].join(10)
        if self._p2p is not None:
            if self._servicer is not None:  # its sessions end on the loop, as a peer's stop ends them
                asyncio.run_coroutine_threadsafe(self._servicer.end_sessions(5), self._loop).result(10)
            asyncio.run_coroutine_threadsafe(self._p2p.shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._threads[0].join(5)
        self.executor.shutdown(wait=False)
        shutdown_dht(self.dht)

    async def _serve(self) -> None:
        self._p2p = await fresh_p2p(self.dht)
        self._servicer = StageServicer(self)
        await self._servicer.add_p2p_handlers(self._p2p, namespace=stage_namespace(self.run.run_id, self.swarm))

    def _heartbeat(self) -> None:
        while not self._stop.is_set():
            record = MemberRecord(peer_id=self.peer_id, state="online", version="0.1.0",
                                  started_at=self._started_at, updated_at=time.time())
            self.membership.announce(self.swarm, record, timeout_s=5.0)
            self._stop.wait(self.run.timeouts.heartbeat_s)

    async def answer(self, tensors: list[torch.Tensor], meta: dict) -> tuple[list[torch.Tensor], dict]:
        if meta.get("op") in ("push_forward", "push_forward_backward", "show"):  # as a client from before pushes
            return [], {"ok": False, "code": "rejected", "error": f"unknown op {meta.get('op')!r}"}
        self.requests += 1
        if self.mode == "black_hole":
            await asyncio.Event().wait()  # accepted, never answered
        if self.mode == "malformed":
            kind = MALFORMED_KINDS[(self.requests - 1) % len(MALFORMED_KINDS)]
            return _malformed(kind, tensors)
        loop = asyncio.get_running_loop()
        out, reply = await loop.run_in_executor(self.executor, self._committed_stage, meta.get("op"), tensors, meta)
        self.answered += 1
        return out, reply

    def _committed_stage(self, op: str, tensors: list[torch.Tensor], meta: dict) -> tuple[list[torch.Tensor], dict]:
        """``_last_stage``, and the weights it ran with (read on the compute thread, before another request runs)."""
        out, reply = self._last_stage(op, tensors, meta)
        return out, {**reply, "committed": self.worker.committed}

    def _last_stage(self, op: str, tensors: list[torch.Tensor], meta: dict) -> tuple[list[torch.Tensor], dict]:
        """An honest last stage of the labels-by-id protocol (the only ops a last stage serves)."""
        x, ids = tensors
        x = self.worker.check_input(x)
        if op == "evaluate":
            loss_sum, correct, count = self.worker.evaluate(x, self.dataset.y_test[ids])
            return [], {"ok": True, "loss_sum": loss_sum, "correct": correct, "count": count}
        if op == "forward_backward_check":  # a driver's spot check of another last-stage peer's gradient
            loss, grad = self.worker.input_gradient(x, self.dataset.y_train[ids])
            return [grad], {"ok": True, "loss": loss}
        assert op == "forward_backward", op
        loss, grad = self.worker.forward_backward(meta["mb"], x, self.dataset.y_train[ids])
        return [grad], {"ok": True, "loss": loss}


def _malformed(kind: str, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict]:
    x = tensors[0]
    if kind == "no_tensor":
        return [], {"ok": True, "loss": 0.5}
    if kind == "wrong_shape":
        return [torch.zeros(x.shape[0] + 1, 3)], {"ok": True, "loss": 0.5}
    if kind == "nan":
        return [torch.full_like(x, float("nan"))], {"ok": True, "loss": 0.5}
    if kind == "garbage_meta":
        return [torch.zeros_like(x)], {"ok": True, "loss": [1, 2], "count": "many"}
    return [torch.full_like(x, 3e38)], {"ok": True, "loss": 0.5}
