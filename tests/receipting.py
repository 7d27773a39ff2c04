"""Receipts for tests that speak the stage protocol by hand (swarm/integrity/receipts.py).

A test that drives a stage directly plays the layer0 driver: it signs its own stage 0's output (as the real
driver does, swarm/pipeline/driver.py) and relays the receipts the stages return."""

from __future__ import annotations

from typing import Any

import torch

from swarm.integrity.receipts import ReceiptKey, ids_digest, tensor_digest
from swarm.pipeline.stage0_replicas import ids_bytes
from swarm.pipeline.wire import serialize_once


def stage0_meta(key: ReceiptKey, run_id: str, mb: str, h: torch.Tensor, ids: Any = None, op: str = "forward",
                codec: str = "float32") -> dict:
    """The metadata of a request that carries ``h`` as our own stage 0's output, signed by ``key`` (whose peer id
    must be the requester's). ``ids``: the sample ids it was computed from (default: 0..batch-1)."""
    ids_d = ids_digest(ids if ids is not None else torch.arange(h.shape[0]))
    item = serialize_once(h, codec)
    receipt = key.sign(run_id, mb, "infer" if op in ("infer", "evaluate") else "forward", 0, 0, ids_d,
                       tensor_digest(item), ids_d)
    meta = {"mb": mb, "rc": [receipt.to_wire()], "rk": key.public}
    if op == "forward":  # stage 1 takes a forward's sample ids with it (swarm/pipeline/stage0_checks.py)
        meta["ids"] = ids_bytes(ids if ids is not None else torch.arange(h.shape[0]))
    return meta


def relay_meta(key: ReceiptKey, mb: str, *receipts: Any) -> dict:
    """The metadata of a request that relays ``receipts`` (wire form, as a stage's reply carries them in ``rc``)."""
    return {"mb": mb, "rc": list(receipts), "rk": key.public}
