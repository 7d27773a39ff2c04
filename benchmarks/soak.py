"""`python -m benchmarks.soak --json`: many volunteers for a long time (issue 15, item 6), real processes.

``--volunteers`` (32) real `volunteer join` processes, ``--volunteers / --stages`` per swarm (digits, the
run's default timeouts), train for ``--minutes`` (30). Every ``--sample-s`` the benchmark reads the
memory of every process of the fleet (PSS from /proc/PID/smaps_rollup: shared pages counted once, split
among their users; RSS too) by kind (volunteer, its DHT process, p2pd) and the drivers' records. At the
end it stops every volunteer the way a user does (SIGTERM) and counts what is left. Figures:
- ``pss_growth`` / ``rss_growth``: the fleet's total in the last ``--window-s`` over the first window after
  ``--warmup-s``, minus 1 (goal: RSS growth <= 0.10);
- ``pss_mib_per_volunteer``: the fleet's PSS over the volunteers, at the start and end windows;
- ``stalled_driver_windows``: (driver, window of ``--stall-s``) pairs in which an online layer0 driver
  trained nothing while the run went on (a micro-batch stuck holds its driver's lane; goal 0);
- ``lost_microbatches``: what the drivers gave up (goal 0);
- ``processes_left``: fleet processes alive after the orderly stop and the reap (goal 0);
  ``sigkilled_after_stop``: processes the reap had to SIGKILL after the stop; ``volunteers_killed_at_stop``:
  volunteers that did not leave within the stop's grace after SIGTERM (a clean leave drains, announces
  and checkpoints: slow on an overloaded machine).

``--quick``: 8 volunteers for 3 minutes (a smoke run, not the measurement).
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import finish, machine_notes, parser, say, wait_until, write_run
from benchmarks.fleet import Fleet, tagged_pids
from benchmarks.procstats import process_kind

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hostile import HostilePeer  # noqa: E402

KINDS = ("volunteer", "dht", "p2pd")


def memory_kib(pid: int) -> tuple[int, int]:
    """(PSS, RSS) of one process in KiB, (0, 0) once it is gone."""
    try:
        text = (Path("/proc") / str(pid) / "smaps_rollup").read_text()
    except OSError:
        return 0, 0
    fields = {line.split(":")[0]: int(line.split()[1]) for line in text.splitlines()[1:] if line.endswith("kB")}
    return fields.get("Pss", 0), fields.get("Rss", 0)


def fleet_memory(fleet: Fleet) -> dict[str, Any]:
    """PSS and RSS of the fleet's processes, in MiB, by kind and in all."""
    pids = tagged_pids(fleet.tag)
    out: dict[str, Any] = {f"{m}_{k}": 0.0 for m in ("pss", "rss") for k in (*KINDS, "total")}
    out["processes"] = len(pids)
    for pid in pids:
        kind = process_kind(pid, pids)
        pss, rss = memory_kib(pid)
        for metric, kib in (("pss", pss), ("rss", rss)):
            if kind in KINDS:
                out[f"{metric}_{kind}"] += kib / 1024
            out[f"{metric}_total"] += kib / 1024
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()}


def growth(samples: list[dict[str, Any]], key: str, warmup_s: float, window_s: float) -> float | None:
    """The mean of ``key`` over the last ``window_s`` over its mean over the first window after ``warmup_s``,
    minus 1 (None without a sample in either window, or when the two windows overlap)."""
    if not samples:
        return None
    end = samples[-1]["t"]
    first = [s[key] for s in samples if warmup_s <= s["t"] < warmup_s + window_s]
    last = [s[key] for s in samples if s["t"] > end - window_s and s["t"] >= warmup_s + window_s]
    if not first or not last:
        return None
    return (sum(last) / len(last)) / (sum(first) / len(first)) - 1.0


def stalled_windows(samples: list[dict[str, Any]], warmup_s: float, stall_s: float) -> list[tuple[str, float]]:
    """(driver, window start) where a driver online at both ends trained nothing while the run's total grew."""
    out = []
    rows = [s for s in samples if s["t"] >= warmup_s]
    for i, start in enumerate(rows):
        later = [s for s in rows[i + 1 :] if s["t"] >= start["t"] + stall_s]
        if not later:
            break
        end = later[0]
        if sum(end["trained"].values()) <= sum(start["trained"].values()):
            continue  # the whole run paused: not one driver's stuck lane
        for driver, trained in start["trained"].items():
            if driver in end["trained"] and end["trained"][driver] <= trained:
                out.append((driver, start["t"]))
    return out


