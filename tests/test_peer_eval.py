"""When layer0 evaluates the pipeline (swarm/pipeline/peer_eval.py): as often as a small share of the run's time
allows, never sooner than EVAL_MIN_GAP_S, never later than the run's eval_every_s; and a new figure is published
with the next tick, not a heartbeat later (volunteer/node/announcer.py)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import swarm.pipeline.peer_eval as peer_eval
from swarm.dht.records import MemberRecord
from swarm.pipeline.peer_eval import EVAL_MIN_GAP_S, EVAL_SHARE, Evaluations
from volunteer.config import load_run
from volunteer.node.announcer import Announcer


def _evaluations() -> Evaluations:
    run, _ = load_run("digits-mlp")
    return Evaluations(run, notify=lambda *a: None, accepting=lambda: True)


def _record(peer_id: str, state: str) -> MemberRecord:
    return MemberRecord(peer_id=peer_id, state=state, version="0", started_at=0.0, updated_at=0.0)


def test_the_gap_keeps_the_runs_evaluations_within_their_share_between_the_floor_and_the_period():
    ev = _evaluations()
    period = ev.run.training.eval_every_s
    assert ev.gap_s() == EVAL_MIN_GAP_S  # nothing measured yet: the floor
    ev.took_s = 0.01
    assert ev.gap_s() == EVAL_MIN_GAP_S  # cheap: as often as the floor allows
    ev.took_s = 0.1
    assert abs(ev.gap_s() - 0.1 / EVAL_SHARE) < 1e-9
    assert EVAL_MIN_GAP_S < ev.gap_s() < period
    ev.note_views({"layer0": [_record(f"p{i}", "online") for i in range(3)] + [_record("gone", "offline")]})
    assert ev.drivers == 3  # every online driver evaluates through the same last stage: each does a third as often
    assert ev.gap_s() == period  # 0.1 s x 3 / share > period: never later than the run's period
    ev.note_views({})
    assert ev.drivers == 1


def test_the_runs_period_still_sets_the_scale_a_benchmarks_never_stays_never():
    from swarm.pipeline.peer_eval import EVAL_MAX_SPEEDUP

    ev = _evaluations()
    for period in (60.0, 1e6):  # a run that asks for a minute; benchmarks.pipeline_configs' "no evaluation"
        ev.run = ev.run.model_copy(update={"training": ev.run.training.model_copy(update={"eval_every_s": period})})
        ev.took_s = 0.01
        assert ev.gap_s() == period / EVAL_MAX_SPEEDUP


def test_a_cheap_evaluation_runs_again_after_the_floor_not_after_the_period(monkeypatch):
    monkeypatch.setattr(peer_eval, "EVAL_MIN_GAP_S", 0.2)
    monkeypatch.setattr(peer_eval, "EVAL_MAX_SPEEDUP", 1000.0)
    said: list[str] = []
    ev = Evaluations(load_run("digits-mlp")[0], notify=lambda level, kind, text: said.append(kind),
                     accepting=lambda: True)
    assert ev.run.training.eval_every_s >= 10
    runs: list[float] = []

    async def evaluate():
        runs.append(time.monotonic())
        await asyncio.sleep(0.002)
        return 0.5, 1.0

    ev.driver = SimpleNamespace(stats=SimpleNamespace(trained=1, eval_at_samples=0), evaluate=evaluate)
    ev.worker = SimpleNamespace(stats=SimpleNamespace(param_version=7))

    async def main():
        task = asyncio.create_task(ev.run_forever())
        await asyncio.sleep(1.5)
        task.cancel()

    asyncio.run(main())
    assert 4 <= len(runs) <= 9, runs  # every 0.2-0.3 s (the loop polls every half gap), not once per 10 s period
    gaps = [b - a for a, b in zip(runs, runs[1:])]
    assert min(gaps) >= 0.2 - 1e-3
    assert 0 < ev.took_s < 0.2 and ev.version == 7 and ev.at > 0
    assert said == ["evaluated"]  # the event log says it once a period (10 s), the figure is published every time


def test_a_new_evaluation_is_announced_at_the_next_tick_once_and_at_most_once_between_heartbeats():
    announced: list[float] = []
    node = SimpleNamespace(run=load_run("digits-mlp")[0], board=SimpleNamespace(publish=lambda **kw: None), peer=None)
    announcer = Announcer(node)
    announcer.next_beat_s = 1e18  # no heartbeat in this test: only the tick's own publishing
    metrics = SimpleNamespace(eval_at=-1.0)
    announcer.work_fields = lambda: announcer.__setattr__("metrics", metrics) or {}
    announcer.announce = lambda *a, **kw: announced.append(metrics.eval_at) or True
    announcer.tick(0.0)
    assert announced == []  # no evaluation yet
    metrics.eval_at = 100.0
    announcer.tick(1.0)
    announcer.tick(2.0)
    assert announced == [100.0]  # once, at the first tick after it ran
    metrics.eval_at = 103.0
    announcer.tick(3.0)
    assert announced == [100.0], "one early record between two heartbeats: the next one carries this figure"
    announcer.next_beat_s = 4.0
    announcer.heartbeat = lambda: announcer._new_evaluation() and announced.append(metrics.eval_at)
    announcer.tick(4.0)  # the heartbeat's record carries it
    assert announced == [100.0, 103.0]
    metrics.eval_at = 106.0
    announcer.tick(5.0)
    assert announced == [100.0, 103.0, 106.0]  # and the next one may go early again


def test_a_driver_held_at_an_empty_swarm_reads_it_every_second_not_only_at_heartbeats():
    """The shipped runs beat every 5 s; a driver that read layer3 empty just before its volunteer's record went up
    waited for the next heartbeat to route to it (`volunteer demo`: 3 s at 0 samples with every swarm online). While
    it waits on a swarm, its node reads that swarm (and only it) every second; once it flows, only heartbeats read."""
    reads: list[list[str]] = []
    given: list[tuple[dict, set]] = []
    stats = SimpleNamespace(waiting_for="layer3")
    layer3 = [SimpleNamespace(peer_id="Q3ww", state="online")]

    def read_all(names, timeout_s=None):
        assert timeout_s is not None and timeout_s <= 1.0  # the node's thread waits on it: never a heartbeat's rpc_s
        reads.append(list(names))
        return {name: layer3 if len(reads) >= 3 else [] for name in names}  # its peer shows up at the third read

    membership = SimpleNamespace(read_all=read_all, fresh={"layer3"})
    peer = SimpleNamespace(driver=SimpleNamespace(stats=stats),
                           update_views=lambda views, fresh=None: given.append((dict(views), set(fresh))))
    node = SimpleNamespace(run=load_run("digits-mlp")[0], board=SimpleNamespace(publish=lambda **kw: None),
                           peer=peer, membership=membership)
    announcer = Announcer(node)
    announcer.next_beat_s = 1e18
    announcer.work_fields = lambda: {}
    announcer.views = {"layer0": [], "layer3": []}
    for now in (0.0, 0.5, 1.0, 1.6, 2.0):
        announcer.tick(now)
    assert reads == [["layer3"], ["layer3"], ["layer3"]]  # at 0, 1 and 2 s: no more than once a second
    assert given[-1] == ({"layer0": [], "layer3": layer3}, {"layer3"})  # the driver routes to it at once
    stats.waiting_for = ""
    announcer.tick(3.5)
    assert len(reads) == 3, "a flowing pipeline reads at heartbeats only"
    stats.waiting_for = "layer3"  # a paused driver's flag stays set (no hop of it clears it) ...
    announcer.tick(3.6)
    assert len(reads) == 3, "... and its view has layer3's peer already: nothing to read for it"
    announcer.views["layer3"], membership.fresh = [], set()  # empty again, and the DHT answers nothing in time
    for now in (4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0):
        announcer.tick(now)
    assert len(reads) == 3 + 3, "a read that failed doubles the wait before the next (1, 2, 4 s): a slow DHT is not " \
                                "asked every second"
