"""In-process peers of one swarm for averaging tests: each its own DHT (real P2P on 127.0.0.1), a
``SwarmPeer`` of ``layer1`` with its events in ``peer.events``; and a parameter service that serves
whatever a hostile peer wants (``FakeWorker``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from swarm.dht.dht import DHTSettings, shutdown_dht, start_dht
from swarm.pipeline.peer import SwarmPeer
from swarm.run.runconfig import RunConfig
from swarm.pipeline.stage.worker import WorkerState


class FakeWorker:
    """What a hostile peer's parameter service serves: any tensors, a high clock and a low loss."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self.params = params

    def capture(self, include_optimizer: bool = False) -> WorkerState:
        return WorkerState(params=dict(self.params), optimizer={} if include_optimizer else None, clock=10**6,
                           loss_ema=0.001, param_version=1)


def serve(peer: SwarmPeer, params: dict[str, torch.Tensor]) -> str:
    """From now on ``peer`` serves ``params`` to every pull; returns its peer id."""
    peer._params_servicer.worker = FakeWorker(params)
    return str(peer.dht.peer_id)


@contextmanager
def layer_peers(run: RunConfig, count: int, swarm: str = "layer1", evaluate: bool = False,
                extra_swarms: tuple[str, ...] = ()) -> Iterator[list[SwarmPeer]]:
    """``count`` started peers of ``swarm``, then one of each of ``extra_swarms`` on the same DHT, stopped with
    their DHTs on exit."""
    dhts, peers = [], []
    first = start_dht(DHTSettings(), [])
    dhts.append(first)
    maddrs = [str(m) for m in first.get_visible_maddrs()]
    try:
        for name in [swarm] * count + list(extra_swarms):
            dht = start_dht(DHTSettings(initial_peers=maddrs), [])
            dhts.append(dht)
            events: list = []
            peer = SwarmPeer(run, dht, name, evaluate=evaluate, notify=lambda *event, seen=events: seen.append(event))
            peer.events = events
            peer.start()
            peers.append(peer)
        yield peers
    finally:
        for peer in peers:
            peer.stop()
        for dht in dhts:
            shutdown_dht(dht)
