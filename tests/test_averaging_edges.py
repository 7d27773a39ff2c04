"""The edge modes' runtime inside a stage worker, without a network (swarm/averaging/edges.py).

The worker's update is the node's (same numbers as a bare EclNode fed the same gradients and
messages); swaps start exactly at the edges' offsets, from the smaller id; an answer is made before
the request is applied; the graph follows the records; bad messages are refused or rejected before
anything is applied; a malformed request never reaches the node (edge_rpc.py's checks).
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch

from swarm.averaging.edge_rpc import EdgeRefused, EdgeServicer
from swarm.averaging.edges import EdgeAveraging
from swarm.ecl.graph import build_graph
from swarm.ecl.updates import EclConfig, EclNode, common_eta
from swarm.dht.records import MemberRecord
from swarm.run.runconfig import RunConfig
from swarm.pipeline.stage.worker import StageWorker
from swarm.pipeline.transport.wire import encode_tensors, pack_metadata

ME = "peer-b"
OTHERS = ("peer-a", "peer-c", "peer-d")  # on the ring: we start the swaps with peer-c, peer-a with us


def _run(mode: str = "pdmm_isvr", **graph) -> RunConfig:
    return RunConfig.model_validate({
        "name": "edges",
        "model": {"stages": 1, "hidden_dim": 16},
        "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.0},
        "averaging": {"mode": mode, "graph": {"kind": "ring", "period_steps": 3, **graph}},
    })


class FakeLoop:
    """Runs what the runtime posts to the event loop at once, and records the sends."""

    def __init__(self) -> None:
        self.sends: list[tuple[str, int, torch.Tensor]] = []
        self.calls: list[tuple] = []

    def call_soon_threadsafe(self, callback, *args) -> None:
        if callback.__name__ == "_start_send":
            peer, message, step, _generation = args
            self.sends.append((peer, step, message))
        else:
            callback(*args)


def _record(peer_id: str, state: str = "online") -> MemberRecord:
    now = time.time()
    return MemberRecord(peer_id=peer_id, state=state, version="t", started_at=now, updated_at=now)


def _setup(mode: str = "pdmm_isvr", **graph) -> tuple[StageWorker, EdgeAveraging, FakeLoop, list[tuple]]:
    run = _run(mode, **graph)
    worker = StageWorker(run, 0)
    loop = FakeLoop()
    events: list[tuple] = []
    edges = EdgeAveraging(run, "layer0", ME, worker, loop, lambda *e: events.append(e))
    edges.start()
    edges.set_records([_record(p) for p in OTHERS] + [_record(ME)])
    return worker, edges, loop, events


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 64, generator=g), torch.randint(0, 10, (8,), generator=g)


def _flat(worker: StageWorker) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in worker.module.parameters()])


def _answer(edges: EdgeAveraging, sender: str, message: torch.Tensor) -> torch.Tensor:
    """What the event loop does with a request: the loop-thread checks, then the answer."""
    edges.check_arrival(sender, message)
    return edges.answer_now(sender, message)


def _reply(edges: EdgeAveraging, peer: str, message: torch.Tensor) -> None:
    """A reply to a swap we started, as _swap queues it (with the generation of the edge it started on)."""
    with edges.worker.lock:
        edges._sync_node(edges.node)
    edges._inbox.setdefault(peer, __import__("collections").deque()).append((edges.generations.current(peer), message))


def test_worker_update_is_the_ecl_node_update_with_messages_applied_in_order():
    worker, edges, loop, _ = _setup()
    graph = build_graph("ring", (ME, *OTHERS), 3)
    reference = EclNode(ME, _flat(worker), graph,
                        EclConfig(mu=0.1, eta=common_eta(0.1, graph), theta=1.0))
    grads: list[torch.Tensor] = []
    real_step = edges.node.step
    edges.node.step = lambda grad: (grads.append(grad.clone()), real_step(grad))[1]
    for i in range(10):
        if i == 2:  # peer-a (smaller id) starts a swap: the answer is our message before its is applied
            message = reference.duals["peer-a"] + torch.randn(edges.numel) * 0.002
            expected = reference.make_message("peer-a")
            assert torch.allclose(_answer(edges, "peer-a", message), expected, atol=1e-6)
            reference.on_messages({"peer-a": message})
        if i == 5:  # peer-c's reply to a swap we started comes back, applied at our next step
            message = reference.duals["peer-c"] + torch.randn(edges.numel) * 0.002
            _reply(edges, "peer-c", message)
            reference.on_messages({"peer-c": message})
        worker.forward_backward(f"mb{i}", *_batch(i))
        reference.step(grads[-1])
        for peer, step, message in loop.sends:  # what was sent is what the reference node would send then
            if step == i:
                assert message.device.type == "cpu"
                assert torch.allclose(message, reference.make_message(peer), atol=1e-6)
    assert torch.allclose(_flat(worker), reference.params, atol=1e-6)
    assert edges.stats.steps == 10 and edges.stats.applied == 2 and edges.stats.rejected == 0
    assert edges.stats.answered == 1
    assert len(loop.sends) == sum(1 for s in range(10) if graph.exchanges_at(ME, "peer-c", s)) > 0


def test_swaps_start_exactly_at_the_edge_offsets_and_only_from_the_smaller_id():
    worker, edges, loop, _ = _setup(period_steps=4)
    graph = build_graph("ring", (ME, *OTHERS), 4)
    for i in range(12):
        worker.forward_backward(f"mb{i}", *_batch(i))
    expected = {("peer-c", s) for s in range(12) if s % 4 == graph.offset(ME, "peer-c")}
    assert {(peer, step) for peer, step, _ in loop.sends} == expected
    assert len(loop.sends) == len(expected) == 3  # one edge we start (peer-a starts the other), three periods
    with pytest.raises(EdgeRefused) as refused:  # the larger id does not start a swap with us
        _answer(edges, "peer-c", edges.node.duals["peer-c"].clone())
    assert refused.value.code == "not_initiator"


def test_a_reply_whose_edge_was_rebuilt_meanwhile_is_dropped():
    worker, edges, _, _ = _setup()
    _zero_step(worker, edges)
    sent_in = edges.generations.current("peer-c")
    records = [_record(p) for p in OTHERS] + [_record(ME)]
    edges.set_records([r if r.peer_id != "peer-c" else _record("peer-c", "paused") for r in records])
    _zero_step(worker, edges)  # c left: its edge and dual are gone
    edges.set_records(records)  # ... and came back: a new edge, a fresh neutral dual
    _zero_step(worker, edges)
    fresh = edges.node.duals["peer-c"].clone()
    edges._inbox["peer-c"] = __import__("collections").deque([(sent_in, fresh + 0.01)])  # the old swap's reply
    _zero_step(worker, edges)
    assert torch.equal(edges.node.duals["peer-c"], fresh)
    assert edges.stats.stale == 1 and edges.stats.applied == 0


def test_dsgd_mixes_with_a_neighbour_copy_by_metropolis_weight():
    worker, edges, _, _ = _setup("dsgd")
    neighbour = build_graph("ring", (ME, *OTHERS), 3).neighbours(ME)[0]
    assert neighbour == "peer-a"  # it starts the swap: we answer with our copy, then mix
    before = _flat(worker)
    reply = _answer(edges, neighbour, before + 0.003)
    # the answer is our copy before mixing; mixing: w <- w + W_ij (w_j - w), W_ij = 1/(1 + max(2, 2))
    assert torch.allclose(reply, before, atol=1e-7)
    assert torch.allclose(_flat(worker), before + 0.001, atol=1e-6)
    assert edges.stats.applied == 1 and edges.stats.rejected == 0 and edges.stats.answered == 1


def test_the_graph_follows_the_online_records_and_says_so():
    _, edges, _, events = _setup()
    assert edges.graph.peers == tuple(sorted((ME, *OTHERS)))
    assert any(kind == "graph" and "4 peer(s)" in text for _, kind, text in events)
    edges.set_records([_record("peer-a"), _record("peer-c", state="paused"), _record("peer-d", state="syncing")])
    assert edges.graph.peers == ("peer-a", ME)
    edges.set_records([])  # a missing record (a late heartbeat) keeps its peer for a record lifetime
    assert edges.graph.peers == ("peer-a", ME)
    edges._unreachable.add("peer-a")  # ... unless our messages to it fail too: a crash, it leaves at once
    edges.set_records([])
    assert edges.graph.peers == (ME,) and edges.graph.neighbours(ME) == ()
    assert "training alone" in events[-1][2]


def test_the_first_notice_after_the_graph_changes_comes_as_soon_as_the_first_one():
    """A user whose neighbour left sees within FIRST_NOTICE_S whether the new edges work, not a period later."""
    from swarm.averaging.edges import FIRST_NOTICE_S, NOTICE_S

    _, edges, _, events = _setup()
    edges._notice_at = time.monotonic()  # a notice just went out
    edges._maybe_notice()
    assert not [e for e in events if e[1] == "averaged"]
    edges.set_records([_record(p) for p in OTHERS[:2]] + [_record(ME)])
    edges._unreachable.add("peer-d")  # peer-d crashed: its record lingers no longer
    edges.set_records([_record(p) for p in OTHERS[:2]] + [_record(ME)])
    assert edges.graph.peers == ("peer-a", ME, "peer-c")
    assert time.monotonic() - edges._notice_at >= NOTICE_S - FIRST_NOTICE_S, "the next notice is due in 5 s"
    edges._notice_at -= FIRST_NOTICE_S
    edges._maybe_notice()
    assert [e for e in events if e[1] == "averaged"]


def test_a_step_with_a_new_graph_keeps_surviving_duals_and_rescales_eta():
    worker, edges, _, _ = _setup()
    worker.forward_backward("mb0", *_batch(0))
    _answer(edges, "peer-a", edges.node.duals["peer-a"] + 0.001)
    worker.forward_backward("mb1", *_batch(1))
    dual_a = edges.node.duals["peer-a"].clone()
    # c and d left (their records say so): a ring of two, one edge
    edges.set_records([_record("peer-a"), _record(ME), _record("peer-c", "offline"), _record("peer-d", "paused")])
    worker.forward_backward("mb2", *_batch(2))
    assert set(edges.node.duals) == {"peer-a"}
    assert torch.equal(edges.node.duals["peer-a"], dual_a)
    assert edges.node.config.eta == pytest.approx(common_eta(0.1, build_graph("ring", ("peer-a", ME), 3)))


def test_bad_messages_are_refused_or_rejected_and_never_applied():
    worker, edges, _, events = _setup()
    before = _flat(worker)
    with pytest.raises(EdgeRefused) as refused:
        _answer(edges, "stranger", torch.zeros(edges.numel))
    assert refused.value.code == "not_neighbour"
    bad = torch.zeros(edges.numel)
    bad[3] = float("nan")
    with pytest.raises(EdgeRefused) as rejected:
        _answer(edges, "peer-a", bad)
    assert rejected.value.code == "rejected"
    assert any(kind == "rejected" and "peer-a"[-8:] in text for _, kind, text in events)
    # the rejected sender is left out of the next graph, and not listened to meanwhile
    edges.set_records([_record(p) for p in OTHERS])
    assert "peer-a" not in edges.graph.peers
    with pytest.raises(EdgeRefused):
        _answer(edges, "peer-a", torch.zeros(edges.numel))
    # a finite reply far larger than our copy is rejected at the step, before it touches the dual
    _reply(edges, "peer-c", torch.full((edges.numel,), 1e6))
    _zero_step(worker, edges)
    assert edges.stats.rejected == 2 and edges.stats.applied == 0
    # ... and so is such a request (past the loop's checks), and it is not answered
    with pytest.raises(EdgeRefused) as rejected:
        edges.answer_now("peer-d", torch.full((edges.numel,), 1e6))
    assert rejected.value.code == "rejected" and edges.stats.answered == 0
    # zero gradient and the new edges' neutral duals: nothing moved
    assert torch.allclose(_flat(worker), before, atol=1e-6)
    assert edges.stats.applied == 0
    for peer, dual in edges.node.duals.items():
        assert torch.allclose(dual, -edges.node._signs[peer] * before)


def test_edge_service_rejects_malformed_requests_before_the_node_sees_them():
    seen = []

    async def answer(*args):
        seen.append(args)
        return torch.ones(10)

    servicer = EdgeServicer(answer, run_id="r-1", swarm="layer0", mode="pdmm_isvr", numel=10)
    good = {"op": "swap", "run_id": "r-1", "swarm": "layer0", "mode": "pdmm_isvr", "step": 3}

    def handle(tensors, meta, raw=None):
        reply, answered = asyncio.run(servicer._handle(encode_tensors(tensors),
                                                       raw if raw is not None else pack_metadata(meta), "sender"))
        assert bool(answered) == bool(reply["ok"])  # a refusal carries no tensor
        return reply

    cases = [
        (handle([torch.zeros(10)], {**good, "run_id": "other"}), "wrong_run"),
        (handle([torch.zeros(10)], {**good, "mode": "dsgd"}), "wrong_run"),
        (handle([torch.zeros(10)], {**good, "op": "params"}), "rejected"),
        (handle([torch.zeros(10)], {**good, "op": "edge"}), "rejected"),  # the one-way push of older peers
        (handle([torch.zeros(10)], {**good, "step": -1}), "rejected"),
        (handle([torch.zeros(10)], {**good, "step": "3"}), "rejected"),
        (handle([torch.zeros(11)], good), "rejected"),
        (handle([torch.zeros(2, 5)], good), "rejected"),
        (handle([torch.zeros(10, dtype=torch.int64)], good), "rejected"),
        (handle([torch.zeros(10), torch.zeros(10)], good), "rejected"),
        (handle([torch.zeros(10_000)], good), "rejected"),
        (handle([torch.zeros(10)], good, raw=b"\xc1garbage"), "rejected"),
    ]
    for reply, code in cases:
        assert reply["ok"] is False and reply["code"] == code, reply
    assert seen == []
    assert handle([torch.zeros(10)], good) == {"ok": True}
    assert len(seen) == 1 and seen[0][0] == "sender" and seen[0][2] == 3


def test_edge_modes_refuse_an_optimizer_they_would_silently_replace():
    with pytest.raises(ValueError, match="optimizer.name: sgd and optimizer.momentum: 0"):
        RunConfig.model_validate({"name": "x", "averaging": {"mode": "pdmm_isvr"}})
    RunConfig.model_validate({"name": "x", "optimizer": {"name": "sgd", "momentum": 0},
                              "averaging": {"mode": "admm_isvr", "graph": {"kind": "random", "period_steps": 1}}})


def _zero_step(worker: StageWorker, edges: EdgeAveraging) -> None:
    """One update with a zero gradient: only the messages move anything."""
    with worker.lock:
        for p in worker.module.parameters():
            p.grad = torch.zeros_like(p)
        edges._update()


def _same_norm_away(reference: torch.Tensor, away: float, seed: int) -> torch.Tensor:
    """``reference`` pushed ``away`` of its norm in a random direction, rescaled to its norm."""
    noise = torch.randn(reference.shape, generator=torch.Generator().manual_seed(seed))
    moved = reference + away * reference.norm() * noise / noise.norm()
    return moved * (reference.norm() / moved.norm())


@pytest.mark.parametrize("mode", ["dsgd"])
def test_a_same_norm_edge_message_moves_the_copy_and_the_dual_at_most_the_step_cap(mode):
    worker, edges, _, events = _setup(mode)
    neighbour = build_graph("ring", (ME, *OTHERS), 3).neighbours(ME)[0]
    _zero_step(worker, edges)  # the node adopts the graph: neutral duals, nothing moves
    before, norm = _flat(worker), float(_flat(worker).norm())
    reference = before if mode == "dsgd" else edges.node.duals[neighbour].clone()
    _answer(edges, neighbour, _same_norm_away(reference, 0.45, seed=1))  # passes the norm check
    _zero_step(worker, edges)
    cap = worker.run.averaging.influence.max_step_ratio * norm * (1 + 1e-4)
    assert float((_flat(worker) - before).norm()) <= cap
    if mode != "dsgd":
        assert float((edges.node.duals[neighbour] - reference).norm()) <= cap
    assert edges.stats.clipped == 1 and edges.stats.applied == 1 and edges.stats.rejected == 0


def test_after_honest_messages_a_same_norm_one_is_an_outlier_rejected_and_its_sender_dropped():
    worker, edges, _, events = _setup("dsgd")
    neighbour = build_graph("ring", (ME, *OTHERS), 3).neighbours(ME)[0]
    for i in range(worker.run.averaging.influence.min_history):  # honest: ~0.1 % of the norm away
        _answer(edges, neighbour, _flat(worker) + torch.randn(edges.numel) * 1e-4)
        _zero_step(worker, edges)
    assert edges.stats.applied == worker.run.averaging.influence.min_history and edges.stats.clipped == 0
    before = _flat(worker)
    with pytest.raises(EdgeRefused, match="outlier_multiplier"):  # refused: the request is not answered
        _answer(edges, neighbour, _same_norm_away(before, 0.3, seed=2))
    _zero_step(worker, edges)
    assert torch.equal(_flat(worker), before), "nothing of it was applied"
    assert any(kind == "rejected" and "outlier_multiplier" in text for _, kind, text in events)
    assert neighbour not in edges.graph.peers


def test_an_ecl_dual_is_applied_whole_near_or_far():
    """ECL duals are neither clipped nor judged by distance (judging them broke a 3-peer PDMM ring in the
    real swarm: tests/test_edges_swarm.py); they keep the finite and norm-ratio checks. Open work: a
    bound on what one dual message does to the copy."""
    worker, edges, _, events = _setup("pdmm_isvr")
    neighbour = build_graph("ring", (ME, *OTHERS), 3).neighbours(ME)[0]
    _zero_step(worker, edges)
    dual = edges.node.duals[neighbour].clone()
    near = _same_norm_away(dual, 0.3, seed=3)  # within max_distance_ratio: PDMM takes it as it is
    _answer(edges, neighbour, near)
    _zero_step(worker, edges)
    assert torch.allclose(edges.node.duals[neighbour], near) and edges.stats.clipped == 0
    far = _same_norm_away(near, 1.5, seed=4)  # the same norm, far away
    _answer(edges, neighbour, far)
    _zero_step(worker, edges)
    assert torch.allclose(edges.node.duals[neighbour], far) and edges.stats.clipped == 0
    assert not any(kind == "rejected" for _, kind, text in events)


def test_the_notice_counts_messages_both_ways_and_pdmm_warns_once_about_late_replies():
    worker, edges, _, events = _setup()
    _zero_step(worker, edges)
    _answer(edges, "peer-a", edges.node.duals["peer-a"] + 0.001)  # one answer: one message out, one in
    edges.stats.sent += 2  # two swaps of ours came back
    edges.lags.extend([20, 20, 20])  # 20 steps, over 2 periods of K = 3
    edges._notice_at = float("-inf")
    edges._maybe_notice()
    edges._notice_at = float("-inf")
    edges._maybe_notice()
    notices = [text for _, kind, text in events if kind == "averaged"]
    assert "sent 3 and applied 1 edge message(s)" in notices[0] and "(2 swap(s) started, 1 answered)" in notices[0]
    assert "sent 0 and applied 0" in notices[1]
    warnings = [text for level, kind, text in events if level == "warning" and kind == "averaging"]
    assert len(warnings) == 1 and "admm_isvr" in warnings[0]


def _dual_attack(bounded: bool, honest: bool = False, steps: int = 300) -> tuple[float, float, int]:
    """A PDMM node of a 3-ring whose neighbour 'sybil' answers every step with a message at the norm check's edge
    (4x our norm, one fixed direction); no gradient. Returns (norm at start, largest norm within the first 60 s of
    simulated time, steps shortened)."""
    from swarm.averaging.edge_checks import DualGrowth, bound_dual_pull, norm_problem

    torch.manual_seed(0)
    graph = build_graph("ring", ("me", "honest", "sybil"), 1)
    node = EclNode("me", torch.randn(1000), graph, EclConfig(mu=0.1, eta=common_eta(0.1, graph)))
    growth = DualGrowth(RunConfig.model_validate({"name": "duals"}).averaging.influence.window_s)
    direction = torch.randn(1000)
    start, largest, shortened = float(node.params.norm()), 0.0, 0
    for step in range(steps):
        now = step * 0.2  # 5 steps a second: 300 steps are 60 s
        node.on_messages({"honest": node.new_dual("honest")})  # a neighbour whose copy equals ours sends this
        if honest:
            node.on_messages({"sybil": node.new_dual("sybil")})
        else:
            message = direction * (3.9 * float(node.params.norm()) / float(direction.norm()))
            if norm_problem(node, "sybil", message, 4.0) is not None:  # only once the copy overflowed
                return start, math.inf, shortened
            node.on_messages({"sybil": message})
        before, grad = node.params, torch.zeros(1000)
        node.step(grad)
        if bounded:
            shortened += bound_dual_pull(node, before, grad, growth, now) < 1.0
        largest = max(largest, float(node.params.norm()))
    return start, largest, shortened


def test_poisoned_duals_grow_a_copy_at_most_a_quarter_a_window():
    start, unbounded, _ = _dual_attack(bounded=False)
    assert unbounded > 100 * start  # each step's norm check allows a larger next message: it overflows
    start, bounded, shortened = _dual_attack(bounded=True)
    assert bounded <= 1.25 * start * 1.001 and shortened > 0, (start, bounded)


def test_honest_duals_are_never_shortened():
    start, largest, shortened = _dual_attack(bounded=True, honest=True)
    assert shortened == 0 and largest == pytest.approx(start, rel=1e-4)
