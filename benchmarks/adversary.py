"""A hostile peer against a local swarm of real `volunteer join` processes (issue 14, item 7).

For each attack: a fresh run (a 3-stage digits MLP, heartbeat 1 s), trained for ``warm_s``, attacked
for ``attack_s`` by a tests/hostile.py peer speaking the real protocol, then watched for ``after_s``.
A clean run of the same shape and length in the same benchmark run is the baseline. Accuracy is
the *true* test accuracy of the swarm's copies, pulled through the params service every
``sample_s`` and evaluated here (whatever the peers publish), so a published evaluation that went
stale can be caught.

Prints one JSON object: ``<attack>_accuracy_ratio`` per attack (the lower of accuracy during and
after the attack over the clean run's in the same windows), ``runs_killed``, the slowest
``refused_after_s`` (attacker's first refusal), ``lost_microbatches``, and ``stale_eval_unlabelled``.
Details per attack under ``attacks``; the runs' own figures under ``clean``.

    python -m benchmarks.adversary --json [--quick] [--attacks huge_3e38,black_hole] [--labels auto|ids|targets]
                                   [--per-swarm 2]

``--per-swarm N`` runs every attack (and its clean baseline) with at least N volunteers per swarm: at 2 the
attacker's driver competes with two honest drivers, and a hostile stage peer sits beside an honest one.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.adversary_attacks import ATTACKS, Attack, start_attack
from benchmarks.adversary_metrics import Sample, summarize_run, summary
from benchmarks.common import apply_overrides, finish, machine_notes, parser, rounded, say, wait_until, write_run
from benchmarks.fleet import Fleet
from benchmarks.procstats import process_rss_mib

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from copies import CopyOracle  # noqa: E402
from hostile import HostilePeer  # noqa: E402

STAGES = 3
START_TIMEOUT_S = 240.0
QUICK_ATTACKS = ("huge_3e38",)
PHASE_S = 20.0


@dataclass(slots=True, frozen=True)
class Settings:
    warm_s: float = PHASE_S
    attack_s: float = PHASE_S
    after_s: float = PHASE_S
    sample_s: float = 2.0
    labels: str = "targets"  # "ids" once stage RPCs take sample ids (PROTOCOL.md)
    overrides: tuple[str, ...] = ()  # --set: run-config fields for every run, attacked and clean


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    names = tuple(args.attacks.split(",")) if args.attacks else (QUICK_ATTACKS if args.quick else tuple(ATTACKS))
    unknown = [n for n in names if n not in ATTACKS]
    if unknown:
        raise SystemExit(f"unknown attack(s) {unknown}; choose from {', '.join(ATTACKS)}")
    settings = Settings(labels=_labels(args.labels), warm_s=args.phase_s, attack_s=args.phase_s, after_s=args.phase_s,
                        overrides=tuple(args.set))
    if args.quick:
        settings = replace(settings, warm_s=12.0, attack_s=8.0, after_s=8.0)
    started = time.monotonic()
    chosen = [replace(ATTACKS[n], per_swarm=max(ATTACKS[n].per_swarm, args.per_swarm)) for n in names]
    with Fleet(prefix="volunteer-adversary-", keep_workdir=args.keep_logs) as fleet:
        if args.keep_logs:
            say(f"logs kept in {fleet.workdir}")
        report = _benchmark(fleet, chosen, settings)
    report["settings"]["per_swarm_at_least"] = args.per_swarm
    report["machine"] = machine_notes()
    return finish(report, "adversary", started, args)


def _parser() -> argparse.ArgumentParser:
    out = parser("adversary", __doc__, quick_help="one attack (huge_3e38), short windows: a smoke test, not a measurement")
    out.add_argument("--keep-logs", action="store_true", help="keep the volunteers' logs (printed path)")
    out.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                     help="a run-config field for every run, e.g. training.weight_prediction=2 (the value is YAML)")
    out.add_argument("--attacks", default="", help=f"comma-separated subset of: {', '.join(ATTACKS)}")
    out.add_argument("--phase-s", type=float, default=PHASE_S,
                     help="seconds of each phase: training before, attack, after (default %(default)s)")
    out.add_argument("--per-swarm", type=int, default=1, help="volunteers per swarm, at least (attacks that need "
                     "more keep theirs; default %(default)s)")
    out.add_argument("--labels", default="auto", choices=("auto", "ids", "targets"),
                     help="what forward_backward carries: sample ids (new protocol) or targets (old); auto detects")
    return out


def _labels(choice: str) -> str:
    if choice != "auto":
        return choice
    import inspect

    from swarm.pipeline.stage import stage_rpc

    return "ids" if "wrong_shard" in inspect.getsource(stage_rpc) else "targets"


def _benchmark(fleet: Fleet, attacks: list[Attack], s: Settings) -> dict[str, Any]:
    _, maddr = fleet.bootstrap()
    clean: dict[tuple, dict[str, Any]] = {}
    results: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    for attack in attacks:
        if attack.baseline not in clean:
            say(f"clean run {attack.baseline}")
            clean[attack.baseline] = _run(fleet, maddr, None, attack.baseline, s)
            say(f"run clean {attack.baseline}: {json.dumps(rounded(clean[attack.baseline]))}")
        say(f"attack {attack.name}")
        try:
            results[attack.name] = _run(fleet, maddr, attack, attack.shape, s)
            say(f"run {attack.name}: {json.dumps(rounded(results[attack.name]))}")  # survives a timeout
        except Exception as exc:  # one attack the harness could not mount must not lose the others' figures
            say(f"attack {attack.name} could not be measured: {exc.__class__.__name__}: {exc}")
            errors[attack.name] = f"{exc.__class__.__name__}: {exc}"[:500]
    report = summary(results, clean, {a.name: a.baseline for a in attacks})
    report["errors"] = errors
    report["settings"] = {"warm_s": s.warm_s, "attack_s": s.attack_s, "after_s": s.after_s,
                          "sample_s": s.sample_s, "labels": s.labels, "stages": STAGES, "set": list(s.overrides)}
    return report


def _run_config(name: str, optimizer: str, heartbeat_s: float = 1.0) -> dict[str, Any]:
    config: dict[str, Any] = {
        "name": name,
        "model": {"kind": "mlp", "stages": STAGES, "hidden_dim": 128},
        "training": {"batch_size": 32, "in_flight": 4, "eval_every_s": 5.0},
        "timeouts": {"heartbeat_s": heartbeat_s},
    }
    if optimizer == "sgd_momentum":
        config["optimizer"] = {"name": "sgd", "lr": 0.05, "momentum": 0.9}  # the schema's default optimizer until issue 11 (now adam)
    else:
        config["optimizer"] = {"name": "adam", "lr": 0.001}  # configs/runs/digits-mlp.yaml's
    return config


def _run(fleet: Fleet, maddr: str, attack: Attack | None, shape: tuple, s: Settings) -> dict[str, Any]:
    """One run: start, train warm_s, attack attack_s (or not), watch after_s, stop. Returns its figures."""
    from swarm.run.runconfig import RunConfig

    per_swarm, optimizer, busy = shape
    label = attack.name if attack else "clean-" + "-".join(map(str, shape))
    config = _run_config(f"adv-{label}-{int(time.time())}", optimizer)
    apply_overrides(config, list(s.overrides))
    run = RunConfig.model_validate(config)
    path = write_run(fleet.workdir / f"{label}.yaml", config)
    procs = {f"layer{k}": [fleet.join(f"{label}-layer{k}-{m}", path, f"layer{k}", maddr) for m in range(per_swarm)]
             for k in range(STAGES)}
    everyone = [p for group in procs.values() for p in group]
    hogs = [fleet.start(f"{label}-busy{i}", [sys.executable, "-c", "while True: pass"])
            for i in range(busy)]
    hostile = HostilePeer(run, [maddr], fleet.workdir / f"{label}-hostile.key",
                          process_group=fleet._process_group(), heartbeat_s=1.0)
    try:
        _wait_training(hostile, per_swarm, everyone)
        sampler = _Sampler(hostile, per_swarm, s.sample_s)
        sampler.start()
        _sleep(s.warm_s, everyone)
        rss_before = {p.name: process_rss_mib(p.pid) for p in procs["layer1"]}
        handle = start_attack(attack, hostile, s.labels) if attack else None
        left = procs[attack.swarm] if attack is not None and attack.lone else []
        if handle is not None and not left:  # the honest copies are measured, never a liar's
            sampler.exclude = frozenset(handle.peer_ids)
        if left:  # the liar is its swarm's only copy from here (a leave, as a volunteer's Ctrl+C)
            fleet.stop(left)
            everyone = [p for p in everyone if p not in left]
        attack_at = time.monotonic()
        cpu_before = _cpu_split([p.pid for p in everyone])
        _sleep(s.attack_s, everyone)
        cpu = _cpu_cores(cpu_before, _cpu_split([p.pid for p in everyone]), time.monotonic() - attack_at)
        attacker = handle.stop() if handle else {}
        _sleep(s.after_s, everyone)
        samples = sampler.stop()
        alive = {p.name: p.alive() for p in everyone}
        rss = {p.name: (rss_before[p.name], process_rss_mib(p.pid)) for p in procs["layer1"]}
    finally:
        hostile.close()
        fleet.stop(everyone + hogs)
    out = summarize_run(samples, attack_at - sampler.t0, s.attack_s, s.after_s)
    out.update(attacker=attacker, all_alive=all(alive.values()), layer1_rss_mb_before_after=rss,
               cpu_cores_during=cpu, **_bans(everyone + left, handle.peer_ids if handle else [hostile.peer_id]))
    if attack is not None and attack.role == "driver":
        out["refused_after_s"] = attacker.get("first_refusal_s")
    return out


BAN_LINE = re.compile(r"banned peer (\w{8}) for")
CONVICTED_LINE = re.compile(r"layer\d peer (\w{8}) convicted")


def _bans(procs: list[Any], attackers: list[str]) -> dict[str, Any]:
    """From the volunteers' logs: bans that landed on a peer other than the attacker's identities (``honest_bans``:
    every penalty must land on the peer that authored the wrong tensor), and whether the attacker was banned
    anywhere."""
    logs = [p.stdout() + p.stderr() for p in procs]
    banned = [m.group(1) for log in logs for m in BAN_LINE.finditer(log)]
    convicted = {m.group(1) for log in logs for m in CONVICTED_LINE.finditer(log)}  # by a driver's referee
    ours = {a[-8:] for a in attackers}
    return {"honest_bans": sum(1 for b in banned if b not in ours), "attacker_banned": any(b in ours for b in banned),
            "honest_convicted": len(convicted - ours), "attackers_convicted": len(convicted & ours)}


def _wait_training(hostile: HostilePeer, per_swarm: int, procs: list[Any]) -> None:
    def ready() -> bool:
        for proc in procs:
            proc.check_running()
        online = {k: hostile.online(f"layer{k}") for k in range(STAGES)}
        return all(len(v) >= per_swarm for v in online.values()) and sum(r.trained for r in online[0]) > 0

    wait_until(ready, START_TIMEOUT_S, "every swarm online and layer0 training", interval_s=1.0)


def _sleep(seconds: float, procs: list[Any]) -> None:
    """Sleep through a phase; a volunteer that dies meanwhile is a result (a killed run), not an error."""
    time.sleep(seconds)


def _cpu_split(volunteers: list[int]) -> dict[str, float]:
    """CPU seconds so far: the volunteers' process trees, and this benchmark's own (the attacker, its p2pd,
    the copy oracle). On one 2-core machine the attacker's CPU is taken from the victims: a stranger on
    its own machine would cost them only the requests they answer."""
    import psutil

    def tree(proc: psutil.Process) -> float:
        total = 0.0
        for p in [proc, *proc.children(recursive=True)]:
            try:
                times = p.cpu_times()
                total += times.user + times.system
            except psutil.Error:
                pass
        return total

    victims = 0.0
    for pid in volunteers:
        try:
            victims += tree(psutil.Process(pid))
        except psutil.Error:
            pass
    everything = tree(psutil.Process())  # the fleet's processes are this one's children too
    return {"volunteers": victims, "benchmark": everything - victims}


def _cpu_cores(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    return {k: round((after[k] - before[k]) / max(seconds, 1e-9), 2) for k in before}


class _Sampler:
    """Every sample_s: the layer0 records (trained, lost, published evaluation) and the copies' true accuracy."""

    def __init__(self, hostile: HostilePeer, per_swarm: int, sample_s: float):
        self.hostile = hostile
        self.per_swarm = per_swarm
        self.sample_s = sample_s
        self.oracle = CopyOracle(hostile)
        # the attacker's identities, never measured as the run's copies: a read that missed the honest copy's record
        # (a copy that stopped serving to heal, a read under load) measured the oldest liar's copy instead; such a
        # sample is skipped. Not for a lone liar: it is then its swarm's copy, what the run trains
        self.exclude: frozenset[str] = frozenset()
        self.samples: list[Sample] = []
        self._trained: dict[str, int] = {}
        self._lost: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sampler", daemon=True)
        self.t0 = time.monotonic()

    def start(self) -> None:
        self.t0 = time.monotonic()
        self._thread.start()

    def stop(self) -> list[Sample]:
        self._stop.set()
        self._thread.join(60)
        return self.samples

    def _loop(self) -> None:
        while not self._stop.wait(self.sample_s):
            try:
                self.samples.append(self._sample())
            except Exception as exc:  # a failed sample is a gap in the series, reported by its absence
                say(f"sample failed: {exc.__class__.__name__}: {exc}")

    def _sample(self) -> Sample:
        views = {k: sorted((r for r in self.hostile.online(f"layer{k}") if r.peer_id not in self.exclude),
                           key=lambda r: r.started_at) for k in range(STAGES)}
        drivers = views[0]
        accuracies = []
        for m in range(self.per_swarm):
            chain = {f"layer{k}": views[k][min(m, len(views[k]) - 1)].peer_id for k in range(STAGES) if views[k]}
            if len(chain) == STAGES:
                self.oracle.pull(chain, timeout_s=10.0)
                accuracies.append(self.oracle.test_accuracy())
        for r in drivers:  # a record missing from one read must not look like samples un-trained
            self._trained[r.peer_id] = max(self._trained.get(r.peer_id, 0), r.trained)
            self._lost[r.peer_id] = max(self._lost.get(r.peer_id, 0), r.lost)
        published = [r for r in drivers if r.test_accuracy >= 0]
        newest = max(published, key=lambda r: r.eval_samples) if published else None
        return Sample(
            t=time.monotonic() - self.t0,
            trained=sum(self._trained.values()),
            lost=sum(self._lost.values()),
            drivers=len(drivers),
            true_accuracy=sum(accuracies) / len(accuracies) if accuracies else None,
            published_accuracy=newest.test_accuracy if newest else None,
            published_labelled=newest is not None and _labelled(newest),
        )


def _labelled(record: Any) -> bool:
    """Does the record say when (or on which copy) its evaluation was taken? (issue 14, item 6)"""
    return any(hasattr(record, name) for name in ("eval_at", "eval_time", "eval_age_s", "eval_version"))


if __name__ == "__main__":
    raise SystemExit(main())
