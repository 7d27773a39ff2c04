"""`python -m benchmarks.churn --json`: churn without loss (issue 15 item 4), real processes on this machine.

A run with 3 peers per swarm trains; every ``--every-s`` (30 s) one random non-driver peer is
SIGKILLed and a replacement joins the same swarm, for ``--churn-s`` (5 minutes). Then a second run of
the same config trains as long with no churn, as the baseline. Measured, each in this benchmark run:
- ``lost_microbatches``: what the drivers gave up during the churn run (goal 0);
- ``throughput_dip``: the mean, over kills, of the lowest 5 s rate in the 15 s after a kill over the
  rate in the 10 s before it;
- ``unlisted_after_kill_s``: how long the killed peer's record still said online (its expiry; the
  drivers stop routing to it at its first failed hop, before that);
- ``final_accuracy_vs_no_churn``: the drivers' last published test accuracy, churn run over baseline
  (goal >= 0.98);
- ``replacement_online_s``: the median, over replacements, of spawn -> "online in" (its own event times),
  a newcomer joining a run that trains on a loaded machine (issue 15 item 5: goal <= 15 s), with
  ``replacement_online_max_s`` and each one's split (import, DHT start, swarm sync) in ``kills``.
"""

from __future__ import annotations

import random
import re
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import finish, machine_notes, parser, say, wait_until, write_run
from benchmarks.fleet import Fleet

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hostile import HostilePeer  # noqa: E402

START_TIMEOUT_S = 300.0


def run_config(name: str, stages: int) -> dict[str, Any]:
    return {"name": name, "model": {"stages": stages}, "optimizer": {"name": "adam", "lr": 0.001},
            "training": {"batch_size": 32, "in_flight": 4, "eval_every_s": 10},
            "timeouts": {"heartbeat_s": 1.0, "record_ttl_heartbeats": 3.0}}


def main(argv: list[str] | None = None) -> int:
    out = parser("churn", __doc__, "2 stages x 2 peers, a kill every 15 s for 60 s (about 4 minutes)")
    out.add_argument("--stages", type=int, default=3)
    out.add_argument("--per-swarm", type=int, default=3)
    out.add_argument("--every-s", type=float, default=30.0)
    out.add_argument("--churn-s", type=float, default=300.0)
    out.add_argument("--seed", type=int, default=0)
    args = out.parse_args(argv)
    if args.quick:
        args.stages, args.per_swarm, args.every_s, args.churn_s = 2, 2, 15.0, 60.0
    started = time.monotonic()
    rng = random.Random(args.seed)
    with Fleet(prefix="volunteer-bench-churn-") as fleet:
        _, maddr = fleet.bootstrap()
        churned = _run(fleet, maddr, "churn", args, rng, churn=True)
        calm = _run(fleet, maddr, "calm", args, rng, churn=False)
    report = {
        "benchmark": "churn", "stages": args.stages, "per_swarm": args.per_swarm, "every_s": args.every_s,
        "churn_s": args.churn_s, "kills": len(churned["kills"]),
        "lost_microbatches": churned["lost"], "lost_microbatches_no_churn": calm["lost"],
        "throughput_dip": _mean([k["dip"] for k in churned["kills"] if k["dip"] is not None]),
        "unlisted_after_kill_s": _mean([k["unlisted_s"] for k in churned["kills"] if k["unlisted_s"] is not None]),
        "replacement_online_s": _median([k["replacement"]["online_s"] for k in churned["kills"] if k["replacement"]]),
        "replacement_online_max_s": max((k["replacement"]["online_s"] for k in churned["kills"] if k["replacement"]),
                                        default=None),
        "replacements_not_online": sum(1 for k in churned["kills"] if not k["replacement"]),
        "final_accuracy": churned["accuracy"], "final_accuracy_no_churn": calm["accuracy"],
        "final_accuracy_vs_no_churn": round(churned["accuracy"] / calm["accuracy"], 4)
        if churned["accuracy"] and calm["accuracy"] else None,
        "samples": churned["trained"], "samples_no_churn": calm["trained"],
        "runs": {"churn": churned, "calm": calm}, "machine": machine_notes(),
    }
    return finish(report, "churn", started, args)


