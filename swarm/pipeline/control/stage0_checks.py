"""A stage-1 peer's spot checks of the stage-0 outputs it is sent (swarm/integrity/spot.py ``judge_author``).

A driver authors its own stage 0's output: it signs it, and nothing else vouched for it. Any other layer0 peer can
recompute it from the same sample ids (swarm/pipeline/stage/stage0_replicas.py), so a share of the forwards that reach
stage 1 (``share``, SPOT_SHARE by default) are also recomputed by another online layer0 peer of the run, asked
at random; when the two disagree a third arbitrates. Only when the author is the odd one out (far from both while
they are not far from each other, with their signed receipts as the evidence) is it blamed: the micro-batch is
refused (``spot_check``) before stage 1 replies or applies anything, and the author gets ``VERDICT_STRIKES``
strikes in the requester book (a ban at ``ban_strikes``). A replica that is the odd one out gets the strike instead
and is not asked again for a while.
With one other layer0 peer a disagreement is only said: two copies cannot tell which one lies.

Influence is earned by validated work, not by keys (which cost nothing). This peer keeps, per layer0 peer, the
number of its stage-0 outputs it spot-checked and found corroborated (``credit``: work another copy recomputed and
agreed with, or, where honest copies differ as on label-skewed shards, that was not far from either of two
recomputations: the verdicts' own bound). Recomputers are asked in a random order weighted by 1 + credit, and a verdict strikes only when the
two that outvoted the odd one have each earned more credit here than it has: two fresh keys that recompute the
same made-up output for an honest driver's ids (a frame-up: the odd-one-out rule alone cannot tell two liars from
two honest copies) get its micro-batch refused, at most the sampled share of its micro-batches, but never a strike
on anyone: keys with no validated work here strike nobody. A refusal without a strike takes the accusers' credit
off the accused's (so an established liar caught by established peers loses its standing, and is struck once
theirs is larger), never more. A peer convicted loses all its credit. The price: a fresh liar is refused but not
struck until two recomputers have one corroborated output each here (about 1/SPOT_SHARE forwards of theirs).
What is left: colluders who earned credit by authoring work that was corroborated can strike an honest driver
with less credit at this peer (a newcomer).

In the path of the sampled forwards, not asynchronous: a forward answered at once would carry made-up activations
to every stage after this one before a verdict could hold them back (the last stage applies its update at its
forward_backward), so the sampled forward waits for its verdict, at most ``budget_s`` (replicas are asked while
our own forward computes). A slow or absent replica is no evidence: past the budget the check is skipped and
nobody is blamed. The strike is given by the check itself, so a driver that gives up waiting (or races another
stage-1 peer) is still struck.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import torch

from swarm.integrity.receipts import NO_WEIGHTS, ids_digest
from swarm.integrity.spot import (
    AGREED,
    AUTHOR_ODD,
    DISAGREED,
    REPLICA_ODD,
    SKIPPED,
    SPOT_SHARE,
    UNDECIDED,
    CreditBook,
    checked_share,
    far,
    judge_author,
    similarity,
)
from swarm.pipeline.control.referee import CONVICTED, HOLDS
from swarm.pipeline.transport.replies import Vouch, check_receipt, check_reply
from swarm.pipeline.control.stage0_referee import Stage0Referee
from swarm.pipeline.control.routing import BAD_REPLY_BAN_S
from swarm.pipeline.stage.stage_rpc import call_stage, stage_namespace
from swarm.pipeline.transport.wire import coded_bytes
from swarm.run.models import stage_output_spec
from swarm.run.runconfig import RunConfig

logger = logging.getLogger(__name__)

# A sampled forward waits at most this for its verdict: half the hop timeout's floor (1 s), so a check alone does not
# time out an honest driver's hop, and about the round trip of two recomputations on a slow link.
CHECK_BUDGET_S = 0.5
REFEREE_MIN_S = 0.25  # what a referee gets after the replicas disagreed, if their round trips used up the budget
REPLICA_HOLD_S = 10.0  # a layer0 peer that failed to answer a replica is not asked again for this long
MAX_EVIDENCE = 32  # caught authors kept with the receipts that convicted them (tests and status read them)
# Strikes per verdict. Not 1: at SPOT_SHARE a liar at r micro-batches a second collects 0.03 r strikes a second,
# which with the 30 s half-life stays under the 10 of a ban for any r below ~8/s: a slow liar was never banned, only
# 3 % of its micro-batches refused. A verdict is stronger evidence than one bad request (two signed recomputations
# that agree, the author far from both, which no honest copy measured has been): 7 makes two verdicts within a
# half-life a ban (7 x 0.5 + 7 >= 10), i.e. a liar at ~1.1 micro-batches a second or more.
VERDICT_STRIKES = 7.0

Strike = Callable[[str, str, float], None]  # (peer, reason, strikes): StageGate.strike


class Stage0Checker:
    def __init__(self, run: RunConfig, p2p: Any, keys: Any, drivers: Callable[[], Iterable[str]], strike: Strike,
                 *, share: float = SPOT_SHARE, budget_s: float = CHECK_BUDGET_S, seed: int | None = None,
                 call: Callable[..., Any] = call_stage, referee: bool = True, device: str = "cpu"):
        self.run = run
        self.run_id = run.run_id
        self.namespace = stage_namespace(self.run_id, "layer0")
        self.p2p = p2p
        self.keys = keys
        self.drivers = drivers
        self.strike = strike
        self.share = share
        self.budget_s = budget_s
        self.rng = random.Random(seed)
        self.call = call
        self._held: dict[str, float] = {}  # layer0 peer -> not asked for replicas before this (monotonic)
        self._said: set[tuple[str, str]] = set()
        self._tasks: set[asyncio.Task] = set()
        self.evidence: deque[tuple[str, str, list]] = deque(maxlen=MAX_EVIDENCE)  # (author, mb, replica receipts)
        self.book = CreditBook()  # layer0 peer -> its stage-0 outputs we checked and found corroborated
        self.counts = {name: 0 for name in ("checked", AGREED, "caught", "replica_caught", "undecided", SKIPPED,
                                             "said", "outweighed", "convicted", "upheld", "refereed")}
        # recomputes an author's output from the weights its receipt commits to (exact; swarm/pipeline/control/stage0_referee.py)
        self.referee = Stage0Referee(run, p2p, call=call, device=device) if referee else None

    @property
    def credit(self) -> dict[str, int]:
        """Per layer0 peer, its stage-0 outputs we checked and found corroborated (the book's own dict)."""
        return self.book.credit

    def start(self, author: str, mb: str, x: torch.Tensor, ids: torch.Tensor,
              weights: bytes = NO_WEIGHTS) -> asyncio.Task | None:
        """Maybe check ``x``, the stage-0 output ``author`` signed for ``ids`` (with its stage-0 weights' digest
        ``weights``): a task whose result is the verdict (AUTHOR_ODD: refuse it), or None when this forward is not
        sampled or nobody can check it."""
        if self.share <= 0 or self.rng.random() >= checked_share(self.share, self.book.get(author)):
            return None  # a driver new here (or convicted) is checked more often (spot.py NEWCOMER_FACTOR)
        now = time.monotonic()
        others = sorted(d for d in self.drivers() if d != author and self._held.get(d, 0.0) <= now)
        if not others:  # no other copy to compare with: the referee recomputes it from the author's own weights
            if self.referee is None or weights == NO_WEIGHTS:
                return None
            task = asyncio.create_task(self._referee_only(author, mb, x, ids, weights))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return task
        # a random order weighted by 1 + credit (Efraimidis-Spirakis): fresh keys are asked, established peers first
        others.sort(key=lambda d: self.rng.random() ** (1.0 / (1.0 + self.book.get(d))), reverse=True)
        task = asyncio.create_task(self._check(author, mb, x, ids, others, weights))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _referee_only(self, author: str, mb: str, x: torch.Tensor, ids: torch.Tensor, weights: bytes) -> str:
        self.counts["checked"] += 1
        settled = await self._refereed(author, mb, x, ids, weights, time.monotonic() + self.budget_s)
        return settled if settled is not None else self._conclude(author, mb, SKIPPED, None, [])

    async def _refereed(self, author: str, mb: str, x: torch.Tensor, ids: torch.Tensor, weights: bytes,
                        deadline: float) -> str | None:
        """The referee's verdict, as a check's: AUTHOR_ODD (convicted: refused, struck to a ban), "upheld" (its output
        follows from its committed weights: credit, whatever replicas said), None (no weights in time: no verdict)."""
        if self.referee is None:
            return None
        self.counts["refereed"] += 1
        outcome = await self.referee.judge(author, x, ids, weights, deadline - time.monotonic())
        if outcome == CONVICTED:
            self.counts["convicted"] += 1
            reason = f"referee: {self.referee.last_reason} (micro-batch {mb[:40]})"
            logger.warning("refused a micro-batch of driver %s: %s", author[-8:], reason)
            self.book.credit.pop(author, None)
            self.strike(author, reason, 2 * VERDICT_STRIKES)  # a proof, not a vote: banned at once
            return AUTHOR_ODD
        if outcome == HOLDS:
            self.counts["upheld"] += 1
            self.book.add(author)
            return "upheld"
        return None

    async def _check(self, author: str, mb: str, x: torch.Tensor, ids: torch.Tensor, others: list[str],
                     weights: bytes = NO_WEIGHTS) -> str:
        self.counts["checked"] += 1
        deadline = time.monotonic() + self.budget_s
        replicas: list[torch.Tensor] = []
        asked: list[tuple[str, Any]] = []  # (peer, its receipt) of each replica in ``replicas``
        verdict, odd = SKIPPED, None
        for peer in others:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                break
            got = await self._replicate(peer, mb, ids, left_s)
            if got is None:
                continue
            replicas.append(got[0])
            asked.append((peer, got[1]))
            verdict, odd = judge_author(x, replicas)
            if verdict != DISAGREED:
                break  # agreed, or two replicas decided it
        if verdict in (DISAGREED, AUTHOR_ODD, REPLICA_ODD) or (verdict == UNDECIDED and any(far(x, r) for r in replicas)):
            # copies disagree: recomputing the author's own output from its committed weights settles it exactly (a
            # frame-up by colluding recomputers fails; a liar with one other layer0 peer online is caught)
            settled = await self._refereed(author, mb, x, ids, weights, max(deadline, time.monotonic() + REFEREE_MIN_S))
            if settled is not None:
                return settled
        if verdict == UNDECIDED and not any(far(x, r) for r in replicas):
            self.book.add(author)  # not far from either: corroborated at the verdicts' own bound (skewed copies)
        figures = ""
        if verdict in (AUTHOR_ODD, REPLICA_ODD):  # the evidence, in the log line: (cosine, norm ratio) of each pair
            outs = [x, replicas[0], replicas[1]]
            figures = " [" + ", ".join(_pair_figures(outs[i], outs[j], name) for i, j, name in (
                (0, 1, "author-1st"), (0, 2, "author-2nd"), (1, 2, "1st-2nd"))) + "]"
        return self._conclude(author, mb, verdict, odd, asked, figures)

    def _conclude(self, author: str, mb: str, verdict: str, odd: int | None, asked: list[tuple[str, Any]],
                  figures: str = "") -> str:
        if verdict == AUTHOR_ODD:
            (a, ra), (b, rb) = asked[0], asked[1]
            reason = (f"spot check: its stage-0 output for {mb[:40]} is far from the recomputations of layer0 peers "
                      f"{a[-8:]} and {b[-8:]}, which are close to each other{figures}")
            if self._outvoted(author, a, b):
                self.counts["caught"] += 1
                self.evidence.append((author, mb, [ra.to_wire(), rb.to_wire()]))
                logger.warning("refused a micro-batch of driver %s: %s", author[-8:], reason)
                self.strike(author, reason, VERDICT_STRIKES)
            else:
                logger.info("refused a micro-batch of driver %s without a strike (%s; they have less validated work "
                            "here than it has)", author[-8:], reason)
        elif verdict == REPLICA_ODD:
            peer, other = asked[odd][0], asked[1 - odd][0]
            reason = (f"spot check: its recomputation of stage 0 for {mb[:40]} is far from two others, which are close "
                      f"to each other{figures}")
            if self._outvoted(peer, author, other):
                self.counts["replica_caught"] += 1
                self._held[peer] = time.monotonic() + BAD_REPLY_BAN_S
                logger.warning("layer0 peer %s: %s", peer[-8:], reason)
                self.strike(peer, reason, VERDICT_STRIKES)
            else:
                logger.info("layer0 peer %s, not struck: %s, with less validated work here than it has", peer[-8:],
                            reason)
        elif verdict == DISAGREED:  # only one replica came back
            self.counts["said"] += 1
            self._say_once(author, asked[0][0])
        elif verdict in (AGREED, SKIPPED):
            self.counts[verdict] += 1
            if verdict == AGREED:
                self.book.add(author)
        else:
            self.counts["undecided"] += 1
        return verdict

    def _outvoted(self, odd: str, a: str, b: str) -> bool:
        """``CreditBook.outvoted``, counting the verdicts that only refuse (``outweighed``)."""
        if self.book.outvoted(odd, a, b):
            return True
        self.counts["outweighed"] += 1
        return False

    async def _replicate(self, peer: str, mb: str, ids: torch.Tensor,
                         timeout_s: float) -> tuple[torch.Tensor, Any] | None:
        """Stage 0's output for ``ids`` from ``peer``, with its checked receipt; None (and the peer held off a
        while) when it does not answer in time or answers anything else: no evidence either way."""
        training = self.run.training
        ids_d = ids_digest(ids)
        batch = int(ids.shape[0])
        shape = tuple(d if d is not None else batch for d in stage_output_spec(self.run.model, 0, batch).shape)
        try:
            out, reply, _ = await self.call(self.p2p, peer, self.namespace, "infer", [ids], {"mb": mb},
                                            timeout_s=timeout_s, codec=training.codec, rank=training.wire_rank,
                                            max_bytes=int(training.max_payload_mb * 2**20),
                                            expect_bytes=coded_bytes(shape, training.codec, training.wire_rank))
            out, reply = check_reply(self.run.model, 0, "infer", batch, out, reply,
                                     self.run.timeouts.reply_max_abs)
            receipt = check_receipt(0, "infer", Vouch(self.run_id, mb, ids_d, ids_d), peer, out, reply, self.keys)
            return out[0], receipt
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # timeouts, refusals (busy, unknown_peer), bad replies: a skip, nobody blamed
            self._held[peer] = time.monotonic() + REPLICA_HOLD_S
            logger.debug("stage-0 replica from %s: %s: %s", peer[-8:], exc.__class__.__name__, exc)
            return None

    def _say_once(self, author: str, other: str) -> None:
        pair = (author, other)
        if pair not in self._said and len(self._said) < 1024:
            self._said.add(pair)
            logger.warning("spot check of stage 0: driver %s and layer0 peer %s computed different outputs for the "
                           "same ids; no third layer0 peer answered to tell which is wrong", author[-8:], other[-8:])

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def stats(self) -> dict[str, int]:
        return dict(self.counts)


def _pair_figures(a: torch.Tensor, b: torch.Tensor, name: str) -> str:
    s = similarity(a, b)
    return f"{name} none" if s is None else f"{name} cos {s[0]:.2f} ratio {s[1]:.2f}"
