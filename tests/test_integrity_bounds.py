"""The stage's bounds without a network: clipping, the guarded step, fair share, strikes and bans, labels by id."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from swarm.pipeline.stage.activations import ActivationCache, Saved, owner_cap
from swarm.integrity.clip import NormHistory, clip_scale, combined_bound, history_bound, step_bound, step_ceiling
from swarm.integrity.guard import StepGuard, StepRefused, typical_tensor_norm
from swarm.integrity.labels import DriverView, LabelSource, WrongShard, allowed_shards
from swarm.integrity.requesters import (
    RequesterBook,
    ban_duration_s,
    decayed,
    fair_share_allows,
    newcomers_allow,
    probation_allows,
)
from swarm.dht.records import MemberRecord
from swarm.run.runconfig import IntegrityConfig, RunConfig
from swarm.pipeline.stage.worker import StageWorker

RUN = RunConfig.model_validate({"name": "bounds", "model": {"stages": 3, "hidden_dim": 32},
                                "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}})


# ----- clipping


def test_clip_scale_brings_a_norm_onto_the_bound_and_refuses_non_finite_norms():
    assert clip_scale(10.0, 2.0) == pytest.approx(0.2)
    assert clip_scale(1.0, 2.0) == 1.0
    assert clip_scale(1e30, None) == 1.0
    assert clip_scale(math.inf, 2.0) == 0.0 and clip_scale(math.nan, None) == 0.0


def test_history_bound_needs_enough_history_then_follows_the_median():
    assert history_bound([1.0] * 7, 3.0) is None
    assert history_bound([1.0] * 7 + [100.0], 3.0) == pytest.approx(3.0)  # one outlier does not move the median
    history = NormHistory(size=8, multiplier=3.0)
    for norm in [1.0, 2.0] * 4:
        history.accept(norm, was_clipped=False)
    assert history.bound() == pytest.approx(4.5)
    history.accept(math.inf, was_clipped=True)
    assert len(history.norms) == 8 and history.clipped_fraction == pytest.approx(1 / 9)


def test_step_ceiling_and_step_bound_are_scale_free():
    assert step_ceiling(param_norm=10.0, lr=0.1, max_step_ratio=0.05) == pytest.approx(5.0)
    assert step_ceiling(0.0, 0.1, 0.05) is None
    assert combined_bound(None, 5.0, 3.0) == 3.0 and combined_bound(None, None) is None
    assert step_bound(tensor_norm=10.0, floor_norm=1.0, max_step_ratio=0.05) == pytest.approx(0.5)
    assert step_bound(tensor_norm=0.0, floor_norm=1.0, max_step_ratio=0.05) == pytest.approx(0.05)  # a zero bias


# ----- the guarded step


def _module_and_optimizer():
    torch.manual_seed(0)
    module = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    return module, optimizer


def test_a_step_that_would_be_non_finite_is_undone_with_its_optimizer_state():
    module, optimizer = _module_and_optimizer()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    guard = StepGuard(module, optimizer, max_step_ratio=0.05)
    for p in module.parameters():
        p.grad = torch.full_like(p, math.inf)
    with pytest.raises(StepRefused):
        guard.run(optimizer.step)
    for name, p in module.named_parameters():
        assert torch.equal(p, before[name])
    assert not optimizer.state, "the refused step's fresh momentum buffers must be dropped too"
    assert guard.refused == 1


def test_the_step_bound_shortens_a_long_move_and_keeps_its_direction():
    module, optimizer = _module_and_optimizer()
    old = [p.detach().clone() for p in module.parameters()]
    for p in module.parameters():
        p.grad = torch.full_like(p, 100.0)
    result = StepGuard(module, optimizer, max_step_ratio=0.05).run(optimizer.step)
    assert result.tensors_scaled == 2
    floor = typical_tensor_norm([float(o.norm()) for o in old])
    for p, o in zip(module.parameters(), old):
        limit = 0.05 * max(float(o.norm()), floor)
        assert float((p.detach() - o).norm()) == pytest.approx(limit, rel=1e-4)
        assert torch.all((p - o) < 0), "the move keeps the update's direction"


def test_an_ordinary_step_passes_the_guard_unchanged():
    module, optimizer = _module_and_optimizer()
    for p in module.parameters():
        p.grad = torch.full_like(p, 1e-3)
    expected = [p.detach() - 0.1 * 1e-3 for p in module.parameters()]
    assert StepGuard(module, optimizer, max_step_ratio=0.05).run(optimizer.step).tensors_scaled == 0
    for p, e in zip(module.parameters(), expected):
        assert torch.allclose(p, e)


def _train_worker(worker: StageWorker, steps: int, owner: str = "honest") -> None:
    torch.manual_seed(1)
    for i in range(steps):
        x = torch.randn(8, 32)
        worker.forward(f"w{i}", x, owner=owner)
        worker.backward(f"w{i}", torch.randn(8, 32) * 0.01, None, None, owner=owner)


@pytest.mark.parametrize("size", [3e38, 1e30, 1e6])
def test_one_huge_finite_gradient_leaves_the_copy_finite_and_moved_within_the_bound(size):
    """The measured attack: one backward with a finite gradient of 3e38 turned layers 0 and 1 to NaN for good."""
    worker = StageWorker(RUN, 1)
    _train_worker(worker, 12)
    before = {n: p.detach().clone() for n, p in worker.module.named_parameters()}
    x = torch.randn(8, 32)
    try:
        grad_in = worker.backward("evil", torch.full((8, 32), size), x, None, owner="evil")
        assert bool(torch.isfinite(grad_in).all())
    except ValueError:
        pass  # rejected, nothing applied: as good
    floor = typical_tensor_norm([float(b.norm()) for b in before.values()])
    for name, p in worker.module.named_parameters():
        assert bool(torch.isfinite(p).all())
        limit = 0.05 * max(float(before[name].norm()), floor)
        assert float((p - before[name]).norm()) <= limit * 1.001
    _train_worker(worker, 3)  # still trains
    assert all(bool(torch.isfinite(p).all()) for p in worker.module.parameters())


def test_an_update_far_above_the_recent_ones_is_clipped_to_the_multiplier():
    worker = StageWorker(RUN, 1)
    _train_worker(worker, 12)
    bound = worker.grad_out_rms.bound()
    worker.backward("big", torch.randn(8, 32) * 50, torch.randn(8, 32), None, owner="big")
    assert worker.last_update.clip_scale < 0.1
    assert worker.grad_out_rms.norms[-1] == pytest.approx(bound)


def test_zero_updates_never_make_honest_ones_look_non_finite():
    """Measured: zero-gradient micro-batches filled the history, the median (and bound) became 0, and every
    later honest update was refused as 'not finite': the driver lost 60-106 micro-batches in 2.5 s."""
    history = NormHistory(size=16, multiplier=3.0)
    for _ in range(16):
        history.accept(0.0, was_clipped=False)
    assert history.bound() is None
    assert clip_scale(1e-3, 0.0) == 1.0  # no scale information, not a non-finite norm
    worker = StageWorker(RUN, 1)
    _train_worker(worker, 12)
    for i in range(80):  # a driver sending all-zero output gradients
        worker.forward(f"z{i}", torch.randn(8, 32), owner="zeros")
        worker.backward(f"z{i}", torch.zeros(8, 32), None, None, owner="zeros")
    _train_worker(worker, 3)  # honest updates are still applied
    assert worker.last_update.clip_scale > 0


def test_a_driver_on_probation_is_clipped_to_the_median_and_cannot_lift_the_bound():
    """Measured: gradients x100 from a newcomer, clipped to 3x the median and entering the history, took
    accuracy to 0.86 of the clean run while it held half of the stage's updates."""
    worker = StageWorker(RUN, 1)
    _train_worker(worker, 12)
    worker.on_probation = lambda owner: owner == "new"
    median_bound = worker.grad_out_rms.bound(1.0)
    history = list(worker.grad_out_rms.norms)
    for i in range(20):
        worker.forward(f"n{i}", torch.randn(8, 32), owner="new")
        worker.backward(f"n{i}", torch.randn(8, 32) * 50, None, None, owner="new")
        assert worker.last_update.clip_scale < 0.05
    assert list(worker.grad_out_rms.norms) == history  # the newcomer's norms never entered the history
    assert worker.grad_out_rms.bound(1.0) == pytest.approx(median_bound)
    worker.forward("senior", torch.randn(8, 32), owner="honest")
    worker.backward("senior", torch.randn(8, 32) * 50, None, None, owner="honest")
    assert worker.grad_out_rms.norms[-1] == pytest.approx(worker.grad_out_rms.multiplier * median_bound, rel=0.05)


