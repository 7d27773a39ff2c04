"""A run config that diverges by itself heals and goes on training, with real processes on 127.0.0.1.

SGD with momentum 0.9 at a step size far too large for the model is the fast version of what a busy
machine did to the schema's default optimizer (stale gradients, a loss of ~1e35): the copies must
notice, restore their last good state, lower their step size, keep training, lose no micro-batch,
and say so in `volunteer status`.
"""

from __future__ import annotations

from procs import wait_until

DIVERGING_RUN = """\
name: healtest
model: {stages: 2, hidden_dim: 32}
optimizer: {name: sgd, lr: 5.0, momentum: 0.9}
training: {batch_size: 16, in_flight: 2, eval_every_s: 2}
integrity: {heal_steps: 400}
timeouts: {heartbeat_s: 1.0, rpc_s: 5}
"""


def test_a_diverging_copy_heals_lowers_its_step_and_keeps_training(swarm, tmp_path):
    run = tmp_path / "diverging.yaml"
    run.write_text(DIVERGING_RUN)
    _, maddr = swarm.bootstrap()
    driver = swarm.join(run, "layer0", maddr, name="layer0")
    swarm.join(run, "layer1", maddr, name="layer1")

    def healed_and_training():
        report = swarm.status(run, maddr)
        heals = sum(report.get("heals", {}).values())
        layer0 = report["swarms"]["layer0"]
        if heals and layer0 and layer0[0]["trained"] > 3000 and report.get("evaluation"):
            return report
        return None

    report = wait_until(healed_and_training, 120, interval_s=1.0, what="a heal, then training past it")
    driver.wait_for_output("healed:", timeout_s=10)
    assert report["swarms"]["layer0"][0]["lost"] == 0, "no micro-batch is lost to a sick copy"
    evaluation = report["evaluation"]
    assert evaluation["age_s"] is not None and not evaluation["stale"]
    trained = report["swarms"]["layer0"][0]["trained"]
    later = wait_until(lambda: (r := swarm.status(run, maddr))["swarms"]["layer0"][0]["trained"] > trained + 2000
                       and r, 60, interval_s=1.0, what="training to go on after healing")
    assert later["evaluation"]["test_accuracy"] is not None
