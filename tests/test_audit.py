"""Update audits (swarm/integrity/audit.py, issue 40): a lone copy trained to harm computes every hop honestly from its
own weights, so every recomputation upholds it; the steps its updates take climb the loss of the micro-batches they
were computed from, and the referee's audits of them convict it. An honest copy's audits never do."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from swarm.integrity.audit import MARGIN, MIN_AUDITS, QUICK_AUDITS, UpdateAudits, VersionBook, update_cosine
from swarm.integrity.receipts import ReceiptKey
from swarm.pipeline.control.referee import CONVICTED, HOLDS
from swarm.pipeline.stage.worker import StageWorker
from test_referee import RUN, _Door, _referee


def test_the_cosine_of_a_step_with_its_gradient_says_descent_from_ascent():
    before = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}
    grads = {"w": torch.tensor([1.0, -1.0]), "b": torch.tensor([0.0])}
    descent = {n: t - 0.1 * grads[n] for n, t in before.items()}
    ascent = {n: t + 0.1 * grads[n] for n, t in before.items()}
    assert update_cosine(before, descent, grads) == pytest.approx(1.0)
    assert update_cosine(before, ascent, grads) == pytest.approx(-1.0)
    assert update_cosine(before, before, grads) == 0.0, "no step: no evidence either way"


def test_audits_convict_only_on_a_mean_below_the_margin_over_enough_updates():
    audits = UpdateAudits()
    # honest Adam measured +0.16 to +0.39 with single updates below 0 now and then
    assert all(audits.add("honest", 1, c) is None for c in [0.3, -0.2, 0.5, 0.1] * (4 * MIN_AUDITS))
    for i in range(QUICK_AUDITS - 1):
        assert audits.add("ascent", 1, -0.3) is None, "too few audits for a verdict"
    verdict = audits.add("ascent", 1, -0.3)  # climbing hard: the quick verdict
    assert verdict is not None and verdict.mean == pytest.approx(-0.3) and verdict.audits == QUICK_AUDITS
    assert "climb" in verdict.describe()
    assert audits.mean("ascent") is None, "convicted: audited afresh when it comes back"
    # flipped labels climb gently (-0.10 to -0.13 measured): the full count of audits, a smaller margin
    assert all(audits.add("flipped", 1, -0.1) is None for _ in range(MIN_AUDITS - 1))
    verdict = audits.add("flipped", 1, -0.1)
    assert verdict is not None and verdict.audits == MIN_AUDITS
    near = UpdateAudits()
    near_zero = [-MARGIN / 2] * (2 * MIN_AUDITS)
    assert all(near.add("zero", 1, c) is None for c in near_zero), "a copy near 0 is not convicted"


def test_the_version_book_keeps_the_latest_digest_named_and_is_bounded():
    book = VersionBook(kept=2)
    book.note("p", 1, 5, b"a" * 16)
    book.note("p", 1, 5, b"b" * 16)  # the peer restarted from a checkpoint: its version 5 is another one now
    book.note("p", 1, 6, b"\0" * 16)  # a receipt that commits to no weights names nothing
    assert book.digest("p", 1, 5) == b"b" * 16 and book.digest("p", 1, 6) is None
    book.note("p", 1, 7, b"c" * 16)
    book.note("p", 1, 8, b"d" * 16)
    assert book.digest("p", 1, 5) is None and book.digest("p", 1, 8) == b"d" * 16


def _ascent(worker: StageWorker) -> None:
    """The copy trained to harm of tests/hostile_stage.py: every update climbs; every hop computed honestly."""
    step = worker._update

    def climb() -> None:
        for param in worker.module.parameters():
            if param.grad is not None:
                param.grad.neg_()
        step()

    worker._update = climb


@pytest.mark.parametrize(("stage", "harm", "alone"), [(1, False, True), (2, False, True), (1, True, True),
                                                      (2, True, True), (2, True, False)])
def test_the_referee_upholds_every_hop_of_a_lone_copy_and_convicts_it_by_its_updates_only_when_they_climb(stage, harm,
                                                                                                         alone):
    """... and only where no other driver trains that copy: another driver's micro-batches fill the Adam momentum
    our update steps along, and crafted ones could turn an honest copy's steps against our gradients (said only)."""
    from swarm.run.data import load_dataset

    worker, key = StageWorker(RUN, stage), ReceiptKey("QmSigner")
    if harm:
        _ascent(worker)
    dataset = load_dataset(RUN.data, RUN.model)
    gen = torch.Generator().manual_seed(stage)
    referee, executor = _referee(_Door(worker))

    def hop(i: int):
        """One update of ours at this stage, its claim and receipt as the driver holds them, and the tensors."""
        mb = f"mb{i}"
        if stage == 1:
            x = torch.randn(16, 32, generator=gen).relu()
            worker.forward(mb, x)
            g = 0.05 * torch.randn(16, 32, generator=gen)
            version, digest = worker.committed
            forward_digest = worker.forward_weights
            grad_in = worker.backward(mb, g, None, None)
            receipt = key.sign(RUN.run_id, mb, "backward", stage, version, b"i" * 16, b"o" * 16, b"d" * 16, digest,
                               forward_digest)
            return "backward", [g, x], grad_in, receipt
        ids = torch.randint(0, len(dataset.y_train), (16,), generator=gen)
        x = torch.randn(16, 32, generator=gen).relu()
        worker._commit()
        version, digest = worker.committed
        _, grad_in = worker.forward_backward(mb, x, dataset.y_train[ids])
        receipt = key.sign(RUN.run_id, mb, "forward_backward", stage, version, b"i" * 16, b"o" * 16, b"d" * 16,
                           digest)
        return "forward_backward", [x, ids], grad_in, receipt

    outcomes, climbing = [], []
    referee.on_climbing = lambda k, verdict: climbing.append((referee.audited, verdict))
    referee.alone = lambda: alone

    async def judged(op, tensors, grad_in, receipt):
        verdict = await referee.judge(stage, op, tensors, grad_in, receipt, "QmSigner")
        await referee.audits_done()  # beside the lane: its verdict comes to on_climbing
        return verdict

    try:
        for i in range(MIN_AUDITS + 8):
            op, tensors, grad_in, receipt = hop(i)
            worker._commit()  # the next version, named by the peer's next receipt (the driver's version book)
            referee.versions.note("QmSigner", stage, *worker.committed)
            outcomes.append(asyncio.run(judged(op, tensors, grad_in, receipt)).outcome)
            if climbing or referee.climbing_not_alone:
                break
    finally:
        executor.shutdown()
    assert outcomes == [HOLDS] * len(outcomes), "every hop of it follows from its weights: each one holds"
    assert referee.audited == len(outcomes), "its updates were not audited"
    if harm and not alone:
        assert not climbing and referee.climbing_not_alone == 1 and len(outcomes) == QUICK_AUDITS
    elif harm:
        assert len(climbing) == 1 and climbing[0][1].outcome == CONVICTED and "climb the loss" in climbing[0][1].why
        assert climbing[0][0] == QUICK_AUDITS, "convicted at its first verdict: every audit of it climbs"
    else:
        assert not climbing and len(outcomes) == MIN_AUDITS + 8
        assert referee.audits.mean("QmSigner")[0] > 0.1


