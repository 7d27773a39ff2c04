"""mode allreduce in one process: a round gives every member the exact group mean, or changes nothing."""

from __future__ import annotations

import asyncio

import pytest
import torch

from layer_peers import layer_peers
from swarm.pipeline.peer import SwarmPeer
from swarm.run.runconfig import RunConfig
from swarm.pipeline.stage.worker import WorkerState

RUN = RunConfig.model_validate({
    "name": "avgallreduce",
    "model": {"stages": 2, "hidden_dim": 32},
    # rounds are started by the tests, not by the clock
    "averaging": {"mode": "allreduce", "allreduce_every_s": 3600, "timeout_s": 3},
})


@pytest.fixture(scope="module")
def trio():
    with layer_peers(RUN, 3, evaluate=True) as peers:
        yield peers


def _scatter(peers: list[SwarmPeer]) -> list[dict[str, torch.Tensor]]:
    """Give every peer different weights; returns them."""
    out = []
    for seed, peer in enumerate(peers):
        torch.manual_seed(seed)
        params = {k: v + torch.randn_like(v) * 0.1 for k, v in peer.worker.state_snapshot().items()}
        peer.worker.restore(WorkerState(params=params, optimizer=None, clock=0.0, loss_ema=None, param_version=0))
        out.append(params)
    return out


def _round(peers: list[SwarmPeer], round_id: int, groups: list[list[str]]) -> list[bool]:
    futures = [asyncio.run_coroutine_threadsafe(peer.allreduce.run_round(round_id, group), peer._loop)
               for peer, group in zip(peers, groups)]
    return [future.result(30) for future in futures]


def test_a_round_gives_every_member_the_group_mean(trio):
    before = _scatter(trio)
    group = sorted(str(p.dht.peer_id) for p in trio)
    assert _round(trio, 1, [group] * 3) == [True, True, True]
    mean = {k: sum(params[k] for params in before) / 3 for k in before[0]}
    for peer in trio:
        after = peer.worker.state_snapshot()
        assert all(torch.allclose(after[k], mean[k], atol=1e-6) for k in mean)
    assert all(any(kind == "averaged" and "3 peers" in text for _, kind, text in p.events) for p in trio)


def test_members_that_disagree_on_the_group_apply_nothing(trio):
    before = _scatter(trio)
    ids = [str(p.dht.peer_id) for p in trio]
    full, partial = sorted(ids), sorted(ids[::2])  # the third peer does not know the second
    assert _round(trio, 2, [full, full, partial]) == [False, False, False]
    for peer, params in zip(trio, before):
        after = peer.worker.state_snapshot()
        assert all(torch.equal(after[k], params[k]) for k in params), "no partial average is ever applied"
    assert any(kind == "averaging" and "nothing applied" in text for _, kind, text in trio[0].events)


def test_a_member_that_never_answers_fails_the_round_for_everyone_within_the_timeout(trio):
    before = _scatter(trio)
    ids = sorted([str(p.dht.peer_id) for p in trio[:2]] + ["QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"])
    assert _round(trio[:2], 3, [ids, ids]) == [False, False]
    for peer, params in zip(trio[:2], before):
        after = peer.worker.state_snapshot()
        assert all(torch.equal(after[k], params[k]) for k in params)
