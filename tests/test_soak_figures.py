"""The soak benchmark's figures (benchmarks/soak.py), without a fleet: memory growth between two windows
and the windows in which one driver trained nothing while the run went on."""

from __future__ import annotations

import pytest

from benchmarks.soak import growth, memory_kib, stalled_windows


def test_growth_compares_the_last_window_with_the_first_after_warmup():
    samples = [{"t": t, "rss": 100.0 if t < 200 else 110.0} for t in range(0, 1000, 30)]
    assert growth(samples, "rss", warmup_s=60, window_s=120) == pytest.approx(0.10)
    assert growth(samples[:5], "rss", warmup_s=60, window_s=120) is None, "the two windows would overlap"
    assert growth([], "rss", 60, 120) is None


def test_a_stall_is_one_driver_idle_while_the_run_trains():
    samples = [{"t": 0, "trained": {"a": 0, "b": 0}}, {"t": 30, "trained": {"a": 100, "b": 0}},
               {"t": 60, "trained": {"a": 200, "b": 50}}, {"t": 90, "trained": {"a": 200, "b": 50}}]
    assert stalled_windows(samples, warmup_s=0, stall_s=30) == [("b", 0)]  # the whole run paused at 60-90
    assert stalled_windows(samples, warmup_s=0, stall_s=60) == []


def test_memory_of_a_live_and_a_gone_process():
    import os

    pss, rss = memory_kib(os.getpid())
    assert 0 < pss <= rss
    assert memory_kib(2**22 + 12345) == (0, 0)