# ----- who may ask, and how much


def test_fair_share_allows_a_burst_then_a_multiple_of_the_others():
    assert fair_share_allows(own=5, others=[], slack=2.0, burst=4)  # alone: the whole stage
    assert fair_share_allows(own=3, others=[1], slack=2.0, burst=4)
    assert fair_share_allows(own=19, others=[10, 10], slack=2.0, burst=4)
    assert not fair_share_allows(own=20, others=[10, 10], slack=2.0, burst=4)


def test_probation_holds_a_newcomer_to_a_share_of_the_established_drivers():
    assert probation_allows(own=3, established=[100], share=0.25)  # the small burst is always allowed
    assert probation_allows(own=24, established=[100], share=0.25)
    assert not probation_allows(own=25, established=[100], share=0.25)
    assert probation_allows(own=500, established=[], share=0.25)  # nobody established: no probation


def _applier(book: RequesterBook):
    """``apply(requester, now)``: admit one update and apply it unclipped; the refusal's code, or None if applied."""

    def apply(requester: str, now: float) -> str | None:
        refusal = book.admit(requester, True, now=now)
        if refusal is not None:
            return refusal.code
        book.finished(requester)
        book.on_update(requester, 1.0, now=now)
        return None

    return apply


def test_a_newcomer_is_held_back_until_it_has_served_its_probation():
    """Measured: 64 gradient-ascent updates accepted at the full fair share (32 burst, then 2x the honest
    driver) took accuracy from 0.95 to 0.72 within a second."""
    cfg = IntegrityConfig(fair_share_burst=32, fair_share_slack=2.0, probation_updates=16, probation_share=0.25)
    book = RequesterBook(cfg)
    apply = _applier(book)

    assert [apply("senior", t * 0.01) for t in range(40)] == [None] * 40  # alone: the whole stage
    codes = [apply("stranger", 0.5 + t * 0.001) for t in range(40)]
    assert codes.count(None) == 10 and codes[-1] == "busy"  # 0.25 x the senior's 40 in the window
    assert "new here" in book.admit("stranger", True, now=0.6).error
    assert book.on_probation("stranger", now=0.6) and not book.on_probation("senior", now=0.6)
    for step in range(6):  # the senior keeps training; the newcomer's share grows with it, past probation
        for t in range(40):
            apply("senior", 1.0 + step + t * 0.001)
        for t in range(40):
            apply("stranger", 1.5 + step + t * 0.001)
    assert book._book["stranger"].applied >= cfg.probation_updates
    assert apply("stranger", 8.0) is None  # established now: the ordinary fair share (2x) applies
    assert not book.on_probation("stranger", now=8.0)
    # established now, but it came later: sending a few updates does not hold the senior driver back
    for t in range(200):
        assert apply("senior", 9.0 + t * 0.01) is None
    # a ban sends a driver back to probation
    book._ban("stranger", book._book["stranger"], 12.0, "test")
    assert book._book["stranger"].applied == 0


