"""The run's end: once the run is complete (swarm/dht/completion.py: its target reached or its sample budget
spent), this node pauses (in-flight backward passes still complete) and says why, instead of training
forever. Not a finish: layer0's final evaluation at a finish needs the other swarms, and they pause too.

Every heartbeat's records are checked. A complete run is final for this node: an online node (a resume,
the idle policy's, or a newcomer's first tick) pauses again at once, and a paused one carries the
reason "run complete: ..." in its snapshot and record, which the dashboard's banner, the headless log and
`volunteer ctl status` show. The process keeps running (a service would only restart it); `q` leaves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from volunteer.node.commands import PAUSED_BY_USER, Transition
from volunteer.snapshot import RUN_COMPLETE_PREFIX as COMPLETE_PREFIX
from volunteer.snapshot import NodeState

if TYPE_CHECKING:
    from volunteer.node.core import Node


def completion_step(state: NodeState, reason: str, why_complete: str) -> Transition | None:
    """What a complete run asks of a node in this state (None: nothing, or not complete)."""
    if not why_complete:
        return None
    if state == NodeState.ONLINE:
        # A pause, not a finish: a finish's last evaluation would need the other swarms, which pause too.
        return Transition(NodeState.PAUSED, f"{COMPLETE_PREFIX}{why_complete}", PAUSED_BY_USER, save_checkpoint=True,
                          event=f"{COMPLETE_PREFIX}{why_complete}. This node takes no more work; in-flight backward "
                                "passes still complete (`volunteer export` saves the model; q leaves)", kind="complete")
    if state == NodeState.PAUSED and not reason.startswith(COMPLETE_PREFIX):
        return Transition(NodeState.PAUSED, f"{COMPLETE_PREFIX}{why_complete}", PAUSED_BY_USER)
    return None


class Completion:
    def __init__(self, node: Node):
        self.node = node
        self.why = ""  # why the run is complete; "" while it is not

    def tick(self, now_s: float) -> None:
        from swarm.dht.completion import run_complete

        node = self.node
        if node.peer is None or not node.announcer.views:
            return
        self.why = self.why or run_complete(node.run.training, node.announcer.views)
        snap = node.board.snapshot()
        transition = completion_step(snap.state, snap.reason, self.why)
        if transition is not None:
            node.commands.enact(transition)

    def close(self) -> None:
        pass
