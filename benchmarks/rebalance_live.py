"""`python -m benchmarks.rebalance_live --json`: live rebalancing in a real run of 8 volunteers on this machine.

Two fixed layer0 drivers and six `--swarm auto --rebalance-s R` volunteers (they place themselves by
capacity) train a 4-stage digits run. Once all 8 train, every peer of the least-served middle swarm
is SIGKILLed. Measured: how long until an auto volunteer from another swarm says it is moving there
(in rebalance periods), until it serves, and the micro-batches the drivers lost before the kill,
between the kill and the move (the swarm was empty: those wait or are lost) and after the move.

Goals (issue 15): the move within 2 rebalance periods of the killed records' expiry, no micro-batch
lost after it.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import finish, machine_notes, parser, say, wait_until, write_run
from benchmarks.fleet import Fleet

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hostile import HostilePeer  # noqa: E402

STAGES = 4
DRIVERS = 2
AUTO = 6
START_TIMEOUT_S = 300.0
HEARTBEAT_S = 1.0
TTL_HEARTBEATS = 3.0


def run_config(name: str) -> dict[str, Any]:
    return {"name": name, "model": {"stages": STAGES}, "optimizer": {"name": "adam", "lr": 0.001},
            "training": {"batch_size": 32, "in_flight": 4, "eval_every_s": 10},
            "timeouts": {"heartbeat_s": HEARTBEAT_S, "record_ttl_heartbeats": TTL_HEARTBEATS}}


def main(argv: list[str] | None = None) -> int:
    out = parser("rebalance_live", __doc__, "rebalance every 4 s, 20 s after the move (about 2 minutes)")
    out.add_argument("--rebalance-s", type=float, default=10.0)
    out.add_argument("--after-s", type=float, default=60.0, help="how long to watch after the move")
    args = out.parse_args(argv)
    period_s, after_s = (4.0, 20.0) if args.quick else (args.rebalance_s, args.after_s)
    started = time.monotonic()
    with Fleet(prefix="volunteer-bench-rebalance-") as fleet:
        report = _benchmark(fleet, period_s, after_s)
    report["machine"] = machine_notes()
    return finish(report, "rebalance_live", started, args)


def _benchmark(fleet: Fleet, period_s: float, after_s: float) -> dict[str, Any]:
    from swarm.run.runconfig import RunConfig

    config = run_config(f"rebal-{int(time.time())}")
    run = RunConfig.model_validate(config)
    path = write_run(fleet.workdir / "run.yaml", config)
    _, maddr = fleet.bootstrap()
    procs = [fleet.join(f"layer0-{m}", path, "layer0", maddr) for m in range(DRIVERS)]
    reader = HostilePeer(run, [maddr], fleet.workdir / "reader.key", process_group=fleet._process_group(),
                         heartbeat_s=1.0)
    try:
        autos = []
        for i in range(AUTO):  # one at a time, so each newcomer reads the records of those before it
            autos.append(fleet.join(f"auto-{i}", path, "auto", maddr, "--rebalance-s", str(period_s)))
            wait_until(lambda: "--swarm auto chose" in autos[-1].stdout(), START_TIMEOUT_S, f"auto-{i} to choose")
        procs += autos
        placed = {proc.name: re.search(r"--swarm auto chose (layer\d+)", proc.stdout()).group(1) for proc in autos}
        say(f"auto volunteers placed: {placed}")

        def all_online() -> bool:
            for proc in procs:
                proc.check_running()
            online = sum(len(reader.online(f"layer{k}")) for k in range(STAGES))
            return online == DRIVERS + AUTO and _drivers(reader)["trained"] > 2000

        wait_until(all_online, START_TIMEOUT_S, "all 8 volunteers online and training", interval_s=1.0)
        # the placement settles first (auto volunteers may rebalance among themselves): no move for 2 periods
        last_moves, quiet_since = -1, time.monotonic()

        def settled() -> bool:
            nonlocal last_moves, quiet_since
            moves_now = sum(p.stdout().count(": rebalancing:") for p in autos)
            if moves_now != last_moves:
                last_moves, quiet_since = moves_now, time.monotonic()
            return time.monotonic() - quiet_since >= 2 * period_s and all_online()

        wait_until(settled, 20 * period_s + 60, "the placement to settle (no move for 2 periods)", interval_s=1.0)
        moves_before_kill = last_moves
        counts = {k: len(reader.online(f"layer{k}")) for k in range(STAGES)}
        victim = min(range(1, STAGES), key=lambda k: (counts[k], k))
        victims = [p for p in autos if _serves(p) == f"layer{victim}"]
        before = _drivers(reader)
        rate_before = _rate(reader, 10.0)
        say(f"peers per swarm {counts}; killing the {len(victims)} peer(s) of layer{victim}")
        for proc in victims:
            proc.kill()
        killed_at = time.monotonic()
        at_kill = _drivers(reader)
        movers = [p for p in autos if p not in victims]

        seen_lines = {p.name: p.stdout().count(f"to layer{victim}: rebalancing") for p in movers}

        def moving() -> Any:  # a move to the victim swarm decided after the kill
            return next((p for p in movers if p.stdout().count(f"to layer{victim}: rebalancing") > seen_lines[p.name]),
                        None)

        wait_until(lambda: moving() is not None, 10 * period_s + 60, f"an auto volunteer moving to layer{victim}",
                   interval_s=0.25)
        move_s = time.monotonic() - killed_at
        mover = moving()
        wait_until(lambda: f"online in layer{victim} (moved from" in mover.stdout(), 120, "the mover online",
                   interval_s=0.25)
        online_s = time.monotonic() - killed_at
        wait_until(lambda: any(r.served > 0 for r in reader.online(f"layer{victim}")), 60, "the mover serving",
                   interval_s=0.5)
        at_move = _drivers(reader)
        rate_after = _rate(reader, after_s)
        after = _drivers(reader)
        expiry_s = HEARTBEAT_S * TTL_HEARTBEATS
        moves = sum(p.stdout().count(": rebalancing:") for p in movers)  # movers: the autos not killed
        return {
            "benchmark": "rebalance_live", "volunteers": DRIVERS + AUTO, "stages": STAGES, "rebalance_s": period_s,
            "placed": placed, "peers_per_swarm": counts, "killed_swarm": f"layer{victim}", "killed": len(victims),
            "move_s": round(move_s, 1), "move_periods_after_expiry": round(max(0.0, move_s - expiry_s) / period_s, 2),
            "mover_online_s": round(online_s, 1), "moves_before_kill": moves_before_kill,
            "moves_after_kill": moves - (moves_before_kill - _moves_of(victims)),
            "lost_before_kill": before["lost"], "lost_kill_to_move": at_move["lost"] - at_kill["lost"],
            "lost_after_move": after["lost"] - at_move["lost"],
            "samples_per_s_before": round(rate_before, 1), "samples_per_s_after": round(rate_after, 1),
            "after_vs_before": round(rate_after / rate_before, 3) if rate_before > 0 else None,
            "goal_met": move_s - expiry_s <= 2 * period_s and after["lost"] == at_move["lost"],
        }
    finally:
        reader.close()
        fleet.stop(procs)


def _moves_of(procs: list[Any]) -> int:
    return sum(p.stdout().count(": rebalancing:") for p in procs)


def _serves(proc: Any) -> str:
    """The swarm an auto volunteer serves now (its last 'online in' line)."""
    found = re.findall(r"online in (layer\d+)", proc.stdout())
    return found[-1] if found else ""


_SEEN: dict[str, tuple[int, int]] = {}  # driver peer id -> the most (trained, lost) its records said


def _drivers(reader: HostilePeer) -> dict[str, int]:
    """Samples trained and micro-batches lost by every layer0 driver so far, those that left included
    (an auto volunteer that moved out of layer0 keeps its count)."""
    for r in reader.membership.read("layer0"):
        trained, lost = _SEEN.get(r.peer_id, (0, 0))
        _SEEN[r.peer_id] = (max(trained, r.trained), max(lost, r.lost))
    return {"trained": sum(t for t, _ in _SEEN.values()), "lost": sum(lost for _, lost in _SEEN.values())}


def _rate(reader: HostilePeer, window_s: float) -> float:
    start, t0 = _drivers(reader)["trained"], time.monotonic()
    time.sleep(window_s)
    return (_drivers(reader)["trained"] - start) / (time.monotonic() - t0)


if __name__ == "__main__":
    raise SystemExit(main())
