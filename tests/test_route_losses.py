"""Weights trained to harm (swarm/pipeline/control/route_losses.py): a copy that computes honestly from weights that do harm
passes every recomputation; the loss of the micro-batches routed through it gives it away, and it is held off.
Honest copies are not, nor is a copy judged on losses from another time of the run."""

from __future__ import annotations

import pytest
import torch

from fake_stages import FakeSwarm, drive, honest
from swarm.pipeline.control.route_losses import MIN_PAIRS, RouteLosses
from swarm.run.models import stage_output_spec
from swarm.run.runconfig import RunConfig

RUN = RunConfig.model_validate({
    "name": "routeloss", "model": {"stages": 3, "hidden_dim": 16}, "training": {"batch_size": 8, "in_flight": 2},
    "timeouts": {"rpc_s": 30},
})


def _harmful(run: RunConfig, k: int):
    """Plausible activations of weights that do harm: the next stage's loss through them is three times higher."""
    good = honest(run, k)

    def answer(op, tensors, meta):
        if op in ("forward", "infer"):
            good(op, tensors, meta)
            shape = tuple(d or tensors[0].shape[0] for d in stage_output_spec(run.model, k).shape)
            return [torch.full(shape, 0.3)], {"ok": True}
        return good(op, tensors, meta)

    return answer


def _last_judging_its_input(run: RunConfig, k: int):
    """A last stage whose loss depends on what it is given (as a real one's does)."""
    good = honest(run, k)

    def answer(op, tensors, meta):
        out, reply = good(op, tensors, meta)
        if op.startswith("forward_backward"):
            reply = {**reply, "loss": 0.5 if float(tensors[0].float().mean()) < 0.2 else 1.5}
        return out, reply

    return answer


async def _no_spot_checks(driver):
    driver.spot.share = 0.0  # what is measured here is the route losses alone


def test_a_copy_whose_weights_do_harm_is_held_off_by_the_loss_through_it():
    fake = FakeSwarm({"layer1": {"good": honest(RUN, 1), "harm": _harmful(RUN, 1)},
                      "layer2": {"last": _last_judging_its_input(RUN, 2)}})
    # until it is held (or MAX_DRIVE_S): in a loaded suite 4 x MIN_PAIRS micro-batches once came before a judgement
    # with MIN_PAIRS pairs close enough in time (a copy is judged once a second at most)
    driver = drive(RUN, fake, seconds=2.0, during=_no_spot_checks, min_microbatches=4 * MIN_PAIRS,
                   until=lambda d: d.route_losses.held >= 1)
    assert driver.route_losses.held >= 1
    assert driver.routers["layer1"].peers["harm"].banned_until > 0
    assert driver.routers["layer1"].peers["good"].convicted_until == 0  # (a slow answer may set it aside a while)
    held_at = driver.routers["layer1"].peers["harm"].banned_until - 60.0  # its first hold: 60 s
    # lanes routed before the hold may still reach it (at most one per lane: in a loaded suite one arrived 0.5 s
    # after the hold), nothing routed after it does
    late = [c for c in fake.calls_to("harm", "forward") if c[4] > held_at + 0.5]
    assert len(late) <= RUN.training.in_flight and not [c for c in late if c[4] > held_at + 3.0], \
        "the harmful copy is not routed to once held off"
    assert driver.stats.lost == 0


def test_honest_copies_are_not_held_off():
    fake = FakeSwarm({"layer1": {"a": honest(RUN, 1), "b": honest(RUN, 1)},
                      "layer2": {"last": _last_judging_its_input(RUN, 2)}})
    driver = drive(RUN, fake, seconds=1.5, during=_no_spot_checks, min_microbatches=4 * MIN_PAIRS)
    assert driver.route_losses.held == 0
    assert all(stats.convicted_until == 0 for stats in driver.routers["layer1"].peers.values())


def test_the_loss_falling_over_time_does_not_count_against_a_copy():
    """Each loss is divided by the running loss of the time: a copy that served early in the run, when the loss was
    high, is not worse than one that served later; copies near convergence whose tiny losses differ 2x in ratio but by
    hundredths of a nat are not either."""
    t = [0.0]
    routes = RouteLosses(chance_loss=2.3, clock=lambda: t[0])
    verdicts = []
    for i in range(80):  # the loss falls 2.3 -> 0.3; 'early' serves the first half, 'late' the second
        t[0] += 0.5
        loss = 2.3 - 2.0 * i / 80
        verdicts += routes.record({1: "early" if i < 40 else "late"}, loss)
        if i >= 40 and i % 2:  # then both serve
            verdicts += routes.record({1: "early"}, loss)
    assert not verdicts
    for i in range(100):  # near convergence: 0.01 against 0.02, twice the loss, a hundredth of a nat
        t[0] += 0.1
        verdicts += routes.record({1: "early"}, 0.01) + routes.record({1: "late"}, 0.02)
    assert not verdicts
    # and a copy at three times the others' loss, at the same time, is held off, longer each time it repeats
    holds = []
    for i in range(200):
        t[0] += 0.1
        for peer, loss in (("fine", 0.4), ("bad", 1.2)):
            holds += [v.hold_s for v in routes.record({1: peer}, loss) if v.peer == "bad"]
    assert holds[:2] == [60.0, 120.0]


