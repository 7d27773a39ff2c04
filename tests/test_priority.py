"""A foreground join lowers its CPU and I/O priority unless the volunteer turns it off (issue 16, item 8)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from volunteer.config import load_preferences
from volunteer.prefs import Preferences
from volunteer.priority import LOW_PRIORITY_NICE, PriorityPlan, plan_priority


def test_by_default_join_goes_to_nice_19_and_the_idle_io_class_on_linux():
    assert plan_priority(True, 0, "linux") == PriorityPlan(nice=LOW_PRIORITY_NICE, io_idle=True)
    assert plan_priority(True, 0, "darwin") == PriorityPlan(nice=LOW_PRIORITY_NICE, io_idle=False)


def test_turned_off_it_changes_nothing():
    assert plan_priority(False, 0, "linux") == PriorityPlan(nice=None, io_idle=False)


def test_an_already_nicer_process_is_left_as_nice_as_it_is():
    assert plan_priority(True, 19, "linux").nice is None  # the systemd unit's Nice=19


def test_the_preference_defaults_on_and_can_be_turned_off(tmp_path):
    assert Preferences().resources.low_priority is True
    prefs = tmp_path / "volunteer.yaml"
    prefs.write_text("resources:\n  low_priority: false\n")
    assert load_preferences(str(prefs)).resources.low_priority is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice and ionice: Linux")
def test_lowering_applies_to_the_process_and_the_threads_it_starts_later():
    code = (
        "import os, threading, psutil\n"
        "from volunteer.priority import lower_priority\n"
        "print(lower_priority(True))\n"
        "seen = {}\n"
        "t = threading.Thread(target=lambda: seen.update(nice=os.getpriority(os.PRIO_PROCESS, 0)))\n"
        "t.start(); t.join()\n"
        "print(os.getpriority(os.PRIO_PROCESS, 0), seen['nice'], int(psutil.Process().ionice().ioclass))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "PYTHONPATH": os.getcwd(), "VOLUNTEER_LOW_PRIORITY": ""},
                         check=True).stdout.splitlines()
    assert out[0] == "['CPU priority nice 19', 'idle I/O class']"
    import psutil

    assert out[1] == f"19 19 {int(psutil.IOPRIO_CLASS_IDLE)}"


def test_the_environment_overrides_the_preference_for_tests_demo_and_benchmarks():
    from volunteer.priority import wanted

    assert wanted(True, {"VOLUNTEER_LOW_PRIORITY": "0"}) is False
    assert wanted(False, {"VOLUNTEER_LOW_PRIORITY": "1"}) is True
    assert wanted(True, {}) is True
    assert wanted(False, {"VOLUNTEER_LOW_PRIORITY": "maybe"}) is False