@pytest.mark.parametrize("alone", [True, False])
def test_a_copy_that_hides_the_versions_its_harmful_updates_made_is_convicted_at_its_first_audit(alone):
    """A copy trained to harm that shows a referee every other version only (tests/hostile_stage.py
    ``withholding_harm``): a judgement of an even version holds, and before pins the audit of the update after it never
    got its next version (``lone_last_withholding_harm`` went to chance unconvicted). A judged update's version is now
    shown with the next one pinned, so calling it gone is a lie whoever else trains the copy."""
    worker, key = StageWorker(RUN, 2), ReceiptKey("QmSigner")
    _ascent(worker)
    show = worker.ring.show
    worker.ring.show = lambda digest, *args: (
        (None, False) if (kept := show(digest, *args))[0] is not None and kept[0].version % 2 else kept)
    from swarm.run.data import load_dataset

    dataset = load_dataset(RUN.data, RUN.model)
    gen = torch.Generator().manual_seed(5)
    referee, executor = _referee(_Door(worker))
    convicted = []
    referee.on_climbing = lambda k, verdict: convicted.append(verdict)
    referee.alone = lambda: alone
    outcomes = []

    async def judged(tensors, grad_in, receipt):
        verdict = await referee.judge(2, "forward_backward", tensors, grad_in, receipt, "QmSigner")
        await referee.audits_done()
        return verdict.outcome

    try:
        for i in range(6):
            ids = torch.randint(0, len(dataset.y_train), (16,), generator=gen)
            x = torch.randn(16, 32, generator=gen).relu()
            worker._commit()
            version, digest = worker.committed
            _, grad_in = worker.forward_backward(f"mb{i}", x, dataset.y_train[ids])
            receipt = key.sign(RUN.run_id, f"mb{i}", "forward_backward", 2, version, b"i" * 16, b"o" * 16, b"d" * 16,
                               digest)
            worker._commit()
            referee.versions.note("QmSigner", 2, *worker.committed)
            outcomes.append(asyncio.run(judged([x, ids], grad_in, receipt)))
            if convicted:
                break
    finally:
        executor.shutdown()
    assert len(convicted) == 1 and convicted[0].outcome == CONVICTED and "withheld its version" in convicted[0].why
    assert referee.withheld == 1 and referee.audited == 0 and outcomes[-1] == HOLDS
    assert len(outcomes) <= 2, f"convicted at the first judged even version: {outcomes}"


