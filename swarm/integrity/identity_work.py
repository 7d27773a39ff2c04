"""Identities that cost something: a proof of work bound to the peer id (issue 25 item 5, S/Kademlia's static puzzle).

A libp2p key costs nothing, so one stranger can be many peers: after a ban, a fresh key is a fresh start. Each peer
publishes, in its signed membership record, a ``work`` nonce such that ``scrypt(peer id, DOMAIN + nonce)`` starts
with at least ``integrity.identity_bits`` zero bits. A reader checks it with one evaluation (about 5 ms, once per
peer id and nonce in a process: ``verified``) and ignores the records of peers without it
(swarm/dht/membership.py): nobody routes to them, pulls from them or serves them as a driver. Finding the nonce
takes 2^bits evaluations on average (8 bits: about a second of one core), once per identity: the nonce is kept
next to the identity file and serves every run that asks for as many bits or fewer.

Why scrypt and not a plain hash (the ARCHITECTURE's earlier objection to a puzzle): a SHA-256 puzzle is found by a
loop in Python here (~0.7 M hashes/s) and natively elsewhere (~20 M/s a core, billions on a GPU), so it would tax
volunteers and barely slow a Sybil. scrypt runs in OpenSSL's C for everyone (``hashlib.scrypt``): an attacker's
CPU core is no faster than a volunteer's, and its 1 MiB per evaluation (n=2^10, r=8) holds a GPU to a few hundred
cores' worth, not millions. What it buys: a banned stranger's next identity costs about a second of CPU, a thousand
of them a quarter of an hour, where they cost nothing before. It is a price, not a wall: identities can be ground
ahead of time. What keeps many identities from mattering is elsewhere: newcomers together share one pool of a
stage's updates and earn more only by validated work (swarm/integrity/requesters.py, swarm/integrity/spot.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DOMAIN = b"volunteer identity work v1/"
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**10, 8, 1  # 1 MiB and ~5 ms an evaluation; changing them is a new DOMAIN
SCRYPT_MAXMEM = 4 * 2**20
MAX_NONCE = 2**63 - 1  # the record's field is a signed 64-bit integer on the wire (msgpack)
MAX_BITS = 20  # 2^20 evaluations: about an hour and a half of one core; the run config refuses more
VERIFIED_MAX = 8192  # (peer id, nonce, bits) verdicts a process keeps: each took one evaluation


def work_digest(peer_id: str, nonce: int) -> bytes:
    return hashlib.scrypt(peer_id.encode(), salt=DOMAIN + nonce.to_bytes(8, "little"), n=SCRYPT_N, r=SCRYPT_R,
                          p=SCRYPT_P, maxmem=SCRYPT_MAXMEM, dklen=32)


def zero_bits(digest: bytes) -> int:
    """Leading zero bits of ``digest``."""
    return len(digest) * 8 - int.from_bytes(digest, "big").bit_length()


_verified: OrderedDict[tuple[str, int, int], bool] = OrderedDict()


def _may_prove(nonce: Any, bits: int) -> bool:
    """Could ``nonce`` prove ``bits`` at all (an integer in range, bits a run may ask for)? Answered without scrypt."""
    return not isinstance(nonce, bool) and isinstance(nonce, int) and 0 <= nonce <= MAX_NONCE and bits <= MAX_BITS


def has_work(peer_id: str, nonce: int, bits: int) -> bool:
    """Does ``nonce`` prove ``bits`` of work for ``peer_id``? (0 bits: anything does.) Each verdict is kept, so a
    reader pays one evaluation per peer id and nonce, not one per read."""
    if bits <= 0:
        return True
    if not _may_prove(nonce, bits):
        return False
    key = (peer_id, nonce, bits)
    verdict = _verified.get(key)
    if verdict is None:
        verdict = zero_bits(work_digest(peer_id, nonce)) >= bits
        _verified[key] = verdict
        if len(_verified) > VERIFIED_MAX:
            _verified.popitem(last=False)
    return verdict


# A reader's checks are bounded against a stranger who would make it evaluate scrypt forever for free (a record with
# a junk nonce costs its author nothing and a reader ~4 ms): a peer is checked for one nonce, again only after
# RECHECK_HOLD_S whatever nonce it shows meanwhile (an honest peer's never changes), and one read checks for at most
# CHECK_BUDGET_S (the rest are checked at the next reads: a newcomer to a swarm of hundreds sees ~60 more a read).
CHECK_BUDGET_S = 0.25
RECHECK_HOLD_S = 60.0
CHECKS_KEPT = 16384
EVALUATION_S = 0.0045  # one evaluation on one core of the 2-core test machine (benchmarks.identity_work: 230/s)


class WorkChecks:
    """One reader's verdicts on identity work, per peer id (see CHECK_BUDGET_S and RECHECK_HOLD_S)."""

    def __init__(self, bits: int, *, budget_s: float = CHECK_BUDGET_S, hold_s: float = RECHECK_HOLD_S,
                 clock: Callable[[], float] = time.monotonic):
        self.bits, self.budget_s, self.hold_s, self.clock = bits, budget_s, hold_s, clock
        self._last: OrderedDict[str, tuple[int, bool, float]] = OrderedDict()  # peer -> (nonce, verdict, checked at)
        self._lock = threading.Lock()  # a Membership may be read from more than one thread

    def keep(self, records: list) -> tuple[list, list]:
        """(the records proven, the records found without the work) of ``records`` (anything with ``peer_id`` and
        ``work``); a record left unchecked by this read's budget is in neither, and is checked at a later read."""
        if self.bits <= 0:
            return list(records), []
        deadline = self.clock() + self.budget_s
        kept, refused = [], []
        with self._lock:
            for record in records:
                verdict = self._proven(record.peer_id, record.work, deadline)
                if verdict is not None:
                    (kept if verdict else refused).append(record)
        return kept, refused

    def _proven(self, peer_id: str, nonce: Any, deadline: float) -> bool | None:
        if not _may_prove(nonce, self.bits):
            return False  # refused without an evaluation: no hold (a restart's proven record must not wait it out)
        now = self.clock()
        last = self._last.get(peer_id)
        if last is not None and last[0] == nonce:
            return last[1]
        if last is not None and now - last[2] < self.hold_s:
            return False  # another nonce within the hold: not evaluated (an honest peer keeps its nonce)
        if now > deadline:
            return None  # this read's checks are spent
        verdict = has_work(peer_id, nonce, self.bits)
        self._last[peer_id] = (nonce, verdict, now)
        self._last.move_to_end(peer_id)
        if len(self._last) > CHECKS_KEPT:
            self._last.popitem(last=False)
        return verdict


