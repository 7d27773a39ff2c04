"""A guarded step: an update is committed only if it leaves every parameter and optimizer state finite,
and it moves no parameter tensor by more than ``max_step_ratio`` of its norm.

Before the step the guard copies the parameters and the optimizer's tensors into buffers it keeps
(``torch._foreach_copy_``: one fused copy, no allocation once warm), or reads the parameters from an exact copy kept
elsewhere (a stage's referee ring holds the version an update op just computed with: ``kept``); after it, one fused norm over
everything says whether all is finite. A non-finite result restores the copies (and drops optimizer
state the step created), so the copy is exactly as before. The step bound compares each tensor's
move with its pre-step norm (floored at the norm of the stage's typical tensor, the root mean
square of its tensors' norms, so a small or zero-initialised bias can still learn) and scales a move that is too long back onto the bound.

Whatever the update rule (``optimizer.step`` or an edge mode's rule, swarm/pipeline/stage/worker.py
``set_update_rule``), the guard wraps it the same way.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from swarm.integrity.clip import step_bound

SAFE_GRAD_NORM = 1e18  # |g| below this: g * g (< 1e36) stays far from float32's largest value (3.4e38)
FULL_CHECK_EVERY_STEPS = 50  # an Adam copy's state is still copied and checked this often (belt and braces)


class StepRefused(ValueError):
    """The update would have made the copy non-finite; it was undone (nothing applied)."""


@dataclass(slots=True, frozen=True)
class GuardResult:
    tensors_scaled: int  # parameter tensors whose move was scaled back onto the step bound


class StepGuard:
    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, max_step_ratio: float,
                 kept: Callable[[], list[torch.Tensor] | None] | None = None):
        """``kept``: an exact copy of the parameters as they are now, kept elsewhere (in parameter order), or None:
        a stage's latest committed version (swarm/integrity/weights.py ``unchanged``: the weights an update op just
        computed with), which the guard reads and restores from instead of copying them (4 bytes a parameter)."""
        self.module = module
        self._plist = list(module.parameters())  # a stage's are updated in place, never replaced: listed once
        self._kept = kept
        self.optimizer = optimizer
        self.max_step_ratio = max_step_ratio
        self._param_buffers: list[torch.Tensor] = []
        self._state_buffers: list[torch.Tensor] = []  # Adam's: only during a full step (1 in 50), freed after
        self._scratch: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # one tensor's move at a time
        self._verified_state: list[weakref.ref] = []  # the state tensors last found finite (a load replaces them)
        self.refused = 0
        self.scaled_steps = 0
        self.steps = 0
        self.fast_steps = 0  # steps whose optimizer state was not copied nor checked (moments_stay_finite)
        self.shared_steps = 0  # steps whose pre-step weights were the ring's copy (``kept``), not ours

    def _params(self) -> list[torch.Tensor]:
        return [p.data for p in self._plist]

    def _state(self) -> list[torch.Tensor]:
        out = []
        for param in self._plist:
            for value in self.optimizer.state.get(param, {}).values():
                if isinstance(value, torch.Tensor):
                    out.append(value)
        return out

    @torch.no_grad()
    def run(self, update: Callable[[], None], bound_steps: bool = True, *, grad_norm: float | None = None,
            param_norms: list[float] | None = None) -> GuardResult:
        """Run ``update`` (which steps the parameters in place); undo it if anything became non-finite.

        ``bound_steps=False`` (an edge mode's rule, whose move includes the pull towards its neighbours,
        checked where their messages arrive) keeps the finiteness guard and skips the step bound.
        ``grad_norm`` (the norm of the gradient ``update`` applies, ``optimizer.step`` only) lets an Adam step
        skip copying and checking the optimizer state when the moments provably stay finite
        (``moments_stay_finite``); ``param_norms`` (each parameter tensor's norm now) saves a pass."""
        old = self._kept() if self._kept is not None else None  # first: with weight stashing it moves the live
        params = self._params()  # weights to new storage (swarm/integrity/weights.py live_view)
        state = self._state()
        fast = (grad_norm is not None and param_norms is not None and self._state_is_verified(state)
                and self.steps % FULL_CHECK_EVERY_STEPS != FULL_CHECK_EVERY_STEPS - 1
                and moments_stay_finite(self.optimizer, grad_norm, math.sqrt(sum(n * n for n in param_norms))))
        had_state = {id(p): bool(self.optimizer.state.get(p)) for p in self._plist}
        if old is not None and _same_layout(old, params):
            self._param_buffers = []  # the copy lives in the ring: ours would be a second one
            self.shared_steps += 1
        else:
            old = _copy_into(self._param_buffers, params)
            self._param_buffers = old
        before_state = [] if fast else state
        if not fast:
            self._state_buffers = _copy_into(self._state_buffers, before_state)
        update()
        self.steps += 1
        self.fast_steps += int(fast)
        moves = self._moves(params, old)
        after_state = self._state()
        finite = all(math.isfinite(m) for m in moves) or _all_finite(params)  # a move can overflow: look closer
        if not finite or (not fast and not _all_finite(after_state)):
            self._restore(params, old, before_state, had_state)
            self._release_state_buffers()
            self.refused += 1
            raise StepRefused("this update would make the copy non-finite: not applied")
        self._release_state_buffers()
        self._verified_state = [weakref.ref(t) for t in after_state]
        if not bound_steps or not params:
            return GuardResult(tensors_scaled=0)
        old_norms = param_norms if param_norms is not None and len(param_norms) == len(params) else \
            torch.stack(torch._foreach_norm(old)).double().tolist()
        scaled = self._bound_steps(params, old, old_norms, moves)
        self.scaled_steps += int(scaled > 0)
        return GuardResult(tensors_scaled=scaled)

    def _state_is_verified(self, state: list[torch.Tensor]) -> bool:
        """The state tensors are the ones found finite after the last step (a restore or a load replaces them)."""
        return bool(state) and len(state) == len(self._verified_state) and \
            all(ref() is t for ref, t in zip(self._verified_state, state))

    def _release_state_buffers(self) -> None:
        """An Adam copy's full steps are 1 in FULL_CHECK_EVERY_STEPS: its state copy (8 bytes a parameter) is not
        kept between them. Other optimizers copy their state every step and keep the buffers (no allocation)."""
        if type(self.optimizer) in (torch.optim.Adam, torch.optim.AdamW):
            self._state_buffers = []

    def _delta(self, new: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
        """``new - before`` in a scratch buffer the size of the stage's largest tensor (not a copy of every tensor:
        4 bytes a parameter), overwritten by the next call."""
        key = (new.dtype, new.device)
        scratch = self._scratch.get(key)
        if scratch is None or scratch.numel() < new.numel():
            scratch = self._scratch[key] = torch.empty(max(p.numel() for p in self.module.parameters()),
                                                       dtype=new.dtype, device=new.device)
        return torch.sub(new, before, out=scratch[: new.numel()].view(new.shape))

    def _moves(self, params: list[torch.Tensor], old: list[torch.Tensor]) -> list[float]:
        """Each tensor's move ``||new - old||``, one tensor at a time through one scratch buffer (each norm is
        computed before the next difference overwrites it: the same stream). With ``old`` finite, a move is finite
        exactly when the new tensor is (or the norm overflowed)."""
        norms = [torch.linalg.vector_norm(self._delta(new, before)) for new, before in zip(params, old)]
        return torch.stack(norms).double().tolist() if norms else []

    def _restore(self, params: list[torch.Tensor], old: list[torch.Tensor], before_state: list[torch.Tensor],
                 had_state: dict[int, bool]) -> None:
        torch._foreach_copy_(params, old)
        if before_state:
            torch._foreach_copy_(before_state, self._state_buffers[: len(before_state)])
        else:  # a step that skipped the state copy: its moments are finite (moments_stay_finite), only the params go back
            self._verified_state = []  # the next step takes the full path
        for param in self.module.parameters():
            if not had_state[id(param)]:
                self.optimizer.state.pop(param, None)  # the step created it: a fresh optimizer state again

    def _bound_steps(self, params: list[torch.Tensor], old: list[torch.Tensor], old_norms: list[float],
                     moves: list[float]) -> int:
        floor = typical_tensor_norm(old_norms)
        scaled = 0
        for param, before, old_norm, move in zip(params, old, old_norms, moves):
            limit = step_bound(old_norm, floor, self.max_step_ratio)
            if move > limit > 0:
                if math.isfinite(move):  # before + delta * limit / move
                    torch.add(before, self._delta(param, before), alpha=limit / move, out=param)
                else:  # an overflowing move has no usable direction: the tensor stays where it was
                    param.copy_(before)
                scaled += 1
        return scaled


def moments_stay_finite(optimizer: torch.optim.Optimizer, grad_norm: float, param_norm: float) -> bool:
    """Whether an Adam or AdamW step from finite moments provably leaves them finite: ``m' = b1 m + (1 - b1) g`` and
    ``v' = b2 v + (1 - b2) g^2`` are convex combinations (betas in [0, 1)), so they stay finite whenever every
    ``g^2`` does, i.e. whenever ``|g| <= ||g|| <= SAFE_GRAD_NORM`` (Adam's L2 decay adds ``wd * p`` to ``g`` first).
    Any other optimizer, or a group outside these conditions: False (its state is copied and checked)."""
    kind = type(optimizer)
    if kind not in (torch.optim.Adam, torch.optim.AdamW) or not math.isfinite(grad_norm):
        return False
    for group in optimizer.param_groups:
        beta1, beta2 = (float(b) for b in group["betas"])
        decay = float(group["weight_decay"])
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0 and math.isfinite(decay) and decay >= 0.0):
            return False
        effective = grad_norm + (decay * param_norm if kind is torch.optim.Adam else 0.0)
        if not effective <= SAFE_GRAD_NORM:
            return False
    return True


def _copy_into(buffers: list[torch.Tensor], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` copied into ``buffers`` (reallocated only when the shapes change): one fused copy."""
    if len(buffers) != len(tensors) or any(b.shape != t.shape or b.dtype != t.dtype for b, t in zip(buffers, tensors)):
        buffers = [torch.empty_like(t) for t in tensors]
    if tensors:
        torch._foreach_copy_(buffers, tensors)
    return buffers


def _same_layout(kept: list[torch.Tensor], params: list[torch.Tensor]) -> bool:
    """A kept copy usable as the pre-step weights: one tensor per parameter, each of its shape, dtype and device."""
    return len(kept) == len(params) and all(
        k.shape == p.shape and k.dtype == p.dtype and k.device == p.device for k, p in zip(kept, params))


def typical_tensor_norm(norms: list[float]) -> float:
    """The norm of an average tensor of the stage (root mean square over tensors): the step bound's floor."""
    return math.sqrt(sum(n * n for n in norms) / len(norms)) if norms else 0.0


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    floats = [t for t in tensors if t.is_floating_point() and t.numel()]
    if not floats:
        return True
    return bool(torch.isfinite(torch.stack(torch._foreach_norm(floats))).all())
