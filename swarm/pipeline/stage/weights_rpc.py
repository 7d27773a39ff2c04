"""The ``weights`` op: a signer shows the weights it committed to in a receipt, for a referee to recompute the hop.

Request metadata ``{"op": "weights", "digest": <16 bytes>}``, no tensors; reply: the tensors of that version in
name order, exactly as committed whatever the run's codec (a recomputation needs the exact weights: floating ones in
bfloat16, sent as their bits in one float16 tensor), and
``{"ok": true, "names": [...]}``; or ``weights_gone`` (that version was dropped from the ring: it is older than
``weights.KEEP_S`` or the ring's memory bound) or ``busy`` (the door's rate). Unsigned: the digest the receipt signed
is the proof, the referee hashes what it received (a mismatch is the signer's lie, swarm/pipeline/control/referee.py).
With ``"pin": true`` the stage also keeps the version after this one for ``weights.PIN_S`` (an audit of the update
that made it follows) and says so in the reply's ``"pinned"``: a pinned version called gone later was withheld; the
audit's fetch of it says ``"release": true``, and the stage lets it go.

Anyone of the run may ask (a referee is a driver or any third peer), so the door bounds what asking costs the
stage: ``MAX_SHOWING`` answers at once in all, ``PER_REQUESTER`` per requester, and one per ``MIN_INTERVAL_S`` per
requester (a driver with several lanes in flight referees several hops at once).
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import torch

from swarm.integrity.prediction import Derivation
from swarm.integrity.receipts import DIGEST_BYTES
from swarm.pipeline.transport.wire import WireError, encode_off_loop, refusal_meta

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

    async def serve(self, worker: Any, requester: str, meta: dict, may_pin: bool = True) -> tuple[list[Any], dict]:
        """``may_pin``: the requester is a driver of the run in this stage's view (pins are for their referees)."""
        digest = meta.get("digest")
        if worker is None or not isinstance(digest, bytes) or len(digest) != DIGEST_BYTES:
            return [], refusal_meta("rejected", "weights: a 16-byte 'digest' of a version this stage signed, please")
        now = time.monotonic()
        if self.showing >= MAX_SHOWING or self._busy.get(requester, 0) >= PER_REQUESTER:
            return [], refusal_meta("busy", "showing weights to other referees: ask again", BUSY_RETRY_S)
        since_s = now - self._last.get(requester, float("-inf"))
        if since_s < MIN_INTERVAL_S:  # ask again when the interval is over, not a quarter second later: an audit
            # fetches the version after the one its judgement just fetched (0.25 s lost per audit, 3 of a test's 4 s)
            return [], refusal_meta("busy", "one version at a time: ask again", max(0.001, MIN_INTERVAL_S - since_s))
        derivation = getattr(worker, "derivations", None) and worker.derivations.get(digest)
        if derivation:  # predicted weights: what they were made from (swarm/integrity/prediction.py), no tensors
            self._last[requester] = now
            return [], {"ok": True, "derived": [derivation.base, derivation.prev, derivation.tau]}
        pin = meta.get("pin") is True  # keep the next version for this referee's audit (weights.py PIN_S)
        # the current version is copied out then
        kept, pinned = await asyncio.to_thread(worker.ring.show, digest, None, requester, pin and may_pin,
                                               meta.get("release") is True)
        tensors = None if kept is None else kept.tensors
        if tensors is None:
            self.gone += 1
            return [], refusal_meta("weights_gone", "that version of the weights is no longer kept here")
        if len(self._last) >= MAX_REQUESTERS:
            self._last.clear()
        self._last[requester] = now
        self.showing += 1
        self._busy[requester] = self._busy.get(requester, 0) + 1
        try:
            if sum(t.numel() for t in tensors.values()) >= PACK_OFF_LOOP_VALUES:  # a copy of the whole stage: its
                flats, layout = await asyncio.to_thread(pack, tensors)  # 48 MB held a heavy driver's loop ~16 % of it
            else:
                flats, layout = pack(tensors)
            serialized = await encode_off_loop(flats, "float32")
            self.shown += 1
            return serialized, {"ok": True, **layout, **({"pinned": pinned} if pin else {})}
        finally:
            self.showing -= 1
            if self._busy[requester] <= 1:
                del self._busy[requester]
            else:
                self._busy[requester] -= 1


