"""Signed hop receipts: every tensor a stage applies names the peer that computed it.

A receipt says "I, ``signer``, ran ``op`` of stage ``stage`` (parameter version ``version``, whose tensors have the
digest ``weights``) for micro-batch ``mb`` of run ``run_id``, on the input whose digest is ``input``, and produced the
output whose digest is ``output``; the chain started from the sample ids whose digest is ``ids``". The weights
digest makes every hop a claim a referee can check by recomputing it (swarm/integrity/weights.py,
swarm/pipeline/control/referee.py). It is signed with the signer's
per-run Ed25519 key (``cryptography``'s, not a home-made scheme). Digests are BLAKE3 (``blake3``: 2 GB/s
on one core, so hashing what travels costs well under 1 % of a hop) over the serialized tensor as it
travels, after the codec: the driver relays those bytes unchanged, so a stage can check that what it
received is what the signer produced.

What the digests chain (docs/ARCHITECTURE.md, "Receipts"):
- stage 0's forward (the driver's own copy, which looks its inputs up by id): input = ids = the digest of
  the sample ids;
- stage k's forward: input = the output of stage k-1's receipt;
- the last stage's forward_backward: input = stage L-2's output, output = the input gradient it returns;
- stage k's backward: input = the digest of the activations the gradient is with respect to (stage k's input),
  output = the input gradient it returns. A gradient receipt of stage k+1 therefore names, in ``input``, the
  output that stage k produced.

Everything here is pure (plain data in, a verdict out) except ``ReceiptKey``, which holds a private key.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

RECEIPT_FORMAT = 3  # 2: receipts commit to the signer's weights; 3: a last stage's also to its loss (older: malformed)
DIGEST_BYTES = 16
# Digests of this many bytes or more are hashed on every core (BLAKE3's tree: the same digest). Hashing 108 MiB of
# llm-small's stage took 24.6 ms on one core, 13.4 on two, and longer than that stage's step on an H200 (session 30);
# under ~1 MiB the threads cost more than they save (64 KiB: 11 -> 30 us).
PARALLEL_HASH_BYTES = 4 * 2**20
_POOL_PID: int | None = None  # the process in which BLAKE3's thread pool (rayon's global pool) was started
SIGNATURE_BYTES = 64
PUBLIC_KEY_BYTES = 32
MAX_TEXT_CHARS = 160
# the *_check ops recompute a gradient another peer returned, for a driver's spot check, and apply nothing
CHECK_OPS = frozenset({"forward_backward_check", "backward_check"})
OPS = frozenset({"forward", "backward", "forward_backward", "infer", "evaluate"}) | CHECK_OPS
GRADIENT_OPS = frozenset({"backward", "forward_backward"})
NO_WEIGHTS = b"\0" * 16  # a receipt of no stage computation (a driver's own stage 0 before it has committed)
NO_FIGURES = b"\0" * 16  # a receipt that reports no figure beside its tensor


# signatures that verified lately (``_verified``): a stage checks the receipt of its input at its forward and again at
# the backward, and its own receipts come back to it in every backward's request and every trail
VERIFIED_KEEP = 4096


class ReceiptError(ValueError):
    """A receipt that is malformed, or that does not say what it must."""


def digest(data: bytes | bytearray | memoryview) -> bytes:
    import blake3

    return blake3.blake3(data).digest(DIGEST_BYTES)


def hash_threads(nbytes: int) -> int:
    """``max_threads`` for a BLAKE3 hasher of ``nbytes``: every core from PARALLEL_HASH_BYTES on, except in a process
    forked after its parent started the thread pool. Rayon's pool does not survive a fork: the child's first parallel
    hash would wait forever for threads that are not there (a volunteer's DHT process, a fork server's child)."""
    global _POOL_PID
    if nbytes < PARALLEL_HASH_BYTES:
        return 1
    pid = os.getpid()
    if _POOL_PID is None:
        _POOL_PID = pid
    elif _POOL_PID != pid:
        return 1
    import blake3

    return blake3.blake3.AUTO


def tensor_digest(item: Any) -> bytes:
    """The digest of one serialized tensor (hivemind's ``runtime_pb2.Tensor``) as it travels: its bytes and
    what it declares about them, so the same bytes under another dtype or shape are another tensor."""
    import blake3

    buffer = item.buffer  # a protobuf message hands out a copy per access: read once
    h = blake3.blake3(max_threads=hash_threads(len(buffer)))
    h.update(f"{item.dtype}|{list(item.size)}|{int(item.compression)}|".encode())
    h.update(buffer)
    return h.digest(DIGEST_BYTES)


def ids_digest(ids: Any) -> bytes:
    """The digest of sample ids (an int64 tensor or array), from their values: both ends compute it."""
    import numpy as np

    values = np.ascontiguousarray(np.asarray(ids, dtype="<i8"))
    return digest(b"ids|" + values.tobytes())


def figures_digest(loss_sum: float, correct: int, count: int) -> bytes:
    """What an evaluation receipt signs: its figures, exactly as they travel."""
    return digest(f"eval|{float(loss_sum)!r}|{int(correct)}|{int(count)}".encode())


def loss_digest(loss: float) -> bytes:
    """What a last stage's forward_backward receipt signs beside its gradient: the loss it reports, exactly as it
    travels (the driver judges copies by it, and in a push every stage above relays it: swarm/pipeline/stage/push.py)."""
    return digest(f"loss|{float(loss)!r}".encode())


def route_digest(run_id: str, mb: str, route: list[str]) -> bytes:
    """What a driver signs when it pushes a micro-batch (swarm/pipeline/stage/push.py): the peers it chose, in order."""
    return digest("\x1f".join(["route", run_id, mb, *route]).encode())


@dataclass(slots=True, frozen=True)
class Receipt:
    run_id: str
    mb: str
    op: str
    stage: int
    version: int
    input: bytes
    output: bytes
    ids: bytes
    signer: str
    signature: bytes = b""
    weights: bytes = NO_WEIGHTS  # the digest of the signer's parameters at ``version`` (weights.py weights_digest)
    # a backward's input gradient runs through the activations its forward computed, with an older version's
    # weights (swarm/pipeline/stage/worker.py): their digest; the same as ``weights`` for every other op
    forward_weights: bytes = NO_WEIGHTS
    figures: bytes = NO_FIGURES  # loss_digest of the loss a forward_backward reports (NO_FIGURES for other ops)

    def body(self) -> bytes:
        """The signed bytes: every field but the signature, unambiguous (lengths are fixed or prefixed)."""
        parts = [str(RECEIPT_FORMAT), self.run_id, self.mb, self.op, str(self.stage), str(self.version), self.signer]
        text = "\x1f".join(f"{len(p)}:{p}" for p in parts).encode()
        return text + b"\x1e" + self.input + self.output + self.ids + self.weights + self.forward_weights + self.figures

    def to_wire(self) -> list[Any]:
        return [RECEIPT_FORMAT, self.run_id, self.mb, self.op, self.stage, self.version, self.input, self.output,
                self.ids, self.weights, self.forward_weights, self.figures, self.signer, self.signature]

    @classmethod
    def from_wire(cls, raw: Any) -> Receipt:
        """Parse a stranger's receipt; anything malformed is a ReceiptError (never another exception)."""
        if not isinstance(raw, (list, tuple)) or len(raw) != 14 or raw[0] != RECEIPT_FORMAT:
            raise ReceiptError("malformed receipt")
        _, run_id, mb, op, stage, version, inp, out, ids, weights, forward_weights, figures, signer, signature = raw
        for text in (run_id, mb, op, signer):
            if not isinstance(text, str) or not 0 < len(text) <= MAX_TEXT_CHARS:
                raise ReceiptError("malformed receipt: a text field")
        for number in (stage, version):
            if not isinstance(number, int) or isinstance(number, bool) or not 0 <= number < 2**62:
                raise ReceiptError("malformed receipt: a number field")
        for blob in (inp, out, ids, weights, forward_weights, figures):
            if not isinstance(blob, bytes) or len(blob) != DIGEST_BYTES:
                raise ReceiptError("malformed receipt: a digest")
        if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
            raise ReceiptError("malformed receipt: the signature")
        if op not in OPS:
            raise ReceiptError(f"malformed receipt: unknown op {op[:32]!r}")
        return cls(run_id, mb, op, stage, version, inp, out, ids, signer, signature, weights, forward_weights, figures)


def parse_all(raw: Any, count: int) -> list[Receipt]:
    """``count`` receipts from a request's metadata field ``rc`` (a list)."""
    if not isinstance(raw, (list, tuple)) or len(raw) != count:
        raise ReceiptError(f"expected {count} receipt(s) in 'rc'")
    return [Receipt.from_wire(item) for item in raw]


class ReceiptKey:
    """This peer's per-run signing key (Ed25519). ``seed``: 32 bytes to derive it from (a restarted peer keeps its
    key), or None for a fresh one."""

    def __init__(self, peer_id: str, seed: bytes | None = None):
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        self.peer_id = peer_id
        self._key = Ed25519PrivateKey.from_private_bytes(seed) if seed is not None else Ed25519PrivateKey.generate()
        self.public = self._key.public_key().public_bytes_raw()

    def sign_bytes(self, data: bytes) -> bytes:
        """A signature of ``data`` itself (a route digest: route_digest)."""
        signature = self._key.sign(data)
        _VERIFIED.add(signature, self.public, data)
        return signature

    def sign(self, run_id: str, mb: str, op: str, stage: int, version: int, input: bytes, output: bytes,
             ids: bytes, weights: bytes = NO_WEIGHTS, forward_weights: bytes | None = None,
             figures: bytes = NO_FIGURES) -> Receipt:
        forward_weights = weights if forward_weights is None else forward_weights
        unsigned = Receipt(run_id, mb, op, stage, max(0, int(version)), input, output, ids, self.peer_id,
                           weights=weights, forward_weights=forward_weights, figures=figures)
        body = unsigned.body()
        signature = self._key.sign(body)
        _VERIFIED.add(signature, self.public, body)
        return Receipt(run_id, mb, op, stage, unsigned.version, input, output, ids, self.peer_id, signature, weights,
                       forward_weights, figures)


class _Verified:
    """Signatures that verified lately, each with the key and the bytes it verified for.

    Ed25519 verification is a pure function of (public key, signature, signed bytes): the same three verify again,
    so a hit is answered without the ~0.1 ms of a verification; a signature seen with another key or other bytes is
    no hit and is verified in full. Only successes are kept (a forgery costs its sender a verification each time),
    at most ``VERIFIED_KEEP`` (the oldest go first); our own signatures go in as we make them.
    """

    def __init__(self, keep: int):
        self.keep = keep
        self.entries: dict[bytes, tuple[bytes, bytes]] = {}
        self.lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def add(self, signature: bytes, public_key: bytes, data: bytes) -> None:
        with self.lock:
            self.entries[signature] = (public_key, bytes(data))
            while len(self.entries) > self.keep:
                del self.entries[next(iter(self.entries))]

    def valid(self, signature: bytes, data: bytes, public_key: bytes) -> bool:
        if self.entries.get(signature) == (public_key, data):
            self.hits += 1
            return True
        self.misses += 1
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        try:
            Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
        except (InvalidSignature, ValueError):
            return False
        self.add(signature, public_key, data)
        return True


_VERIFIED = _Verified(VERIFIED_KEEP)


def verification_stats() -> dict[str, int]:
    """Signature checks answered from the recently verified (hits) and verified in full (misses), since start."""
    return {"hits": _VERIFIED.hits, "misses": _VERIFIED.misses}


def bytes_signature_valid(data: bytes, signature: Any, public_key: bytes | None) -> bool:
    """``signature`` (ReceiptKey.sign_bytes) of ``data`` by the holder of ``public_key``."""
    if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES or not isinstance(public_key, bytes) \
            or len(public_key) != PUBLIC_KEY_BYTES:
        return False
    return _VERIFIED.valid(signature, bytes(data), public_key)


def signature_valid(receipt: Receipt, public_key: bytes) -> bool:
    if not isinstance(public_key, bytes) or len(public_key) != PUBLIC_KEY_BYTES or \
            not isinstance(receipt.signature, bytes) or len(receipt.signature) != SIGNATURE_BYTES:
        return False
    return _VERIFIED.valid(receipt.signature, receipt.body(), public_key)


@dataclass(slots=True, frozen=True)
class Expect:
    """What a receipt must say to vouch for one tensor (None: that field is not checked)."""

    run_id: str
    stage: int
    ops: frozenset[str]
    output: bytes
    mb: str | None = None
    input: bytes | None = None
    ids: bytes | None = None
    signer: str | None = None


def mismatch(receipt: Receipt, expect: Expect) -> str | None:
    """Why ``receipt`` does not vouch for what ``expect`` describes, or None when it does (the signature is
    checked separately: ``signature_valid``)."""
    if receipt.run_id != expect.run_id:
        return "a receipt of another run"
    if receipt.stage != expect.stage or receipt.op not in expect.ops:
        return f"a receipt of {receipt.op} at stage {receipt.stage}, not of {'/'.join(sorted(expect.ops))} at " \
               f"stage {expect.stage}"
    if expect.mb is not None and receipt.mb != expect.mb:
        return "a receipt of another micro-batch"
    if expect.signer is not None and receipt.signer != expect.signer:
        return f"signed by {receipt.signer[-8:]}, not by {expect.signer[-8:]}"
    if receipt.output != expect.output:
        return "the tensor is not the one the receipt's signer produced"
    if expect.input is not None and receipt.input != expect.input:
        return "the receipt's input is not the output it must follow"
    if expect.ids is not None and receipt.ids != expect.ids:
        return "the receipt's sample ids are not the ones sent"
    return None
