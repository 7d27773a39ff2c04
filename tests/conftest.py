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
# workers, one module at a time each (--dist loadfile, so a module's swarm is started once): starting the
# long modules first keeps one worker from finishing them alone at the end. Measured with --durations=0.
HEAVY_FIRST = (  # per-module totals of a full run (--durations, 2026-11-26, load 4-5): 160 s ... 10 s
    "test_pipeline", "test_benchmarks_smoke", "test_benchmarks_pipeline_smoke", "test_adversary", "test_nat",
    "test_llm_swarm", "test_foundation", "test_netlab", "test_run_end", "test_edges_swarm", "test_averaging_swarm",
    "test_ctl", "test_rebalance_swarm", "test_averaging_train", "test_tui_e2e", "test_driver_swarm",
    "test_health_page", "test_lm_cli", "test_status_fast", "test_startup_interrupt", "test_driver_hops",
    "test_doctor", "test_ecl_updates", "test_memory",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: index for index, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the order within a module stays
