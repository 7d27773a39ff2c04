"""Can other hosts dial this node? The node's side of swarm/dht/reachability.py.

Once online (after ``FIRST_CHECK_S``), the node asks a few online peers of the run to dial its addresses
back; again every ``RECHECK_S``, or sooner while the answer is unknown (after ``RETRY_FIRST_S``, doubling up to
``RETRY_S``: peers that came online together are each other's only responders, and busy ones refuse). The verdict shows in
the snapshot (``reachability``, its detail and time: the dashboard and `status` say how old it is) and
in our record (``reachable``), announced at once when it changes, so that drivers stop routing to a node
they cannot dial within a heartbeat.

Behind NAT (unreachable) a node still joins, drives and pulls, which only dial out. In layer0 that is
all it needs. In another swarm nobody can send it work: it says so in its reason and the event log
(with what to do), and a `--swarm auto` node moves to layer0 and stays there.
"""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING, Any

from volunteer.snapshot import EventLevel, NodeState

if TYPE_CHECKING:
    from volunteer.node.core import Node

logger = logging.getLogger(__name__)

FIRST_CHECK_S = 3.0  # after the node is first online: its peers have read its record by then
RECHECK_S = 600.0  # a home router's port forward or a laptop's network changes rarely
# while the verdict is unknown (too few peers online or free to tell): the first retry, doubling up to RETRY_S, each
# drawn up to RETRY_JITTER later (nodes that started together do not ask the same busy peers together again). A
# fixed 30 s kept a node that checked while its peers were busy answering each other "unknown" for half a minute:
# its user saw no verdict, and one behind NAT stayed in the drivers' routes (only ``reachable: 0`` leaves them).
RETRY_FIRST_S = 5.0
RETRY_S = 30.0
RETRY_JITTER = 0.2


class Reachability:
    def __init__(self, node: Node):
        self.node = node
        self.verdict: Any = None  # swarm.dht.reachability.Verdict
        self._future: Any = None
        self._next_at: float | None = None
        self._unknowns = 0  # checks in a row that could not tell (the retry's backoff)

    @property
    def record_value(self) -> int:
        return self.verdict.record_value if self.verdict is not None else -1

    def cut_off_reason(self) -> str:
        """Why no driver can send us work ("" when they can): we are unreachable and serve a swarm other
        than layer0."""
        if self.record_value != 0 or self.node.swarm in ("", "layer0"):
            return ""
        return (f"other hosts cannot dial this node (behind NAT or a firewall), so no driver can send {self.node.swarm} "
                "work here; see `volunteer doctor`, or join layer0")

    def tick(self, now_s: float) -> None:
        node = self.node
        if node.peer is None or node.board.snapshot().state != NodeState.ONLINE:
            return
        if self._future is not None:
            if self._future.done():
                self._adopt(self._result(), now_s)
            return
        if self._next_at is None:
            self._next_at = now_s + FIRST_CHECK_S
        if now_s < self._next_at:
            return
        me = node.board.snapshot().peer_id
        responders = sorted({r.peer_id for records in node.announcer.views.values() for r in records
                             if r.state == "online" and r.peer_id != me})
        # asked even with nobody to ask: a node on loopback only knows at once that there is nothing to check (its
        # dashboard said "not known yet" until it read another swarm's peers, 25 s for a node that drives nothing);
        # any other says "no other online peer to ask yet" and is retried as for any unknown
        if self.verdict is None:
            node.board.publish(reachability="checking", reachability_detail="asking peers to dial this node back"
                               if responders else "no other online peer to ask yet")
        self._future = node.peer.check_reachability(responders)

    def _result(self) -> Any:
        from swarm.dht.reachability import UNKNOWN, Verdict

        future, self._future = self._future, None
        try:
            return future.result()
        except Exception as exc:
            logger.info("reachability check failed: %s", exc)
            return Verdict(UNKNOWN, f"the check failed: {exc.__class__.__name__}: {exc}")

    def _adopt(self, verdict: Any, now_s: float) -> None:
        from swarm.dht.reachability import LOCAL, REACHABLE, UNKNOWN, UNREACHABLE, advice

        node = self.node
        previous = self.verdict
        if verdict.status == UNKNOWN and previous is not None and previous.status != UNKNOWN:
            self._next_at = self._retry_at(now_s)  # keep what we knew; a later check may tell again
            return
        self.verdict = verdict
        if verdict.status == UNKNOWN:
            self._next_at = self._retry_at(now_s)
        else:
            self._unknowns, self._next_at = 0, now_s + RECHECK_S
        node.board.publish(reachability=verdict.status, reachability_detail=verdict.detail,
                           reachability_at=time.time())
        if previous is not None and previous.status == verdict.status:
            return
        if verdict.status == UNREACHABLE:
            node.board.emit(f"not reachable: {verdict.detail}. {advice(verdict, node.swarm)}", EventLevel.WARNING,
                            "network")
        elif verdict.status in (REACHABLE, LOCAL):
            node.board.emit(f"reachable: {verdict.detail}" if verdict.status == REACHABLE else verdict.detail,
                            kind="network")
        if verdict.record_value != (previous.record_value if previous is not None else -1):
            node.announcer.announce()  # drivers stop (or start) routing to us within a heartbeat
        if verdict.status == UNREACHABLE and node.rebalancer.enabled and node.swarm != "layer0":
            node.move_to("layer0", "other hosts cannot dial this node: layer0 is the one swarm that needs no "
                                   "inbound connection (its peers drive)")

    def _retry_at(self, now_s: float) -> float:
        from swarm.pipeline.control.routing import backoff_s

        self._unknowns += 1
        return now_s + backoff_s(self._unknowns, RETRY_FIRST_S, RETRY_S) * random.uniform(1.0, 1.0 + RETRY_JITTER)

    def close(self) -> None:
        if self._future is not None:
            self._future.cancel()
