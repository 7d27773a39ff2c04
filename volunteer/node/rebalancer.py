"""`--swarm auto`: reconsider our swarm once per rebalance period and move toward the bottleneck.

The decision is ``swarm.rebalance.plan_move`` on the records the announcer has read (every swarm's
peers that serve or are arriving, with their published capacities), taken at a random time in each
period so that the peers of a swarm do not all decide on the same records. A move is the node's
``move_to``: drain and leave the old swarm, download the new layer from its peers, serve it.

Loads come from ``swarm.rebalance.loads_from_records``: a peer with no published capacity yet counts
as its swarm's median, so newcomers and old clients weigh like their neighbours.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any

from volunteer.snapshot import NodeState

COOLDOWN_PERIODS = 2  # after a move, sit out this many periods: capacities measured on a busy machine
# are noisy, and the moved copy's new figure (another layer) needs a period to settle

if TYPE_CHECKING:
    from volunteer.node.core import Node


def my_rank(views: dict[str, list[Any]], my_swarm: str, me: str, epoch: int) -> int:
    """Our place in this period's mover order among our swarm's online movable peers (us included)."""
    from swarm.rebalance import mover_order

    ids = {r.peer_id for r in views.get(my_swarm, []) if r.state == "online" and r.movable} | {me}
    return mover_order(sorted(ids), epoch).index(me)


class Rebalancer:
    def __init__(self, node: Node):
        from swarm.rebalance import RebalancePolicy

        self.node = node
        period_s = node.options.rebalance_s
        self.enabled = node.options.swarm == "auto" and period_s > 0
        self.policy = RebalancePolicy(period_s=period_s if period_s > 0 else 60.0)
        self.rng = random.Random()
        self._decide_at: float | None = None  # monotonic time of this period's decision
        self._epoch = -1  # the period (wall time // period_s) decided in
        self.moves = 0
        self._settled_epoch = -1  # the first period we may move in again after a move

    @property
    def movable(self) -> bool:
        """Rebalancing may move us: `--swarm auto`, and other hosts can dial us (a node behind NAT stays
        in layer0, the one swarm that needs no inbound connection: volunteer/node/reachability.py)."""
        return self.enabled and self.node.reachability.record_value != 0

    def tick(self, now_s: float) -> None:
        node = self.node
        if not self.movable or node.peer is None or node.board.snapshot().state != NodeState.ONLINE:
            self._decide_at = None
            return
        epoch = int(time.time() // self.policy.period_s)
        if self._decide_at is None:  # a new period, or back online: decide at a random time in the next one
            from swarm.rebalance import decision_delay_s

            start = (epoch + 1) * self.policy.period_s
            self._decide_at = now_s + (start - time.time()) + decision_delay_s(self.policy, self.rng)
            return
        if now_s < self._decide_at:
            return
        self._decide_at = None
        if epoch == self._epoch:
            return
        self._epoch = epoch
        if epoch < self._settled_epoch:  # we moved lately: let the records show it before judging again
            return
        move = self.decide(epoch)
        if move is not None:
            self.moves += 1
            self._settled_epoch = epoch + 1 + COOLDOWN_PERIODS
            gain = ("nothing trains until it has a peer" if move.gain == float("inf")
                    else f"the pipeline's slowest swarm would gain x{move.gain:.2f}")
            node.move_to(move.target, f"rebalancing: {node.swarm} has capacity to spare and {move.target} is "
                                      f"short ({gain})")

    def decide(self, epoch: int) -> Any:
        from swarm.rebalance import layer_costs, loads_from_records, plan_move

        node = self.node
        capacity = node.peer.metrics().capacity if node.peer is not None else None
        if capacity is None or not node.membership:
            return None
        me = node.board.snapshot().peer_id
        loads = loads_from_records(node.announcer.views, node.run.swarm_names, me=me, my_swarm=node.swarm,
                                   my_capacity=capacity)
        cost = layer_costs(node.announcer.views, node.run.swarm_names)  # layers differ: a mover's speed there
        return plan_move(loads, node.swarm, capacity, my_rank(node.announcer.views, node.swarm, me, epoch), self.policy,
                         cost=cost)

    def close(self) -> None:
        pass
