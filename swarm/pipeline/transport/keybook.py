"""Whose receipt key is whose: the per-run Ed25519 public keys of the peers whose receipts we check.

A key is only ever taken from the peer itself over its own authenticated libp2p connection: a driver's key
rides on its own requests (metadata ``rk``), a stage peer's on its replies, and a key we have not seen is
asked for with ``rpc_receipt_key`` in the namespace of the swarm the receipt says its signer serves. A key
relayed by anyone else is never believed, so a relay cannot sign in another peer's name.

Fetches are bounded: one in flight per peer, at most ``MAX_FETCHES_PER_S`` a second in all, each within
``FETCH_TIMEOUT_S``, and a peer that did not answer is asked again only after a backoff (``FIRST_RETRY_S``
doubling up to ``FAILED_RETRY_S``: a stranger naming random signers costs us a few dials a second, not a storm).
A key that cannot be had *yet* is not a gone signer: at start-up a stage meets its neighbours' receipts before it
can reach them (its first fetch fails, or its view of their swarm is older than they are), and refusing those
micro-batches at once dropped every backward for seconds while the last stage kept applying its half of them
(736 micro-batches lost in 8 s, a diverging copy). ``wait_s`` says how long a caller should wait for a key: a
signer that has failed for less than ``KEY_PATIENCE_S`` is waited for (reply ``key_pending``), one past it is gone
(``unknown_signer``). And a peer our last two views of that swarm do
not list may take a fetch only while more than half the budget is left: a stranger naming random signers spent
the whole budget that the keys of the peers we know needed. Not "never": a stage reads its neighbours' swarms as
rarely as once a minute, and refusing every signer it had not read yet lost micro-batches of a newly online
peer's (tests/test_nat.py under load: 22 given up as ``unknown_signer``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from swarm.integrity.receipts import PUBLIC_KEY_BYTES

logger = logging.getLogger(__name__)

MAX_KEYS = 4096
MAX_FETCHES_PER_S = 8.0
FETCH_TIMEOUT_S = 3.0
FAILED_RETRY_S = 10.0
FIRST_RETRY_S = 0.5
KEY_PATIENCE_S = 20.0  # a signer whose key fetches have failed this long is taken for gone

Fetch = Callable[[str, str], Awaitable[bytes]]  # (peer id, swarm) -> its public key


class KeyBook:
    def __init__(self, fetch: Fetch | None = None):
        self._fetch = fetch
        self._keys: OrderedDict[str, bytes] = OrderedDict()
        self._failed: dict[str, tuple[float, float, float]] = {}  # peer -> (first failure, backoff, next try at)
        self._pending: dict[str, asyncio.Future] = {}
        self._tokens = MAX_FETCHES_PER_S
        self._tokens_at = time.monotonic()
        self._members: dict[str, tuple[frozenset[str], frozenset[str]]] = {}  # swarm -> (last view, the one before)

    def learn(self, peer_id: str, key: object) -> None:
        """A key that came from ``peer_id`` itself (its request or its reply); anything else is ignored."""
        if isinstance(key, bytes) and len(key) == PUBLIC_KEY_BYTES and isinstance(peer_id, str) and peer_id:
            self._keys[peer_id] = key
            self._keys.move_to_end(peer_id)
            while len(self._keys) > MAX_KEYS:
                self._keys.popitem(last=False)
            self._failed.pop(peer_id, None)

    def known(self, peer_id: str) -> bytes | None:
        return self._keys.get(peer_id)

    async def key(self, peer_id: str, swarm: str) -> bytes | None:
        """The key of ``peer_id``, asked of it in ``swarm`` if we do not have it; None if it cannot be had now."""
        key = self._keys.get(peer_id)
        if key is not None or self._fetch is None:
            return key
        now = time.monotonic()
        failed = self._failed.get(peer_id)
        if failed is not None and now < failed[2]:
            return None
        members = self._members.get(swarm)
        stranger = members is not None and peer_id not in members[0] and peer_id not in members[1]
        pending = self._pending.get(peer_id)
        if pending is None:
            if not self._take_token(now, reserve=MAX_FETCHES_PER_S / 2 if stranger else 0.0):
                return None
            pending = self._pending[peer_id] = asyncio.ensure_future(self._fetch_one(peer_id, swarm))
        try:
            return await asyncio.shield(pending)
        finally:
            if pending.done():
                self._pending.pop(peer_id, None)

    async def _fetch_one(self, peer_id: str, swarm: str) -> bytes | None:
        try:
            key = await asyncio.wait_for(self._fetch(peer_id, swarm), FETCH_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.info("could not get the receipt key of %s in %s: %s", peer_id[-8:], swarm,
                        exc.__class__.__name__ if not str(exc) else exc)
            key = None
        if isinstance(key, bytes) and len(key) == PUBLIC_KEY_BYTES:
            self.learn(peer_id, key)
            return key
        now = time.monotonic()
        first, backoff, next_at = self._failed.get(peer_id, (now, FIRST_RETRY_S / 2, now))
        if now - next_at > KEY_PATIENCE_S:  # nobody asked for a long while: a new episode, patience anew
            first, backoff = now, FIRST_RETRY_S / 2
        backoff = min(FAILED_RETRY_S, 2 * backoff)
        if len(self._failed) > MAX_KEYS:
            self._failed.clear()
        self._failed[peer_id] = (first, backoff, now + backoff)
        return None

    def wait_s(self, peer_id: str) -> float | None:
        """After ``key`` gave None: how long to wait before asking again, or None if the signer is taken for gone
        (its fetches have failed for ``KEY_PATIENCE_S``). A signer not tried yet (no fetch token left) is waited
        for: the caller bounds its own wait (swarm/pipeline/control/hops.py)."""
        now = time.monotonic()
        failed = self._failed.get(peer_id)
        if failed is None:
            return 1.0 / MAX_FETCHES_PER_S
        first, _, next_at = failed
        if now - first >= KEY_PATIENCE_S:
            return None
        return max(0.1, next_at - now)

    def prefetch(self, peer_ids: list[str], swarm: str) -> None:
        """Ask for the keys of ``swarm``'s peers we do not have yet, in the background (on the running loop): a
        peer that signs a tensor and then dies (killed, or gone) can no longer be asked, and its receipts must still
        be checkable by the next stage. The ids are also the swarm's members: only they are asked later (``key``)."""
        previous = self._members.get(swarm, (frozenset(), frozenset()))[0]
        self._members[swarm] = (frozenset(peer_ids), previous)
        for peer_id in peer_ids:
            if peer_id not in self._keys and peer_id not in self._pending:
                asyncio.ensure_future(self.key(peer_id, swarm))

    def _take_token(self, now: float, reserve: float = 0.0) -> bool:
        """One fetch token, leaving at least ``reserve`` for others (the peers our views list)."""
        self._tokens = min(MAX_FETCHES_PER_S, self._tokens + (now - self._tokens_at) * MAX_FETCHES_PER_S)
        self._tokens_at = now
        if self._tokens < 1.0 + reserve:
            return False
        self._tokens -= 1.0
        return True


async def fetch_receipt_key(p2p: Any, run_id: str, peer_id: str, swarm: str) -> bytes:
    """Ask ``peer_id`` for its receipt key in ``swarm``'s namespace (a KeyBook's fetch; b"" when it has none)."""
    from hivemind.p2p import PeerID
    from hivemind.proto import runtime_pb2

    from swarm.pipeline.transport.stage_client import StageRPC, stage_namespace
    from swarm.pipeline.transport.wire import unpack_metadata

    stub = StageRPC.get_stub(p2p, PeerID.from_base58(peer_id), namespace=stage_namespace(run_id, swarm))
    reply = await stub.rpc_receipt_key(runtime_pb2.ExpertRequest())
    key = unpack_metadata(reply.metadata).get("key")
    return key if isinstance(key, bytes) else b""