def _run(fleet: Fleet, maddr: str, label: str, args: Any, rng: random.Random, churn: bool) -> dict[str, Any]:
    from swarm.run.runconfig import RunConfig

    config = run_config(f"churn-{label}-{int(time.time())}", args.stages)
    run = RunConfig.model_validate(config)
    path = write_run(fleet.workdir / f"{label}.yaml", config)
    procs: dict[str, list[Any]] = {f"layer{k}": [fleet.join(f"{label}-layer{k}-{m}", path, f"layer{k}", maddr)
                                                for m in range(args.per_swarm)] for k in range(args.stages)}
    reader = HostilePeer(run, [maddr], fleet.workdir / f"{label}-reader.key", process_group=fleet._process_group(),
                         heartbeat_s=1.0)
    seen: dict[str, tuple[int, int]] = {}
    kills: list[dict[str, Any]] = []
    try:
        def ready() -> bool:
            online = {k: len(reader.online(f"layer{k}")) for k in range(args.stages)}
            return all(n >= args.per_swarm for n in online.values()) and _drivers(reader, seen)["trained"] > 1000

        wait_until(ready, START_TIMEOUT_S, f"{label}: every swarm full and training", interval_s=1.0)
        t0, replacements = time.monotonic(), 0
        while time.monotonic() - t0 < args.churn_s:
            next_at = time.monotonic() + args.every_s
            if churn:
                kills.append(_kill_one(fleet, reader, procs, path, maddr, label, rng, seen, replacements))
                replacements += 1
            time.sleep(max(0.0, next_at - time.monotonic()))
        final = _drivers(reader, seen)
        accuracy = _latest_accuracy(reader)
        return {"trained": final["trained"], "lost": final["lost"], "accuracy": accuracy, "kills": kills,
                "seconds": round(time.monotonic() - t0, 1)}
    finally:
        reader.close()
        fleet.stop([p for group in procs.values() for p in group])


def _kill_one(fleet: Fleet, reader: HostilePeer, procs: dict[str, list[Any]], path: Path, maddr: str, label: str,
              rng: random.Random, seen: dict, index: int) -> dict[str, Any]:
    swarm = rng.choice(sorted(name for name in procs if name != "layer0"))
    victim = rng.choice(procs[swarm])
    joined = re.search(r"joined the DHT as (\w+)", victim.stdout())  # its own id (its log names others too)
    victim_id = next((r.peer_id for r in reader.online(swarm) if joined and r.peer_id.endswith(joined.group(1))), None)
    rate_before = _rate(reader, seen, 10.0)
    victim.kill()
    killed_at = time.monotonic()
    procs[swarm].remove(victim)
    # a new volunteer, not the victim restarted: its own identity (it would take the victim's free slot)
    name = f"{label}-{swarm}-r{index}"
    replacement = fleet.join(name, path, swarm, maddr, "--identity", str(fleet.workdir / f"{name}.key"))
    procs[swarm].append(replacement)
    rates, unlisted_s = [], None
    while time.monotonic() - killed_at < 15.0:
        rates.append(_rate(reader, seen, 5.0))
        if unlisted_s is None and victim_id and victim_id not in {r.peer_id for r in reader.online(swarm)}:
            unlisted_s = round(time.monotonic() - killed_at, 1)
    if unlisted_s is None and victim_id:
        wait_until(lambda: victim_id not in {r.peer_id for r in reader.online(swarm)}, 60, "the record to expire")
        unlisted_s = round(time.monotonic() - killed_at, 1)
    joined_in = _online_times(replacement)
    say(f"{label}: killed a {swarm} peer; rates after {[round(r) for r in rates]} vs {rate_before:.0f} before; "
        f"the replacement: {joined_in}")
    return {"swarm": swarm, "rate_before": round(rate_before, 1), "rates_after": [round(r, 1) for r in rates],
            "dip": round(min(rates) / rate_before, 3) if rate_before > 0 and rates else None,
            "unlisted_s": unlisted_s, "replacement": joined_in}


JOIN_MARKERS = {"import_s": "starting the DHT", "dht_s": "joined the DHT as", "online_s": "online in "}


def _online_times(proc: Any, timeout_s: float = 120.0) -> dict[str, float] | None:
    """Spawn -> each join step of a volunteer, by its own event times (None if it was not online in time)."""
    def events() -> dict[str, float] | None:
        found: dict[str, float] = {}
        for line in proc.json_lines():
            for key, marker in JOIN_MARKERS.items():
                if line.get("type") == "event" and marker in str(line.get("text", "")):
                    found.setdefault(key, float(line["time"]) - proc.started_at)
        return found if "online_s" in found else None

    try:
        found = wait_until(events, timeout_s, "the replacement to come online", interval_s=0.5)
    except Exception:
        return None
    return {key: round(found[key], 2) for key in JOIN_MARKERS if key in found}


def _drivers(reader: HostilePeer, seen: dict[str, tuple[int, int]]) -> dict[str, int]:
    for r in reader.membership.read("layer0"):
        trained, lost = seen.get(r.peer_id, (0, 0))
        seen[r.peer_id] = (max(trained, r.trained), max(lost, r.lost))
    return {"trained": sum(t for t, _ in seen.values()), "lost": sum(lost for _, lost in seen.values())}


def _rate(reader: HostilePeer, seen: dict, window_s: float) -> float:
    start, t0 = _drivers(reader, seen)["trained"], time.monotonic()
    time.sleep(window_s)
    return (_drivers(reader, seen)["trained"] - start) / (time.monotonic() - t0)


def _latest_accuracy(reader: HostilePeer) -> float | None:
    published = [(r.eval_at, r.test_accuracy) for r in reader.membership.read("layer0") if r.test_accuracy >= 0]
    return max(published)[1] if published else None


def _median(values: list[float]) -> float | None:
    import statistics

    return statistics.median(values) if values else None


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 3) if values else None


if __name__ == "__main__":
    raise SystemExit(main())
