"""A hostile peer against real `volunteer join` processes (issue 14, item 7): the fast cases.

One swarm for the module (bootstrap + one volunteer per stage of a 3-stage digits MLP), attacked by
tests/hostile.py peers that speak the real protocol over hivemind P2P. The tests run in file order:
the ones that leave the run intact first, the one that (undefended) destroys a copy last. Each
asserts what a user would notice: the copy stays finite and close, the driver survives and keeps
training, the attacker is refused.
"""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

from copies import CopyOracle, params_finite, relative_distance
from hostile import HostilePeer, Reply
from procs import Swarm, wait_until, write_run
from swarm.pipeline.stage.stage_stats import SIMULATED_STEP_ENV
from volunteer.config import load_run

STAGES = 3
START_TIMEOUT_S = 120.0
WINDOW_S = 4.0
# Each stage's forward and backward take 15 ms, as on an accelerator (the compute thread sleeps): the module's swarm
# trains through every test, and CPU-bound it took 1.7 of the 2 cores from the suite's other worker for 50 s (86 s of
# the machine's CPU for the module alone; 50 s with the step, in the same wall time). What the tests measure, the
# attacker's effect on an honest driver's training, is a ratio and a count of hops: the same with 4 in flight.
STEP_ENV = {SIMULATED_STEP_ENV: "0.015"}
AWAITING_DEFENCES = "needs the issue-14 defences (bounded influence, who may ask, reply checks, hedged hops)"


@pytest.fixture(scope="module")
def run_swarm(tmp_path_factory):
    """(harness, run path, bootstrap maddr, {swarm: proc}) with every stage online and layer0 training."""
    tmp = tmp_path_factory.mktemp("adversary")
    harness = Swarm(tmp)
    try:
        run_path = write_run(tmp / "run.yaml", name="adversary-test", stages=STAGES, heartbeat_s=1.0)
        _, maddr = harness.bootstrap()
        procs = {f"layer{k}": harness.join(run_path, f"layer{k}", maddr, "--log-format", "json", name=f"layer{k}",
                                           env=STEP_ENV)
                 for k in range(STAGES)}
        yield harness, run_path, maddr, procs
    finally:
        left = harness.close()
        assert not left, f"processes outlived the tests: {left}"


@pytest.fixture(scope="module")
def driver(run_swarm, tmp_path_factory):
    """A hostile peer with no record yet (tests announce what they need); waits for training to start."""
    harness, run_path, maddr, procs = run_swarm
    run, _ = load_run(str(run_path))
    peer = HostilePeer(run, [maddr], tmp_path_factory.mktemp("hostile") / "driver.key", heartbeat_s=1.0)
    try:
        wait_until(lambda: _trained(peer) > 0 and all(peer.online(f"layer{k}") for k in range(STAGES)),
                   START_TIMEOUT_S, interval_s=0.5, what="every stage online and layer0 training")
        yield peer
    finally:
        peer.close()


def _layer0(peer: HostilePeer):
    records = peer.online("layer0")
    return records[0] if records else None


def _trained(peer: HostilePeer, timeout_s: float = 15.0) -> int:
    """The honest driver's count of trained samples. A DHT read on a loaded machine can miss its record (CI: a
    rate of 0 measured between a read that found it and one that did not), so a miss is read again, not 0."""
    deadline = time.monotonic() + timeout_s
    while True:
        record = _layer0(peer)
        if record is not None or time.monotonic() > deadline:
            return record.trained if record is not None else 0
        time.sleep(0.3)


def _training_rate(peer: HostilePeer, seconds: float) -> float:
    """Samples/s the honest driver completed over ``seconds`` (from its record, one heartbeat late)."""
    before = _trained(peer)
    time.sleep(seconds)
    return (_trained(peer) - before) / seconds


def _why_not(run_swarm, swarm: str = "layer0", lines: int = 12) -> str:
    """What a volunteer of the module's swarm said lately besides routine INFO (for an assertion's message: CI keeps
    nothing but the failure's text)."""
    said, status = [], {}
    for line in run_swarm[3][swarm].stdout().splitlines():  # --log-format json: events and status records
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if item.get("type") == "event":
            said.append(f"{item.get('level')}: {str(item.get('text'))[:200]}")
        elif "state" in item:
            status = item
    return (f"\n{swarm} said lately:\n" + "\n".join(said[-lines:]) +
            f"\nits last status: {status.get('state')} ({status.get('reason')})")


