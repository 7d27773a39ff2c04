"""A hostile stage peer that plays by the protocol: a real stage (worker, gate, receipt desk) that signs every reply
with its own key, so drivers and the next stages accept its tensors as its own, and then lies in one way
(``TWISTS``). What signed receipts change is who gets blamed: these attacks test that it is the signer.

- ``huge_gradient``: trains honestly, but the input gradient it returns is sign(g) x 9.9e5 (under a driver's reply
  bound of 1e6, so it passes the driver's checks);
- ``lying_eval``: trains honestly, but every evaluation it answers says 100 % accuracy and zero loss;
- ``ascent_gradient``: trains honestly, but every input gradient it returns (training, and the recomputations a
  driver's spot check asks of it) points the other way, at the honest norm: plausible, signed, and gradient ascent
  for every stage upstream;
- ``trained_to_harm``: computes everything honestly from its own weights (every recomputation a referee makes holds),
  but trains them by gradient ascent, its own health checks (which would heal it) off: its copy gets worse with every update, and so does the loss of whatever goes
  through it (swarm/pipeline/control/route_losses.py is what sees it);
- ``hidden_harm``: ``trained_to_harm``, and a last stage that hides it: every loss it reports (and signs) is a
  quarter of the one it computed, so the losses of the routes through it look better than through an honest copy
  (only a referee that recomputes the loss from its committed weights sees the lie: swarm/pipeline/recompute.py);
- ``withholding_harm``: ``trained_to_harm``, and it shows a referee the weights of every other version only (the
  odd ones are "gone"): a judgement of an even version holds, and the audit of the update after it never gets its
  next version;
- ``unpinned_harm``: ``withholding_harm`` that never keeps a version for an audit (its answer to a pin: not kept);
- ``hiding_harm``: ``trained_to_harm`` that shows a referee no version at all;
- ``capped_harm``: a last stage trained to harm that keeps its own loss under ``CAPPED_SHARE`` of the chance loss
  (ascent below it, descent above), under the floor at which route losses hold a last stage off.
"""

from __future__ import annotations

import asyncio
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

TWISTS = ("huge_gradient", "lying_eval", "ascent_gradient", "trained_to_harm", "hidden_harm", "capped_harm",
          "withholding_harm", "unpinned_harm", "hiding_harm")
CAPPED_SHARE = 0.8  # capped_harm: a last stage trained to harm that keeps its loss under this share of the chance loss
HUGE_VALUE = 9.9e5


def serve_signed_stage(hostile: Any, swarm: str, params: dict[str, torch.Tensor], twist: str) -> Any:
    """Register a real, signing stage servicer of ``swarm`` on ``hostile`` (a tests/hostile.py HostilePeer)."""
    from swarm.integrity.labels import LabelSource
    from swarm.pipeline.stage import stage_rpc
    from swarm.pipeline.transport.keybook import KeyBook
    from swarm.pipeline.stage.worker import StageWorker
    from swarm.pipeline.stage.stage_gate import StageGate
    from swarm.pipeline.stage.stage_receipts import ReceiptDesk
    from swarm.run.data import load_dataset, make_shards

    if twist not in TWISTS:
        raise ValueError(f"unknown twist {twist!r}; choose one of {TWISTS}")
    run = hostile.run
    k = int(swarm.removeprefix("layer"))
    worker = StageWorker(run, k)
    worker.module.load_state_dict(params)
    _twist(worker, twist)
    dataset = load_dataset(run.data, run.model)
    labels = LabelSource(dataset.y_train, dataset.y_test, make_shards(dataset.y_train, run.data, dataset.num_classes))

    async def read_drivers() -> list:
        return await asyncio.get_running_loop().run_in_executor(None, hostile.membership.read, "layer0")

    async def fetch_key(peer_id: str, name: str) -> bytes:
        from hivemind.p2p import PeerID
        from hivemind.proto import runtime_pb2

        from swarm.pipeline.transport.wire import unpack_metadata

        stub = stage_rpc.StageServicer.get_stub(hostile.p2p, PeerID.from_base58(peer_id),
                                                namespace=stage_rpc.stage_namespace(run.run_id, name))
        reply = await stub.rpc_receipt_key(runtime_pb2.ExpertRequest())
        return unpack_metadata(reply.metadata).get("key", b"")

    gate = StageGate(run.integrity, labels=labels, refresh=read_drivers, swarm=swarm,
                     balance=run.data.partition == "label_skewed")
    desk = ReceiptDesk(run.run_id, k, hostile.receipt_key, KeyBook(fetch_key))
    servicer = stage_rpc.make_servicer(worker, ThreadPoolExecutor(max_workers=1), codec=run.training.codec,
                                       max_bytes=int(run.training.max_payload_mb * 2**20), is_accepting=lambda: True,
                                       traffic=stage_rpc.Traffic(), gate=gate, desk=desk)
    servicer.requests = 0
    servicer.training_at = []  # monotonic times of the training ops it was sent (forward_backward, backward)
    handle = servicer._handle

    async def counted(serialized, metadata, context):
        out, meta = await handle(serialized, metadata, context)
        servicer.requests += 1
        try:
            op = stage_rpc.unpack_metadata(metadata).get("op")
        except Exception:
            op = None
        if op in ("forward_backward", "backward"):
            servicer.training_at.append(time.monotonic())
        return out, meta

    servicer._handle = counted
    hostile.on_loop(servicer.add_p2p_handlers(hostile.p2p, namespace=stage_rpc.stage_namespace(run.run_id, swarm)))
    hostile.servicers.append(servicer)
    return servicer


