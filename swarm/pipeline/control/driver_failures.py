"""What a driver's lane does when a micro-batch cannot pass (a method mixin of ``PipelineDriver``,
swarm/pipeline/control/driver.py): a refusal is counted, said and backed off from; a bug costs its micro-batch and is
logged once; the author of a refused tensor is routed around."""

from __future__ import annotations

import asyncio
import logging
import time

from swarm.integrity.labels import WRONG_SHARD_HOLD_S
from swarm.pipeline.control.hops import Refused
from swarm.pipeline.control.routing import BAD_REPLY_BAN_S, backoff_s

logger = logging.getLogger("swarm.pipeline.control.driver")

REFUSED_BACKOFF_BASE_S = 0.2
# After a ``wrong_shard`` refusal the driver trains on its own shard only for this long (its view of who
# holds what disagreed with a stage's), and backs off this little: the refusal is about views, not load. The stages
# strike a driver that goes on past a refusal (integrity/labels.py ShardRefusals): the hold is the protocol's.
COVER_HOLD_S = WRONG_SHARD_HOLD_S


class LaneFailures:
    async def _refused(self, exc: Refused) -> None:
        """A stage refused a micro-batch: count it, say why, back off (exponential, capped)."""
        self.stats.refused += 1
        self.blockage.set(exc.reason)
        if exc.code in ("bad_author", "spot_check"):  # not our doing: its author is routed around, no backoff
            self._avoid_author(exc)
            return
        if exc.code == "unknown_signer":  # a peer that computed part of this micro-batch is gone: the next one passes
            await asyncio.sleep(REFUSED_BACKOFF_BASE_S)
            return
        if exc.code == "wrong_shard":
            logger.info("a micro-batch was refused as outside our shards (%s); training on our own shard only "
                        "for %.0f s", exc.reason, COVER_HOLD_S)
            if time.monotonic() >= self._cover_hold_until:
                self._cover_hold_until = time.monotonic() + COVER_HOLD_S
                self.cover_shards(())
            await asyncio.sleep(REFUSED_BACKOFF_BASE_S)
            return
        self._refused_streak += 1
        await asyncio.sleep(backoff_s(self._refused_streak, REFUSED_BACKOFF_BASE_S,
                                      self.run.timeouts.reject_backoff_max_s))

    def _lane_bug(self, exc: Exception) -> None:
        self.stats.lost += 1
        kind = exc.__class__.__name__
        if kind not in self._bugs_seen:
            self._bugs_seen.add(kind)
            logger.exception("a micro-batch failed unexpectedly; the lane goes on (further %s are not logged)", kind)
            self.notify("error", f"a micro-batch failed ({kind}: {exc}); the driver goes on")

    def _avoid_author(self, exc: Refused) -> None:
        """A stage refused a tensor we relayed because its author is banned there: we stop using that peer too."""
        if exc.code != "bad_author" or not exc.author:
            return
        for name, router in self.routers.items():
            if exc.author in router.peers:
                # not "proven" on a neighbour's word, even one that says it banned the author: a hostile middle
                # stage could say so of an honest lone last stage and stall its swarm (only our own referee's
                # recomputation keeps a swarm's last peer out: spot_checks.py _convict)
                ban_s = router.failure(exc.author, time.monotonic(), min_ban_s=BAD_REPLY_BAN_S, convicted=True)
                logger.warning("%s peer %s computed a tensor a stage refused; not using it for %.0f s", name,
                               exc.author[-8:], ban_s)
