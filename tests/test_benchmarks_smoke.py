"""The benchmarks still run: each, in --quick mode, prints one JSON object with its headline figures
and leaves no process behind. (Quick mode is a smoke test: its numbers are not measurements.)"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from procs import START_ENV, fork_server
from volunteer_cli.forkserver import ForkRefused, available as forks_available

ROOT = Path(__file__).resolve().parents[1]
QUICK_TIMEOUT_S = 240  # each benchmark's --quick takes about a minute on an idle 2-core machine (pipeline's: 4 parts)


def _quick(module: str, env: dict[str, str] | None = None) -> dict:
    """``python -m MODULE --quick --json`` (``env``: the test's start environment by default), forked from this test
    process's fork server where it can be (torch and hivemind imported once: ~2 s of CPU less a run), its one line
    of JSON parsed."""
    env, argv = dict(START_ENV if env is None else env), ["--quick", "--json"]
    with tempfile.TemporaryDirectory(prefix="quick-") as tmp:
        out_path, err_path = Path(tmp) / "stdout", Path(tmp) / "stderr"
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            try:
                if not forks_available():
                    raise ForkRefused("no fork server here")
                proc = fork_server().spawn(argv, env, out.fileno(), err.fileno(), cwd=str(ROOT), module=module)
            except ForkRefused:
                proc = subprocess.Popen([sys.executable, "-m", module, *argv], cwd=ROOT, env=env, stdout=out,
                                        stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code = proc.wait(QUICK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
            raise
        stdout, stderr = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    assert code == 0, stderr[-3000:]
    lines = stdout.strip().splitlines()
    assert len(lines) == 1, f"stdout must be exactly one JSON line, got: {stdout[:2000]}"
    return json.loads(lines[0])


def _positive(report: dict, keys: tuple[str, ...]) -> None:
    for key in keys:
        value = report.get(key)
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, f"{key} = {value!r}"


def test_join_benchmark_quick_prints_its_figures(swarm):
    report = _quick("benchmarks.join", swarm.env)
    _positive(report, ("join_s", "join_vs_bare_dht", "baseline_import_hivemind_torch_s", "get_swarm_ms",
                       "get_swarm_vs_get_1", "status_s", "status_vs_import"))
    phases = report["join"]
    assert math.isclose(phases["import_s"] + phases["dht_start_s"] + phases["first_announce_s"], phases["total_s"],
                        rel_tol=1e-3)
    assert "print_and_exit" in report["status"]["phases_s"]


def test_codecs_benchmark_quick_prints_its_figures():
    report = _quick("benchmarks.codecs")
    cells = report["runs"]["digits-mlp"]["codecs"]
    assert sorted(cells) == ["float16", "float32", "int8", "lowrank_r8"]
    for cell in cells.values():
        _positive(cell, ("bytes_per_sample", "test_loss", "cpu_ms_per_microbatch"))
    # the byte counts are deterministic: each codec sends what it promises, whatever the machine's load
    assert 0.45 < cells["float16"]["bytes_ratio"] < 0.51
    assert 0.25 < cells["int8"]["bytes_ratio"] < 0.26
    assert cells["lowrank_r8"]["bytes_ratio"] < 0.1
    _positive(report, ("int8_bytes_ratio", "best_codec_bytes_ratio"))


def test_dht_scale_benchmark_quick_measures_a_cell():
    report = _quick("benchmarks.dht_scale")
    (cell,) = report["cells"]
    assert cell["peers"] == 4 and cell["heartbeats"] > 0 and cell["records_read_per_peer_heartbeat"] > 0
    _positive(cell, ("cpu_ms_per_peer_heartbeat", "python_ms_per_peer_heartbeat", "gets_per_peer_heartbeat"))
    if cell["own_network_namespace"]:  # root with unshare (CI): the DHT's own traffic
        assert cell["kbytes_per_peer_heartbeat"] > 0


def test_scale_benchmark_quick_prints_its_figures():
    report = _quick("benchmarks.scale")
    _positive(report, ("rebalancing_vs_optimal", "placement_only_vs_optimal"))
    assert report["rebalancing_vs_optimal"] > report["placement_only_vs_optimal"] - 0.05
    sizes = report["swarm_read_bytes"]
    assert 0 < sizes["64"] < sizes["256"] < sizes["1024"] < 4 * 2**20, sizes  # a swarm of 1,024 still fits a get
    assert report["peers_per_swarm_at_unary_cap"] > 1024
    assert {(c["churn"], c["rebalance"]) for c in report["cells"]} == {(0.0, False), (0.0, True), (0.02, False),
                                                                       (0.02, True)}


def test_copies_sim_quick_prints_its_figures():
    report = _quick("benchmarks.copies_sim")
    _positive(report, ("dpwa_default_worst_ratio", "best_ratio"))
    (cell,) = report["cells"]
    assert cell["peers"] == 2 and set(cell["ratios"]) == {"1000", "2000"}


def test_penalty_counter_counts_holds_and_strikes_not_statements():
    """The convergence matrix's honest-penalty count (benchmarks/common.py): a disagreement that is only said (two
    skewed honest copies, no third to arbitrate) or a refusal without a strike is no penalty; a hold-off and a strike
    are."""
    from benchmarks.common import count_penalties

    said = ("spot check at layer1: peers 1a2b3c4d and 5e6f7a8b computed different outputs for the same input; no "
            "third peer to tell which is wrong")
    unstruck = "refused a micro-batch of driver 1a2b3c4d without a strike (spot check: ...)"
    held = "spot check at layer2: peer 1a2b3c4d computed an output two other peers disagree with; not using it for 60 s"
    struck = "refused a micro-batch of driver 1a2b3c4d: spot check: its stage-0 output for m is far from ..."
    replica = "layer0 peer 1a2b3c4d: spot check: its recomputation of stage 0 for m is far from two others"
    assert count_penalties([said, unstruck])["total"] == 0
    counts = count_penalties([held, struck, replica])
    assert (counts["spot_check"], counts["stage0_spot_check"], counts["total"]) == (1, 2, 3)


def test_referee_benchmark_quick_prices_the_weights_digest():
    import pytest

    report = _quick("benchmarks.referee")
    for name in ("digits", "heavy"):
        figures = report[name]
        assert figures["step_ms"] > 0 and figures["commit_ms"] > 0, figures
        assert report[f"digest_share_{name}"] == pytest.approx(figures["commit_ms"] / figures["step_ms"], rel=0.01)
    # an honest hop always reproduces from the exact weights it committed to (bfloat16 ones: see the benchmark)
    assert report["honest_failures_exact"] == 0 and 0 <= report["honest_failures_bf16"] <= 1
    assert report["tail"]["worst_cosine_exact"] > 0.9999, report["tail"]


def test_versus_benchmark_quick_trains_one_process_and_hivemind_peers_to_the_target():
    report = _quick("benchmarks.versus")
    for way in ("one_process", "hivemind"):
        assert report[way]["seconds_to_target"] is not None, report[way]
        _positive(report[way], ("samples", "cpu_s", "samples_per_cpu_s"))
    _positive(report, ("hivemind_time_vs_one_process", "hivemind_cpu_efficiency_vs_one_process"))


def test_framing_benchmark_quick_measures_both_ways_and_leaves_no_daemon(swarm):
    report = _quick("benchmarks.framing", swarm.env)
    assert set(report["sizes"]) == {"32k", "256k", "1m"} and report["reps"] == 20
    for figures in report["sizes"].values():
        for way in ("hivemind", "lean"):
            _positive(figures[way], ("round_trip_ms",))
    assert "python_cpu_1m_lean_vs_hivemind" in report and "p2pd_cpu_1m_lean_vs_hivemind" in report


def test_stream_cuts_benchmark_quick_calls_both_ways_and_none_that_asks_is_cut(swarm):
    report = _quick("benchmarks.stream_cuts", swarm.env)
    for way in ("plain", "ask"):
        assert report["ways"][way]["calls"] == 100
        _positive(report["ways"][way], ("cpu_ms_per_call", "ms_per_call"))
    assert report["cut_ask"] == 0 and report["cut_plain"] >= 0  # the plain way's cuts are rare (~0.2 %)
    _positive(report, ("cpu_ms_per_call_ask_vs_plain",))


def test_the_data_plane_figure_sums_each_peers_bytes_over_its_heartbeats_and_skips_what_it_cannot_span():
    """benchmarks/pipeline_dataplane.py: bytes moved = Mb/s x the span since the peer's previous record (its rates
    cover that span), an offline record or one without rates adds nothing, a peer's first record only starts it."""
    from types import SimpleNamespace

    from benchmarks.pipeline_dataplane import _Bytes

    def rec(peer, at, mbps_in, mbps_out, trained=0, state="online"):
        return SimpleNamespace(peer_id=peer, updated_at=at, mbps_in=mbps_in, mbps_out=mbps_out, trained=trained,
                               state=state)

    moved = _Bytes()
    moved.add([rec("a", 10.0, 8.0, 8.0, 0), rec("b", 10.0, 1.0, 1.0)])
    assert moved.moved == {}  # a first record only starts the count
    moved.add([rec("a", 12.0, 4.0, 4.0, 320), rec("b", 10.0, 9.0, 9.0)])  # b's record not refreshed: nothing
    moved.add([rec("a", 14.0, -1.0, -1.0, 640), rec("b", 12.0, 0.0, 8.0, state="offline")])
    assert moved.moved == {"a": 8e6 / 8 * 2.0}  # 8 Mb/s for 2 s; no rates (-1) and offline add nothing
    assert moved.last["a"].trained - moved.first["a"].trained == 640


