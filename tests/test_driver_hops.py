"""The driver against fake remote stages (tests/fake_stages.py): black holes, malformed replies, refusals,
holds, a sick own copy, bugs in a micro-batch. The driver, its routing and its stage-0 worker are real."""

from __future__ import annotations

import asyncio

import pytest
import torch

from fake_stages import BLACK_HOLE, FakeSwarm, drive, honest, make_driver, malformed, refusing
from swarm.run.runconfig import RunConfig


def _run(stages: int, **timeouts) -> RunConfig:
    return RunConfig.model_validate({
        "name": "drivertest",
        "model": {"stages": stages, "hidden_dim": 16},
        "training": {"batch_size": 8, "in_flight": 4},
        "timeouts": {"rpc_s": 30, **timeouts},
    })


RUN2 = _run(2)
RUN3 = _run(3)


def test_a_black_hole_last_stage_stalls_one_lane_once_and_training_goes_on():
    run = _run(2, first_contact_s=1.0)
    fake = FakeSwarm({"layer1": {"hole": BLACK_HOLE, "good": honest(run, 1)}})
    driver = drive(run, fake, seconds=2.5, min_microbatches=51)
    # the four lanes start together and probe both unmeasured peers; once the black hole has timed out
    # (1 s), it is not asked again: the honest peer answers in milliseconds
    start = fake.calls[0][4]
    assert all(c[4] - start < 0.5 for c in fake.calls_to("hole")), "no request to the black hole after its timeout"
    assert driver.stats.timeouts == len(fake.calls_to("hole")) and driver.stats.lost == 0
    assert driver.stats.microbatches > 50
    first_done = fake.calls_to("good", "forward_backward")[0][4] - fake.calls[0][4]
    assert first_done < 0.5, "training starts at once through the honest peer"


def test_a_black_hole_middle_stage_is_hedged_within_seconds():
    run = RUN3  # default first-contact timeout (5 s): the hedge, not the timeout, rescues the forward
    fake = FakeSwarm({"layer1": {"hole": BLACK_HOLE, "good": honest(run, 1)}, "layer2": {"last": honest(run, 2)}})
    driver = drive(run, fake, seconds=3.5)
    hole_forwards = fake.calls_to("hole", "forward")
    # probed at the start (by two of the four lanes at most: two unmeasured peers with a probe each in flight tie),
    # then set aside 1 s, 2 s ... after each hop it left unanswered: three times at most in 3.5 s (a time bound,
    # < 3 s after the first call, and then a count of 2 each failed a loaded suite once: under load the honest peer's
    # first answer comes later, so a third lane starts while both peers are still unmeasured)
    assert hole_forwards and len(hole_forwards) <= 3, f"probed {len(hole_forwards)} times"
    assert driver.stats.hedges >= 1 and driver.stats.lost == 0
    for _, _, _, meta, asked in hole_forwards:
        rescued = [c for c in fake.calls_to("good", "forward") if c[3]["mb"] == meta["mb"]]
        assert rescued and rescued[0][4] - asked < 3.0, "the same forward went to the honest peer"
        assert any(c[3]["mb"] == meta["mb"] for c in fake.calls_to("good", "backward")), "and it completed"


@pytest.mark.parametrize("kind", ["no_tensor", "wrong_shape", "nan", "huge", "garbage_meta", "nan_loss"])
def test_malformed_replies_ban_the_peer_and_never_kill_the_driver(kind):
    fake = FakeSwarm({"layer1": {"bad": malformed(kind, RUN2, 1), "good": honest(RUN2, 1)}})
    driver = drive(RUN2, fake, seconds=1.0, min_microbatches=21)
    assert driver.stats.bad_replies >= 1
    assert len(fake.calls_to("bad")) <= 2, "a bad reply bans the peer for a long while"
    assert driver.stats.lost == 0 and driver.stats.refused == 0
    assert driver.stats.microbatches > 20, "every lane goes on through the honest peer"


