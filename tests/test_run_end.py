"""Runs have an end (issue 16, item 7): a target or a sample budget in the run config, after which every
volunteer finishes its work, pauses and says the run is complete; `volunteer status` says so too."""

from __future__ import annotations

import math
import time

from swarm.dht.completion import run_complete
from swarm.dht.records import MemberRecord
from swarm.run.runconfig import RunConfig, TrainingConfig
from volunteer.node.commands import PAUSED_BY_USER
from volunteer.node.completion import COMPLETE_PREFIX, completion_step
from volunteer.snapshot import NodeState


def _layer0(clock: int = 0, accuracy: float = -1.0, loss: float = -1.0, eval_at: float = -1.0) -> MemberRecord:
    now = time.time()
    return MemberRecord(peer_id="12D3KooWPeer", state="online", version="0.1.0", started_at=now, updated_at=now,
                        clock=clock, test_accuracy=accuracy, test_loss=loss, eval_at=eval_at, eval_samples=359)


def test_a_run_without_an_end_is_never_complete():
    views = {"layer0": [_layer0(clock=10**9, accuracy=1.0, eval_at=1.0)]}
    assert run_complete(TrainingConfig(), views) == ""


def test_the_target_counts_only_when_the_run_asks_for_it_and_the_current_evaluations_decide():
    training = TrainingConfig(end_at_target=True, target_accuracy=0.9)
    assert run_complete(training, {}) == ""
    assert run_complete(training, {"layer0": [_layer0(accuracy=0.85, eval_at=10.0)]}) == ""
    # an evaluation three periods (30 s) older than the newest is no longer current
    reached = run_complete(training, {"layer0": [_layer0(accuracy=0.85, eval_at=10.0),
                                                 _layer0(accuracy=0.93, eval_at=50.0)]})
    assert reached == "test accuracy 93.0% reached the run's target 90.0%"
    assert run_complete(training, {"layer0": [_layer0(accuracy=0.93, eval_at=10.0),
                                              _layer0(accuracy=0.85, eval_at=50.0)]}) == ""
    # two current ones: the more modest decides (one record's claim ends nothing: swarm/dht/published.py)
    assert run_complete(training, {"layer0": [_layer0(accuracy=0.85, eval_at=40.0),
                                              _layer0(accuracy=0.93, eval_at=50.0)]}) == ""


def test_a_language_model_ends_in_bits_per_byte_and_a_budget_in_samples():
    lm = TrainingConfig(end_at_target=True, target_bits_per_byte=2.5)
    assert run_complete(lm, {"layer0": [_layer0(loss=2.6 * math.log(2), eval_at=1.0)]}) == ""
    assert "2.40 bits/byte reached" in run_complete(lm, {"layer0": [_layer0(loss=2.4 * math.log(2), eval_at=1.0)]})
    budget = TrainingConfig(sample_budget=6400)
    assert run_complete(budget, {"layer0": [_layer0(clock=6399)]}) == ""
    assert run_complete(budget, {"layer0": [_layer0(clock=6400)]}).startswith("a layer0 copy trained 6,400 samples")


def test_an_online_node_pauses_and_a_paused_one_says_why_once():
    why = "test accuracy 95.1% reached the run's target 95.0%"
    stop = completion_step(NodeState.ONLINE, "", why)
    assert (stop.state, stop.reason, stop.paused_by) == (NodeState.PAUSED, f"{COMPLETE_PREFIX}{why}", PAUSED_BY_USER)
    assert stop.event.startswith(f"{COMPLETE_PREFIX}{why}") and stop.save_checkpoint
    label = completion_step(NodeState.PAUSED, "paused by you", why)
    assert (label.state, label.reason, label.event) == (NodeState.PAUSED, f"{COMPLETE_PREFIX}{why}", "")
    assert completion_step(NodeState.PAUSED, label.reason, why) is None
    assert completion_step(NodeState.FINISHING, "", why) is None  # the user's finish goes on
    assert completion_step(NodeState.ONLINE, "", "") is None


def test_a_run_end_left_unset_keeps_the_run_id():
    plain = RunConfig(name="ends")
    assert "end_at_target" not in plain.canonical()["training"]
    assert RunConfig(name="ends", training={"end_at_target": False, "sample_budget": 0}).run_id == plain.run_id
    assert RunConfig(name="ends", training={"sample_budget": 100}).run_id != plain.run_id