def _peer(peer: HostilePeer, swarm: str) -> str:
    return peer.online(swarm)[0].peer_id


def _announced(peer: HostilePeer, swarm: str, **fields) -> None:
    """Announce a record and wait until a store took it (one store can time out on a loaded machine; the peer's
    heartbeat stores it again, as a real volunteer's does)."""
    wait_until(lambda: peer.announce(swarm, **fields), 30, interval_s=0.5, what=f"our {swarm} record stored")


def _until_known(call, timeout_s: float = 10.0):
    """Repeat a call while the server does not know our new record yet (one heartbeat of grace)."""
    deadline = time.monotonic() + timeout_s
    while True:
        reply = call()
        if reply.code != "unknown_driver" or time.monotonic() > deadline:
            return reply
        time.sleep(float(reply.meta.get("retry_after_s", 0.5)))


def test_a_peer_without_a_layer0_record_is_not_served(driver):
    x = torch.zeros(8, 128)
    reply = driver.call(_peer(driver, "layer1"), "layer1", "forward", [x])
    assert not reply.ok and reply.code == "unknown_driver", (reply.code, reply.error)


def test_a_stranger_without_identity_work_is_nobody(driver, run_swarm, tmp_path_factory):
    """A key made for free (its record carries no proof of identity work, swarm/integrity/identity_work.py): its
    layer0 record is in the DHT, but no reader takes it, so it drives nothing: the stages refuse its forwards."""
    from swarm.dht.membership import latest
    from swarm.dht.records import parse_swarm, swarm_key

    with HostilePeer(driver.run, [run_swarm[2]], tmp_path_factory.mktemp("free") / "free.key", heartbeat_s=1.0,
                     work=False) as free:
        _announced(free, "layer0", shard=0)
        stored = latest(driver.dht, swarm_key(driver.run.run_id, "layer0")).result(timeout=30)
        assert free.peer_id in {r.peer_id for r in parse_swarm(stored.value, now=time.time())}, "not even stored"
        # the control: a stranger that paid for its key, announced at the same time, is known within that wait
        with HostilePeer(driver.run, [run_swarm[2]], tmp_path_factory.mktemp("paid") / "paid.key",
                         heartbeat_s=1.0) as paid:
            _announced(paid, "layer0", shard=0)
            time.sleep(4.0)  # a proven record is known to a stage within a heartbeat or two (1 s here)
            reply = free.call(_peer(driver, "layer1"), "layer1", "forward", [torch.zeros(8, 128)])
            assert not reply.ok and reply.code == "unknown_driver", (reply.code, reply.error)
            assert free.peer_id not in {r.peer_id for r in driver.online("layer0")}
            control = _until_known(lambda: paid.call(_peer(driver, "layer1"), "layer1", "forward",
                                                     [torch.zeros(8, 128)]))
            assert control.code != "unknown_driver", "a proven key was not known either: the test proves nothing"


def test_sample_ids_from_another_drivers_shard_are_refused(driver, run_swarm):
    from swarm.run.data import load_dataset, make_shards

    run = driver.run
    honest = _layer0(driver)
    own = (honest.shard + 1) % run.data.shards
    _announced(driver, "layer0", shard=own)
    dataset = load_dataset(run.data, run.model)
    shards = make_shards(dataset.y_train, run.data, dataset.num_classes)
    ids = torch.as_tensor(shards[honest.shard][:8], dtype=torch.int64)
    last = f"layer{STAGES - 1}"
    # a claim stays open to the others for 3 heartbeats after a stage first sees it (DriverView): this test may
    # run within that of the swarm's start, when the honest driver's shard is still open to everyone
    deadline = time.monotonic() + 15.0
    def attempt():  # a real forward through the stages before (they check no shards), then the last stage
        try:
            mb, h, rc = driver.forward_chain(torch.zeros(8, 128), ids, STAGES - 1)
        except RuntimeError as exc:  # our record is not known to layer1 yet
            return Reply(False, "unknown_driver", str(exc), meta={"retry_after_s": 0.5})
        return driver.call(_peer(driver, last), last, "forward_backward", [h, ids], {"mb": mb, "rc": rc})

    while True:
        reply = _until_known(attempt)
        if not reply.ok or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not reply.ok and reply.code == "wrong_shard", (reply.code, reply.error)


