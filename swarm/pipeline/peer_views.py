"""What a peer remembers of the swarms' records between heartbeats: the shards other drivers held (HeldShards).

SwarmPeer.update_views notes each read of layer0; its driver covers only the shards none of the last reads
showed held (swarm/pipeline/control/driver.py ``cover_shards``).
"""

from __future__ import annotations

from collections import deque

from swarm.dht.records import MemberRecord

# A driver covers a shard only when none of its last this-many reads of layer0 showed a holder: a stage
# closes a shard that either of its last two reads shows held (integrity/labels.py), and under load a
# holder's record misses a read now and then. Covering on one read made 32 volunteers on 2 cores strike
# and ban their honest drivers at layer3 (benchmarks/README.md, benchmarks.soak).
HELD_MEMORY_VIEWS = 3


class HeldShards:
    """The data shards other online drivers held in the last ``HELD_MEMORY_VIEWS`` reads of layer0. A driver
    covers a shard only when none of them showed a holder: under load a holder's record misses a read now
    and then, and the stages refuse micro-batches of a shard someone else holds (``wrong_shard``). A view
    that is not a new read (layer0 is not read every heartbeat) counts once, not once per heartbeat."""

    def __init__(self) -> None:
        self._views: deque[set[int]] = deque(maxlen=HELD_MEMORY_VIEWS)

    def note(self, layer0: list[MemberRecord], me: str, fresh: bool = True) -> None:
        if fresh or not self._views:
            self._views.append({r.shard for r in layer0 if r.state == "online" and r.peer_id != me and r.shard >= 0})

    def unheld(self, shards: int) -> list[int]:
        held = set().union(*self._views)
        return [i for i in range(shards) if i not in held]
