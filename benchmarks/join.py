"""How long a volunteer takes to join, how fast a swarm's records are read, and where `volunteer status` spends its time.

    python -m benchmarks.join --json [--runs 5] [--peers 16] [--reads 40] [--quick] [--load 14]

prints one JSON object (progress goes to stderr). Every figure comes with a baseline measured in
the same run, because absolute times on a shared 2-core machine drift:

- ``join_s``: from starting `volunteer join --headless --log-format json` (a returning volunteer: its
  identity file exists; each join is the first peer of a fresh run, so it never waits on others) to
  its record being visible to another peer (a reader polling ``Membership.read``). Split with the
  joiner's own event times into ``import`` (spawn -> "starting the DHT": interpreter, CLI, hivemind
  and torch imports, identity lock), ``dht_start`` (-> "joined the DHT") and ``first_announce``
  (-> visible), the last one also as ``to_online`` (-> "online in") + ``online_to_visible``. One more
  join runs instrumented (the real CLI with timing wrappers around its steps: ``join.probe_phases_s``).
  Baselines, run back to back with each join: ``python -c "import hivemind, torch"`` (the floor of
  any command) and a bare ``hivemind.DHT`` process that starts, stores one value and is seen by the
  same reader; ``join_vs_*`` are medians of the per-round ratios.
- ``--load N``: N busy-loop processes at the join's own priority (a busy laptop, or the many processes of a test
  run) spin through the joins and their baselines; ``loaded.loadavg_1m`` says the load they made. A volunteer that
  keeps its default low priority would yield to them: the benchmark (like the tests) sets
  ``VOLUNTEER_LOW_PRIORITY=0``, so this is the case of a machine busy with work of equal standing.
- ``get_swarm_ms``: ``Membership.read`` latency of a swarm with ``--peers`` announcing peers
  (in-process DHTs, one identity each) over that of a swarm with 1 peer, in the same DHT, split into
  the DHT get and the parsing of the records; ``read_all`` reads every swarm of the run at once.
- ``status_s``: wall time of `volunteer status --json` against that DHT, and instrumented runs of the
  same command that say where the time goes (``status.phases_s``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    BenchmarkError,
    finish,
    load_run_config,
    machine_notes,
    median,
    parser as common_parser,
    percentile,
    ratio,
    say,
    wait_until,
    write_run,
)
from benchmarks.fleet import LOOPBACK, Fleet, new_identity
from benchmarks.join_children import (
    BARE_FLAG,
    JOIN_STEPS,
    PROBE_FLAG,
    STATUS_STEPS,
    bare_child,
    phases as step_phases,
    probe,
)

JOIN_SWARM = "layer1"
GET_SWARM_MANY = "layer2"  # every announcing peer is here
GET_SWARM_ONE = "layer3"  # only the first announcing peer is here: the 1-record baseline
RECORD_HEARTBEAT_S = 60.0  # records outlive the whole benchmark without re-announcing
JOIN_TIMEOUT_S = 180.0
VISIBLE_POLL_S = 0.005
STDOUT_POLL_S = 0.01
EVENT_MARKERS = {"starting": "starting the DHT", "joined": "joined the DHT as", "online": "online in "}



def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [PROBE_FLAG]:
        return probe(argv[1], Path(argv[2]), argv[3:])
    if argv[:1] == [BARE_FLAG]:
        return bare_child(argv[1], argv[2])
    args = _parser().parse_args(argv)
    if args.quick:
        args.runs, args.peers, args.reads, args.status_runs, args.warmup = 1, 2, 5, 1, False
    started = time.monotonic()
    with Fleet(prefix="volunteer-bench-join-") as fleet, Burners(args.load) as burners:
        report = _benchmark(fleet, args, burners)
    return finish(report, "join", started, args)


class Burners:
    """``count`` processes that spin on a CPU each until the context ends (killed, never left behind)."""

    def __init__(self, count: int):
        self.count = count
        self.procs: list[subprocess.Popen] = []
        self.loads: list[float] = []

    def __enter__(self) -> Burners:
        for _ in range(self.count):
            # each in a session of its own, as the volunteers are: with the kernel's autogroup scheduling (on by
            # default on desktops) processes of one session share one slice, and 14 burners in ours made a load of
            # 15 that slowed `import torch` 10x and the join (its own session) not at all
            self.procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True,
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        if self.count:
            say(f"{self.count} busy-loop processes started; letting the load settle for 20 s")
            time.sleep(20.0)
        return self

    def sample(self) -> None:
        if self.count and hasattr(os, "getloadavg"):
            self.loads.append(os.getloadavg()[0])

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait(timeout=10)


def _parser() -> argparse.ArgumentParser:
    parser = common_parser("join", __doc__)
    parser.add_argument("--runs", type=int, default=5, help="joins (and baselines) to take the median of")
    parser.add_argument("--peers", type=int, default=16, help="announcing peers in the many-records swarm")
    parser.add_argument("--reads", type=int, default=40, help="reads of each swarm for the get latency")
    parser.add_argument("--status-runs", type=int, default=3, help="`volunteer status` runs (plain and instrumented)")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="skip the discarded first round (it warms the page cache)")
    parser.add_argument("--load", type=int, default=0,
                        help="busy-loop processes spinning through the joins (14 on 2 cores: a load of ~15)")
    parser.add_argument("--quick", action="store_true",
                        help="1 instrumented join, 2 peers, 5 reads, 1 instrumented status: a smoke test")
    return parser


def _benchmark(fleet: Fleet, args: argparse.Namespace, burners: Burners) -> dict[str, Any]:
    from hivemind.dht.crypto import RSASignatureValidator

    say(f"starting a bootstrap peer (work dir {fleet.workdir})")
    _, maddr = fleet.bootstrap()
    reader = fleet.dht([maddr], [RSASignatureValidator()], client_mode=True)  # reads every run's records

    joins, bares, imports = [], [], []
    for i in range(args.runs + (1 if args.warmup else 0)):
        label = "warm-up" if args.warmup and i == 0 else f"run {i + (0 if args.warmup else 1)}/{args.runs}"
        imports_i = _time_import()
        bare_i = _bare_join(fleet, reader, maddr, f"bare{i}")
        join_i = _join_once(fleet, maddr, reader, f"join{i}", probe=args.quick)
        burners.sample()
        say(f"{label}: join {join_i['total_s']:.2f} s, bare DHT {bare_i['total_s']:.2f} s, import {imports_i:.2f} s")
        if not (args.warmup and i == 0):
            joins.append(join_i)
            bares.append(bare_i)
            imports.append(imports_i)
    probed = joins[-1] if args.quick else _join_once(fleet, maddr, reader, "joinprobe", probe=True)

    run_path = write_run(fleet.workdir / "getbench.yaml",
                         # identity work sized for many synthetic peers (the reader still checks each record's)
                         {"name": "getbench", "timeouts": {"heartbeat_s": RECORD_HEARTBEAT_S},
                          "integrity": {"identity_bits": 2}})
    get_report = _get_latency(fleet, load_run_config(run_path), maddr, reader, args.peers, args.reads)
    status_report = _status(fleet, run_path, maddr, args.status_runs, plain_too=not args.quick)

    join_total, import_s = median([j["total_s"] for j in joins]), median(imports)
    # ratios per round (a join and its baselines ran back to back), then the median: robust to drift
    return {
        "join_s": join_total,
        "join_vs_bare_dht": median([ratio(j["total_s"], b["total_s"]) for j, b in zip(joins, bares)]),
        "join_vs_import": median([ratio(j["total_s"], t) for j, t in zip(joins, imports)]),
        "join": {
            "runs": len(joins),
            **{key: median([j[key] for j in joins]) for key in ("total_s", "import_s", "dht_start_s",
                                                                "first_announce_s", "to_online_s",
                                                                "online_to_visible_s", "leave_s")},
            "all_total_s": [j["total_s"] for j in joins],
            "probe_phases_s": probed["phases"],
            "probe_phase_shares": {k: ratio(v, probed["phases"]["total"]) for k, v in probed["phases"].items()
                                   if k != "total"},
            "probe_timeline": probed["timeline"],
        },
        "baseline_bare_dht": {key: median([b[key] for b in bares]) for key in bares[0]},
        "baseline_import_hivemind_torch_s": import_s,
        **get_report,
        **status_report,
        "status_vs_import": ratio(status_report["status_s"], import_s),
        "loaded": {"busy_processes": args.load, "loadavg_1m": [round(v, 1) for v in burners.loads]},
        "machine": machine_notes(),
    }


# ----- import floor


def _time_import() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import hivemind, torch"], check=True, timeout=JOIN_TIMEOUT_S,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


# ----- one join


def _join_once(fleet: Fleet, maddr: str, reader_dht: Any, name: str, probe: bool) -> dict[str, Any]:
    """Start a join as the first peer of a fresh run; time it until a reader sees its record."""
    from swarm.dht.dht import load_identity_key
    from swarm.dht.membership import Membership
    from swarm.dht.records import peer_id_from_public_key

    run_path = write_run(fleet.workdir / f"{name}.yaml", {"name": f"joinbench-{name}",
                                                           "timeouts": {"heartbeat_s": RECORD_HEARTBEAT_S}})
    reader = Membership(reader_dht, load_run_config(run_path), b"")
    identity = new_identity(fleet.workdir / f"{name}.key")
    peer_id = peer_id_from_public_key(load_identity_key(identity).get_public_key().to_bytes())
    join_args = ["join", "--run", str(run_path), "--swarm", JOIN_SWARM, "--initial-peers", maddr, "--listen", LOOPBACK,
                 "--headless", "--log-format", "json", "--identity", str(identity)]
    marks_path = fleet.workdir / f"{name}.marks.json"
    argv = ([sys.executable, "-m", "benchmarks.join", PROBE_FLAG, "join", str(marks_path)] if probe
            else [sys.executable, "-m", "volunteer_cli"]) + join_args
    proc = fleet.start(name, argv)
    spawned = proc.started_at

    def events() -> dict[str, float] | None:
        proc.check_running()
        found: dict[str, float] = {}
        for line in proc.json_lines():
            for key, marker in EVENT_MARKERS.items():
                if line.get("type") == "event" and str(line.get("text", "")).startswith(marker):
                    found.setdefault(key, float(line["time"]))
        return found if len(found) == len(EVENT_MARKERS) else None

    times = wait_until(events, JOIN_TIMEOUT_S, f"{name} to come online", interval_s=STDOUT_POLL_S)
    visible = wait_until(lambda: _visible(reader, JOIN_SWARM, peer_id), JOIN_TIMEOUT_S,
                         f"{name}'s record to be visible", interval_s=VISIBLE_POLL_S)
    timeline = [{"at_s": round(float(line["time"]) - spawned, 3), "text": str(line.get("text", ""))[:70]}
                for line in proc.json_lines() if line.get("type") == "event"]
    timeline.append({"at_s": round(visible - spawned, 3), "text": "record visible to the reader"})
    leave_s = proc.stop()
    phases = {}
    if probe:
        marks = json.loads(marks_path.read_text())
        phases = step_phases(marks, JOIN_STEPS, spawned, end=("reader_sees_record", visible))
    return {
        "total_s": visible - spawned,
        "import_s": times["starting"] - spawned,
        "dht_start_s": times["joined"] - times["starting"],
        "first_announce_s": visible - times["joined"],
        "to_online_s": times["online"] - times["joined"],
        "online_to_visible_s": visible - times["online"],
        "leave_s": leave_s,
        "timeline": timeline,
        "phases": phases,
    }


def _visible(reader: Any, swarm: str, peer_id: str) -> float | None:
    records = reader.read(swarm)
    now = time.time()
    return now if any(r.peer_id == peer_id and r.state == "online" for r in records) else None


# ----- the bare-hivemind baseline


def _bare_join(fleet: Fleet, reader_dht: Any, maddr: str, name: str) -> dict[str, float]:
    key = f"joinbench_bare_{name}"
    proc = fleet.start(name, [sys.executable, "-m", "benchmarks.join", BARE_FLAG, maddr, key], stdin_pipe=True)
    spawned = proc.started_at

    def stored() -> dict | None:
        proc.check_running()
        lines = proc.json_lines()
        return lines[0] if lines else None

    times = wait_until(stored, JOIN_TIMEOUT_S, f"{name} to store", interval_s=STDOUT_POLL_S)

    def visible() -> float | None:
        return time.time() if reader_dht.get(key, latest=True) is not None else None

    seen = wait_until(visible, JOIN_TIMEOUT_S, f"{name}'s value to be visible", interval_s=VISIBLE_POLL_S)
    proc.stop()
    return {"total_s": seen - spawned, "import_s": times["imported"] - spawned,
            "dht_start_s": times["dht_started"] - times["imported"], "store_s": times["stored"] - times["dht_started"],
            "store_to_visible_s": seen - times["stored"]}


# ----- get latency with many records


def _get_latency(fleet: Fleet, run: Any, maddr: str, reader_dht: Any, peers: int, reads: int) -> dict[str, Any]:
    from swarm.dht.dht import make_validators
    from swarm.dht.membership import Membership
    from swarm.dht.records import MemberRecord
    from swarm.integrity.identity_work import identity_work

    reader = Membership(reader_dht, run, b"")
    say(f"starting {peers} announcing peers (in-process DHTs, one identity each)")
    for k in range(peers):
        identity = new_identity(fleet.workdir / f"peer{k}.key")
        validators = make_validators(run.run_id, run.swarm_names, identity)
        dht = fleet.dht([maddr], validators, identity_path=identity)
        membership = Membership(dht, run, validators[0].local_public_key)
        membership.work = identity_work(identity, str(dht.peer_id), run.integrity.identity_bits)
        now = time.time()
        record = MemberRecord(peer_id=str(dht.peer_id), state="online", version="bench", started_at=now,
                              updated_at=now, throughput=100.0 + k, loss=1.0, clock=1000 * k, served=k)
        for swarm in (GET_SWARM_MANY, GET_SWARM_ONE) if k == 0 else (GET_SWARM_MANY,):
            if not membership.announce(swarm, record):
                raise BenchmarkError(f"peer {k} could not announce in {swarm}")
    wait_until(lambda: len(reader.read(GET_SWARM_MANY)) == peers and len(reader.read(GET_SWARM_ONE)) == 1, 60,
               f"all {peers} records to be visible", interval_s=0.2)
    say(f"reading the {peers}-record and the 1-record swarms {reads} times each")
    many, one, many_get, many_parse, one_get, everything = [], [], [], [], [], []
    for _ in range(reads):  # interleaved, so drift hits both alike
        many.append(_timed(lambda: reader.read(GET_SWARM_MANY), expect=peers))
        one.append(_timed(lambda: reader.read(GET_SWARM_ONE), expect=1))
        get_s, parse_s = _split_read(reader, GET_SWARM_MANY, peers)
        many_get.append(get_s)
        many_parse.append(parse_s)
        one_get.append(_split_read(reader, GET_SWARM_ONE, 1)[0])
        everything.append(_timed(reader.read_all))
    get_many, get_one = median(many), median(one)
    return {
        "get_swarm_ms": 1000 * get_many,
        "get_swarm_vs_get_1": ratio(get_many, get_one),
        "get_swarm_peers": peers,
        "get": {
            "reads": reads,
            "read_swarm_ms": {"median": 1000 * get_many, "p90": 1000 * percentile(many, 90)},
            "read_1_ms": {"median": 1000 * get_one, "p90": 1000 * percentile(one, 90)},
            "dht_get_swarm_ms": 1000 * median(many_get),
            "dht_get_1_ms": 1000 * median(one_get),
            "parse_swarm_ms": 1000 * median(many_parse),
            "read_all_ms": {"median": 1000 * median(everything), "p90": 1000 * percentile(everything, 90),
                            "swarms": len(run.swarm_names)},
        },
    }


def _timed(call: Any, expect: int | None = None) -> float:
    started = time.perf_counter()
    result = call()
    elapsed = time.perf_counter() - started
    if expect is not None and len(result) != expect:
        raise BenchmarkError(f"a read returned {len(result)} records, expected {expect}")
    return elapsed


def _split_read(reader: Any, swarm: str, expect: int) -> tuple[float, float]:
    """``Membership.read`` in its two steps: the DHT get (in the DHT process) and parsing the records."""
    from swarm.dht.membership import dht_time
    from swarm.dht.records import parse_swarm, swarm_key

    started = time.perf_counter()
    found = reader.dht.get(swarm_key(reader.run.run_id, swarm), latest=True)
    fetched = time.perf_counter()
    records = parse_swarm(found.value if found is not None else None, now=dht_time())
    parsed = time.perf_counter()
    if len(records) != expect:
        raise BenchmarkError(f"a read returned {len(records)} records, expected {expect}")
    return fetched - started, parsed - fetched


# ----- volunteer status


def _status(fleet: Fleet, run_path: Path, maddr: str, runs: int, plain_too: bool) -> dict[str, Any]:
    """Wall time of the plain command (unless ``plain_too`` is off) and of the instrumented one, by phase."""
    say(f"timing `volunteer status` {runs} time(s)" + (", plain and instrumented" if plain_too else ", instrumented"))
    args = ["status", "--run", str(run_path), "--initial-peers", maddr, "--json"]
    plain, phases = [], []
    for i in range(runs):
        if plain_too:
            started = time.perf_counter()
            subprocess.run([sys.executable, "-m", "volunteer_cli", *args], env=fleet.env, check=True, timeout=120,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            plain.append(time.perf_counter() - started)
        out = fleet.workdir / f"status-probe{i}.json"
        spawned = time.time()
        subprocess.run([sys.executable, "-m", "benchmarks.join", PROBE_FLAG, "status", str(out), *args], env=fleet.env,
                       check=True, timeout=120, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        phases.append(step_phases(json.loads(out.read_text()), STATUS_STEPS, spawned, end=("print_and_exit", time.time())))
    breakdown = {name: median([p[name] for p in phases if name in p]) for name in phases[0]}
    status_s = median(plain) if plain else breakdown["total"]
    shares = {k: ratio(v, breakdown["total"]) for k, v in breakdown.items() if k != "total"}
    return {"status_s": status_s,
            "status": {"runs": runs, "plain_s": plain, "phases_s": breakdown, "phase_shares": shares}}


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