def test_newcomers_together_share_one_pool_however_many_keys_they_have():
    """Issue 25, item 5: probation was per identity and identities cost nothing, so 100 fresh keys had 100 shares
    (and 100 bursts). Together they now get one established driver's share; the established driver keeps its own."""
    cfg = IntegrityConfig(fair_share_burst=32, fair_share_slack=2.0, probation_updates=64, probation_share=0.25)
    book = RequesterBook(cfg)
    apply = _applier(book)

    for t in range(80):  # an honest driver past its probation: 80 updates in the 10 s window
        assert apply("honest", t * 0.01) is None
    applied = sum(apply(f"sybil{k}", 1.0 + k * 0.001 + t * 0.0001) is None for k in range(100) for t in range(8))
    assert applied == 80, "4 x 0.25 x the honest driver's 80 (one driver's share) for all 100 keys together"
    assert "taken by the others" in book.admit("sybil99", True, now=1.5).error
    assert all(apply("honest", 1.6 + t * 0.001) is None for t in range(80))  # the established driver is not held
    assert newcomers_allow(pool=3, established=[1], share=0.25)  # a small burst is always open to the pool
    assert newcomers_allow(pool=500, established=[], share=0.25)  # nobody established: no probation, no pool


def test_drivers_starting_together_are_asked_back_within_a_quarter_second_not_a_window():
    """Session 10: three honest drivers of a label-skewed run (burst 8, slack 1.1, window 5 s) starting together
    held each other to a burst per window: each fair-share refusal said "retry when your oldest update leaves the
    window" (~4 s), while the others' next update would open the share within milliseconds."""
    from swarm.integrity.requesters import FAIR_SHARE_RETRY_S

    cfg = IntegrityConfig(fair_share_burst=8, fair_share_slack=1.1, fair_share_window_s=5.0, probation_updates=64)
    book = RequesterBook(cfg)
    apply = _applier(book)
    for t in range(9):
        for name in ("a", "b", "c"):
            assert apply(name, 0.01 * t) is None
    assert apply("a", 0.1) is None  # 9 < 1.1 x 9: one more
    refusal = book.admit("a", True, now=0.2)  # 10 is not under 1.1 x the others' 9
    assert refusal is not None and refusal.code == "busy" and "fair share" in refusal.error
    assert refusal.retry_after_s <= FAIR_SHARE_RETRY_S
    assert apply("b", 0.21) is None and apply("c", 0.22) is None
    assert book.admit("a", True, now=0.2 + FAIR_SHARE_RETRY_S) is None, "the others moved on: a is served again"


