"""A volunteer's DHT node inside its own process (issue 15, item 5: a lighter volunteer).

hivemind's ``DHT`` forks a process that runs a ``DHTNode`` on its own event loop and talks to it through
a pipe. Forked from a volunteer that has already imported torch, that child cost 133-163 MiB PSS per
volunteer (benchmarks/README.md, the soak) to run a few hundred milliseconds of Python a minute: with a
read schedule that keeps a peer's DHT work flat (swarm/dht/membership.py ``read_period``), about 20 ms of
CPU per heartbeat (benchmarks/dht_scale.py). ``InProcessDHT`` runs the same ``DHTNode``, with the same
settings, validators and p2pd, on an event-loop thread of the volunteer's own process, and offers the part
of ``hivemind.DHT`` the node uses: ``get``/``store`` (futures with ``result(timeout)``), ``peer_id``,
``get_visible_maddrs`` and the daemon's address for ``swarm.dht.dht.fresh_p2p``, and
``shutdown``/``join``/``is_alive``/``kill`` for ``swarm.dht.dht.shutdown_dht``.

What changes for the process: p2pd is its only helper (it joins the watchdog's group, as before); the
DHT's work shares the GIL with training, which at 20 ms per 5 s heartbeat is noise; a SIGTERM reaches
the main process only, which leaves in order (announces offline) and then stops the node.
``volunteer bootstrap`` and the tests' helper DHTs still use hivemind's process (``swarm.dht.dht.start_dht``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from swarm.dht.lightdht import SYNC_CALL_S, LightDHT, _p2pd_in_group

logger = logging.getLogger(__name__)

REPLICAS_REFRESH_S = 30.0  # how long a key's nearest nodes, once found, take our record without a new search
# how often a node checks that it is still connected to its bootstrap peers (one local p2pd call);
# VOLUNTEER_REJOIN_S shortens it for a test of a bootstrap peer's restart (its own time scale: 15 s of a 60 s test),
# read when a node starts (not at import: a process forked from one that imported this module has its own environment)
REJOIN_S = 15.0
REJOIN_MAX_S = 240.0  # the longest wait between checks of a bootstrap peer found reachable but not connected
REJOIN_DIAL_S = 10.0  # a dial (and ping) of a bootstrap peer that does not answer is given up after this


def bootstrap_peers(maddrs: list[str]) -> dict[Any, list[Any]]:
    """The peer ids of ``initial_peers`` with the addresses to dial each at: what precedes the *last* /p2p/ (a
    relayed address, /p2p/RELAY/p2p-circuit/p2p/PEER, names the relay first)."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    peers: dict[Any, list[Any]] = {}
    for text in maddrs:
        address, _, peer = text.rpartition("/p2p/")
        try:
            peers.setdefault(PeerID.from_base58(peer), []).append(Multiaddr(address))
        except Exception as exc:  # checked at the command line already; a bad one is skipped here
            logger.debug("initial peer %s: %s", text, exc)
    return peers


