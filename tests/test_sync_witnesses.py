"""A newcomer's download is checked against other peers' copies (swarm/averaging/sync.py, "Witnesses"),
over real P2P on 127.0.0.1: a stranger who ranks first among the donors and serves a finite layer of a
plausible norm (every check on names, shapes, finiteness and norm passes) is rejected and banned when two
honest copies agree against it, and the newcomer loads an honest copy instead. With one honest witness
only, the vote is undecided: the download is kept and the event says it was not confirmed.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

import swarm.averaging.sync as sync
from layer_peers import layer_peers, serve
from swarm.pipeline.peer import SwarmPeer
from swarm.dht.records import MemberRecord
from swarm.run.runconfig import RunConfig

RUN = RunConfig.model_validate({
    "name": "syncwitness",
    "model": {"stages": 2, "hidden_dim": 32},
    "optimizer": {"name": "adam", "lr": 0.01},
    "training": {"batch_size": 8, "in_flight": 1},
    "averaging": {"mode": "dpwa", "fetch_probability": 0.0, "timeout_s": 10, "ban_s": 60, "sync_timeout_s": 30},
})
WAIT_S = 60
TRAINED = 1.1  # the honest copies: the seeded init, scaled (so a download that took is told from our own init)


def _record(peer: SwarmPeer) -> MemberRecord:
    now = time.time()
    return MemberRecord(peer_id=str(peer.dht.peer_id), state="online", version="t", started_at=now, updated_at=now,
                        clock=100, loss=0.5)


def _norm(params: dict[str, torch.Tensor]) -> float:
    return float(torch.stack([t.double().norm() ** 2 for t in params.values() if t.is_floating_point()]).sum().sqrt())


@pytest.fixture(scope="module")
def peers():
    with layer_peers(RUN, 4) as (newcomer, honest1, honest2, hostile):
        for peer in (honest1, honest2):
            with peer.worker.lock, torch.no_grad():
                for param in peer.worker.module.parameters():
                    param.mul_(TRAINED)
        seeded = newcomer.worker.state_snapshot()
        g = torch.Generator().manual_seed(3)
        noise = {k: torch.randn(t.shape, generator=g) for k, t in seeded.items()}
        serve(hostile, {k: noise[k] * (_norm(seeded) * TRAINED / _norm(noise)) for k in seeded})  # same norm, any way
        yield newcomer, honest1, honest2, hostile, seeded


def _sync(newcomer: SwarmPeer, order: list[SwarmPeer], monkeypatch) -> str | None:
    """Sync the newcomer's layer from ``order`` (donors in this order), from its seeded init."""
    newcomer.averaging.banned.until.clear()
    newcomer.events.clear()
    monkeypatch.setattr(sync, "donor_order", lambda records, me, rng: [r.peer_id for r in records])
    records = [_record(p) for p in order]
    return asyncio.run_coroutine_threadsafe(sync.sync_layer(newcomer.averaging, records),
                                            newcomer._loop).result(WAIT_S)


def _is_honest(newcomer: SwarmPeer, seeded: dict[str, torch.Tensor]) -> bool:
    now = newcomer.worker.state_snapshot()
    return all(torch.allclose(now[k], seeded[k] * TRAINED, atol=1e-6) for k in seeded if seeded[k].is_floating_point())


def test_a_first_ranked_liar_is_outvoted_by_two_agreeing_copies_and_banned(peers, monkeypatch):
    newcomer, honest1, honest2, hostile, seeded = peers
    liar = str(hostile.dht.peer_id)
    donor = _sync(newcomer, [hostile, honest1, honest2], monkeypatch)
    assert donor == str(honest1.dht.peer_id)
    assert _is_honest(newcomer, seeded), "the newcomer holds the honest copy, nothing of the lie"
    assert liar in newcomer.averaging.excluded(time.monotonic())
    assert any(kind == "rejected" and liar[-8:] in text and "agree with each other" in text
               for _, kind, text in newcomer.events)
    assert any(kind == "synced" and "checked against" in text for _, kind, text in newcomer.events)


def test_an_honest_download_is_confirmed_by_one_witness(peers, monkeypatch):
    newcomer, honest1, honest2, hostile, seeded = peers
    assert _sync(newcomer, [honest2, honest1, hostile], monkeypatch) == str(honest2.dht.peer_id)
    assert _is_honest(newcomer, seeded)
    (synced,) = [text for level, kind, text in newcomer.events if kind == "synced"]
    assert f"checked against {str(honest1.dht.peer_id)[-8:]}" in synced


def test_one_against_one_keeps_the_download_and_says_it_was_not_confirmed(peers, monkeypatch):
    newcomer, honest1, _, hostile, seeded = peers
    assert _sync(newcomer, [honest1, hostile], monkeypatch) == str(honest1.dht.peer_id)
    assert _is_honest(newcomer, seeded)
    assert any(level == "warning" and kind == "synced" and "not confirmed" in text
               for level, kind, text in newcomer.events)
