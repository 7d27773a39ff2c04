"""Tracebacks a new user met outside `join`, through the installed `volunteer` entry point: `eval` of a model
from another run, and `ctl` printing into a pipe its reader closed (`volunteer ctl resume | head -1`)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from fake_engine import FakeEngine  # noqa: E402
from procs import volunteer_exe, write_run  # noqa: E402

from volunteer.control import serve_node  # noqa: E402
from volunteer.snapshot import Command  # noqa: E402

EXIT_USAGE = 2
EXIT_SIGPIPE = 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader left


def export_digits_model(path: Path) -> None:
    """A file as `volunteer export` writes it, of the built-in digits-mlp run (its initial weights)."""
    import torch

    from swarm.run.models import build_stage
    from volunteer.config import load_run

    run, _ = load_run("digits-mlp")
    torch.save({"format": "volunteer-model-v1", "run": run.model_dump(mode="json"), "run_id": run.run_id,
                "stages": [build_stage(run.model, k).state_dict() for k in range(run.model.stages)],
                "sources": {}, "reported": None}, path)


def volunteer(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([volunteer_exe(), *args], env=env, capture_output=True, text=True, timeout=60)


def test_eval_of_a_model_from_another_run_names_the_fields_that_differ(swarm, tmp_path):
    model = tmp_path / "model.pt"
    export_digits_model(model)
    wide = write_run(tmp_path / "wide.yaml", name="wide", stages=4)
    wide.write_text(wide.read_text().replace("  stages: 4", "  stages: 4\n  hidden_dim: 64"))
    done = volunteer("eval", "--model", str(model), "--run", str(wide), env=swarm.env)
    assert done.returncode == EXIT_USAGE and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"volunteer eval: --model {model} was exported from run digits-mlp-")
    assert "model.hidden_dim: 128 in the file, 64 in --run. Drop --run" in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr

    narrow = write_run(tmp_path / "narrow.yaml", name="digits-mlp", stages=4)  # the same model, data it cannot take
    npz = tmp_path / "twenty.npz"
    import numpy as np

    np.savez(npz, X=np.zeros((50, 20), dtype=np.float32), y=np.arange(50) % 5)
    narrow.write_text(narrow.read_text() + f"data:\n  source: npz\n  path: {npz}\n")
    done = volunteer("eval", "--model", str(model), "--run", str(narrow), env=swarm.env)
    assert done.returncode == EXIT_USAGE, done.stderr
    assert done.stderr == (f"volunteer eval: {narrow}: data.source 'npz' has 20 features; set model.input_dim "
                           "to 20\n")


def test_ctl_into_a_closed_pipe_does_its_work_and_exits_quietly(swarm, tmp_path):
    engine = FakeEngine()
    with serve_node(tmp_path / "data", "testrun-0123abcd", "layer1", engine):
        proc = subprocess.Popen([volunteer_exe(), "ctl", "resume", "--data-dir", str(tmp_path / "data")],
                                env=swarm.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.stdout.close()  # the reader left before ctl printed (`| head -1` after its first line)
        try:
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert engine.commands == [Command.RESUME]
    assert proc.returncode == EXIT_SIGPIPE and err == b"", err.decode()


def test_a_command_ends_with_its_exit_handlers_and_its_output_but_no_finalization():
    """volunteer_cli.main.entry and the fork server's children end through ``end_process``: the interpreter's
    finalization (~1 s of collecting torch's and hivemind's heap, 0.6-1.5 s in a forked child) is skipped, not the
    exit handlers nor what was printed and not yet flushed."""
    script = ("import atexit, sys, threading, time\n"
              "from volunteer.hygiene import end_process\n"
              "atexit.register(lambda: print('handler ran'))\n"
              "sys.stdout.write('buffered, ')\n"
              "threading.Thread(target=lambda: (time.sleep(0.3), sys.stdout.write('thread done, '))).start()\n"
              "end_process(3)\n"
              "print('not reached')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    # a thread that is not a daemon finishes first, as at a normal exit (a file a command still writes is written)
    assert done.stdout == "buffered, thread done, handler ran\n"


def test_a_thread_that_never_ends_does_not_keep_a_command_from_ending():
    """A normal exit waits forever for a stuck thread that is not a daemon; ``end_process`` waits EXIT_THREADS_S."""
    script = ("import sys, threading, time\n"
              "from volunteer import hygiene\n"
              "hygiene.EXIT_THREADS_S = 0.5\n"
              "threading.Thread(target=threading.Event().wait, name='stuck-reader').start()\n"
              "print('work done')\n"
              "hygiene.end_process(3)\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3 and done.stdout == "work done\n", done.stderr
    assert "stuck-reader" in done.stderr and time.monotonic() - started < 30