async def fetch_weights(p2p: Any, peer: str, namespace: str, digest: bytes, *, expect_bytes: int, timeout_s: float,
                        call: Any = None, tries: int = FETCH_TRIES, traffic: Any = None,
                        pinned: list | None = None, release: bool = False) -> dict[str, torch.Tensor] | Derivation:
    """The tensors ``peer`` committed to under ``digest`` (not yet checked against it: the caller hashes them), or the
    ``Derivation`` of predicted weights (``rebuild`` makes them from the two versions it names). A
    ``busy`` door is asked again after its retry_after_s (busy is no reason to give a verdict up), within
    ``timeout_s`` in all. Raises StageError (``weights_gone``, ``busy``...), WireError for a malformed reply, or a
    transport error or timeout. ``traffic``: where the bytes received are counted against ``peer`` (a referee's
    fetches are on its link as much as a hop's tensors: the dashboard's Mb/s and benchmarks.pipeline's data-plane).
    ``pinned``: ask the stage to keep the version after this one for an audit; whether it did is appended to it.
    ``release``: this is the audit's fetch of a version pinned for us: the stage may let it go."""
    from swarm.pipeline.transport.stage_client import call_stage

    call = call or call_stage
    max_bytes = max(int(expect_bytes * 1.25) + 2**20, 8 * 2**20)
    deadline = time.monotonic() + timeout_s
    for attempt in range(tries):
        try:
            ask = {"digest": digest, **({"pin": True} if pinned is not None else {}),
                   **({"release": True} if release else {})}
            tensors, reply, _ = await call(p2p, peer, namespace, WEIGHTS_OP, [], ask,
                                           timeout_s=max(0.01, deadline - time.monotonic()), codec="float32",
                                           max_bytes=max_bytes, expect_bytes=expect_bytes)
            break
        except Exception as exc:
            wait_s = min(1.0, getattr(exc, "retry_after_s", None) or BUSY_RETRY_S)
            if getattr(exc, "code", "") != "busy" or attempt == tries - 1 or time.monotonic() + wait_s >= deadline:
                raise
            await asyncio.sleep(wait_s)
    if traffic is not None:
        traffic.count(peer, inbound=sum(t.numel() * t.element_size() for t in tensors), op="referee weights")
    if pinned is not None:
        pinned.append(reply.get("pinned") is True)
    if "derived" in reply:
        return derivation_of(reply["derived"])
    return unpack(tensors, reply)


def derivation_of(raw: Any) -> Derivation:
    """A reply's ``derived``: [base digest, prev digest, tau]; WireError when malformed."""
    if not (isinstance(raw, (list, tuple)) and len(raw) == 3 and all(isinstance(d, bytes) and len(d) == DIGEST_BYTES
                                                                      for d in raw[:2])
            and isinstance(raw[2], int) and not isinstance(raw[2], bool)):
        raise WireError("weights: 'derived' is [base digest, previous digest, updates ahead]")
    return Derivation(bytes(raw[0]), bytes(raw[1]), int(raw[2]))


# ----- a stage's tensors as one flat tensor per dtype (a message carries at most wire.MAX_TENSORS tensors, and a
# transformer stage has dozens): metadata "names", "shapes", "dtypes" in name order say how to cut them apart

PACKED_DTYPES = ("float32", "float16", "bfloat16", "int64")
PACK_OFF_LOOP_VALUES = 1 << 20  # a version this large is packed on a worker thread (the tensors stay held: the ring
# reuses a version's buffers only when nothing outside it holds them, WeightsRing._take_spare)
MAX_PACKED_NAMES = 4096


def pack(tensors: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], dict]:
    names = sorted(tensors)
    dtypes = [str(tensors[n].dtype).removeprefix("torch.") for n in names]
    if any(d not in PACKED_DTYPES for d in dtypes):
        raise ValueError(f"a stage tensor of a dtype the wire does not carry: {sorted(set(dtypes))}")
    flats = []
    for dtype in PACKED_DTYPES:
        parts = [tensors[n].detach().reshape(-1) for n, d in zip(names, dtypes) if d == dtype]
        if parts:
            flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
            # bfloat16 travels as its bits in a float16 tensor: 2 bytes a value, where hivemind sends bfloat16 as
            # float32 (its legacy default); a committed version is bfloat16, so a referee's fetch halves
            flats.append(flat.view(torch.float16) if dtype == "bfloat16" else flat)
    return flats, {"names": names, "shapes": [list(tensors[n].shape) for n in names], "dtypes": dtypes}


def unpack(flats: list[torch.Tensor], meta: dict) -> dict[str, torch.Tensor]:
    """The tensors ``pack`` made ``flats`` of; a stranger's layout that does not add up is a WireError."""
    names, shapes, dtypes = meta.get("names"), meta.get("shapes"), meta.get("dtypes")
    if not (isinstance(names, list) and isinstance(shapes, list) and isinstance(dtypes, list)) or \
            not 0 < len(names) == len(shapes) == len(dtypes) <= MAX_PACKED_NAMES or len(set(names)) != len(names) or \
            not all(isinstance(n, str) and isinstance(d, str) and d in PACKED_DTYPES for n, d in zip(names, dtypes)) or \
            not all(isinstance(sh, list) and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**31
                                                  for v in sh) for sh in shapes):
        raise WireError("weights: a malformed layout ('names', 'shapes', 'dtypes')")
    present = [d for d in PACKED_DTYPES if d in dtypes]
    if len(flats) != len(present):
        raise WireError("weights: one flat tensor per dtype, please")
    out: dict[str, torch.Tensor] = {}
    for dtype, flat in zip(present, flats):
        if dtype == "bfloat16" and flat.dtype == torch.float16 and flat.dim() == 1:
            flat = flat.view(torch.bfloat16)  # its bits (pack)
        if str(flat.dtype).removeprefix("torch.") != dtype or flat.dim() != 1:
            raise WireError(f"weights: the {dtype} part is not a flat {dtype} tensor")
        offset = 0
        for name, shape, d in zip(names, shapes, dtypes):
            if d != dtype:
                continue
            numel = math.prod(shape)
            if offset + numel > flat.numel():
                raise WireError("weights: the layout asks for more values than were sent")
            out[name] = flat[offset:offset + numel].reshape(shape)
            offset += numel
        if offset != flat.numel():
            raise WireError("weights: more values were sent than the layout names")
    return out
