"""The driver's spot checks (swarm/integrity/spot.py): a share of forward hops is also computed by a second peer of
the same swarm (``infer`` on the same input and receipt: it applies nothing), and the two signed outputs are
compared; as much of gradient hops (``forward_backward_check`` [x, ids] at the last stage, ``backward_check``
[g, x] with the chain of receipts elsewhere: the input gradient recomputed, nothing applied), compared by the
looser GRADIENTS bounds. When they disagree a third peer arbitrates; the odd one out is not used for ``BAD_REPLY_BAN_S``, and if it
was the peer whose output this micro-batch carries, the micro-batch is dropped before anything downstream applied
it (``Refused``, code ``spot_check``). With no third peer the disagreement is only said: two copies alone cannot
tell which one lies.

As at stage 1's checks of stage 0 (stage0_checks.py), influence is earned by validated work: the driver keeps a
credit per peer (its outputs corroborated by another peer's in a check), and the odd one out is held off only when
the two that outvoted it have each more credit than it has; two fresh colluding keys cannot steer our traffic away
from an honest peer. The micro-batch whose output is the odd one is dropped either way: an output before anything downstream applied
it, a gradient before anything upstream did (that micro-batch is lost: the stages after it applied their updates).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
import collections
from collections import deque
from typing import Any

import torch

from swarm.integrity.spot import (
    ACTIVATIONS,
    GRADIENTS,
    ESTABLISHED_CREDIT,
    SPOT_SHARE,
    Bounds,
    CreditBook,
    checked_share,
    odd_one_out,
    similarity,
)
from swarm.integrity.receipts import Receipt
from swarm.pipeline.control.hops import HopCaller, HopGivenUp, NeedInputReply, Refused
from swarm.pipeline.control.referee import Referee
from swarm.pipeline.transport.replies import Vouch
from swarm.pipeline.control.routing import BAD_REPLY_BAN_S
from swarm.pipeline.control.spot_referee import DISPUTE_BOTH_HOLD, DISPUTE_SETTLED, Claim, SpotReferee

logger = logging.getLogger(__name__)

SIMILARITIES_KEPT = 200
LONE_UPDATE_SHARE = 0.12  # update hops of a swarm's only copy checked (and their updates audited) at least this often


class SpotChecker(SpotReferee):
    def __init__(self, hops: HopCaller, share: float = SPOT_SHARE, seed: int = 0, referee: Referee | None = None):
        self.hops = hops
        self.referee = referee  # recomputes disputed hops from committed weights (None: disputes go to a vote)
        if referee is not None:
            referee.on_climbing = self._climbing
        self.convicted = 0  # signers whose claim did not follow from their committed weights
        self.unshown = 0  # disputed claims whose weights could not be had: not used, nobody convicted
        self.refereed_alone = 0  # hops of a swarm without a second copy, recomputed by the referee
        self.referee_skipped = 0  # sampled hops of upheld peers left unchecked: the referee was over its time budget
        self._background: set[asyncio.Task] = set()
        self._unshown_in_row: dict[str, int] = {}  # peer -> sampled hops in a row it showed no weights for
        self._hidden_in_row: dict[str, int] = {}  # ... or whose update's result it would not keep (SpotReferee._hidden)
        self._hidden_holds: dict[str, int] = {}  # peer -> times a lone copy was held off so, in a row
        self.hidden_holds = 0
        self.share = share
        self.rng = random.Random(seed)
        self.checked = 0  # forward hops replicated
        self.agreed = 0
        self.near = 0  # not agreeing, not far: corroborated all the same (skewed copies)
        self.caught = 0  # odd ones out found
        self.outweighed = 0  # odd ones out not held off: their accusers had less validated work
        self.gradients_checked = 0  # of which gradient hops (a last stage's forward_backward, a backward)
        self.book = CreditBook()  # peer -> its outputs corroborated in our checks
        # the latest checks' (cosine, norm ratio) of the first two outputs: how far honest copies are apart here
        self.similarities: dict[str, deque[tuple[float, float]]] = {
            "activations": deque(maxlen=SIMILARITIES_KEPT), "gradient": deque(maxlen=SIMILARITIES_KEPT)}
        self._seen: dict[str, int] = {}
        self._cannot: collections.defaultdict[str, set[str]] = collections.defaultdict(set)  # op -> peers without it
        self._knows: collections.defaultdict[str, set[str]] = collections.defaultdict(set)  # op -> peers that know it
        self._said: set[tuple[str, str]] = set()

    @property
    def credit(self) -> dict[str, int]:
        """Per peer, its outputs corroborated in our checks (the book's own dict)."""
        return self.book.credit

    async def after_forward(self, k: int, x: torch.Tensor, meta: dict, vouch: Vouch, primary: str,
                            out: torch.Tensor, receipt: Receipt | None = None, *, drawn: bool = False) -> None:
        """Maybe replicate the forward hop that ``primary`` served (``receipt``: its reply's, which commits to its
        weights); raises Refused when ``primary`` is caught. ``drawn``: the hop was drawn for a check already (a
        pushed hop, checked after the fact: swarm/pipeline/control/push_driver.py)."""
        await self._maybe_replicate(k, "infer", [x], meta, vouch, primary, out, ACTIVATIONS,
                                    Claim(primary, out, receipt, "forward"), drawn)

    async def after_gradient(self, k: int, op: str, tensors: list[torch.Tensor], meta: dict, vouch: Vouch,
                             primary: str, grad_in: torch.Tensor, receipt: Receipt | None = None, *,
                             drawn: bool = False, loss: float | None = None) -> None:
        """Maybe replicate the gradient hop that ``primary`` served (the last stage's forward_backward: ``op``
        forward_backward_check, ``tensors`` [x, ids]; another stage's backward: backward_check, [g, x], ``meta`` with
        the receipts of g, x and primary's forward);
        raises Refused when ``primary`` is caught. Its update is applied already: what the check keeps from
        anyone upstream is the wrong input gradient, and the peer that computed it from our traffic."""
        primary_op = "forward_backward" if op == "forward_backward_check" else "backward"
        await self._maybe_replicate(k, op, tensors, meta, vouch, primary, grad_in, GRADIENTS,
                                    Claim(primary, grad_in, receipt, primary_op, loss), drawn)

    async def _maybe_replicate(self, k: int, op: str, tensors: list[torch.Tensor], meta: dict, vouch: Vouch,
                               primary: str, out: torch.Tensor, bounds: Bounds, claim: Claim,
                               drawn: bool = False) -> None:
        router = self.hops.routers[f"layer{k}"]
        share = self.gradient_share_for(k, primary) if bounds is GRADIENTS else self.share_for(primary)
        if not drawn and (self.share <= 0 or self.rng.random() >= share):
            return
        other = self._usable(router, exclude=[primary, *self._cannot[op]]) if len(router.peers) >= 2 else None
        refereed = self.referee is not None and self.referee.can_judge(claim.op)  # not a training op with dropout
        if other is None or (refereed and not self.established(primary)):
            # no second copy to compare with, or a newcomer (fresh keys could earn credit by agreeing with each other):
            # the referee recomputes the hop itself, and only that earns a newcomer its standing
            await self._referee_alone(k, tensors, claim)
            return
        second, second_receipt, second_loss = await self._recompute(k, op, tensors, meta, vouch, other)
        if second is None:
            return
        self.checked += 1
        kind = "gradient" if bounds is GRADIENTS else "activations"
        if kind == "gradient":
            self.gradients_checked += 1
        seen = similarity(out, second)
        if seen is not None:
            self._observe(kind, k, op, seen)
        agreed = bounds.agrees(seen)
        if agreed or not bounds.is_far(seen):
            # Agreed, or apart within the verdicts' own bound (honest copies of a layer that trains on skewed
            # shards disagree at the 0.9 cosine without being far): neither can be the odd one of any trio
            # (odd_one_out wants it far from every other), so no third peer is asked. Both are corroborated, as at
            # stage 1's checks of stage 0, when they are near (bounds.near: for gradients closer than not-far)
            if agreed:
                self.agreed += 1
            else:
                self.near += 1
            if agreed or bounds.is_near(seen):
                for peer in (primary, other):
                    # with a referee, agreement adds to a standing recomputation earned, never starts one: two fresh
                    # keys agreeing with each other prove nothing (settled evidence, not a count of keys)
                    if not refereed or self.established(peer):
                        self.book.add(peer)
            return
        # A far disagreement: settled by recomputing the disputed hops from the weights each signer committed to (one
        # honest referee suffices, no vote); only when both claims follow from their weights (copies that differ, or
        # a copy trained to harm) or neither could be checked does a third peer's word count, and then with credit
        # the second copy's loss is a claim too (its receipt signs it): a last stage that hides harm behind a false
        # loss was drawn far more often as the recomputer of an honest copy's hops than for its own (session 15)
        dispute = await self._referee_dispute(k, tensors, claim, Claim(other, second, second_receipt, op, second_loss),
                                              kind)
        if dispute == DISPUTE_SETTLED:
            return
        third = self._usable(router, exclude=[primary, other, *self._cannot[op]])
        arbiter = (await self._recompute(k, op, tensors, meta, vouch, third))[0] if third is not None else None
        if arbiter is None:
            self._say_once(primary, other, f"spot check at layer{k}: peers {primary[-8:]} and {other[-8:]} computed "
                                           f"different {kind} for the same input; no third peer to tell which is "
                                           "wrong")
            return
        odd = odd_one_out([out, second, arbiter], bounds)
        if odd is None:
            return
        trio = (primary, other, third)
        culprit = trio[odd]
        accusers = [p for p in trio if p != culprit]
        outvoted = self.book.outvoted(culprit, *accusers)
        if outvoted:
            self.caught += 1
            ban_s = router.failure(culprit, time.monotonic(), min_ban_s=BAD_REPLY_BAN_S, convicted=True)
            logger.warning("spot check at layer%d: peer %s computed an output (%s) two other peers disagree with; not "
                           "using it for %.0f s", k, culprit[-8:], kind, ban_s)
        else:  # its accusers have less validated work than it has: no routing ban on their word
            self.outweighed += 1
            logger.info("spot check at layer%d: peer %s computed an output (%s) two other peers disagree with, who "
                        "have less validated work than it has: not held off", k, culprit[-8:], kind)
        # an output the referee found to follow from its signer's weights is passed on unless its accusers have the
        # standing to hold it off: two keys trained to harm outvoted the honest copy at layer2 and had 7 of its
        # micro-batches dropped in 20 s (session 27, six_keys_last_harm); whether its weights do harm is for route
        # losses to judge. An output nobody could check is dropped on their word, as before (it may be the wrong one)
        if culprit == primary and (outvoted or dispute != DISPUTE_BOTH_HOLD):
            raise Refused("spot_check", f"layer{k} peer {primary[-8:]} failed a spot check (its {kind} disagree "
                                        "with two other peers'): not passed on")

    def cancel_background(self) -> None:
        """The driver stops: background referees and announcements end with it."""
        for task in list(self._background):
            task.cancel()
        if self.referee is not None:
            self.referee.cancel_audits()

    def established(self, peer: str) -> bool:
        """Has ``peer`` validated work here (ESTABLISHED_CREDIT outputs corroborated in our checks)? Routing bounds
        the share of hops that go to peers without it (swarm/pipeline/control/routing.py NEWCOMER_ROUTE_SHARE)."""
        return self.book.get(peer) >= ESTABLISHED_CREDIT

    def share_for(self, primary: str) -> float:
        """How often a hop ``primary`` served is checked: ``share``, or NEWCOMER_FACTOR times it while ``primary`` has
        fewer than ESTABLISHED_CREDIT outputs corroborated here (a stage peer new to us, or one caught, whose credit
        a conviction cleared): a stranger that lies from its first hop is caught within a few hops, not ~1/share."""
        return checked_share(self.share, self.book.get(primary))

    def gradient_share_for(self, k: int, primary: str) -> float:
        """How often an update hop (a gradient) ``primary`` served at stage ``k`` is checked: as ``share_for``, and at
        least LONE_UPDATE_SHARE where it is its swarm's only copy. There a recomputation is the only check, and the
        audit of the update (swarm/integrity/audit.py) needs MIN_AUDITS of them to judge a copy trained to harm: at 3 %
        a digits run's lone last stage was audited ~25 times in the 20 s that took the run to chance."""
        share = self.share_for(primary)
        if self.share > 0 and len(self.hops.routers[f"layer{k}"].peers) < 2:
            share = max(share, LONE_UPDATE_SHARE)
        return share

    def _observe(self, kind: str, k: int, op: str, seen: tuple[float, float]) -> None:
        """Keep how far the two copies were apart; every SIMILARITIES_KEPT checks of a kind, say how far copies
        of this run are apart (the bounds in swarm/integrity/spot.py must leave honest copies well inside)."""
        kept = self.similarities[kind]
        kept.append(seen)
        logger.debug("spot check at layer%d (%s): cosine %.3f, norm ratio %.3f", k, op, *seen)
        self._seen[kind] = self._seen.get(kind, 0) + 1
        if self._seen[kind] % SIMILARITIES_KEPT == 0:
            cos, ratio = sorted(c for c, _ in kept), sorted(r for _, r in kept)
            logger.info("spot checks (%s), the last %d: cosine min %.3f, 5th percentile %.3f, median %.3f; norm ratio "
                        "min %.3f, 5th percentile %.3f, median %.3f", kind, len(kept), cos[0],
                        cos[len(cos) // 20], cos[len(cos) // 2], ratio[0], ratio[len(ratio) // 20],
                        ratio[len(ratio) // 2])

    @staticmethod
    def _usable(router: Any, exclude: list[str]) -> str | None:
        """Another peer to replicate on, or None: never one the router bans or that holds us off (a black hole, a
        peer that failed a check), nor one that never answered us or whose last request failed or went unanswered
        (a black hole, before its first timeout or after its ban ran out), since a spot check must not make a lane
        wait out a timeout."""
        now = time.monotonic()
        peer = router.choose(now, exclude=exclude)
        if peer is None or peer in exclude:
            return None
        stats = router.peers.get(peer)
        if not router.may_ask(peer, now) or stats.service_ema_s is None or stats.abandoned:
            return None
        return peer

    async def _recompute(self, k: int, op: str, tensors: list[torch.Tensor], meta: dict, vouch: Vouch,
                         peer: str) -> tuple[torch.Tensor | None, Receipt | None, float | None]:
        """``peer``'s recomputation: its tensor, its receipt and (a last stage's check) the loss it reports. A peer is
        asked for its first ``op`` one lane at a time: an older client that does not know it strikes us once, not
        once per lane (two lanes asked at once on a loaded machine)."""
        first = peer not in self._knows[op]
        if first:
            self._cannot[op].add(peer)  # until it answers: no other lane asks it meanwhile
        try:
            (out,), reply, _ = await self.hops.hop(k, op, tensors, meta, only=peer, vouch=vouch)
            self._knows[op].add(peer)
            if first:
                self._cannot[op].discard(peer)
            loss = reply.get("loss")
            finite = isinstance(loss, float) and math.isfinite(loss)
            return out, reply.get("receipt"), loss if finite else None
        except (HopGivenUp, NeedInputReply, Refused) as exc:  # a replica that fails is no evidence either way
            if isinstance(exc, Refused) and exc.code == "rejected" and "unknown op" in exc.reason:
                # a client from before this op (runs mix versions): it struck us once; never asked for one again
                self._cannot[op].add(peer)
                logger.info("layer%d peer %s does not know %s (an older client): not asked for checks", k,
                            peer[-8:], op)
            elif first and isinstance(exc, Refused):
                self._knows[op].add(peer)  # it knows the op: it refused this one for another reason
                self._cannot[op].discard(peer)
            elif first:
                self._cannot[op].discard(peer)  # no answer at all: it may be asked again
            logger.debug("spot check at layer%d peer %s: %s", k, peer[-8:], exc)
            return None, None, None
        except BaseException:
            if first and peer not in self._knows[op]:
                self._cannot[op].discard(peer)
            raise

    def _say_once(self, a: str, b: str, text: str) -> None:
        pair = (min(a, b), max(a, b))
        if pair not in self._said:
            self._said.add(pair)
            logger.warning(text)

    def stats(self) -> dict[str, Any]:
        return {"checked": self.checked, "gradients_checked": self.gradients_checked, "agreed": self.agreed,
                "near": self.near, "caught": self.caught, "outweighed": self.outweighed, "convicted": self.convicted,
                "unshown": self.unshown, "refereed_alone": self.refereed_alone,
                "referee_skipped": self.referee_skipped, "hidden_holds": self.hidden_holds,
                **({"referee": self.referee.stats()} if self.referee is not None else {})}
