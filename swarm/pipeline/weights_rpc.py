"""The ``weights`` op: a signer shows the weights it committed to in a receipt, for a referee to recompute the hop.

Request metadata ``{"op": "weights", "digest": <16 bytes>}``, no tensors; reply: the tensors of that version in
name order, in float32 on the wire whatever the run's codec (a recomputation needs the exact weights), and
``{"ok": true, "names": [...]}``; or ``weights_gone`` (that version was dropped from the ring: it is older than
``weights.KEEP_S`` or the ring's memory bound) or ``busy`` (the door's rate). Unsigned: the digest the receipt signed
is the proof, the referee hashes what it received (a mismatch is the signer's lie, swarm/pipeline/referee.py).

Anyone of the run may ask (a referee is a driver or any third peer), so the door bounds what asking costs the
stage: ``MAX_SHOWING`` answers at once in all, ``PER_REQUESTER`` per requester, and one per ``MIN_INTERVAL_S`` per
requester (a driver with several lanes in flight referees several hops at once).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from swarm.integrity.receipts import DIGEST_BYTES
from swarm.pipeline.wire import WireError, encode_off_loop, refusal_meta

WEIGHTS_OP = "weights"
MAX_SHOWING = 8
PER_REQUESTER = 4  # a driver's lanes referee hops in parallel (in_flight 4 by default)
MIN_INTERVAL_S = 0.005
BUSY_RETRY_S = 0.25
MAX_REQUESTERS = 4096
FETCH_TRIES = 8  # a busy door is asked again this many times at most (~2 s at its retry_after_s)


class WeightsDoor:
    def __init__(self) -> None:
        self.showing = 0
        self.shown = 0  # versions sent
        self.gone = 0  # asked for a version no longer kept
        self._last: dict[str, float] = {}
        self._busy: dict[str, int] = {}

    async def serve(self, worker: Any, requester: str, meta: dict) -> tuple[list[Any], dict]:
        digest = meta.get("digest")
        if worker is None or not isinstance(digest, bytes) or len(digest) != DIGEST_BYTES:
            return [], refusal_meta("rejected", "weights: a 16-byte 'digest' of a version this stage signed, please")
        now = time.monotonic()
        if self.showing >= MAX_SHOWING or self._busy.get(requester, 0) >= PER_REQUESTER or \
                now - self._last.get(requester, float("-inf")) < MIN_INTERVAL_S:
            return [], refusal_meta("busy", "showing weights to other referees: ask again", BUSY_RETRY_S)
        tensors = worker.weights_for(digest)
        if tensors is None:
            self.gone += 1
            return [], refusal_meta("weights_gone", "that version of the weights is no longer kept here")
        if len(self._last) >= MAX_REQUESTERS:
            self._last.clear()
        self._last[requester] = now
        self.showing += 1
        self._busy[requester] = self._busy.get(requester, 0) + 1
        try:
            names = sorted(tensors)
            serialized = await encode_off_loop([tensors[name] for name in names], "float32")
            self.shown += 1
            return serialized, {"ok": True, "names": names}
        finally:
            self.showing -= 1
            if self._busy[requester] <= 1:
                del self._busy[requester]
            else:
                self._busy[requester] -= 1


async def fetch_weights(p2p: Any, peer: str, namespace: str, digest: bytes, *, expect_bytes: int, timeout_s: float,
                        call: Any = None, tries: int = FETCH_TRIES) -> dict[str, torch.Tensor]:
    """The tensors ``peer`` committed to under ``digest`` (not yet checked against it: the caller hashes them). A
    ``busy`` door is asked again after its retry_after_s (busy is no reason to give a verdict up), within
    ``timeout_s`` in all. Raises StageError (``weights_gone``, ``busy``...), WireError for a malformed reply, or a
    transport error or timeout."""
    from swarm.pipeline.stage_rpc import call_stage

    call = call or call_stage
    max_bytes = max(int(expect_bytes * 1.25) + 2**20, 8 * 2**20)
    deadline = time.monotonic() + timeout_s
    for attempt in range(tries):
        try:
            tensors, reply, _ = await call(p2p, peer, namespace, WEIGHTS_OP, [], {"digest": digest},
                                           timeout_s=max(0.01, deadline - time.monotonic()), codec="float32",
                                           max_bytes=max_bytes, expect_bytes=expect_bytes)
            break
        except Exception as exc:
            wait_s = min(1.0, getattr(exc, "retry_after_s", None) or BUSY_RETRY_S)
            if getattr(exc, "code", "") != "busy" or attempt == tries - 1 or time.monotonic() + wait_s >= deadline:
                raise
            await asyncio.sleep(wait_s)
    names = reply.get("names")
    if not isinstance(names, list) or len(names) != len(tensors) or not all(isinstance(n, str) for n in names) or \
            len(set(names)) != len(names):
        raise WireError("weights reply: 'names' does not match its tensors")
    return dict(zip(names, tensors))