def test_a_swarm_of_only_malformed_peers_stalls_the_hop_but_never_kills_a_lane():
    fake = FakeSwarm({"layer1": {"bad": malformed("no_tensor", RUN2, 1)}})
    driver = drive(RUN2, fake, seconds=1.0)  # drive() raises if run_forever ended with an exception
    assert driver.stats.bad_replies >= 3, "the lanes keep trying (bans yield when every peer is banned)"
    assert driver.stats.trained == 0 and driver.stats.lost == 0


def test_a_rejecting_stage_is_backed_off_not_stormed():
    fake = FakeSwarm({"layer1": {"strict": refusing("rejected")}})
    driver = drive(RUN2, fake, seconds=3.0)
    assert 4 <= driver.stats.refused <= 20, driver.stats.refused  # without backoff: thousands
    assert driver.stats.lost == 0 and driver.stats.trained == 0
    assert driver.stats.blocked_reason.startswith("layer1 rejects our activations")


def test_a_backward_its_peer_says_it_applied_already_is_lost_never_resent_to_another_copy():
    """``duplicate`` (swarm/pipeline/stage/applied.py): that copy has stepped on this micro-batch. Resent with its input
    to another peer of the swarm (what a lost backward otherwise gets), a second copy would step on it too."""
    good = honest(RUN3, 1)

    def applied_already(op, tensors, meta):
        if op == "backward":
            return [], {"ok": False, "code": "duplicate", "error": "fake duplicate"}
        return good(op, tensors, meta)

    fake = FakeSwarm({"layer1": {"dup": applied_already, "other": honest(RUN3, 1)},
                      "layer2": {"last": honest(RUN3, 2)}})
    driver = drive(RUN3, fake, seconds=2.0)
    refused = {c[3]["mb"] for c in fake.calls_to("dup", "backward")}
    assert refused and driver.stats.lost >= len(refused) - 4  # (the last few may still be in flight at the stop)
    assert not refused & {c[3]["mb"] for c in fake.calls_to("other", "backward")}, "resent to another copy"
    assert fake.calls_to("other", "backward"), "the other copy's own micro-batches complete"


def test_wrong_shard_is_refused_not_lost_and_the_driver_keeps_to_its_own_shard_for_a_while():
    import time

    from swarm.pipeline.control.driver import COVER_HOLD_S

    fake = FakeSwarm({"layer1": {"p": refusing("wrong_shard")}})
    driver = drive(RUN2, fake, seconds=1.0)
    assert driver.stats.refused >= 1 and driver.stats.lost == 0
    # the refusal is about whose shards are whose, not load: no exponential backoff (a 1 s drive would see
    # a handful of refusals with it), and no covering of unheld shards until the hold has passed
    assert driver.stats.refused >= 10, driver.stats.refused
    assert driver.covered == (driver.own_shard,)
    assert driver._cover_hold_until - time.monotonic() > COVER_HOLD_S - 30
    driver.cover_shards(range(len(driver.shards)))
    assert driver.covered == (driver.own_shard,), "views that say a shard is unheld wait for the hold"
    driver._cover_hold_until = float("-inf")
    driver.cover_shards(range(len(driver.shards)))
    assert len(driver.covered) == len(driver.shards)


def test_busy_peer_is_not_asked_again_before_its_retry_after():
    fake = FakeSwarm({"layer1": {"busy": refusing("busy", retry_after_s=30.0), "good": honest(RUN2, 1)}})
    driver = drive(RUN2, fake, seconds=1.0, min_microbatches=21)
    busy_calls = fake.calls_to("busy")  # the lanes' first probes; then nothing for the next 30 s
    assert busy_calls and all(c[4] - fake.calls[0][4] < 5.0 for c in busy_calls)
    assert driver.stats.microbatches > 20 and driver.stats.lost == 0 and driver.stats.refused == 0


