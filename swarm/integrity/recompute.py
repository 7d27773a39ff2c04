"""A referee's recomputation of one hop from the weights its signer committed to, and whether the claim reproduces.

Pure: weights, inputs and the claimed output in, a ``Finding`` out (no network: swarm/pipeline/control/referee.py fetches).
One honest referee suffices (Verde's refereed delegation): the claim either follows from the committed weights or
it does not; no vote among copies, so a swarm of two settles a dispute as surely as a swarm of twenty.

What "reproduces" means is set by honest numerics, not by how far copies drift (they are the same weights here):
- activations (forward, infer): the same computation, so the same tensor up to float rounding, the wire codec and
  bf16 autocast on an accelerator (``ACTIVATION_TOLERANCE``);
- input gradients: a stage clips the output gradient it is sent and scales its reply under the driver's bound, so
  a claim may be *shorter* than the recomputation, never longer; and a backward whose forward ran on an older
  version uses that version's activations (ReLU masks) with the weights of now (swarm/pipeline/stage/worker.py): the
  receipt names both versions' digests and the referee replays exactly that (recomputed at the weights of now only,
  a backward 32 updates stale reproduced at cosine 0.985 on digits with Adam 1e-3: too loose a margin for a large
  step size). Measured (tests/test_referee.py): honest claims reproduce at cosine > 0.9999 and norm ratio 1 on CPU;
  an ascent gradient is at -1, a random one ~0, one with noise of its own norm ~0.7.
Lossy codecs loosen the bounds (int8 blockwise: ~1 % error; lowrank: a rank-r projection of the tensor, whose
cosine with it is its norm ratio).
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from swarm.run.models import backward_root, stage_loss
from swarm.run.runconfig import ModelConfig

ACTIVATION_OPS = frozenset({"forward", "infer"})
LAST_GRADIENT_OPS = frozenset({"forward_backward", "forward_backward_check"})
MIDDLE_GRADIENT_OPS = frozenset({"backward", "backward_check"})
REFEREED_OPS = ACTIVATION_OPS | LAST_GRADIENT_OPS | MIDDLE_GRADIENT_OPS


@dataclass(slots=True, frozen=True)
class Tolerance:
    min_cosine: float
    max_ratio: float  # the claim's norm over the recomputation's
    min_ratio: float = 0.0


ACTIVATION_TOLERANCE = {"float32": Tolerance(0.99, 1.03, 0.97), "float16": Tolerance(0.99, 1.03, 0.97),
                        "int8": Tolerance(0.98, 1.05, 0.95), "lowrank": Tolerance(0.3, 1.05, 0.0)}
GRADIENT_TOLERANCE = {"float32": Tolerance(0.99, 1.05), "float16": Tolerance(0.99, 1.05),
                      "int8": Tolerance(0.98, 1.05), "lowrank": Tolerance(0.3, 1.1)}


@dataclass(slots=True, frozen=True)
class Finding:
    holds: bool
    cosine: float
    ratio: float  # claim norm / recomputed norm
    why: str = ""

    def describe(self) -> str:
        return f"cosine {self.cosine:.3f}, norm ratio {self.ratio:.3f}" + (f" ({self.why})" if self.why else "")


def tolerance_for(op: str, codec: str, dropout: float = 0.0) -> Tolerance:
    """How close a claim of ``op`` must come to its recomputation under the run's wire ``codec``. A forward with
    dropout is random where the referee's is not: its activations are held to the gradients' bound."""
    if op in ACTIVATION_OPS and not (op == "forward" and dropout > 0):
        return ACTIVATION_TOLERANCE.get(codec, ACTIVATION_TOLERANCE["int8"])
    return GRADIENT_TOLERANCE.get(codec, GRADIENT_TOLERANCE["int8"])


def compare(claim: torch.Tensor, recomputed: torch.Tensor, tolerance: Tolerance) -> Finding:
    """Does ``claim`` reproduce ``recomputed`` within ``tolerance``?"""
    a, b = claim.detach().double().flatten(), recomputed.detach().double().flatten()
    if a.shape != b.shape:
        return Finding(False, 0.0, 0.0, f"shape {tuple(claim.shape)}, recomputed {tuple(recomputed.shape)}")
    na, nb = float(a.norm()), float(b.norm())
    if not (math.isfinite(na) and math.isfinite(nb)):
        return Finding(False, 0.0, 0.0, "not finite")
    if nb == 0.0:  # nothing to point along: only nothing reproduces it
        return Finding(na <= 1e-12, 1.0 if na <= 1e-12 else 0.0, 0.0 if na == 0 else math.inf)
    if na == 0.0:  # a zero claim: a gradient clipped to nothing would be refused at the stage, never sent
        return Finding(False, 0.0, 0.0, "a zero tensor")
    cosine, ratio = float(a @ b) / (na * nb), na / nb
    holds = cosine >= tolerance.min_cosine and tolerance.min_ratio <= ratio <= tolerance.max_ratio
    return Finding(holds, cosine, ratio)


# functional_call swaps a module's parameters in place for the duration of the call: recomputations that share a module
# (a referee's threads, stage 1's stage-0 referee on asyncio's) take its lock, or one computes with another's weights
# (an honest charlm driver was convicted that way at cosine 0.836 and banned: tests/test_referee.py)
_MODULE_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCKS_LOCK = threading.Lock()


def module_lock(module: nn.Module) -> threading.Lock:
    """The lock every recomputation on ``module`` holds."""
    with _LOCKS_LOCK:
        lock = _MODULE_LOCKS.get(module)
        if lock is None:
            lock = _MODULE_LOCKS[module] = threading.Lock()
        return lock


def recompute(model: ModelConfig, module: nn.Module, op: str, weights: dict[str, torch.Tensor],
              tensors: list[torch.Tensor], targets: torch.Tensor | None = None,
              forward_weights: dict[str, torch.Tensor] | None = None, stashed: bool = False) -> torch.Tensor:
    """The output (activations) or input gradient that ``op`` computes on ``tensors`` with ``weights`` (a state dict of
    ``module``'s shape): forward/infer [x] -> y; backward/backward_check [g, x] -> grad x (unclipped), through the
    activations of ``forward_weights`` where a backward's forward ran on another version (as the stage does);
    forward_backward/_check [x, ids] with ``targets`` -> grad x of the loss; ``stashed`` (the run's
    ``training.weight_stashing``): a backward computed with ``forward_weights`` alone. Raises ValueError on weights that
    do not fit the module (names, shapes): the signer showed something else than a copy of this stage.

    Computed where ``module`` lives (a referee on a GPU recomputes a GPU-sized stage there, under the stage's own
    autocast: swarm/run/llama.py); the result comes back on the CPU, where the claim is."""
    device = _device_of(module)
    tensors = [t.to(device) for t in tensors]
    targets = None if targets is None else targets.to(device)
    if stashed and forward_weights is not None:
        weights, forward_weights = forward_weights, None
    with module_lock(module):
        return _recompute(model, module, op, weights, tensors, targets, forward_weights).cpu()


def _recompute(model: ModelConfig, module: nn.Module, op: str, weights: dict[str, torch.Tensor],
               tensors: list[torch.Tensor], targets: torch.Tensor | None,
               forward_weights: dict[str, torch.Tensor] | None) -> torch.Tensor:
    expected = module.state_dict()
    state = _fitted(expected, weights)
    if op in ACTIVATION_OPS:
        was_training = module.training
        module.train(op == "forward")
        try:
            with torch.no_grad():
                return functional_call(module, state, (tensors[0],)).detach()
        finally:
            module.train(was_training)
    module.train(True)
    if op in MIDDLE_GRADIENT_OPS:
        grad_out, x = tensors[0], tensors[1]
        x = x.detach().clone().requires_grad_(True)
        if forward_weights is None:
            outputs = functional_call(module, state, (x,))
        else:  # the forward's activations, then the weights of the backward under them (.data: the graph stays valid)
            aliases = {name: t.clone() for name, t in _fitted(expected, forward_weights).items()}
            outputs = functional_call(module, aliases, (x,))
            for name, alias in aliases.items():
                alias.data.copy_(state[name])
        (grad_in,) = torch.autograd.grad(backward_root(outputs, grad_out.to(outputs.dtype)), x)
        return grad_in.detach()
    if op in LAST_GRADIENT_OPS:
        if targets is None:
            raise ValueError("a last stage's gradient needs its targets")
        x = tensors[0].detach().clone().requires_grad_(True)
        (grad_in,) = torch.autograd.grad(stage_loss(model, module, state, x, targets), x)
        return grad_in.detach()
    raise ValueError(f"a referee does not recompute {op!r}")


def recompute_param_grads(model: ModelConfig, module: nn.Module, op: str, weights: dict[str, torch.Tensor],
                          tensors: list[torch.Tensor], targets: torch.Tensor | None = None,
                          forward_weights: dict[str, torch.Tensor] | None = None,
                          stashed: bool = False) -> dict[str, torch.Tensor]:
    """The parameter gradient an update op computes at ``weights`` (what its update steps along, before clipping):
    backward [g, x] through the activations of ``forward_weights`` where its forward ran on another version, as the
    stage does (``stashed``: through ``forward_weights`` alone); forward_backward [x] with ``targets``. On the CPU, by
    parameter name (swarm/integrity/audit.py)."""
    if stashed and forward_weights is not None:
        weights, forward_weights = forward_weights, None
    with module_lock(module):
        return _param_grads(model, module, op, weights, tensors, targets, forward_weights)


def _param_grads(model: ModelConfig, module: nn.Module, op: str, weights: dict[str, torch.Tensor],
                 tensors: list[torch.Tensor], targets: torch.Tensor | None,
                 forward_weights: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    device = _device_of(module)
    tensors = [t.to(device) for t in tensors]
    expected = module.state_dict()
    state = _fitted(expected, weights)
    names = [name for name, _ in module.named_parameters()]
    module.train(True)
    aliases = {name: t.clone().requires_grad_(name in names)
               for name, t in _fitted(expected, forward_weights if forward_weights is not None else weights).items()}
    if op in MIDDLE_GRADIENT_OPS:
        grad_out, x = tensors[0], tensors[1]
        outputs = functional_call(module, aliases, (x.detach(),))
        for name, alias in aliases.items():  # the weights of the update under the forward's activations (.data)
            alias.data.copy_(state[name])
        grads = torch.autograd.grad(backward_root(outputs, grad_out.to(outputs.dtype)), [aliases[n] for n in names],
                                    allow_unused=True)
    elif op in LAST_GRADIENT_OPS:
        if targets is None:
            raise ValueError("a last stage's gradient needs its targets")
        loss = stage_loss(model, module, aliases, tensors[0].detach(), targets.to(device))
        grads = torch.autograd.grad(loss, [aliases[n] for n in names], allow_unused=True)
    else:
        raise ValueError(f"{op!r} applies no update")
    return {name: g.detach().cpu() for name, g in zip(names, grads) if g is not None}


# A last stage's reported loss against the one recomputed from its committed weights: honest numerics (another
# device's kernels, bf16 autocast) move a loss by far less than 1 %; a loss reported to frame or shield a copy
# (route losses, swarm/pipeline/control/route_losses.py, compare losses through copies tens of % apart) is far outside
LOSS_ABS_TOLERANCE = 0.01
LOSS_REL_TOLERANCE = 0.02


def recompute_loss(model: ModelConfig, module: nn.Module, weights: dict[str, torch.Tensor], x: torch.Tensor,
                   targets: torch.Tensor) -> float:
    """The loss a last stage with ``weights`` computes on ``x`` and ``targets`` (training mode, as forward_backward)."""
    device = _device_of(module)
    state = _fitted(module.state_dict(), weights)
    with module_lock(module), torch.no_grad():
        module.train(True)
        return float(stage_loss(model, module, state, x.to(device), targets.to(device)))


def loss_agrees(claimed: float, recomputed: float) -> bool:
    return abs(claimed - recomputed) <= LOSS_ABS_TOLERANCE + LOSS_REL_TOLERANCE * abs(recomputed)


def _fitted(expected: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if set(weights) != set(expected) or any(weights[n].shape != expected[n].shape for n in expected):
        raise ValueError("the weights shown are not a copy of this stage (names or shapes differ)")
    return {name: weights[name].to(expected[name].device, expected[name].dtype) for name in expected}


def _device_of(module: nn.Module) -> torch.device:
    for tensor in module.state_dict().values():
        return tensor.device
    return torch.device("cpu")