def test_fresh_keys_reporting_losses_cannot_get_an_established_copy_held_off():
    """The losses come from the last stage, which may lie (and hold many keys): a copy is held off only against a
    rival with as much validated work as it has, so fresh keys cannot frame an established honest copy."""
    t = [0.0]
    credit = {"honest": 8, "sybil": 0}
    routes = RouteLosses(chance_loss=2.3, clock=lambda: t[0], standing=credit.get)
    verdicts = []
    for _ in range(100):  # the lying last stage reports 3x the loss for whatever went through the honest copy
        t[0] += 0.1
        verdicts += routes.record({1: "honest"}, 1.5) + routes.record({1: "sybil"}, 0.5)
    assert not verdicts
    credit["sybil"] = 8  # a rival with as much standing is believed
    for _ in range(30):
        t[0] += 0.1
        verdicts += routes.record({1: "honest"}, 1.5) + routes.record({1: "sybil"}, 0.5)
    assert verdicts and {v.peer for v in verdicts} == {"honest"}


def test_a_lying_last_stage_cannot_frame_a_middle_copy_beside_an_honest_last_stage():
    """issue 40: a last-stage peer can tell whose activations it was given (the receipts) and report 3x the loss for
    one middle copy's micro-batches. Losses are compared witness by witness: the honest last-stage copy, which sees
    both middle copies do as well, vetoes the hold. A copy that does harm is seen by both witnesses and held off."""
    t = [0.0]
    routes = RouteLosses(chance_loss=2.3, clock=lambda: t[0])
    verdicts = []
    for _ in range(60):
        t[0] += 0.1
        verdicts += routes.record({1: "victim"}, 1.5, witness="liar") + routes.record({1: "rival"}, 0.5, witness="liar")
        verdicts += routes.record({1: "victim"}, 0.5, witness="honest") + routes.record({1: "rival"}, 0.5,
                                                                                         witness="honest")
    assert not verdicts and routes.disputed > 0
    for _ in range(60):  # now the copy does harm: both witnesses see it
        t[0] += 0.1
        verdicts += routes.record({1: "victim"}, 1.5, witness="liar") + routes.record({1: "rival"}, 0.5, witness="liar")
        verdicts += routes.record({1: "victim"}, 1.5, witness="honest") + routes.record({1: "rival"}, 0.5,
                                                                                         witness="honest")
    assert verdicts and {v.peer for v in verdicts} == {"victim"}


def _last_with_loss(run: RunConfig, k: int, loss: float):
    """A last stage whose own weights give ``loss`` on whatever it is given (weights trained to harm: a high one)."""
    good = honest(run, k)

    def answer(op, tensors, meta):
        out, reply = good(op, tensors, meta)
        return out, ({**reply, "loss": loss} if op.startswith("forward_backward") else reply)

    return answer


def test_a_last_stage_whose_weights_do_harm_is_held_off_by_its_own_loss():
    """Session 27: a last stage trained to harm beside one honest copy (benchmarks.adversary pair_last_harm) computes
    every hop honestly from its weights, so its gradients pass every recomputation, and the driver's stage 0 and the
    middle copies descended them: 0.50-0.87 of the clean run's accuracy. Its loss is its own claim (signed, recomputed
    by a referee), so a last stage's copies are compared with each other's losses, and the harmful one is held off."""
    import asyncio
    import time

    async def until_held(driver):
        """Both copies serve until one is held (bounded): under load the router, which picks the copy expected to
        finish soonest, once sent 933 micro-batches to one and 6 to the other, and nothing could be compared."""
        await _no_spot_checks(driver)
        deadline = time.monotonic() + 30.0
        while driver.route_losses.held == 0 and time.monotonic() < deadline:
            for stats in driver.routers["layer2"].peers.values():
                stats.service_ema_s = None  # unmeasured again: both are asked
            await asyncio.sleep(0.05)

    fake = FakeSwarm({"layer1": {"mid": honest(RUN, 1)},
                      "layer2": {"good": _last_with_loss(RUN, 2, 0.5), "harm": _last_with_loss(RUN, 2, 3.0)}})
    driver = drive(RUN, fake, seconds=0.5, during=until_held, min_microbatches=4 * MIN_PAIRS)
    assert driver.route_losses.held >= 1, [len(fake.calls_to(p, "forward_backward")) for p in ("good", "harm")]
    assert driver.routers["layer2"].peers["harm"].banned_until > 0
    assert driver.routers["layer2"].peers["good"].convicted_until == 0
    assert driver.routers["layer1"].peers["mid"].convicted_until == 0, "the middle copy's losses come through both"
    assert driver.stats.lost == 0