def test_when_every_peer_holds_us_off_the_driver_waits_and_says_why():
    fake = FakeSwarm({"layer1": {"busy": refusing("unknown_driver", retry_after_s=0.5)}})
    driver = drive(RUN2, fake, seconds=1.2)
    assert len(fake.calls_to("busy")) <= 12  # four lanes, at most once per retry_after_s each
    assert "asks us to wait" in driver.stats.blocked_reason
    assert "the last, busy said " in driver.stats.blocked_reason, driver.stats.blocked_reason  # and what it said
    assert driver.stats.lost == 0


def test_a_stage_still_getting_a_receipt_key_makes_the_micro_batch_wait_not_drop():
    """Session 10: at start-up a stage that could not fetch its neighbour's receipt key yet refused every
    micro-batch as ``unknown_signer``; the driver dropped them at once and kept sending (736 lost in 8 s, while
    the last stage applied its half of each). ``key_pending`` now makes the micro-batch wait and ask again."""
    import time

    good = honest(RUN2, 1)
    until = time.monotonic() + 0.6
    # what the stage answered, as it answered it (a call recorded just before ``until`` may be served just after)
    waited: list[str] = []
    passed: set[str] = set()

    def slow_key(op, tensors, meta):
        if time.monotonic() < until:
            waited.append(meta["mb"])
            return [], {"ok": False, "code": "key_pending", "error": "fake key_pending", "retry_after_s": 0.2}
        if op == "forward_backward":
            passed.add(meta["mb"])
        return good(op, tensors, meta)

    fake = FakeSwarm({"layer1": {"p": slow_key}})
    driver = drive(RUN2, fake, seconds=1.5, min_microbatches=11)
    assert len(waited) <= 4 * 5, f"{len(waited)} asks in 0.6 s: the lanes wait retry_after_s, no storm"
    assert driver.stats.refused == 0 and driver.stats.lost == 0, "nothing dropped"
    assert waited and set(waited) <= passed, "the micro-batches that waited are the ones that then passed"
    assert driver.stats.microbatches > 10 and driver.stats.blocked_reason == ""


def test_a_backward_only_its_forwards_peer_can_serve_waits_for_that_peers_receipt_key():
    """Session 27 (benchmarks.adversary --per-swarm 2): a layer1 peer still fetching the receipt key of a layer2 peer
    that had joined a moment before answered the backward of its gradient ``key_pending``; that backward can go only to
    the peer that ran the forward, and the driver gave it up at once: six micro-batches lost, their last stage's half
    applied. It waits there now, as for ``busy``."""
    import time

    good = honest(RUN3, 1)
    until = time.monotonic() + 0.6

    waited: list[str] = []  # the backwards answered key_pending

    def slow_key_at_backward(op, tensors, meta):
        if op == "backward" and time.monotonic() < until:
            waited.append(meta["mb"])
            return [], {"ok": False, "code": "key_pending", "error": "fake key_pending", "retry_after_s": 0.2}
        return good(op, tensors, meta)

    fake = FakeSwarm({"layer1": {"p": slow_key_at_backward}, "layer2": {"last": honest(RUN3, 2)}})
    driver = drive(RUN3, fake, seconds=1.5, min_microbatches=11)
    assert waited, "the fake said key_pending to some backward"
    asked = [c[3]["mb"] for c in fake.calls_to("p", "backward")]
    assert all(asked.count(mb) > waited.count(mb) for mb in waited), "each backward that waited was asked again"
    assert driver.stats.refused == 0 and driver.stats.lost == 0, "nothing given up"
    assert driver.stats.microbatches > 10


def test_a_key_that_never_comes_drops_the_micro_batch_after_the_wait(monkeypatch):
    from swarm.pipeline.control import hops

    monkeypatch.setattr(hops, "KEY_WAIT_MAX_S", 0.5)
    fake = FakeSwarm({"layer1": {"p": refusing("key_pending", retry_after_s=0.2)}})
    driver = drive(RUN2, fake, seconds=1.5)
    assert 4 <= driver.stats.refused <= 16, driver.stats.refused
    assert driver.stats.lost == 0 and driver.stats.trained == 0
    assert len(fake.calls_to("p")) <= 4 * 12, "each lane asks about once per retry_after_s"


