"""layer0's evaluations of the pipeline: when they run, what a published figure carries, the last one at a finish.

The driver runs an evaluation (swarm/pipeline/control/driver.py ``evaluate``); this decides when. At most
``eval_every_s`` apart, and as often as ``EVAL_SHARE`` of the run's time allows: an evaluation that took t seconds is
followed by the next one after t / EVAL_SHARE seconds times the run's drivers (each evaluates through the same last
stage), never sooner than ``EVAL_MIN_GAP_S`` nor than ``eval_every_s / EVAL_MAX_SPEEDUP``. On a small model the
figure a user waits for is then seconds old, not a period (digits: a 0.1 s evaluation every 2 s instead of every 10:
the demo saw 95 % up to 10 s late).
Sooner too (after half a period) when a copy anywhere in the run healed since the last one, because the published
figure then describes a copy that no longer exists. When the peer finishes, one more, retried until a deadline: a
hop can time out on a busy machine, a stage can be between peers. Each figure is stamped with when it ran, the
version of our copy it ran on and the run's samples then, so that whoever shows it can say how old it is.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from swarm.dht.records import MemberRecord
from swarm.run.runconfig import RunConfig

logger = logging.getLogger(__name__)

Notify = Callable[[str, str, str], None]  # (level, kind, text), as SwarmPeer's
EVAL_SHARE = 0.03  # of the run's time spent evaluating, by every driver together (an evaluation's wall time counts)
EVAL_MIN_GAP_S = 2.0  # between two evaluations of one driver, however cheap (a record carries each: DHT traffic)
EVAL_MAX_SPEEDUP = 5.0  # and never more often than eval_every_s / this: the run's period still sets the scale (a
# benchmark's 1e6 s means none; a run that asks for 60 s is never evaluated every 2 s)


class Evaluations:
    """The evaluation schedule of one layer0 peer; ``driver`` and ``worker`` are set when its driver starts."""

    def __init__(self, run: RunConfig, notify: Notify, accepting: Callable[[], bool]):
        self.run = run
        self.notify = notify
        self._accepting = accepting  # a paused peer evaluates nothing
        self.driver: Any = None  # swarm.pipeline.control.driver.PipelineDriver
        self.worker: Any = None  # swarm.pipeline.stage.worker.StageWorker
        self.at = -1.0  # wall time of the latest evaluation
        self.version = -1  # our copy's param_version when it ran
        self.run_samples = 0  # samples the run's drivers completed, as last read
        self.run_heals = 0  # heals announced anywhere in the run, as last read
        self._heals_seen = 0  # run_heals when we last evaluated
        self.drivers = 1  # online layer0 peers, as last read (ourselves included)
        self.took_s = 0.0  # wall time of the latest evaluation

    def note_views(self, views: dict[str, list[MemberRecord]]) -> None:
        """The swarms as last read. Run-wide samples trained: what the drivers completed (clocks merge when
        copies average)."""
        self.run_samples = sum(r.trained for r in views.get("layer0", []))
        self.drivers = max(1, sum(r.state == "online" for r in views.get("layer0", [])))
        self.run_heals = sum(r.heals for records in views.values() for r in records)

    def gap_s(self) -> float:
        """Seconds from one evaluation to the next: what keeps the run's evaluations within EVAL_SHARE of its time,
        between EVAL_MIN_GAP_S and ``eval_every_s``."""
        period_s = self.run.training.eval_every_s
        return min(period_s, max(EVAL_MIN_GAP_S, period_s / EVAL_MAX_SPEEDUP, self.took_s * self.drivers / EVAL_SHARE))

    async def run_forever(self) -> None:
        """Every ``gap_s()``; sooner (after half a period) when a copy of the run healed since the last one.
        The first one runs as soon as the driver has trained a micro-batch, so a run publishes a figure
        within one period of starting to train, however long its pipeline."""
        last = said = -math.inf
        while True:
            period_s = self.gap_s()
            await asyncio.sleep(min(1.0, period_s / 2))
            since_s = time.monotonic() - last
            healed = self.run_heals > self._heals_seen
            if since_s < period_s and not (healed and since_s >= period_s / 2):
                continue
            if not self._accepting() or self.driver.stats.trained == 0:
                continue
            last = time.monotonic()
            try:
                accuracy, loss = await asyncio.wait_for(self.driver.evaluate(),
                                                        timeout=max(60.0, self.run.training.eval_every_s * 3))
            except Exception as exc:
                logger.info("evaluation failed: %s", exc)
                self.notify("warning", "evaluated", f"could not evaluate the pipeline ({exc.__class__.__name__}: "
                            f"{exc}); the last published figure keeps its age")
                continue
            self.took_s = time.monotonic() - last
            logger.info("evaluated the pipeline: %s (took %.2f s; the next in %.1f s, %d driver(s))",
                        evaluation_text(accuracy, loss), self.took_s, self.gap_s(), self.drivers)
            self.stamp()
            if last - said >= self.run.training.eval_every_s:  # the event log says it once a period, not every 2 s
                said = last
                self.notify("info", "evaluated", f"evaluated the pipeline: {evaluation_text(accuracy, loss)}")

    async def final(self, deadline: float) -> bool:
        """One last evaluation, retried until ``deadline`` (monotonic): True once published, False when it could
        not run (the user was told why)."""
        attempt, reason = 0, ""
        while time.monotonic() < deadline:
            attempt += 1
            if self.driver.stats.waiting_for:  # a stage has no online peer: nothing to evaluate through
                reason = f"waiting for a peer of {self.driver.stats.waiting_for}"
                await asyncio.sleep(1.0)
                continue
            try:
                accuracy, loss = await asyncio.wait_for(self.driver.evaluate(),
                                                        timeout=max(1.0, deadline - time.monotonic()))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                reason = f"{exc.__class__.__name__}: {exc}" if str(exc) else exc.__class__.__name__
                logger.info("final evaluation, attempt %d, failed: %s", attempt, reason)
                await asyncio.sleep(1.0)
                continue
            self.stamp()
            self.notify("info", "evaluated", f"final evaluation of the pipeline: {evaluation_text(accuracy, loss)}")
            return True
        self.notify("warning", "evaluated", f"the final evaluation could not run ({reason or 'no time left'}); "
                    "the last published figure keeps its age")
        return False

    def stamp(self) -> None:
        """An evaluation carries when it ran, on which version of our copy, and what the run had healed."""
        self.driver.stats.eval_at_samples = self.run_samples
        self.at = time.time()
        self.version = self.worker.stats.param_version
        self._heals_seen = self.run_heals


def evaluation_text(accuracy: float | None, loss: float) -> str:
    return f"test loss {loss:.3f}" + (f", accuracy {accuracy:.1%}" if accuracy is not None else "")