def test_a_black_hole_in_a_swarm_is_routed_around_within_seconds(driver, run_swarm, tmp_path_factory):
    # the rates come from the driver's record (a heartbeat a second): windows of several heartbeats, and the
    # first second after the first hop to the black hole (a hedge delay per lane) is not "within seconds" yet
    before = _training_rate(driver, 2 * WINDOW_S)
    with HostilePeer(driver.run, [run_swarm[2]], tmp_path_factory.mktemp("hole") / "hole.key",
                     heartbeat_s=1.0) as hole:
        servicer = hole.serve_stage("layer1", "black_hole")
        _announced(hole, "layer1")
        wait_until(lambda: servicer.requests > 0, 20, what="the driver to route a hop to the black hole")
        time.sleep(1.0)
        asked = servicer.requests
        during = _training_rate(driver, 2 * WINDOW_S)
        asked = servicer.requests - asked
    print(f"black hole: {before:.0f} -> {during:.0f} samples/s, {asked} hops to it in {2 * WINDOW_S:.0f} s")
    assert before > 0, _why_not(run_swarm) + _why_not(run_swarm, "layer2")
    # Routed around: the black hole gets a probe now and then (set aside 1, 2, 4 ... s after each unanswered hop),
    # not a share of the hops. The rate is the user's view; on a loaded 2-core machine it varies by 2x between
    # windows whatever the black hole does (CI: 1,844 -> 872), so it only has to show no stall.
    assert asked <= 6, f"the black hole still got {asked} hops in {2 * WINDOW_S:.0f} s"
    assert during >= 0.25 * before, f"training fell from {before:.0f} to {during:.0f} samples/s behind a black hole"


def test_malformed_replies_from_the_last_stage_do_not_stop_the_driver(driver, run_swarm, tmp_path_factory):
    layer0 = run_swarm[3]["layer0"]
    last = f"layer{STAGES - 1}"
    with HostilePeer(driver.run, [run_swarm[2]], tmp_path_factory.mktemp("liar") / "liar.key",
                     heartbeat_s=1.0) as liar:
        servicer = liar.serve_stage(last, "no_tensor")
        _announced(liar, last)
        wait_until(lambda: servicer.requests > 0, 20, what="the driver to route a hop to the malformed server")
        for behaviour in ("no_tensor", "wrong_shape", "nan", "huge", "garbage_metadata"):
            servicer.behaviour = behaviour
            time.sleep(1.0)
        served = servicer.requests
        during = _training_rate(driver, WINDOW_S)
    assert layer0.popen.poll() is None, "the layer0 volunteer exited"
    assert "driver failed" not in layer0.stdout(), "the driver died of a malformed reply"
    # One malformed reply bans its peer for a minute (swarm/pipeline/control/hops.py), so the driver does not come back for
    # more; each kind of malformed reply is checked on its own in tests/test_driver_replies.py.
    assert served >= 1
    assert during > 0, "the driver stopped training after malformed replies" + _why_not(run_swarm)


def test_one_huge_gradient_leaves_the_copy_finite_and_close(driver, run_swarm):
    oracle = CopyOracle(driver)
    peers = {f"layer{k}": _peer(driver, f"layer{k}") for k in range(STAGES)}
    if not driver.announced:
        _announced(driver, "layer0", shard=(_layer0(driver).shard + 1) % driver.run.data.shards)
    oracle.pull(peers)
    before = {k: v.clone() for k, v in oracle.stages[1].state_dict().items()}
    x = oracle.stage_input(1, oracle.dataset.x_train[:32])
    grad = torch.full((32, 128), 3.0e38)
    reply = _until_known(lambda: driver.call(peers["layer1"], "layer1", "backward", [grad, x], {"loss": 1.0}))
    time.sleep(2.0)  # let the honest driver's next micro-batches pass through the copy
    oracle.pull(peers)
    after = oracle.stages[1].state_dict()
    rate = _training_rate(driver, 3.0)
    assert params_finite(after), f"one backward (reply {reply.code or 'ok'}) made layer1's copy non-finite"
    assert relative_distance(after, before) < 0.5, "one backward moved layer1's copy by half its norm or more"
    assert rate > 0, "the honest driver stopped training after one hostile backward" + _why_not(run_swarm)


