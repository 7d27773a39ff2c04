"""benchmarks.wan's figures from its cells (pure: no lab, no processes)."""

from __future__ import annotations

from benchmarks.netlab import Link
from benchmarks.wan import PROFILES, ratios


def test_each_lab_cell_is_compared_with_its_runs_loopback_cell_and_its_bound():
    cells = {
        "charlm_loopback": {"samples_per_s": 100.0},
        "charlm_100mbit_50ms": {"samples_per_s": 40.0, "vs_bound": 0.5},
        "heavy_20mbit_100ms": {"samples_per_s": 10.0, "vs_bound": 0.9},  # no loopback cell of its own
        "digits_loopback": {"error": "timed out", "samples_per_s": None},
        "digits_100mbit_50ms": {"samples_per_s": 300.0, "vs_bound": 0.1},
    }
    flat = ratios(cells)
    assert flat["charlm_100mbit_50ms_vs_loopback"] == 0.4 and flat["charlm_100mbit_50ms_vs_bound"] == 0.5
    assert flat["heavy_20mbit_100ms_vs_loopback"] is None and flat["heavy_20mbit_100ms_vs_bound"] == 0.9
    assert flat["digits_100mbit_50ms_vs_loopback"] is None  # its baseline failed: no ratio, no crash
    assert "charlm_loopback_vs_loopback" not in flat


def test_the_profiles_round_trips_are_what_their_names_say():
    assert PROFILES["100mbit_50ms"] == Link(rate_mbit_s=100.0, delay_ms=12.5)  # 2 x (12.5 + 12.5) = 50 ms
    assert PROFILES["20mbit_100ms"] == Link.for_rtt(20.0, 100.0)
    assert PROFILES["loopback"] is None
