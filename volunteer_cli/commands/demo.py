"""`volunteer demo`: a whole swarm on this machine, as real processes on loopback, trained end to end.

It starts a bootstrap peer and M headless volunteers per layer swarm, watches the swarms through
the DHT like any other peer would, prints progress until the target (a classifier's test accuracy,
a language model's test bits per byte) or the time limit,
then shuts every process down (their DHT processes and p2pd too) on success, failure or Ctrl+C, and
removes its /tmp/volunteer-demo-* folder unless the demo failed (then the logs there say why).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml

from volunteer_cli.commands.demo_monitor import Monitor, read_figures
from volunteer_cli.main import UserError
from volunteer.config import load_run
from volunteer_cli.forkserver import (ForkRefused, Forked, ForkServer, SpawnCancelled, available as forks_available,
                                     spawn_or_exec)
from volunteer.hygiene import die_with_parent_hook
from volunteer.snapshot import bits_per_byte, evaluation_figure

logger = logging.getLogger(__name__)

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
DEMO_HEARTBEAT_S = 2.0
POLL_S = 2.0
START_POLL_S = 0.5  # until every swarm is online: training starts, and is said, up to 1.5 s sooner
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0
READ_BUDGET_S = 4.0  # one poll's reads of every swarm, together: a loaded DHT delays a line by this much at most
CHILD_NICE = 5  # the volunteers run this much nicer than the monitor, which the user watches (see Children)
BLOCKED_MARKER = "no micro-batch flows: "  # what a layer0 driver logs (swarm/pipeline/control/hops.py Blockage)
FLOWING_MARKER = "micro-batches flow again"
EXIT_INTERRUPTED = 130


def keep_workdir(code: int) -> bool:
    """Keep the demo's folder (logs, checkpoints) only when the demo failed: its logs say why. A success or
    a Ctrl+C leaves nothing behind in /tmp."""
    return code not in (0, EXIT_INTERRUPTED) or bool(os.environ.get("VOLUNTEER_KEEP_DEMO"))


def _clean_up(workdir: Path, code: int, say) -> None:
    if keep_workdir(code):
        say(f"the volunteers' logs are kept in {workdir} (remove it when done)")
        return
    try:
        shutil.rmtree(workdir)
    except OSError as exc:
        say(f"could not remove {workdir}: {exc}; remove it by hand")


class Children:
    """The demo's processes: each in its own session, each told to stop if the demo dies. They are forked from a fork
    server (volunteer_cli/forkserver.py) that imports torch and hivemind once for all of them, where the platform has
    one: five processes each importing them side by side took ~11 s of CPU before the first was online on 2 cores."""

    def __init__(self, workdir: Path, stop: threading.Event | None = None):
        self.workdir = workdir
        self.stop_event = stop or threading.Event()  # set by a Ctrl+C: a start waiting on the fork server gives up
        self.procs: list[tuple[str, subprocess.Popen | Forked]] = []
        # Not the lowest priority (the demo is the user's explicit request, and its timings compare with earlier
        # ones), but CHILD_NICE below the monitor: 8 volunteers at the monitor's priority on 2 cores starved it
        # (its lines stopped for 3 minutes while the swarms trained, then it reported a time limit at once).
        self.env = {**os.environ, "VOLUNTEER_DATA_DIR": str(workdir / "data"), "PYTHONUNBUFFERED": "1",
                    "VOLUNTEER_LOW_PRIORITY": "0"}
        self.forks: ForkServer | None = None
        if forks_available() and not os.environ.get("VOLUNTEER_DEMO_EXEC"):
            try:  # started first: it imports while the bootstrap peer's identity and the volunteers' are made
                self.forks = ForkServer(env=self.env, preexec_fn=_nicer(die_with_parent_hook(), CHILD_NICE),
                                        log=str(workdir / "forkserver.log"))
            except (OSError, ForkRefused) as exc:
                logger.info("no fork server (%s): each volunteer is its own program", exc)

    def start(self, name: str, args: list[str]) -> subprocess.Popen | Forked:
        out = open(self.workdir / f"{name}.log", "wb")
        try:  # a forked child runs CHILD_NICE nicer with the server, an exec'ed one by the hook
            proc = spawn_or_exec(self.forks, args, self.env, out.fileno(), out.fileno(),
                                 [sys.executable, "-m", "volunteer_cli", *args],
                                 _nicer(die_with_parent_hook(), CHILD_NICE), die_with_parent=True,
                                 cancelled=self.stop_event.is_set)
        except SpawnCancelled:
            raise KeyboardInterrupt from None
        finally:
            out.close()
        self.procs.append((name, proc))
        return proc

    def log(self, name: str) -> str:
        try:
            return (self.workdir / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""

    def dead(self) -> list[str]:
        return [name for name, proc in self.procs if proc.poll() is not None]

    def stop(self, say) -> None:
        """Volunteers first (they announce offline), then the bootstrap peer; SIGKILL what hangs."""
        ordered = [p for p in self.procs if p[0] != "bootstrap"] + [p for p in self.procs if p[0] == "bootstrap"]
        for group in (ordered[:-1], ordered[-1:]):
            for _, proc in group:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for name, proc in group:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    say(f"{name} did not stop in {STOP_TIMEOUT_S:.0f} s; killing it")
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    proc.wait(5)
        if self.forks is not None:
            self.forks.close()


def _nicer(hook, increment: int):
    """A preexec hook that runs ``hook`` then lowers the child's CPU priority by ``increment``."""

    def run() -> None:
        if hook is not None:
            hook()
        os.nice(increment)

    return run


