"""torch.optim's optimizers without importing ``torch._dynamo`` (a second of CPU at every volunteer's start).

torch.optim wraps ``Optimizer.add_param_group`` (so every constructor), ``zero_grad``, ``state_dict`` and
``load_state_dict`` in ``torch._disable_dynamo``, which imports ``torch._dynamo`` (sympy, torch.fx,
torch.distributed) the first time each is called, and ``Adam.step`` / ``AdamW.step`` / ``SGD.step`` in a wrapper
that imports it at every call. Measured here (torch 2.13, one core): 1.0 s of CPU, a third of what a volunteer
spends from process start to online (2.0 s with torch 2.5, where a session found it holding up "building layerN").
A volunteer never compiles, so the disabling does nothing for it: outside ``torch.compile``, a function wrapped by
``torch._dynamo.disable`` is called as it is.

``lighten()`` resolves torch's lazy lookup ahead of time: the wrapper keeps the resolved function on the original
as ``__dynamo_disable``; set to the original itself, the wrapper calls it and never imports. ``step_of(optimizer)``
calls the optimizer's own step under the grad mode torch's wrapper sets (``defaults["differentiable"]``), skipping
the wrapper that imports. Both depend on how torch lays these wrappers out: where torch does it otherwise (a future
version), ``lighten`` returns False and nothing changes (the import then happens, as it did before).
tests/test_optim_light.py checks, in a fresh interpreter, that a stage's steps import nothing of dynamo and that
the updates are bit-for-bit those of ``optimizer.step()``.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

_LIGHT: bool | None = None
_CLASSES = ("Optimizer", "Adam", "AdamW", "SGD")


def lighten() -> bool:
    """Make torch.optim's dynamo-disabled methods call straight through; True where torch's layout allowed it."""
    global _LIGHT
    if _LIGHT is None:
        _LIGHT = _lighten()
    return _LIGHT


def _lighten() -> bool:
    disable = getattr(torch, "_disable_dynamo", None)
    if disable is None:
        return False
    try:
        code = disable(lambda: None).__code__  # the wrapper's code: what every method it wrapped runs
    except Exception:  # noqa: BLE001 - another torch: leave it as it is
        return False
    found = 0
    for name in _CLASSES:
        for attr in vars(getattr(torch.optim, name)).values():
            fn = getattr(attr, "__func__", attr)
            original = getattr(fn, "__wrapped__", None)
            if getattr(fn, "__code__", None) is code and callable(original):
                original.__dynamo_disable = original  # what the wrapper looks up before it imports
                found += 1
    return found > 0


def step_of(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """``optimizer.step`` without the import at every call: the step itself, under the grad mode torch's wrapper
    sets. Falls back to ``optimizer.step`` where torch's layout is not the one this knows."""
    wrapped = type(optimizer).step
    step = inspect.unwrap(wrapped)
    if step is wrapped or not lighten() or step is inspect.unwrap(torch.optim.Optimizer.step):
        return optimizer.step
    differentiable = bool(optimizer.defaults.get("differentiable", False))

    def run() -> None:
        with torch.set_grad_enabled(differentiable):
            step(optimizer)

    return run


def without_dynamo() -> None:
    """At a volunteer's start: ``lighten``, or where torch lays its wrappers out otherwise, import ``torch._dynamo``
    in the background while the DHT starts (mostly waiting on p2pd and the network).

    The import is 1-2 s of CPU (sympy, torch.fx, torch.distributed) that held up "building layerN" before every first
    announce (`benchmarks.join`: start_training 2.1 s of a 5.4 s join, torch 2.5). A daemon thread: a node stopped
    meanwhile exits without waiting for it; a failure here only means the import happens later, where it used to."""
    if lighten():  # no import at all: a second of CPU saved at every start
        return

    def load() -> None:
        try:
            import torch._dynamo  # noqa: F401
        except Exception:  # noqa: BLE001 - the real import later says what is wrong
            logger.debug("warming torch._dynamo failed", exc_info=True)

    threading.Thread(target=load, name="warm-imports", daemon=True).start()
