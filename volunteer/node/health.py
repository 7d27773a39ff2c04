"""The node's side of self-healing: a copy found sick puts the node in ``healing`` until it is well.

The stage watches and heals itself (swarm/integrity/heal.py): it refuses work while sick, restores
its last good snapshot and lowers its step size. This part makes that visible: the snapshot's state
(``healing``, with the reason) and our record, announced at once so drivers route around us; back to
``online`` when the copy is well. A restore usually takes milliseconds, so the heal is also told in
the event log and counted (``heals``) in the snapshot and the record, where a one-second tick could
miss the state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from volunteer.snapshot import NodeState

if TYPE_CHECKING:
    from volunteer.node.core import Node


class Health:
    def __init__(self, node: Node):
        self.node = node

    def tick(self, now_s: float) -> None:
        node = self.node
        if node.peer is None or node.peer.healer is None:
            return
        reason = node.peer.healer.status().healing
        state = node.board.snapshot().state
        if reason and state == NodeState.ONLINE:
            node.set_state(NodeState.HEALING, f"this copy is sick ({reason}); restoring its last good state")
            node.governors.sync_accepting()
        elif not reason and state == NodeState.HEALING:
            node.set_state(NodeState.ONLINE, "")
            node.governors.sync_accepting()

    def close(self) -> None:
        pass
