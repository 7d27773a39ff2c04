"""The run's immune system: what one peer's message can do to a copy, and how a sick copy heals.

Decisions are pure functions over plain numbers (a clip bound, sick or not, ban or not), unit-tested
without a network; the stage, the RPC servicer and the peer call them.

Map:
- health.py      sick or healthy: the signals, the verdict, and SickCopy (nothing non-finite leaves a stage)
- heal.py        self-healing: the last good snapshot, the health check every few steps, the restore
- clip.py        how large one update may be: centered clipping around the accepted ones, a history-free ceiling
- guard.py       the guarded step: never commit non-finite state; bound each tensor's move
- requesters.py  fair share, in-flight cap, strikes and bans per driver (pure decisions + RequesterBook)
- receipts.py    signed hop receipts: every tensor a stage applies names the peer that computed it
- spot.py        spot validation by replication: agree, far, the odd one out, the verdict on a stage-0 output
- weights.py     committed weights: the digest of each version a stage computes with, the ring of recent versions
- recompute.py   a referee's recomputation of one hop from committed weights, and whether a claim reproduces
- audit.py       update audits: does a copy's step descend the loss of the micro-batch it came from (a lone copy
                 trained to harm), and the weights digest each peer's receipts named per version
- evaluations.py evaluations validated by replication over peers of the last stage, each figure signed
- labels.py      targets by sample id, shard checks, the view of the run's drivers
- mixing.py      bounded influence through averaging: reject, clip or skip one peer's copy or edge message
                 (centered clipping around the accepted distances, a step cap, a budget per window)
"""
