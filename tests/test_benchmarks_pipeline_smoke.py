"""The pipeline benchmark's --quick run prints its figures (its own module: at 2-3 minutes on a loaded 2-core
machine it is the longest smoke run, and pytest-xdist hands out whole modules, so it runs beside the others)."""

from __future__ import annotations

import math

from test_benchmarks_smoke import _positive, _quick


def test_pipeline_benchmark_quick_prints_its_figures(swarm):
    report = _quick("benchmarks.pipeline", swarm.env)
    # --quick scales 2 -> 1 peers (the full run: 4 -> 2 -> 1), the least that exercises the scaling part
    _positive(report, ("efficiency_heavy", "efficiency_heavy_vs_1_thread", "scaling_2",
                       "hop_overhead_ms_4m", "cpu_efficiency_digits-mlp"))
    # a small hop's overhead is the difference of two ~2 ms timings over 3 repetitions: at load 10 it came out
    # -0.3 ms (the local timing slowed more than the hop's); a number, not a sign
    assert math.isfinite(report["hop_overhead_ms_64k"]), report["hop_overhead_ms_64k"]
    assert sorted(report["scaling"]["per_swarm"]) == ["1", "2"]
    assert report["quick"] is True
