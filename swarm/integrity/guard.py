"""A guarded step: an update is committed only if it leaves every parameter and optimizer state finite,
and it moves no parameter tensor by more than ``max_step_ratio`` of its norm.

Before the step the guard copies the parameters and the optimizer's tensors into buffers it keeps
(``torch._foreach_copy_``: one fused copy, no allocation once warm); after it, one fused norm over
everything says whether all is finite. A non-finite result restores the copies (and drops optimizer
state the step created), so the copy is exactly as before. The step bound compares each tensor's
move with its pre-step norm (floored at the norm of the stage's typical tensor, the root mean
square of its tensors' norms, so a small or zero-initialised bias can still learn) and scales a move that is too long back onto the bound.

Whatever the update rule (``optimizer.step`` or an edge mode's rule, swarm/pipeline/stage.py
``set_update_rule``), the guard wraps it the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from swarm.integrity.clip import step_bound


class StepRefused(ValueError):
    """The update would have made the copy non-finite; it was undone (nothing applied)."""


@dataclass(slots=True, frozen=True)
class GuardResult:
    tensors_scaled: int  # parameter tensors whose move was scaled back onto the step bound


class StepGuard:
    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, max_step_ratio: float):
        self.module = module
        self.optimizer = optimizer
        self.max_step_ratio = max_step_ratio
        self._buffers: list[torch.Tensor] = []
        self.refused = 0
        self.scaled_steps = 0
        self.steps = 0

    def _params(self) -> list[torch.Tensor]:
        return [p.data for p in self.module.parameters()]

    def _state(self) -> list[torch.Tensor]:
        out = []
        for param in self.module.parameters():
            for value in self.optimizer.state.get(param, {}).values():
                if isinstance(value, torch.Tensor):
                    out.append(value)
        return out

    def _backup(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if len(self._buffers) != len(tensors) or any(b.shape != t.shape or b.dtype != t.dtype
                                                     for b, t in zip(self._buffers, tensors)):
            self._buffers = [torch.empty_like(t) for t in tensors]
        if tensors:
            torch._foreach_copy_(self._buffers, tensors)
        return self._buffers

    @torch.no_grad()
    def run(self, update: Callable[[], None], bound_steps: bool = True) -> GuardResult:
        """Run ``update`` (which steps the parameters in place); undo it if anything became non-finite.

        ``bound_steps=False`` (an edge mode's rule, whose move includes the pull towards its neighbours,
        checked where their messages arrive) keeps the finiteness guard and skips the step bound."""
        params = self._params()
        had_state = {id(p): bool(self.optimizer.state.get(p)) for p in self.module.parameters()}
        before_state = self._state()
        saved = self._backup(params + before_state)
        update()
        self.steps += 1
        after_state = self._state()
        if not _all_finite(params + after_state):
            self._restore(params, before_state, saved, had_state)
            self.refused += 1
            raise StepRefused("this update would make the copy non-finite: not applied")
        scaled = self._bound_steps(params, saved[: len(params)]) if bound_steps else 0
        self.scaled_steps += int(scaled > 0)
        return GuardResult(tensors_scaled=scaled)

    def _restore(self, params: list[torch.Tensor], before_state: list[torch.Tensor], saved: list[torch.Tensor],
                 had_state: dict[int, bool]) -> None:
        torch._foreach_copy_(params + before_state, saved[: len(params) + len(before_state)])
        for param in self.module.parameters():
            if not had_state[id(param)]:
                self.optimizer.state.pop(param, None)  # the step created it: a fresh optimizer state again

    def _bound_steps(self, params: list[torch.Tensor], old: list[torch.Tensor]) -> int:
        if not params:
            return 0
        deltas = torch._foreach_sub(params, old)
        norms = torch.stack(torch._foreach_norm(old) + torch._foreach_norm(deltas)).double().tolist()
        old_norms, moves = norms[: len(params)], norms[len(params):]
        floor = typical_tensor_norm(old_norms)
        scaled = 0
        for param, before, delta, old_norm, move in zip(params, old, deltas, old_norms, moves):
            limit = step_bound(old_norm, floor, self.max_step_ratio)
            if move > limit > 0:
                param.copy_(before).add_(delta, alpha=limit / move)
                scaled += 1
        return scaled


def typical_tensor_norm(norms: list[float]) -> float:
    """The norm of an average tensor of the stage (root mean square over tensors): the step bound's floor."""
    return math.sqrt(sum(n * n for n in norms) / len(norms)) if norms else 0.0


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    floats = [t for t in tensors if t.is_floating_point() and t.numel()]
    if not floats:
        return True
    return bool(torch.isfinite(torch.stack(torch._foreach_norm(floats))).all())
