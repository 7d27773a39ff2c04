"""A broken push, the driver's side (swarm/pipeline/control/push_driver.py): ask every peer of the route what it kept of the
micro-batch, and resume it by relay from the furthest point that is known (a method mixin of ``Pusher``)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterable
from typing import Any

import torch

from swarm.integrity.receipts import Expect, Receipt, ReceiptError, loss_digest, tensor_digest
from swarm.pipeline.control.hops import HopGivenUp
from swarm.pipeline.stage.push import SHOW_OP
from swarm.pipeline.transport.replies import BadReply, check_reply_tensor
from swarm.pipeline.transport.wire import coded_bytes, payload_of
from swarm.run.models import stage_input_spec, stage_output_spec

from swarm.pipeline.control.push_trail import AVOID_S, Pushed, TrailError

logger = logging.getLogger(__name__)

RECOVER_TIMEOUT_S = 5.0  # each peer's answer to a recovery's show (a dead peer on loopback fails at once)
RUNNING_POLL_S = 0.2  # a stage that says it still runs the micro-batch is asked again this often...
RUNNING_WAIT_S = 30.0  # ... for at most this long (then what is known is used, as for a slow relayed hop)


class PushRecovery:
    # ----- a broken push: what the route holds
    async def _recover(self, mb: str, route: list[str], h0: torch.Tensor, ids: torch.Tensor, ids_d: bytes,
                       r0: Receipt, why: str, budget_s: float = RUNNING_WAIT_S) -> Pushed | None:
        """A push that got no answer somewhere down the route (a peer died or is unreachable): ask every peer of the
        route what it kept of ``mb`` (``show``: tensors and receipts, each checked against the signed chain), then
        resume by relay from the furthest point that is known: the backward from the deepest stage whose backward
        is known done, if the last stage's update is known applied, else the forward from the deepest output known.
        A peer that is dead takes its update with it; a peer that is only slow may still finish (as a relayed hop
        that times out may). Raises HopGivenUp when nothing can be resumed without applying an update twice."""
        now = time.monotonic()
        # A cut stream (StreamCut: p2pd ended a stream between a tensor's parts, ~0.4 % of large replies on loopback)
        # is a transport hiccup, not a bad route: the first on a route within AVOID_S is resumed without relaying the
        # route for a minute (heavy, every hop streamed, had its route relayed most of the time). A second, or a
        # route that another cut was forgiven on lately, is relayed as any broken push (the reason is a stage's word).
        if "StreamCut" in why and all(now - self.cut_forgiven.get(peer, -AVOID_S) >= AVOID_S for peer in route):
            self.cut_forgiven.update((peer, now) for peer in route)
            logger.info("a push along the route %s was cut (%s): resumed, the route kept",
                        "/".join(p[-8:] for p in route), why[:120])
        else:
            for peer in route:
                self.avoid[peer] = now + AVOID_S
            self._say(route[0], "broken", f"a push along the route {'/'.join(p[-8:] for p in route)} broke "
                      f"({why[:120]}): those peers are relayed for {AVOID_S:.0f} s")
        batch, last, model = int(h0.shape[0]), self.stages - 1, self.run.model
        shows = await asyncio.gather(*(self._fetch(mb, k, peer, batch) for k, peer in enumerate(route, 1)))
        waited = 0.0
        # no longer than the route's own time budget: an honest stage cannot still run it past that, and a stage that
        # says "running" for ever must not hold the lane longer than a black hole would
        while any(show and show.get("running") for show in shows) and waited < min(budget_s, RUNNING_WAIT_S):
            # a stage still working on it (slow, not gone): what it applies must be known before anything is resent
            await asyncio.sleep(RUNNING_POLL_S)
            waited += RUNNING_POLL_S
            shows = await asyncio.gather(*(self._fetch(mb, k, peer, batch) for k, peer in enumerate(route, 1)))
        fwd: dict[int, Receipt] = {0: r0}
        ys: dict[int, torch.Tensor] = {0: h0}
        loss: float | None = None
        for k, peer in enumerate(route, 1):  # the forward chain, as far as it is known
            here, after = shows[k - 1], shows[k] if k < last else None
            receipt = _receipt(here, "rc_y" if k < last else "rc_gx") or (_receipt(after, "rc_x") if after else None)
            op = "forward_backward" if k == last else "forward"
            if receipt is None or not self._follows(receipt, k, op, mb, fwd[k - 1].output, ids_d, peer):
                break
            fwd[k] = receipt
            if k < last:
                y = _tensor([(here, "y"), (after, "x")], receipt.output, stage_output_spec(model, k, batch), self.run)
                if y is None:
                    break
                ys[k] = y
            else:
                shown_loss = here.get("loss") if here else None
                if isinstance(shown_loss, float) and math.isfinite(shown_loss) and \
                        receipt.figures == loss_digest(shown_loss):
                    loss = shown_loss
        served_by = {k: fwd[k].signer for k in fwd if k}
        inputs = {k: ys[k - 1] for k in range(1, last + 1) if k - 1 in ys}
        if last not in fwd or loss is None:  # the last stage's update is not known applied: the forward goes on
            m = max(k for k in ys)
            running = [k for k in range(m + 1, last + 1) if shows[k - 1] and shows[k - 1].get("running")]
            if running:  # still on its way there (slow, past its budget): a resend would meet it (applied.py)
                raise HopGivenUp(f"pushed micro-batch {mb}: layer{running[-1]} peer {route[running[-1] - 1][-8:]} "
                                 f"still runs it after {waited:.1f} s: given up, as a relayed hop that timed out")
            self.partial += 1
            if m == 0:
                return None
            return Pushed(served_by=served_by, forwards={k: fwd[k] for k in range(1, m + 1)}, partial_at=m, h=ys[m])
        grad = _tensor([(shows[last - 1], "gx"), (shows[last - 2] if last > 1 else None, "g")], fwd[last].output,
                       stage_input_spec(model, last, batch), self.run)
        if grad is None:
            raise HopGivenUp(f"pushed micro-batch {mb}: the last stage applied it and its gradient cannot be had")
        receipt = fwd[last]
        k = last - 1
        while k >= 1:  # the backwards known done, from the last stage up
            here, below = shows[k - 1], shows[k - 2] if k > 1 else None
            bwd = _receipt(here, "rc_gx") or (_receipt(below, "rc_g") if below else None)
            if bwd is None or not self._follows(bwd, k, "backward", mb, fwd[k - 1].output, ids_d, route[k - 1]):
                break
            spec = stage_input_spec(model, k, batch)
            g = _tensor([(here, "gx"), (below, "g")], bwd.output, spec, self.run)
            if g is None:
                break
            grad, receipt, k = g, bwd, k - 1
        self.recovered += 1
        return Pushed(served_by=served_by, forwards=fwd, grad=grad, loss=loss, back_from=k, grad_receipt=receipt,
                      inputs=inputs)

    async def _fetch(self, mb: str, k: int, peer: str, batch: int) -> dict[str, Any] | None:
        """``peer``'s ``show`` of ``mb`` at stage ``k``: its reply metadata with the tensors by name, or None."""
        training = self.run.training
        try:
            out, reply, _ = await self.hops.call(
                self.hops.p2p, peer, self.hops.namespaces[f"layer{k}"], SHOW_OP, [], {"mb": mb},
                timeout_s=RECOVER_TIMEOUT_S, codec=training.codec, rank=training.wire_rank,
                max_bytes=int(training.max_payload_mb * 2**20), traffic=self.hops.traffic,
                expect_bytes=self._shown_bytes(k, batch))
        except asyncio.CancelledError:
            raise
        except Exception:
            return None
        have = reply.get("have")
        if not isinstance(have, list) or len(have) != len(out):
            return None
        return {**reply, "tensors": dict(zip(have, out))}

    def _follows(self, receipt: Receipt, k: int, op: str, mb: str, input: bytes, ids_d: bytes, peer: str) -> bool:
        try:
            self._holds(receipt, Expect(self.run.run_id, k, frozenset({op}), receipt.output, mb=mb, input=input,
                                        ids=ids_d, signer=peer))
            return True
        except TrailError:
            return False

    def _shown_bytes(self, k: int, batch: int, names: Iterable[str] = ("x", "gx", "y", "g")) -> int:
        """About how large a ``show`` of hop ``k`` is with the tensors ``names`` (x, gx: of its input's shape; y, g:
        of its output's), so that a reply over a session's limit takes a stream of its own."""
        training, model = self.run.training, self.run.model
        spec = {"x": stage_input_spec(model, k, batch), "gx": stage_input_spec(model, k, batch)}
        if k + 1 < self.stages:
            spec["y"] = spec["g"] = stage_output_spec(model, k, batch)
        return sum(coded_bytes(tuple(batch if d is None else d for d in spec[name].shape), training.codec,
                               training.wire_rank) for name in names if name in spec)


def _receipt(shown: dict[str, Any] | None, name: str) -> Receipt | None:
    if not shown or name not in shown:
        return None
    try:
        return Receipt.from_wire(shown[name])
    except ReceiptError:
        return None


def _tensor(candidates: list[tuple[dict[str, Any] | None, str]], digest: bytes, spec: Any,
            run: Any) -> torch.Tensor | None:
    """The first shown tensor of ``candidates`` ((a peer's show, a name)) that is the one ``digest`` names and passes
    the reply checks, or None."""
    for shown, name in candidates:
        tensor = (shown or {}).get("tensors", {}).get(name)
        if tensor is None:
            continue
        try:
            tensor = check_reply_tensor(tensor, spec, run.timeouts.reply_max_abs, f"shown {name}")
        except BadReply:
            continue
        if tensor_digest(payload_of(tensor)) == digest:
            return tensor
    return None
