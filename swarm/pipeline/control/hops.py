"""One hop of the driver: a call to some peer of a swarm, checked, timed out, hedged and retried.

``HopCaller.hop`` returns a checked reply or raises one of three things the driver acts on:
``Refused`` (the micro-batch is dropped before anything was applied: a ``rejected`` or
``wrong_shard`` reply), ``NeedInputReply`` (backward needs the input resent) or ``HopGivenUp``
(no peer of the swarm served it after many tries). Everything else a peer can do is that peer's
problem: a timeout, a transport error, a malformed reply (swarm/pipeline/transport/replies.py), ``paused`` or
``healing`` ban it for a while and the hop goes to another peer; ``busy``, ``banned`` and
``unknown_driver`` hold it off for its ``retry_after_s``; ``key_pending`` (the stage is still getting
the receipt key of a peer whose tensor we relay) makes this micro-batch wait and ask again, up to
``KEY_WAIT_MAX_S``. Ops that apply no update (forward, infer, evaluate) are hedged: after
``SwarmRouter.hedge_after_s`` the same request goes to a second peer and the first answer wins. Ops
that apply an update are never sent twice at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from swarm.integrity.audit import VersionBook
from swarm.pipeline.transport.replies import HEDGED_OPS, BadReply, Vouch, check_receipt, check_reply
from swarm.pipeline.stage.applied import DUPLICATE_CODE
from swarm.pipeline.control.routing import BAD_REPLY_BAN_S, SwarmRouter, retry_delay_s
from swarm.run.runconfig import RunConfig
from swarm.pipeline.stage.stage_rpc import StageError, Traffic, call_stage, stage_namespace
from swarm.pipeline.transport.wire import WireError, coded_bytes

logger = logging.getLogger(__name__)

MAX_HOP_ATTEMPTS = 200  # with capped backoff: minutes of trying before a micro-batch is given up
EMPTY_SWARM_NOTICE_S = 10.0
BLOCKED_NOTICE_S = 10.0  # the same kind of blockage is said at most this often
BLOCKED_NOTICE_AFTER_S = 2.0  # ... and only once it has lasted this long (a hold of a second is not news)
HOLD_DEFAULT_S, HOLD_MIN_S = 1.0, 0.05  # a hold code without a usable retry_after_s; the least a patient hop waits
HOLD_CODES = frozenset({"busy", "banned", "unknown_driver"})
# bad_receipt: the stage says a receipt we relayed does not hold; bad_author: a tensor we relayed was computed by a
# peer that stage has banned (its reply names it: we stop using that peer too); unknown_signer: the stage cannot get
# the key of the peer that computed a tensor we relayed (it is gone, not merely slow: key_pending): that micro-batch
# cannot pass, nobody's fault; spot_check: stage 1 found our stage-0 output far from two other layer0 peers' replicas
REFUSED_CODES = frozenset({"rejected", "wrong_shard", "bad_receipt", "bad_author", "unknown_signer", "spot_check"})
HOLD_POLL_MAX_S = 1.0
ONLY_BUSY_MAX_S = 10.0  # what a hop only one peer can serve waits for it to be less busy (its activations keep 120 s)
KEY_WAIT_NOTICE_S = 2.0
KEY_WAIT_MAX_S = 30.0  # a stage that still has no key after this long: the micro-batch is given up (unknown_signer)
# ... and a peer that has answered nothing but key_pending for this long is treated as failing (routed around): an
# honest stage gives a signer up after 20 s (keybook.KEY_PATIENCE_S), a hostile one could say it forever and hold
# every lane that reaches it 30 s per micro-batch at no cost to itself
MAX_KEY_PENDING_PEERS = 1024

CallStage = Callable[..., Awaitable[tuple[list[torch.Tensor], dict, float]]]


class DriverStopped(Exception):
    pass


class HopGivenUp(Exception):
    pass


class AlreadyApplied(HopGivenUp):
    """The peer has applied this micro-batch's update already (a resend met its claim: swarm/pipeline/stage/applied.py):
    its gradient is lost, and no other copy may apply it again (never resent elsewhere)."""


class NeedInputReply(Exception):
    """The peer has no saved activations for this backward: resend with the input."""


class Refused(Exception):
    """The next stage refused the micro-batch itself (``code``: one of REFUSED_CODES); nothing was applied.
    ``author``: with bad_author, the peer whose tensor it refused."""

    def __init__(self, code: str, reason: str, author: str = ""):
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.author = author


class _TryElsewhere(Exception):
    def __init__(self, *args: object, busy_s: float | None = None):
        super().__init__(*args)
        self.busy_s = busy_s  # the peer said busy: it may serve after this long


class _KeyPending(_TryElsewhere):
    def __init__(self, wait_s: float, reason: str):
        super().__init__(reason, busy_s=wait_s)  # at the one peer that can serve it, waited out as busy (_patient)
        self.wait_s = wait_s


@dataclass(slots=True)
class DriverStats:
    sent: int = 0  # samples whose micro-batch was started
    trained: int = 0  # samples whose micro-batch completed forward and backward everywhere
    lost: int = 0  # micro-batches given up after part of them was applied, or after every retry
    refused: int = 0  # micro-batches a stage refused before anything was applied (rejected, wrong_shard)
    microbatches: int = 0
    retries: int = 0
    timeouts: int = 0  # hops that got no answer in time
    bad_replies: int = 0  # replies that failed the checks of swarm/pipeline/transport/replies.py
    hedges: int = 0  # update-free requests also sent to a second peer
    hops_ok: int = 0  # hops a peer answered and whose reply passed the checks
    last_loss: float | None = None
    waiting_for: str = ""  # the empty swarm we are waiting on, "" when none
    blocked_reason: str = ""  # why no micro-batch flows right now, "" when they do
    eval_accuracy: float | None = None
    eval_loss: float | None = None
    eval_at_samples: int = 0
    eval_replicas: int = 0  # last-stage peers the latest evaluation went through (swarm/integrity/evaluations.py)
    eval_validated: bool = False  # two of them agreed on it
    hop_ms: dict[str, float] = field(default_factory=dict)
    depth: int = 0  # in_flight auto: the lanes allowed to work now (0: a fixed in_flight)


class Blockage:
    """``stats.blocked_reason`` and the notices that go with it: a warning once a blockage has lasted
    ``BLOCKED_NOTICE_AFTER_S`` (then one per kind per BLOCKED_NOTICE_S), and "flow again" only after a warning.
    Without the delay, fair-share holds of a second or less among drivers starting together logged "no micro-batch
    flows" and "micro-batches flow again" ~50 times in 12 s for three drivers, while they trained."""

    def __init__(self, stats: DriverStats, notify: Callable[[str, str], None]):
        self.stats = stats
        self.notify = notify
        self._said: dict[str, float] = {}  # kind -> when it was said, since micro-batches last flowed after a warning
        self._since: float | None = None  # when the current blockage began

    def set(self, reason: str) -> None:
        self.stats.blocked_reason = reason
        kind = reason.split(":", 1)[0]
        now = time.monotonic()
        if self._since is None:
            self._since = now
        if now - self._since >= BLOCKED_NOTICE_AFTER_S and \
                now - self._said.get(kind, -BLOCKED_NOTICE_S) >= BLOCKED_NOTICE_S:
            self._said[kind] = now
            self.notify("warning", f"no micro-batch flows: {reason}")

    def clear(self) -> None:
        self._since = None
        if self.stats.blocked_reason:
            self.stats.blocked_reason = ""
            if self._said:  # a warning was said: flowing again is news
                self._said.clear()
                self.notify("info", "micro-batches flow again")