def _twist(worker: Any, twist: str) -> None:
    if twist == "huge_gradient":
        honest = worker.forward_backward

        def forward_backward(mb, x, y, owner="", **kw):
            loss, grad = honest(mb, x, y, owner=owner, **kw)
            return loss, torch.where(grad >= 0, HUGE_VALUE, -HUGE_VALUE)

        worker.forward_backward = forward_backward
    elif twist == "ascent_gradient":
        honest_fb, honest_bw, honest_check = worker.forward_backward, worker.backward, worker.input_gradient

        def ascent_fb(mb, x, y, owner="", **kw):
            loss, grad = honest_fb(mb, x, y, owner=owner, **kw)
            return loss, None if grad is None else -grad

        def ascent_bw(mb_id, grad_out, x, loss, owner=""):
            grad = honest_bw(mb_id, grad_out, x, loss, owner=owner)
            return None if grad is None else -grad

        def ascent_check(x, y=None, grad_out=None):
            loss, grad = honest_check(x, y, grad_out)
            return loss, -grad

        worker.forward_backward, worker.backward, worker.input_gradient = ascent_fb, ascent_bw, ascent_check
    elif twist in ("trained_to_harm", "hidden_harm", "capped_harm", "withholding_harm", "unpinned_harm", "hiding_harm"):
        optimizer = worker.optimizer
        # an attacker does not let its own health checks take it out of the run: a last stage trained to harm saw
        # its loss explode, refused as "healing" and restored its good snapshot (benchmarks.adversary, session 15)
        worker.health.observe_local_loss = lambda *args, **kwargs: None
        worker._refuse_if_sick = lambda: None
        honest_fb, honest_check = worker.forward_backward, worker.input_gradient
        climbs = lambda: True  # noqa: E731
        if twist == "hidden_harm" and worker.is_last:

            def hiding_fb(mb, x, y, owner="", **kw):
                loss, grad = honest_fb(mb, x, y, owner=owner, **kw)
                return loss / 4, grad

            def hiding_check(x, y=None, grad_out=None):
                loss, grad = honest_check(x, y, grad_out)
                return (loss / 4 if loss is not None else None), grad

            worker.forward_backward, worker.input_gradient = hiding_fb, hiding_check
        elif twist == "capped_harm":  # a last stage: ascent while its loss is under the cap, descent above it
            model, seen = worker.run.model, {"loss": 0.0}
            cap = CAPPED_SHARE * math.log(model.num_classes if model.kind == "mlp" else model.vocab_size)

            def tracking_fb(mb, x, y, owner="", **kw):
                loss, grad = honest_fb(mb, x, y, owner=owner, **kw)
                seen["loss"] = loss
                return loss, grad

            worker.forward_backward = tracking_fb
            climbs = lambda: seen["loss"] < cap  # noqa: E731

        def ascent_update() -> None:
            if climbs():
                for param in worker.module.parameters():
                    if param.grad is not None:
                        param.grad.neg_()
            optimizer.step()

        worker.set_update_rule(ascent_update)
        show = worker.ring.show  # what a referee's fetch gets (swarm/pipeline/stage/weights_rpc.py)
        if twist == "withholding_harm":  # shows a referee every other version only: no audit (v -> v+1) ever completes
            worker.ring.show = lambda digest, *args: (
                (None, False) if (kept := show(digest, *args))[0] is not None and kept[0].version % 2 else kept)
        elif twist == "unpinned_harm":  # ... and keeps no version for an audit (its answer: not pinned)
            worker.ring.show = lambda digest, now=None, *args: (
                (None, False) if (kept := show(digest, now))[0] is not None and kept[0].version % 2 else kept)
        elif twist == "hiding_harm":  # shows no version at all
            worker.ring.show = lambda digest, *args: (None, False)
    elif twist == "lying_eval":
        worker.evaluate = lambda x, y: (0.0, len(y), len(y))
