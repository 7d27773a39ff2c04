"""The pipeline against what a user would pick instead, side by side in one run (issue 41, item 5).

    python -m benchmarks.versus --json [--run digits-mlp] [--peers 4] [--time-limit-s 180] [--eval-every-s 2]
                                [--quick]

Three ways to train the run's model (same stages, data, optimizer, batch and seed) to the run's target (test
accuracy, or bits per byte for a language model), each launched as fresh processes and timed from launch:

- ``one_process``: the whole model in one torch process on one thread (the loop of swarm/run/local.py),
  evaluated every ``--eval-every-s`` seconds of training;
- ``pipeline``: `volunteer demo` (a bootstrap peer and one volunteer per stage on this machine, the run's own
  protocol: receipts, spot checks, referees), its volunteers evaluating every ``--eval-every-s``;
- ``hivemind``: ``--peers`` processes, each training the whole model with ``hivemind.Optimizer`` at the settings
  of hivemind's quick start (``use_local_updates=True``, ``target_batch_size=10000``, ``matchmaking_time=3``,
  ``averaging_timeout=10``; ``batch_size_per_step`` the run's batch), over one DHT on loopback, each on its own
  shuffle of the training set; the first peer evaluates its copy every ``--eval-every-s``.

Reported for each: ``seconds_to_target`` (from launch; None if the time limit came first), ``samples`` (trained
by every process together), ``cpu_s`` (every process and its children, p2pd and DHT processes included: the
rusage of waited-for children), ``samples_per_cpu_s``; and ratios against one process and against hivemind.
The machine's load is stated: three runs one after the other on a quiet machine are comparable, a busy one not.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import BenchmarkError, finish, machine_notes, parser as common_parser, ratio, say, write_run

HIVEMIND_QUICKSTART = {"target_batch_size": 10000, "use_local_updates": True, "matchmaking_time": 3.0,
                       "averaging_timeout": 10.0}
STOP_S = 20.0


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    parser = common_parser("versus", __doc__.split("\n\n")[0], "a smoke test: one process and 2 hivemind peers (the "
                           "pipeline's way is `volunteer demo`, tested on its own), a 60 s limit each")
    parser.add_argument("--run", default="digits-mlp", help="a built-in run name or a run YAML (default digits-mlp)")
    parser.add_argument("--peers", type=int, default=4, help="hivemind.Optimizer peers (default 4, its quick start)")
    parser.add_argument("--time-limit-s", type=float, default=180.0, help="per way of training")
    parser.add_argument("--eval-every-s", type=float, default=2.0, help="evaluation cadence of every way")
    parser.add_argument("--only", default="one_process,pipeline,hivemind", help="comma-separated ways to run")
    parser.add_argument("--child", choices=("one_process", "hivemind"), help=argparse_hidden())
    parser.add_argument("--child-args", default="{}", help=argparse_hidden())
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.child, json.loads(args.child_args))
    if args.quick:
        args.peers, args.time_limit_s, args.only = 2, 60.0, "one_process,hivemind"
    from volunteer.config import load_run

    run, run_path = load_run(args.run)
    target = _target(run)
    report: dict[str, Any] = {"run": run.run_id, "target": target, "peers": args.peers,
                              "eval_every_s": args.eval_every_s, "machine": machine_notes()}
    with tempfile.TemporaryDirectory(prefix="versus-") as tmp:
        config = run.model_dump(mode="json")
        config["training"]["eval_every_s"] = args.eval_every_s
        run_file = write_run(Path(tmp) / "run.yaml", config)
        ways = {"one_process": lambda: _one_process(run_file, target, args),
                "pipeline": lambda: _pipeline(run_file, target, args),
                "hivemind": lambda: _hivemind(run_file, target, args)}
        for name in args.only.split(","):
            if name not in ways:
                raise BenchmarkError(f"--only: {name!r} is not one of {', '.join(ways)}")
            say(f"{name}: training {run.name} to {target['kind']} {target['value']}")
            report[name] = ways[name]()
            say(f"{name}: {report[name]}")
    for name in ("pipeline", "hivemind"):
        if name in report and "one_process" in report:
            report[f"{name}_time_vs_one_process"] = ratio(report[name]["seconds_to_target"] or 0,
                                                          report["one_process"]["seconds_to_target"] or 0)
            report[f"{name}_cpu_efficiency_vs_one_process"] = ratio(report[name]["samples_per_cpu_s"],
                                                                    report["one_process"]["samples_per_cpu_s"])
    if "pipeline" in report and "hivemind" in report:
        report["pipeline_time_vs_hivemind"] = ratio(report["pipeline"]["seconds_to_target"] or 0,
                                                    report["hivemind"]["seconds_to_target"] or 0)
        report["pipeline_cpu_efficiency_vs_hivemind"] = ratio(report["pipeline"]["samples_per_cpu_s"],
                                                              report["hivemind"]["samples_per_cpu_s"])
    return finish(report, "versus", started, args)


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


def _target(run: Any) -> dict[str, Any]:
    if run.model.kind in ("mlp",) or getattr(run.training, "target_bits_per_byte", None) is None:
        return {"kind": "accuracy", "value": run.training.target_accuracy}
    return {"kind": "bits_per_byte", "value": run.training.target_bits_per_byte}


def _reached(target: dict[str, Any], accuracy: float | None, bits: float | None) -> bool:
    if target["kind"] == "accuracy":
        return accuracy is not None and accuracy >= target["value"]
    return bits is not None and bits <= target["value"]


# ----- the three ways, each from launch


class _Children:
    """CPU of the processes started from here (and theirs, once waited for): the rusage of waited children."""

    def __enter__(self) -> _Children:
        self.before = _children_cpu()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cpu_s = _children_cpu() - self.before


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _result(seconds: float | None, samples: int, cpu_s: float, **extra: Any) -> dict[str, Any]:
    return {"seconds_to_target": None if seconds is None else round(seconds, 2), "samples": samples,
            "cpu_s": round(cpu_s, 2), "samples_per_cpu_s": round(samples / cpu_s, 1) if cpu_s > 0 else None, **extra}


def _one_process(run_file: Path, target: dict[str, Any], args: Any) -> dict[str, Any]:
    child = {"run": str(run_file), "target": target, "eval_every_s": args.eval_every_s,
             "time_limit_s": args.time_limit_s}
    with _Children() as cpu:
        launched = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "benchmarks.versus", "--child", "one_process", "--child-args",
                               json.dumps(child)], capture_output=True, text=True, timeout=args.time_limit_s + 60)
    if done.returncode != 0:
        raise BenchmarkError(f"one process failed: {done.stderr[-1500:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    seconds = None if out["reached_at"] is None else out["reached_at"] + (out["started_at"] - launched)
    return _result(seconds, out["samples"], cpu.cpu_s, final=out["final"])


def _pipeline(run_file: Path, target: dict[str, Any], args: Any) -> dict[str, Any]:
    flag = ["--target-accuracy" if target["kind"] == "accuracy" else "--target-bits-per-byte", str(target["value"])]
    command = [sys.executable, "-m", "volunteer_cli", "demo", "--run", str(run_file), "--json",
               "--time-limit-s", str(args.time_limit_s), *flag]
    reached = None
    with _Children() as cpu:
        launched = time.monotonic()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            for line in proc.stderr:  # the demo's progress; "reached ..." when a published evaluation met the target
                if reached is None and " reached " in line:
                    reached = time.monotonic() - launched
            out, _ = proc.communicate(timeout=args.time_limit_s + 60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    summary = json.loads(out.strip().splitlines()[-1])
    return _result(reached, summary["samples"], cpu.cpu_s, final={k: summary.get(k) for k in (
        "test_accuracy", "test_bits_per_byte")}, lost_microbatches=summary.get("lost_microbatches"))


def _hivemind(run_file: Path, target: dict[str, Any], args: Any) -> dict[str, Any]:
    procs: list[subprocess.Popen] = []
    reached, samples, final, maddr = None, {}, None, ""
    stop_file = run_file.parent / "stop-hivemind"
    with _Children() as cpu:
        launched = time.monotonic()
        try:
            for index in range(args.peers):
                child = {"run": str(run_file), "target": target, "eval_every_s": args.eval_every_s, "index": index,
                         "initial_peers": [] if index == 0 else [maddr], "time_limit_s": args.time_limit_s,
                         "stop_file": str(stop_file)}
                procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks.versus", "--child", "hivemind",
                                               "--child-args", json.dumps(child)], stdout=subprocess.PIPE,
                                              stderr=subprocess.DEVNULL, text=True, start_new_session=True))
                if index == 0:
                    first = json.loads(procs[0].stdout.readline())  # its address, once its DHT is up
                    maddr = first["maddr"]
            os.set_blocking(procs[0].stdout.fileno(), True)
            for line in procs[0].stdout:  # peer 0's evaluations
                record = json.loads(line)
                samples[0] = record["samples"]
                final = record
                if _reached(target, record.get("accuracy"), record.get("bits_per_byte")):
                    reached = time.monotonic() - launched
                    break
                if time.monotonic() - launched > args.time_limit_s:
                    break
        finally:
            totals = _stop_all(procs, stop_file)
    total = sum(totals.values()) if totals else sum(samples.values())
    return _result(reached, total, cpu.cpu_s, final=final, quickstart=HIVEMIND_QUICKSTART)


def _stop_all(procs: list[subprocess.Popen], stop_file: Path) -> dict[int, int]:
    """Every peer stops at its next step once ``stop_file`` exists, shuts hivemind down (its DHT process, p2pd) and
    prints the samples it trained; one that does not within STOP_S is killed with its process group."""
    import signal

    stop_file.touch()
    totals = {}
    deadline = time.monotonic() + STOP_S
    for index, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            lines = [json.loads(x) for x in out.strip().splitlines() if x.startswith("{")]
            if lines and "trained" in lines[-1]:
                totals[index] = lines[-1]["trained"]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for proc in procs:  # what a peer left behind in its session (its DHT process, p2pd), if anything
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return totals


# ----- the child processes


def _child(kind: str, spec: dict[str, Any]) -> int:
    import torch

    torch.set_num_threads(1)
    from benchmarks.common import load_run_config
    from swarm.run.data import MicroBatches, load_dataset
    from swarm.run.local import evaluate, make_optimizer
    from swarm.run.models import assemble, bits_per_char, build_stages, loss_fn

    started_at = time.monotonic()
    run = load_run_config(Path(spec["run"]))
    data = load_dataset(run.data, run.model)
    torch.manual_seed(0)
    model = assemble(build_stages(run.model))
    optimizer = make_optimizer(model.parameters(), run.optimizer)
    index = spec.get("index", 0)
    batches = MicroBatches(data.x_train, data.y_train, list(range(len(data.x_train))), run.training.batch_size,
                           seed=index)
    dht = None
    if kind == "hivemind":
        import hivemind

        dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                           initial_peers=spec["initial_peers"] or None)
        if index == 0:
            print(json.dumps({"maddr": str(dht.get_visible_maddrs()[0])}), flush=True)
        optimizer = hivemind.Optimizer(dht=dht, run_id="versus", optimizer=optimizer,
                                       batch_size_per_step=run.training.batch_size, verbose=False,
                                       **HIVEMIND_QUICKSTART)
    evaluates = kind == "one_process" or index == 0
    trained, train_s, next_eval, reached_at, final = 0, 0.0, spec["eval_every_s"], None, None
    deadline = started_at + spec["time_limit_s"]
    stop_file = Path(spec["stop_file"]) if spec.get("stop_file") else None
    try:
        while time.monotonic() < deadline and not (stop_file is not None and stop_file.exists()):
            tick = time.monotonic()
            x, y = next(batches)
            loss = loss_fn(run.model, model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            trained += len(x)
            train_s += time.monotonic() - tick
            if evaluates and train_s >= next_eval:
                next_eval += spec["eval_every_s"]
                accuracy, test_loss = evaluate(model, data, run.model)
                bits = bits_per_char(test_loss, data.bytes_per_token) if data.kind == "language_model" else None
                final = {"samples": trained, "accuracy": accuracy, "bits_per_byte": bits,
                         "t": time.monotonic() - started_at}
                if kind == "hivemind":
                    print(json.dumps(final), flush=True)
                elif _reached(spec["target"], accuracy, bits):
                    reached_at = time.monotonic() - started_at
                    break
    except KeyboardInterrupt:
        pass
    finally:
        if kind == "hivemind":
            optimizer.shutdown()
            dht.shutdown()
    if kind == "hivemind":
        print(json.dumps({"trained": trained}), flush=True)
    else:
        print(json.dumps({"started_at": started_at, "reached_at": reached_at, "samples": trained, "final": final}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
