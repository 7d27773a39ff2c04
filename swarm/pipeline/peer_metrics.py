"""What a peer reports to its node each heartbeat (PeerMetrics): the figures its record, status and screens show.

Plain data, collected (``collect_metrics``, for SwarmPeer.metrics) from the stage's statistics
(swarm/pipeline/stage/stage_stats.py), the traffic, the healer and, on layer0, the driver and its evaluations
(swarm/pipeline/peer_eval.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swarm.integrity.heal import HealStatus
    from swarm.pipeline.peer_eval import Evaluations
    from swarm.pipeline.stage.worker import StageWorker
    from swarm.pipeline.stage.stage_gate import StageGate
    from swarm.pipeline.transport.traffic import Traffic


@dataclass(slots=True, frozen=True)
class PeerMetrics:
    samples_per_s: float
    loss: float | None
    clock: int
    param_version: int
    served: int
    bytes_in: int
    bytes_out: int
    in_flight: int
    samples: int = 0  # samples in the micro-batches served (what this volunteer computed)
    # layer0 driver only
    sent: int = 0
    trained: int = 0
    lost: int = 0
    refused: int = 0  # micro-batches a stage refused before anything was applied (not lost)
    waiting_for: str = ""
    blocked_reason: str = ""  # why no micro-batch flows right now ("" when they do)
    test_accuracy: float | None = None
    test_loss: float | None = None
    eval_samples: int = 0
    eval_at: float = -1.0  # wall time of that evaluation
    eval_version: int = -1  # our copy's param_version when it ran
    # integrity (every peer)
    healing: str = ""  # why this copy is sick and healing; "" when healthy
    heals: int = 0
    last_heal_at: float = 0.0
    # staleness of the recent updates (swarm/pipeline/stage/staleness.py), in updates; None before the first one
    staleness_mean: float | None = None
    staleness_p95: float | None = None
    staleness_max: int | None = None
    # weight prediction (training.weight_prediction): training forwards that computed with predicted weights, and how
    # many updates ahead the latest looked (0: none predicted)
    predicted_forwards: int = 0
    predicted_ahead: int = 0
    capacity: float | None = None  # samples/s at full use (StageStats.capacity); None until measured
    # the run's online drivers our stage refuses right now (banned), of those it knows; the last ban's reason
    # (StageGate.refusals); -1 before the gate is up
    drivers_refused: int = -1
    drivers_seen: int = -1
    ban_reason: str = ""
    # spot checks this peer ran (layer0: its driver's replicated hops, swarm/pipeline/control/spot_checks.py; layer1: the
    # stage-0 outputs it had recomputed, stage0_checks.py): checked, an odd one out held off or struck, and odd
    # ones out left unpunished because their accusers had less validated work here
    spot_checked: int = 0
    spot_caught: int = 0
    spot_outweighed: int = 0
    # layer0: how its micro-batches travel (stage to stage, or relayed by the driver): push_driver.Pusher.describe
    data_plane: str = ""


def collect_metrics(worker: StageWorker, traffic: Traffic, in_flight: int, heal: HealStatus | None, driver: Any,
                    evaluations: Evaluations, gate: StageGate | None = None, spot0: Any = None) -> PeerMetrics:
    """This peer's figures now; the driver's and the evaluations' only on layer0 (``driver`` None elsewhere)."""
    stats = worker.stats
    common = dict(
        samples_per_s=stats.samples_per_s(time.monotonic()), loss=stats.loss_ema, clock=int(round(stats.clock)),
        param_version=stats.param_version, served=stats.served, samples=stats.samples, bytes_in=traffic.bytes_in,
        bytes_out=traffic.bytes_out, in_flight=in_flight, capacity=stats.capacity(time.monotonic()),
        predicted_forwards=worker.predicted, predicted_ahead=worker.predicted_ahead,
    )
    stale = worker.staleness.summary()
    if stale is not None:
        common.update(staleness_mean=stale.mean, staleness_p95=stale.p95, staleness_max=stale.max)
    if gate is not None:
        refused, seen, reason = gate.refusals(time.monotonic())
        common.update(drivers_refused=refused, drivers_seen=seen, ban_reason=reason)
    if heal is not None:
        common.update(healing=heal.healing, heals=heal.heals, last_heal_at=heal.last_heal_at)
    checks = [c.stats() for c in (spot0, getattr(driver, "spot", None)) if c is not None]
    common.update(spot_checked=sum(int(c.get("checked", 0)) for c in checks),
                  spot_caught=sum(int(c.get("caught", 0)) + int(c.get("replica_caught", 0)) for c in checks),
                  spot_outweighed=sum(int(c.get("outweighed", 0)) for c in checks))
    if driver is None:
        return PeerMetrics(**common)
    d = driver.stats
    pusher = getattr(driver, "pusher", None)
    return PeerMetrics(**common, data_plane=pusher.describe() if pusher is not None else "", sent=d.sent, trained=d.trained, lost=d.lost, refused=d.refused,
                       waiting_for=d.waiting_for, blocked_reason=d.blocked_reason, test_accuracy=d.eval_accuracy,
                       test_loss=d.eval_loss, eval_samples=d.eval_at_samples, eval_at=evaluations.at,
                       eval_version=evaluations.version)
