"""`python -m benchmarks.scale --json`: a large run's throughput against the optimum, with and without
live rebalancing (benchmarks/scale_sim.py drives swarm.dht.membership.least_served_swarm and
swarm.rebalance as the node does), at 1,000 and 10,000 volunteers, with churn and uneven peers.

Each cell prints the mean and worst (after warm-up) of throughput / best split of the same peers, and
moves per peer-hour. Headline figures, each a ratio measured in this run:
- ``rebalancing_vs_optimal``: the worst cell with rebalancing (goal >= 0.95);
- ``placement_only_vs_optimal``: the worst cell where peers stay where they joined (the baseline);
- ``dht_cpu_per_peer_64_vs_8``: the DHT's CPU per peer and heartbeat at 64 peers over 8 (goal <= 1.5), from
  two cells of benchmarks/dht_scale.py (real hivemind DHT nodes, the node's own store and read schedule);
  ``--no-dht`` or ``--quick`` skip them (null). ``python -m benchmarks.dht_scale`` measures 4 to 64.
- ``swarm_read_bytes``: the bytes of one swarm's DHT value (what a `get` of it returns) at 64, 256 and
  1,024 peers per swarm: real signed records (hivemind's RSASignatureValidator over a full MemberRecord,
  msgpack as stored), one key's entry size times N distinct subkeys in a real DictionaryDHTValue;
  ``peers_per_swarm_at_unary_cap``: where that value reaches hivemind's 4 MiB unary message cap (a get
  of a larger swarm fails).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from benchmarks.scale_sim import SimConfig, Simulation
from swarm.rebalance import RebalancePolicy


UNARY_CAP_BYTES = 4 * 2**20  # hivemind's unary messages (a DHT get's reply is one): ../shared/HIVEMIND_NOTES.md


def record_sizes(sizes: tuple[int, ...] = (64, 256, 1024)) -> dict:
    """The serialized size of one swarm's DHT value with N signed membership records (see the module doc)."""
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils.serializer import MSGPackSerializer

    from swarm.dht.records import MemberRecord, swarm_key

    validator = RSASignatureValidator()
    now = time.time()
    record = MemberRecord(peer_id="12D3KooW" + "x" * 44, state="online", version="volunteer 0.9.0 (hivemind 1.1.12)",
                          started_at=now, updated_at=now, clock=123456.5, loss=0.1234, shard=3, capacity=1234.5,
                          movable=True, mbps_in=12.5, mbps_out=11.25, staleness_mean=2.5, staleness_p95=6.0,
                          staleness_max=9, test_accuracy=0.95, test_loss=0.2, eval_samples=123456)
    key = MSGPackSerializer.dumps(swarm_key("digits-mlp-0123abcd", "layer1"))
    subkey = MSGPackSerializer.dumps(validator.local_public_key)
    signed = validator.sign_value(DHTRecord(key=key, subkey=subkey, value=MSGPackSerializer.dumps(record.to_wire()),
                                            expiration_time=now + 15))
    out = {}
    for n in sizes:
        value = DictionaryDHTValue()
        for i in range(n):  # distinct subkeys of the same length as a real owner's
            value.store(subkey[:-8] + f"{i:08d}".encode(), signed, now + 15)
        out[str(n)] = len(MSGPackSerializer.dumps(value))
    per_peer = (out[str(sizes[-1])] - out[str(sizes[0])]) / (sizes[-1] - sizes[0])
    return {"swarm_read_bytes": out, "bytes_per_record": round(per_peer, 1),
            "subkey_bytes": len(subkey), "signed_value_bytes": len(signed),
            "peers_per_swarm_at_unary_cap": int(UNARY_CAP_BYTES / per_peer)}


def dht_cells() -> dict:
    """benchmarks/dht_scale.py at 8 and 64 peers (each cell a child process, in its own network namespace
    when it can have one)."""
    from benchmarks.common import ratio
    from benchmarks.dht_scale import _cell_in_child, _parser as dht_parser

    settings = dht_parser().parse_args([])
    cells = {n: _cell_in_child(n, settings) for n in (8, 64)}
    bytes_ratio = None
    if cells[8]["kbytes_per_peer_heartbeat"] is not None and cells[64]["kbytes_per_peer_heartbeat"] is not None:
        bytes_ratio = ratio(cells[64]["kbytes_per_peer_heartbeat"], cells[8]["kbytes_per_peer_heartbeat"])
    return {"dht_cpu_per_peer_64_vs_8": ratio(cells[64]["cpu_ms_per_peer_heartbeat"], cells[8]["cpu_ms_per_peer_heartbeat"]),
            "dht_bytes_per_peer_64_vs_8": bytes_ratio, "cells": list(cells.values())}


def cells(quick: bool) -> list[dict]:
    sizes = (1000,) if quick else (1000, 10000)
    churns = (0.0, 0.02) if quick else (0.0, 0.005, 0.02)
    return [dict(peers=n, churn=c, rebalance=r) for n in sizes for c in churns for r in (False, True)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="1,000 peers, 40 periods (about 10 s)")
    parser.add_argument("--swarms", type=int, default=8)
    parser.add_argument("--periods", type=int, default=None, help="rebalance periods per cell (default 120, quick 40)")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal spread of peer capacities")
    parser.add_argument("--hysteresis", type=float, default=RebalancePolicy().hysteresis)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-dht", action="store_true", help="skip the DHT cells (8 and 64 peers, about 3.5 min)")
    args = parser.parse_args(argv)
    periods = args.periods or (40 if args.quick else 120)
    started, load_before = time.monotonic(), os.getloadavg()[0]
    rows = []
    for cell in cells(args.quick):
        config = SimConfig(swarms=args.swarms, periods=periods, warmup=min(20, periods // 4), sigma=args.sigma,
                           policy=RebalancePolicy(hysteresis=args.hysteresis), seed=args.seed, **cell)
        t0 = time.monotonic()
        result = Simulation(config).run()
        rows.append({**cell, **result.to_json(), "seconds": round(time.monotonic() - t0, 1)})
        if not args.json:
            print(json.dumps(rows[-1]), file=sys.stderr)
    dht = dht_cells() if not (args.quick or args.no_dht) else None
    moved = [row for row in rows if row["rebalance"]]
    kept = [row for row in rows if not row["rebalance"]]
    report = {
        "benchmark": "scale",
        "swarms": args.swarms, "periods": periods, "sigma": args.sigma, "hysteresis": args.hysteresis,
        "rebalancing_vs_optimal": min(row["throughput_vs_best"] for row in moved),
        "placement_only_vs_optimal": min(row["throughput_vs_best"] for row in kept),
        "dht_cpu_per_peer_64_vs_8": None if dht is None else dht["dht_cpu_per_peer_64_vs_8"],
        "dht_bytes_per_peer_64_vs_8": None if dht is None else dht["dht_bytes_per_peer_64_vs_8"],
        "dht_cells": None if dht is None else dht["cells"],
        **record_sizes(),
        "cells": rows,
        "seconds": round(time.monotonic() - started, 1),
        "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