class Rejoin:
    """Reconnect to the bootstrap peers when the link to them is gone, and merge the DHT through them.

    hivemind pings ``initial_peers`` once, when a node starts. When a bootstrap peer restarts (an upgrade, a
    crash; same identity, same address), it knows nobody, and nobody dials it again: the volunteers that were
    running stay in their part of the DHT, every volunteer that joins afterwards in another, and each part sees
    the other's swarms as empty, for good (found walking issue 30 as a user: layer0 said "waiting for layer2"
    while a new layer2 peer said "layers 0, 1 and 3 have no online peer"). A bootstrap peer that p2pd is not
    connected to is dialled at its address and pinged (the ping puts us in its routing table), then we look up
    our own id through it (which puts its other peers in ours): the parts merge, and the next heartbeat's reads
    and stores reach everyone.

    Connected is not enough: p2pd re-dials a restarted bootstrap peer on its own (same identity, same address),
    often before that peer's DHT handlers are up; our DHT's calls to it then fail, our routing table drops it, and
    the parts stayed apart for good while p2pd showed it connected (tests/test_foundation.py failed 3 times in 13
    so). So a connected bootstrap peer is pinged over its connection (no handshake); a ping that answers with a DHT
    id other than the last one it gave (a restarted peer draws a new one; at our first check, any) is a peer that
    may not know us: the DHT is merged through it as after a dial.

    How often: every ``REJOIN_S`` while we find it connected, or while it does not answer (a failed dial costs it
    nothing). Found reachable but not connected again and again (p2pd's connection manager trims idle
    connections in a large swarm), the wait doubles up to ``REJOIN_MAX_S``: a thousand volunteers must not
    re-handshake with one bootstrap peer every 15 s."""

    def __init__(self, node: Any, maddrs: list[str], clock: Callable[[], float] = time.monotonic):
        self.node = node
        self.clock = clock
        self.peers = bootstrap_peers(maddrs)
        self.every_s = float(os.environ.get("VOLUNTEER_REJOIN_S", "") or REJOIN_S)
        self._wait_s = {peer_id: self.every_s for peer_id in self.peers}
        self._due = {peer_id: 0.0 for peer_id in self.peers}  # clock time of each peer's next check
        self._ids: dict[Any, Any] = {}  # the DHT id each bootstrap peer last answered a ping with

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # p2pd gone (shutting down), or a dial that failed: try again later
                logger.debug("checking the bootstrap peers: %s", exc)

    async def check(self) -> int:
        """Dial and ping every bootstrap peer that is due and not connected; returns how many answered."""
        now = self.clock()
        due = [peer_id for peer_id in self.peers if self._due[peer_id] <= now]
        if not due:
            return 0
        connected = {info.peer_id for info in await self.node.p2p.list_peers()}
        answered = 0
        for peer_id in due:
            if peer_id in connected:
                self._wait_s[peer_id] = self.every_s
                answered += await self._ping(peer_id)  # 1 when it is new to us since the last ping
            elif await self._redial(peer_id):
                answered += 1
                self._wait_s[peer_id] = min(REJOIN_MAX_S, 2 * self._wait_s[peer_id])
            self._due[peer_id] = now + self._wait_s[peer_id]
        if answered:
            await asyncio.wait_for(self.node.find_nearest_nodes([self.node.node_id]), REJOIN_DIAL_S)
            logger.info("reconnected to %d bootstrap peer(s) and merged the DHT through them", answered)
        return answered

    async def _redial(self, peer_id: Any) -> bool:
        try:
            # p2pd's own connect (hivemind's P2P has no public one): the address is ours to give, not the peerstore's
            await asyncio.wait_for(self.node.p2p._client.connect(peer_id, self.peers[peer_id]), REJOIN_DIAL_S)
        except Exception as exc:  # TimeoutError included
            logger.debug("bootstrap peer %s does not answer: %s", peer_id, exc)
            return False
        return await self._ping(peer_id, changed_only=False) > 0

    async def _ping(self, peer_id: Any, changed_only: bool = True) -> int:
        """Ping ``peer_id`` (it adds us to its routing table, and we it to ours): 1 when it answered (with a DHT id
        other than the last it gave, where ``changed_only``), else 0."""
        try:
            pong = await asyncio.wait_for(self.node.protocol.call_ping(peer_id, validate=False, strict=False),
                                          REJOIN_DIAL_S)
        except Exception as exc:  # TimeoutError included
            logger.debug("bootstrap peer %s does not answer a ping: %s", peer_id, exc)
            return 0
        if pong is None:  # up, but not its DHT (yet): a restarted peer's handlers come after its p2pd
            return 0
        last, self._ids[peer_id] = self._ids.get(peer_id), pong
        return int(not changed_only or last != pong)


