"""A new user's first mistakes, through the installed `volunteer` entry point: one line with the field and the
fix, exit status 2, and nothing joined or announced (issue: tracebacks after 10-56 s, a run record left
behind that every later joiner was warned about)."""

from __future__ import annotations

import numpy as np

from procs import write_run

EXIT_USAGE = 2
JOIN_EXIT_S = 60.0  # a join that fails its preflight exits once torch has loaded (5-7 s on a loaded 2-core machine)


def one_line_error(proc, command: str) -> str:
    """The process's error: exactly one line on stderr, no traceback."""
    err = proc.stderr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith(f"volunteer {command}: "), err
    return lines[0]


def test_a_run_that_does_not_fit_its_data_stops_before_joining(swarm, tmp_path):
    _, maddr = swarm.bootstrap()
    npz = tmp_path / "twenty.npz"
    np.savez(npz, X=np.zeros((50, 20), dtype=np.float32), y=np.arange(50) % 5)
    cases = {  # run config lines -> what the one line must say (the other mistakes: tests/test_preflight.py)
        "fewclasses": ("model:\n  num_classes: 5", "model.num_classes (5) must exceed the largest label"),
        "twenty": (f"data:\n  source: npz\n  path: {npz}", "has 20 features; set model.input_dim to 20"),
    }
    joins = {}
    for name, (lines, _) in cases.items():
        run = write_run(tmp_path / f"{name}.yaml", name="digits-mlp")
        run.write_text(run.read_text() + lines + "\n")
        joins[name] = swarm.join(run, "auto", maddr, name=name)
    for name, (_, says) in cases.items():
        proc = joins[name]
        assert proc.wait(JOIN_EXIT_S) == EXIT_USAGE, proc.stderr()
        line = one_line_error(proc, "join")
        assert f"{name}.yaml: " in line and says in line, line
        assert "starting the DHT" not in proc.stdout()  # nothing joined, so nothing announced
