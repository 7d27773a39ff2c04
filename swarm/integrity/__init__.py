"""The run's immune system: what one peer's message can do to a copy, and how a sick copy heals.

Decisions are pure functions over plain numbers (a clip bound, sick or not, ban or not), unit-tested
without a network; the stage, the RPC servicer and the peer call them.

Map:
    mixing.py      bounded influence through averaging: reject, clip or skip one peer's copy or edge
                   message (centered clipping around the accepted distances, a step cap, a budget per
                   window, fair share of pulls)
(more parts land here)
"""
