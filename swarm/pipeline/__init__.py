"""Micro-batches through the swarms, laid out by plane (issue 41): ``transport/`` moves tensors, ``stage/`` serves
them (the data plane's server), ``control/`` is the layer0 driver that orchestrates with receipts. The modules here
wire the three into a volunteer's training runtime. Imports run transport <- stage <- control <- peer, never back
(tests/test_layers.py).

Map:
- peer.py        a peer's training runtime: its stage served over RPC, and on layer0 the driver
- peer_checks.py the stage's checks attached to its servicer: convictions, pushes, stage 1's checks of stage 0
- peer_eval.py   layer0's evaluations of the pipeline: when they run, their stamp, the last one at a finish
- peer_metrics.py what a peer reports to its node each heartbeat (PeerMetrics, collect_metrics)
- peer_views.py  what a peer remembers of the records between reads: the shards other drivers held

transport/ (imports nothing of stage/ or control/)
- wire.py        tensors on the wire: (de)serialization in the run's codec, checks on arrival
- streams.py     large messages streamed in parts and joined once; the caller closes the stream first (end marks)
- codecs.py      boundary codecs (int8 blockwise, lowrank int8 factors): framing and hostile-payload checks
- sessions.py    stage calls on one long-lived stream per peer: call ids, replies in any order, failures per call
- stage_client.py  the client: the RPCs' signatures (StageRPC, the stub's source), one call, StageError
- traffic.py     bytes on the wire per link, and the rates they make
- replies.py     checks on a stage's reply (count, dtype, shape, finite, magnitude, metadata, its receipt)
- keybook.py     whose receipt key is whose: the keys of the peers whose receipts we check

stage/ (imports transport/, never control/)
- worker.py      one peer's copy of one stage: forward, backward with the (clipped, guarded) update
- stage_stats.py what a stage counts and hands out: StageStats, StepInfo, UpdateReport, WorkerState
- stage_state.py a copy's state in and out (averaging, healing's restores)
- activations.py saved forward graphs, bounded, an equal share per driver
- staleness.py   staleness of updates (window: mean, p95, max) and the staleness-aware step size
- stage_rpc.py   the stage RPCs' server; stage_ops.py: one request dispatched on the compute thread
- stage_gate.py  who may ask, fair share, bans; fair_queue.py: requesters in turn on the compute thread
- applied.py     one update per micro-batch per copy (a resend is refused: duplicate)
- stage_receipts.py the stage's side of receipts: what a request's receipts vouch for, whom a wrong tensor blames
- push.py        micro-batches pushed to this stage and on to the next (stage to stage), the outbox, ``show``
- weights_rpc.py the ``weights`` op: a signer shows the weights of a digest it signed, within a door's rate
- convictions.py a referee's evidence against a signer, re-checked here before it bans anyone
- stage0_replicas.py stage 0's infer [ids] for stage 1's checks: who may ask and how much, the ids on the wire
- stage0_rpc.py  the servicer's part in them (a mixin of stage_rpc's StageServicer)

control/ (imports transport/ and stage/: the driver runs its own stage 0)
- driver.py      the layer0 pipeline driver: lanes of micro-batches (sample ids, never targets)
- driver_failures.py what a lane does with a refusal, a lost micro-batch or a bug; driver_eval.py: evaluations
- depth.py       how many micro-batches a driver keeps in flight (pure)
- hops.py        one relayed hop of the driver: timed out, hedged, retried, refusal codes, blocked_reason
- routing.py     which peer gets a hop, bans and holds, timeouts and hedge delays from measured times
- route_losses.py copies whose routes' losses are far worse than their swarm's other copies (held off)
- push_driver.py a micro-batch pushed down a route; push_checks.py its spot checks after the fact;
  push_recovery.py a broken push resumed by relay; push_trail.py what they share
- spot_checks.py the driver's spot checks: a share of forward and gradient hops recomputed at a second peer
  spot_referee.py their referee side: lone and newcomer hops recomputed, disputes settled, what a verdict does
- referee.py     the driver's referee: a disputed or sampled hop recomputed from the weights its signer committed to
  referee_audits.py the referee's audits of the updates it upholds, beside the lanes (integrity/audit.py)
- stage0_checks.py stage 1's spot checks of the stage-0 outputs it is sent (recomputed by other layer0 peers);
  stage0_referee.py the same settled by recomputing the driver's committed stage 0
"""
