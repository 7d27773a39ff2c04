"""A new user's first mistakes, through the installed `volunteer` entry point: one line with the field and the
fix, exit status 2, and nothing joined or announced (issue: tracebacks after 10-56 s, a run record left
behind that every later joiner was warned about; ports shared with another p2pd misreported)."""

from __future__ import annotations

import subprocess

import numpy as np

from procs import LOOPBACK, unused_peer_id, volunteer_exe, write_run

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
    # the README's command, without --listen and with no preferences file: the default listen (port 0) has no
    # port to check (it was a TypeError traceback before anything else was said); it fails here on its data only
    run = write_run(tmp_path / "nolisten.yaml", name="digits-mlp")
    run.write_text(run.read_text() + cases["fewclasses"][0] + "\n")
    joins["nolisten"] = swarm.start("join", "--run", str(run), "--swarm", "layer0", "--initial-peers", maddr,
                                    "--headless", name="nolisten")
    cases["nolisten"] = cases["fewclasses"]
    for name, (_, says) in cases.items():
        proc = joins[name]
        assert proc.wait(JOIN_EXIT_S) == EXIT_USAGE, proc.stderr()
        line = one_line_error(proc, "join")
        assert f"{name}.yaml: " in line and says in line, line
        assert "starting the DHT" not in proc.stdout()  # nothing joined, so nothing announced


def test_a_data_dir_or_identity_that_takes_no_files_is_one_line(swarm, tmp_path):
    maddr = f"/ip4/127.0.0.1/tcp/9/p2p/{unused_peer_id()}"  # never dialled: the check comes before anything loads
    run = write_run(tmp_path / "run.yaml")
    blocker = tmp_path / "a-file"  # a file where a folder should be: as unwritable as a read-only disk, also for root
    blocker.write_text("")
    cases = [
        (("join", "--run", str(run), "--initial-peers", maddr, "--data-dir", str(blocker / "data")),
         f"data dir {blocker / 'data'}: cannot write there"),
        (("join", "--run", str(run), "--initial-peers", maddr, "--identity", str(blocker / "id.key")),
         f"identity {blocker / 'id.key'}: cannot write in {blocker}"),
        (("bootstrap", "--listen", LOOPBACK, "--identity", str(blocker / "id.key")),
         f"identity {blocker / 'id.key'}: cannot write in {blocker}"),
        (("bootstrap", "--listen", LOOPBACK), f"identity {blocker / 'bootstrap' / 'identity.key'}: cannot write"),
    ]
    for args, says in cases:
        env = {**swarm.env, "VOLUNTEER_DATA_DIR": str(blocker)} if "--identity" not in args else swarm.env
        done = subprocess.run([volunteer_exe(), *args, "--headless"] if args[0] == "join" else [volunteer_exe(), *args],
                              env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode == EXIT_USAGE and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.startswith(f"volunteer {args[0]}: {says}") and done.stderr.count("\n") == 1, done.stderr


def test_a_listen_port_another_peer_holds_is_named_not_a_bootstrap_failure(swarm, tmp_path):
    boot, maddr = swarm.bootstrap()
    taken = "/".join(maddr.split("/")[:5])  # the bootstrap peer's own /ip4/127.0.0.1/tcp/PORT
    port = taken.rsplit("/", 1)[1]
    run = write_run(tmp_path / "run.yaml")
    for args in (("join", "--run", str(run), "--initial-peers", maddr, "--headless", "--listen", taken),
                 ("bootstrap", "--listen", taken, "--identity", str(tmp_path / "second.key"))):
        done = subprocess.run([volunteer_exe(), *args], env=swarm.env, capture_output=True, text=True, timeout=60)
        assert done.returncode == EXIT_USAGE, (done.stdout, done.stderr)
        assert done.stderr == (f"volunteer {args[0]}: --listen {taken}: TCP port {port} is already in use on this "
                               "machine (another `volunteer bootstrap` or `join`?): choose another port, or 0 for a "
                               "free one\n")
        assert "is up" not in done.stdout  # the second bootstrap peer no longer claims the first one's port
    boot.check_running()
