"""The stage's side of receipts (swarm/integrity/receipts.py): what a request's receipts must vouch for before
anything runs, whom a wrong tensor is blamed on, and the receipt this stage signs on its reply.

What each op at stage k (k >= 1) must carry in ``rc`` (stage 0 trains for no one but its own driver; its ``infer
[ids]`` for a layer1 peer's spot check carries none: it starts the chain, swarm/pipeline/stage/stage0_replicas.py):

    forward, infer      [receipt of x]  by a peer of swarm k-1 (the requester itself when k-1 = 0)
    forward_backward    [receipt of x]  likewise, and its sample ids are the ids sent
    evaluate            [receipt of x]  likewise (an ``infer`` receipt), and its ids are the ids sent
    backward [g]        [receipt of g]  by a peer of swarm k+1, over the output this stage produced for this
                                        micro-batch (kept from our forward: ``Emitted``)
    backward [g, x]     [receipt of g, receipt of x, a stage-k peer's forward receipt from x to g's input]
                        (a retry at a peer that did not run the forward: the chain proves the input)
    forward_backward_check [x, ids], backward_check [g, x]
                        as forward_backward and backward [g, x]: a driver's spot check asks a second peer to
                        recompute a gradient another peer of this swarm returned (nothing is applied)

Blame: a receipt that is missing, malformed, or that does not match the tensor is the requester's doing (an honest
driver checks every receipt it relays: swarm/pipeline/control/hops.py); a signature that does not verify with the key its
signer gives us is nobody's strike (the signer may have shown the driver another key); a tensor whose
receipt holds but whose content is wrong (non-finite, wrong shape, clipped to nothing) is its signer's.
A signer we cannot get a key from is nobody's fault: ``key_pending`` (wait ``retry_after_s`` and ask again) while
the key may still come, ``unknown_signer`` (the micro-batch cannot pass) once its signer is taken for gone.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from swarm.integrity.receipts import (
    GRADIENT_OPS,
    NO_WEIGHTS,
    Expect,
    Receipt,
    ReceiptError,
    ReceiptKey,
    NO_FIGURES,
    figures_digest,
    ids_digest,
    loss_digest,
    mismatch,
    parse_all,
    signature_valid,
    tensor_digest,
)
from swarm.pipeline.transport.keybook import KEY_PATIENCE_S, KeyBook
from swarm.pipeline.transport.wire import payload_of

MAX_EMITTED = 4096  # forwards whose output digest we keep for the backward (more than the activation cache)
# ... of which one requester's at most: a flood of one identity's forwards evicts its own, not the other drivers'
# (whose backwards would then need the longer chain of receipts)
MAX_EMITTED_PER_REQUESTER = 512
# infer takes a forward's activations too: a driver's spot check (swarm/pipeline/control/spot_checks.py) asks a second peer
# for the output of an input another peer computed in training
INPUT_OPS = {"forward": frozenset({"forward"}), "forward_backward": frozenset({"forward"}),
             "infer": frozenset({"infer", "forward"}), "evaluate": frozenset({"infer"}),
             "forward_backward_check": frozenset({"forward"})}


class ReceiptRefusal(Exception):
    """The request's receipts do not vouch for it. ``strike``: it counts against the requester."""

    def __init__(self, code: str, text: str, *, strike: bool, retry_after_s: float | None = None):
        super().__init__(text)
        self.code = code
        self.strike = strike
        self.retry_after_s = retry_after_s


class NeedChain(Exception):
    """A backward of a micro-batch whose forward did not run here: resend with the input and its receipts."""


@dataclass(slots=True, frozen=True)
class Emitted:
    input: bytes  # digest of the activations our forward consumed
    output: bytes  # digest of the activations it returned (a gradient receipt's input must be this)
    ids: bytes


@dataclass(slots=True)
class Vouched:
    """What a request's receipts established, for the reply's receipt and for blame."""

    mb: str = ""
    input: bytes = b""  # digest of the activations this op is about (our input)
    ids: bytes = b""
    authors: dict[int, str] = field(default_factory=dict)  # tensor index -> the peer that computed it
    input_weights: bytes = b""  # the weights digest the input's receipt says it computed with (stage 1: the driver's
    # stage 0; its forward_weights, which differ from its version's only where it predicted: integrity/prediction.py)

    @property
    def applied_author(self) -> str:
        """Who computed the tensor whose update we apply: the gradient at backward, the input otherwise."""
        return self.authors.get(0, "")