def test_p2pd_start_benchmark_quick_prices_a_daemon_against_the_import_floor(swarm):
    report = _quick("benchmarks.p2pd_start", swarm.env)
    _positive(report, ("ready_cpu_s", "settled_cpu_s", "import_cpu_s", "rss_mib", "p2pd_vs_import"))
    assert report["settled_cpu_s"] >= report["ready_cpu_s"] and len(report["rounds"]) == 1


def test_stashing_benchmark_quick_trains_every_way_in_the_pipelines_schedule():
    report = _quick("benchmarks.stashing")
    seed = report["seeds"]["0"]
    for way in ("one_in_flight", "stashed", "unstashed", "predicted"):
        assert seed[way]["samples"] >= 640 and seed[way]["test_loss"] > 0
    assert seed["one_in_flight"]["staleness_mean"] == [0.0, 0.0, 0.0, 0.0]
    assert seed["stashed"]["staleness_mean"][0] > seed["stashed"]["staleness_mean"][2] > 0 == \
        seed["stashed"]["staleness_mean"][3]  # the pipeline's: the first stage waits longest, the last not at all
    assert seed["predicted"]["predicted_forwards"] > 0 == seed["stashed"]["predicted_forwards"]
    _positive(report, ("stashed_loss_vs_one_in_flight", "unstashed_loss_vs_one_in_flight",
                       "predicted_loss_vs_one_in_flight"))