def find_work(peer_id: str, bits: int, *, start: int = 0, should_stop: Callable[[], bool] | None = None,
              progress: Callable[[int], None] | None = None) -> int | None:
    """The first nonce from ``start`` that proves ``bits`` for ``peer_id``; None when ``should_stop`` says so
    (asked between two evaluations). ``progress(evaluations so far)`` is called after each."""
    if bits <= 0:
        return 0
    for nonce in range(start, MAX_NONCE + 1):
        if zero_bits(work_digest(peer_id, nonce)) >= bits:
            return nonce
        if progress is not None:
            progress(nonce + 1 - start)
        if should_stop is not None and should_stop():
            return None
    return None  # not reached for any bits <= MAX_BITS


def work_path(identity_path: Path) -> Path:
    return identity_path.with_name(identity_path.name + ".work")


def load_work(identity_path: Path, peer_id: str, bits: int) -> int | None:
    """The nonce kept for this identity if it proves ``bits`` (a file edited or of another key: ignored)."""
    try:
        kept = json.loads(work_path(identity_path).read_text())
        nonce = kept["nonce"] if kept.get("peer_id") == peer_id else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return nonce if isinstance(nonce, int) and has_work(peer_id, nonce, bits) else None


def save_work(identity_path: Path, peer_id: str, nonce: int) -> None:
    path = work_path(identity_path)
    body = json.dumps({"peer_id": peer_id, "nonce": nonce, "bits": zero_bits(work_digest(peer_id, nonce)),
                       "domain": DOMAIN.decode()})
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        tmp.write_text(body)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only data dir: the work is found again next time, nothing is lost
        logger.warning("could not keep this identity's work in %s: %s", path, exc)


def identity_work(identity_path: Path | None, peer_id: str, bits: int, *,
                  should_stop: Callable[[], bool] | None = None,
                  say: Callable[[str], None] | None = None) -> int | None:
    """This identity's nonce for ``bits``: the kept one, else found now (saying so, with progress) and kept.
    None when stopped before it was found."""
    if bits <= 0:
        return 0
    if identity_path is not None:
        kept = load_work(identity_path, peer_id, bits)
        if kept is not None:
            return kept
    expected = 1 << bits
    if say is not None:
        say(f"proving this identity's work ({bits} bits: about {expected} scrypt evaluations, "
            f"~{max(1.0, expected * EVALUATION_S):.0f} s of one core, once per identity, so that identities cost "
            f"something)")
    started = time.monotonic()
    last_said = [started]

    def progress(done: int) -> None:
        now = time.monotonic()
        if say is not None and now - last_said[0] >= 5.0:
            last_said[0] = now
            say(f"still proving this identity's work: {done} scrypt evaluations in {now - started:.0f} s (about "
                f"{expected} expected, a matter of luck)")

    nonce = find_work(peer_id, bits, should_stop=should_stop, progress=progress)
    if nonce is not None:
        logger.info("identity work: %d bits in %.1f s", bits, time.monotonic() - started)
        if identity_path is not None:
            save_work(identity_path, peer_id, nonce)
    return nonce
