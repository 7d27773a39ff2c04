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


def test_each_codec_is_compared_with_float32_on_the_same_link_and_the_best_one_named():
    cells = {
        "charlm_loopback@float32": {"samples_per_s": 100.0},
        "charlm_100mbit_50ms@float32": {"samples_per_s": 40.0, "vs_bound": 0.5, "bytes_per_sample": 200_000.0},
        "charlm_loopback@int8": {"samples_per_s": 80.0},
        "charlm_100mbit_50ms@int8": {"samples_per_s": 60.0, "vs_bound": 0.3, "bytes_per_sample": 60_000.0},
        "charlm_100mbit_50ms@lowrank": {"samples_per_s": 70.0, "vs_bound": 0.2, "bytes_per_sample": 30_000.0},
    }
    flat = ratios(cells)
    assert flat["charlm_100mbit_50ms_vs_loopback@int8"] == 0.75, "against the loopback cell of the same codec"
    assert flat["charlm_100mbit_50ms_vs_loopback@float32"] == 0.4
    assert flat["charlm_100mbit_50ms_vs_loopback@lowrank"] is None
    assert flat["charlm_100mbit_50ms_bytes_ratio@int8"] == 0.3 and flat["charlm_100mbit_50ms_bytes_ratio@lowrank"] == 0.15
    assert (flat["best_codec_bytes_ratio"], flat["best_codec"]) == (0.15, "lowrank")
    assert "charlm_100mbit_50ms_bytes_ratio@float32" not in flat
