"""Weight prediction: a forward computes with where its stage's weights will be when its backward lands, and a
referee can rebuild exactly those weights from two versions the stage committed to.

With micro-batches in flight, ``tau`` updates land at a stage between a micro-batch's forward and its backward there
(3, 2, 1, 0 at the four stages of charlm with one driver at in_flight 4). Weight stashing makes the backward the
gradient of the weights its forward ran with, but those weights are ``tau`` updates old when the gradient is applied.
Extrapolating the last update (PipeMare's and SpecTrain's idea, with the update itself as the direction),

    w_hat = w_v + tau * (w_v - w_prev)       w_prev: the weights before the optimizer step that made w_v

the forward (and its stashed backward) compute at about the weights the gradient will be applied to. Measured with
every stage's real worker in the pipeline's schedule (``python -m benchmarks.stashing``, benchmarks/README.md session
36): charlm at 8 k sequences 2.65 bits per byte against 2.80 stashed alone and one process's 2.34.

Integrity: ``w_hat`` is no version of the stage's chain, so its digest alone would let a signer compute with any
weights. The stage registers each prediction it signs (``Derivations``: digest -> base digest, prev digest, tau) and
shows it as that: a referee fetches the two versions, checks that ``tau`` is at most ``PREDICT_MAX`` and that
``w_prev`` is one update from ``w_v`` (each tensor within the step guard's bound, ``within_one_step``), rebuilds
``w_hat`` with ``predict`` (the same float operations on every device: bit for bit) and hashes it against the digest
the receipt signed. Where the receipt names the base (a forward's ``weights``) the derivation must start from it. A
signer can thus move the weights it computes with by at most ``PREDICT_MAX`` guarded steps from versions it shows,
and not keep them there: the next version is audited as any update is.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from swarm.integrity.clip import step_bound
from swarm.integrity.guard import typical_tensor_norm

PREDICT_MAX = 8  # updates ahead a forward may predict (training.weight_prediction x the stage's staleness, capped)
STEP_SLACK = 1.001  # the guard pulls a move back onto its bound: float rounding may leave it a hair past
DERIVATIONS_KEPT = 4096  # predictions remembered for referees: one a forward, and a referee may ask for a
# backward's up to weights.KEEP_S later (digits serves ~75 forwards a second at a stage)


@dataclass(frozen=True, slots=True)
class Derivation:
    base: bytes  # the digest of w_v
    prev: bytes  # the digest of w_prev
    tau: int


def predict(base: dict[str, torch.Tensor], prev: dict[str, torch.Tensor], tau: int) -> dict[str, torch.Tensor]:
    """``base + tau * (base - prev)`` per floating tensor (others as in ``base``), in the base's dtype and device: new
    tensors. Elementwise and rounded at each operation, so a stage and its referee get the same bits."""
    out = {}
    for name, tensor in base.items():
        if not tensor.is_floating_point():
            out[name] = tensor.clone()
            continue
        before = prev[name].to(tensor.device, tensor.dtype)
        out[name] = torch.sub(tensor, before).mul_(float(tau)).add_(tensor)
    return out


def within_one_step(base: dict[str, torch.Tensor], prev: dict[str, torch.Tensor], max_step_ratio: float,
                    param_names: list[str]) -> str | None:
    """None where ``base`` is at most one guarded update from ``prev`` (the same names, shapes and dtypes; each
    parameter moved by at most the step guard's bound, ``max_step_ratio`` of its norm before the update floored at
    the stage's typical parameter norm: swarm/integrity/guard.py; every other tensor unchanged), else why not."""
    if sorted(base) != sorted(prev) or not set(param_names) <= set(base):
        return "its two versions do not name this stage's tensors"
    for name in base:
        if base[name].shape != prev[name].shape or base[name].dtype != prev[name].dtype:
            return f"its two versions differ in the shape or dtype of {name}"
        if name not in param_names and not torch.equal(base[name], prev[name]):
            return f"{name}, no parameter, changed between its two versions"
    norms = [float(prev[n].double().norm()) for n in param_names]
    floor = typical_tensor_norm(norms)
    for name, norm in zip(param_names, norms):
        move = float((base[name].double() - prev[name].double()).norm())
        limit = step_bound(norm, floor, max_step_ratio) * STEP_SLACK
        if not math.isfinite(move) or move > limit:
            return f"{name} moved {move:.4g} between its two versions, more than one update may ({limit:.4g})"
    return None


def check_derivation(derivation: Derivation, base: dict[str, torch.Tensor], prev: dict[str, torch.Tensor],
                     max_step_ratio: float, param_names: list[str], expect_base: bytes | None = None) -> str | None:
    """None where a shown derivation may be rebuilt (its digest is the caller's to check), else why not."""
    if not 1 <= derivation.tau <= PREDICT_MAX:
        return f"it predicted {derivation.tau} updates ahead (at most {PREDICT_MAX})"
    if expect_base is not None and derivation.base != expect_base:
        return "its prediction does not start from the version its receipt signed"
    return within_one_step(base, prev, max_step_ratio, param_names)


class Derivations:
    """The predictions a stage signed, by digest, for its weights door; bounded, thread-safe."""

    def __init__(self, kept: int = DERIVATIONS_KEPT):
        self.kept = kept
        self._items: OrderedDict[bytes, Derivation] = OrderedDict()
        self._lock = threading.Lock()

    def note(self, digest: bytes, derivation: Derivation) -> None:
        with self._lock:
            self._items[digest] = derivation
            self._items.move_to_end(digest)
            while len(self._items) > self.kept:
                self._items.popitem(last=False)

    def get(self, digest: bytes) -> Derivation | None:
        with self._lock:
            return self._items.get(digest)


class PredictionLie(ValueError):
    """Predicted weights shown as made from versions they cannot be made from."""


async def rebuild(fetch: Callable[[bytes], Awaitable[Any]], shown: Derivation, max_step_ratio: float,
                  param_names: list[str], expect_base: bytes | None = None) -> dict[str, torch.Tensor]:
    """The predicted weights ``shown`` names, rebuilt from its two versions (``fetch``: digest -> the tensors the signer
    shows for it, or a Derivation); raises PredictionLie where the derivation breaks a rule (``check_derivation``),
    or where a version it names is itself a prediction or does not hash to its digest. The caller hashes the result
    against the digest the receipt signed."""
    from swarm.integrity.weights_copies import weights_digest

    versions = []
    for digest in (shown.base, shown.prev):
        tensors = await fetch(digest)
        if isinstance(tensors, Derivation):
            raise PredictionLie("its prediction names another prediction as a version")
        if weights_digest(tensors) != digest:
            raise PredictionLie("it showed a version of its prediction whose digest is not the one it named")
        versions.append(tensors)
    why = check_derivation(shown, versions[0], versions[1], max_step_ratio, param_names, expect_base)
    if why is not None:
        raise PredictionLie(why)
    return predict(versions[0], versions[1], shown.tau)
