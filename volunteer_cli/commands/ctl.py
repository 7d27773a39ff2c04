"""`volunteer ctl status|pause|finish|resume|quit`: talk to a node running on this machine.

The node serves a control socket in its data dir (volunteer/control.py). Without ``--socket``,
``ctl`` asks every socket in ``<data_dir>/control/`` and picks the one live node, narrowed by
``--swarm`` and ``--run`` when several run; it never needs to know the swarm or the bootstrap peers.
`volunteer status` is the other view: every swarm of a run, read from the DHT.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from volunteer_cli.main import UserError

QUIT_WAIT_S = 30.0  # a clean leave: drain, save a checkpoint, announce offline, stop the DHT
QUIT_POLL_S = 0.2
EXIT_NOT_RUNNING = 1


def run_ctl(args: argparse.Namespace) -> int:
    from volunteer.control import ControlError, send_command

    try:
        socket = Path(args.socket).expanduser() if args.socket else _discover(args)
        reply = send_command(socket, args.action, timeout_s=args.timeout_s)
    except ControlError as exc:  # not running (exit 1), unlike a usage mistake (UserError, exit 2)
        print(f"volunteer ctl: {exc}", file=sys.stderr)
        return EXIT_NOT_RUNNING
    snapshot = reply["snapshot"]
    stopped = None
    if args.action == "quit":
        stopped = _wait_gone(socket, args.wait_s)
    _print(args, socket, snapshot, stopped)
    return 0


def _discover(args: argparse.Namespace) -> Path:
    from volunteer.control import NodeNotRunning, control_dir, live_nodes

    data_dir = _data_dir(args)
    nodes = [(path, snap) for path, snap in live_nodes(data_dir)
             if (not args.swarm or snap.get("swarm") == args.swarm)
             and (not args.run or args.run in (snap.get("run_name"), snap.get("run_id")))]
    if len(nodes) == 1:
        return nodes[0][0]
    narrowed = " matching " + " ".join(f"--{k} {v}" for k, v in (("swarm", args.swarm), ("run", args.run)) if v)
    if not nodes:
        raise NodeNotRunning(
            f"no running node{narrowed if args.swarm or args.run else ''} in {control_dir(data_dir)}: "
            "start one with `volunteer join --headless` (or `volunteer service install`), "
            "or pass --data-dir if it uses another data dir"
        )
    listing = "\n".join(f"  {path}  ({snap.get('run_id')} {snap.get('swarm')}, {snap.get('state')})"
                        for path, snap in nodes)
    raise UserError(f"several nodes run here; choose one with --swarm layerK, --run NAME or --socket PATH:\n{listing}")


def _data_dir(args: argparse.Namespace) -> Path:
    from volunteer.config import load_preferences
    from volunteer.paths import user_data_dir

    prefs_dir = load_preferences(args.prefs).data_dir if not args.data_dir else None
    return Path(args.data_dir or prefs_dir or user_data_dir()).expanduser()


def _wait_gone(socket: Path, wait_s: float) -> bool:
    """After quit: True once the node no longer answers (it closes its socket last)."""
    from volunteer.control import ControlError, NodeNotRunning, send_command

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            send_command(socket, "status", timeout_s=max(0.5, min(2.0, deadline - time.monotonic())))
        except NodeNotRunning:
            return True
        except ControlError:
            pass  # shutting down: it may hang up on us
        time.sleep(QUIT_POLL_S)
    return False


def _print(args: argparse.Namespace, socket: Path, snapshot: dict, stopped: bool | None) -> None:
    if args.json:
        out = {**snapshot, "control_socket": str(socket)}
        if stopped is not None:
            out["stopped"] = stopped
        print(json.dumps(out))
        return
    if args.action == "quit":
        print("the node left its swarm and stopped" if stopped else
              f"asked the node to quit; it is still leaving after {args.wait_s:g} s")
        return
    if args.action != "status" and snapshot.get("state") in ("joining", "syncing"):
        print(f"the node is still {snapshot['state']}; it will {args.action} as soon as it is online")
    print(render_status(snapshot))


def _read_age(swarm: dict) -> str:
    """' (read 24 s ago)' for a swarm the node read a while ago (volunteer/snapshot.py ``view_age_s``)."""
    from volunteer.snapshot import VIEW_AGE_SHOWN_S

    read_at = swarm.get("read_at")
    age_s = time.time() - read_at if isinstance(read_at, (int, float)) else 0.0
    return f" (read {age_s:.0f} s ago)" if age_s >= VIEW_AGE_SHOWN_S else ""


def render_status(snap: dict) -> str:
    state = snap.get("state", "?")
    reason = snap.get("reason") or ""
    lines = [f"{state}" + (f": {reason}" if reason else (": training" if state == "online" else ""))]
    if snap.get("stalled_s"):  # it wants to train and completed nothing for that long (the dashboard's STALLED)
        lines.append(f"STALLED: no micro-batch completed for {snap['stalled_s']:.0f} s while it wants to train")
    lines += [f"RUN ALARM: {alarm}" for alarm in snap.get("run_alarms") or ()]
    peer = (snap.get("peer_id") or "")[-8:] or "(no peer id yet)"
    lines.append(f"node {peer} in {snap.get('swarm')} of run {snap.get('run_id')} on {snap.get('device')}")
    work = [f"clock {snap.get('clock', 0):.0f} samples", f"{snap.get('samples_per_s', 0.0):.1f} samples/s",
            f"{snap.get('microbatches_served', 0)} micro-batches served"]
    if snap.get("loss") is not None:
        work.append(f"loss {snap['loss']:.3f}")
    if snap.get("staleness_max") is not None:  # updates applied here between a micro-batch's forward and backward
        work.append(f"staleness {snap.get('staleness_mean') or 0.0:.1f} mean, {snap.get('staleness_p95') or 0.0:.0f} "
                    f"p95, {snap['staleness_max']} max (updates)"
                    + (f", weights predicted {snap['predicted_ahead']} ahead" if snap.get("predicted_ahead") else ""))
    if snap.get("spot_checked"):  # other peers' outputs this node had recomputed and compared
        work.append(f"spot checks {snap['spot_checked']} ({snap.get('spot_caught', 0)} caught"
                    + (f", {snap['spot_outweighed']} not penalised: their accusers had less validated work"
                       if snap.get("spot_outweighed") else "") + ")")
    if snap.get("data_plane"):  # layer0: its micro-batches stage to stage, or relayed by it (swarm/pipeline/control/push_*.py, stage/push.py)
        work.append(f"transfer {snap['data_plane']}")
    if snap.get("test_accuracy") is not None or snap.get("test_loss") is not None:
        from volunteer.snapshot import describe_evaluation

        work.append("run " + describe_evaluation(snap.get("test_accuracy"), snap.get("test_loss"),
                                                 snap.get("evaluation_age_s"), snap.get("eval_every_s", 10.0),
                                                 snap.get("evaluation_stale")))
    lines.append(", ".join(work))
    swarms = snap.get("swarms") or []
    if swarms:
        lines.append("swarms: " + "  ".join(f"{s['name']} {s['online']} online{_read_age(s)}" for s in swarms))
    if snap.get("total_sessions"):  # what this identity gave the run, all sessions (volunteer/contribution.py)
        from volunteer.contribution import format_hours

        lines.append(f"contribution: {snap.get('session_samples', 0):,} samples this session; in total "
                     f"{snap.get('total_microbatches', 0):,} micro-batches ({snap.get('total_samples', 0):,} samples), "
                     f"{format_hours(snap.get('total_online_s', 0.0))} online over {snap['total_sessions']} session(s)")
    if snap.get("log_path"):
        lines.append(f"log: {snap['log_path']}")
    lines.append(f"up {_duration(snap.get('uptime_s', 0.0))}")
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    from volunteer.policy import format_duration

    return format_duration(seconds)
