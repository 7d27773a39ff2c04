"""Spot checks of pushed hops, after the fact (swarm/pipeline/control/push_driver.py): a hop drawn for a check is shown to its
driver by its peer, checked against the receipts, and checked as a relayed hop would be (a method mixin of
``Pusher``)."""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from swarm.integrity.receipts import Receipt, tensor_digest
from swarm.pipeline.stage.push import SHOW_OP
from swarm.pipeline.transport.replies import Vouch, check_reply_tensor
from swarm.pipeline.stage.stage0_replicas import ids_bytes
from swarm.pipeline.transport.wire import decode_tensors, payload_of
from swarm.run.models import stage_input_spec, stage_output_spec

from swarm.pipeline.control.push_trail import TrailError

logger = logging.getLogger(__name__)

UNSHOWN_AVOID_S = 300.0  # a peer that did not show a checked hop's tensors UNSHOWN_IN_ROW times running is relayed
UNSHOWN_IN_ROW = 3
MAX_CHECKS = 4  # pushed hops checked in the background at once
SHOW_TIMEOUT_S = 10.0


class PushChecks:
    # ----- spot checks after the fact
    def _check_later(self, mb: str, route: list[str], forwards: dict[int, Receipt], backwards: dict[int, Receipt],
                     ids: torch.Tensor, ids_d: bytes, loss: float, batch: int,
                     held: dict[str, torch.Tensor] | None = None) -> None:
        """Draw the hops of ``mb`` to check; ``held``: stage 1's tensors we hold already (its input, our own stage-0
        output; its input gradient, the push's reply), not asked of it again."""
        spot = self.driver.spot
        if spot.share <= 0:
            return
        last = self.stages - 1
        for k, peer in enumerate(route, 1):
            share = spot.share_for(peer)
            forward = k < last and spot.rng.random() < share
            gradient = spot.rng.random() < spot.gradient_share_for(k, peer)
            if not (forward or gradient):
                continue
            ops = [op for op, drawn in (("forward", forward),
                                        ("forward_backward" if k == last else "backward", gradient)) if drawn]
            if all(spot.skips_lone(k, peer, op) for op in ops):  # nothing would check what it showed: not asked
                spot.referee_skipped += 1
                continue
            if len(self._checks) >= MAX_CHECKS:
                spot.referee_skipped += 1
                continue
            task = asyncio.ensure_future(self._check(mb, k, peer, forwards, backwards, ids, ids_d, loss, batch,
                                                     forward, gradient, (held or {}) if k == 1 else {}))
            self._checks.add(task)
            task.add_done_callback(self._checks.discard)

    async def _check(self, mb: str, k: int, peer: str, forwards: dict[int, Receipt], backwards: dict[int, Receipt],
                     ids: torch.Tensor, ids_d: bytes, loss: float, batch: int, forward: bool, gradient: bool,
                     held: dict[str, torch.Tensor]) -> None:
        try:
            shown = await self._show(mb, k, peer, forwards, backwards, batch, forward, gradient, held)
            if shown is None:
                return
            await self._recheck(mb, k, peer, shown, forwards, backwards, ids, ids_d, loss, forward, gradient)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # Refused: the peer was caught (convicted or held off already); a bug: never a lane's
            if exc.__class__.__name__ != "Refused":
                logger.exception("a check of a pushed hop failed")

    async def _show(self, mb: str, k: int, peer: str, forwards: dict[int, Receipt], backwards: dict[int, Receipt],
                    batch: int, forward: bool = True, gradient: bool = True,
                    held: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor] | None:
        """What ``peer`` received and sent at hop ``k`` of ``mb`` that the drawn checks need (a forward check: x, y; a
        gradient check: x, g, gx), each checked against its receipt; None (and the peer's misses counted) when it
        cannot show them. What we ``held`` (by name, as it travelled) is not asked for."""
        last = self.stages - 1
        model, bound = self.run.model, self.run.timeouts.reply_max_abs
        digests = {"x": forwards[k - 1].output, "gx": (backwards[k] if k < last else forwards[last]).output}
        specs = {"x": stage_input_spec(model, k, batch), "gx": stage_input_spec(model, k, batch)}
        if k < last:
            digests["y"] = forwards[k].output
            digests["g"] = (backwards[k + 1] if k + 1 < last else forwards[last]).output
            specs["y"] = specs["g"] = stage_output_spec(model, k, batch)
        wanted = {"x"} | ({"y"} if forward and k < last else set()) | ({"gx", "g"} if gradient else set())
        local = {name: _as_received(tensor, self.run) for name, tensor in (held or {}).items() if name in wanted}
        digests = {name: digest for name, digest in digests.items() if name in wanted and name not in local}
        training = self.run.training
        if not digests:
            return local
        try:
            out, reply, _ = await self.hops.call(
                self.hops.p2p, peer, self.hops.namespaces[f"layer{k}"], SHOW_OP, [],
                {"mb": mb, "want": sorted(digests)}, timeout_s=SHOW_TIMEOUT_S, codec=training.codec,
                rank=training.wire_rank,
                max_bytes=int(training.max_payload_mb * 2**20), traffic=self.hops.traffic,
                expect_bytes=self._shown_bytes(k, batch, digests))
            have = reply.get("have")
            if not isinstance(have, list) or sorted(have) != sorted(digests) or len(out) != len(have):
                raise TrailError(f"it showed {str(have)[:60]}")
            shown = {}
            for name, tensor in zip(have, out):
                tensor = check_reply_tensor(tensor, specs[name], bound, f"shown {name}")
                if tensor_digest(payload_of(tensor)) != digests[name]:
                    raise TrailError(f"its {name} is not the tensor its receipt names")
                shown[name] = tensor
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.unshown_total += 1
            misses = self.unshown.get(peer, 0) + 1
            self.unshown[peer] = misses
            logger.info("layer%d peer %s did not show a pushed hop drawn for a check (%s: %s)", k, peer[-8:],
                        exc.__class__.__name__, exc)
            if misses >= UNSHOWN_IN_ROW:
                self.unshown.pop(peer, None)
                self.avoid[peer] = time.monotonic() + UNSHOWN_AVOID_S
                logger.warning("layer%d peer %s showed none of its last %d pushed hops drawn for a check: its hops "
                               "are relayed (and checked before use) for %.0f s", k, peer[-8:], UNSHOWN_IN_ROW,
                               UNSHOWN_AVOID_S)
            return None
        self.unshown.pop(peer, None)
        return {**shown, **local}

    async def _recheck(self, mb: str, k: int, peer: str, shown: dict[str, torch.Tensor],
                       forwards: dict[int, Receipt], backwards: dict[int, Receipt], ids: torch.Tensor, ids_d: bytes,
                       loss: float, forward: bool, gradient: bool) -> None:
        """The check a relayed hop gets (swarm/pipeline/control/spot_checks.py), on what the peer showed."""
        driver, spot, last = self.driver, self.driver.spot, self.stages - 1
        vouch = Vouch(self.run.run_id, mb, forwards[k - 1].output, ids_d)
        meta = driver._meta(mb, forwards[k - 1])
        if k == 1:
            meta["ids"] = ids_bytes(ids)
        self.checked += 1
        if forward and k < last:
            await spot.after_forward(k, shown["x"], meta, vouch, peer, shown["y"], forwards[k], drawn=True)
        if not gradient:
            return
        if k == last:
            await spot.after_gradient(k, "forward_backward_check", [shown["x"], ids], meta, vouch, peer, shown["gx"],
                                      forwards[k], drawn=True, loss=loss)
            return
        g_receipt = backwards[k + 1] if k + 1 < last else forwards[last]
        chain = {**driver._meta(mb, g_receipt, forwards[k - 1], forwards[k]), "loss": loss}
        await spot.after_gradient(k, "backward_check", [shown["g"], shown["x"]], chain, vouch, peer, shown["gx"],
                                  backwards[k], drawn=True)



def _as_received(tensor: torch.Tensor, run) -> torch.Tensor:
    """A tensor we sent or received, as its peer had it: decoded from the payload that travelled (a lossy codec's
    output is not the float32 tensor it was coded from); as it is when it carries none."""
    item = payload_of(tensor)
    if item is None:
        return tensor
    (decoded,) = decode_tensors([item], max(int(run.training.max_payload_mb * 2**20), 1), coded=True)
    return decoded
