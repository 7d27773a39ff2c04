"""What the demo says when every swarm is online and nothing trains: the driver's own reason."""

from __future__ import annotations

from volunteer_cli.commands.demo import blocked_reason


def test_the_demo_repeats_the_drivers_last_reason():
    log = ("12:00:01 info training on shard 0\n"
           "12:00:05 warning no micro-batch flows: layer1 rejects our activations: rejected: contains NaN\n")
    assert blocked_reason(["", log]) == "layer1 rejects our activations: rejected: contains NaN"


def test_no_reason_once_micro_batches_flow_again():
    log = ("12:00:05 warning no micro-batch flows: our layer0 copy is sick, healing (x)\n"
           "12:00:09 info micro-batches flow again\n")
    assert blocked_reason([log]) == ""
