"""A real layer0 volunteer (the driver) against hostile layer1 peers over the real DHT and P2P:
a black hole and a peer that answers malformed replies, each next to an honest peer. The two cases share
one bootstrap peer; each has a run (and so a namespace) of its own."""

from __future__ import annotations

import time

import pytest

from impostor import Impostor
from procs import Swarm, wait_until
from volunteer.config import load_run

RUN = """\
name: drvswarm-{mode}
model: {stages: 2, hidden_dim: 32}
optimizer: {name: adam, lr: 0.001}
training: {batch_size: 16, in_flight: 4, eval_every_s: 3}
timeouts: {heartbeat_s: 1.0, rpc_s: 30}
"""


@pytest.fixture(scope="module")
def bootstrap(tmp_path_factory):
    """(harness, bootstrap maddr) for the module."""
    harness = Swarm(tmp_path_factory.mktemp("drvswarm"))
    try:
        _, maddr = harness.bootstrap()
        yield harness, maddr
    finally:
        left = harness.close()
        assert not left, f"processes outlived the tests: {left}"


@pytest.mark.parametrize("mode", ["black_hole", "malformed"])
def test_a_hostile_layer1_peer_next_to_an_honest_one_does_not_stop_training(bootstrap, tmp_path, mode):
    swarm, maddr = bootstrap
    path = tmp_path / "run.yaml"
    path.write_text(RUN.replace("{mode}", mode))
    run, _ = load_run(str(path))
    with Impostor(run, "layer1", maddr, "honest", tmp_path / "honest.key") as honest, \
            Impostor(run, "layer1", maddr, mode, tmp_path / "hostile.key") as hostile:
        driver = swarm.join(path, "layer0", maddr, name=f"layer0-{mode}", env={"VOLUNTEER_DATA_DIR": str(tmp_path)})
        wait_until(lambda: hostile.requests > 0, 60, interval_s=0.2, what=f"the driver to reach the {mode} peer")
        reached = time.monotonic()
        served = honest.answered
        # rpc_s is 30 s: training must go on long before that
        wait_until(lambda: honest.answered >= served + 100, 20, interval_s=0.2,
                   what=f"100 micro-batches through the honest peer after the first request to the {mode} peer")
        seconds = time.monotonic() - reached
        print(f"{mode}: 100 micro-batches through the honest peer {seconds:.1f} s after the first hostile request")
        assert hostile.requests <= 3, f"the {mode} peer is routed around, not asked again and again"
        log = driver.stdout() + driver.stderr()
        assert "the driver failed" not in log and "gave up a micro-batch" not in log
        driver.stop()  # before its layer1 peers leave: a driver left without them takes ~10 s to exit
