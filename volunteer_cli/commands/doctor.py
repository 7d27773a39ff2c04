"""`volunteer doctor`: what works on this machine, in plain words, before a node runs on it.

Checks, in order of what most often goes wrong: the data dir (writable, free space, nodes already
running there), idle detection (which sources work, and what the idle policy would do right now),
the run's bootstrap peers (a short, bounded DHT start and a ping of each), whether other hosts can dial
this machine (it listens where `volunteer join` would and asks online peers of the run to dial it back,
swarm/dht/reachability.py; a node already running here reports its own verdict instead), and the GPU. The GPU is
looked at last: CUDA must not be initialised before hivemind forks its DHT process. For a llama run, the memory
each stage needs (swarm/run/memory.py, from the run config alone) against what this machine has.
Exit status 0 when nothing failed, 1 otherwise; warnings do not fail.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import threading
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from volunteer.config import load_preferences, load_run
from volunteer_cli.commands.doctor_check import FAIL, GIB, INFO, MARKS, MIB, NOT_HERE, OK, WARN, Check
from volunteer_cli.commands.doctor_memory import memory_checks

MIN_FREE_BYTES = 1 << 30  # a few checkpoints of a large layer
PING_TIMEOUT_S = 5.0
PROBE_FILE = ".doctor-probe"


def run_doctor(args: argparse.Namespace) -> int:
    prefs = load_preferences(args.prefs)
    run, _ = load_run(args.run)
    from volunteer_cli.commands.common import check_initial_peers
    from volunteer.paths import user_data_dir

    check_initial_peers(args.initial_peers)

    data_dir = Path(args.data_dir or prefs.data_dir or user_data_dir()).expanduser()
    from volunteer.control import live_nodes
    from volunteer_cli.commands.join import DEFAULT_VOLUNTEER_LISTEN

    checks = [*data_dir_checks(data_dir), *idle_checks(prefs)]
    running = [snap for _, snap in live_nodes(data_dir) if snap.get("run_id") == run.run_id]
    if args.listen:
        _check_listen(args.listen)
    listen = [m for m in (args.listen or prefs.network.listen or DEFAULT_VOLUNTEER_LISTEN) if "/tcp/" in m]
    checks += network_checks(run, list(args.initial_peers or run.bootstrap_peers), args.timeout_s, args.verbose,
                             listen=listen, announce=list(prefs.network.announce), running=running[0] if running else None)
    checks += gpu_checks(prefs.device)
    checks += memory_checks(run, prefs.device, shutil.disk_usage(data_dir).free if data_dir.is_dir() else None)
    ok = not any(check.status == FAIL for check in checks)
    if args.json:
        print(json.dumps({"ok": ok, "run_id": run.run_id, "data_dir": str(data_dir),
                          "checks": [asdict(check) for check in checks]}))
    else:
        print(render(checks, run.run_id))
    return 0 if ok else 1


def _check_listen(maddrs: list[str]) -> None:
    """--listen checked as network.listen is (volunteer/prefs.py), before anything loads: a UserError with the fix."""
    from pydantic import ValidationError

    from volunteer.prefs import NetworkPrefs
    from volunteer_cli.main import UserError

    try:
        NetworkPrefs(listen=maddrs)
    except ValidationError as exc:
        raise UserError(f"--listen: {exc.errors()[0]['msg'].removeprefix('Value error, ')}") from None
    if not any("/tcp/" in maddr for maddr in maddrs):
        raise UserError("--listen: the reachability check needs a TCP address, e.g. /ip4/0.0.0.0/tcp/31337")


def render(checks: list[Check], run_id: str) -> str:
    lines = [f"volunteer doctor (run {run_id})"]
    section = None
    for check in checks:
        if check.section != section:
            section = check.section
            lines.append(section)
        lines.append(f"  {MARKS[check.status]}  {check.name}: {check.detail}")
    failed = sum(check.status == FAIL for check in checks)
    warned = sum(check.status == WARN for check in checks)
    lines.append("all good" if not failed and not warned else f"{failed} failed, {warned} warning(s)")
    return "\n".join(lines)


# ----- data dir


def data_dir_checks(data_dir: Path) -> list[Check]:
    section = "data dir"
    try:
        from volunteer.paths import ensure_private_dir

        ensure_private_dir(data_dir)
        probe = data_dir / PROBE_FILE
        with open(probe, "wb") as file:
            file.write(b"ok")
            file.flush()
            os.fsync(file.fileno())
        probe.unlink()
    except OSError as exc:
        return [Check(section, str(data_dir), FAIL, f"not writable ({exc.strerror or exc}); pass --data-dir "
                                                    "or set data_dir in your preferences")]
    free = shutil.disk_usage(data_dir).free
    status = OK if free >= MIN_FREE_BYTES else WARN
    advice = "" if status == OK else f"; checkpoints need room, free at least {MIN_FREE_BYTES // GIB} GiB"
    checks = [Check(section, str(data_dir), status, f"writable, {free / GIB:.1f} GiB free{advice}")]
    checkpoints = sorted(data_dir.glob("runs/*/*/*.ckpt"))
    if checkpoints:
        size = sum(path.stat().st_size for path in checkpoints)
        checks.append(Check(section, "checkpoints", INFO, f"{len(checkpoints)} ({size / MIB:.1f} MiB)"))
    from volunteer.control import live_nodes

    for path, snap in live_nodes(data_dir):
        reason = f": {snap['reason']}" if snap.get("reason") else ""
        checks.append(Check(section, "running node", INFO,
                            f"{snap.get('swarm')} of {snap.get('run_id')}, {snap.get('state')}{reason} ({path.name})"))
    return checks


# ----- idle detection


def idle_checks(prefs: Any) -> list[Check]:
    from volunteer.idle import CPU_PROBE_S, IdleObserver, probe_sources
    from volunteer.policy import PolicyMemory, decide

    enabled = prefs.idle.enabled
    section = f"idle detection (idle.enabled: {'true' if enabled else 'false'})"
    checks = []
    for report in probe_sources():
        unknown_idle = report.name == "user idle time" and not report.works
        status = OK if report.works else (WARN if unknown_idle and enabled else NOT_HERE)
        detail = report.detail
        if unknown_idle and enabled and not prefs.idle.run_when_idle_unknown:
            detail += "; a headless node will stay paused (set idle.run_when_idle_unknown: true to train anyway)"
        checks.append(Check(section, report.name, status, detail))
    if enabled:
        observer = IdleObserver(watch_gpu=prefs.device != "cpu")
        observer.observe()  # the CPU meter needs two samples
        threading.Event().wait(CPU_PROBE_S)
        verdict = decide(prefs.idle, observer.observe(), PolicyMemory(), time.monotonic())
        here = verdict.on("cuda" if prefs.device.startswith("cuda") else "cpu")
        checks.append(Check(section, "idle policy now", INFO, "would train" if here.run else f"would pause: {here.reason}"))
    return checks


# ----- network


def network_checks(run: Any, initial_peers: list[str], timeout_s: float, verbose: int,
                   listen: list[str] | None = None, announce: list[str] | None = None,
                   running: dict | None = None) -> list[Check]:
    section = "bootstrap peers"
    if not initial_peers:
        return [Check(section, "bootstrap peers", FAIL, "none: pass --initial-peers MADDR or list bootstrap_peers "
                                                        "in the run config (`volunteer bootstrap` hosts one)")]
    from volunteer_cli.commands.common import setup_process

    watchdog, _ = setup_process(verbose)
    from swarm.dht.dht import DHTSettings, DHTStartError, make_validators, shutdown_dht, start_dht

    dht = None
    started = time.monotonic()
    try:
        # listen where a node would (nothing can dial it while a client-mode DHT serves no DHT requests,
        # except the dial-back check's TCP connection); a node already running here holds its port
        host_maddrs = ["/ip4/127.0.0.1/tcp/0"] if running is not None or not listen else listen
        settings = DHTSettings(initial_peers=initial_peers, host_maddrs=host_maddrs,
                               announce_maddrs=announce or [], client_mode=True,
                               start_timeout_s=timeout_s, process_group=watchdog.pgid)
        try:
            dht = start_dht(settings, make_validators(run.run_id, run.swarm_names, None))
        except DHTStartError as exc:
            return [Check(section, maddr, FAIL, "unreachable") for maddr in initial_peers] + [
                Check(section, "joining the DHT", FAIL, str(exc))]
        checks = [Check(section, "joining the DHT", OK, f"took {time.monotonic() - started:.1f} s")]
        checks += _ping_checks(dht, initial_peers, section)
        swarm_checks, views = _swarm_checks(dht, run)
        checks += swarm_checks
        checks += reachability_checks(dht, run, views, running)
        return checks
    finally:
        if dht is not None:
            shutdown_dht(dht)
        watchdog.stop()


def _ping_checks(dht: Any, initial_peers: list[str], section: str) -> list[Check]:
    ids = {maddr: maddr.rsplit("/p2p/", 1)[1] for maddr in initial_peers if "/p2p/" in maddr}
    try:
        times = dht.run_coroutine(partial(_ping_peers, peer_ids=sorted(set(ids.values())), timeout_s=PING_TIMEOUT_S))
    except Exception as exc:
        return [Check(section, "ping", WARN, f"could not ping: {exc}")]
    checks = []
    for maddr in initial_peers:
        elapsed = times.get(ids.get(maddr, ""))
        if maddr not in ids:
            checks.append(Check(section, maddr, FAIL, "no /p2p/<peer id> at its end: ask for the full address"))
        elif elapsed is None:
            checks.append(Check(section, maddr, FAIL, f"did not answer a ping within {PING_TIMEOUT_S:g} s"))
        else:
            checks.append(Check(section, maddr, OK, f"answered in {elapsed * 1000:.0f} ms"))
    return checks


async def _ping_peers(dht: Any, node: Any, peer_ids: list[str], timeout_s: float) -> dict[str, float | None]:
    """Runs inside the DHT process: each peer's ping round trip in seconds, None if it did not answer."""
    from hivemind.p2p import PeerID

    async def ping(peer_id: str) -> float | None:
        started = time.perf_counter()
        try:
            answer = await asyncio.wait_for(node.protocol.call_ping(PeerID.from_base58(peer_id)), timeout_s)
        except (asyncio.TimeoutError, ValueError):
            return None
        return time.perf_counter() - started if answer is not None else None

    results = await asyncio.gather(*(ping(peer_id) for peer_id in peer_ids))
    return dict(zip(peer_ids, results))


