"""The referee's side of the driver's spot checks (a mixin of ``SpotChecker``, swarm/pipeline/control/spot_checks.py): a
sampled hop of a swarm with no second copy (or of a newcomer) recomputed from the weights its signer committed to, a far
disagreement settled the same way, and what a verdict does (credit, conviction, the backoff of a peer that shows
nothing, the evidence sent to the convict's neighbours)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from swarm.integrity.receipts import Receipt
from swarm.integrity.spot import MAX_CREDITED
from swarm.pipeline.control.hops import Refused
from swarm.pipeline.control.referee import CONVICTED, CONVICTED_BAN_S, HOLDS, UNSHOWN, Verdict
from swarm.pipeline.control.routing import BAD_REPLY_BAN_S
from swarm.pipeline.stage.convictions import announce

logger = logging.getLogger("swarm.pipeline.control.spot_checks")

REFEREE_SAY_S = 1.0  # a lane waiting this long for a newcomer's verdict says so (hops.Blockage: if nothing flows)
MAX_BACKGROUND_REFEREES = 4  # sampled hops of established peers refereed off the lanes' path at once
# what a referee made of a far disagreement (SpotReferee._referee_dispute): settled (a liar convicted or unshown),
# both claims follow from their weights (copies that differ: weights trained to harm, or skewed ones), or neither
DISPUTE_SETTLED, DISPUTE_BOTH_HOLD, DISPUTE_OPEN = "settled", "both hold", ""
UNSHOWN_IN_ROW = 3  # sampled hops in a row whose weights a peer did not show before it is backed off
HIDDEN_IN_ROW = 6  # ... before a lone copy, with us the run's only driver, is held off (SpotReferee._hidden)
HIDDEN_HOLD_S = 60.0  # ... for this long, doubling each time, up to CONVICTED_BAN_S


@dataclass(slots=True, frozen=True)
class Claim:
    """One peer's answer in a check: who, what it returned, the receipt that commits it to its weights, the op."""

    peer: str
    out: torch.Tensor
    receipt: Receipt | None
    op: str
    loss: float | None = None  # a last stage's reported loss (its receipt signs it): the referee checks it too


