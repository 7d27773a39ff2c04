"""The protocol and the training mechanics of a layer-per-swarm run. No UI, no process management.

Packages, lowest first (a package imports only those above it in this list, and hivemind/torch):
- run/        what is trained: the run config (the "torrent file") and run id, models, data and shards,
              the single-process reference trainer
- dht/        the DHT side: starting a node with the run's validators, signed membership records,
              heartbeats and reads, peer addresses, reachability (dial-back), fixes to hivemind
- integrity/  the run's immune system: bounds on what one message can do, health, labels by id
- pipeline/   micro-batches through the swarms: the stage and its RPCs, the driver, hops, routing, the
              wire and its codecs, staleness, the peer runtime that ties them together
- averaging/  keeping a swarm's copies together: Dpwa pulls, best-model exchange, newcomer sync,
              all-reduce, and the decentralized optimizers' edges
- ecl/        decentralized optimizers (DSGD, PDMM-ISVR, ADMM-ISVR) and their simulation harness

Modules that belong to no subsystem:
- rebalance.py   live rebalancing of `--swarm auto` volunteers toward the bottleneck swarm (pure)

Importing any package here imports nothing: each __init__ is only its map.
"""