def test_strikes_decay_and_bans_double():
    assert decayed(8.0, elapsed_s=30.0, half_life_s=30.0) == pytest.approx(4.0)
    assert [ban_duration_s(n, 60.0, 200.0) for n in range(3)] == [60.0, 120.0, 200.0]


def test_a_flooding_driver_is_answered_busy_while_the_other_is_served():
    cfg = IntegrityConfig(fair_share_burst=4, fair_share_slack=2.0, max_in_flight_per_requester=3)
    book = RequesterBook(cfg)
    for t in range(5):  # past its free burst here: it wants its share of this copy
        assert book.admit("honest", True, now=t * 0.5) is None
        book.finished("honest")
        book.on_update("honest", 1.0, now=t * 0.5)
    codes = []
    for t in range(20):
        refusal = book.admit("flood", True, now=3.0 + t * 0.01)
        codes.append(None if refusal is None else refusal.code)
        if refusal is None:
            book.finished("flood")
            book.on_update("flood", 1.0, now=3.0 + t * 0.01)
    assert codes.count(None) == 10 and codes[-1] == "busy"  # 2 x the honest driver's 5
    assert book.admit("honest", True, now=3.5) is None
    # in flight: a fourth concurrent request of one driver waits
    assert [book.admit("many", False, now=4.0) for _ in range(3)] == [None] * 3
    assert book.admit("many", False, now=4.0).code == "busy"


