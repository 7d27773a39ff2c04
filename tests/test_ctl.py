"""A real headless node on loopback, driven with `volunteer ctl` while a layer0 driver trains through it.

One scenario (processes are the expensive part): bootstrap + layer0 + layer1. Pause layer1 with ctl:
it stops taking work within 2 s, its record and ctl say why, and the driver loses no micro-batch.
Resume: training goes on. Malformed requests get an error and the node lives on. SIGKILL layer1 and
start it again: it resumes from its checkpoint (at most one checkpoint interval back), not from 0.
The waits ask the node's socket in-process (`node`); every action and the checks of what a user reads
go through `volunteer ctl` and `volunteer status` (the CLI).
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

from procs import volunteer_exe, wait_until, write_run

CHECKPOINT_INTERVAL_S = 1.0
PAUSE_TAKES_EFFECT_S = 2.0


def ctl(swarm, *args: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run([volunteer_exe(), "ctl", *args], env=swarm.env, capture_output=True, text=True,
                          timeout=timeout_s)


def ctl_json(swarm, action: str, layer: str) -> dict:
    done = ctl(swarm, action, "--swarm", layer, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def node(swarm, layer: str) -> dict:
    """What `ctl status --swarm LAYER --json` prints, asked in-process (no interpreter per poll); {} while
    no node of this layer answers."""
    from volunteer.control import live_nodes

    found = [snap for _, snap in live_nodes(swarm.env["VOLUNTEER_DATA_DIR"]) if snap.get("swarm") == layer]
    assert len(found) <= 1, found
    return found[0] if found else {}


def answer(swarm, layer: str, timeout_s: float = 30.0) -> dict:
    return wait_until(lambda: node(swarm, layer), timeout_s, what=f"{layer}'s node to answer on its socket")


def ask_raw(path: str, payload: bytes) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5.0)
        sock.connect(path)
        sock.sendall(payload)
        return json.loads(sock.makefile().readline())


def test_ctl_pauses_and_resumes_a_training_node_and_a_restart_resumes_its_checkpoint(swarm, tmp_path):
    run = write_run(tmp_path / "run.yaml")
    prefs = tmp_path / "volunteer.yaml"
    prefs.write_text(f"device: cpu\nresources:\n  checkpoint_interval_s: {CHECKPOINT_INTERVAL_S}\n")
    _, maddr = swarm.bootstrap()
    reader = swarm.reader(run, maddr)
    layer0 = swarm.join(run, "layer0", maddr, "--prefs", str(prefs), name="layer0")
    layer1 = swarm.join(run, "layer1", maddr, "--prefs", str(prefs), name="layer1")

    # Both nodes serve a control socket in the shared data dir: ctl asks which one when unsure.
    wait_until(lambda: node(swarm, "layer1"), 60, what="layer1's socket")
    ambiguous = ctl(swarm, "status")
    assert ambiguous.returncode == 2 and "--swarm" in ambiguous.stderr
    assert "layer0" in ambiguous.stderr and "layer1" in ambiguous.stderr
    # layer1 trains only on the micro-batches of layer0's driver.
    wait_until(lambda: node(swarm, "layer1").get("clock", 0) > 0, 90, interval_s=0.5,
               what="the pipeline to train")

    paused = ctl_json(swarm, "pause", "layer1")
    assert paused["state"] == "paused" and paused["reason"] == "paused by you"
    time.sleep(PAUSE_TAKES_EFFECT_S)
    clock_after_pause = answer(swarm, "layer1")["clock"]
    while_paused = swarm.status(run, maddr)["swarms"]
    assert [row["state"] for row in while_paused["layer1"]] == ["paused"]
    assert ctl_json(swarm, "status", "layer1")["clock"] == clock_after_pause, "a paused node took new work"
    human = ctl(swarm, "status", "--swarm", "layer1")
    assert human.returncode == 0 and human.stdout.startswith("paused: paused by you")

    # Malformed requests get an error reply; the node goes on.
    socket_path = paused["control_socket"]
    not_json = ask_raw(socket_path, b"not json\n")
    assert not_json == {"ok": False, "error": 'not JSON: send one line like {"cmd": "status"}'}
    unknown = ask_raw(socket_path, b'{"cmd": "explode"}\n')
    assert unknown["ok"] is False and "unknown command 'explode'" in unknown["error"]
    assert ask_raw(socket_path, b'["cmd"]\n')["ok"] is False

    resumed = ctl_json(swarm, "resume", "layer1")
    assert resumed["state"] == "online" and resumed["reason"] == ""
    wait_until(lambda: node(swarm, "layer1").get("clock", 0) > clock_after_pause, 30, interval_s=0.5,
               what="training to go on after the resume")
    (driver_while_paused,) = while_paused["layer0"]
    (driver,) = wait_until(lambda: [r for r in reader.report()["swarms"]["layer0"]
                                    if r["trained"] > driver_while_paused["trained"]], 30, interval_s=0.5,
                           what="the driver's record to count the samples trained after the resume")
    assert driver["lost"] == 0, "the pause cost micro-batches"

    # Healing's snapshots are files in the node's folder, not RAM (swarm/integrity/snapshots.py).
    data_dir = Path(swarm.env["VOLUNTEER_DATA_DIR"])
    (killed,) = wait_until(lambda: [d for d in data_dir.glob("runs/*/layer1/heal-*") if list(d.glob("*.pt"))], 30,
                           what="layer1's first snapshot file")

    # A crash: at most one checkpoint interval of progress is lost.
    clock_before_crash = answer(swarm, "layer1")["clock"]
    time.sleep(2 * CHECKPOINT_INTERVAL_S + 0.5)
    layer1.signal(signal.SIGKILL)
    layer1.wait(10)
    again = swarm.join(run, "layer1", maddr, "--prefs", str(prefs), name="layer1-again")
    again.wait_for_output("resuming from the checkpoint at clock", timeout_s=60)
    # the killed node's snapshot files are cleaned up by the next one in that folder, when it builds its stage
    wait_until(lambda: not killed.exists(), 30, what="the killed node's snapshot folder to be removed")
    restored = int(re.search(r"resuming from the checkpoint at clock (\d+)", again.stdout()).group(1))
    assert restored >= clock_before_crash > 0
    wait_until(lambda: node(swarm, "layer1"), 30, what="the restarted socket")
    assert ctl_json(swarm, "status", "layer1")["clock"] >= restored

    # quit: a clean leave (the driver first, so nothing waits on a missing layer1)
    for layer, proc in (("layer0", layer0), ("layer1", again)):
        assert ctl_json(swarm, "quit", layer)["stopped"] is True
        assert proc.wait(30) == 0
        assert "Traceback" not in proc.stderr()
    assert not list(data_dir.glob("runs/*/*/heal-*")), "a clean leave removes its snapshot files"