def test_a_sick_own_copy_pauses_the_lanes_and_loses_nothing():
    fake = FakeSwarm({"layer1": {"good": honest(RUN2, 1)}})
    seen = {}

    async def sick_for_a_while(driver):
        driver.worker.health.mark_sick("test: parameters not finite")
        await asyncio.sleep(0.8)
        seen["reason"], seen["trained"] = driver.stats.blocked_reason, driver.stats.trained
        driver.worker.health.healed()

    driver = drive(RUN2, fake, seconds=1.0, during=sick_for_a_while, min_microbatches=11)
    assert seen["trained"] == 0 and seen["reason"].startswith("our layer0 copy is sick, healing")
    assert driver.stats.microbatches > 10 and driver.stats.lost == 0 and driver.stats.blocked_reason == ""


def test_a_bug_in_one_micro_batch_costs_only_that_micro_batch():
    fake = FakeSwarm({"layer1": {"good": honest(RUN2, 1)}})
    failed = []

    async def break_once(driver):
        real = driver.worker.forward

        def forward(mb, x):
            if not failed:
                failed.append(mb)
                raise RuntimeError("a bug")
            return real(mb, x)

        driver.worker.forward = forward

    driver = drive(RUN2, fake, seconds=1.0, during=break_once, min_microbatches=11)
    assert failed and driver.stats.lost == 1 and driver.stats.microbatches > 10


def test_requests_carry_sample_ids_never_targets():
    fake = FakeSwarm({"layer1": {"good": honest(RUN2, 1)}})
    driver = drive(RUN2, fake, seconds=0.5)
    train_rows = len(driver.dataset.y_train)
    sent = [c for c in fake.calls if c[1] == "forward_backward"]
    assert sent
    for _, _, tensors, _, _ in sent:
        h, ids = tensors
        assert ids.dtype == torch.int64 and ids.shape == (h.shape[0],)
        assert 0 <= int(ids.min()) and int(ids.max()) < train_rows

    fake.calls.clear()
    driver2, executor = make_driver(RUN2, fake)
    try:
        accuracy, _ = asyncio.run(driver2.evaluate())
    finally:
        executor.shutdown(wait=False)
    ids = torch.cat([c[2][1] for c in fake.calls if c[1] == "evaluate"])
    assert torch.equal(ids, torch.arange(len(driver2.dataset.y_test))), "evaluate sends test-split rows"
    assert accuracy == pytest.approx(0.5, abs=0.01)


def test_brief_holds_are_not_news_and_a_lasting_blockage_is_said_once(monkeypatch):
    """Session 10: three drivers starting together logged "no micro-batch flows" and "micro-batches flow again"
    ~50 times in 12 s while they trained (fair-share holds of a second or less). A blockage is said once it has
    lasted BLOCKED_NOTICE_AFTER_S, and "flow again" only after it was said."""
    import time

    from swarm.pipeline.control import hops

    monkeypatch.setattr(hops, "BLOCKED_NOTICE_AFTER_S", 0.2)
    said = []
    stats = hops.DriverStats()
    blockage = hops.Blockage(stats, lambda kind, text: said.append((kind, text)))
    for _ in range(20):  # brief holds between micro-batches that complete
        blockage.set("every layer2 peer asks us to wait")
        assert stats.blocked_reason
        blockage.clear()
    assert said == [] and stats.blocked_reason == ""
    blockage.set("layer1 rejects our activations: rejected")
    time.sleep(0.25)
    blockage.set("layer1 rejects our activations: rejected")
    blockage.set("layer1 rejects our activations: rejected")
    assert said == [("warning", "no micro-batch flows: layer1 rejects our activations: rejected")]
    blockage.clear()
    assert said[-1] == ("info", "micro-batches flow again") and len(said) == 2