def _swarm_checks(dht: Any, run: Any) -> tuple[list[Check], dict[str, list[Any]]]:
    from swarm.dht.membership import Membership, summarize

    views = Membership(dht, run, b"").read_all()
    parts, empty = [], []
    for name in run.swarm_names:
        online, throughput, _ = summarize(views.get(name, []))
        parts.append(f"{name} {online} online")
        if not online:
            empty.append(name)
    detail = ", ".join(parts) + (f"; nobody serves {', '.join(empty)} yet: join one of these" if empty else "")
    return [Check("run " + run.run_id, "swarms", INFO, detail)], views


REACHABILITY_STATUS = {"reachable": OK, "local": INFO, "unknown": WARN, "unreachable": WARN, "checking": INFO}


def reachability_checks(dht: Any, run: Any, views: dict[str, list[Any]], running: dict | None) -> list[Check]:
    """Can other hosts dial this machine? A running node's own verdict, else a dial-back by online peers."""
    from swarm.dht.reachability import UNREACHABLE, Verdict, advice, check_reachability

    section, name = "reachability", "dialled from outside"
    if running is not None:
        status = running.get("reachability") or "unknown"
        at = running.get("reachability_at")
        age = f" ({time.time() - at:.0f} s ago)" if isinstance(at, (int, float)) else ""
        detail = f"the node running here: {status}{age}; {running.get('reachability_detail') or 'no detail yet'}"
        return [Check(section, name, REACHABILITY_STATUS.get(status, WARN), detail)]
    responders = sorted({r.peer_id for records in views.values() for r in records if r.state == "online"})

    async def ask() -> Any:
        from swarm.dht.dht import fresh_p2p

        p2p = await fresh_p2p(dht)
        try:
            return await check_reachability(p2p, run.run_id, responders)
        finally:
            await p2p.shutdown()

    try:
        verdict = asyncio.run(asyncio.wait_for(ask(), 60.0))
    except Exception as exc:
        verdict = Verdict("unknown", f"the check failed: {exc.__class__.__name__}: {exc}")
    detail = verdict.detail
    if verdict.status == UNREACHABLE:
        detail += ". " + advice(verdict)
    elif verdict.status == "unknown" and not responders:
        detail = "no peer of the run is online to dial this machine back; run `volunteer doctor` again once one is"
    return [Check(section, name, REACHABILITY_STATUS.get(verdict.status, WARN), detail)]


# ----- GPU


def gpu_checks(requested: str) -> list[Check]:
    section = "gpu"
    import torch

    from volunteer.device import resolve_device

    if not torch.cuda.is_available():
        cuda = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        status = FAIL if requested.startswith("cuda") else NOT_HERE
        advice = ("; use --device cpu or install a CUDA build of torch" if status == FAIL
                  else ": training runs on the CPU")
        return [Check(section, "cuda", status, f"torch {torch.__version__} ({cuda}) sees no CUDA GPU{advice}")]
    checks = []
    for index in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(index)
        free, total = torch.cuda.mem_get_info(index)
        checks.append(Check(section, f"cuda:{index}", OK, f"{properties.name}, {total / GIB:.1f} GiB "
                                                          f"({free / GIB:.1f} GiB free), torch {torch.__version__}"))
    try:
        checks.append(Check(section, "device", OK, f"{requested} -> {resolve_device(requested)}"))
    except ValueError as exc:
        checks.append(Check(section, "device", FAIL, str(exc)))
    return checks
