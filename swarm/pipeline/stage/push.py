"""Stage-to-stage transfer, the stage's side (issue 41): a stage pushes its output straight to the next stage's peer.

The driver still chooses every hop's peer. It sends stage 1 a ``push_forward``: its stage-0 output with its receipt,
the sample ids and the route (the peers of stages 1..L it chose, signed by it: a stage serves a push only from the
peer the route names before it, and only where the route names it). Stage k then
1. checks the request as it checks any forward (its receipt, swarm/pipeline/stage/stage_receipts.py) and runs it for the
   driver whose micro-batch it is (that driver's fair share, shards and saved activations): the driver is the signer
   of the chain's stage-0 receipt, which stage k checks with the driver's own key (a stage cannot spend a driver's
   share, or lend its micro-batch id, in its name);
2. pushes its output with its receipt and the chain so far to the next peer of the route (``push_forward``, or
   ``push_forward_backward`` at the last stage, which runs its forward_backward);
3. checks the gradient that comes back as a driver checks a reply (swarm/pipeline/transport/replies.py), runs its backward on
   it (checked and receipted as a backward the driver relayed), and answers its caller with its input gradient and
   the trail of every receipt from itself down and back.
The driver gets stage 1's input gradient and the trail (2L-1 receipts): swarm/pipeline/control/push_driver.py. Its link carries
the stage-0 output and its gradient; every other tensor crosses one link once.

Failures fall back to the relay:
- a push that fails before the next stage answered (refused, unreachable, timed out) or that it answers ``partial``
  is answered ``partial``: this stage's output (or the deeper one) and the trail so far. The driver relays the rest of
  the micro-batch from there as before this round; the saved activations here wait for its relayed backward;
- a failure once the next stage has applied its update (a gradient whose receipt does not hold, our own backward
  refused) is answered ``push_lost``: no stage above applies anything for it (the relay's "lost").
Strikes for a malformed push land on its sender (``StageServicer.admitted``), never on the driver.

What each pushed hop received and sent is kept a little while (swarm/pipeline/stage/outbox.py) for the driver's spot
checks: it may ask (``show``) after the hop, and checks the tensors against the receipts (stage 1 keeps all but its
input: the driver's own). A stage cannot know which hops will be checked, so it cannot compute honestly only for
those.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from swarm.integrity.receipts import (
    Receipt,
    ReceiptError,
    bytes_signature_valid,
    ids_digest,
    parse_all,
    route_digest,
    signature_valid,
)
from swarm.pipeline.stage.applied import DUPLICATE_CODE
from swarm.pipeline.stage.outbox import Outbox, driver_bytes
from swarm.pipeline.transport.keybook import KEY_PATIENCE_S
from swarm.pipeline.transport.replies import BadReply, Vouch, check_receipt, check_reply
from swarm.pipeline.stage.stage0_replicas import ids_from_meta
from swarm.pipeline.transport.sessions import SessionUnopened
from swarm.pipeline.transport.stage_client import StageError, call_stage, stage_namespace
from swarm.pipeline.transport.wire import WireError, payload_of, refusal_meta

logger = logging.getLogger(__name__)

PUSH_FORWARD = "push_forward"  # stages 1..L-1: forward, push on, backward with what comes back
PUSH_LAST = "push_forward_backward"  # the last stage: forward_backward of a pushed micro-batch
PUSH_OPS = frozenset({PUSH_FORWARD, PUSH_LAST})
SHOW_OP = "show"  # a driver asks what a pushed hop of its micro-batch received and sent
LOST_CODE = "push_lost"
BROKEN_CODE = "push_broken"  # a push downstream got no answer: its driver asks the route what happened (recovery)
MAX_STAGES = 64
MAX_BATCH = 65536  # TrainingConfig.batch_size's bound
MAX_PUSH_S = 600.0  # the most a push may wait downstream (the route's hop budgets, summed)
SHOWN = ("x", "y", "g", "gx")  # received input, sent output, received output gradient, sent input gradient
# the receipts of x (received), of our forward (sent with y), of g (received), of our backward (sent with gx)
RECEIPTS = ("rc_x", "rc_y", "rc_g", "rc_gx")


@dataclass(slots=True)
class PushRequest:
    mb: str
    ids: torch.Tensor
    rc: Receipt  # the receipt of our input
    chain: list[Receipt]  # the receipts before it, from the driver's stage 0
    route: list[str]  # the peers of stages 1..L the driver chose, in order (signed: route_sig)
    hop_s: list[float]  # their time budgets (forward and backward each)
    route_sig: bytes = b""
    raw_chain: list[Any] = field(default_factory=list)


def parse_push(meta: dict, stage: int, stages: int) -> PushRequest:
    """A pushed request's metadata, or WireError (its sender's doing). The ids' count is checked against the
    tensors' batch where they meet (the last stage's targets)."""
    mb = meta.get("mb")
    if not isinstance(mb, str) or not 0 < len(mb) <= 128:
        raise WireError("missing or malformed micro-batch id")
    raw_ids = meta.get("ids")
    if not isinstance(raw_ids, bytes) or not 0 < len(raw_ids) <= 8 * MAX_BATCH or len(raw_ids) % 8:
        raise WireError("a push carries its sample ids in 'ids' (int64 little-endian bytes)")
    ids = ids_from_meta(raw_ids, len(raw_ids) // 8)
    raw_chain, route, hop_s = meta.get("chain"), meta.get("route"), meta.get("hop_s")
    if not isinstance(raw_chain, list) or len(raw_chain) != stage - 1:
        raise WireError(f"a push to stage {stage} carries the {stage - 1} receipt(s) before its input's in 'chain'")
    hops = stages - 1
    if not isinstance(route, list) or len(route) != hops or \
            not all(isinstance(p, str) and 0 < len(p) <= 128 for p in route):
        raise WireError(f"a push names the {hops} peers of stages 1..{hops} in 'route'")
    route_sig = meta.get("route_sig")
    if not isinstance(route_sig, bytes) or not 0 < len(route_sig) <= 128:
        raise WireError("a push carries its driver's signature of the route in 'route_sig'")
    if not isinstance(hop_s, list) or len(hop_s) != hops or \
            not all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and 0 < t
                    for t in hop_s) or sum(hop_s) > MAX_PUSH_S:
        raise WireError("'hop_s': a positive time budget per peer of the route")
    try:
        (rc,) = parse_all(meta.get("rc"), 1)
        chain = [Receipt.from_wire(raw) for raw in raw_chain]
    except ReceiptError as exc:
        raise WireError(f"push: {exc}") from None
    return PushRequest(mb, ids, rc, chain, list(route), [float(t) for t in hop_s], route_sig, raw_chain)


class PushServer:
    """A stage's pushes: served for the stage before it (or the driver, at stage 1), sent on to the stage after it."""

    def __init__(self, p2p: Any, run: Any, keys: Any, *, index: int, traffic: Any = None, call: Any = call_stage,
                 drivers: Any = None):
        self.p2p = p2p
        self.run = run
        self.run_id = run.run_id
        self.keys = keys
        self.traffic = traffic
        self.call = call
        self.namespaces = {k: stage_namespace(self.run_id, f"layer{k}") for k in range(run.model.stages)}
        # ``drivers``: the stage gate's view of the run's drivers (DriverView): the outbox grows with their number
        # and, past its bytes, lets the hops of a driver no layer0 record names go first
        self.outbox = Outbox(driver_bytes=driver_bytes(run, index),
                             drivers=drivers.drivers if drivers is not None else None,
                             known=drivers.knows if drivers is not None else None)
        self.pushed = 0  # micro-batches this stage pushed on
        self.partial = 0  # ... whose push failed, answered partial
        self.lost = 0  # ... answered push_lost
        self.shown = 0

    async def serve(self, servicer: Any, sender: str, op: str, meta: dict, serialized: list[Any]) -> tuple[list, dict]:
        worker = servicer.worker
        k, stages = worker.index, self.run.model.stages
        last = worker.is_last
        if k == 0 or (op == PUSH_LAST) != last:
            return [], refusal_meta("rejected", f"{op} is not served by stage {k}")
        want = 2 if last else 1
        try:
            if len(serialized) != want:
                raise WireError(f"{op} takes {want} tensor(s)")
            request = parse_push(meta, k, stages)
        except WireError as exc:
            if servicer.gate is not None:
                servicer.gate.strike(sender, f"a malformed push: {str(exc)[:100]}")
            return [], refusal_meta("rejected", str(exc))
        self.keys.learn(sender, meta.get("rk"))  # the sender's own key, over its own connection
        driver = sender if k == 1 else request.chain[0].signer if request.chain else ""
        refusal = await self._check_chain(request, k, sender, driver,
                                          servicer.desk.key.peer_id if servicer.desk is not None else "")
        if refusal is not None:
            return [], refusal
        # kept from here, marked running: a driver recovering a broken push waits for what runs here, and gives the
        # micro-batch up rather than resend it while it still runs (push_recovery.py; a resend is refused: applied.py)
        # stage 1 keeps no copy of its input: its driver sent it and holds it (a check asks for it only elsewhere, a
        # recovery resumes from its own stage-0 output): half of a 2-stage run's last stage's outbox
        x = serialized[0] if k > 1 else None
        fresh = not self.outbox.has(driver, request.mb)
        self.outbox.put(driver, request.mb, x=x, rc_x=meta.get("rc")[0], running=True)
        outcome = None
        gate = servicer.gate
        try:
            if gate is not None:
                admitted = await gate.admit(driver, "forward_backward" if last else "backward")
                if admitted is not None:
                    gate = None  # no slot taken: nothing to settle, and nothing ran: nothing to keep
                    if fresh:
                        self.outbox.discard(driver, request.mb)
                        fresh = None
                    return [], refusal_meta(admitted.code, admitted.error, admitted.retry_after_s)
            out, reply, outcome = await servicer.admitted(driver, sender, "forward_backward" if last else "forward",
                                                          {"mb": request.mb, "rc": meta.get("rc"),
                                                           "ids": meta.get("ids")}, serialized)
            if reply.get("ok") is not True:
                return out, reply
            if last:
                self.outbox.put(driver, request.mb, x=x, gx=out[0] if out else None,
                                rc_x=meta.get("rc")[0], rc_gx=reply["rc"], loss=reply.get("loss"))
                return out, {**reply, "trail": [reply["rc"]]}
            self.outbox.put(driver, request.mb, x=x, y=out[0], rc_x=meta.get("rc")[0], rc_y=reply["rc"])
            out, reply, backward = await self._push_on(servicer, request, driver, out[0], reply)
            if backward is not None:
                outcome = backward
            return out, reply
        finally:
            if fresh is not None:
                self.outbox.put(driver, request.mb, running=False)
            if gate is not None and outcome is not None:
                gate.settle(driver, outcome)
            elif gate is not None:
                gate.book.finished(driver)

    async def _check_chain(self, request: PushRequest, k: int, sender: str, driver: str, me: str) -> dict | None:
        """The chain from the driver's stage 0 to our input: one micro-batch, one set of ids, every link, the last
        signer the sender, the first the driver (its signature checked with its own key). None when it holds."""
        ids_d = ids_digest(request.ids)
        receipts = [*request.chain, request.rc]
        for j, receipt in enumerate(receipts):
            problem = None
            if receipt.run_id != self.run_id or receipt.stage != j or receipt.op != "forward" or \
                    receipt.mb != request.mb or receipt.ids != ids_d:
                problem = f"the chain's receipt {j} is not of this micro-batch's forward at stage {j}"
            elif j and receipt.input != receipts[j - 1].output:
                problem = f"the chain breaks at stage {j}"
            if problem is not None:
                return refusal_meta("bad_receipt", problem)
        if request.rc.signer != sender:
            return refusal_meta("bad_receipt", "a push carries its sender's own output")
        if request.route[k - 1] != me or (k > 1 and request.route[k - 2] != sender):
            return refusal_meta("bad_receipt", "this push is not on its driver's route (another peer, or another "
                                "sender)")
        key = self.keys.known(driver) if k == 1 else await self.keys.key(driver, "layer0")
        if key is None:
            wait_s = self.keys.wait_s(driver)
            if wait_s is not None:
                return refusal_meta("key_pending", f"getting the receipt key of driver {driver[-8:]}", wait_s)
            return refusal_meta("unknown_signer", f"cannot get the receipt key of driver {driver[-8:]} "
                                f"({KEY_PATIENCE_S:.0f} s)")
        if k > 1 and not signature_valid(request.chain[0], key):
            return refusal_meta("bad_receipt", f"the stage-0 receipt does not verify with driver {driver[-8:]}'s key")
        if not bytes_signature_valid(route_digest(self.run_id, request.mb, request.route), request.route_sig, key):
            return refusal_meta("bad_receipt", f"the route is not signed by driver {driver[-8:]}")
        return None

    async def _push_on(self, servicer: Any, request: PushRequest, driver: str, y: Any,
                       reply: dict) -> tuple[list, dict, Any]:
        """Push our output to the next peer; our backward on what comes back. (out, reply, the backward's outcome)."""
        k = servicer.worker.index
        nxt, last_next = request.route[k], k + 1 == len(request.route)
        mine = reply["rc"]
        down_meta = {"mb": request.mb, "rc": [mine], "chain": [*request.raw_chain, _wire(request.rc)],
                     "rk": servicer.desk.key.public if servicer.desk is not None else b"",
                     "ids": _ids_raw(request.ids), "route": request.route, "hop_s": request.hop_s,
                     "route_sig": request.route_sig}
        tensors = [_carrier(y), request.ids] if last_next else [_carrier(y)]
        training = self.run.training
        try:
            out, down, _ = await self.call(
                self.p2p, nxt, self.namespaces[k + 1], PUSH_LAST if last_next else PUSH_FORWARD, tensors, down_meta,
                timeout_s=sum(request.hop_s[k:]), codec=training.codec, rank=training.wire_rank,
                max_bytes=int(training.max_payload_mb * 2**20), traffic=self.traffic)
        except StageError as exc:
            if exc.code in (LOST_CODE, BROKEN_CODE):  # said further down: passed up as it is
                self.lost += exc.code == LOST_CODE
                return [], refusal_meta(exc.code, str(exc)[:300]), None
            if exc.code == DUPLICATE_CODE:  # the next peer applied it already (its driver resent it): lost
                self.lost += 1
                return [], refusal_meta(LOST_CODE, str(exc)[:300]), None
            return self._partial(y, mine, nxt, str(exc), exc.code)  # refused at its door: nothing ran there
        except SessionUnopened as exc:  # never sent (the next peer cannot be reached from here: NAT, gone)
            return self._partial(y, mine, nxt, str(exc))
        except Exception as exc:  # no answer: whatever ran downstream, its driver asks the route (recovery)
            logger.info("a push to %s got no answer (%s: %s): its driver recovers micro-batch %s", nxt[-8:],
                        exc.__class__.__name__, exc, request.mb)
            return [], refusal_meta(BROKEN_CODE, f"layer{k} peer got no answer from layer{k + 1} peer {nxt[-8:]}: "
                                    f"{exc.__class__.__name__}"), None
        trail = down.get("trail")
        if not isinstance(trail, list) or len(trail) > 2 * MAX_STAGES:
            return self._partial(y, mine, nxt, "a reply without its trail")
        if down.get("partial") is True:  # deeper down a push failed: its output goes up as it is
            self.partial += 1
            return [payload_of(out[0])] if out else [], \
                {"ok": True, "partial": True, "trail": [mine, *trail], "push_failed": down.get("push_failed")}, None
        batch = int(request.ids.shape[0])
        try:
            out, down = check_reply(self.run.model, k + 1, "forward_backward", batch, out, down,
                                    self.run.timeouts.reply_max_abs)
            check_receipt(k + 1, "forward_backward" if last_next else "backward",
                          Vouch(self.run_id, request.mb, Receipt.from_wire(mine).output, ids_digest(request.ids)),
                          nxt, out, down, self.keys)
        except (BadReply, ReceiptError) as exc:  # it has applied its update: nothing above may apply ours
            self.lost += 1
            logger.warning("layer%d peer %s returned a gradient we cannot use (%s): micro-batch %s lost", k + 1,
                           nxt[-8:], exc, request.mb)
            return [], refusal_meta(LOST_CODE, f"layer{k + 1} peer {nxt[-8:]} returned a gradient that fails its "
                                    f"checks: {exc}"), None
        g = payload_of(out[0])
        out_b, reply_b, outcome = await servicer.admitted(
            driver, nxt, "backward", {"mb": request.mb, "rc": [down["rc"]], "loss": down["loss"]}, [g])
        if reply_b.get("ok") is not True:
            self.lost += 1
            return [], refusal_meta(LOST_CODE, f"layer{k} refused the gradient: {reply_b.get('error', '')}"[:300]), \
                outcome
        self.pushed += 1
        self.outbox.put(driver, request.mb, g=g, gx=out_b[0] if out_b else None, rc_g=down["rc"], rc_gx=reply_b["rc"])
        return out_b, {**reply_b, "loss": down["loss"], "trail": [mine, *trail, reply_b["rc"]]}, outcome

    def _partial(self, y: Any, mine: Any, nxt: str, why: str, code: str = "") -> tuple[list, dict, None]:
        """Our output goes up to the driver, which relays it. ``code``: the next peer's refusal, when it answered
        one (a refusal of this micro-batch says nothing against the link: its driver keeps pushing there)."""
        self.partial += 1
        logger.info("could not push micro-batch on to %s (%s): its driver relays from here", nxt[-8:], why[:200])
        failed = {"peer": nxt, "error": why[:200], **({"code": code[:32]} if code else {})}
        return [y], {"ok": True, "partial": True, "trail": [mine], "push_failed": failed}, None

    def show(self, requester: str, meta: dict) -> tuple[list, dict]:
        """What a pushed hop of the requester's own micro-batch received and sent (only its driver may ask); metadata
        ``want``: which of them (default all), and every receipt kept with them."""
        mb = meta.get("mb")
        kept = self.outbox.get(requester, mb) if isinstance(mb, str) else None
        if not kept:
            return [], refusal_meta("gone", "nothing kept of that micro-batch here (too old, or not yours)")
        self.shown += 1
        want = meta.get("want")
        wanted = set(want) if isinstance(want, list) and all(isinstance(n, str) for n in want) else set(SHOWN)
        names = [name for name in SHOWN if name in kept and name in wanted]
        return [kept[name] for name in names], {"ok": True, "have": names, "loss": kept.get("loss"),
                                                "running": bool(kept.get("running")),
                                                **{name: kept[name] for name in RECEIPTS if name in kept}}


def _carrier(item: Any) -> torch.Tensor:
    """A placeholder tensor that makes call_stage send ``item`` (the payload we signed) as it is."""
    from swarm.pipeline.transport.wire import _RELAY_ATTR

    carrier = torch.empty(0)
    setattr(carrier, _RELAY_ATTR, item)
    return carrier


def _wire(receipt: Receipt) -> list[Any]:
    return receipt.to_wire()


def _ids_raw(ids: torch.Tensor) -> bytes:
    from swarm.pipeline.stage.stage0_replicas import ids_bytes

    return ids_bytes(ids)