# ----- the harness's own payloads and the benchmark's figures (pure, no network)


def test_every_crafted_gradient_passes_the_wire_checks_but_is_hostile():
    from hostile import GRADIENT_ATTACKS, crafted_gradient

    honest = torch.randn(32, 128)
    for kind in GRADIENT_ATTACKS:
        crafted = crafted_gradient(kind, honest, torch.Generator().manual_seed(0))
        assert crafted.shape == honest.shape and bool(torch.isfinite(crafted).all()), kind
        assert not torch.allclose(crafted, honest), kind
    assert torch.equal(crafted_gradient("ascent", honest), -honest)
    assert crafted_gradient("random", honest).norm() == pytest.approx(honest.norm().item(), rel=1e-4)


def test_a_same_norm_poison_keeps_every_tensor_norm():
    from hostile import poisoned_params

    honest = {"w": torch.randn(16, 16), "b": torch.randn(16)}
    poisoned = poisoned_params("same_norm", honest, torch.Generator().manual_seed(0))
    for name, tensor in honest.items():
        assert poisoned[name].norm() == pytest.approx(tensor.norm().item(), rel=1e-4)
        assert relative_distance(poisoned, honest) > 0.5


def test_the_benchmark_flags_a_stale_evaluation_and_a_stalled_run():
    from benchmarks.adversary_metrics import Sample, longest_stall_s, longest_unlabelled_stale_s, summarize_run

    series = [Sample(t=2.0 * i, trained=100 * min(i, 10), lost=0, drivers=1,
                     true_accuracy=0.95 if i < 10 else 0.1, published_accuracy=0.95, published_labelled=False)
              for i in range(30)]
    assert longest_stall_s(series) == pytest.approx(38.0)
    assert longest_unlabelled_stale_s(series) == pytest.approx(38.0)
    figures = summarize_run(series, attack_at=20.0, attack_s=20.0, after_s=20.0)
    assert figures["killed"] and figures["accuracy_after"] == pytest.approx(0.1)
    dated = [dataclasses.replace(s, published_labelled=True) for s in series]
    assert longest_unlabelled_stale_s(dated) == 0.0, "an evaluation that says its age is not hidden staleness"


def test_a_slowed_run_is_also_compared_at_equal_samples():
    from benchmarks.adversary_metrics import equal_samples_ratio

    clean = {"curve": [(1000, 0.5), (4000, 0.8), (9000, 0.9)]}
    slowed = {"curve": [(500, 0.3), (3000, 0.76)]}  # a third of the samples in the same time
    assert equal_samples_ratio(slowed, clean) == pytest.approx(0.76 / 0.8)
    assert equal_samples_ratio({"curve": [(20000, 0.9)]}, clean) is None  # the clean run never trained as many


def test_the_benchmark_says_how_long_a_run_took_to_be_back_beside_the_clean_one():
    """issue 40 item 6: seconds from the attack's start until the attacked run is within 0.02 of the clean run's
    accuracy at the same time and stays there."""
    from benchmarks.adversary_metrics import Sample, recovery_s, summarize_run

    def run(accuracies: list[float]) -> dict:
        series = [Sample(t=5.0 * i, trained=100 * i, lost=0, drivers=1, true_accuracy=a, published_accuracy=a,
                         published_labelled=True) for i, a in enumerate(accuracies)]
        return summarize_run(series, attack_at=20.0, attack_s=20.0, after_s=20.0)

    clean = run([0.5, 0.8, 0.9, 0.92, 0.93, 0.94, 0.94, 0.95, 0.95, 0.95, 0.95, 0.95])
    assert recovery_s(run([0.5, 0.8, 0.9, 0.92, 0.925, 0.93, 0.94, 0.95, 0.95, 0.95, 0.95, 0.95]), clean) == 0.0
    hurt = run([0.5, 0.8, 0.9, 0.92, 0.6, 0.3, 0.7, 0.9, 0.94, 0.95, 0.95, 0.95])  # behind at t = 20..35, back at 40
    assert recovery_s(hurt, clean) == pytest.approx(20.0)
    assert recovery_s(run([0.5, 0.8, 0.9, 0.92, 0.6, 0.3, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]), clean) is None