class ReceiptDesk:
    def __init__(self, run_id: str, stage: int, key: ReceiptKey, keys: KeyBook):
        self.run_id = run_id
        self.stage = stage
        self.key = key
        self.keys = keys
        self.keys.learn(key.peer_id, key.public)
        self.emitted: OrderedDict[tuple[str, str], Emitted] = OrderedDict()
        self._emitted_by: dict[str, deque[str]] = {}  # requester -> its micro-batch ids in self.emitted, oldest first

    # ----- before the request runs
    async def check(self, requester: str, op: str, meta: dict, tensors: list[Any]) -> Vouched:
        """What the receipts vouch for, or ReceiptRefusal / NeedChain."""
        self.keys.learn(requester, meta.get("rk"))  # the requester's own key, over its own connection
        mb = meta.get("mb")
        if not isinstance(mb, str) or not 0 < len(mb) <= 128:
            raise ReceiptRefusal("rejected", "missing or malformed micro-batch id", strike=True)
        try:
            if op == "backward":
                return await self._check_backward(requester, mb, meta.get("rc"), tensors)
            if op == "backward_check":  # always with the input and its chain: the forward ran at another peer
                if len(tensors) != 2:
                    raise ReceiptRefusal("rejected", f"{op} takes the output gradient and the input", strike=True)
                return await self._check_backward(requester, mb, meta.get("rc"), tensors)
            return await self._check_input(requester, op, mb, meta.get("rc"), tensors)
        except ReceiptError as exc:
            raise ReceiptRefusal("bad_receipt", str(exc), strike=True) from None

    async def _check_input(self, requester: str, op: str, mb: str, raw: Any, tensors: list[Any]) -> Vouched:
        want = 2 if op in ("forward_backward", "evaluate", "forward_backward_check") else 1
        if len(tensors) != want:
            raise ReceiptRefusal("rejected", f"{op} takes {want} tensor(s), got {len(tensors)}", strike=True)
        (receipt,) = parse_all(raw, 1)
        ids = ids_digest(tensors[1]) if want == 2 else None
        await self._verify(requester, receipt, self.stage - 1, Expect(
            self.run_id, self.stage - 1, INPUT_OPS[op], _digest(tensors[0]), mb=mb, ids=ids))
        return Vouched(mb=mb, input=receipt.output, ids=receipt.ids, authors={0: receipt.signer, 1: requester},
                       input_weights=receipt.forward_weights)  # what it computed with (predicted or its version)

    async def _check_backward(self, requester: str, mb: str, raw: Any, tensors: list[Any]) -> Vouched:
        if len(tensors) not in (1, 2):
            raise ReceiptRefusal("rejected", "backward takes the output gradient and optionally the input", strike=True)
        g_digest = _digest(tensors[0])
        if len(tensors) == 1:
            emitted = self.emitted.get((requester, mb))
            if emitted is None:
                raise NeedChain(mb)
            (grad,) = parse_all(raw, 1)
            await self._verify(requester, grad, self.stage + 1, Expect(
                self.run_id, self.stage + 1, GRADIENT_OPS, g_digest, mb=mb, input=emitted.output, ids=emitted.ids))
            return Vouched(mb=mb, input=emitted.input, ids=emitted.ids, authors={0: grad.signer})
        grad, x, ours = parse_all(raw, 3)
        await self._verify(requester, x, self.stage - 1, Expect(
            self.run_id, self.stage - 1, frozenset({"forward"}), _digest(tensors[1]), mb=mb))
        try:
            await self._verify(requester, ours, self.stage, Expect(
                self.run_id, self.stage, frozenset({"forward"}), grad.input, mb=mb, input=x.output, ids=x.ids))
        except ReceiptRefusal:
            # the peer of our swarm that ran the forward is gone (that is why this backward came here) and we never
            # had its key: the link it states is checked above, its signature cannot be; x's and g's still are
            pass
        await self._verify(requester, grad, self.stage + 1, Expect(
            self.run_id, self.stage + 1, GRADIENT_OPS, g_digest, mb=mb, ids=x.ids))
        return Vouched(mb=mb, input=x.output, ids=x.ids, authors={0: grad.signer, 1: x.signer})

    async def _verify(self, requester: str, receipt: Receipt, stage: int, expect: Expect) -> None:
        if stage == 0:  # stage 0 runs only on its own driver: its receipts are the requester's own
            expect = Expect(**{**_fields(expect), "signer": requester})
        problem = mismatch(receipt, expect)
        if problem is not None:
            raise ReceiptError(problem)
        key = self.keys.known(receipt.signer) if stage == 0 else await self.keys.key(receipt.signer, f"layer{stage}")
        if key is None:
            if stage == 0:
                raise ReceiptError("no receipt key of yours: send it with your requests ('rk')")
            wait_s = self.keys.wait_s(receipt.signer)
            if wait_s is not None:  # not yet reachable (start-up, a slow dial): the requester waits, nothing is lost
                raise ReceiptRefusal("key_pending", f"getting the receipt key of layer{stage} peer "
                                     f"{receipt.signer[-8:]}: ask again in {wait_s:.1f} s", strike=False,
                                     retry_after_s=wait_s)
            raise ReceiptRefusal("unknown_signer", f"cannot get the receipt key of layer{stage} peer "
                                 f"{receipt.signer[-8:]}: it has not answered for {KEY_PATIENCE_S:.0f} s",
                                 strike=False)
        if not signature_valid(receipt, key):
            if receipt.signer == requester:
                raise ReceiptError("your receipt is not signed with the key you sent ('rk')")
            # Either the relay forged it or the signer showed the driver one key and us another: we cannot tell which,
            # and a strike on the relay would let a hostile signer get honest drivers banned. Refused, nobody struck.
            raise ReceiptRefusal("bad_receipt", f"the receipt of layer{stage} peer {receipt.signer[-8:]} does not "
                                 "verify with the key it gives us", strike=False)

    # ----- the reply
    def sign(self, requester: str, op: str, vouched: Vouched, out: list[Any], version: int,
             figures: tuple[float, int, int] | None = None, weights: bytes = NO_WEIGHTS,
             forward_weights: bytes | None = None, loss: float | None = None) -> list[Any]:
        """The receipt of our reply (wire form), committed to ``weights`` (the digest of the parameters the op ran
        with, at ``version``) and, with ``loss`` (a last stage's forward_backward), to the loss it reports; a
        forward's output digest is kept for its backward."""
        output = figures_digest(*figures) if figures is not None else tensor_digest(out[0]) if out else b"\0" * 16
        receipt = self.key.sign(self.run_id, vouched.mb, op, self.stage, version, vouched.input or b"\0" * 16,
                                output, vouched.ids or b"\0" * 16, weights, forward_weights,
                                NO_FIGURES if loss is None else loss_digest(loss))
        if op == "forward":
            self.emitted[(requester, vouched.mb)] = Emitted(vouched.input, output, vouched.ids)
            mine = self._emitted_by.setdefault(requester, deque())
            mine.append(vouched.mb)
            while len(mine) > MAX_EMITTED_PER_REQUESTER:
                self.emitted.pop((requester, mine.popleft()), None)
            while len(self.emitted) > MAX_EMITTED:
                (old_requester, old_mb), _ = self.emitted.popitem(last=False)
                theirs = self._emitted_by.get(old_requester)
                if theirs and theirs[0] == old_mb:
                    theirs.popleft()
            if len(self._emitted_by) > MAX_EMITTED:  # requesters with nothing kept any more
                self._emitted_by = {r: q for r, q in self._emitted_by.items() if q}
        return receipt.to_wire()


def _digest(tensor: Any) -> bytes:
    item = payload_of(tensor)
    if item is None:  # every decoded tensor carries its payload (swarm/pipeline/transport/wire.py)
        raise ReceiptError("a tensor without its payload")
    return tensor_digest(item)


def _fields(expect: Expect) -> dict[str, Any]:
    return {name: getattr(expect, name) for name in Expect.__slots__}