def run_demo(args: argparse.Namespace) -> int:
    run, run_path = load_run(args.run)
    if args.per_swarm < 1:
        raise UserError("--per-swarm must be at least 1")
    target = demo_target(run, args.target_accuracy, getattr(args, "target_bits_per_byte", None))
    from volunteer_cli.commands.common import setup_process

    watchdog, shutdown = setup_process(args.verbose)
    out = sys.stderr if args.json else sys.stdout

    def say(text: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {text}", file=out, flush=True)

    workdir = Path(tempfile.mkdtemp(prefix="volunteer-demo-"))
    demo_run = workdir / "run.yaml"
    config = run.model_dump(mode="json")
    config["timeouts"]["heartbeat_s"] = DEMO_HEARTBEAT_S  # a local demo can afford a faster heartbeat
    demo_run.write_text(yaml.safe_dump(config, sort_keys=False))
    children = Children(workdir, shutdown.event)
    started = time.monotonic()
    result = {"test_accuracy": None, "test_loss": None, "test_bits_per_byte": None, "samples": 0, "seconds": 0.0,
              "lost_microbatches": 0}
    code = 1
    try:
        say(f"demo of run {run.run_id} ({run_path}): 1 bootstrap peer + {args.per_swarm} volunteer(s) "
            f"per swarm x {run.model.stages} swarms, logs in {workdir}")
        volunteers = run.model.stages * args.per_swarm
        # the volunteers' identities and their work, made while the bootstrap peer starts (each volunteer would
        # otherwise prove its own at once, on a machine busy starting all of them: 5-10 s more to "online" on 2 cores)
        # Without a fork server the bootstrap peer is started before the identities' thread: a child started with a
        # preexec_fn (ours: die with the demo, run nicer) runs Python's at-fork hooks, and a module the thread imports
        # meanwhile can register one between the "before" and "after" calls (concurrent.futures: "RuntimeError: release
        # unlocked lock", printed by a demo on a fresh clone). The fork server was started before any thread, and
        # its first child waits for its imports: the identities are made meanwhile. The volunteers start once they are.
        boot_args = ["bootstrap", "--listen", LOOPBACK, "--json", "--identity", str(workdir / "bootstrap.key")]
        bootstrap = None if children.forks is not None else children.start("bootstrap", boot_args)
        identities = _Identities(workdir / "data" / "identities", volunteers, run.integrity.identity_bits,
                                 shutdown.event)
        bootstrap = bootstrap or children.start("bootstrap", boot_args)
        maddr = _bootstrap_address(children, bootstrap, shutdown)
        identities.wait(say)
        say(f"bootstrap peer at {maddr}; from another terminal, `volunteer status --run {demo_run} --initial-peers "
            f"{maddr}` reads the run, and with `--serve 8080` serves its health page on http://127.0.0.1:8080/")
        for k in range(run.model.stages):
            for m in range(args.per_swarm):
                children.start(f"layer{k}-{m}", ["join", "--run", str(demo_run), "--swarm", f"layer{k}",
                                                 "--initial-peers", maddr, "--listen", LOOPBACK, "--headless",
                                                 "--device", args.device, *(["-" + "v" * args.verbose]
                                                                             if args.verbose else [])])
        say(f"started {run.model.stages * args.per_swarm} volunteers; waiting for every swarm to come online")
        watched, _ = load_run(str(demo_run))  # the demo's heartbeat: a record 3 of them old is offline
        code, result = _watch(watched, maddr, children, shutdown, watchdog, say, target, args.time_limit_s, started)
    except UserError:
        raise
    except KeyboardInterrupt:
        say("interrupted")
        code = EXIT_INTERRUPTED
    finally:
        say("stopping all volunteers and the bootstrap peer")
        children.stop(say)
        watchdog.stop()
        result["seconds"] = round(time.monotonic() - started, 1)
        _clean_up(workdir, code, say)
    _report(result, target, say)
    if args.json:
        print(json.dumps(result), flush=True)
    return code


class _Identities:
    """``count`` identity files in ``folder`` (the slots volunteers claim, swarm/dht/dht.py ``claim_identity``), each
    with its proof of work kept beside it (swarm/integrity/identity_work.py), made in two threads (scrypt and the RSA
    key generation run outside the GIL)."""

    def __init__(self, folder: Path, count: int, bits: int, stop: threading.Event):
        self.folder, self.count, self.bits, self.stop = folder, count, bits, stop
        self.started = time.monotonic()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._make, name="demo-identities", daemon=True)
        self.thread.start()

    def _make(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from swarm.dht.dht import ensure_identity, identity_peer_id
        from swarm.integrity.identity_work import identity_work

        def one(slot: int) -> None:
            path = self.folder / f"identity-{slot}.key"
            ensure_identity(path)
            identity_work(path, identity_peer_id(path), self.bits, should_stop=self.stop.is_set)

        try:
            with ThreadPoolExecutor(max_workers=2, thread_name_prefix="demo-identity") as pool:
                list(pool.map(one, range(self.count)))
        except Exception as exc:  # the volunteers make their own then: slower, not broken
            self.error = exc

    def wait(self, say) -> None:
        if self.thread.is_alive():
            say(f"proving the work of {self.count} volunteer identities ({self.bits} bits each, about a second of CPU "
                "apiece: in a public run, identities cost something)")
        while self.thread.is_alive() and not self.stop.is_set():
            self.thread.join(0.2)
        if self.stop.is_set():
            raise KeyboardInterrupt
        if self.error is not None:
            say(f"could not prepare the volunteers' identities ({self.error}); each volunteer makes its own")
        else:
            logger.info("demo identities ready after %.1f s", time.monotonic() - self.started)


def _bootstrap_address(children: Children, proc: subprocess.Popen, shutdown) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and not shutdown.event.is_set():
        # its stdout and stderr share the log: with -v/-vv, log lines come before its JSON line (session 27: `volunteer
        # demo -vv` stopped at hivemind's first debug line)
        for line in children.log("bootstrap").split("\n")[:-1]:
            if not line.startswith("{"):
                continue
            try:
                return json.loads(line)["maddrs"][0]
            except (ValueError, KeyError, IndexError, TypeError):
                raise UserError(f"the bootstrap peer printed something unexpected: {line[:200]}") from None
        if proc.poll() is not None:
            raise UserError(f"the bootstrap peer exited: {children.log('bootstrap')[-1000:]}")
        time.sleep(0.1)
    raise KeyboardInterrupt if shutdown.event.is_set() else UserError("the bootstrap peer did not start in time")


def _watch(run, maddr: str, children: Children, shutdown, watchdog, say, target: Target, time_limit_s: float,
           started: float) -> tuple[int, dict]:
    from swarm.dht.dht import make_validators
    from swarm.dht.lightdht import ReaderSettings, start_reader
    from swarm.dht.membership import Membership

    # a reader in this process (swarm/dht/lightdht.py): no DHT process of its own, no torch, while the volunteers
    # start on the same cores (start_dht's forked DHT and its torch import: ~2 s of CPU at the worst moment)
    dht = start_reader(ReaderSettings(initial_peers=[maddr], host_maddrs=[LOOPBACK], process_group=watchdog.pgid),
                       make_validators(run.run_id, run.swarm_names, None))
    result = {"test_accuracy": None, "test_loss": None, "test_bits_per_byte": None, "samples": 0, "seconds": 0.0,
              "lost_microbatches": 0}
    try:
        membership = Membership(dht, run, b"")
        monitor = Monitor(run.swarm_names, started)
        read_at = time.monotonic()
        while not shutdown.event.wait(POLL_S if monitor.all_online_at is not None else START_POLL_S):
            dead = children.dead()
            if dead:
                say(f"error: {dead[0]} exited unexpectedly; its log ends with:\n{children.log(dead[0])[-1500:]}")
                return 1, result
            views = membership.read_all(timeout_s=READ_BUDGET_S)  # bounded: the output stays steady
            now = time.monotonic()
            if membership.fresh:
                read_at = now
            figures = read_figures(views, run.swarm_names, run.training.eval_every_s)
            for line in monitor.observe(figures, now, time.time(), now - read_at):
                say(line)
            accuracy, loss = figures.test_accuracy, figures.test_loss
            result.update(test_accuracy=accuracy, test_loss=loss, samples=figures.samples,
                          test_bits_per_byte=round(bits_per_byte(loss), 4) if target.kind == "bits" and loss is not None
                          else None, lost_microbatches=figures.lost)
            if monitor.stall_notice_due(now):
                logs = [children.log(name) for name, _ in children.procs if name.startswith("layer0-")]
                reason = blocked_reason(logs) or "the layer0 drivers do not say why"
                say(f"every swarm is online but no sample trained for {monitor.stalled_s(now):.0f} s: {reason}")
            if target_reached(target, accuracy, loss):
                say(f"reached {evaluation_figure(accuracy, loss)} (target {target})")
                return 0, result
            if now - started > time_limit_s:
                say(f"time limit of {time_limit_s:.0f} s reached before {target}")
                return 1, result
        say("interrupted")
        return EXIT_INTERRUPTED, result
    finally:
        dht.shutdown()


def blocked_reason(logs: list[str]) -> str:
    """Why no micro-batch flows, as the layer0 drivers last said it in their logs ("" if none says so)."""
    for text in logs:
        said, flowing = text.rfind(BLOCKED_MARKER), text.rfind(FLOWING_MARKER)
        if said > flowing:
            return text[said + len(BLOCKED_MARKER):].split("\n", 1)[0].strip()
    return ""


@dataclass(frozen=True, slots=True)
class Target:
    """What ends a demo: a test accuracy (classifiers) or a test loss in bits per byte (language models)."""

    kind: Literal["accuracy", "bits"]
    value: float

    def __str__(self) -> str:
        # 4 significant digits: a target of 0.999 is "99.9%", never rounded up to a "100%" that cannot be reached
        return f"{self.value * 100:.4g}% test accuracy" if self.kind == "accuracy" else f"{self.value:.2f} bits/byte"


def demo_target(run, accuracy: float | None, bits: float | None) -> Target:
    """The stop rule that fits the run: a language model's targets are in bits per byte."""
    if run.model.language_model:
        return Target("bits", bits if bits is not None else run.training.target_bits_per_byte)
    return Target("accuracy", accuracy if accuracy is not None else run.training.target_accuracy)


def target_reached(target: Target, accuracy: float | None, loss: float | None) -> bool:
    if target.kind == "accuracy":
        return accuracy is not None and accuracy >= target.value
    return loss is not None and bits_per_byte(loss) <= target.value


def latest_evaluation(layer0: list) -> tuple[float | None, float | None]:
    """(accuracy or None, loss or None) of the evaluation that covers the most samples."""
    published = [r for r in layer0 if r.test_accuracy >= 0 or r.test_loss >= 0]
    if not published:
        return None, None
    latest = max(published, key=lambda r: r.eval_samples)
    return (latest.test_accuracy if latest.test_accuracy >= 0 else None,
            latest.test_loss if latest.test_loss >= 0 else None)


def _report(result: dict, target: Target, say) -> None:
    figure = evaluation_figure(result["test_accuracy"], result["test_loss"]) or "no evaluation yet"
    say("final report: " + figure + f" (target {target}), {result['samples']} samples trained in {result['seconds']:.0f} s, "
        f"{result['lost_microbatches']} micro-batches lost")
