"""The protocol and the training mechanics of a layer-per-swarm run. No UI, no process management.

Map:
- runconfig.py   the run config schema (the "torrent file") and the run id
- records.py     signed, schema-validated membership records: wire format and tolerant parsing
- dht.py         starting a hivemind DHT with this run's validators; key names
- lightdht.py    a torch-free DHT reader for one-shot commands (`volunteer status`)
- completion.py  when a run is complete (its target reached or its sample budget spent), from the records
- membership.py  announcing our record on a heartbeat, reading a swarm's records, other runs of our
                 name, why a run trains nothing (a layer with no online peer)
- maddrs.py      peer addresses checked by hand before anything loads (/ip4/HOST/tcp/PORT/p2p/PEER_ID)
- models.py      building the stages of a model from the run config
- data.py        data sets, train/test split and shards (IID or label-skewed), rarest-first shard choice
- stage.py       one peer's copy of one stage: forward, backward with the (clipped, guarded) update
- activations.py saved forward graphs, bounded, an equal share per driver
- staleness.py   staleness of updates (window: mean, p95, max) and the staleness-aware step size
- stage_rpc.py   the stage RPCs (server and client call); stage_gate.py: who may ask, fair share, bans
- wire.py        tensors on the wire: (de)serialization in the run's codec, streaming, checks on arrival
- codecs.py      boundary codecs (int8 blockwise, lowrank int8 factors): framing and hostile-payload checks
- integrity/     bounds on what one message can do, health, labels by id (see its __init__)
- driver.py      the layer0 pipeline driver: lanes of micro-batches (sample ids, never targets)
- hops.py        one hop of the driver: timed out, hedged, retried, refusal codes, blocked_reason
- routing.py     which peer gets a hop, bans and holds, timeouts and hedge delays from measured times
- replies.py     checks on a stage's reply (count, dtype, shape, finite, magnitude, metadata)
- ecl/           decentralized optimizers (DSGD, PDMM-ISVR, ADMM-ISVR) and their simulation harness
"""
