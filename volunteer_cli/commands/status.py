"""`volunteer status`: every swarm of a run, read from the DHT (``--serve PORT``: the run health page,
volunteer_cli/commands/status_serve.py)."""

from __future__ import annotations

import argparse
import json
import time

from volunteer_cli.main import UserError
from volunteer.config import load_run
from volunteer.snapshot import short_id

STATUS_LISTEN = ["/ip4/127.0.0.1/tcp/0"]  # a short-lived reader: nobody needs to dial it
EMPTY_RETRY_WAITS_S = (0.0, 0.3, 0.6)  # further looks at swarms that read empty, and the pause before each
# when every swarm read empty (a whole run with nobody is rare, and a loaded machine's fresh reader can miss every
# record for a second or two: CI saw it), a few longer looks before saying so
ALL_EMPTY_RETRY_WAITS_S = (0.0, 0.5, 1.0, 1.5)


def run_status(args: argparse.Namespace) -> int:
    run, _ = load_run(args.run)
    from volunteer_cli.commands.common import check_initial_peers

    check_initial_peers(args.initial_peers)
    initial_peers = args.initial_peers or run.bootstrap_peers
    if not initial_peers:
        raise UserError("no bootstrap peers: pass --initial-peers MADDR or list bootstrap_peers in the run config")
    from volunteer_cli.commands.common import setup_process

    watchdog, shutdown = setup_process(args.verbose)
    from swarm.dht.lightdht import ReaderSettings, light_hivemind, start_reader

    light_hivemind()  # a reader needs hivemind's DHT, not torch: 1-5 s less (swarm/dht/lightdht.py)
    from swarm.dht.dht import DHTStartError, make_validators
    from swarm.dht.membership import Membership

    dht = None
    try:
        settings = ReaderSettings(initial_peers=list(initial_peers), host_maddrs=STATUS_LISTEN,
                                  start_timeout_s=args.timeout_s, process_group=watchdog.pgid)
        try:
            dht = start_reader(settings, make_validators(run.run_id, run.swarm_names, None))
        except DHTStartError as exc:
            raise UserError(str(exc)) from None
        membership = Membership(dht, run, b"")
        if args.serve is not None:
            from volunteer_cli.commands.status_serve import serve

            from volunteer_cli.commands.common import resolve_data_dir

            history = resolve_data_dir(args.data_dir, args.prefs) / "health" / f"{run.run_id}.jsonl"
            serve(lambda: build_report(run, membership.read_all(), now=time.time()), args.serve_host, args.serve,
                  args.every_s, shutdown.event, announce=lambda text: print(text, flush=True), history_path=history)
            return 0
        views = membership.read_all()
        # a fresh client's first lookups can miss records a moment old (under load two in a row missed a record
        # a reader in another process saw: test_foundation): a few more looks, briefly apart, before "nobody"
        waits = ALL_EMPTY_RETRY_WAITS_S if not any(views.values()) else EMPTY_RETRY_WAITS_S
        for wait_s in waits:
            empty = [name for name, records in views.items() if not records]
            if not empty:
                break
            if wait_s:
                time.sleep(wait_s)
            views.update(membership.read_all(empty))
    finally:
        if dht is not None:
            dht.shutdown()
        watchdog.stop()
    report = build_report(run, views, now=time.time(), this_machine=_this_machine(args, run.run_id))
    print(json.dumps(report) if args.json else render_report(report))
    return 0  # everything is released: the command ends without the slow interpreter teardown (main.entry)


def _this_machine(args: argparse.Namespace, run_id: str):
    """What the volunteers of this data dir gave the run (volunteer/contribution.py), None if nothing."""
    from volunteer.contribution import machine_tallies
    from volunteer_cli.commands.common import resolve_data_dir

    total, identities = machine_tallies(resolve_data_dir(args.data_dir, args.prefs), run_id)
    return (total, identities) if total.sessions else None


