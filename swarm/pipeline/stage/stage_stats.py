"""What one stage's copy counts and hands out: its statistics, and the plain records of its updates and state.

- ``StageStats``: clock, loss EMA and measured throughput and capacity (what the membership record carries).
- ``StepInfo``: what a step hook hears about one applied update (averaging, healing).
- ``UpdateReport``: what the bounds did to the latest update (the servicer turns it into strikes).
- ``WorkerState``: a consistent CPU copy of the stage (the parameter service serves it, healing restores it).

Kept apart from stage.py (which exports all four) so that the worker there is only its compute: these are plain
data and counters, with no model, optimizer or bound in them.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from swarm.pipeline.transport.wire import WireError

LOSS_EMA_ALPHA = 0.1
THROUGHPUT_WINDOW_S = 10.0
MIN_BUSY_FOR_CAPACITY_S = 0.05  # of compute in the window before a capacity is published


@dataclass(slots=True, frozen=True)
class StepInfo:
    """What a step hook hears about one applied update."""

    batch_size: int
    loss: float | None  # the micro-batch's loss, as the last stage computed it
    forward_at: float  # monotonic time of the forward (at this stage) whose gradient was applied
    staleness: int = 0  # updates applied here between that forward and this update (swarm/pipeline/stage/staleness.py)


@dataclass(slots=True, frozen=True)
class UpdateReport:
    """What the bounds did to the latest applied update (the servicer turns it into strikes)."""

    clip_scale: float  # 1.0 = not clipped; the smaller of the output-gradient and parameter-gradient scales
    tensors_scaled: int  # parameter tensors whose move the step bound shortened
    staleness: int = 0  # updates applied here between this micro-batch's forward and its backward
    step_factor: float = 1.0  # what the staleness-aware rule scaled this update's step by


@dataclass(slots=True)
class WorkerState:
    """A consistent CPU copy of a stage: what the parameter service serves and healing restores."""

    params: dict[str, torch.Tensor]  # the module's state_dict (parameters and buffers)
    optimizer: dict[str, torch.Tensor] | None  # named optimizer tensors (swarm/run/optim_state.py), if taken
    clock: float
    loss_ema: float | None
    param_version: int


class StageStats:
    """Clock, loss EMA and measured throughput of this copy (what the membership record carries)."""

    def __init__(self) -> None:
        self.clock = 0.0  # samples trained into this copy (fractional once merged by averaging)
        self.param_version = 0  # updates applied
        self.served = 0  # micro-batches whose update we applied (the update counter staleness is counted on)
        self.samples = 0  # the samples in them (this process's contribution; the clock also merges peers')
        self.loss_ema: float | None = None
        self._window: deque[tuple[float, int]] = deque()
        self._busy: deque[tuple[float, float]] = deque()  # (monotonic end, seconds computing) per request
        self._last_capacity: float | None = None
        self._window_lock = threading.Lock()  # the compute thread appends, the node's thread reads

    def record_update(self, batch_size: int, loss: float | None, now: float) -> None:
        self.clock += batch_size
        self.param_version += 1
        self.served += 1
        self.samples += batch_size
        if loss is not None and math.isfinite(loss):
            self.loss_ema = loss if self.loss_ema is None else (1 - LOSS_EMA_ALPHA) * self.loss_ema + LOSS_EMA_ALPHA * loss
        with self._window_lock:
            self._window.append((now, batch_size))

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Time one request's compute (forward, backward, inference) for ``capacity``."""
        started = time.perf_counter()
        try:
            yield
        finally:
            with self._window_lock:
                self._busy.append((time.monotonic(), time.perf_counter() - started))

    def capacity(self, now: float) -> float | None:
        """Samples/s this copy could train at if it computed all the time: the samples of the window's
        updates over the seconds it spent computing (their forwards, backwards and any inference). None
        until it has computed a little (rebalancing compares peers by it, swarm/rebalance.py). A copy with
        no work in the window keeps its last figure: when the pipeline stalls (a swarm lost its peers),
        rebalancing needs capacities most, and nothing is measured then."""
        with self._window_lock:
            while self._busy and now - self._busy[0][0] > THROUGHPUT_WINDOW_S:
                self._busy.popleft()
            while self._window and now - self._window[0][0] > THROUGHPUT_WINDOW_S:
                self._window.popleft()
            seconds = sum(s for _, s in self._busy)
            samples = sum(n for _, n in self._window)
            if seconds >= MIN_BUSY_FOR_CAPACITY_S and samples > 0:
                self._last_capacity = samples / seconds
            return self._last_capacity

    def samples_per_s(self, now: float) -> float:
        with self._window_lock:
            while self._window and now - self._window[0][0] > THROUGHPUT_WINDOW_S:
                self._window.popleft()
            if not self._window:
                return 0.0
            span = max(now - self._window[0][0], 1.0)
            return sum(n for _, n in self._window) / span


# ----- what a stage worker raises, and its benchmarks' simulated accelerator
SIMULATED_STEP_ENV = "VOLUNTEER_SIMULATED_STEP_S"


def simulated_step_s() -> float:
    """Benchmarks only: pretend each forward/backward runs on an accelerator that takes this long.

    The compute thread sleeps (holding the stage, so one micro-batch at a time), which lets a 2-core
    machine measure how throughput scales with peers per swarm when the CPU is not the limit.
    """
    try:
        return max(0.0, float(os.environ.get(SIMULATED_STEP_ENV, "0")))
    except ValueError:
        return 0.0


class AbsurdGradient(WireError):
    """A remote output gradient whose update would be clipped to nothing (its signer's fault): never applied."""


class InputOutOfRange(WireError):
    """The request's input (not this copy) makes outputs too large to send."""


class NeedInput(Exception):
    """Backward reached a peer that has no saved activations for this micro-batch: resend with the input."""