def test_repeated_rejections_ban_a_driver_and_the_ban_expires():
    cfg = IntegrityConfig(ban_strikes=5.0, ban_s=60.0)
    book = RequesterBook(cfg)
    bans = [book.on_strike("bad", "rejected", now=0.0) for _ in range(5)]
    assert bans[:4] == [None] * 4 and bans[4].duration_s == 60.0
    refusal = book.admit("bad", True, now=10.0)
    assert refusal.code == "banned" and refusal.retry_after_s == pytest.approx(50.0)
    # the driver is told why, not only that (an honest one can say what happened to its user)
    assert "50 s more: 5 strikes, the last: rejected" in refusal.error, refusal.error
    assert book.admit("bad", True, now=65.0) is None
    # rejections spread out in time (an honest driver now and then) never add up to a ban
    assert all(book.on_strike("slow", "rejected", now=t * 60.0) is None for t in range(50))


# ----- labels from the data


def test_allowed_shards_are_the_own_shard_and_every_unheld_one():
    assert allowed_shards("a", {"a": 0, "b": 1}, num_shards=4) == {0, 2, 3}
    assert allowed_shards("stranger", {"a": 0, "b": 1}, num_shards=4) == {2, 3}
    view = DriverView()
    record = lambda pid, shard: MemberRecord(pid, "online", "v", 0.0, 0.0, shard=shard)  # noqa: E731
    view.update([record("a", 0), record("b", 1)])
    view.update([record("a", 1)])  # a moved to shard 1, b left: the old view still counts for a heartbeat
    assert view.allowed("a", 4) == {0, 1, 2, 3} and view.knows("b")
    view.update([record("a", 1)])
    assert not view.knows("b") and view.allowed("a", 4) == {0, 1, 2, 3}
    # b's record missed by one read: its shard stays closed to others for that heartbeat
    view.update([record("a", 0), record("b", 1)])
    view.update([record("a", 0)])
    assert view.allowed("a", 4) == {0, 2, 3} and view.allowed("stranger", 4) == {2, 3}
    # ... but a driver whose own read missed the same record covers it honestly: the latest view alone
    # opens it, and the last stage refuses such a micro-batch without a strike (excusable)
    assert view.allowed("a", 4, latest_only=True) == {0, 1, 2, 3}


def test_a_new_shard_claim_stays_open_to_the_others_for_its_grace():
    record = lambda pid, shard: MemberRecord(pid, "online", "v", 0.0, 0.0, shard=shard)  # noqa: E731
    view = DriverView(claim_grace_s=3.0)
    view.update([record("a", 0)], now=100.0)
    assert view.allowed("a", 4, now=103.0) == {0, 1, 2, 3}
    assert view.allowed("stranger", 4, now=103.0) == {1, 2, 3}, "a's claim is 3 s old: closed"
    # b joins on shard 1, which a covered until its own next read: a may still use it for 3 s, no strike
    view.update([record("a", 0), record("b", 1)], now=110.0)
    assert 1 in view.allowed("a", 4, now=112.9)
    assert view.allowed("a", 4, now=113.0) == {0, 2, 3}
    assert view.allowed("b", 4, now=110.0) == {1, 2, 3}, "b's own claim on 1; a's old claim on 0 is closed to b"
    # a claim seen by an on-demand read starts its grace then; a shard let go and taken again starts anew
    view.merge([record("c", 2)], now=120.0)
    assert 2 in view.allowed("a", 4, now=121.0) and 2 not in view.allowed("a", 4, now=123.5)
    view.update([record("a", 0)], now=130.0)
    view.update([record("a", 0)], now=131.0)  # b and c gone from both views: 1 and 2 unheld
    view.update([record("a", 0), record("d", 1)], now=140.0)
    assert 1 in view.allowed("a", 4, now=141.0) and 1 not in view.allowed("a", 4, now=143.0)


