"""When a run is complete: its target reached or its sample budget spent (issue 16, item 7).

A run without an end trains forever (train loss 0.0000, test loss rising). The run config may set one:
``training.end_at_target`` (the published test evaluation reaches ``target_accuracy``, or for a language
model ``target_bits_per_byte``) and ``training.sample_budget`` (a layer0 copy has trained that many
samples). Every volunteer reads the same records, so each decides on its own, within a heartbeat of the
others, with this pure function; then it pauses (in-flight work completes) and says why
(volunteer/node/completion.py), and `volunteer status` says it too.
"""

from __future__ import annotations

import math
from typing import Any


def bits_per_byte(loss_nats: float) -> float:
    return loss_nats / math.log(2)


def run_complete(training: Any, views: dict[str, list[Any]]) -> str:
    """Why the run is complete ("" while it is not), from the swarms' records. ``training`` is the run's
    TrainingConfig; ``views`` maps swarm names to their MemberRecords."""
    from swarm.dht.published import representative_clock, representative_evaluation

    layer0 = views.get("layer0", [])
    if training.sample_budget > 0:  # the median copy's clock: one record claiming 2^62 samples ends nothing
        trained = representative_clock(layer0)
        if trained >= training.sample_budget:
            return f"a layer0 copy trained {trained:,} samples, the run's budget of {training.sample_budget:,}"
    if training.end_at_target:
        latest, _ = representative_evaluation(layer0, training.eval_every_s)  # the median: swarm/dht/published.py
        if latest is not None:
            if latest.test_accuracy >= 0:
                if latest.test_accuracy >= training.target_accuracy:
                    return (f"test accuracy {latest.test_accuracy:.1%} reached the run's target "
                            f"{training.target_accuracy:.1%}")
            elif bits_per_byte(latest.test_loss) <= training.target_bits_per_byte:
                return (f"test loss {bits_per_byte(latest.test_loss):.2f} bits/byte reached the run's target "
                        f"{training.target_bits_per_byte:.2f}")
    return ""
