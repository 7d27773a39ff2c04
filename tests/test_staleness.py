"""Staleness: measured per stage, shown in records, status and the dashboard, and a step that shrinks with it.

Pure tests (no network): the rule, the window, the step-size owner that composes with healing, a real
stage worker counting updates between a forward and its backward, and the record/status/dashboard text.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from swarm.integrity.heal import Healer
from swarm.run.runconfig import RunConfig
from swarm.pipeline.stage.worker import StageWorker
from swarm.pipeline.stage.staleness import StalenessWindow, StepSize, stale_momentum, step_factor, summarize


def _run(**optimizer) -> RunConfig:
    opt = {"name": "sgd", "lr": 0.05, "momentum": 0.9, **optimizer}
    return RunConfig(name="stale", model={"stages": 3}, optimizer=opt)


def test_divide_rule_is_zhang_et_al_with_a_tolerance():
    assert [step_factor(t, "divide") for t in (0, 1, 2, 4, 10)] == [1.0, 1.0, 0.5, 0.25, 0.1]
    assert [step_factor(t, "divide", tolerance=4) for t in (0, 4, 8, 16)] == [1.0, 1.0, 0.5, 0.25]
    assert all(step_factor(t, rule) == 1.0 for t in (0, 3, 1000) for rule in ("none", "momentum"))
    assert step_factor(4, "divide_momentum") == 0.25
    with pytest.raises(ValueError, match="optimizer.staleness"):
        step_factor(3, "halve")
    with pytest.raises(ValueError, match="staleness_tolerance"):
        step_factor(3, "divide", tolerance=0)


def test_staleness_takes_its_share_of_the_momentum_horizon():
    # 0.9 averages over 10 updates: a mean staleness of 5 leaves 5 (0.8), 9 or more leaves none
    assert [stale_momentum(0.9, tau) for tau in (0.0, 5.0, 9.0, 40.0)] == pytest.approx([0.9, 0.8, 0.0, 0.0])
    assert stale_momentum(0.0, 5.0) == 0.0 and stale_momentum(0.5, 0.5) == pytest.approx(1 / 3)
    assert stale_momentum(0.9, float("nan")) == 0.9


def test_window_keeps_the_recent_values_and_summarizes_them():
    assert summarize([]) is None
    window = StalenessWindow(size=4)
    assert window.summary() is None
    for value in (100, 100, 0, 1, 2, 3):  # the two old 100s fall out of the window
        window.record(value)
    summary = window.summary()
    assert (summary.mean, summary.max, summary.count) == (1.5, 3, 4) and window.mean() == 1.5
    assert summary.p95 == pytest.approx(2.85)


def test_the_default_run_is_robust_and_divides_stale_steps():
    default = RunConfig(name="r").optimizer
    assert (default.name, default.lr, default.staleness, default.staleness_tolerance) == \
        ("adam", 0.001, "divide_momentum", 1)
    with pytest.raises(ValueError):
        RunConfig(name="r", optimizer={"staleness": "sometimes"})
    with pytest.raises(ValueError):
        RunConfig(name="r", optimizer={"staleness_tolerance": 0})


def test_sgd_scales_the_stale_gradient_and_leaves_lr_to_the_heal_scale():
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    size = StepSize(optimizer, "sgd", "divide")
    grads = [torch.ones(3)]
    assert size.before_step(4, grads) == 0.25
    assert torch.allclose(grads[0], torch.full((3,), 0.25))  # only this gradient's share of the momentum shrinks
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    size.set_heal_scale(0.3)
    assert size.before_step(1, [torch.ones(3)]) == 1.0
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.03) and size.lr == pytest.approx(0.03)
    assert optimizer.param_groups[0]["momentum"] == 0.9  # rule divide leaves the momentum alone


def test_sgd_momentum_gives_way_to_a_copys_mean_staleness():
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    size = StepSize(optimizer, "sgd", "divide_momentum")
    size.before_step(2, [torch.ones(3)], mean_staleness=5.0)
    assert optimizer.param_groups[0]["momentum"] == pytest.approx(0.8)
    size.before_step(0, [torch.ones(3)], mean_staleness=0.0)
    assert optimizer.param_groups[0]["momentum"] == pytest.approx(0.9)  # from the run's value, never compounded
    adam = torch.optim.Adam([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)
    StepSize(adam, "adam", "divide_momentum").before_step(2, [torch.ones(3)], mean_staleness=20.0)
    assert "momentum" not in adam.param_groups[0]  # Adam's betas are left alone


def test_adam_scales_this_steps_lr_times_the_heal_scale():
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.Adam([param], lr=1e-3)
    size = StepSize(optimizer, "adam", "divide", tolerance=2)
    size.set_heal_scale(0.5)
    grads = [torch.ones(3)]
    size.before_step(8, grads)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.5 * 0.25)
    assert torch.equal(grads[0], torch.ones(3))  # Adam would normalise a scaled gradient away
    size.before_step(0, grads)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.5)
    with pytest.raises(ValueError):
        size.set_heal_scale(0.0)


def test_a_stage_counts_updates_between_a_forward_and_its_backward():
    worker = StageWorker(_run(), 1)
    x = torch.randn(4, 128)
    for i in range(4):
        worker.forward(f"mb{i}", x, owner="d")
    seen = []
    for i in range(4):
        worker.backward(f"mb{i}", torch.randn(4, 128) * 1e-3, None, 1.0, owner="d")
        seen.append((worker.last_update.staleness, worker.last_update.step_factor))
    assert seen == [(0, 1.0), (1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    worker.backward("lost-graph", torch.randn(4, 128) * 1e-3, x, 1.0, owner="d")  # recomputed here: fresh
    assert worker.last_update.staleness == 0
    summary = worker.staleness.summary()
    assert (summary.max, summary.count, summary.mean) == (3, 5, pytest.approx(1.2))


def test_the_last_stage_is_never_stale():
    worker = StageWorker(_run(), 2)
    for i in range(3):
        worker.forward_backward(f"mb{i}", torch.randn(4, 128), torch.randint(0, 10, (4,)))
    assert worker.staleness.summary().max == 0


def test_healing_and_staleness_compose_instead_of_fighting():
    worker = StageWorker(_run(name="adam", lr=1e-3), 1)
    healer = Healer(worker, notify=lambda *a: None)
    healer.take_snapshot()
    worker.health.mark_sick("test")
    healer.heal()  # heal scale 0.3
    x = torch.randn(4, 128)
    for i in range(5):
        worker.forward(f"mb{i}", x, owner="d")
    for i in range(5):
        worker.backward(f"mb{i}", torch.randn(4, 128) * 1e-3, None, 1.0, owner="d")
    # the 5th backward was 4 updates stale: the run's lr x the heal scale x 1/4, and neither undoes the other
    assert worker.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.3 * 0.25)
    assert healer.status().lr_scale == pytest.approx(0.3)


def test_records_carry_staleness_and_old_records_still_parse():
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    from swarm.dht.records import MemberRecord, parse_member, peer_id_from_public_key

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    subkey = b"[owner:" + public + b"]"
    now = time.time()
    record = MemberRecord(peer_id=peer_id_from_public_key(public), state="online", version="t", started_at=now,
                          updated_at=now, staleness_mean=2.5, staleness_p95=6.0, staleness_max=7)
    assert parse_member(subkey, record.to_wire(), now).staleness_or_none == (2.5, 6.0, 7)
    old = {k: v for k, v in record.to_wire().items() if not k.startswith("staleness")}  # a client before this
    assert parse_member(subkey, old, now).staleness_or_none is None
    assert parse_member(subkey, {**old, "staleness_max": None}, now).staleness_or_none is None
    for bad in ({"staleness_mean": float("nan")}, {"staleness_max": -5}, {"staleness_p95": "7"}):
        assert parse_member(subkey, {**record.to_wire(), **bad}, now) is None, bad
    # the schema every DHT node of the run checks: new records pass, and so do records without the fields
    from swarm.dht.records import _MemberValueSchema

    _MemberValueSchema.parse_obj(record.to_wire())
    _MemberValueSchema.parse_obj(old)
    with pytest.raises(ValueError):
        _MemberValueSchema.parse_obj({**record.to_wire(), "staleness_max": 2.5})


def test_status_and_dashboard_show_each_copys_staleness():
    from swarm.dht.records import MemberRecord
    from tui.format import format_staleness
    from tui.work import figures_table
    from volunteer.snapshot import NodeSnapshot, NodeState
    from volunteer_cli.commands.status import build_report, render_report

    run = RunConfig(name="s", model={"stages": 2})
    now = time.time()
    fresh = MemberRecord(peer_id="p1", state="online", version="t", started_at=now, updated_at=now,
                         staleness_mean=3.25, staleness_p95=7.0, staleness_max=9)
    old = MemberRecord(peer_id="p2", state="online", version="t", started_at=now, updated_at=now)
    report = build_report(run, {"layer0": [fresh, old], "layer1": []}, now)
    assert report["summary"]["layer0"]["staleness_max"] == 9
    assert [row["staleness"] for row in report["swarms"]["layer0"]] == [{"mean": 3.25, "p95": 7.0, "max": 9}, None]
    text = render_report(report)
    assert "staleness p95 7 max 9 updates" in text and "staleness 3.2/7/9" in text
    assert format_staleness(3.25, 7.0, 9) == "avg 3.2 · p95 7 · max 9" and format_staleness(None, None, None) == "–"
    snap = NodeSnapshot(run_name="s", run_id="s-1", swarm="layer0", peer_id="p1", state=NodeState.ONLINE,
                        staleness_mean=3.25, staleness_p95=7.0, staleness_max=9)
    from rich.console import Console

    console = Console(width=80, record=True)
    console.print(figures_table(snap))
    shown = console.export_text()
    assert "staleness avg 3.2 · p95 7 · max 9 updates" in shown
    console = Console(width=80, record=True)
    console.print(figures_table(NodeSnapshot(run_name="s", run_id="s-1", swarm="layer0", peer_id="p1",
                                             state=NodeState.ONLINE)))
    assert "staleness" not in console.export_text()  # not measured yet: no row, the layout is unchanged
    from volunteer_cli.commands.ctl import render_status

    assert "staleness 3.2 mean, 7 p95, 9 max (updates)" in render_status(snap.to_json())
    assert "predicted" not in shown and "predicted" not in render_status(snap.to_json())
    # weight prediction at work (training.weight_prediction): the row says how far ahead the forwards look
    predicting = dataclasses.replace(snap, predicted_forwards=120, predicted_ahead=4)
    console = Console(width=120, record=True)
    console.print(figures_table(predicting))
    assert "staleness avg 3.2 · p95 7 · max 9 updates · predicted 4 ahead" in console.export_text()
    assert "9 max (updates), weights predicted 4 ahead" in render_status(predicting.to_json())


def test_a_predicting_nodes_figures_reach_its_snapshot_and_it_says_so_once():
    """The node's announcer carries the stage's prediction figures into the snapshot the dashboard and `volunteer
    ctl status` render, and says in the event log, once, that its forwards compute with predicted weights."""
    from types import SimpleNamespace

    from swarm.pipeline.peer_metrics import PeerMetrics
    from volunteer.config import load_run
    from volunteer.node.announcer import Announcer
    from volunteer.snapshot import NodeSnapshot, NodeState

    said: list[tuple[str, str]] = []
    metrics = PeerMetrics(samples_per_s=10.0, loss=1.0, clock=0, param_version=5, served=40, bytes_in=0, bytes_out=0,
                          in_flight=4, staleness_mean=1.5, staleness_p95=2.0, staleness_max=3, predicted_forwards=0,
                          predicted_ahead=0)
    node = SimpleNamespace(run=load_run("charlm")[0], swarm="layer1",
                           peer=SimpleNamespace(metrics=lambda: metrics, device="cpu"),
                           board=SimpleNamespace(emit=lambda text, kind="info", **kw: said.append((kind, text)),
                                                 snapshot=lambda: SimpleNamespace(state=NodeState.ONLINE)),
                           governors=SimpleNamespace(throttle_reason=lambda: None),
                           reachability=SimpleNamespace(cut_off_reason=lambda: ""))
    announcer = Announcer(node)
    fields = announcer.work_fields()
    assert fields["predicted_ahead"] == 0 and not said  # nothing predicted yet: nothing said
    metrics = dataclasses.replace(metrics, predicted_forwards=37, predicted_ahead=3)
    fields = announcer.work_fields()
    snap = dataclasses.replace(NodeSnapshot(run_name="charlm", run_id="c-1", swarm="layer1", peer_id="p1",
                                            state=NodeState.ONLINE),
                               **{k: v for k, v in fields.items() if k in NodeSnapshot.__dataclass_fields__})
    assert (snap.predicted_forwards, snap.predicted_ahead) == (37, 3)
    assert [kind for kind, _ in said] == ["predicting"] and "predicted 3 updates ahead" in said[0][1]
    announcer.work_fields()
    assert len(said) == 1  # once a process, not every heartbeat