def test_a_pinned_version_outlives_the_rings_bounds_and_pins_are_bounded():
    """The honest side: a ring asked to keep the version after a shown one keeps it past its bytes and keep_s (the
    next oldest goes instead) for PIN_S or until its pinner fetches it; PIN_MAX pins in all, PIN_PER_PINNER of one
    pinner's; a door pins for the run's drivers only, and says whether it did."""
    from swarm.integrity.weights import PIN_MAX, PIN_S, WeightsRing, committed_bytes
    from swarm.pipeline.stage.weights_rpc import WeightsDoor
    from swarm.run.models import build_stage
    from test_referee import _commit_versions

    module = build_stage(RUN.model, 1)
    size = committed_bytes(module.state_dict())
    ring = WeightsRing(max_bytes=2 * size, keep_s=5.0)
    digests = _commit_versions(ring, module, range(3))
    shown, pinned = ring.show(digests[1], now=2.5, pinner="QmReferee", pin_next=True)
    assert shown is not None and pinned and shown.version == 1
    digests += _commit_versions(ring, module, range(3, 8))  # version 2 is pinned: older than every kept one
    kept = [ring.get(d, now=7.5) is not None for d in digests]
    assert kept == [False, False, True, False, False, True, True, True], kept
    assert ring.get(digests[2], now=2.5 + PIN_S - 1).version == 2  # past keep_s and the bytes, within PIN_S
    digests += _commit_versions(ring, module, range(int(3 + PIN_S), int(4 + PIN_S)))
    assert ring.get(digests[2], now=4 + PIN_S) is None  # the pin is over: it goes as any other
    again = _commit_versions(ring, module, range(40, 43))
    assert ring.show(again[0], now=42.5, pinner="QmReferee", pin_next=True)[1]
    again += _commit_versions(ring, module, range(43, 46))
    assert ring.show(again[1], now=45.4, pinner="QmReferee")[0] is not None  # a judgement's fetch: kept on
    assert ring.get(again[1], now=45.45) is not None
    assert ring.show(again[1], now=45.5, pinner="QmReferee", release=True)[0] is not None  # its audit's: let go
    assert ring.get(again[1], now=45.6) is None and ring.get(again[2], now=45.6) is None
    roomy = WeightsRing(max_bytes=100 * size, keep_s=1000.0)
    many = _commit_versions(roomy, module, range(2 * PIN_MAX + 4))  # pins of versions 1, 3, 5...: none fetched
    grants = [roomy.show(many[2 * i], now=10.0, pinner=f"Qm{i // 2}", pin_next=True)[1]
              for i in range(PIN_MAX + 1)]
    assert grants == [True] * PIN_MAX + [False], grants  # PIN_MAX in all
    assert not roomy.show(many[2 * PIN_MAX + 2], now=10.0, pinner="Qm0", pin_next=True)[1]  # 2 a pinner
    assert roomy.show(many[0], now=10.0, pinner="Qm0", pin_next=True)[1], "pinned already: asked again"
    assert roomy.show(many[-2], now=11.0 + PIN_S, pin_next=True)[1], "the pins are over: room again"
    worker = StageWorker(RUN, 1)
    door = WeightsDoor()
    worker.forward("mb", torch.randn(4, 32).relu())
    digest = worker.committed[1]
    _, reply = asyncio.run(door.serve(worker, "referee", {"digest": digest, "pin": True}))
    assert reply["ok"] and reply["pinned"] is True
    _, plain = asyncio.run(door.serve(worker, "other", {"digest": digest}))
    assert plain["ok"] and "pinned" not in plain
    time.sleep(0.01)  # the door's interval per requester
    _, stranger = asyncio.run(door.serve(worker, "QmStranger", {"digest": digest, "pin": True}, may_pin=False))
    assert stranger["ok"] and stranger["pinned"] is False
