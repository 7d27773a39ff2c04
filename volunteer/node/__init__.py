"""The node engine: one volunteer serving one layer swarm, as a lifecycle that composes named parts.

Map:
- core.py         ``Node``: join the DHT, pick a swarm, start the stage, the serve loop that ticks the
                  parts, leave cleanly (the ``Engine`` of snapshot.py)
- options.py      ``NodeOptions`` (what to run, where, how) and ``JoinError``
- board.py        the snapshot, the event history and the listeners; every part publishes through it
- commands.py     the command queue and tickets; pause/finish/resume as pure transitions (who paused:
                  the user or the idle policy)
- governors.py    the machine comes first: idle policy, bandwidth cap, whether the stage takes work
- checkpoints.py  resume from a checkpoint, save on pause, exit and timer
- contribution.py this session's served work and time, plus earlier sessions' (persisted); the farewell
- completion.py   the run's end: finish and say "run complete" once its target or budget is reached
- announcer.py    our record on the DHT, heartbeat, reading the swarms, shard rebalancing, the view
- records.py      pure builders: our MemberRecord, the snapshot's swarm and peer rows
- runs.py         another run of our name with another config: stop with how to join it (or --new-run)

Parts hold a reference to the node and see each other only through it (``node.board``,
``node.set_state``, ``node.peer``); each is tested on its own with a fake node or as pure functions.
"""

from volunteer.node.core import Node
from volunteer.node.options import JoinError, NodeOptions

__all__ = ["JoinError", "Node", "NodeOptions"]