def test_a_peer_that_answers_only_key_pending_is_routed_around(monkeypatch):
    """Review of session 10: ``key_pending`` costs a stage nothing, so a hostile one could say it to every request
    and hold each lane that reaches it KEY_WAIT_MAX_S per micro-batch, never penalised. A peer that has answered
    nothing but key_pending for KEY_WAIT_MAX_S is treated as failing: the lanes go to the honest peer."""
    from swarm.pipeline.control import hops

    monkeypatch.setattr(hops, "KEY_WAIT_MAX_S", 0.5)
    fake = FakeSwarm({"layer1": {"liar": refusing("key_pending", retry_after_s=30.0), "good": honest(RUN2, 1)}})
    driver = drive(RUN2, fake, seconds=3.0, min_microbatches=21)
    start = fake.calls[0][4]
    late = [c for c in fake.calls_to("liar") if c[4] - start > 1.5]
    assert late == [], f"{len(late)} requests to the liar after 1.5 s: it was never routed around"
    assert driver.stats.microbatches > 20 and driver.stats.lost == 0


def test_a_backward_only_one_peer_can_serve_waits_out_its_busy_answers_there():
    """A stage admits a forward without its fair-share check and may answer its backward ``busy`` (a driver new
    there): the peer that holds the forward's activations is asked again after its retry_after, not given up (a pushed
    micro-batch was lost that way: no other peer has its input). Here the peer says busy to every second backward."""
    answers = {"backward": 0}
    good = honest(RUN3, 1)

    def busy_at_times(op, tensors, meta):
        if op == "backward":
            answers["backward"] += 1
            if answers["backward"] % 2:
                return [], {"ok": False, "code": "busy", "error": "fake busy: you are new here", "retry_after_s": 0.05}
        return good(op, tensors, meta)

    fake = FakeSwarm({"layer1": {"mid": busy_at_times}, "layer2": {"last": honest(RUN3, 2)}})
    driver = drive(RUN3, fake, seconds=1.0, min_microbatches=10)
    backwards = fake.calls_to("mid", "backward")
    assert len(backwards) >= 2 * 10 - 1, len(backwards)  # each busy answer was followed by another try there
    # every try carried the gradient alone: the peer's saved activations were used, never a resend of the input
    assert all(len(call[2]) == 1 for call in backwards)
    assert driver.stats.microbatches >= 10 and driver.stats.lost == 0


def test_a_peer_busy_forever_with_no_wait_holds_a_backward_a_bounded_time_and_is_then_routed_around(monkeypatch):
    """The worst well-formed answer to a patient hop: ``busy`` with retry_after_s 0, to every backward. The lane waits
    a floor between tries (no loop of calls), gives up after ONLY_BUSY_MAX_S and routes around that peer."""
    from swarm.pipeline.control import hops

    monkeypatch.setattr(hops, "ONLY_BUSY_MAX_S", 0.5)
    good = honest(RUN3, 1)

    def never_backward(op, tensors, meta):
        if op == "backward":
            return [], {"ok": False, "code": "busy", "error": "fake busy \x1b[31m", "retry_after_s": 0}
        return good(op, tensors, meta)

    fake = FakeSwarm({"layer1": {"mid": never_backward}, "layer2": {"last": honest(RUN3, 2)}})
    drive(RUN3, fake, seconds=1.5)
    backwards = fake.calls_to("mid", "backward")
    assert backwards, "the backward was tried at the peer that holds its activations"
    # at most one try per HOLD_MIN_S per lane (4 lanes) over the window, not a loop of calls
    span = max(c[4] for c in backwards) - min(c[4] for c in backwards)
    assert len(backwards) <= 4 * (span / hops.HOLD_MIN_S + 2), (len(backwards), span)