def build_report(run, views: dict, now: float, this_machine=None) -> dict:
    swarms = {}
    summary = {}
    for name in run.swarm_names:
        records = views.get(name, [])
        rows = []
        for r in records:
            rows.append({
                "peer_id": r.peer_id, "state": r.state, "age_s": round(max(0.0, now - r.updated_at), 1),
                "version": r.version, "throughput": round(r.throughput, 2), "loss": r.loss_or_none,
                "clock": r.clock, "shard": r.shard_or_none, "served": r.served,
                "trained": r.trained, "lost": r.lost, "staleness": _staleness(r),
                "mbps_in": r.mbps_in if r.mbps_in >= 0 else None, "mbps_out": r.mbps_out if r.mbps_out >= 0 else None,
                "capacity": round(r.capacity, 1) if r.capacity > 0 else None, "movable": r.movable,
                # can other hosts dial it (swarm/dht/reachability.py): True, False (behind NAT), None (not known)
                "reachable": {1: True, 0: False}.get(r.reachable),
                # seconds it wanted to train and completed no micro-batch (None: not published or not online)
                "stalled_s": r.stalled_s if r.stalled_s >= 0 and r.state == "online" else None,
                # the run's online drivers its stage refuses right now, of those it knows (None: not published)
                "drivers_refused": r.drivers_refused if r.drivers_refused >= 0 else None,
                "drivers_seen": r.drivers_seen if r.drivers_seen >= 0 else None, "ban_reason": r.ban_reason,
            })
        online = [r for r in records if r.state == "online"]
        measured = [r.staleness_or_none for r in online if r.staleness_or_none is not None]
        summary[name] = {"online": len(online), "total": len(records),
                         "throughput": round(sum(r.throughput for r in online), 2), "empty": not online,
                         # the worst copy of the swarm: how old the gradients it applies are, in updates
                         "staleness_p95": max((s[1] for s in measured), default=None),
                         "staleness_max": max((s[2] for s in measured), default=None),
                         # Mb/s through the swarm's online peers (each counts what it sent and received)
                         "mbps_in": round(sum(max(0.0, r.mbps_in) for r in online), 3),
                         "mbps_out": round(sum(max(0.0, r.mbps_out) for r in online), 3),
                         # the longest an online peer of the swarm went without a completed micro-batch
                         "stalled_s": max((r.stalled_s for r in online if r.stalled_s >= 0), default=None)}
        swarms[name] = rows
    from swarm.dht.alarms import run_alarms
    from swarm.dht.membership import idle_reason

    from swarm.dht.completion import run_complete

    report = {"run_id": run.run_id, "swarms": swarms, "summary": summary,
              "idle_reason": idle_reason(views, run.swarm_names),
              "alarms": run_alarms(views, run.swarm_names),  # swarm/dht/alarms.py: refusing stages, stalls
              "complete": run_complete(run.training, views)}  # "" while the run has not reached its end
    from swarm.dht.published import representative_evaluation

    latest, current = representative_evaluation(views.get("layer0", []), run.training.eval_every_s)
    if latest is not None:
        from volunteer.snapshot import evaluation_is_stale

        # The evaluation's own time (records before it carried one: the heartbeat that published it)
        measured_at = latest.eval_at if latest.eval_at >= 0 else None
        age_s = round(max(0.0, now - measured_at), 1) if measured_at is not None else None
        from volunteer.snapshot import bits_per_byte

        accuracy = latest.test_accuracy if latest.test_accuracy >= 0 else None
        report["evaluation"] = {"test_accuracy": accuracy, "test_loss": latest.test_loss,
                                "test_bits_per_byte": (round(bits_per_byte(latest.test_loss), 4)
                                                       if accuracy is None and latest.test_loss >= 0 else None),
                                "samples": latest.eval_samples, "by": latest.peer_id,
                                "measured_at": measured_at, "age_s": age_s, "copy_version": latest.eval_version,
                                "stale": evaluation_is_stale(age_s, run.training.eval_every_s),
                                "eval_every_s": run.training.eval_every_s,
                                # how many drivers' current evaluations the figure is the median of, and their range
                                "drivers": len(current), "range": _figure_range(current)}
    heals = {name: sum(r.heals for r in views.get(name, [])) for name in run.swarm_names}
    report["heals"] = heals
    if this_machine is not None:  # a Tally, or (Tally, identities it sums)
        tally, identities = this_machine if isinstance(this_machine, tuple) else (this_machine, 1)
        report["this_machine"] = tally.to_json()
        report["this_machine_identities"] = identities
    return report


