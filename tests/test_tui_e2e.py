"""The real `volunteer join` dashboard in a pseudo-terminal: it shows the swarm, `q` leaves cleanly."""

from __future__ import annotations

import fcntl
import os
import struct
import subprocess
import termios
import threading
import time

import pyte

from procs import LOOPBACK, volunteer_exe, wait_until, write_run

COLUMNS, LINES = 120, 40


class Terminal:
    """A pty running one program, rendered by pyte the way a terminal would show it."""

    def __init__(self, args: list[str], env: dict[str, str]):
        self.screen = pyte.Screen(COLUMNS, LINES)
        self.stream = pyte.ByteStream(self.screen)
        self.lock = threading.Lock()
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", LINES, COLUMNS, 0, 0))
        self.master = master

        def controlling_tty() -> None:
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env,
                                     preexec_fn=controlling_tty, close_fds=True)
        os.close(slave)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            with self.lock:
                self.stream.feed(data)

    def text(self) -> str:
        with self.lock:
            return "\n".join(self.screen.display)

    def press(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        try:
            os.close(self.master)
        except OSError:
            pass


def test_dashboard_shows_the_swarm_and_q_leaves_cleanly(swarm, tmp_path):
    run = write_run(tmp_path / "run.yaml", stages=2)
    _, maddr = swarm.bootstrap()
    swarm.join(run, "layer1", maddr, name="layer1")
    env = {**swarm.env, "TERM": "xterm-256color", "COLUMNS": str(COLUMNS), "LINES": str(LINES)}
    term = Terminal([volunteer_exe(), "join", "--run", str(run), "--swarm", "layer0", "--initial-peers", maddr,
                     "--listen", LOOPBACK], env)
    try:
        def dashboard_ready():
            screen = term.text()
            # my own row in the peers table ("you") comes with the first read of my own record, after the rest
            return "ONLINE" in screen and "layer1" in screen and "samples/s" in screen and "you" in screen

        try:
            wait_until(dashboard_ready, 90, interval_s=0.5, what="the dashboard to show the online swarm")
        except TimeoutError:
            raise AssertionError(f"dashboard never became ready; screen:\n{term.text()}") from None
        screen = term.text()
        assert "layer0" in screen and "you" in screen  # my own swarm and my own row are marked in words
        assert "q" in screen.splitlines()[-1].lower()  # the footer names the keys

        term.press(b"q")
        assert term.proc.wait(60) == 0
        reported = swarm.reader(run, maddr).report()  # what `volunteer status` prints (the CLI: test_foundation)
        # offline, or already gone (the offline record lives one record lifetime: 3 s here)
        assert all(row["state"] == "offline" for row in reported["swarms"]["layer0"])
    finally:
        term.close()
    time.sleep(0.1)