class RecordStores:
    """A heartbeat's store, without a search of the DHT each time.

    ``DHTNode.store`` first crawls toward the key to find its nearest nodes, and every node it asks that
    holds the key answers with the key's whole value: for a swarm's key, every record of the swarm. Storing
    our record each heartbeat that way costs in proportion to the swarm's size (benchmarks/dht_scale.py).
    The nearest nodes of a key change only when nodes join or leave near it, so they are searched for once
    a ``REPLICAS_REFRESH_S`` (one search, as ``DHTNode.store``'s own) and the signed record goes straight to
    them (``call_store``, as ``DHTNode.store`` sends it), then and until the next search. A node that does
    not take it is dropped from the set; with fewer than ``num_replicas`` // 2 + 1 left, or fewer than
    ``num_replicas`` found (a small DHT, or one still forming), the next store searches again. If nobody
    takes it, hivemind's own store runs (which may also keep it on this node). A node that joined near the
    key in between gets our record at the next search; readers merge every replica they reach."""

    def __init__(self) -> None:
        self._replicas: dict[Any, tuple[float, list[Any]]] = {}  # key id -> (found at, peer ids)

    async def store(self, node: Any, key: Any, subkey: Any, value: Any, expiration_time: float, beam_size: int) -> bool:
        import time

        from hivemind.dht.routing import DHTID

        key_id = DHTID.generate(source=key)
        found = self._replicas.get(key_id)
        if found is not None and time.monotonic() - found[0] < REPLICAS_REFRESH_S:
            took = await self._send(node, key_id, subkey, value, expiration_time, found[1])
            if len(took) > node.num_replicas // 2:
                self._replicas[key_id] = (found[0], took)
            else:
                del self._replicas[key_id]  # they left, or refuse: the next store searches again
            if took:  # stored (sent again now, this same record would be refused as not newer)
                return True
        # one search, as DHTNode.store's own, then the same direct stores
        nearest = await node.find_nearest_nodes([key_id], k_nearest=node.num_replicas, beam_size=beam_size,
                                                exclude_self=True)
        peers = list(nearest.get(key_id, {}).values())
        took = await self._send(node, key_id, subkey, value, expiration_time, peers) if peers else []
        if len(peers) >= node.num_replicas and len(took) > node.num_replicas // 2:
            self._replicas[key_id] = (time.monotonic(), took)
        if took:
            return True
        return bool(await node.store(key, value, expiration_time, subkey=subkey, beam_size=beam_size))

    @staticmethod
    async def _send(node: Any, key_id: Any, subkey: Any, value: Any, expiration_time: float, peers: list[Any]) -> list[Any]:
        """The signed record to each of ``peers`` (``call_store``, as DHTNode.store sends it); those that took it."""
        from hivemind.dht.validation import DHTRecord

        serializer, validator = node.protocol.serializer, node.protocol.record_validator
        value_bytes = serializer.dumps(value)
        if validator is not None:
            value_bytes = validator.sign_value(DHTRecord(key_id.to_bytes(), serializer.dumps(subkey), value_bytes,
                                                         expiration_time))
        replies = await asyncio.gather(*(
            node.protocol.call_store(peer_id, keys=[key_id], values=[value_bytes], expiration_time=[expiration_time],
                                     subkeys=[subkey]) for peer_id in peers))
        return [peer_id for peer_id, reply in zip(peers, replies) if reply and reply[0]]


class InProcessDHT(LightDHT):
    """A full DHT node (not a reader) on an event-loop thread of this process; see the module docstring."""

    def __init__(self, settings: Any, validators: list[Any]):  # settings: swarm.dht.dht.DHTSettings
        super().__init__(settings, validators)
        self._thread.name = "dht-node"
        self.peer_id: Any = None
        self._stores = RecordStores()
        self._rejoin_task: Any = None  # held: the loop keeps only a weak reference to a task

    async def _create(self) -> Any:
        from hivemind.dht.node import DHTNode
        from hivemind.dht.validation import CompositeValidator

        from swarm.dht.dht import _apply_hivemind_fixes, node_kwargs

        _apply_hivemind_fixes()
        with _p2pd_in_group(self.settings.process_group):  # what start_dht's hivemind.DHT would create
            node = await DHTNode.create(record_validator=CompositeValidator(self._validators),
                                        **node_kwargs(self.settings))
        self.peer_id = node.peer_id
        self._rejoin_task = asyncio.create_task(Rejoin(node, list(self.settings.initial_peers)).run())
        return node

    # ----- what hivemind.DHT offers and the node uses

    def store(self, key: Any, value: Any, expiration_time: float, subkey: Any = None, return_future: bool = False,
              **kwargs: Any) -> Any:
        """A record (a store with a subkey) goes to the key's nearest nodes as last found (``RecordStores``)."""
        if subkey is not None and set(kwargs) <= {"beam_size"}:
            from swarm.dht.dht import GET_BEAM

            coro = self._stores.store(self._node, key, subkey, value, expiration_time, kwargs.get("beam_size", GET_BEAM))
        else:
            coro = self._node.store(key, value, expiration_time, subkey=subkey, **kwargs)
        future: Future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future if return_future else future.result(SYNC_CALL_S)

    def get_visible_maddrs(self, latest: bool = False) -> list[Any]:
        return asyncio.run_coroutine_threadsafe(self._node.get_visible_maddrs(latest=latest),
                                                self._loop).result(SYNC_CALL_S)

    def daemon_listen_maddr(self) -> Any:
        """p2pd's control address (set once, when the node started), for a P2P replica on the caller's own
        loop (swarm/dht/dht.py ``fresh_p2p``)."""
        return self._node.p2p.daemon_listen_maddr

    def is_alive(self) -> bool:
        return self._node is not None and self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def kill(self) -> None:
        """Nothing to kill but p2pd, which the watchdog's process group reaps."""
        self.shutdown()


def start_node_dht(settings: Any, validators: list[Any]) -> InProcessDHT:
    """Start an InProcessDHT; raise swarm.dht.dht.DHTStartError with advice (as start_dht does) when it fails."""
    from swarm.dht.dht import start_error

    try:
        return InProcessDHT(settings, validators).start()
    except Exception as exc:  # hivemind raises plain exceptions for bootstrap failures
        raise start_error(exc, settings) from None