def main(argv: list[str] | None = None) -> int:
    out = parser("soak", __doc__, "8 volunteers, 3 minutes (a smoke run)")
    out.add_argument("--volunteers", type=int, default=32)
    out.add_argument("--stages", type=int, default=4)
    out.add_argument("--minutes", type=float, default=30.0)
    out.add_argument("--sample-s", type=float, default=30.0)
    out.add_argument("--warmup-s", type=float, default=120.0)
    out.add_argument("--window-s", type=float, default=180.0)
    out.add_argument("--stall-s", type=float, default=60.0)
    out.add_argument("--keep", action="store_true", help="keep the fleet's folder (the volunteers' logs)")
    args = out.parse_args(argv)
    if args.quick:
        args.volunteers, args.minutes, args.sample_s, args.warmup_s, args.window_s = 8, 3.0, 10.0, 30.0, 40.0
    per_swarm = max(1, args.volunteers // args.stages)
    started = time.monotonic()
    samples: list[dict[str, Any]] = []
    best: dict[str, int] = {}  # each driver's largest count read: a record missing from a read is no drop
    with Fleet(prefix="volunteer-bench-soak-", keep_workdir=args.keep) as fleet:
        if args.keep:
            say(f"logs kept in {fleet.workdir}")
        _, maddr = fleet.bootstrap()
        config = {"name": f"soak-{int(time.time()) % 10**8}", "model": {"stages": args.stages},
                  "training": {"batch_size": 32, "in_flight": 4, "eval_every_s": 30}}
        path = write_run(fleet.workdir / "run.yaml", config)
        from swarm.run.runconfig import RunConfig

        run = RunConfig.model_validate(config)
        reader = HostilePeer(run, [maddr], fleet.workdir / "reader.key", process_group=fleet._process_group(),
                             heartbeat_s=5.0)
        procs = [fleet.join(f"layer{k}-{m}", path, f"layer{k}", maddr) for k in range(args.stages)
                 for m in range(per_swarm)]
        say(f"{len(procs)} volunteers joining ({per_swarm} per swarm)")
        try:
            wait_until(lambda: all(len(reader.online(f"layer{k}")) >= per_swarm for k in range(args.stages)),
                       900.0, "every volunteer online", interval_s=5.0)
            say("all online; soaking")
            t0 = time.monotonic()
            lost = 0
            while time.monotonic() - t0 < args.minutes * 60:
                drivers = reader.online("layer0")
                lost = max(lost, sum(r.lost for r in drivers))
                for r in drivers:
                    best[r.peer_id] = max(best.get(r.peer_id, 0), r.trained)
                sample = {"t": round(time.monotonic() - t0, 1), **fleet_memory(fleet),
                          "trained": {r.peer_id: r.trained for r in drivers}, "lost": lost}
                samples.append(sample)
                say(f"t={sample['t']:.0f}s pss {sample['pss_total']:.0f} MiB rss {sample['rss_total']:.0f} MiB, "
                    f"{sample['processes']} processes, trained {sum(best.values())}, lost {lost}")
                for proc in procs:
                    proc.check_running()
                time.sleep(args.sample_s)
        finally:
            reader.close()
            stop_started = time.monotonic()
            fleet.stop(procs)
            stop_s = time.monotonic() - stop_started
        leftovers = fleet.close()
    left = tagged_pids(fleet.tag)
    stalls = stalled_windows(samples, args.warmup_s, args.stall_s)
    first = [s for s in samples if args.warmup_s <= s["t"] < args.warmup_s + args.window_s]
    last = [s for s in samples if samples and s["t"] > samples[-1]["t"] - args.window_s]
    report = {
        "volunteers": len(procs), "per_swarm": per_swarm, "stages": args.stages, "minutes": args.minutes,
        "pss_growth": growth(samples, "pss_total", args.warmup_s, args.window_s),
        "rss_growth": growth(samples, "rss_total", args.warmup_s, args.window_s),
        "pss_mib_per_volunteer": {
            "start": round(sum(s["pss_total"] for s in first) / len(first) / len(procs), 1) if first else None,
            "end": round(sum(s["pss_total"] for s in last) / len(last) / len(procs), 1) if last else None},
        "pss_mib_by_kind_end": {k: samples[-1][f"pss_{k}"] for k in KINDS} if samples else None,
        "stalled_driver_windows": len(stalls), "stalls": stalls[:20],
        "lost_microbatches": samples[-1]["lost"] if samples else None,
        "trained": sum(best.values()),
        "processes_left": len(left), "sigkilled_after_stop": len(leftovers), "stop_s": round(stop_s, 1),
        "volunteers_killed_at_stop": sum(1 for p in procs if p.popen.returncode == -signal.SIGKILL),
        "samples": [{k: v for k, v in s.items() if k != "trained"} for s in samples],
        "machine": machine_notes(),
    }
    return finish(report, "soak", started, args)


if __name__ == "__main__":
    raise SystemExit(main())
