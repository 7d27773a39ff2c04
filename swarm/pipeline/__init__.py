"""Micro-batches through the swarms: stage servers, the layer0 driver, and the wire between them.

Map:
- stage.py       one peer's copy of one stage: forward, backward with the (clipped, guarded) update
- stage_stats.py what a stage counts and hands out: StageStats, StepInfo, UpdateReport, WorkerState
- activations.py saved forward graphs, bounded, an equal share per driver
- staleness.py   staleness of updates (window: mean, p95, max) and the staleness-aware step size
- stage_rpc.py   the stage RPCs' server; stage_gate.py: who may ask, fair share, bans
- stage_client.py  the client: the RPCs' signatures (StageRPC, the stub's source), one call, StageError
- sessions.py    stage calls on one long-lived stream per peer: call ids, replies in any order, failures per call
- stage_receipts.py the stage's side of receipts: what a request's receipts vouch for, whom a wrong tensor blames
- keybook.py     whose receipt key is whose: the keys of the peers whose receipts we check
- spot_checks.py the driver's spot checks: a share of forward and gradient hops recomputed at a second peer of the swarm
- referee.py     the driver's referee: a disputed or sampled hop recomputed from the weights its signer committed to
- weights_rpc.py the ``weights`` op: a signer shows the weights of a digest it signed, within a door's rate
- stage0_checks.py stage 1's spot checks of the stage-0 outputs it is sent: recomputed by other layer0 peers
- stage0_replicas.py stage 0's infer [ids] for those checks: who may ask and how much (pure), the ids on the wire
- stage0_rpc.py  the servicer's part in them (a mixin of stage_rpc's StageServicer)
- wire.py        tensors on the wire: (de)serialization in the run's codec, streaming, checks on arrival
- codecs.py      boundary codecs (int8 blockwise, lowrank int8 factors): framing and hostile-payload checks
- traffic.py     bytes on the wire per link, and the rates they make
- driver.py      the layer0 pipeline driver: lanes of micro-batches (sample ids, never targets)
- depth.py       how many micro-batches a driver keeps in flight (pure)
- hops.py        one hop of the driver: timed out, hedged, retried, refusal codes, blocked_reason
- routing.py     which peer gets a hop, bans and holds, timeouts and hedge delays from measured times
- replies.py     checks on a stage's reply (count, dtype, shape, finite, magnitude, metadata)
- peer.py        a peer's training runtime: its stage served over RPC, and on layer0 the driver
- peer_eval.py   layer0's evaluations of the pipeline: when they run, their stamp, the last one at a finish
- peer_metrics.py what a peer reports to its node each heartbeat (PeerMetrics, collect_metrics)
- peer_views.py  what a peer remembers of the records between reads: the shards other drivers held
"""
