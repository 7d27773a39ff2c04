"""Decentralized optimizers for heterogeneous data (ECL-ISVR, Niwa et al., ICML 2021) and their
deterministic simulation. One node = one peer; a node is a plain object over flat tensors that takes
its neighbours' messages and returns the messages to send, so the same classes run in the simulation
and, later, inside a real swarm. docs/ECL.md has the math, the choices and the convergence study.

Map:
- graph.py      peer graphs from sorted peer ids (ring, double ring, seeded random connected), edge
                signs A_ij = -A_ji, per-edge exchange offsets (every K steps at a hashed offset)
- updates.py    node state and updates: EclNode (PDMM-ISVR theta=1, ADMM-ISVR theta=1/2), DsgdNode,
                mixing weights, eta helpers (common_eta; reference_eta, the authors' per-node one)
- gossip.py     baselines as pure functions plus nodes: Dpwa interpolation (constant, clock) and
                best-model exchange (best peer by loss EMA, adoption margin)
- pairing.py    how an edge exchange is paired: the smaller id starts a swap at its offset, the answer is
                made before the request is applied, edge generations drop replies of a rebuilt edge
- live_sim.py   the orderings a swarm peer runs (one-way pushes, the swap), with per-node step counters
                (out of phase) and lag, for the comparison with the reference in docs/ECL.md
- simulate.py   single-process, seeded harness: N nodes, local steps, edge exchanges at offsets,
                random node speeds, peers leaving (graph rebuilt), per-epoch evaluation
- models.py     tiny classifiers over one flat parameter vector (softmax regression, MLP)
- quadratic.py  quadratic consensus problems with a known optimum, for tests and the eta measurement
- study.py      the digits convergence study: data and shards, every method at the same budget, tuning
                on a validation split; run by benchmarks/convergence_ecl.py
"""
