"""Weight prediction (``training.weight_prediction``; swarm/integrity/prediction.py, stage/predicting.py): a training
forward computes with its weights extrapolated along the last update by the stage's staleness, signs them as what it
computed with beside its version, and a referee rebuilds them exactly from the two versions the stage shows, within
the rules: a lie about them, or a prediction from a version the receipt did not sign, convicts. Real stage workers
and weights doors, no network."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch.func import functional_call

from swarm.integrity.prediction import PREDICT_MAX, Derivation, check_derivation, predict, within_one_step
from swarm.integrity.receipts import ReceiptKey
from swarm.integrity.recompute import recompute
from swarm.integrity.weights import weights_digest
from swarm.pipeline.control.referee import CONVICTED, HOLDS, Referee
from swarm.pipeline.stage.stage_rpc import refusal_error
from swarm.pipeline.stage.weights_rpc import WeightsDoor
from swarm.pipeline.stage.worker import StageWorker
from swarm.pipeline.transport.wire import decode_tensors
from swarm.run.data import load_dataset
from swarm.run.runconfig import RunConfig

RUN = RunConfig.model_validate({"name": "prediction", "model": {"stages": 3, "hidden_dim": 32},
                                "training": {"batch_size": 8, "weight_prediction": 1.0}})
HIDDEN = 32


def _stale_worker(index: int = 1, steps: int = 6, seed: int = 2) -> tuple[StageWorker, torch.Generator]:
    """A worker whose updates each land one update after their forward (staleness 1), as in a pipeline."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    worker = StageWorker(RUN, index)

    def x() -> torch.Tensor:
        return torch.randn(8, HIDDEN, generator=gen).relu() if index else torch.randn(8, 64, generator=gen)

    worker.forward("s0", x())
    for i in range(1, steps):
        worker.forward(f"s{i}", x())
        worker.backward(f"s{i - 1}", 0.1 * torch.randn(8, HIDDEN, generator=gen), None, None)
    return worker, gen


class _Door:
    """``call`` for a referee: the weights op answered by a real WeightsDoor over ``worker``; ``edit`` may change the
    reply's derivation (a liar's)."""

    def __init__(self, worker: StageWorker, edit=None):
        self.worker, self.door, self.edit = worker, WeightsDoor(), edit

    async def __call__(self, p2p, peer, namespace, op, tensors, meta, *, timeout_s, codec, max_bytes, expect_bytes):
        serialized, reply = await self.door.serve(self.worker, "referee", meta)
        if not reply.get("ok"):
            raise refusal_error(reply)
        if "derived" in reply and self.edit is not None:
            reply = {**reply, "derived": self.edit(reply["derived"])}
        return decode_tensors(serialized, max_bytes, coded=True), reply, 0.0


def _judge(worker: StageWorker, receipt, x, claim, edit=None):
    executor = ThreadPoolExecutor(max_workers=1)
    referee = Referee(RUN, None, {"layer1": "ns.layer1", "layer0": "ns.layer0"}, executor,
                      load_dataset(RUN.data, RUN.model), call=_Door(worker, edit))
    try:
        return asyncio.run(referee.judge(worker.index, "forward", [x], claim, receipt, "QmSigner"))
    finally:
        executor.shutdown()


def test_a_forward_computes_with_its_weights_predicted_along_the_last_update():
    worker, gen = _stale_worker()
    assert worker.staleness.mean() >= 0.5
    x = torch.randn(8, HIDDEN, generator=gen).relu()
    y = worker.forward("p", x)
    version, digest = worker.committed
    made = worker.derivations.get(worker.forward_weights)
    assert worker.forward_weights != digest and made is not None  # its receipt names both
    assert made.base == digest and made.tau == 1 and made.prev != digest
    assert worker.predicted_ahead == 1  # what the dashboard's staleness row says ("weights predicted 1 ahead")
    prev = worker.ring.get(made.prev).tensors
    live = {name: t.detach() for name, t in worker.module.state_dict().items()}
    expected = predict(live, prev, 1)
    assert weights_digest(expected) == worker.forward_weights
    for name in live:  # one update further along the last one
        assert torch.allclose(expected[name] - live[name], live[name] - prev[name], atol=1e-6)
    params = {name: expected[name] for name, _ in worker.named_params}
    assert torch.equal(y, functional_call(worker.module, params, (x,)))
    held = worker.cache._items[("", "p")]
    assert held.weights == worker.forward_weights and held.stash is not None
    # its backward, after another update: the gradient at the predicted weights, which a referee recomputes from them
    worker.forward("q", x)
    worker.backward("s5", 0.1 * torch.randn(8, HIDDEN, generator=gen), None, None)
    g = 0.1 * torch.randn(8, HIDDEN, generator=gen)
    grad_in = worker.backward("p", g, None, None)
    assert worker.forward_weights == held.weights
    again = recompute(RUN.model, worker.module, "backward", live, [g, x], None, expected, True)
    assert torch.allclose(grad_in, again, atol=1e-6)
    assert worker.predicted >= 1


