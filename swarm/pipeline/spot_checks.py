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

import logging
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
from swarm.pipeline.hops import HopCaller, HopGivenUp, NeedInputReply, Refused
from swarm.pipeline.replies import Vouch
from swarm.pipeline.routing import BAD_REPLY_BAN_S

logger = logging.getLogger(__name__)

SIMILARITIES_KEPT = 200


class SpotChecker:
    def __init__(self, hops: HopCaller, share: float = SPOT_SHARE, seed: int = 0):
        self.hops = hops
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
        self._said: set[tuple[str, str]] = set()

    @property
    def credit(self) -> dict[str, int]:
        """Per peer, its outputs corroborated in our checks (the book's own dict)."""
        return self.book.credit

    async def after_forward(self, k: int, x: torch.Tensor, meta: dict, vouch: Vouch, primary: str,
                            out: torch.Tensor) -> None:
        """Maybe replicate the forward hop that ``primary`` served; raises Refused when ``primary`` is caught."""
        await self._maybe_replicate(k, "infer", [x], meta, vouch, primary, out, ACTIVATIONS)

    async def after_gradient(self, k: int, op: str, tensors: list[torch.Tensor], meta: dict, vouch: Vouch,
                             primary: str, grad_in: torch.Tensor) -> None:
        """Maybe replicate the gradient hop that ``primary`` served (the last stage's forward_backward: ``op``
        forward_backward_check, ``tensors`` [x, ids]; another stage's backward: backward_check, [g, x], ``meta`` with
        the receipts of g, x and primary's forward);
        raises Refused when ``primary`` is caught. Its update is applied already: what the check keeps from
        anyone upstream is the wrong input gradient, and the peer that computed it from our traffic."""
        await self._maybe_replicate(k, op, tensors, meta, vouch, primary, grad_in, GRADIENTS)

    async def _maybe_replicate(self, k: int, op: str, tensors: list[torch.Tensor], meta: dict, vouch: Vouch,
                               primary: str, out: torch.Tensor, bounds: Bounds) -> None:
        router = self.hops.routers[f"layer{k}"]
        if self.share <= 0 or len(router.peers) < 2 or self.rng.random() >= self.share_for(primary):
            return
        other = self._usable(router, exclude=[primary, *self._cannot[op]])
        if other is None:
            return
        second = await self._recompute(k, op, tensors, meta, vouch, other)
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
                    self.book.add(peer)
            return
        third = self._usable(router, exclude=[primary, other, *self._cannot[op]])
        arbiter = await self._recompute(k, op, tensors, meta, vouch, third) if third is not None else None
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
        if self.book.outvoted(culprit, *accusers):
            self.caught += 1
            ban_s = router.failure(culprit, time.monotonic(), min_ban_s=BAD_REPLY_BAN_S, convicted=True)
            logger.warning("spot check at layer%d: peer %s computed an output (%s) two other peers disagree with; not "
                           "using it for %.0f s", k, culprit[-8:], kind, ban_s)
        else:  # its accusers have less validated work than it has: no routing ban on their word
            self.outweighed += 1
            logger.info("spot check at layer%d: peer %s computed an output (%s) two other peers disagree with, who "
                        "have less validated work than it has: not held off", k, culprit[-8:], kind)
        if culprit == primary:
            raise Refused("spot_check", f"layer{k} peer {primary[-8:]} failed a spot check (its {kind} disagree "
                                        "with two other peers'): not passed on")

    def established(self, peer: str) -> bool:
        """Has ``peer`` validated work here (ESTABLISHED_CREDIT outputs corroborated in our checks)? Routing bounds
        the share of hops that go to peers without it (swarm/pipeline/routing.py NEWCOMER_ROUTE_SHARE)."""
        return self.book.get(peer) >= ESTABLISHED_CREDIT

    def share_for(self, primary: str) -> float:
        """How often a hop ``primary`` served is checked: ``share``, or NEWCOMER_FACTOR times it while ``primary`` has
        fewer than ESTABLISHED_CREDIT outputs corroborated here (a stage peer new to us, or one caught, whose credit
        a conviction cleared): a stranger that lies from its first hop is caught within a few hops, not ~1/share."""
        return checked_share(self.share, self.book.get(primary))

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
        if stats is None or stats.service_ema_s is None or stats.banned_until > now or stats.held_until > now or \
                stats.failures or stats.abandoned:
            return None
        return peer

    async def _recompute(self, k: int, op: str, tensors: list[torch.Tensor], meta: dict, vouch: Vouch,
                         peer: str) -> torch.Tensor | None:
        try:
            (out,), _, _ = await self.hops.hop(k, op, tensors, meta, only=peer, vouch=vouch)
            return out
        except (HopGivenUp, NeedInputReply, Refused) as exc:  # a replica that fails is no evidence either way
            if isinstance(exc, Refused) and exc.code == "rejected" and "unknown op" in exc.reason:
                # a client from before this op (runs mix versions): it struck us once; never asked for one again
                self._cannot[op].add(peer)
                logger.info("layer%d peer %s does not know %s (an older client): not asked for checks", k,
                            peer[-8:], op)
            logger.debug("spot check at layer%d peer %s: %s", k, peer[-8:], exc)
            return None

    def _say_once(self, a: str, b: str, text: str) -> None:
        pair = (min(a, b), max(a, b))
        if pair not in self._said:
            self._said.add(pair)
            logger.warning(text)

    def stats(self) -> dict[str, Any]:
        return {"checked": self.checked, "gradients_checked": self.gradients_checked, "agreed": self.agreed,
                "near": self.near, "caught": self.caught, "outweighed": self.outweighed}
