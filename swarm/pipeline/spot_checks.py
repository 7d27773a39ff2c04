"""The driver's spot checks (swarm/integrity/spot.py): a share of forward hops is also computed by a second peer of
the same swarm (``infer`` on the same input and receipt: it applies nothing), and the two signed outputs are
compared. When they disagree a third peer arbitrates; the odd one out is not used for ``BAD_REPLY_BAN_S``, and if it
was the peer whose output this micro-batch carries, the micro-batch is dropped before anything downstream applied
it (``Refused``, code ``spot_check``). With no third peer the disagreement is only said: two copies alone cannot
tell which one lies.

As at stage 1's checks of stage 0 (stage0_checks.py), influence is earned by validated work: the driver keeps a
credit per peer (its outputs corroborated by another peer's in a check), and the odd one out is held off only when
the two that outvoted it have each more credit than it has; two fresh colluding keys cannot steer our traffic away
from an honest peer. The micro-batch whose output is the odd one is dropped either way (nothing downstream applied
it yet).
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import torch

from swarm.integrity.spot import SPOT_SHARE, CreditBook, agree, far, odd_one_out
from swarm.pipeline.hops import HopCaller, HopGivenUp, NeedInputReply, Refused
from swarm.pipeline.replies import Vouch
from swarm.pipeline.routing import BAD_REPLY_BAN_S

logger = logging.getLogger(__name__)


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
        self.book = CreditBook()  # peer -> its outputs corroborated in our checks
        self._said: set[tuple[str, str]] = set()

    @property
    def credit(self) -> dict[str, int]:
        """Per peer, its outputs corroborated in our checks (the book's own dict)."""
        return self.book.credit

    async def after_forward(self, k: int, x: torch.Tensor, meta: dict, vouch: Vouch, primary: str,
                            out: torch.Tensor) -> None:
        """Maybe replicate the forward hop that ``primary`` served; raises Refused when ``primary`` is caught."""
        router = self.hops.routers[f"layer{k}"]
        if self.share <= 0 or len(router.peers) < 2 or self.rng.random() >= self.share:
            return
        other = self._usable(router, exclude=[primary])
        if other is None:
            return
        second = await self._infer(k, x, meta, vouch, other)
        if second is None:
            return
        self.checked += 1
        agreed = agree(out, second)
        if agreed or not far(out, second):
            # Agreed, or apart within the verdicts' own bound (honest copies of a layer that trains on skewed
            # shards disagree at the 0.9 cosine without being far): both corroborated, as at stage 1's checks of
            # stage 0. Neither can be the odd one of any trio (odd_one_out wants it far from every other), so
            # no third peer is asked.
            if agreed:
                self.agreed += 1
            else:
                self.near += 1
            for peer in (primary, other):
                self.book.add(peer)
            return
        third = self._usable(router, exclude=[primary, other])
        arbiter = await self._infer(k, x, meta, vouch, third) if third is not None else None
        if arbiter is None:
            self._say_once(primary, other, f"spot check at layer{k}: peers {primary[-8:]} and {other[-8:]} computed "
                                           "different outputs for the same input; no third peer to tell which is wrong")
            return
        odd = odd_one_out([out, second, arbiter])
        if odd is None:
            return
        trio = (primary, other, third)
        culprit = trio[odd]
        accusers = [p for p in trio if p != culprit]
        if self.book.outvoted(culprit, *accusers):
            self.caught += 1
            ban_s = router.failure(culprit, time.monotonic(), min_ban_s=BAD_REPLY_BAN_S)
            logger.warning("spot check at layer%d: peer %s computed an output two other peers disagree with; not "
                           "using it for %.0f s", k, culprit[-8:], ban_s)
        else:  # its accusers have less validated work than it has: no routing ban on their word
            self.outweighed += 1
            logger.info("spot check at layer%d: peer %s computed an output two other peers disagree with, who have "
                        "less validated work than it has: not held off", k, culprit[-8:])
        if culprit == primary:
            raise Refused("spot_check", f"layer{k} peer {primary[-8:]} failed a spot check (its output disagrees with "
                                        "two other peers'): the micro-batch is dropped before anything applied it")

    @staticmethod
    def _usable(router: Any, exclude: list[str]) -> str | None:
        """Another peer to replicate on, or None: never one the router bans or that holds us off (a black hole, a
        peer that failed a check), since a spot check must not make a lane wait out a timeout."""
        now = time.monotonic()
        peer = router.choose(now, exclude=exclude)
        if peer is None or peer in exclude:
            return None
        stats = router.peers.get(peer)
        if stats is None or stats.banned_until > now or stats.held_until > now:
            return None
        return peer

    async def _infer(self, k: int, x: torch.Tensor, meta: dict, vouch: Vouch, peer: str) -> torch.Tensor | None:
        try:
            (out,), _, _ = await self.hops.hop(k, "infer", [x], meta, only=peer, vouch=vouch)
            return out
        except (HopGivenUp, NeedInputReply, Refused) as exc:  # a replica that fails is no evidence either way
            logger.debug("spot check at layer%d peer %s: %s", k, peer[-8:], exc)
            return None

    def _say_once(self, a: str, b: str, text: str) -> None:
        pair = (min(a, b), max(a, b))
        if pair not in self._said:
            self._said.add(pair)
            logger.warning(text)

    def stats(self) -> dict[str, Any]:
        return {"checked": self.checked, "agreed": self.agreed, "near": self.near, "caught": self.caught,
                "outweighed": self.outweighed}
