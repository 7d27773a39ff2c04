"""The DHT side: a hivemind DHT node with this run's validators, membership records, peer addresses.

Map:
- dht.py            starting a hivemind DHT with this run's validators; key names
- nodedht.py        a volunteer's DHT node inside its own process
- lightdht.py       a torch-free DHT reader for one-shot commands (`volunteer status`)
- validators.py     the DHT's record validators, with their verdicts remembered
- records.py        signed, schema-validated membership records: wire format and tolerant parsing
- membership.py     announcing our record on a heartbeat, reading a swarm's records, other runs of our
                    name, why a run trains nothing (a layer with no online peer)
- alarms.py         run-level alarms from every swarm's records: a stage that refuses every driver, stalled drivers
- completion.py     when a run is complete (its target reached or its sample budget spent), from the records
- published.py      what readers take of the figures records claim: the median of the drivers' current ones
- maddrs.py         peer addresses checked by hand before anything loads (/ip4/HOST/tcp/PORT/p2p/PEER_ID)
- reachability.py   can strangers dial this node? a dial-back check and the verdict a node behind NAT acts on
- hivemind_fixes.py a fix to hivemind 1.1.12: unary calls that time out must not kill the P2P read loop
"""