def _figure_range(records: list) -> list[float] | None:
    if len(records) < 2:
        return None
    figures = [r.test_accuracy if r.test_accuracy >= 0 else r.test_loss for r in records]
    return [round(min(figures), 4), round(max(figures), 4)]


def _staleness(record) -> dict | None:
    figures = record.staleness_or_none
    if figures is None:
        return None
    mean, p95, maximum = figures
    return {"mean": round(mean, 2), "p95": round(p95, 1), "max": maximum}


def render_report(report: dict) -> str:
    from swarm.dht.alarms import STALL_ALARM_S

    lines = [f"run {report['run_id']}"]
    if report.get("complete"):
        lines.append(f"  RUN COMPLETE: {report['complete']}; its volunteers take no more work")
    if report.get("idle_reason"):
        lines.append(f"  NOT TRAINING: {report['idle_reason']}")
    lines += [f"  RUN ALARM: {alarm}" for alarm in report.get("alarms", [])]
    if "evaluation" in report:
        from volunteer.snapshot import describe_evaluation

        ev = report["evaluation"]
        figure = describe_evaluation(ev["test_accuracy"], ev["test_loss"], ev["age_s"], ev["eval_every_s"])
        loss = f", test loss {ev['test_loss']:.3f}" if ev["test_accuracy"] is not None else ""  # else in the figure
        by = (f"the median of {ev['drivers']} drivers', {ev['range'][0]:.3g}-{ev['range'][1]:.3g}"
              if ev.get("drivers", 1) > 1 and ev.get("range") else f"by {short_id(ev['by'])}")
        lines.append(f"  {figure}{loss} after {ev['samples']} samples ({by})")
    for name, rows in report["swarms"].items():
        s = report["summary"][name]
        flag = "  <-- NO ONLINE PEER: the pipeline cannot pass this layer" if s["empty"] else ""
        healed = report.get("heals", {}).get(name, 0)
        flag += f"  ({healed} heal{'s' if healed != 1 else ''} of sick copies)" if healed else ""
        stale = (f", staleness p95 {s['staleness_p95']:.0f} max {s['staleness_max']} updates"
                 if s.get("staleness_max") is not None else "")
        lines.append(f"{name}: {s['online']} online / {s['total']} peers, {s['throughput']:.1f} samples/s{stale}{flag}")
        for row in rows:
            loss = f"{row['loss']:.3f}" if row["loss"] is not None else "-"
            st = row.get("staleness")
            st_text = f"  staleness {st['mean']:.1f}/{st['p95']:.0f}/{st['max']}" if st else ""
            if row.get("mbps_in") is not None:
                st_text += f"  {row['mbps_in']:.2f}/{row['mbps_out']:.2f} Mb/s in/out"
            if row.get("reachable") is False:
                st_text += "  NOT DIALLABLE (behind NAT: nobody routes to it)"
            if row.get("stalled_s") is not None and row["stalled_s"] >= STALL_ALARM_S:
                st_text += f"  STALLED {row['stalled_s']:.0f}s (no micro-batch completed)"
            if row.get("drivers_refused"):
                st_text += f"  refuses {row['drivers_refused']}/{row['drivers_seen']} drivers"
            lines.append(f"  {short_id(row['peer_id']):>8}  {row['state']:<9} seen {row['age_s']:>5.1f}s ago  "
                         f"v{row['version']}  {row['throughput']:.1f}/s  loss {loss}  clock {row['clock']}{st_text}")
    if report.get("this_machine"):
        from volunteer.contribution import Tally, describe_tally

        mine = Tally.from_json(report["this_machine"])
        identities = report.get("this_machine_identities", 1)
        lines.append(f"this machine gave the run {describe_tally(mine)} over {mine.sessions} "
                     f"session{'s' if mine.sessions != 1 else ''}"
                     + (f" of {identities} volunteer identities (a volunteer's farewell counts its own)"
                        if identities > 1 else ""))
    return "\n".join(lines)
