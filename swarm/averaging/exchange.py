"""Best-model exchange's scoring: the context it pulls, and the copies scored on the validation split.

The decision: every ``exchange.every_samples`` samples, pull the copies of ``exchange.candidates``
random online peers and one copy of every other layer (the context), score them and ours on the
run's validation split here (validation.py says why this way), and adopt the best when its
validation loss beats ours by ``exchange.margin``. Nobody's reported loss or clock decides, so there
is no trial to roll back: the measurement comes before the adoption. Under label-skewed shards the
old rule (lowest reported training loss, then a trial on our own shard's micro-batches) rolled back
96 % of its adoptions: a copy that generalises better has a higher loss on one skewed shard
(docs/decisions/best-model-exchange.md has the measured table).

agent.py (``SwarmAveraging.exchange_once``) decides when, fetches the candidates and adopts the
winner through its influence bounds; ``ExchangeScorer`` here pulls the context and scores.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable

from swarm.averaging.checks import ParamsRejected, check_params
from swarm.dht.records import MemberRecord
from swarm.run.runconfig import RunConfig
from swarm.pipeline.stage.worker import StageWorker

logger = logging.getLogger(__name__)

CONTEXT_TRIES = 3  # peers of another swarm asked for a copy to score ours with, before giving up this exchange
OWN = "<own>"  # our copy's name among the scored ones (never a peer id)
Fetch = Callable[..., Awaitable[tuple[dict, dict] | None]]  # SwarmAveraging._fetch: (state, meta) or None
Reject = Callable[[str, str], None]  # (peer, reason): ban its server


class ExchangeScorer:
    """Pulls the context and scores copies against ours for one peer's exchanges (see the module doc)."""

    def __init__(self, run: RunConfig, swarm: str, worker: StageWorker, rng: random.Random, fetch: Fetch,
                 reject: Reject):
        self.run = run
        self.cfg = run.averaging
        self.swarm = swarm
        self.worker = worker
        self._rng = rng  # the agent's loop-thread rng
        self._fetch = fetch
        self._reject = reject
        self._validation: tuple | None = None  # (x, y) validation samples, loaded at the first exchange

    @property
    def samples(self) -> int:
        """How many validation samples the copies were scored on (0 before the first scoring)."""
        return 0 if self._validation is None else len(self._validation[0])

    async def context(self, views: dict[str, list[MemberRecord]], me: str) -> tuple[list, list] | None:
        """Copies of every other layer (one random online peer of each swarm), checked, as modules."""
        from swarm.run.models import build_stage

        before, after = [], []
        for index, swarm in enumerate(self.run.swarm_names):
            if swarm == self.swarm:
                continue
            module = build_stage(self.run.model, index)
            peers = [r.peer_id for r in views.get(swarm, []) if r.state == "online" and r.peer_id != me]
            self._rng.shuffle(peers)
            for peer in peers[:CONTEXT_TRIES]:
                fetched = await self._fetch(peer, self.cfg.timeout_s, swarm=swarm)
                if fetched is None:
                    continue
                try:
                    check_params(module.state_dict(), fetched[0], self.cfg.max_norm_ratio)
                except ParamsRejected as exc:
                    self._reject(peer, f"{swarm} copy for scoring: {exc}")
                    continue
                module.load_state_dict(fetched[0])
                break
            else:
                logger.info("exchange skipped: no usable copy of %s to score ours with", swarm)
                return None
            (before if index < self.worker.index else after).append(module)
        return before, after

    def score(self, context: tuple[list, list], copies: dict[str, dict]):
        """Compute thread: (our score, the candidates' scores, their clocks), or None when a copy does
        not fit ours (it is then rejected and its server banned)."""
        from swarm.averaging.validation import score_copies
        from swarm.run.models import build_stage

        if self._validation is None:
            self._validation = load_validation(self.run, self.cfg.exchange.validation_samples)
        own = self.worker.capture()
        fitting: dict[str, dict] = {}
        for peer, state in copies.items():
            try:
                check_params(own.params, state, self.cfg.max_norm_ratio)
                fitting[peer] = state
            except ParamsRejected as exc:
                self._reject(peer, str(exc))
        if not fitting:
            return None
        scratch = build_stage(self.run.model, self.worker.index)
        x, y = self._validation
        scores = score_copies(self.run.model, context[0], scratch, {OWN: own.params, **fitting}, context[1], x, y)
        clocks = {peer: own.clock for peer in fitting}  # the peer's clock is its claim: the merge keeps ours
        return scores.pop(OWN), scores, clocks


def load_validation(run: RunConfig, max_samples: int) -> tuple:
    """The first ``max_samples`` of the run's validation split (deterministic: every peer has it)."""
    from swarm.averaging.validation import validation_subset
    from swarm.run.data import load_dataset

    dataset = load_dataset(run.data, run.model)
    return validation_subset(dataset.x_val, dataset.y_val, max_samples)


def fmt_score(score) -> str:
    accuracy = f", accuracy {score.accuracy:.3f}" if score.accuracy is not None else ""
    return f"{score.loss:.3f}{accuracy}"
