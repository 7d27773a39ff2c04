"""`volunteer service install|uninstall`: the unit's content and idempotent install/uninstall in a tmp dir."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from volunteer.service import (
    ENABLE_HINT,
    ServiceError,
    install,
    join_argv,
    quote_arg,
    render_unit,
    systemd_user_problem,
    uninstall,
    unit_path,
)


@pytest.fixture
def path(tmp_path) -> Path:
    return tmp_path / "config" / "systemd" / "user" / "volunteer.service"


def unit_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def test_the_unit_lives_in_the_users_systemd_dir(tmp_path):
    assert unit_path({"XDG_CONFIG_HOME": "/xdg"}) == Path("/xdg/systemd/user/volunteer.service")
    assert unit_path({}, home=tmp_path) == tmp_path / ".config/systemd/user/volunteer.service"
    assert unit_path({"XDG_CONFIG_HOME": ""}, home=tmp_path) == tmp_path / ".config/systemd/user/volunteer.service"


def test_the_unit_runs_a_headless_node_at_the_lowest_priority():
    lines = unit_lines(render_unit(["--run", "/runs/mnist.yaml"], python="/opt/venv/bin/python"))
    exec_start = "ExecStart=/opt/venv/bin/python -m volunteer_cli join --headless --swarm auto --run /runs/mnist.yaml"
    assert exec_start in lines
    settings = ["Nice=19", "CPUSchedulingPolicy=idle", "IOSchedulingClass=idle", "Restart=on-failure"]
    for setting in [*settings, "RestartPreventExitStatus=2"]:
        assert setting in lines
    assert "WantedBy=default.target" in lines
    assert not any(line.startswith("PrivateTmp") for line in lines)  # the X socket in /tmp must stay visible


def test_stop_signals_only_the_main_process_so_it_leaves_in_order():
    # KillMode=mixed: SIGTERM reaches the node alone (it announces offline, saves a checkpoint and stops
    # its DHT process and p2pd itself); the default would SIGTERM p2pd at the same time and cut the leave.
    lines = unit_lines(render_unit())
    assert "KillMode=mixed" in lines
    assert "TimeoutStopSec=60" in lines


def test_the_users_own_swarm_and_headless_flags_are_not_doubled():
    assert join_argv(["--swarm", "layer3"], python="py") == [
        "py", "-m", "volunteer_cli", "join", "--headless", "--swarm", "layer3",
    ]
    assert join_argv(["--swarm=layer0", "--headless"], python="py") == [
        "py", "-m", "volunteer_cli", "join", "--swarm=layer0", "--headless",
    ]


@pytest.mark.parametrize(
    ("arg", "word"),
    [
        ("--run", "--run"),
        ("/runs/mnist-v2.yaml", "/runs/mnist-v2.yaml"),
        ("/home/ann b/run.yaml", '"/home/ann b/run.yaml"'),
        ("100%", "100%%"),  # % starts a systemd specifier
        ("$HOME", '"$$HOME"'),  # $ expands an environment variable
        ('say "hi"\\', '"say \\"hi\\"\\\\"'),
    ],
)
def test_exec_start_words_survive_systemd_quoting(arg, word):
    assert quote_arg(arg) == word


def test_a_line_break_cannot_go_into_a_unit():
    with pytest.raises(ServiceError, match="line break"):
        render_unit(["--run", "a\nb"])


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_accepts_the_unit(tmp_path):
    unit = tmp_path / "volunteer.service"
    unit.write_text(render_unit(["--run", "/home/ann b/run 100%.yaml", "$HOME", 'q"uote']))
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=10)
    assert done.returncode == 0, done.stderr


def test_install_writes_the_unit_and_says_how_to_enable_it(path):
    message = install(["--run", "/runs/mnist.yaml"], path=path)
    assert path.read_text() == render_unit(["--run", "/runs/mnist.yaml"], python=sys.executable)
    assert message.startswith(f"Installed the service at {path}.")
    assert ENABLE_HINT in message
    assert ENABLE_HINT == "systemctl --user daemon-reload && systemctl --user enable --now volunteer.service"


def test_install_twice_is_harmless_and_says_so(path):
    install(["--run", "a.yaml"], path=path)
    message = install(["--run", "a.yaml"], path=path)
    assert message.startswith(f"The service is already installed at {path} (unchanged).")
    assert ENABLE_HINT in message


def test_install_with_other_args_updates_the_unit(path):
    install(["--run", "a.yaml"], path=path)
    message = install(["--run", "b.yaml"], path=path)
    assert message.startswith("Updated the service")
    assert "--run b.yaml" in path.read_text()
    assert [p.name for p in path.parent.iterdir()] == ["volunteer.service"]  # no scratch file left


def test_install_does_not_overwrite_a_unit_it_did_not_write(path):
    path.parent.mkdir(parents=True)
    path.write_text("[Service]\nExecStart=/usr/bin/something-else\n")
    with pytest.raises(ServiceError, match="was not written by volunteer"):
        install(path=path)
    assert "something-else" in path.read_text()


def test_uninstall_removes_the_unit_and_its_enablement(path):
    install(path=path)
    wants = path.parent / "default.target.wants" / "volunteer.service"
    wants.parent.mkdir()
    wants.symlink_to(path)  # what `systemctl --user enable` leaves
    message = uninstall(path=path)
    assert not path.exists() and not wants.is_symlink()
    assert message.startswith(f"Removed the service {path}")
    assert "systemctl --user stop volunteer.service" in message


def test_uninstall_twice_is_harmless_and_says_so(path):
    install(path=path)
    uninstall(path=path)
    assert uninstall(path=path) == f"The service is not installed (no {path}); nothing to do."


def test_uninstall_leaves_a_foreign_unit_alone(path):
    path.parent.mkdir(parents=True)
    path.write_text("[Service]\nExecStart=/usr/bin/something-else\n")
    with pytest.raises(ServiceError, match="not written by volunteer"):
        uninstall(path=path)
    assert path.exists()


PEER = "/ip4/127.0.0.1/tcp/31337/p2p/QmaypY6rCvw4CcrNw87NrKEqJ2gh92sJjKAYFB85EL7cbK"


def _runtime_dir(tmp_path, systemd: bool = True) -> Path:
    """An XDG_RUNTIME_DIR as a systemd user instance leaves it (its private socket), or without one."""
    runtime = tmp_path / "runtime"
    (runtime / "systemd").mkdir(parents=True, exist_ok=True)
    if systemd:
        (runtime / "systemd" / "private").touch()
    return runtime


def _cli(tmp_path, *args: str, systemd: bool = True) -> subprocess.CompletedProcess:
    from procs import volunteer_exe

    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "xdg"),
           "XDG_RUNTIME_DIR": str(_runtime_dir(tmp_path / ("with" if systemd else "without"), systemd))}
    return subprocess.run([volunteer_exe(), "service", *args], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)


def test_the_cli_checks_the_join_args_and_makes_paths_absolute(tmp_path):
    (tmp_path / "run.yaml").write_text("name: svc\n")
    (tmp_path / "mine.yaml").write_text("device: cpu\n")
    unit = tmp_path / "xdg" / "systemd" / "user" / "volunteer.service"
    maddr = PEER

    done = _cli(tmp_path, "install", "--run", "run.yaml", "--prefs=mine.yaml", "--initial-peers", maddr)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"Installed the service at {unit}.")
    exec_start = next(line for line in unit.read_text().splitlines() if line.startswith("ExecStart="))
    assert exec_start.endswith(f"join --headless --swarm auto --run {tmp_path / 'run.yaml'} "
                               f"--prefs={tmp_path / 'mine.yaml'} --initial-peers {maddr}")

    assert _cli(tmp_path, "uninstall").returncode == 0 and not unit.exists()
    typo = _cli(tmp_path, "install", "--run", "run.yaml", "--swarmm", "layer1")
    assert typo.returncode == 2 and "does not know --swarmm" in typo.stderr and not unit.exists()
    missing = _cli(tmp_path, "install", "--run", "nowhere.yaml")
    assert missing.returncode == 2 and "no such run config file" in missing.stderr and not unit.exists()


def test_the_systemd_user_instance_is_found_by_its_private_socket(tmp_path):
    assert systemd_user_problem({"XDG_RUNTIME_DIR": str(_runtime_dir(tmp_path / "a"))}) is None
    missing = systemd_user_problem({"XDG_RUNTIME_DIR": str(_runtime_dir(tmp_path / "b", systemd=False))})
    assert "no systemd user instance" in missing and "volunteer join --headless" in missing
    assert str(tmp_path / "b" / "runtime" / "systemd" / "private") in missing


def test_install_refuses_a_unit_that_could_never_run_and_says_what_is_missing(tmp_path):
    (tmp_path / "run.yaml").write_text("name: svc\n")
    unit = tmp_path / "xdg" / "systemd" / "user" / "volunteer.service"

    no_peers = _cli(tmp_path, "install", "--run", "run.yaml")
    assert no_peers.returncode == 2 and "no bootstrap peers" in no_peers.stderr and "--initial-peers" in no_peers.stderr
    bad_peer = _cli(tmp_path, "install", "--run", "run.yaml", "--initial-peers", "/ip4/127.0.0.1/tcp/31337")
    assert bad_peer.returncode == 2 and "/ip4/HOST/tcp/PORT/p2p/PEER_ID" in bad_peer.stderr
    no_systemd = _cli(tmp_path, "install", "--run", "run.yaml", "--initial-peers", PEER, systemd=False)
    assert no_systemd.returncode == 2 and "no systemd user instance" in no_systemd.stderr
    everything = _cli(tmp_path, "install", "--run", "run.yaml", "--swarm", "layer9", systemd=False)
    assert everything.returncode == 2
    for missing in ("no bootstrap peers", "--swarm layer9", "no systemd user instance"):
        assert missing in everything.stderr  # every problem at once, not one per try
    assert not unit.exists()
    assert _cli(tmp_path, "install", "--run", "run.yaml", "--initial-peers", PEER).returncode == 0 and unit.exists()