class HopCaller:
    def __init__(self, run: RunConfig, p2p: Any, routers: dict[str, SwarmRouter], stats: DriverStats,
                 blockage: Blockage, *, traffic: Traffic, is_stopping: Callable[[], bool],
                 call: CallStage = call_stage, keys: Any = None):
        self.run = run
        # run.run_id hashes the whole config on every read (0.14 ms, 11 reads per digits micro-batch): once here
        self.namespaces = {name: stage_namespace(run.run_id, name) for name in run.swarm_names}
        self.keys = keys  # the receipt keys of the peers we call (swarm/pipeline/transport/keybook.py), learnt from their replies
        self.p2p = p2p
        self.routers = routers
        self.stats = stats
        self.blockage = blockage
        self.traffic = traffic
        self.is_stopping = is_stopping
        self.call = call
        # the weights digest each peer's verified receipts named per version: an audited update at v is paired with
        # the weights it produced, v+1 (swarm/integrity/audit.py)
        self.versions = VersionBook()
        self._empty_since: dict[str, float] = {}
        self._held_why: dict[str, str] = {}  # swarm -> what its last peer that asked us to wait said (the user is told)
        self._logged: set[tuple[str, str]] = set()
        self._key_pending_since: dict[str, float] = {}  # peer -> its first key_pending since it last served us

    async def hop(self, k: int, op: str, tensors: list[torch.Tensor], meta: dict, *, only: str | None = None,
                  vouch: Vouch | None = None) -> tuple[list[torch.Tensor], dict, str]:
        """Call stage ``k`` until a peer serves it; ``only``: one try at that peer (no hedge). With ``vouch`` the
        reply's receipt must hold (swarm/pipeline/transport/replies.py ``check_receipt``): it is in the reply as ``receipt``."""
        swarm = f"layer{k}"
        router = self.routers[swarm]
        tried: list[str] = []
        key_waited = 0.0
        for attempt in range(1 if only else MAX_HOP_ATTEMPTS):
            if self.is_stopping():
                raise DriverStopped()
            peer = only or router.choose(time.monotonic(), exclude=tried[-1:], hop=True)
            if peer is None:
                await self._wait_for_swarm(swarm, router, attempt)
                continue
            self._swarm_has_peers(swarm)
            try:
                if op in HEDGED_OPS and not only:
                    return await self._hedged(k, op, tensors, meta, peer, vouch)
                out, reply = await (self._patient if only else self._attempt)(k, op, tensors, meta, peer, vouch)
                return out, reply, peer
            except _KeyPending as exc:
                if only or key_waited + exc.wait_s > KEY_WAIT_MAX_S:
                    raise Refused("unknown_signer", f"{swarm} could not get a receipt key for {key_waited:.0f} s: "
                                  f"{exc}") from None
                if key_waited >= KEY_WAIT_NOTICE_S:  # a blip is not news; a wait of seconds is said
                    self.blockage.set(f"{swarm} is getting the receipt key of a peer whose tensor we relay")
                key_waited += exc.wait_s
                await asyncio.sleep(exc.wait_s)
                continue
            except _TryElsewhere:
                pass
            tried.append(peer)
            self.stats.retries += 1
            if only:
                break
            await asyncio.sleep(retry_delay_s(min(attempt, 6)))
        raise HopGivenUp(f"{op} at {swarm} failed after {len(tried)} attempt(s)")

    async def _patient(self, k: int, op: str, tensors: list[torch.Tensor], meta: dict, peer: str,
                       vouch: Vouch | None) -> tuple[list[torch.Tensor], dict]:
        """An attempt at the one peer that can serve it (a backward whose input only it holds): ``busy`` is waited out
        there, up to ``ONLY_BUSY_MAX_S``. A stage admits a forward without its fair-share check and may refuse the
        backward of a driver new there: giving up lost a pushed micro-batch (session 17), as ``key_pending`` did."""
        deadline = time.monotonic() + ONLY_BUSY_MAX_S
        while True:
            try:
                return await self._attempt(k, op, tensors, meta, peer, vouch)
            except _TryElsewhere as exc:
                if exc.busy_s is None or self.is_stopping():
                    raise
                wait_s = max(HOLD_MIN_S, exc.busy_s)  # a retry_after_s of 0 must not make a loop of calls
                if time.monotonic() + wait_s > deadline:  # busy for good (or saying so): not routed to for a while
                    self.routers[f"layer{k}"].failure(peer, time.monotonic())
                    raise
                await asyncio.sleep(wait_s)

    # ----- one attempt, and what its failure means
    async def _attempt(self, k: int, op: str, tensors: list[torch.Tensor], meta: dict, peer: str,
                       vouch: Vouch | None = None) -> tuple[list[torch.Tensor], dict]:
        swarm = f"layer{k}"
        router = self.routers[swarm]
        batch = int(tensors[0].shape[0])
        training = self.run.training
        router.begin(peer)
        try:
            out, reply, elapsed = await self.call(
                self.p2p, peer, self.namespaces[swarm], op, tensors, meta,
                timeout_s=router.timeout_s(op, peer), codec=training.codec, rank=training.wire_rank,
                max_bytes=int(training.max_payload_mb * 2**20), traffic=self.traffic,
                expect_bytes=coded_bytes(tuple(tensors[0].shape), training.codec, training.wire_rank),
            )
            out, reply = check_reply(self.run.model, k, op, batch, out, reply, self.run.timeouts.reply_max_abs)
            if vouch is not None:
                receipt = check_receipt(k, op, vouch, peer, out, reply, self.keys)
                self.versions.note(peer, k, receipt.version, receipt.weights)
                reply = {**reply, "receipt": receipt}
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._failed(swarm, router, peer, op, exc)
        finally:
            router.end(peer)
        router.success(peer, elapsed, op)
        self._key_pending_since.pop(peer, None)
        self.stats.hops_ok += 1
        self.stats.hop_ms[swarm] = elapsed * 1000
        return out, reply

    def _failed(self, swarm: str, router: SwarmRouter, peer: str, op: str, exc: Exception) -> None:
        """Book the failure against the peer; raise what the caller does next."""
        now = time.monotonic()
        if isinstance(exc, StageError):
            code = exc.code
            if code in REFUSED_CODES:
                if code == "rejected":
                    router.failure(peer, now)  # a peer that rejects everything is also avoided
                what = "gradients" if op == "backward" else "activations"
                raise Refused(code, f"{swarm} {'rejects our ' + what if code == 'rejected' else 'says'}: {exc}",
                              getattr(exc, "author", "") or "")
            if code == "key_pending":  # nobody's fault, and this peer may hold our saved activations: wait, ask again
                if peer not in self._key_pending_since and len(self._key_pending_since) >= MAX_KEY_PENDING_PEERS:
                    self._key_pending_since.clear()  # peers long gone
                since = self._key_pending_since.setdefault(peer, now)
                if now - since <= KEY_WAIT_MAX_S:
                    retry_after_s = getattr(exc, "retry_after_s", None)
                    raise _KeyPending(min(KEY_WAIT_MAX_S, max(0.1, retry_after_s or HOLD_DEFAULT_S)), str(exc))
                del self._key_pending_since[peer]  # nothing but key_pending for too long: a failing peer (below)
            if code == "need_input":
                raise NeedInputReply(str(exc))
            if code == DUPLICATE_CODE:  # it applied this micro-batch already (we resent it): its gradient is lost
                raise AlreadyApplied(f"{op} at {swarm} peer {peer[-8:]}: {exc}")
            if code in HOLD_CODES:
                retry_after_s = getattr(exc, "retry_after_s", None)
                hold_s = retry_after_s if retry_after_s is not None else HOLD_DEFAULT_S
                router.hold(peer, now, hold_s)
                self._held_why[swarm] = f"{peer[-8:]} said {exc}"[:300]
                self._log_once(swarm, code, f"{op} at {swarm} peer {peer[-8:]}: {exc}")
                raise _TryElsewhere(busy_s=hold_s if code == "busy" else None) from None
            router.failure(peer, now)  # paused, healing, broken, or a code we do not know
            self._log_once(swarm, code, f"{op} at {swarm} peer {peer[-8:]}: {exc}")
            raise _TryElsewhere() from None
        if isinstance(exc, (BadReply, WireError)):
            self.stats.bad_replies += 1
            ban_s = router.failure(peer, now, min_ban_s=BAD_REPLY_BAN_S)
            logger.warning("bad %s reply from %s peer %s, banned for %.0f s: %s", op, swarm, peer[-8:], ban_s, exc)
            raise _TryElsewhere() from None
        if isinstance(exc, TimeoutError):
            self.stats.timeouts += 1
            ban_s = router.timed_out(peer, op, now)
            logger.info("%s at %s peer %s timed out; banned for %.0f s", op, swarm, peer[-8:], ban_s)
            raise _TryElsewhere() from None
        ban_s = router.failure(peer, now)  # dead peers, broken streams: all mean "try another peer"
        logger.info("%s %s at %s failed (%s: %s); banned for %.0f s", op, swarm, peer[-8:],
                    exc.__class__.__name__, exc, ban_s)
        raise _TryElsewhere() from None

    def _log_once(self, swarm: str, code: str, text: str) -> None:
        if (swarm, code) not in self._logged:
            self._logged.add((swarm, code))
            logger.info("%s (further '%s' replies from %s are not logged)", text, code, swarm)

    # ----- hedging
    async def _hedged(self, k: int, op: str, tensors: list[torch.Tensor], meta: dict, first: str,
                      vouch: Vouch | None = None) -> tuple[list[torch.Tensor], dict, str]:
        """Ask ``first``; if it has not answered after the hedge delay, ask a second peer too; first answer wins."""
        router = self.routers[f"layer{k}"]
        started: dict[asyncio.Task, tuple[str, float]] = {}

        def launch(peer: str) -> asyncio.Task:
            task = asyncio.create_task(self._attempt(k, op, tensors, meta, peer, vouch))
            started[task] = (peer, time.monotonic())
            return task

        first_task = launch(first)
        try:
            done, _ = await asyncio.wait({first_task}, timeout=router.hedge_after_s(op, first))
            if not done:
                second = router.hedge_to(time.monotonic(), first)
                if second is not None:
                    self.stats.hedges += 1
                    launch(second)
            return await self._first_answer(router, started)
        finally:
            pending = [task for task in started if not task.done()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for task in started:  # a loser that failed after the winner answered: its failure is not news
                if task.done() and not task.cancelled():
                    task.exception()

    @staticmethod
    async def _first_answer(router: SwarmRouter, started: dict[asyncio.Task, tuple[str, float]],
                            ) -> tuple[list[torch.Tensor], dict, str]:
        pending = set(started)
        failure: BaseException | None = None
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                exc = task.exception()
                if exc is None:
                    now = time.monotonic()
                    for other in pending:  # the loser is at least this slow: it stops looking attractive
                        peer, since = started[other]
                        router.slow(peer, now - since, now)
                    out, reply = task.result()
                    return out, reply, started[task][0]
                if not isinstance(exc, _TryElsewhere):
                    raise exc
                failure = exc
        raise failure if failure is not None else _TryElsewhere()

    # ----- empty or unwilling swarms
    async def _wait_for_swarm(self, swarm: str, router: SwarmRouter, attempt: int) -> None:
        now = time.monotonic()
        if router.proven_only(now):  # nothing it computes can be used: no update applied for nothing
            self.blockage.set(f"every {swarm} peer was convicted by recomputation (a wrong tensor, or updates that "
                              "climb the loss) or hides the weights it computes with: waiting for another peer")
            await asyncio.sleep(HOLD_POLL_MAX_S)
            return
        free_at = router.free_at()
        if free_at is not None:  # peers exist, every one asked us to come back later
            self.blockage.set(f"every {swarm} peer asks us to wait (busy, banned or does not know us yet): the last, "
                              f"{self._held_why.get(swarm, '?')}")
            await asyncio.sleep(min(HOLD_POLL_MAX_S, max(0.05, free_at - now)))
            return
        since = self._empty_since.setdefault(swarm, now)
        if self.stats.waiting_for != swarm:
            self.stats.waiting_for = swarm
            self.stats.blocked_reason = f"swarm {swarm} has no online peer"
            self.blockage.notify("warning", f"waiting: swarm {swarm} has no online peer, so no micro-batch can pass it")
        elif now - since > EMPTY_SWARM_NOTICE_S:
            self._empty_since[swarm] = now
            self.blockage.notify("warning", f"still waiting for a peer in {swarm}")
        await asyncio.sleep(retry_delay_s(min(attempt, 6)))

    def _swarm_has_peers(self, swarm: str) -> None:
        if self.stats.waiting_for == swarm:
            self.stats.waiting_for = ""
            self._empty_since.pop(swarm, None)
            self.blockage.notify("info", f"{swarm} has an online peer now; micro-batches flow again")
