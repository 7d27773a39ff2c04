"""Receipts for tests that speak the stage protocol by hand (swarm/integrity/receipts.py).

A test that drives a stage directly plays the layer0 driver: it signs its own stage 0's output (as the real
driver does, swarm/pipeline/control/driver.py) and relays the receipts the stages return."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from swarm.integrity.receipts import ReceiptKey, ids_digest, tensor_digest
from swarm.pipeline.stage.stage0_replicas import ids_bytes
from swarm.pipeline.transport.wire import serialize_once


def stage0_meta(key: ReceiptKey, run_id: str, mb: str, h: torch.Tensor, ids: Any = None, op: str = "forward",
                codec: str = "float32") -> dict:
    """The metadata of a request that carries ``h`` as our own stage 0's output, signed by ``key`` (whose peer id
    must be the requester's). ``ids``: the sample ids it was computed from (default: 0..batch-1)."""
    ids_d = ids_digest(ids if ids is not None else torch.arange(h.shape[0]))
    item = serialize_once(h, codec)
    receipt = key.sign(run_id, mb, "infer" if op in ("infer", "evaluate") else "forward", 0, 0, ids_d,
                       tensor_digest(item), ids_d)
    meta = {"mb": mb, "rc": [receipt.to_wire()], "rk": key.public}
    if op == "forward":  # stage 1 takes a forward's sample ids with it (swarm/pipeline/control/stage0_checks.py)
        meta["ids"] = ids_bytes(ids if ids is not None else torch.arange(h.shape[0]))
    return meta


def relay_meta(key: ReceiptKey, mb: str, *receipts: Any) -> dict:
    """The metadata of a request that relays ``receipts`` (wire form, as a stage's reply carries them in ``rc``)."""
    return {"mb": mb, "rc": list(receipts), "rk": key.public}


@contextmanager
def stage_peers(run: Any, drivers: int, stages: tuple[int, ...]) -> Iterator[tuple[list[Any], list[Any]]]:
    """``drivers`` DHT nodes (the first one the others' bootstrap) that play layer0 drivers, and a real stage peer
    (swarm/pipeline/peer.py ``SwarmPeer``) per stage in ``stages``, whose gates know the drivers as online (driver i
    holds shard i). Everything is stopped on the way out."""
    from swarm.dht.dht import DHTSettings, shutdown_dht, start_dht
    from swarm.pipeline.peer import SwarmPeer

    dhts, peers = [], []
    try:
        dhts.append(start_dht(DHTSettings(), []))
        maddrs = [str(m) for m in dhts[0].get_visible_maddrs()]
        dhts.extend(start_dht(DHTSettings(initial_peers=maddrs), []) for _ in range(drivers - 1))
        for k in stages:
            dhts.append(start_dht(DHTSettings(initial_peers=maddrs), []))
            peers.append(SwarmPeer(run, dhts[-1], f"layer{k}"))
            peers[-1].start()
        allow(peers, dhts[:drivers])
        yield dhts[:drivers], peers
    finally:
        for peer in peers:
            peer.stop()
        for dht in dhts:
            shutdown_dht(dht)


def allow(peers: list[Any], drivers: list[Any]) -> None:
    """Every peer's gate takes ``drivers`` (DHT nodes) as the run's online layer0 peers, driver i holding shard i."""
    from swarm.dht.records import MemberRecord

    records = [MemberRecord(str(d.peer_id), "online", "test", 0.0, 0.0, shard=s) for s, d in enumerate(drivers)]

    async def set_drivers(peer):
        peer.gate.set_drivers(records)

    for peer in peers:
        asyncio.run_coroutine_threadsafe(set_drivers(peer), peer._loop).result(5)
