"""Layer-per-swarm training with real processes on 127.0.0.1."""

from __future__ import annotations

import json
import re
import signal

from procs import wait_until

PIPE_RUN = """\
name: pipetest
model: {{stages: 3, hidden_dim: 32}}
optimizer: {{name: adam, lr: 0.001}}
training: {{batch_size: 16, in_flight: 4, eval_every_s: 3}}
timeouts: {{heartbeat_s: 1.0, rpc_s: 5}}
{extra}
"""


def _run(tmp_path, extra: str = ""):
    path = tmp_path / "pipe.yaml"
    path.write_text(PIPE_RUN.format(extra=extra))
    return path


def _rows(report: dict, swarm: str, state: str | None = None) -> list[dict]:
    return [r for r in report["swarms"][swarm] if state is None or r["state"] == state]


def _trained(report: dict) -> int:
    rows = _rows(report, "layer0")
    return rows[0]["trained"] if rows else 0


def test_killing_a_middle_peer_loses_no_microbatch(swarm, tmp_path):
    run = _run(tmp_path)
    _, maddr = swarm.bootstrap()
    driver = swarm.join(run, "layer0", maddr, name="layer0")
    middles = [swarm.join(run, "layer1", maddr, name=f"layer1-{i}") for i in range(2)]
    swarm.join(run, "layer2", maddr, name="layer2")

    def trained(minimum: int, middles_online: int):
        report = swarm.status(run, maddr)
        rows = _rows(report, "layer0", "online")
        if len(_rows(report, "layer1", "online")) == middles_online and rows and rows[0]["trained"] >= minimum:
            return report
        return None

    report = wait_until(lambda: trained(2000, 2), 90, interval_s=1.0, what="training through both layer1 peers")
    served = {r["peer_id"]: r["served"] for r in _rows(report, "layer1")}
    assert all(count > 0 for count in served.values()), f"both middle peers take work: {served}"

    middles[0].signal(signal.SIGKILL)
    before = _rows(report, "layer0")[0]["trained"]
    report = wait_until(lambda: trained(before + 3000, 1), 90, interval_s=1.0, what="training to go on after the kill")
    assert _rows(report, "layer0")[0]["lost"] == 0

    # A clean stop of the driver: every sample it counts as trained went through every stage exactly once.
    driver.signal(signal.SIGINT)
    assert driver.wait(30) == 0
    final = swarm.status(run, maddr)
    layer0 = _rows(final, "layer0")[0]
    assert layer0["state"] == "offline" and layer0["lost"] == 0
    assert layer0["clock"] == layer0["trained"]
    assert sum(r["clock"] for r in _rows(final, "layer2")) == layer0["trained"]
    assert "waiting" not in driver.stdout() or "online peer now" in driver.stdout()


def test_an_empty_swarm_is_named_and_training_starts_when_it_fills(swarm, tmp_path):
    run = _run(tmp_path)
    _, maddr = swarm.bootstrap()
    driver = swarm.join(run, "layer0", maddr, name="layer0")
    swarm.join(run, "layer2", maddr, name="layer2")
    driver.wait_for_output("waiting: swarm layer1 has no online peer", timeout_s=60)
    swarm.join(run, "layer1", maddr, name="layer1")
    driver.wait_for_output("layer1 has an online peer now", timeout_s=60)
    wait_until(lambda: _trained(swarm.status(run, maddr)) > 0, 60, interval_s=1.0,
               what="training once layer1 is online")


def test_two_layer0_peers_take_different_shards(swarm, tmp_path):
    run = _run(tmp_path)
    _, maddr = swarm.bootstrap()
    first = swarm.join(run, "layer0", maddr, name="first")
    first.wait_for_output("holding data shard", timeout_s=60)
    wait_until(lambda: _rows(swarm.status(run, maddr), "layer0", "online"), 30, interval_s=1.0, what="first online")
    second = swarm.join(run, "layer0", maddr, name="second")
    second.wait_for_output("holding data shard", timeout_s=60)
    shards = [int(re.search(r"holding data shard (\d+)", p.stdout()).group(1)) for p in (first, second)]
    assert shards[0] != shards[1], shards


def test_demo_trains_to_the_accuracy_bar_and_cleans_up(swarm):
    demo = swarm.start("demo", "--json", "--time-limit-s", "240", name="demo")
    assert demo.wait(300) == 0, demo.stderr()[-3000:]
    result = json.loads(demo.stdout().strip().splitlines()[-1])
    assert result["test_accuracy"] >= 0.95
    assert result["lost_microbatches"] == 0 and result["samples"] > 0
    assert "final report" in demo.stderr()


def test_export_then_eval_reproduces_the_reported_accuracy(swarm, tmp_path):
    run = _run(tmp_path)
    _, maddr = swarm.bootstrap()
    driver = swarm.join(run, "layer0", maddr, name="layer0")
    for k in (1, 2):
        swarm.join(run, f"layer{k}", maddr, name=f"layer{k}")
    wait_until(lambda: _trained(swarm.status(run, maddr)) > 3000, 90, interval_s=1.0,
               what="some training")
    # The driver finishes (drains, evaluates once more, pauses): the swarm's weights stop moving, and the
    # published accuracy is of exactly those weights.
    ctl = swarm.start("ctl", "finish", "--swarm", "layer0", "--json", name="ctl")
    assert ctl.wait(60) == 0, ctl.stderr()

    def paused_with_evaluation():
        rows = _rows(swarm.status(run, maddr), "layer0")
        return rows and rows[0]["state"] == "paused" and "final evaluation" in driver.stdout()

    wait_until(paused_with_evaluation, 60, interval_s=1.0, what="layer0 paused with a final evaluation")

    model = tmp_path / "model.pt"
    export = swarm.start("export", "--run", str(run), "--initial-peers", maddr, "--out", str(model), "--json",
                         name="export")
    assert export.wait(120) == 0, export.stderr()
    reported = json.loads(export.stdout().strip().splitlines()[-1])["reported"]
    evaluated = swarm.start("eval", "--model", str(model), "--json", name="eval")
    assert evaluated.wait(120) == 0, evaluated.stderr()
    result = json.loads(evaluated.stdout().strip().splitlines()[-1])
    assert reported["state"] == "paused"
    assert result["test_accuracy"] == reported["test_accuracy"]
    assert abs(result["test_loss"] - reported["test_loss"]) < 1e-4
