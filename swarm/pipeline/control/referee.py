"""The driver's referee: a disputed (or sampled) hop is settled by recomputing it from the weights its signer committed
to in the receipt, not by counting copies (Verde's refereed delegation; docs/ARCHITECTURE.md "Referees").

``Referee.judge`` fetches the weights of the digest the receipt signed from the signer itself (``weights`` op,
swarm/pipeline/stage/weights_rpc.py), hashes them, and recomputes the hop on the driver's own device (its GPU where it has one:
a GPU-sized stage recomputed on a CPU took seconds a hop and stalled a CUDA run 40-fold) in a thread of its own, off the
thread that computes the driver's stage 0 (swarm/integrity/recompute.py). Three outcomes:

- HOLDS: the claim follows from the committed weights. (It says nothing of whether those weights are honest: a copy
  trained to harm computes honestly from itself. That is judged elsewhere: see the threat model.)
- CONVICTED: the weights shown are not the ones signed, are not a copy of this stage, or the claim does not follow
  from them. Self-contained evidence (the receipt, the inputs, the claim, the weights) any peer can re-check; the
  driver routes around the signer for ``CONVICTED_BAN_S``.
- UNSHOWN: no weights came (the version was dropped, the signer is busy, slow or gone, or it commits to nothing). No
  conviction: an honest peer on a slow link must not be punished. What depends on the claim is not used.
- NOT_REPRODUCIBLE: a training op of a run with dropout (its random mask cannot be replayed): no check at all.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from swarm.integrity.audit import Climbing, UpdateAudits, VersionBook
from swarm.integrity.receipts import NO_WEIGHTS, Receipt, loss_digest
from swarm.integrity.recompute import (
    LAST_GRADIENT_OPS,
    REFEREED_OPS,
    Finding,
    compare,
    loss_agrees,
    recompute,
    recompute_loss,
    tolerance_for,
)
from swarm.integrity.weights import PIN_PER_PINNER, PIN_S, tensors_bytes, weights_digest
from swarm.pipeline.control.referee_audits import UpdateAuditor
from swarm.integrity.prediction import Derivation, Derivations, PredictionLie, rebuild
from swarm.pipeline.stage.weights_rpc import fetch_weights
from swarm.run.models import build_stage
from swarm.run.runconfig import EDGE_MODES

logger = logging.getLogger(__name__)

HOLDS, CONVICTED, UNSHOWN = "holds", "convicted", "unshown"
UPDATE_OPS = frozenset({"backward", "forward_backward"})  # a claim of these also applied an update (audited)
# a run with dropout draws a random mask in every training op: only eval-mode ops (infer) can be recomputed exactly
NOT_REPRODUCIBLE = "not_reproducible"
PIN_MARGIN_S = 5.0  # a pin we asked for is counted this much longer than the peer keeps it (its clock starts later)
MAX_PINNED_PEERS = 1024
CONVICTED_BAN_S = 3600.0  # a signer whose claim does not follow from its own weights: proven, not suspected
FETCH_BASE_S = 3.0
FETCH_BYTES_PER_S = 5e6  # a home uplink's worth: the fetch timeout grows with the stage's size
WEIGHTS_KEPT = 8  # versions fetched, by digest (a dispute's two parties, a backward's two versions)
WEIGHTS_KEPT_COPIES = 4  # ... and at most this many copies of the stage's bytes (a 100 MB stage: 400 MB, not 800)
# Sampled recomputations of peers already upheld once (not disputes, not a newcomer's first) stop while the referee
# has been busy (fetching or recomputing) more than this share of the last BUSY_WINDOW_S: fetching a 100 MB stage's
# weights for every sampled hop would take a home link's whole uplink (weights change every step, so a fetch is
# rarely shared). A slow link thus checks a large stage less often, never stalls for it.
SAMPLED_BUSY_SHARE = 0.1
# A swarm's only copy has no second copy to be compared with: its sampled hops (and the audits of its updates, which
# need 16-32 of them to judge it: swarm/integrity/audit.py) may use more of the referee's time. At 0.1 the newcomers'
# checks at a run's start used the budget up, and a lone copy trained to harm got one audit in the 20 s it took the
# run to chance (benchmarks.adversary lone_last_harm, session 16).
LONE_BUSY_SHARE = 0.3
MAX_BUSY_PEERS = 256
RECOMPUTE_ALLOWANCE_S = 2.0
BUSY_WINDOW_S = 60.0
CONVICTIONS_KEPT = 256


@dataclass(slots=True, frozen=True)
class Verdict:
    outcome: str  # HOLDS, CONVICTED, UNSHOWN
    peer: str
    finding: Finding | None = None
    why: str = ""
    # an update's HOLDS: whether the peer keeps the version the update made for its audit (None: not asked)
    pinned: bool | None = None
    absent: bool = False  # UNSHOWN on the peer's own word: it said the weights are gone, or committed to none

    def describe(self) -> str:
        return self.why or (self.finding.describe() if self.finding is not None else self.outcome)


@dataclass(slots=True)
class Conviction:
    """The evidence: what the signer signed, what it was given, what it claimed, the weights it showed."""

    peer: str
    stage: int
    receipt: list[Any]
    inputs: list[torch.Tensor]
    claim: torch.Tensor
    why: str
    weights: dict[str, torch.Tensor] | None = None  # as shown, when the claim was recomputed from them
    loss: float | None = None  # a last stage's signed loss that does not follow from those weights (its receipt binds it)
    at: float = field(default_factory=time.time)


class Referee(UpdateAuditor):
    def __init__(self, run: Any, p2p: Any, namespaces: dict[str, str], executor: Any, dataset: Any, call: Any = None,
                 device: str | torch.device = "cpu", versions: VersionBook | None = None):
        """``executor``: where recomputations run (None: a thread of the referee's own, ``close`` ends it);
        ``device``: where (the driver's device); ``versions``: the weights digests the driver's verified receipts
        named per peer and version (swarm/integrity/audit.py), for the audit of an upheld update."""
        self.versions = versions if versions is not None else VersionBook()
        self.traffic: Any = None  # the driver's Traffic: a fetch's bytes are counted on the signer's link
        self.audits = UpdateAudits()
        self.audited = 0  # upheld updates whose step was also audited (the weights they produced were named)
        self.run = run
        self.p2p = p2p
        self.namespaces = namespaces
        self._own_executor = executor is None
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="referee") if executor is None else executor
        self.device = torch.device(device)
        self._busy: deque[tuple[float, float]] = deque(maxlen=256)  # (monotonic end, seconds) of each judgement
        self._peer_busy: OrderedDict[str, deque[tuple[float, float]]] = OrderedDict()  # the same, per peer judged
        self.dataset = dataset
        self.call = call
        self._modules: dict[int, torch.nn.Module] = {}
        self._weights: OrderedDict[bytes, dict[str, torch.Tensor]] = OrderedDict()
        self._stage_bytes: dict[int, int] = {}
        self._fetching: dict[bytes, asyncio.Future] = {}
        self._derived = Derivations()  # predicted weights shown: what they were made from (integrity/prediction.py)
        self.convictions: OrderedDict[str, Conviction] = OrderedDict()
        self.refereed = 0
        self.held = 0
        self.false_losses = 0  # last stages whose signed loss did not follow from their committed weights
        self.climbing = 0  # peers convicted by their audited updates (swarm/integrity/audit.py)
        self.withheld = 0  # ... or by a version they had pinned for an audit and then called gone
        self.pins_refused = 0  # judged updates whose signer would not keep the version they made (weights.py pins)
        self.unaudited = 0  # upheld updates not audited: the weights they produced were not named to us (in time)
        self._auditing: set[asyncio.Task] = set()
        self._pins: dict[str, list[float]] = {}  # peer -> until when each pin we asked of it may still be held there
        # a copy convicted by its audits (k, verdict): the spot checker routes around it (set by it)
        self.on_climbing: Any = None
        self.alone: Any = lambda: True  # no other driver seen lately (the driver sets it: referee_audits.py)
        self.climbing_not_alone = 0  # audit verdicts not acted on: another driver trains that copy too
        self.unshown = 0
        self.recompute_s = 0.0  # compute-thread seconds spent recomputing
        self.fetch_s = 0.0
        self.fetches = 0

    def close(self) -> None:
        if self._own_executor:
            self.executor.shutdown(wait=False, cancel_futures=True)

    def busy_share(self, now: float | None = None) -> float:
        """The share of the last BUSY_WINDOW_S this referee spent fetching weights and recomputing."""
        return self._share(self._busy, time.monotonic() if now is None else now)

    @staticmethod
    def _share(busy: Any, now: float) -> float:
        return sum(min(seconds, BUSY_WINDOW_S - (now - end)) for end, seconds in busy
                   if now - end < BUSY_WINDOW_S) / BUSY_WINDOW_S

    def _spent(self, peer: str, seconds: float) -> None:
        """A judgement's (or an audit's) cost, in all and for its peer (the fair parts of ``has_time``)."""
        now = time.monotonic()
        self._busy.append((now, seconds))
        mine = self._peer_busy.get(peer)
        if mine is None:
            mine = self._peer_busy[peer] = deque(maxlen=256)
            while len(self._peer_busy) > MAX_BUSY_PEERS:
                self._peer_busy.popitem(last=False)
        self._peer_busy.move_to_end(peer)
        mine.append((now, seconds))

    def has_time(self, lone: bool = False, peer: str = "") -> bool:
        """Whether a sampled (undisputed) recomputation fits its budget now (SAMPLED_BUSY_SHARE; LONE_BUSY_SHARE for a
        hop of a swarm's only copy, where nothing else checks it). A ``peer`` that has used less than its fair part
        (the share over the stages we referee) goes first, up to twice the share in all: at 0.3 in all, a run's honest
        lone copies used the minute's budget in their first seconds and a lone copy trained to harm that came 20 s
        later got one recomputation before it took the run to chance (benchmarks.adversary lone_last_harm)."""
        now = time.monotonic()
        share = LONE_BUSY_SHARE if lone else SAMPLED_BUSY_SHARE
        total = self.busy_share(now)
        if total < share:
            return True
        fair = share / max(1, self.run.model.stages - 1)
        return bool(peer) and total < 2 * share and self._share(self._peer_busy.get(peer, ()), now) < fair

    def stats(self) -> dict[str, Any]:
        return {"refereed": self.refereed, "held": self.held, "convicted": len(self.convictions),
                "unshown": self.unshown, "recompute_s": round(self.recompute_s, 3), "fetches": self.fetches,
                "fetch_s": round(self.fetch_s, 3), "false_losses": self.false_losses, "audited": self.audited,
                "climbing": self.climbing, "withheld": self.withheld, "pins_refused": self.pins_refused,
                "unaudited": self.unaudited,
                "climbing_not_alone": self.climbing_not_alone}

    def can_judge(self, op: str) -> bool:
        """Whether a claim of ``op`` can be recomputed at all (not a training op of a run with dropout)."""
        return op in REFEREED_OPS and (op == "infer" or _dropout(self.run.model) == 0)

    async def judge(self, k: int, op: str, tensors: list[torch.Tensor], claim: torch.Tensor, receipt: Receipt | None,
                    peer: str, loss: float | None = None) -> Verdict:
        """Does ``claim`` (what ``peer`` returned for ``op`` at stage ``k`` on ``tensors``, the same tensors a spot
        check sends: [x], [g, x] or [x, ids]) follow from the weights its ``receipt`` committed to? With ``loss`` (a
        last stage's, which its receipt signs: format 3), does that loss follow too?"""
        if _dropout(self.run.model) > 0 and op != "infer":
            return Verdict(NOT_REPRODUCIBLE, peer, why="dropout: a training op's random mask cannot be replayed")
        self.refereed += 1
        began = time.monotonic()
        verdict = await self._judge(k, op, tensors, claim, receipt, peer, loss)
        if verdict.outcome != UNSHOWN:
            # what a judgement costs us, at most what its size would take on a home link: a peer that shows its
            # weights slowly, or not at all, must not spend the budget that keeps other peers' hops checked
            self._spent(peer, min(time.monotonic() - began, self._cost_cap_s(k)))
        return verdict

    async def _judge(self, k: int, op: str, tensors: list[torch.Tensor], claim: torch.Tensor, receipt: Receipt | None,
                     peer: str, loss: float | None = None) -> Verdict:
        if receipt is None or op not in REFEREED_OPS or receipt.weights == NO_WEIGHTS or receipt.signer != peer:
            return self._unshown(peer, "its receipt commits to no weights", absent=True)
        pinned: list | None = None
        try:
            forward_weights = None
            if op in ("backward", "forward") and receipt.forward_weights not in (receipt.weights, NO_WEIGHTS):
                # A backward's forward version is older and may be gone: then no verdict, never one from the weights
                # of now (an honest layer1 peer hundreds of updates stale was convicted so); fetched first, as the
                # stage drops it first. A forward's other weights are predicted from its version (prediction.py)
                which = "its forward's weights"
                forward_weights = await self._fetch(k, peer, receipt.forward_weights)
                made = self._derived.get(receipt.forward_weights)
                if op == "forward" and (made is None or made.base != receipt.weights):
                    raise _Lied("its forward computed with weights it did not predict from the version it signed")
            which = "its weights"
            # an update's version is shown with the version after it kept for its audit (weights.py PIN_S)
            audited = op in UPDATE_OPS and self.run.averaging.mode not in EDGE_MODES
            pinned = [] if audited and self._may_pin(peer) else None
            pinned_at = time.monotonic()
            weights = await self._fetch(k, peer, receipt.weights, pinned)
        except (_Lied, PredictionLie) as exc:
            return self._convict(k, peer, receipt, tensors, claim, str(exc))
        except Exception as exc:  # gone, busy, slow, a broken stream: no evidence either way
            if pinned == [] and getattr(exc, "code", ""):  # it answered without showing: it pinned nothing either
                self._unpin(peer)
            # "gone" is the peer's own word; busy, slow or cut is not (a stranger can keep a door busy)
            return self._unshown(peer, f"no weights ({which}, of its {op} at version {receipt.version}): "
                                       f"{str(exc)[:160]}", absent=getattr(exc, "code", "") == "weights_gone")
        targets = self.dataset.y_train[tensors[1].long()] if op in LAST_GRADIENT_OPS else None
        started = time.perf_counter()
        try:
            recomputed = await asyncio.get_running_loop().run_in_executor(
                self.executor, recompute, self.run.model, self._module(k), op,
                forward_weights if op == "forward" and forward_weights is not None else weights,
                tensors[:1] if op in LAST_GRADIENT_OPS else tensors, targets,
                forward_weights if op == "backward" else None, self.run.training.weight_stashing)
        except ValueError as exc:  # weights that hash right but are no copy of this stage
            return self._convict(k, peer, receipt, tensors, claim, f"showed weights that are not this stage's: {exc}")
        finally:
            self.recompute_s += time.perf_counter() - started
        finding = compare(claim, recomputed, tolerance_for(op, self.run.training.codec, _dropout(self.run.model)))
        if not finding.holds:
            return self._convict(k, peer, receipt, tensors, claim,
                                 f"its {op} does not follow from the weights it committed to ({finding.describe()})",
                                 finding, weights)
        if loss is not None and op in LAST_GRADIENT_OPS and receipt.figures == loss_digest(loss):
            recomputed_loss = await asyncio.get_running_loop().run_in_executor(
                self.executor, recompute_loss, self.run.model, self._module(k), weights, tensors[0], targets)
            if not loss_agrees(loss, recomputed_loss):
                # the receipt signs the loss: the evidence (with the loss) is re-checked by the peers it is sent to
                self.false_losses += 1
                return self._convict(k, peer, receipt, tensors, claim, f"reported loss {loss:.4g} where its committed "
                                     f"weights give {recomputed_loss:.4g}", finding, weights, loss=loss)
        if pinned == [False]:
            self._unpin(peer)
            self.pins_refused += 1
        if audited:  # an update (not of an edge mode, whose step includes its pull)
            self._start_audit(k, op, peer, receipt, weights, forward_weights, tensors, targets,
                              pinned_at=pinned_at if pinned and pinned[0] else None)
        self.held += 1
        logger.debug("referee at layer%d: %s of %s holds (%s)", k, op, peer[-8:], finding.describe())
        return Verdict(HOLDS, peer, finding, pinned=pinned[0] if pinned else None)

    def _climbing(self, k: int, peer: str, receipt: Receipt, climbing: Climbing) -> Verdict:
        """A copy whose audited updates climb the loss: convicted by our own recomputations (routed around even as its
        swarm's last peer), not announced (the evidence is many audits, not one re-checkable hop: not done yet)."""
        self.climbing += 1
        logger.warning("referee: layer%d peer %s convicted: %s (the last: micro-batch %s at version %d)", k, peer[-8:],
                       climbing.describe(), receipt.mb, receipt.version)
        return Verdict(CONVICTED, peer, None, climbing.describe())

    def _withheld(self, k: int, peer: str, withheld: Any) -> Verdict:
        """A signer that hid a version it had pinned for our audit (referee_audits.Withheld): convicted as a climbing
        copy is, by us alone."""
        self.withheld += 1
        logger.warning("referee: layer%d peer %s convicted: %s", k, peer[-8:], withheld.describe())
        return Verdict(CONVICTED, peer, None, withheld.describe())

    def _may_pin(self, peer: str) -> bool:
        """Ask ``peer`` for a pin: it keeps PIN_PER_PINNER of ours at once (weights.py), each until we fetch its version
        or for PIN_S (counted here from the ask, with a margin), so an honest peer never refuses one for our own."""
        now = time.monotonic()
        held = [until for until in self._pins.get(peer, ()) if until > now]
        if len(held) >= PIN_PER_PINNER:
            return False
        if len(self._pins) >= MAX_PINNED_PEERS:
            self._pins.clear()
        self._pins[peer] = [*held, now + PIN_S + PIN_MARGIN_S]
        return True

    def _unpin(self, peer: str) -> None:
        """A pin we asked of ``peer`` ended: not granted, or its version fetched (the peer lets it go then)."""
        held = self._pins.get(peer)
        if held:
            held.pop(0)

    def _cost_cap_s(self, k: int) -> float:
        """What a judgement (or an audit) of stage ``k`` costs the budget at most: what it would take on a home link."""
        return FETCH_BASE_S + self._bytes(k) / FETCH_BYTES_PER_S + RECOMPUTE_ALLOWANCE_S

    # ----- parts
    async def _fetch(self, k: int, peer: str, digest: bytes, pinned: list | None = None,
                     release: bool = False) -> dict[str, torch.Tensor]:
        """The weights of ``digest`` from ``peer``, hashed and checked; lanes that want the same version at once share
        one fetch (a digest names its tensors whoever shows them). ``pinned``: asked of the peer itself whatever we
        hold, with the version after it kept for an audit (whether it was: appended); ``release``: of the peer too,
        the audit's fetch of a version it pinned for us."""
        if pinned is not None or release:
            return await self._fetch_once(k, peer, digest, pinned, release)
        kept = self._weights.get(digest)
        if kept is not None:
            self._weights.move_to_end(digest)
            return kept
        pending = self._fetching.get(digest)
        if pending is None:
            pending = asyncio.ensure_future(self._fetch_once(k, peer, digest))
            self._fetching[digest] = pending
            pending.add_done_callback(lambda _: self._fetching.pop(digest, None))
        return await asyncio.shield(pending)

    async def _fetch_once(self, k: int, peer: str, digest: bytes, pinned: list | None = None,
                          release: bool = False) -> dict[str, torch.Tensor]:
        size = self._bytes(k)
        timeout_s = FETCH_BASE_S + size / FETCH_BYTES_PER_S
        started = time.perf_counter()
        try:
            weights = await fetch_weights(self.p2p, peer, self.namespaces[f"layer{k}"], digest, expect_bytes=size,
                                          timeout_s=timeout_s, call=self.call, traffic=self.traffic, pinned=pinned,
                                          release=release)
        finally:
            self.fetches += 1
            self.fetch_s += time.perf_counter() - started
        if isinstance(weights, Derivation):  # predicted weights: rebuilt from the two versions they name
            self._derived.note(digest, weights)  # PredictionLie where they cannot be made so
            weights = await rebuild(lambda d: self._fetch(k, peer, d), weights, self.run.integrity.max_step_ratio,
                                    [name for name, _ in self._module(k).named_parameters()])
        if weights_digest(weights) != digest:
            raise _Lied("showed weights whose digest is not the one it signed")
        if tensors_bytes(weights) > 2 * size + 2**20:
            raise _Lied("showed weights far larger than this stage's")
        self._weights[digest] = weights
        while len(self._weights) > 1 and (len(self._weights) > WEIGHTS_KEPT or sum(
                tensors_bytes(w) for w in self._weights.values()) > WEIGHTS_KEPT_COPIES * size):
            self._weights.popitem(last=False)
        return weights

    def _module(self, k: int) -> torch.nn.Module:
        if k not in self._modules:
            self._modules[k] = build_stage(self.run.model, k).to(self.device)
        return self._modules[k]

    def _bytes(self, k: int) -> int:
        if k not in self._stage_bytes:
            self._stage_bytes[k] = tensors_bytes(self._module(k).state_dict())  # float32 wherever it lives
        return self._stage_bytes[k]

    def _unshown(self, peer: str, why: str, absent: bool = False) -> Verdict:
        self.unshown += 1
        logger.info("referee: peer %s: %s (no verdict)", peer[-8:], why)
        return Verdict(UNSHOWN, peer, why=why, absent=absent)

    def _convict(self, k: int, peer: str, receipt: Receipt, tensors: list[torch.Tensor], claim: torch.Tensor,
                 why: str, finding: Finding | None = None, weights: dict[str, torch.Tensor] | None = None,
                 loss: float | None = None) -> Verdict:
        # the tensors as they travelled (their payloads are what the receipt's digests name: convictions.py)
        self.convictions[peer] = Conviction(peer, k, receipt.to_wire(), list(tensors), claim, why, weights, loss)
        while len(self.convictions) > CONVICTIONS_KEPT:
            self.convictions.popitem(last=False)
        logger.warning("referee: layer%d peer %s convicted: %s (micro-batch %s, its version %d)", k, peer[-8:], why,
                       receipt.mb, receipt.version)
        return Verdict(CONVICTED, peer, finding, why)


class _Lied(Exception):
    """The signer showed something that contradicts what it signed."""


def _dropout(model: Any) -> float:
    return float(getattr(model, "dropout", 0.0) or 0.0)
