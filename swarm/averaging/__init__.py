"""Keeping a layer swarm's copies together: pair-wise averaging, best-model exchange, newcomer sync.

Files:
    rules.py       pure decisions: interpolation factor (constant / clock / loss, divergence rule),
                   flow-control peer scores, bans, donor order for newcomers, best-model candidates and winner,
                   who is in an edge mode's graph
    checks.py      checks on received parameters and optimizer state (names, shapes, dtypes, finite, norm)
    influence.py   ``InfluenceGuard``: swarm/integrity/mixing.py's bounds on one copy or edge message, on tensors
    params_rpc.py  the parameter service (streaming RPC) and ``fetch_params``, its plain client
    validation.py  scoring copies of one layer on the run's validation split, within a pulled context
    agent.py       ``SwarmAveraging``: Dpwa pulls and best-model exchange (scored here), beside training
    exchange.py    best-model exchange's scoring: the context it pulls, the copies scored on the validation split
    sync.py        a newcomer's download of its layer before it goes online
    allreduce.py   ``mode: allreduce``: synchronous group averaging in rounds, all or nothing
    edges.py       ``mode: dsgd | pdmm_isvr | admm_isvr``: swarm/ecl's nodes as the stage's update, over a
                   graph of the swarm's online peers
    edge_rpc.py    the edge-swap service and ``swap_edge_messages``, its client
    edge_checks.py what an edge message must pass before it is applied: its norm, then the influence bounds
    edge_notices.py what the edge modes tell the user: their counters, the periodic notice, the lag warning

Importing this package imports nothing (its modules pull in hivemind). The optimizer state as named tensors, which
the parameter service sends, is swarm/run/optim_state.py: the stage captures it without importing averaging.
"""
