"""The guarded step's cheap path (issue 29): an Adam step skips copying and checking its state only when its moments
provably stay finite, and still never commits anything non-finite; the checks it skips come back every
FULL_CHECK_EVERY_STEPS steps and after any load of the state."""

from __future__ import annotations

import copy
import math

import torch

from swarm.integrity.guard import FULL_CHECK_EVERY_STEPS, SAFE_GRAD_NORM, StepGuard, StepRefused, moments_stay_finite
from swarm.pipeline.stage.worker import StageWorker
from swarm.run.runconfig import RunConfig

ADAM_RUN = RunConfig.model_validate({"name": "guard", "model": {"stages": 3, "hidden_dim": 32},
                                     "optimizer": {"name": "adam", "lr": 0.001}})


def _adam(kind=torch.optim.Adam, **kwargs):
    torch.manual_seed(0)
    module = torch.nn.Linear(8, 4)
    return module, kind(module.parameters(), lr=1e-3, **kwargs)


def _step(module, optimizer, guard, grad=1e-2, **kwargs):
    for p in module.parameters():
        p.grad = torch.full_like(p, grad)
    norm = math.sqrt(sum(float(p.grad.norm()) ** 2 for p in module.parameters()))
    params = [float(p.detach().norm()) for p in module.parameters()]
    return guard.run(optimizer.step, grad_norm=norm, param_norms=params, **kwargs)


def test_only_adam_with_a_gradient_whose_square_is_finite_may_skip_the_state_checks():
    module, adam = _adam()
    assert moments_stay_finite(adam, 1.0, 1.0)
    assert not moments_stay_finite(adam, SAFE_GRAD_NORM * 10, 1.0)
    assert not moments_stay_finite(adam, math.inf, 1.0)
    assert moments_stay_finite(_adam(torch.optim.AdamW, weight_decay=0.1)[1], 1.0, 1e30)  # decoupled decay
    assert not moments_stay_finite(_adam(weight_decay=0.1)[1], 1.0, 1e30)  # Adam's L2 decay feeds the moments
    assert not moments_stay_finite(torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9), 1.0, 1.0)


def test_adam_steps_skip_the_state_copy_but_take_the_full_check_periodically():
    module, adam = _adam()
    guard = StepGuard(module, adam, max_step_ratio=0.05)
    for _ in range(2 * FULL_CHECK_EVERY_STEPS):
        _step(module, adam, guard)
    # the first step (no state yet) and every FULL_CHECK_EVERY_STEPS-th take the full path
    assert guard.fast_steps == 2 * FULL_CHECK_EVERY_STEPS - 3
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())


def test_a_non_finite_result_on_the_cheap_path_restores_the_parameters_and_the_next_step_checks_everything():
    module, adam = _adam()
    guard = StepGuard(module, adam, max_step_ratio=0.05)
    _step(module, adam, guard)
    _step(module, adam, guard)
    before = [p.detach().clone() for p in module.parameters()]
    fast = guard.fast_steps

    def poisoned():  # whatever the rule does, a NaN it writes into the parameters is never committed
        adam.step()
        next(iter(module.parameters())).data[0, 0] = math.nan

    for p in module.parameters():
        p.grad = torch.full_like(p, 1e-2)
    try:
        guard.run(poisoned, grad_norm=0.1, param_norms=[float(b.norm()) for b in before])
        raise AssertionError("a non-finite step must be refused")
    except StepRefused:
        pass
    assert guard.fast_steps == fast + 1
    for p, b in zip(module.parameters(), before):
        assert torch.equal(p.detach(), b)
    _step(module, adam, guard)
    assert guard.fast_steps == fast + 1, "after a refusal the next step copies and checks the state again"


def test_a_state_replaced_by_a_load_is_checked_on_the_next_step():
    module, adam = _adam()
    guard = StepGuard(module, adam, max_step_ratio=0.05)
    _step(module, adam, guard)
    adam.load_state_dict(copy.deepcopy(adam.state_dict()))  # new state tensors: not the ones found finite
    fast = guard.fast_steps
    _step(module, adam, guard)
    assert guard.fast_steps == fast


def test_a_stage_worker_on_adam_takes_the_cheap_path_and_stays_within_its_bounds():
    worker = StageWorker(ADAM_RUN, 1)
    torch.manual_seed(1)
    for i in range(20):
        worker.forward(f"m{i}", torch.randn(8, 32), owner="d")
        worker.backward(f"m{i}", torch.randn(8, 32) * 0.01, None, None, owner="d")
    assert worker.guard.fast_steps >= 17
    assert all(bool(torch.isfinite(p).all()) for p in worker.module.parameters())


def test_a_stage_undoes_a_step_from_the_rings_copy_of_the_weights_it_computed_with_and_keeps_none_of_its_own():
    """issue 42: the guard's pre-step copy (4 bytes a parameter) is the referee ring's latest version, the exact weights
    an update op committed and computed with. A refused step restores them bit for bit and leaves the ring's copy (and
    its digest) as it was; a module changed since the commit (a load, a pull) gets the guard's own copy again."""
    from swarm.integrity.weights import weights_digest

    worker = StageWorker(ADAM_RUN, 1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 32, generator=gen)
    worker.forward("a", x)
    worker.backward("a", 1e-3 * torch.randn(8, 32, generator=gen), None, None)
    assert worker.guard.shared_steps == worker.guard.steps == 1 and worker.guard._param_buffers == []
    worker.forward("b", x)
    version, digest = worker.committed
    before = {n: p.detach().clone() for n, p in worker.module.named_parameters()}
    real = worker._update

    def poisoned():
        real()
        next(iter(worker.module.parameters())).data.fill_(math.nan)

    worker._update = poisoned
    try:
        worker.backward("b", 1e-3 * torch.randn(8, 32, generator=gen), None, None)
        raise AssertionError("a non-finite step must be refused")
    except StepRefused:
        pass
    finally:
        worker._update = real
    assert worker.guard.shared_steps == 2 and worker.guard.refused == 1
    for name, p in worker.module.named_parameters():
        assert torch.equal(p.detach(), before[name]), name
    assert weights_digest(worker.weights_for(digest)) == digest, "the ring's copy was written into"
    with torch.no_grad():  # changed outside an op (as a pull mixes a peer's copy in): the guard copies for itself
        next(iter(worker.module.parameters())).add_(1e-3)
    worker.guard.run(real, param_norms=None)
    assert worker.guard.shared_steps == 2 and len(worker.guard._param_buffers) == len(before)