def test_a_driver_is_struck_for_a_wrong_shard_only_when_it_goes_on_after_it_was_told():
    """Views of layer0 disagree for a few heartbeats (a holder left and our read has not seen it): a driver's lanes
    full of such micro-batches are refused, never struck (CI: ten in flight banned an honest driver); one that keeps
    sending them after the refusal, past the micro-batches it had in flight, is."""
    from swarm.integrity.labels import WRONG_SHARD_GRACE_S, WRONG_SHARD_HOLD_S, ShardRefusals

    told = ShardRefusals(allowance=3, max_drivers=2)
    assert not any(told.strikes("honest", now=100.0 + 0.01 * i) for i in range(50)), "in flight when told"
    assert not told.strikes("honest", now=100.0 + WRONG_SHARD_GRACE_S - 0.1)
    assert told.strikes("honest", now=100.0 + WRONG_SHARD_GRACE_S), "told, and went on"
    assert told.strikes("honest", now=100.0 + WRONG_SHARD_HOLD_S - 0.1)
    # the hold is over: an honest driver covers unheld shards again, and views may disagree again
    assert not told.strikes("honest", now=100.0 + WRONG_SHARD_HOLD_S)
    assert not told.strikes("honest", now=100.0 + WRONG_SHARD_HOLD_S + WRONG_SHARD_GRACE_S - 0.1)
    # each driver is told for itself; the memory is bounded (the oldest forgotten: told again, not struck)
    assert not told.strikes("b", now=200.0) and not told.strikes("c", now=200.0)
    assert not any(told.strikes("c", now=200.0 + WRONG_SHARD_GRACE_S) for _ in range(2)), "its allowance"
    assert told.strikes("c", now=200.0 + WRONG_SHARD_GRACE_S), "past what it could have had in flight"
    assert not told.strikes("honest", now=200.0 + WRONG_SHARD_GRACE_S), "forgotten, so told anew"
    # a busy machine: the few micro-batches it had in flight arrive after the grace, and strike nobody
    slow = ShardRefusals(allowance=3)
    assert not any(slow.strikes("busy", now=300.0 + 20.0 * (i > 0)) for i in range(3))  # 3 = its allowance


def test_targets_are_looked_up_by_id_and_checked():
    labels = LabelSource(torch.arange(10) % 3, torch.arange(4), [np.arange(0, 5), np.arange(5, 10)])
    assert labels.train_targets(torch.tensor([0, 4]), 2, allowed={0}).tolist() == [0, 1]
    with pytest.raises(WrongShard) as refused:
        labels.train_targets(torch.tensor([0, 7]), 2, allowed={0})
    assert not refused.value.excusable
    with pytest.raises(WrongShard) as refused:
        labels.train_targets(torch.tensor([0, 7]), 2, allowed={0}, excusable={0, 1})
    assert refused.value.excusable, "shard 1 is closed only by the grace view"
    with pytest.raises(ValueError, match="out of range"):
        labels.test_targets(torch.tensor([4]), 1)
    with pytest.raises(ValueError, match="does not match"):
        labels.train_targets(torch.tensor([0]), 2, allowed={0, 1})


# ----- saved activations


def test_a_flood_of_forwards_evicts_only_the_flooders_graphs():
    cache = ActivationCache(max_entries=16)
    cache.owner_cap = owner_cap(16, drivers=2)
    saved = lambda t: Saved(torch.zeros(1), torch.zeros(1), {}, created=t)  # noqa: E731
    for i in range(4):
        cache.put(("honest", f"h{i}"), saved(0.0))
    for i in range(500):
        cache.put(("flood", f"f{i}"), saved(1.0))
    assert len(cache) <= 16 and cache.held_by("flood") <= 8
    assert all(cache.pop(("honest", f"h{i}"), now=2.0) is not None for i in range(4))
    assert cache.pop(("flood", "h0"), now=2.0) is None  # one driver cannot take another's graph by its id


