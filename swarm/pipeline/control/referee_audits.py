"""The referee's audits of the updates it upholds (swarm/integrity/audit.py: a lone copy trained to harm), a mixin
of ``Referee`` (swarm/pipeline/control/referee.py): they run beside the lanes, never in their path, and a copy whose
audits climb the loss is handed to ``on_climbing``."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from swarm.integrity.audit import Climbing, update_cosine
from swarm.integrity.receipts import Receipt
from swarm.integrity.recompute import LAST_GRADIENT_OPS, recompute_param_grads
from swarm.integrity.weights import PIN_S

logger = logging.getLogger("swarm.pipeline.control.referee")

AFTER_WAIT_S = 2.0  # an audit waits this long for a receipt of that peer to name the version its update produced
MAX_AUDITS_PENDING = 8
PIN_TRUSTED_S = PIN_S / 3  # a pinned version asked for within this long after the pin was asked is never gone honestly


@dataclass(frozen=True)
class Withheld:
    """A signer that showed a version, kept the next one for our audit at our ask, and then called it gone: an honest
    ring drops its oldest versions first and keeps a pinned one (swarm/integrity/weights.py), so it hid the result
    of that update (a copy trained to harm that shows only the versions its harmless updates made)."""

    version: int
    mb: str

    def describe(self) -> str:
        return (f"withheld its version {self.version} (the result of its update on micro-batch {self.mb}), which it "
                "had promised to keep for this audit")


class UpdateAuditor:
    """Needs: ``versions``, ``audits``, ``_auditing``, ``on_climbing``, ``alone``, ``_fetch``, ``_module``,
    ``_spent``, ``_cost_cap_s``, ``_climbing``, ``_withheld``, ``_unpin``, ``executor``, ``run`` and the counters
    ``audited``, ``unaudited``, ``climbing_not_alone``. ``alone()``: no other driver has been seen in the run lately
    (a verdict convicts only then)."""

    versions: Any
    audits: Any
    _auditing: set
    on_climbing: Any
    alone: Any

    def _start_audit(self, k: int, op: str, peer: str, receipt: Receipt, weights: dict[str, torch.Tensor],
                     forward_weights: dict[str, torch.Tensor] | None, tensors: list[torch.Tensor],
                     targets: torch.Tensor | None, pinned_at: float | None = None) -> None:
        """The audit runs beside the lane, never in its path: it may wait for the next hop there to name the version
        its update produced (a lane that waited for its own next hop would wait for nothing). A verdict goes to
        ``on_climbing``. ``pinned_at``: when we asked the peer to keep that version for us, which it said it does
        (weights.py PIN_S)."""
        if len(self._auditing) >= MAX_AUDITS_PENDING:
            self.unaudited += 1
            return

        async def audit() -> None:
            began = time.monotonic()
            try:
                climbing = await self._audit(k, op, peer, receipt, weights, forward_weights, tensors, targets,
                                             pinned_at)
            except asyncio.CancelledError:
                raise
            except Exception:  # an audit's bug must never reach a lane
                logger.exception("an update audit failed")
                return
            self._spent(peer, min(time.monotonic() - began, self._cost_cap_s(k)))
            if climbing is None or self.on_climbing is None:
                return
            if isinstance(climbing, Withheld):  # whoever else trains it: no honest ring drops a version it pinned
                self.on_climbing(k, self._withheld(k, peer, climbing))
                return
            if not self.alone():
                # Another driver trains this copy too, and an update steps along Adam's momentum, which that driver's
                # micro-batches fill: crafted inputs from it could turn our honest copy's steps against our gradients
                # and have us convict it. Said, not acted on (a hold would do nothing to a lone copy anyway).
                self.climbing_not_alone += 1
                logger.warning("referee: layer%d peer %s: %s; another driver trains it too, so this is not taken "
                               "as proof", k, peer[-8:], climbing.describe())
                return
            self.on_climbing(k, self._climbing(k, peer, receipt, climbing))

        task = asyncio.ensure_future(audit())
        self._auditing.add(task)
        task.add_done_callback(self._auditing.discard)

    async def audits_done(self) -> None:
        """Wait for the audits under way (tests; the driver cancels them when it stops: ``cancel_audits``)."""
        while self._auditing:
            await asyncio.gather(*list(self._auditing), return_exceptions=True)

    def cancel_audits(self) -> None:
        for task in list(self._auditing):
            task.cancel()

    async def _audit(self, k: int, op: str, peer: str, receipt: Receipt, weights: dict[str, torch.Tensor],
                     forward_weights: dict[str, torch.Tensor] | None, tensors: list[torch.Tensor],
                     targets: torch.Tensor | None, pinned_at: float | None = None) -> Climbing | Withheld | None:
        """The update this upheld claim made (its version to the next): does it descend its micro-batch's loss?
        (swarm/integrity/audit.py) Only where a verified receipt of that peer named the weights of the next version;
        no verdict when those cannot be had (a slow link is no lie)."""
        after_digest = self.versions.digest(peer, k, receipt.version + 1)
        waited = 0.0
        while after_digest is None and waited < AFTER_WAIT_S:  # the next hop there names it soon (lanes in flight)
            await asyncio.sleep(0.1)
            waited += 0.1
            after_digest = self.versions.digest(peer, k, receipt.version + 1)
        if after_digest is None or after_digest == receipt.weights:
            self.unaudited += 1
            return None
        # asked well within the pin's life (a large stage's fetch over a home link takes tens of seconds)
        promised = pinned_at is not None and time.monotonic() - pinned_at < PIN_TRUSTED_S
        try:
            # from the peer itself where it pinned it for us (this fetch lets its pin go there)
            after = await self._fetch(k, peer, after_digest, release=pinned_at is not None)
        except Exception as exc:  # gone, busy, slow, or weights that are not the ones named: no audit either way
            if pinned_at is not None and getattr(exc, "code", "") == "weights_gone":
                self._unpin(peer)
                if promised:  # ... but for a version it promised to keep
                    return Withheld(receipt.version + 1, receipt.mb)
            logger.info("referee: layer%d peer %s did not show its version %d for an audit (%s)", k, peer[-8:],
                        receipt.version + 1, str(exc)[:160])
            return None
        if pinned_at is not None:
            self._unpin(peer)
        loop = asyncio.get_running_loop()
        try:
            grads = await loop.run_in_executor(
                self.executor, recompute_param_grads, self.run.model, self._module(k), op, weights,
                tensors[:1] if op in LAST_GRADIENT_OPS else tensors, targets, forward_weights,
                self.run.training.weight_stashing)
            cosine = await loop.run_in_executor(self.executor, update_cosine, weights, after, grads)
        except ValueError:
            return None
        self.audited += 1
        logger.debug("referee at layer%d: peer %s's update at version %d: cosine %+.3f with its descent", k, peer[-8:],
                     receipt.version, cosine)
        return self.audits.add(peer, k, cosine)