def test_nothing_is_predicted_without_staleness_the_flag_or_at_the_last_stage():
    plain = RUN.model_copy(update={"training": RUN.training.model_copy(update={"weight_prediction": 0.0})})
    worker = StageWorker(plain, 1)
    worker.forward("a", torch.randn(8, HIDDEN).relu())
    assert worker.forward_weights == worker.committed[1]
    fresh = StageWorker(RUN, 1)  # no staleness yet: nothing to predict
    fresh.forward("a", torch.randn(8, HIDDEN).relu())
    fresh.backward("a", torch.randn(8, HIDDEN), None, None)
    fresh.forward("b", torch.randn(8, HIDDEN).relu())
    assert fresh.forward_weights == fresh.committed[1] and fresh.predicted == 0
    assert fresh.predicted_ahead == 0 and worker.predicted_ahead == 0


def test_the_predicted_copies_forwards_in_flight_hold_are_what_doctor_says():
    """Four micro-batches in flight at stage 0 (staleness 3): each forward awaiting its backward holds its own
    predicted copy, which `volunteer doctor` counts (swarm/run/memory.py: predict_bytes typically, stash_max_bytes
    at most), and none of it is the referee's ring's."""
    from swarm.run.memory import host_memory

    run = RUN.model_copy(update={"training": RUN.training.model_copy(update={"in_flight": 4})})
    gen = torch.Generator().manual_seed(3)
    worker = StageWorker(run, 0)
    need = host_memory(run, 0)
    weights = 4 * sum(p.numel() for p in worker.module.parameters())
    assert need.predict_bytes == 4 * weights and need.stash_max_bytes == 9 * weights
    plain = RUN.model_copy(update={"training": RUN.training.model_copy(update={"weight_prediction": 0.0})})
    assert host_memory(run, 2).predict_bytes == 0 and host_memory(plain, 0).predict_bytes == 0

    def held() -> int:  # distinct storages the predicted forwards' graphs and the predictor hold
        stashes = [s.stash for s in worker.cache._items.values() if worker.derivations.get(s.weights) is not None]
        if worker._prediction is not None:
            stashes.append(worker._prediction[2])
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for s in stashes for t in s.values()}
        ring = {t.untyped_storage().data_ptr() for v in worker.ring._versions.values()
                for t in (v.tensors or {}).values()}
        assert not set(storages) & ring  # predicted copies are never the ring's
        return sum(storages.values())

    most = 0
    for i in range(24):
        worker.forward(f"m{i}", torch.randn(8, 64, generator=gen))
        if i >= 3:
            most = max(most, held())
            worker.backward(f"m{i - 3}", 0.1 * torch.randn(8, HIDDEN, generator=gen), None, None)
    assert worker.predicted >= 12 and worker.predicted_ahead >= 1
    assert most == need.predict_bytes <= need.stash_max_bytes, (most / weights, need)  # measured: the estimate


def test_the_referee_rebuilds_predicted_weights_and_upholds_the_honest_forward():
    worker, gen = _stale_worker()
    key = ReceiptKey("QmSigner")
    x = torch.randn(8, HIDDEN, generator=gen).relu()
    y = worker.forward("p", x)
    version, digest = worker.committed
    receipt = key.sign(RUN.run_id, "p", "forward", 1, version, b"i" * 16, b"o" * 16, b"d" * 16, digest,
                       worker.forward_weights)
    assert _judge(worker, receipt, x, y).outcome == HOLDS
    lie = _judge(worker, receipt, x, 1.5 * y)
    assert lie.outcome == CONVICTED and "does not follow" in lie.why
    # predicted further than the rules let a stage: a lie, whatever the output
    far = _judge(worker, receipt, x, y, edit=lambda d: [d[0], d[1], PREDICT_MAX + 1])
    assert far.outcome == CONVICTED and "updates ahead" in far.why
    # a derivation that does not make the weights signed: their digest is not the one signed
    other = _judge(worker, receipt, x, y, edit=lambda d: [d[0], d[1], d[2] + 1])
    assert other.outcome == CONVICTED and "digest" in other.why
    # a forward that names weights predicted from another version than the one it signed
    elsewhere = key.sign(RUN.run_id, "p", "forward", 1, version, b"i" * 16, b"o" * 16, b"d" * 16, b"v" * 16,
                         worker.forward_weights)
    assert _judge(worker, elsewhere, x, y).outcome == CONVICTED


