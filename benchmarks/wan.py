"""Pipeline throughput over slow and far links (issue 12, item 3): runs x link profiles in the network lab.

    python -m benchmarks.wan --json [--runs digits,charlm,heavy] [--profiles loopback,100mbit_50ms,20mbit_100ms]
                             [--codecs float32,int8,lowrank] [--wire-rank 47] [--in-flight auto] [--lock /tmp/volunteer-cpu.lock] [--quick]

Each cell is a fresh swarm: a bootstrap peer and one `volunteer join` per stage (the drivers are the
layer0 peers). Profile `loopback` runs them all on 127.0.0.1 as every other benchmark does (the
baseline); the other profiles put each on a host of its own in the network lab (benchmarks/netlab.py):
every host's link has the profile's rate each way (tbf) and a delay that makes the round trip between
two hosts the profile's RTT (the lab's relay, which every peer announces). Throughput is read from the
drivers' records after a warm-up (benchmarks/pipeline.py `_measure`).

Per cell: ``samples_per_s``; ``vs_loopback`` (over the same run's loopback cell); ``bytes_per_sample``:
the busiest host's bytes on its link per trained sample (the larger of up and down, counted on its
veth: activations, gradients, libp2p framing, DHT and averaging traffic); ``bound_samples_per_s``:
the link's rate over that; ``vs_bound``: samples/s over the bound (1.0 = the link is the limit). Flat
keys: ``<run>_<profile>_vs_loopback`` and ``<run>_<profile>_vs_bound``.

``--codecs``: the boundary codecs to cross with (``training.wire_codec``; default: each run's own). A cell
of codec C is keyed ``<run>_<profile>@C`` and compared with its run's loopback cell of the same codec;
``<run>_<profile>_bytes_ratio@C`` is its busiest link's bytes per sample over float32's in the same run
and profile, and ``best_codec_bytes_ratio`` the smallest of those (``best_codec``: which).

Runs: ``digits`` (configs/runs/digits-mlp.yaml), ``charlm`` (configs/runs/charlm.yaml), ``heavy``
(benchmarks/pipeline.py's heavy run: 4 stages of 2048-wide layers, batch 256); every run without
periodic evaluation (it would cost the driver CPU the loopback cell pays too, but in bursts).
With ``--lock FILE`` each cell holds an exclusive flock on FILE (the shared machine's CPU lock).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import (BenchmarkError, finish, load_run_config, machine_notes, parser, ratio, say,
                               wait_until, write_run)
from benchmarks.fleet import Fleet, Proc
from benchmarks.netlab import Host, Lab, Link
from benchmarks.pipeline import (START_TIMEOUT_S, Settings, _heavy_run, _measure, _sleep, _stop_in_order,
                                 _wait_training)

PROFILES: dict[str, Link | None] = {
    "loopback": None,
    "100mbit_50ms": Link.for_rtt(100.0, 50.0),
    "20mbit_100ms": Link.for_rtt(20.0, 100.0),
}
RUNS = ("digits", "charlm", "heavy")
CODECS = ("float32", "float16", "int8", "lowrank")  # training.wire_codec
SHIPPED = {"digits": "digits-mlp", "charlm": "charlm"}  # configs/runs/<name>.yaml
LAB_PORT = 31337  # every host is a namespace of its own: the same port everywhere
LOCK_TIMEOUT_S = 1800.0


@dataclass(slots=True, kw_only=True)
class Cell:
    warmup_s: float = 15.0
    window_s: float = 25.0
    heartbeat_s: float = 2.0  # records live 3 heartbeats: 1 s ones expired behind a saturated 20 Mbit/s link
    in_flight: int | str | None = None  # training.in_flight for every run (None: the run's own)
    codec: str | None = None  # training.wire_codec for every run (None: the run's own)
    wire_rank: int | None = None  # training.wire_rank (lowrank) for every run (None: the run's own)


QUICK = Cell(warmup_s=3.0, window_s=5.0)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cell = QUICK if args.quick else Cell()
    cell.wire_rank = args.wire_rank
    if args.in_flight:
        cell.in_flight = args.in_flight if args.in_flight == "auto" else int(args.in_flight)
    runs, profiles = args.runs.split(","), args.profiles.split(",")
    codecs: list[str | None] = [c for c in args.codecs.split(",") if c] or [None]
    for codec in codecs:
        if codec is not None and codec not in CODECS:
            raise SystemExit(f"unknown codec {codec!r}; choose from {', '.join(CODECS)}")
    for name in runs:
        if name not in RUNS:
            raise SystemExit(f"unknown run {name!r}; choose from {', '.join(RUNS)}")
    for name in profiles:
        if name not in PROFILES:
            raise SystemExit(f"unknown profile {name!r}; choose from {', '.join(PROFILES)}")
    started = time.monotonic()
    report: dict[str, Any] = {"machine": machine_notes(), "cells": {},
                              "profiles": {n: _profile_doc(link) for n, link in PROFILES.items() if n in profiles}}
    for run in runs:
        for codec in codecs:
            cell.codec = codec
            for profile in profiles:
                key = f"{run}_{profile}" + (f"@{codec}" if codec else "")
                with _cpu_lock(args.lock):
                    say(f"{key} (load {os.getloadavg()[0]:.1f})")
                    try:
                        report["cells"][key] = _cell(run, PROFILES[profile], cell)
                    except BenchmarkError as exc:  # one failed cell does not lose the others
                        report["cells"][key] = {"error": str(exc), "samples_per_s": None}
                say(f"{key}: {json.dumps(report['cells'][key])}")
    report.update(ratios(report["cells"]))
    return finish(report, "wan", started, args)


def _parser() -> argparse.ArgumentParser:
    out = parser("wan", __doc__, "3 s warm-up, 5 s window per cell: a smoke test, not a measurement")
    out.add_argument("--runs", default=",".join(RUNS))
    out.add_argument("--profiles", default=",".join(PROFILES))
    out.add_argument("--lock", default=None, help="hold an exclusive flock on this file during each cell")
    out.add_argument("--codecs", default="", help="training.wire_codec values to cross with, comma-separated "
                     "(default: each run's own)")
    out.add_argument("--wire-rank", type=int, default=None, help="training.wire_rank for the lowrank codec "
                     "(default: each run's own, 8)")
    out.add_argument("--in-flight", default="", help="training.in_flight for every run: a number or auto "
                     "(default: each run's own)")
    return out


def _profile_doc(link: Link | None) -> dict[str, float] | None:
    return None if link is None else {"rate_mbit_s": link.rate_mbit_s, "rtt_ms": 4 * link.delay_ms}


@contextmanager
def _cpu_lock(path: str | None):
    if path is None:
        yield
        return
    with open(path, "a") as handle:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise BenchmarkError(f"{path} stayed locked for {LOCK_TIMEOUT_S:.0f} s") from None
                time.sleep(1.0)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ratios(cells: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """The flat keys: each lab cell over its run's loopback cell, and over its link's bound."""
    out: dict[str, Any] = {}
    best: tuple[float, str] | None = None
    for key, cell in cells.items():
        run, rest = key.split("_", 1)
        profile, _, codec = rest.partition("@")
        if profile == "loopback":
            continue
        suffix = f"@{codec}" if codec else ""
        base = cells.get(f"{run}_loopback{suffix}")
        cell["vs_loopback"] = ratio(cell["samples_per_s"], base["samples_per_s"]) if base else None
        out[f"{run}_{profile}_vs_loopback{suffix}"] = cell["vs_loopback"]
        out[f"{run}_{profile}_vs_bound{suffix}"] = cell.get("vs_bound")
        plain = cells.get(f"{run}_{profile}@float32")
        if codec and codec != "float32" and plain and plain.get("bytes_per_sample") and cell.get("bytes_per_sample"):
            bytes_ratio = round(cell["bytes_per_sample"] / plain["bytes_per_sample"], 3)
            cell["bytes_ratio"] = out[f"{run}_{profile}_bytes_ratio{suffix}"] = bytes_ratio
            if best is None or bytes_ratio < best[0]:
                best = (bytes_ratio, codec)
    if best is not None:
        out["best_codec_bytes_ratio"], out["best_codec"] = best
    return out


# ----- one cell


def _run_path(run: str, fleet: Fleet, heartbeat_s: float, in_flight: int | str | None = None,
              codec: str | None = None, wire_rank: int | None = None) -> tuple[Path, Any]:
    if run == "heavy":
        path, _ = _heavy_run(fleet, Settings(heartbeat_s=heartbeat_s))
        config = load_run_config(path).model_dump(mode="json")
    else:
        from volunteer.config import load_run

        loaded, _ = load_run(SHIPPED[run])
        config = loaded.model_dump(mode="json")
        config["timeouts"]["heartbeat_s"] = heartbeat_s
        config["training"]["eval_every_s"] = 1e6  # no evaluation in the window
    if in_flight is not None:
        config["training"]["in_flight"] = in_flight
    if codec is not None:
        config["training"]["wire_codec"] = codec
    if wire_rank is not None:
        config["training"]["wire_rank"] = wire_rank
    path = write_run(fleet.workdir / f"{run}.yaml", config)
    return path, load_run_config(path)


def _cell(run: str, link: Link | None, cell: Cell) -> dict[str, Any]:
    """One swarm, its throughput measured. The lab (if any) outlives the fleet: processes stop before their hosts go."""
    with Lab([link] * (_stages(run) + 1)) if link else nullcontext() as lab, \
            Fleet(prefix=f"volunteer-bench-wan-{run}-", keep_workdir=bool(os.environ.get("VOLUNTEER_BENCH_KEEP"))) as fleet:
        run_path, config = _run_path(run, fleet, cell.heartbeat_s, cell.in_flight, cell.codec,
                                     cell.wire_rank)
        stages = config.model.stages
        procs: dict[str, list[Proc]] = {}
        try:
            if lab is None:
                _, maddr = fleet.bootstrap()
                hosts = []
                for k in range(stages):
                    procs[f"layer{k}"] = [fleet.join(f"layer{k}", run_path, f"layer{k}", maddr)]
            else:
                boot_host, *hosts = lab.hosts
                maddr = _lab_bootstrap(fleet, lab, boot_host)
                for k, host in enumerate(hosts):
                    procs[f"layer{k}"] = [_lab_join(fleet, lab, host, run_path, f"layer{k}", maddr)]
            return _measure_cell(fleet, config, maddr, procs, cell, lab, hosts)
        except BenchmarkError as exc:
            fleet.keep_workdir = True
            raise BenchmarkError(f"{exc} (logs in {fleet.workdir})") from exc
        finally:
            _stop_in_order(fleet, procs)


def _stages(run: str) -> int:
    if run == "heavy":
        return Settings().heavy_stages
    from volunteer.config import load_run

    return load_run(SHIPPED[run])[0].model.stages


def _lab_bootstrap(fleet: Fleet, lab: Lab, host: Host) -> str:
    proc = fleet.start("bootstrap", _in_host(host, "bootstrap", "--listen", host.maddr(LAB_PORT), "--announce",
                                             lab.expose(host, LAB_PORT), "--json", "--identity",
                                             str(fleet.workdir / "bootstrap.key")))

    def first_line() -> dict | None:
        proc.check_running()
        lines = proc.json_lines()
        return lines[0] if lines else None

    return wait_until(first_line, START_TIMEOUT_S, "the lab's bootstrap peer to start", interval_s=0.1)["maddrs"][0]


def _lab_join(fleet: Fleet, lab: Lab, host: Host, run_path: Path, swarm: str, maddr: str) -> Proc:
    """A volunteer on its host: it listens on the host's own address and announces the lab's relay to it."""
    return fleet.start(swarm, _in_host(host, "join", "--run", str(run_path), "--swarm", swarm, "--initial-peers",
                                       maddr, "--listen", host.maddr(LAB_PORT), "--announce",
                                       lab.expose(host, LAB_PORT), "--headless", "--log-format", "json"))


def _in_host(host: Host, *args: str) -> list[str]:
    return [*host.exec_prefix(), sys.executable, "-m", "volunteer_cli", *args]


def _veth_bytes(lab: Lab, hosts: list[Host]) -> dict[str, tuple[int, int]]:
    """(bytes up, bytes down) of each host's link so far, from its veth's counters."""
    out = {}
    for host in hosts:
        text = lab.run(host, ["cat", "/sys/class/net/eth0/statistics/tx_bytes",
                              "/sys/class/net/eth0/statistics/rx_bytes"], 10.0).stdout.split()
        out[host.netns] = (int(text[0]), int(text[1]))
    return out


def _measure_cell(fleet: Fleet, config: Any, maddr: str, procs: dict[str, list[Proc]], cell: Cell,
                  lab: Lab | None, hosts: list[Host]) -> dict[str, Any]:
    from swarm.dht.membership import Membership
    from hivemind.dht.crypto import RSASignatureValidator

    flat = [p for group in procs.values() for p in group]
    reader = fleet.dht([maddr], [RSASignatureValidator()], client_mode=True)
    membership = Membership(reader, config, b"")
    _wait_training(membership, config.model.stages, 1, flat, START_TIMEOUT_S)
    _sleep(cell.warmup_s, flat)
    before = _veth_bytes(lab, hosts) if lab else {}
    wall = time.monotonic()
    measured = _measure(fleet, membership, flat, 0.0, cell.window_s)
    result = {"samples_per_s": measured["samples_per_s"], "cpu_cores_used": measured["cpu_cores_used"],
              "loadavg_1m": round(os.getloadavg()[0], 2)}
    if lab is not None:
        after, wall = _veth_bytes(lab, hosts), time.monotonic() - wall
        samples = measured["samples_per_s"] * wall
        per_host = {ns: max(a[0] - before[ns][0], a[1] - before[ns][1]) / samples for ns, a in after.items()}
        busiest = max(per_host.values())
        rate_bytes_s = hosts[0].link.rate_mbit_s * 1e6 / 8
        result.update(bytes_per_sample=busiest, bound_samples_per_s=rate_bytes_s / busiest,
                      vs_bound=ratio(measured["samples_per_s"], rate_bytes_s / busiest),
                      bytes_per_sample_by_host=per_host)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
