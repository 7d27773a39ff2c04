from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from procs import Swarm  # noqa: E402


@pytest.fixture
def swarm(tmp_path: Path):
    """Real processes on loopback; the test fails if any of them (or their children) outlives it."""
    harness = Swarm(tmp_path)
    yield harness
    left = harness.close()
    assert not left, f"processes outlived the test: {left}"


# The modules that start the most processes, heaviest first. `make test` runs the suite on two pytest-xdist
# workers, one module at a time each (--dist loadfile, so a module's swarm is started once). pytest-xdist then
# reorders modules by their count of tests (its default --loadscope-reorder), so this order only breaks its ties:
# with --no-loadscope-reorder the heaviest did start first, and the suite took as long (561 s against 565: it is
# CPU-bound, 1.7 of 2 cores busy, and heavy modules side by side ran slower), so the default stays.
HEAVY_FIRST = (  # per-module totals of a full run (junit times, 2026-11-28, load 2-4): 108 s ... 10 s
    "test_foundation", "test_benchmarks_smoke", "test_pipeline", "test_nat", "test_benchmarks_pipeline_smoke",
    "test_netlab", "test_adversary", "test_edges_swarm", "test_ctl", "test_llm_swarm", "test_rebalance_swarm",
    "test_averaging_swarm", "test_driver_hops", "test_stage0_spot_swarm", "test_run_end", "test_driver_swarm",
    "test_join_preflight", "test_doctor", "test_lm_cli", "test_spot_checks", "test_averaging_train",
    "test_startup_interrupt", "test_tui_e2e", "test_run_alarms", "test_ecl_updates", "test_tui_app",
    "test_health_page", "test_local", "test_codecs_swarm", "test_referee_swarm", "test_blame_swarm", "test_status_fast",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: index for index, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the order within a module stays
