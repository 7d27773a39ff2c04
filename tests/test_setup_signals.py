"""A Ctrl+C that lands while a long-running command sets up (volunteer_cli/commands/common.setup_process).

Found by sending SIGINT to `volunteer join --headless` at 10 ms steps across its start: at ~0.55 s the signal
landed inside the watchdog's fork, in logging's after-fork hook (`_releaseLock`). Python raised KeyboardInterrupt
there and swallowed it ("Exception ignored in: <function _releaseLock>"); logging's lock stayed held, the engine
thread hung at its first `getLogger`, and the Ctrl+C was lost: the process never exited (the fresh-clone suites'
"Ctrl+C acted on 20-50 s late" at the "loading" point of tests/test_startup_interrupt.py).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import logging, os, signal, sys, threading

    from volunteer_cli.commands.common import setup_process

    fired = []

    def tracer(frame, event, arg):
        # SIGINT exactly where the user hit it: entering logging's after-fork hook in the parent
        if (event == "call" and frame.f_code.co_name == "_releaseLock" and not fired
                and frame.f_back is not None and frame.f_back.f_code.co_name == "start"):
            fired.append(True)
            os.kill(os.getpid(), signal.SIGINT)
        return None

    sys.settrace(tracer)
    watchdog, shutdown = setup_process(0)
    sys.settrace(None)
    got = []

    def take_logging_lock():  # from another thread, as the engine thread's first getLogger does
        got.append(logging._lock.acquire(timeout=5))
        if got[-1]:
            logging._lock.release()

    worker = threading.Thread(target=take_logging_lock)
    worker.start()
    worker.join(10)
    watchdog.stop()
    print(f"fired={bool(fired)} stopped={shutdown.event.is_set()} signum={shutdown.signum} logging_free={got == [True]}")
""")


def test_ctrl_c_inside_the_watchdog_fork_is_a_stop_request_and_leaves_logging_usable():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "Exception ignored" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr
    assert proc.stdout.strip() == "fired=True stopped=True signum=2 logging_free=True", proc.stdout + proc.stderr
