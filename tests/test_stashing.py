"""Weight stashing (``training.weight_stashing``; swarm/integrity/weights.py ``live_view``, stage/worker.py):
a stage's backward computes with the weights its forward ran with, though updates land in between, at no copy more
than the referee's ring made before: the storage a forward's graph holds becomes that version's copy, and the live
weights move to the new one. Real stage workers and rings, no network."""

from __future__ import annotations

import torch

from swarm.integrity.weights import WeightsRing, committed_bytes, weights_digest
from swarm.pipeline.stage.worker import StageWorker
from swarm.run.models import build_stage
from swarm.run.runconfig import RunConfig

RUN = RunConfig.model_validate({"name": "stashing", "model": {"stages": 3, "hidden_dim": 32},
                                "training": {"batch_size": 8}})
HIDDEN = 32


def _run(stashing: bool) -> RunConfig:
    return RUN.model_copy(update={"training": RUN.training.model_copy(update={"weight_stashing": stashing})})


def _update(worker: StageWorker, name: str, gen: torch.Generator) -> None:
    worker.forward(name, torch.randn(8, HIDDEN, generator=gen).relu())
    worker.backward(name, 0.1 * torch.randn(8, HIDDEN, generator=gen), None, None)


def test_a_forward_keeps_the_weights_it_ran_with_while_updates_land_and_the_backward_is_their_gradient():
    torch.manual_seed(3)
    gen = torch.Generator().manual_seed(4)
    worker = StageWorker(_run(True), 1)
    x, g = torch.randn(8, HIDDEN).relu(), 0.1 * torch.randn(8, HIDDEN)
    before = {name: p.detach().clone() for name, p in worker.named_params}
    worker.forward("held", x)
    held = worker.cache._items.get(("", "held"))
    assert held is not None and held.stash is not None
    for i in range(6):  # six other micro-batches' updates before this one's backward
        _update(worker, f"u{i}", gen)
    assert worker.ring.moved >= 1
    for name, p in worker.named_params:
        assert not torch.equal(p.detach(), before[name])  # the live weights moved on ...
        assert torch.equal(held.stash[name], before[name])  # ... the forward's stayed as they were
    assert weights_digest({n: held.stash[n] for n in worker.module.state_dict()}) == held.weights
    # its backward: exactly the gradient at the forward's weights, as one process would have taken it then
    reference = build_stage(RUN.model, 1)
    reference.load_state_dict(before)
    xr = x.detach().clone().requires_grad_(True)
    reference(xr).backward(g)
    grad_in = worker.backward("held", g, None, None)
    assert torch.allclose(grad_in, xr.grad, atol=1e-6)


def test_without_stashing_the_graph_aliases_the_live_weights_and_nothing_moves():
    gen = torch.Generator().manual_seed(5)
    worker = StageWorker(_run(False), 1)
    worker.forward("held", torch.randn(8, HIDDEN).relu())
    held = worker.cache._items.get(("", "held"))
    assert held is not None and held.stash is None
    for i in range(3):
        _update(worker, f"u{i}", gen)
    assert worker.ring.moved == 0
    live = dict(worker.named_params)
    assert all(held.params[name].data_ptr() == live[name].data_ptr() for name in held.params)


def test_a_ring_never_reuses_storage_a_graph_still_holds():
    module = build_stage(RUN.model, 1)
    size = committed_bytes(module.state_dict())
    ring = WeightsRing(max_bytes=2 * size, keep_s=100.0)
    ring.stash = True
    held, digests = [], []
    for version in range(6):
        ring.release_live(now=version - 0.5)  # the update's release: moves the storage graphs hold
        with torch.no_grad():
            next(module.parameters()).add_(0.01)
        digests.append(ring.commit(module, version, now=float(version))[1])
        view = ring.live_view()
        assert view is not None
        if version in (1, 2):  # graphs of versions 1 and 2 are still waiting for their backwards
            held.append((digests[-1], view))
        del view  # the others' backwards came
    ring.release_live(now=6.0)
    for digest, view in held:  # evicted from the ring or not, what those graphs compute with is their version
        assert weights_digest(view) == digest
    assert ring.moved == 2 and ring.recycled >= 1  # the versions nobody held were reused
    for digest in digests:
        kept = ring.get(digest, now=6.0)
        assert kept is None or weights_digest(kept.tensors) == digest


def test_the_cached_graphs_hold_a_bounded_number_of_versions():
    from swarm.integrity.weights import STASHED_VERSIONS_MAX

    gen = torch.Generator().manual_seed(6)
    worker = StageWorker(_run(True), 1)
    for i in range(STASHED_VERSIONS_MAX + 4):  # each forward at a version of its own: an update between them
        worker.forward(f"held{i}", torch.randn(8, HIDDEN, generator=gen).relu())
        _update(worker, f"u{i}", gen)
    held = [worker.cache.pop(("", f"held{i}"), 0.0) for i in range(STASHED_VERSIONS_MAX + 4)]
    assert [s is not None for s in held] == [False] * 4 + [True] * STASHED_VERSIONS_MAX  # the oldest went
    assert len({id(s.stash) for s in held if s is not None}) == STASHED_VERSIONS_MAX


def test_forwards_that_never_come_back_lose_their_own_graphs_not_a_returning_drivers():
    """A driver floods forwards at every version and never sends their backwards; an honest one keeps two micro-batches
    in flight and its backwards return. Past the bound the flood's old graphs go; the honest one's stay, so its
    backwards use their stashed versions (no input re-sent, nothing recomputed)."""
    from swarm.integrity.weights import STASHED_VERSIONS_MAX

    gen = torch.Generator().manual_seed(7)
    worker = StageWorker(_run(True), 1)
    batch = lambda: torch.randn(8, HIDDEN, generator=gen).relu()  # noqa: E731
    worker.forward("h0", batch(), owner="honest")
    for i in range(1, 3 * STASHED_VERSIONS_MAX):
        worker.forward(f"f{i}", batch(), owner="flood")  # never comes back
        worker.forward(f"h{i}", batch(), owner="honest")
        # the honest micro-batch before this one comes back: its graph is there, its version as its forward saw it
        assert worker.backward(f"h{i - 1}", 0.1 * torch.randn(8, HIDDEN, generator=gen), None, None,
                               owner="honest") is not None
    held = {id(s.stash) for s in worker.cache._items.values()}
    assert len(held) <= STASHED_VERSIONS_MAX
    assert worker.cache.held_by("flood") < 3 * STASHED_VERSIONS_MAX - 1  # the flood lost its old graphs
    assert worker.cache.held_by("honest") == 1  # the one in flight
