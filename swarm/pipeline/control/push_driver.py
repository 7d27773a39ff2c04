"""Stage-to-stage transfer, the driver's side (issue 41): one micro-batch pushed down the route it chose.

The driver chooses a peer of every stage (``SwarmRouter.choose``, as for relayed hops) and sends stage 1 its stage-0
output with the route (swarm/pipeline/stage/push.py says what each stage does). It gets back stage 1's input gradient and
the trail of 2L-1 receipts (the forwards of stages 1..L-1, the last stage's forward_backward, the backwards of stages
L-1..1), checks every one (signer, stage, op, micro-batch, sample ids, each input the output before it, the
signature with the key the driver has of that peer, the last stage's loss) and applies its stage-0 backward. Nothing
in the trail is taken on the word of the peer that relayed it.

Which micro-batches are pushed: those whose every peer has had a hop upheld by a check here (its credit in
``SpotChecker.book``; any peer while spot checks are off) and whose receipt key the driver holds. A stranger's hops
are relayed until then: its first sampled hop is checked before anything downstream uses its output, as before; from
then on a relayed hop's check runs in the background too (spot_checks.py), as a pushed hop's does. A peer that
failed a push, could not show what a pushed hop carried, or does not know the push ops (an older client) is relayed
for a while. The route is signed (a stage serves a push only where it names it, from the peer it names before).

Spot checks after the fact: each hop of a pushed micro-batch is drawn for a check as a relayed one is (``share_for``);
for a drawn hop the driver asks its peer what it received and sent (``show``), checks those tensors against the
receipts, and runs the same check as for a relayed hop (a second copy, or the referee) in the background. A peer
cannot tell a checked hop from another when it computes it. A liar caught there is convicted and routed around as
in a relayed check; the micro-batch it served has gone on (as with a background referee).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from typing import Any

import torch

from swarm.integrity.receipts import (
    Expect,
    Receipt,
    ReceiptError,
    loss_digest,
    mismatch,
    route_digest,
    signature_valid,
    tensor_digest,
)
from swarm.pipeline.stage.applied import DUPLICATE_CODE
from swarm.pipeline.control.hops import HopGivenUp
from swarm.pipeline.stage.push import BROKEN_CODE, LOST_CODE, PUSH_FORWARD, PUSH_LAST
from swarm.pipeline.transport.replies import BadReply, check_reply_tensor
from swarm.pipeline.transport.sessions import SessionUnopened
from swarm.pipeline.stage.stage0_replicas import ids_bytes
from swarm.pipeline.transport.stage_client import StageError
from swarm.pipeline.control.push_checks import PushChecks
from swarm.pipeline.control.push_trail import AVOID_S, Pushed, TrailError, link_failed
from swarm.pipeline.control.push_recovery import PushRecovery
from swarm.pipeline.transport.wire import WireError, payload_of
from swarm.run.models import stage_input_spec, stage_output_spec

logger = logging.getLogger(__name__)

TIMING_OP = "push"  # the routers' service times of pushed hops (each hop's share of the chain's round trip)


def enabled() -> bool:
    """Stages hand tensors to each other; VOLUNTEER_DATA_PLANE=relay keeps the relay (benchmarks compare both). Read
    when a driver starts, not at import (a process forked from one that imported this has its own environment)."""
    return os.environ.get("VOLUNTEER_DATA_PLANE", "push") != "relay"


class Pusher(PushRecovery, PushChecks):
    def __init__(self, driver: Any):
        self.driver = driver
        self.hops = driver.hops
        self.run = driver.run
        self.stages = self.run.model.stages
        self.avoid: dict[str, float] = {}  # peer -> relayed until
        self.cannot: set[str] = set()  # peers that do not know the push ops
        self.unshown: dict[str, int] = {}
        self._checks: set[asyncio.Task] = set()
        self._said: set[tuple[str, str]] = set()
        self.pushed = 0
        self.partial = 0
        self.relayed = 0  # micro-batches relayed because a peer of their route may not be pushed through
        self.checked = 0  # pushed hops checked after the fact
        self.unshown_total = 0
        self.recovered = 0  # broken pushes resumed by relay from what the route held
        self.cut_forgiven: dict[str, float] = {}  # peer -> when a cut stream on its route was last forgiven

    # ----- the route
    def route(self) -> list[str] | None:
        """A peer of every stage 1..L that may be pushed through, or None (relay this micro-batch)."""
        now = time.monotonic()
        spot, keys = self.driver.spot, self.driver.keys
        route = []
        for k in range(1, self.stages):
            peer = self.hops.routers[f"layer{k}"].choose(now, hop=True)
            if peer is None or peer in self.cannot or self.avoid.get(peer, 0.0) > now or keys.known(peer) is None or \
                    (spot.share > 0 and spot.book.get(peer) <= 0):
                self.relayed += 1
                return None
            route.append(peer)
        return route

    # ----- one micro-batch
    async def push(self, mb: str, h: torch.Tensor, ids: torch.Tensor, ids_d: bytes, r0: Receipt) -> Pushed | None:
        """Push ``mb`` down a route; None when it is not pushed (the driver relays it from the start). Raises
        HopGivenUp when it was lost (a stage applied its update and the rest cannot follow)."""
        route = self.route()
        if route is None:
            return None
        training, last = self.run.training, self.stages - 1
        routers = [self.hops.routers[f"layer{k}"] for k in range(1, self.stages)]
        hop_s = [router.timeout_s(TIMING_OP, peer) for router, peer in zip(routers, route)]
        meta = {"mb": mb, "rc": [r0.to_wire()], "chain": [], "rk": self.driver.receipt_key.public,
                "ids": ids_bytes(ids), "route": route, "hop_s": hop_s,
                "route_sig": self.driver.receipt_key.sign_bytes(route_digest(self.run.run_id, mb, route))}
        tensors = [h, ids] if last == 1 else [h]
        for router, peer in zip(routers, route):
            router.begin(peer)
        try:
            out, reply, elapsed = await self.hops.call(
                self.hops.p2p, route[0], self.hops.namespaces["layer1"], PUSH_LAST if last == 1 else PUSH_FORWARD,
                tensors, meta, timeout_s=sum(hop_s), codec=training.codec, rank=training.wire_rank,
                max_bytes=int(training.max_payload_mb * 2**20), traffic=self.hops.traffic)
        except StageError as exc:
            if exc.code in (LOST_CODE, DUPLICATE_CODE):
                raise HopGivenUp(f"pushed micro-batch lost: {exc}") from None
            if exc.code == BROKEN_CODE:  # a stage down the route got no answer from the next
                return await self._recover(mb, route, h, ids, ids_d, r0, str(exc), sum(hop_s))
            if exc.code == "rejected" and ("unknown op" in str(exc) or "pushed" in str(exc)):
                self.cannot.add(route[0])  # an older client: relayed from now on
            return None  # stage 1 refused it at its door: nothing ran, the relay meets the refusal and acts on it
        except asyncio.CancelledError:
            raise
        except SessionUnopened:  # never sent: relayed from the start, and stage 1's peer judged by its relayed hop
            self.avoid[route[0]] = time.monotonic() + AVOID_S
            return None
        except Exception as exc:  # no answer in time, a cut stream: ask the route what happened
            routers[0].failure(route[0], time.monotonic())
            return await self._recover(mb, route, h, ids, ids_d, r0, f"{exc.__class__.__name__}: {exc}",
                                       sum(hop_s))
        finally:
            for router, peer in zip(routers, route):
                router.end(peer)
        batch = int(h.shape[0])
        try:
            if reply.get("partial") is True:
                return self._partial(mb, out, reply, route, ids_d, r0, batch)
            pushed = self._full(mb, out, reply, route, h, ids, ids_d, r0, batch)
        except (TrailError, BadReply, ReceiptError, WireError) as exc:
            self.avoid[route[0]] = time.monotonic() + AVOID_S
            logger.warning("a pushed micro-batch came back through layer1 peer %s with a trail that does not hold "
                           "(%s): lost; that peer is relayed for %.0f s", route[0][-8:], exc, AVOID_S)
            raise HopGivenUp(f"pushed micro-batch {mb}: {exc}") from None
        for router, peer in zip(routers, route):
            router.success(peer, elapsed / len(route), TIMING_OP)
        self.pushed += 1
        return pushed

    def _full(self, mb: str, out: list[torch.Tensor], reply: dict, route: list[str], h: torch.Tensor,
              ids: torch.Tensor, ids_d: bytes,
              r0: Receipt, batch: int) -> Pushed:
        last = self.stages - 1
        if len(out) != 1:
            raise TrailError(f"a pushed micro-batch's reply carries {len(out)} tensors")
        grad = check_reply_tensor(out[0], stage_input_spec(self.run.model, 1, batch),
                                  self.run.timeouts.reply_max_abs, "push reply")
        loss = reply.get("loss")
        if not isinstance(loss, (int, float)) or isinstance(loss, bool) or not math.isfinite(loss) or loss < 0:
            raise TrailError(f"loss {str(loss)[:40]} is not a finite non-negative number")
        trail = self._receipts(reply.get("trail"), 2 * last - 1)
        forwards = self._forwards(trail[:last], route, mb, ids_d, r0)
        final = trail[last - 1]
        if final.figures != loss_digest(loss):
            raise TrailError("the last stage's receipt does not sign the loss that came back")
        backwards = {}
        for i, receipt in enumerate(trail[last:]):
            k = last - 1 - i
            self._holds(receipt, Expect(self.run.run_id, k, frozenset({"backward"}), receipt.output, mb=mb,
                                        input=forwards[k - 1].output, ids=ids_d, signer=route[k - 1]))
            backwards[k] = receipt
        if tensor_digest(payload_of(grad)) != (backwards[1].output if last > 1 else final.output):
            raise TrailError("the gradient is not the one stage 1 signed")
        served_by = dict(enumerate(route, 1))
        # stage 1's input is our own output and its input gradient the one that came back: a check of its hop asks
        # it to show only what we do not hold
        self._check_later(mb, route, forwards, backwards, ids, ids_d, float(loss), batch, {"x": h, "gx": grad})
        return Pushed(served_by=served_by, forwards=forwards, grad=grad, loss=float(loss))

    def _partial(self, mb: str, out: list[torch.Tensor], reply: dict, route: list[str], ids_d: bytes, r0: Receipt,
                 batch: int) -> Pushed:
        raw = reply.get("trail")
        if not isinstance(raw, list) or not 1 <= len(raw) < self.stages - 1 or len(out) != 1:
            raise TrailError("a partial reply without its trail and output")
        trail = self._receipts(raw, len(raw))
        forwards = self._forwards(trail, route, mb, ids_d, r0)
        m = len(trail)
        h = check_reply_tensor(out[0], stage_output_spec(self.run.model, m, batch), self.run.timeouts.reply_max_abs,
                               "push reply")
        if tensor_digest(payload_of(h)) != forwards[m].output:
            raise TrailError(f"the output is not the one layer{m} signed")
        failed = reply.get("push_failed")
        peer = link_failed(failed, route)  # not on a refusal of this micro-batch: its relay meets it and says it
        if peer is not None:
            self.avoid[peer] = time.monotonic() + AVOID_S  # relayed to for a while; judged by its own hops there
            self._say(route[m - 1], peer, f"layer{m} peer {route[m - 1][-8:]} could not push to layer{m + 1} peer "
                      f"{peer[-8:]} ({str(failed.get('error', ''))[:120]}): that peer is relayed for {AVOID_S:.0f} s")
        self.partial += 1
        return Pushed(served_by={k: route[k - 1] for k in range(1, m + 1)}, forwards=forwards, partial_at=m, h=h)

    # ----- the trail
    def _receipts(self, raw: Any, count: int) -> list[Receipt]:
        if not isinstance(raw, list) or len(raw) != count:
            raise TrailError(f"expected a trail of {count} receipts")
        return [Receipt.from_wire(item) for item in raw]

    def _forwards(self, trail: list[Receipt], route: list[str], mb: str, ids_d: bytes,
                  r0: Receipt) -> dict[int, Receipt]:
        """Stage -> its forward's receipt (the last stage's forward_backward), each following the one before."""
        forwards = {0: r0}
        last = self.stages - 1
        for k, receipt in enumerate(trail, 1):
            op = "forward_backward" if k == last else "forward"
            self._holds(receipt, Expect(self.run.run_id, k, frozenset({op}), receipt.output, mb=mb,
                                        input=forwards[k - 1].output, ids=ids_d, signer=route[k - 1]))
            forwards[k] = receipt
        return forwards

    def _holds(self, receipt: Receipt, expect: Expect) -> None:
        problem = mismatch(receipt, expect)
        if problem is not None:
            raise TrailError(f"layer{expect.stage}'s receipt: {problem}")
        key = self.driver.keys.known(receipt.signer)
        if key is None or not signature_valid(receipt, key):
            raise TrailError(f"layer{expect.stage}'s receipt does not verify with its signer's key")
        self.hops.versions.note(receipt.signer, expect.stage, receipt.version, receipt.weights)

    def _say(self, a: str, b: str, text: str) -> None:
        if (a, b) not in self._said:
            self._said.add((a, b))
            logger.info(text)
            self.driver.notify("info", text)

    def describe(self) -> str:
        """How this driver's micro-batches travel, for its user: 'stage to stage 96% · 2 peers relayed now'."""
        total = self.pushed + self.relayed + self.partial + self.recovered
        if not total:
            return ""
        now = time.monotonic()
        text = f"stage to stage {100 * self.pushed / total:.0f}%"
        avoided = sum(1 for until in self.avoid.values() if until > now) + len(self.cannot)
        if avoided:
            text += f" · {avoided} peer{'s' if avoided != 1 else ''} relayed now"
        return text

    def cancel(self) -> None:
        for task in list(self._checks):
            task.cancel()