def test_status_says_the_run_is_complete():
    from volunteer_cli.commands.status import build_report, render_report

    run = RunConfig(name="ends", training={"sample_budget": 100})
    report = build_report(run, {"layer0": [_layer0(clock=128)]}, now=time.time())
    assert report["complete"].startswith("a layer0 copy trained 128 samples")
    assert render_report(report).splitlines()[1].startswith("  RUN COMPLETE: a layer0 copy trained 128 samples")


# ----- a real swarm: 2 stages, a budget of 4 micro-batches

JOIN_WAIT_S = 180.0
COMPLETE_WAIT_S = 60.0  # the budget is 4 micro-batches, then a heartbeat (1 s) to read it
EVENT_WAIT_S = 10.0


def test_volunteers_pause_and_say_the_run_is_complete_when_its_budget_is_spent(swarm, tmp_path):
    from procs import wait_until, write_run
    from swarm_client import events

    run = write_run(tmp_path / "run.yaml", name="ends", stages=2, heartbeat_s=1.0,
                    training="{batch_size: 32, sample_budget: 128}")
    _, maddr = swarm.bootstrap()
    last = swarm.join(run, "layer1", maddr, "--log-format", "json", name="last")
    driver = swarm.join(run, "layer0", maddr, "--log-format", "json", name="driver")
    reader = swarm.reader(run, maddr)

    def complete_everywhere() -> bool:
        report = reader.report()
        rows = [row for rows in report["swarms"].values() for row in rows]
        return bool(report["complete"]) and len(rows) == 2 and all(row["state"] == "paused" for row in rows)

    # generous: at load 12 two joins took 50 s to load and start their DHTs
    wait_until(lambda: all(reader.report()["swarms"][name] for name in ("layer0", "layer1")), JOIN_WAIT_S,
               what="both volunteers' records")
    wait_until(complete_everywhere, COMPLETE_WAIT_S, what="both volunteers paused in a complete run")
    for proc in (last, driver):  # the paused record is announced just before the event is printed
        said = wait_until(lambda: [e["text"] for e in events(proc) if e.get("kind") == "complete"], EVENT_WAIT_S,
                          what=f"{proc.name} to say the run is complete")
        assert said[0].startswith("run complete: a layer0 copy trained"), proc.stdout()[-2000:]
    assert swarm.status(run, maddr)["complete"]  # the CLI says it too


def test_the_dashboard_says_the_run_is_complete_without_offering_a_resume():
    from fake_engine import sample_snapshot

    from tui.format import not_training_line

    line = not_training_line(sample_snapshot(state=NodeState.PAUSED, samples_per_s=0.0,
                                             reason=f"{COMPLETE_PREFIX}a layer0 copy trained 128 samples"))
    assert line == "PAUSED: run complete: a layer0 copy trained 128 samples (nothing more to train here; press q to leave)"


def test_one_record_claiming_the_target_or_the_budget_ends_nothing():
    """Issue 25: any key can publish a layer0 record. One claiming accuracy 1.0, or a clock of 2^62 samples, must
    not pause every volunteer of the run as "complete" while the honest drivers are short of the end
    (swarm/dht/published.py: the median of the drivers' figures)."""
    from swarm.dht.completion import run_complete
    from swarm.dht.records import MemberRecord
    from swarm.run.runconfig import TrainingConfig

    def driver(peer: str, accuracy: float, clock: int) -> MemberRecord:
        return MemberRecord(peer_id=peer, state="online", version="t", started_at=0.0, updated_at=100.0, clock=clock,
                            test_accuracy=accuracy, test_loss=0.2, eval_samples=clock, eval_at=99.0)

    honest = [driver("QmHonestA", 0.90, 20_000), driver("QmHonestB", 0.91, 21_000)]
    liar = driver("QmLiar", 1.0, 2**62)
    at_target = TrainingConfig(end_at_target=True, target_accuracy=0.95)
    assert run_complete(at_target, {"layer0": [liar, *honest]}) == ""
    assert run_complete(at_target, {"layer0": [liar, honest[0]]}) == ""  # of two, the more modest figure
    assert run_complete(TrainingConfig(sample_budget=100_000), {"layer0": [liar, *honest]}) == ""
    # the honest majority at the target ends it
    assert "reached the run's target" in run_complete(at_target, {"layer0": [liar, driver("QmC", 0.96, 30_000),
                                                                                driver("QmD", 0.97, 30_000)]})