def test_a_prediction_from_a_version_past_one_update_convicts():
    """A signer may not pass off any weights as predicted: the version it predicts from must be one guarded update
    before the one it signed, or the referee convicts, though everything hashes and the output follows."""
    from swarm.pipeline.stage.weights_rpc import pack

    worker, gen = _stale_worker()
    key = ReceiptKey("QmSigner")
    x = torch.randn(8, HIDDEN, generator=gen).relu()
    version, digest = worker.committed
    worker.forward("p", x)
    live = {name: t.detach().clone() for name, t in worker.module.state_dict().items()}
    far = {n: t - 0.5 * t.sign() * t.abs().mean() for n, t in live.items()}  # no one update away
    far_digest = weights_digest(far)
    harmful = predict(live, far, 1)
    forged = weights_digest(harmful)
    worker.derivations.note(forged, Derivation(digest, far_digest, 1))
    y = functional_call(worker.module, {n: harmful[n] for n, _ in worker.named_params}, (x,))
    receipt = key.sign(RUN.run_id, "p", "forward", 1, version, b"i" * 16, b"o" * 16, b"d" * 16, digest, forged)
    door = _Door(worker)

    async def shows_far(p2p, peer, namespace, op, tensors, meta, **kwargs):
        if meta.get("digest") == far_digest:  # the liar keeps the made-up version in its ring
            flats, layout = pack(far)
            return flats, {"ok": True, **layout}, 0.0
        return await door(p2p, peer, namespace, op, tensors, meta, **kwargs)

    executor = ThreadPoolExecutor(max_workers=1)
    referee = Referee(RUN, None, {"layer1": "ns.layer1"}, executor, load_dataset(RUN.data, RUN.model), call=shows_far)
    try:
        verdict = asyncio.run(referee.judge(1, "forward", [x], y, receipt, "QmSigner"))
    finally:
        executor.shutdown()
    assert verdict.outcome == CONVICTED and "more than one update may" in verdict.why, verdict


def test_the_rules_of_a_derivation():
    torch.manual_seed(0)
    prev = {"w": torch.randn(16, 16), "b": torch.zeros(16), "steps": torch.tensor(3)}
    step = {"w": 0.01 * torch.randn(16, 16), "b": torch.full((16,), 1e-3), "steps": torch.tensor(0)}
    base = {n: prev[n] + step[n] for n in prev}
    names = ["w", "b"]
    assert within_one_step(base, prev, 0.05, names) is None
    ahead = predict(base, prev, 3)
    assert torch.allclose(ahead["w"], base["w"] + 3 * step["w"], atol=1e-6)
    assert torch.equal(ahead["steps"], base["steps"])
    assert torch.equal(predict(base, prev, 3)["w"], ahead["w"])  # bit for bit, every time
    jump = {**base, "w": prev["w"] * 1.5}
    assert "moved" in within_one_step(jump, prev, 0.05, names)
    assert "no parameter" in within_one_step({**base, "steps": torch.tensor(9)}, prev, 0.05, names)
    made = Derivation(b"a" * 16, b"b" * 16, 2)
    assert check_derivation(made, base, prev, 0.05, names) is None
    assert "ahead" in check_derivation(Derivation(b"a" * 16, b"b" * 16, 0), base, prev, 0.05, names)
    assert "signed" in check_derivation(made, base, prev, 0.05, names, expect_base=b"c" * 16)


def test_stage_one_upholds_a_predicting_drivers_stage0_output():
    from swarm.pipeline.control.stage0_checks import Stage0Checker

    driver, gen = _stale_worker(index=0)
    dataset = load_dataset(RUN.data, RUN.model)
    ids = torch.arange(8)
    h = driver.forward("mb", dataset.x_train[ids])
    assert driver.forward_weights != driver.committed[1]
    struck: list = []
    checker = Stage0Checker(RUN, None, None, lambda: [], lambda peer, reason, n: struck.append(peer), share=1.0,
                            call=_Door(driver), seed=0)

    async def verdicts():
        honest = await checker.start("QmDriver", "mb", h, ids, driver.forward_weights)
        made_up = await checker.start("QmDriver", "mb2", h.flip(0), ids, driver.forward_weights)
        return honest, made_up

    honest, made_up = asyncio.run(verdicts())
    assert honest == "upheld" and made_up != "upheld" and struck == ["QmDriver"]


def test_prediction_needs_stashing_and_enters_the_run_id_only_when_set():
    with pytest.raises(ValueError, match="weight_stashing"):
        RunConfig.model_validate({"name": "p", "training": {"weight_prediction": 2.0, "weight_stashing": False}})
    with pytest.raises(ValueError, match="weight_prediction"):
        RunConfig.model_validate({"name": "p", "training": {"weight_prediction": 9}})
    plain = RunConfig.model_validate({"name": "p"})
    off = RunConfig.model_validate({"name": "p", "training": {"weight_prediction": 0}})
    on = RunConfig.model_validate({"name": "p", "training": {"weight_prediction": 2.0}})
    assert plain.run_id == off.run_id != on.run_id
