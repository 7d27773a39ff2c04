"""Children that die with their supervisor (volunteer/hygiene.py ``die_with_parent_hook``): the demo and the
benchmark fleets start volunteers with it, each in a session of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

SUPERVISOR = textwrap.dedent("""
    import subprocess
    from volunteer.hygiene import die_with_parent_hook

    hook = die_with_parent_hook()
    children = [subprocess.Popen(["sleep", "60"], start_new_session=True, preexec_fn=hook) for _ in range(5)]
    print(" ".join(str(c.pid) for c in children), flush=True)
""")  # then it exits, its children in sessions of their own: nothing but the hook stops them


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_children_get_sigterm_when_their_supervisor_dies():
    done = subprocess.run([sys.executable, "-c", SUPERVISOR], capture_output=True, text=True, timeout=60)
    pids = [int(p) for p in done.stdout.split()]
    try:
        assert done.returncode == 0 and len(pids) == 5, done.stderr[-2000:]
        assert "Traceback" not in done.stderr, done.stderr[-2000:]
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids), "a child outlived its supervisor"
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
