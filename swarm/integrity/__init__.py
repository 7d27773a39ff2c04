"""The run's immune system: what one peer's message can do to a copy, and how a sick copy heals.

Decisions are pure functions over plain numbers (a clip bound, sick or not, ban or not), unit-tested
without a network; the stage, the RPC servicer and the peer call them.

Map:
- health.py   sick or healthy: the signals, the verdict, and SickCopy (nothing non-finite leaves a stage)
- heal.py     self-healing: the last good snapshot, the health check every few steps, the restore
"""