def test_honest_last_stages_are_not_held_off_even_one_that_lags_the_other():
    """A label-skewed SGD demo (session 27) held an honest last-stage copy off 4 s into the run: 1.9x the loss of its
    rival, a nat more (2.2 against 1.15 nats). A last stage is held off only at the chance loss or above (ln 10 = 2.3
    here), or beside a rival that has learned (within the absolute margin, 0.58 nats): early in a run none has."""
    fake = FakeSwarm({"layer1": {"mid": honest(RUN, 1)},
                      "layer2": {"a": _last_with_loss(RUN, 2, 1.15), "b": _last_with_loss(RUN, 2, 2.2)}})
    driver = drive(RUN, fake, seconds=1.5, during=_no_spot_checks, min_microbatches=4 * MIN_PAIRS)
    assert driver.route_losses.held == 0
    assert all(stats.banned_until == 0 for stats in driver.routers["layer2"].peers.values())
    # and they were judged: each last-stage copy's own losses are kept (a driver that judged no last stage passes the
    # two lines above too)
    assert driver.route_losses.training_loss(2, "a") == 1.15 and driver.route_losses.training_loss(2, "b") == 2.2


def _last_with_figures(run: RunConfig, k: int, loss: float, accuracy: float):
    """A last stage whose own weights give ``loss`` in training and ``accuracy`` on the test split."""
    train = _last_with_loss(run, k, loss)

    def answer(op, tensors, meta):
        if op == "evaluate":
            batch = tensors[0].shape[0]
            return [], {"ok": True, "loss_sum": loss * batch, "correct": round(accuracy * batch), "count": batch}
        return train(op, tensors, meta)

    return answer


def test_the_published_evaluation_leaves_out_copies_held_off_or_far_worse_in_training():
    """Session 27 (six_keys_last_harm): keys trained to harm, faster than the honest copy, were the last-stage copies
    evaluated, and the median published 18-78 % while the honest copy stood at 96 %. Copies held off, and copies whose
    own training loss is far worse than the best copy's, are left out while others are usable."""
    import asyncio
    import time

    from swarm.pipeline.control.driver_eval import evaluate

    fake = FakeSwarm({"layer1": {"mid": honest(RUN, 1)},
                      "layer2": {"good": _last_with_figures(RUN, 2, 0.5, 0.96),
                                 "k1": _last_with_figures(RUN, 2, 9.0, 0.40),
                                 "k2": _last_with_figures(RUN, 2, 9.0, 0.41)}})
    published = {}

    async def evaluate_later(driver):
        driver.spot.share = 0.0
        driver.route_losses = None  # nothing held off by the time of the evaluation: only the figures are judged here

        async def later():
            await asyncio.sleep(1.0)
            from swarm.pipeline.control.route_losses import RouteLosses, SELF_WITNESS

            routes = RouteLosses(chance_loss=2.3)  # what the driver's route losses had measured of each copy
            for peer, loss in (("good", 0.5), ("k2", 9.0)):  # k1 was held off (its losses cleared): banned
                routes.record({2: peer}, loss, witness=SELF_WITNESS)
            driver.route_losses = routes
            driver.routers["layer2"].peers["k1"].banned_until = time.monotonic() + 60.0
            published["accuracy"] = (await evaluate(driver))[0]

        asyncio.get_running_loop().create_task(later())

    drive(RUN, fake, seconds=2.0, during=evaluate_later)
    assert published["accuracy"] == pytest.approx(0.96, abs=0.01)


def test_a_last_stage_under_the_chance_loss_is_held_off_only_beside_a_rival_that_has_learned():
    """A copy trained to harm that keeps its loss at 0.8 of the chance loss (benchmarks.adversary
    pair_last_capped_harm: 0.97 of clean, never held) is held off beside a rival that has learned; an honest copy that
    lags a rival still learning itself (early in a run: 2.2 against 1.15 nats) is not."""
    from swarm.pipeline.control.route_losses import SELF_WITNESS

    def holds(mine: float, rival: float) -> list:
        t = [0.0]
        routes = RouteLosses(chance_loss=2.3, clock=lambda: t[0])
        verdicts = []
        for _ in range(60):
            t[0] += 0.1
            verdicts += routes.record({2: "copy"}, mine, witness=SELF_WITNESS)
            verdicts += routes.record({2: "rival"}, rival, witness=SELF_WITNESS)
        return [v.peer for v in verdicts]

    assert set(holds(0.8 * 2.3, 0.05)) == {"copy"}
    assert holds(2.2, 1.15) == [], "an honest copy lagging a rival that is still learning"
    assert set(holds(3.0, 1.15)) == {"copy"}, "past the chance loss: held whatever the rival's"