class SpotReferee:
    """Needs: ``referee``, ``book``, ``hops``, ``_background``, ``_unshown_in_row``, ``_hidden_in_row``,
    ``_hidden_holds`` and the counters ``refereed_alone``, ``referee_skipped``, ``unshown``, ``convicted``,
    ``hidden_holds``."""

    referee: Any
    book: Any
    hops: Any

    def skips_lone(self, k: int, peer: str, op: str) -> bool:
        """Whether a check of ``peer``'s ``op`` at stage ``k`` would come to nothing: the swarm has no second copy and
        the referee would pass it unchecked (none, an op it cannot replay, or its budget spent on a peer it has
        upheld: ``_referee_alone``). A pushed hop's check asks this before it asks the peer to show the hop's
        tensors: on the heavy benchmark the shows of hops the referee then skipped moved as many bytes as the
        pipeline itself."""
        if len(self.hops.routers[f"layer{k}"].peers) >= 2:
            return False
        if self.referee is None or not self.referee.can_judge(op):
            return True
        return self._over_budget(peer, lone=True)

    def _over_budget(self, peer: str, lone: bool) -> bool:
        """A hop of ``peer`` passes unchecked: the referee has upheld it and its budget is spent (referee.
        SAMPLED_BUSY_SHARE, LONE_BUSY_SHARE); never a peer that did not show its weights last time, or would not keep
        its update's result (stalling must not buy it unchecked hops)."""
        return self.book.get(peer) > 0 and not self._unshown_in_row.get(peer) and not self._hidden_in_row.get(peer) \
            and not self.referee.has_time(lone, peer)

    async def _referee_alone(self, k: int, tensors: list[torch.Tensor], claim: Claim) -> None:
        """A sampled hop of a swarm with no second copy, or of a newcomer: recomputed from the weights its signer
        committed to. A claim that follows earns its signer credit; one that does not is refused and its signer
        convicted; one whose weights do not come is refused (nothing doubtful is used) and its signer backed off like
        a failing peer, not convicted (a slow link is no lie)."""
        if self.referee is None or not self.referee.can_judge(claim.op):
            return
        if self.book.get(claim.peer) > 0:
            # Off the lane's path once a recomputation has upheld the peer: its hops not sampled pass unchecked
            # anyway, so holding this one back protects little, while a fetch in the path held the lane (a lane that
            # waited half a second came back 29 updates stale at its stage 0, against 12 at most without it). A lie
            # found later still convicts it and routes every later hop around it. A stranger's first sampled hop
            # waits for its verdict: a liar from its first hop is dropped there.
            if self._over_budget(claim.peer, lone=len(self.hops.routers[f"layer{k}"].peers) < 2):
                self.referee_skipped += 1
                return
            self.refereed_alone += 1
            if len(self._background) < MAX_BACKGROUND_REFEREES:
                task = asyncio.ensure_future(self._referee_later(k, tensors, claim))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            return
        self.refereed_alone += 1
        verdict = asyncio.ensure_future(self._referee_alone_verdict(k, tensors, claim))
        try:
            while not (await asyncio.wait({verdict}, timeout=REFEREE_SAY_S))[0]:
                # the lane waits for a fetch of the stage's weights (a large stage over a slow link: tens of seconds):
                # said if nothing else flows meanwhile (any micro-batch that completes clears it)
                self.hops.blockage.set(f"referee: recomputing a hop of layer{k} peer {claim.peer[-8:]} (new to us) "
                                       "from the weights it committed to, before its outputs are used")
        finally:
            if not verdict.done():
                verdict.cancel()
        verdict.result()

    def _alone_verdict(self, k: int, claim: Claim, verdict: Verdict) -> None:
        if verdict.outcome == HOLDS:
            self.book.add(claim.peer)  # validated work: its claim followed from the weights it committed to
            self._unshown_in_row.pop(claim.peer, None)
            if verdict.pinned is False:  # ... but it would not keep what its update made: that update goes unaudited
                self._hidden(k, claim.peer, verdict)
            elif verdict.pinned:  # an update shown, and its result kept for the audit: auditable (a forward's hold
                # proves nothing of its updates: a copy can show the versions of its harmless ones only)
                self._hidden_in_row.pop(claim.peer, None)
                self._hidden_holds.pop(claim.peer, None)
            return
        if verdict.outcome == CONVICTED:
            self._convict(k, verdict)
            raise Refused("spot_check", f"layer{k} peer {claim.peer[-8:]} was convicted by recomputation: "
                                        f"{verdict.describe()}")
        if verdict.outcome == UNSHOWN:
            # No verdict. A large stage keeps few versions (a 16 MiB one: 2-4) and drops one a referee was about to
            # ask for: refusing and backing off then stalled a heavy run whose swarms had one peer each. So one miss
            # is nothing; a peer that shows nothing UNSHOWN_IN_ROW times running is backed off like a failing one
            # (what a liar that never shows gets), and its sampled micro-batch is refused
            self.unshown += 1
            if verdict.absent:  # "gone" on its own word; a busy door or a slow link counts nothing towards a hold
                self._hidden(k, claim.peer, verdict)
            misses = self._unshown_in_row.get(claim.peer, 0) + 1
            if len(self._unshown_in_row) >= MAX_CREDITED:
                self._unshown_in_row.clear()
            self._unshown_in_row[claim.peer] = misses
            if misses >= UNSHOWN_IN_ROW:
                self._unshown_in_row.pop(claim.peer, None)
                self.hops.routers[f"layer{k}"].failure(claim.peer, time.monotonic())
                raise Refused("spot_check", f"layer{k} peer {claim.peer[-8:]} showed the weights of none of its last "
                                            f"{UNSHOWN_IN_ROW} sampled hops ({verdict.describe()}): not passed on")

    def _hidden(self, k: int, peer: str, verdict: Verdict) -> None:
        """A sampled hop whose weights ``peer`` said are gone, or whose update's result it would not keep for an audit.
        Where it is its swarm's only copy and we the run's only driver, nothing else checks it and an honest one shows
        what nearly every one asks (a lone copy with one driver: 0 of 16 unshown, benchmarks.lone_referee): after
        HIDDEN_IN_ROW such hops in a row it is not trained through for HIDDEN_HOLD_S, doubling each time (a copy that
        hides its weights cannot be audited: one trained to harm took a run to chance so), and the driver says why.
        Elsewhere the backoff of UNSHOWN_IN_ROW stays what it gets."""
        hidden = self._hidden_in_row.get(peer, 0) + 1
        if len(self._hidden_in_row) >= MAX_CREDITED:
            self._hidden_in_row.clear()
        self._hidden_in_row[peer] = hidden
        if hidden < HIDDEN_IN_ROW or len(self.hops.routers[f"layer{k}"].peers) >= 2 or not self.referee.alone():
            return
        self._hidden_in_row.pop(peer, None)
        holds = self._hidden_holds.get(peer, 0)
        if len(self._hidden_holds) >= MAX_CREDITED:
            self._hidden_holds.clear()
        self._hidden_holds[peer] = holds + 1
        hold_s = min(CONVICTED_BAN_S, HIDDEN_HOLD_S * 2 ** holds)
        self.hops.routers[f"layer{k}"].failure(peer, time.monotonic(), min_ban_s=hold_s, proven=True)
        self.hidden_holds += 1
        logger.warning("layer%d peer %s, the only copy of its swarm, showed the weights of none of its last %d sampled "
                       "hops (the last: %s): not trained through for %.0f s", k, peer[-8:], hidden, verdict.describe(),
                       hold_s)
        raise Refused("spot_check", f"layer{k} peer {peer[-8:]} hides the weights it computes with: not trained "
                                    f"through for {hold_s:.0f} s")

    async def _referee_later(self, k: int, tensors: list[torch.Tensor], claim: Claim) -> None:
        try:
            await self._referee_alone_verdict(k, tensors, claim)
        except Refused:
            pass  # convicted or backed off already; its micro-batch went on before the verdict
        except Exception:  # a referee's bug must never reach a lane
            logger.exception("a background referee failed")

    async def _referee_alone_verdict(self, k: int, tensors: list[torch.Tensor], claim: Claim) -> None:
        verdict = await self.referee.judge(k, claim.op, tensors, claim.out, claim.receipt, claim.peer,
                                           loss=claim.loss)
        self._alone_verdict(k, claim, verdict)

    async def _referee_dispute(self, k: int, tensors: list[torch.Tensor], primary: Claim, other: Claim,
                               kind: str) -> str:
        """Settle a far disagreement by recomputation: DISPUTE_SETTLED (a liar convicted, or one claim held while the
        other's weights could not be had), DISPUTE_BOTH_HOLD or DISPUTE_OPEN (falsy). Newcomers are refereed first (the
        fewest corroborated outputs), the second party only when the first held or could not be checked. Raises
        Refused when ``primary`` lost."""
        if self.referee is None or not (self.referee.can_judge(primary.op) and self.referee.can_judge(other.op)):
            return DISPUTE_OPEN
        verdicts: dict[str, Verdict] = {}
        for claim in sorted((primary, other), key=lambda c: self.book.get(c.peer)):
            verdict = await self.referee.judge(k, claim.op, tensors, claim.out, claim.receipt, claim.peer,
                                               loss=claim.loss)
            verdicts[claim.peer] = verdict
            if verdict.outcome == CONVICTED:
                self._convict(k, verdict)
                if claim.peer == primary.peer:
                    raise Refused("spot_check", f"layer{k} peer {primary.peer[-8:]} was convicted by recomputation "
                                                f"(its {kind}: {verdict.describe()}): not passed on")
                return DISPUTE_SETTLED
        outcomes = {verdict.outcome for verdict in verdicts.values()}
        if outcomes == {HOLDS}:
            return DISPUTE_BOTH_HOLD  # the weights differ: a vote with credit decides
        if outcomes != {HOLDS, UNSHOWN}:
            return DISPUTE_OPEN  # neither could be checked
        unshown = next(peer for peer, verdict in verdicts.items() if verdict.outcome == UNSHOWN)
        self.unshown += 1
        ban_s = self.hops.routers[f"layer{k}"].failure(unshown, time.monotonic(), min_ban_s=BAD_REPLY_BAN_S)
        logger.warning("referee at layer%d: peer %s could not show the weights of an output (%s) another peer's "
                       "recomputable one disputes; not using it for %.0f s", k, unshown[-8:], kind, ban_s)
        if unshown == primary.peer:
            raise Refused("spot_check", f"layer{k} peer {primary.peer[-8:]} could not show the weights of its disputed "
                                        f"{kind}: not passed on")
        return DISPUTE_SETTLED

    def _climbing(self, k: int, verdict: Verdict) -> None:
        """A copy whose audited updates climb the loss (swarm/integrity/audit.py): convicted like a wrong tensor, by our
        own recomputations (routed around even as its swarm's last peer), its credit gone; nothing to announce."""
        self._convict(k, verdict)

    def _convict(self, k: int, verdict: Verdict) -> None:
        """A signer proven wrong by recomputation: routed around for CONVICTED_BAN_S, its credit gone, and the evidence
        sent to the stages next to it, which re-check it and refuse its tensors from then on (convictions.py)."""
        self.convicted += 1
        self.book.credit.pop(verdict.peer, None)
        self.hops.routers[f"layer{k}"].failure(verdict.peer, time.monotonic(), min_ban_s=CONVICTED_BAN_S,
                                               proven=True)
        conviction = self.referee.convictions.get(verdict.peer) if self.referee is not None else None
        if conviction is None or len(self._background) >= 2 * MAX_BACKGROUND_REFEREES:
            return
        neighbours = [(peer, self.hops.namespaces[name]) for name in (f"layer{k - 1}", f"layer{k + 1}")
                      if name in self.hops.routers and name != "layer0" for peer in self.hops.routers[name].peers]
        task = asyncio.ensure_future(announce(conviction, neighbours, self.hops.call, self.hops.p2p, self.hops.run))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