def test_the_gate_serves_known_drivers_reads_records_at_most_once_a_second_and_lets_paused_ones_finish():
    import asyncio

    from swarm.pipeline.stage.stage_gate import StageGate

    reads = []

    async def refresh():
        reads.append(1)
        return [MemberRecord("late", "online", "v", 0.0, 0.0, shard=2)]

    async def main():
        gate = StageGate(IntegrityConfig(), refresh=refresh)
        gate.set_drivers([MemberRecord("a", "online", "v", 0.0, 0.0, shard=0),
                          MemberRecord("p", "paused", "v", 0.0, 0.0, shard=1)])
        assert await gate.admit("a", "forward") is None
        assert (await gate.admit("stranger", "forward")).code == "unknown_driver"
        assert (await gate.admit("stranger", "forward")).code == "unknown_driver"
        assert len(reads) == 1, "an unknown requester must not make us read the DHT more than once a second"
        assert (await gate.admit("p", "forward")).code == "unknown_driver"
        assert await gate.admit("p", "backward") is None  # a paused driver's in-flight micro-batch completes
        gate._last_refresh -= 2.0
        assert await gate.admit("late", "forward") is None  # joined since the heartbeat: found by the read

    asyncio.run(main())


def test_an_honest_heavy_tail_of_clipped_updates_is_no_strike_but_absurd_gradients_are():
    """Measured: at 0.5 the default demo banned its only driver (hard micro-batches clipped to 0.17)."""
    book = RequesterBook(IntegrityConfig())
    assert all(book.on_update("honest", 0.17, now=t * 0.03) is None for t in range(1000))
    bans = [book.on_update("huge", 1e-9, now=t * 0.03) for t in range(20)]
    assert any(ban is not None for ban in bans), "1e30 gradients (clipped to nothing) get their sender banned"


def test_a_driver_that_sends_almost_nothing_does_not_throttle_the_others():
    """Measured: one hostile backward made the honest driver 'busy' (held to 2x the stranger's one update)."""
    cfg = IntegrityConfig(fair_share_burst=8, fair_share_slack=2.0)
    book = RequesterBook(cfg)
    book.on_update("stranger", 1.0, now=0.0)
    for t in range(100):
        assert book.admit("honest", True, now=t * 0.05) is None
        book.finished("honest")
        book.on_update("honest", 1.0, now=t * 0.05)


def test_newcomers_at_a_fresh_copy_hold_each_other_only_past_their_burst():
    """Session 38: two honest drivers starting together (nobody established at either copy of a swarm) whose
    micro-batches mostly went to different copies held each other near the burst at both: at each copy the other
    driver's few updates bounded the one that used it (`volunteer demo --per-swarm 2`: 60-230 samples/s for 6-10 s,
    then 1,000-1,900). A newcomer within its free burst here does not want more of this copy; one past it does."""
    cfg = IntegrityConfig(fair_share_burst=32, fair_share_slack=2.0, probation_updates=64)
    book = RequesterBook(cfg)
    apply = _applier(book)
    assert [apply("elsewhere", t * 0.1) for t in range(3)] == [None] * 3  # its micro-batches go to the other copy
    assert [apply("here", 0.5 + t * 0.01) for t in range(60)] == [None] * 60, "not held to 2 x the other's 3"
    assert book.on_probation("here", now=1.2) is False  # nobody established: no probation either
    # once the other wants more than its burst here, the two share this copy as before (both still newcomers)
    book2 = RequesterBook(IntegrityConfig(fair_share_burst=32, fair_share_slack=2.0, probation_updates=200))
    apply2 = _applier(book2)
    assert [apply2("a", t * 0.01) for t in range(40)] == [None] * 40
    codes = [apply2("b", 0.5 + t * 0.001) for t in range(100)]
    assert codes.count(None) == 80 and codes[-1] == "busy"  # 2 x a's 40
    # a label-skewed run (balance): the share is also the classes' balance, so the other's few updates bound it
    # (issue 30: counting newcomers only past their burst took a busy skewed run's worst chain from 0.90 to 0.57)
    skewed = RequesterBook(IntegrityConfig(fair_share_burst=8, fair_share_slack=1.1, fair_share_window_s=5.0,
                                           probation_updates=64), balance=True)
    apply3 = _applier(skewed)
    assert [apply3("slow", t * 0.1) for t in range(3)] == [None] * 3
    codes = [apply3("fast", 0.5 + t * 0.01) for t in range(60)]
    assert codes.count(None) == 8 and codes[-1] == "busy"  # its free burst, then 1.1 x the slow driver's 3
