"""What a p2pd daemon costs at its start (issue 42: every volunteer, bootstrap peer, export and test reader starts
one; the suite starts ~300).

    python -m benchmarks.p2pd_start --json [--daemons 5] [--settle-s 5] [--quick]

Starts hivemind's p2pd one at a time with the flags a volunteer's DHT node gives it (hivemind ``P2P.create`` on
127.0.0.1, relay on, auto-relay off: ``swarm/dht/dht.py node_kwargs``), and reads the daemon's CPU seconds
(``/proc/PID/stat``) when ``P2P.create`` returns (``ready_cpu_s``) and ``--settle-s`` later, idle all along
(``settled_cpu_s``): what it spends before it has carried one message. Baseline in the same run: the CPU of
``python -c "import hivemind, torch"`` (the floor of any of our commands), run back to back with each daemon;
``p2pd_vs_import`` is the median of the per-round ratios. Also the daemon's RSS once settled.

Measured in session 29 (2-vCPU Intel Xeon): 0.54-0.87 s of CPU in the daemon's first 5 s, most of it in its first
second, with ~62 MB of Go heap touched (a quarter of its samples clear fresh pages), whatever hivemind's flags
(NAT port mapping, AutoNAT, TLS, relay, the libp2p DHT's mode, or no libp2p DHT at all) or Go's (GOGC, GOMAXPROCS) say.
Where it goes (session 31, 2-vCPU AMD EPYC: 0.30-0.39 s, all of it by 0.5 s after ``P2P.create`` returns, none later):
hivemind's binary is packed with UPX, so each start first decompresses 25 MB of code into private memory (a copy
unpacked from a running daemon's memory: 0.02 s of CPU at ready instead of 0.11, 0.22-0.25 s settled instead of
0.30-0.35); then the circuit relay v2 service's background goroutine (go-libp2p 0.32.1) builds go-libp2p-asn-util
0.3.0's IPv6-to-ASN table: its embedded list of networks parsed (``net.ParseCIDR``) and inserted into a go-cidranger
trie, 72 % of the unpacked daemon's perf samples, and the collector after it 19 % (Go's own function table maps the
addresses). Neither hivemind's ``use_relay=False`` nor p2pd's ``-relayService=0`` spares it (4 rounds each: the same
CPU). go-libp2p dropped that table's construction in December 2023 (its pull request 2673, asn-util 0.4: a lookup in
the binary's read-only data): it takes a p2pd built from a newer go-libp2p, which is hivemind's to ship.
"""

from __future__ import annotations

import asyncio
import resource
import subprocess
import sys
import time
from typing import Any

from benchmarks.common import finish, machine_notes, median, parser, ratio, say
from benchmarks.procstats import process_cpu_seconds, process_rss_mib


def _import_cpu_s() -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", "import hivemind, torch"], check=True, timeout=120,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


async def _one_daemon(settle_s: float) -> dict[str, float]:
    from hivemind.p2p import P2P

    started = time.perf_counter()
    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_relay=True, use_auto_relay=False)
    try:
        wall = time.perf_counter() - started
        pid = p2p._child.pid  # hivemind keeps the daemon's Popen there
        ready = process_cpu_seconds(pid)
        await asyncio.sleep(settle_s)
        return {"start_wall_s": wall, "ready_cpu_s": ready, "settled_cpu_s": process_cpu_seconds(pid),
                "rss_mib": process_rss_mib(pid)}
    finally:
        await p2p.shutdown()


def measure(daemons: int, settle_s: float) -> dict[str, Any]:
    rounds = []
    for i in range(daemons):
        imported = _import_cpu_s()
        daemon = asyncio.run(_one_daemon(settle_s))
        rounds.append({**daemon, "import_cpu_s": imported})
        say(f"daemon {i + 1}/{daemons}: {daemon['ready_cpu_s']:.2f} s of CPU at ready, {daemon['settled_cpu_s']:.2f} "
            f"after {settle_s:.0f} s idle, {daemon['rss_mib']:.0f} MiB; `import hivemind, torch` {imported:.2f} s")
    return {
        **{key: median([r[key] for r in rounds]) for key in rounds[0]},
        "p2pd_vs_import": median([ratio(r["settled_cpu_s"], r["import_cpu_s"]) for r in rounds]),
        "rounds": rounds,
        "settle_s": settle_s,
    }


def main(argv: list[str] | None = None) -> int:
    args_parser = parser("p2pd_start", __doc__.split("\n\n")[0], "one daemon, 1 s idle: a smoke test")
    args_parser.add_argument("--daemons", type=int, default=5, help="daemons started one after another")
    args_parser.add_argument("--settle-s", type=float, default=5.0, help="idle seconds after the daemon is ready")
    args = args_parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.daemons, args.settle_s = 1, 1.0
    started = time.monotonic()
    try:
        report = {**measure(args.daemons, args.settle_s), "machine": machine_notes()}
    except KeyboardInterrupt:  # the daemon of the round is shut down on the way out (``_one_daemon``'s finally)
        say("interrupted: no daemon left running")
        return 130
    return finish(report, "p2pd_start", started, args)


if __name__ == "__main__":
    sys.exit(main())
