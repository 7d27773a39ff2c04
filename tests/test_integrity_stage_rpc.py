"""A hostile driver against real stage servers over P2P: its huge and ascent gradients, which no layer2 peer signed,
are never applied (the copy does not move), it is banned for them, and the honest driver is still served."""

from __future__ import annotations

import asyncio
import pytest
import torch

from swarm.run.data import load_dataset, make_shards
from swarm.integrity.guard import typical_tensor_norm
from swarm.dht.dht import fresh_p2p
from swarm.run.runconfig import RunConfig
from swarm.pipeline.stage.worker import StageWorker
from swarm.integrity.receipts import ReceiptKey
from swarm.pipeline.stage.stage_rpc import StageError, call_stage, stage_namespace
from receipting import relay_meta, stage0_meta, stage_peers

RUN = RunConfig.model_validate({
    "name": "hostile",
    "model": {"stages": 3, "hidden_dim": 32},
    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    "training": {"batch_size": 8},
    "integrity": {"fair_share_burst": 16},
    "timeouts": {"rpc_s": 10},
})


@pytest.fixture(scope="module")
def run_with_attacker():
    with stage_peers(RUN, 2, (1, 2)) as ((honest, attacker), peers):
        yield honest, attacker, peers


async def _hop(p2p, peer, op, tensors, meta):
    return await call_stage(p2p, str(peer.dht.peer_id), stage_namespace(RUN.run_id, peer.swarm), op, tensors, meta,
                            timeout_s=10, codec="float32", max_bytes=2**24)


async def _train_honestly(p2p, layer1, layer2, worker0, dataset, ids_pool, steps: int, tag: str) -> torch.Tensor:
    grad = None
    key = ReceiptKey(str(p2p.peer_id))
    for i in range(steps):
        ids = torch.as_tensor(ids_pool[(i * 8) % len(ids_pool):][:8], dtype=torch.int64)
        mb = f"{tag}{i}"
        h0 = worker0.forward(mb, dataset.x_train[ids])
        (h1,), m1, _ = await _hop(p2p, layer1, "forward", [h0], stage0_meta(key, RUN.run_id, mb, h0, ids))
        (g1,), meta, _ = await _hop(p2p, layer2, "forward_backward", [h1, ids], relay_meta(key, mb, m1["rc"]))
        (g0,), _, _ = await _hop(p2p, layer1, "backward", [g1], {**relay_meta(key, mb, meta["rc"]), "loss": meta["loss"]})
        worker0.backward(mb, g0, None, meta["loss"])
        grad = g1
    return grad


def _max_move_ratio(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    """The largest move of any tensor, in units of its step bound (max_step_ratio of its norm, floored)."""
    floor = typical_tensor_norm([float(t.norm()) for t in before.values()])
    ratio = RUN.integrity.max_step_ratio
    return max(float((after[n] - before[n]).norm()) / (ratio * max(float(t.norm()), floor)) for n, t in before.items())


def test_huge_and_ascent_gradients_are_bounded_and_the_flood_is_refused(run_with_attacker):
    honest, attacker, (layer1, layer2) = run_with_attacker
    dataset = load_dataset(RUN.data, RUN.model)
    shards = make_shards(dataset.y_train, RUN.data, dataset.num_classes)

    async def main():
        p2p_honest, p2p_attacker = await fresh_p2p(honest), await fresh_p2p(attacker)
        try:
            worker0 = StageWorker(RUN, 0)
            g1 = await _train_honestly(p2p_honest, layer1, layer2, worker0, dataset, shards[0], 12, "h")
            x = torch.randn(8, 32)
            # one backward with float32's largest finite gradient
            before = layer1.worker.state_snapshot()
            try:
                await _hop(p2p_attacker, layer1, "backward", [torch.full((8, 32), 3e38), x], {"mb": "evil"})
            except StageError as exc:  # a gradient no layer2 peer signed: refused before anything is computed
                assert exc.code == "bad_receipt"
            huge_move = _max_move_ratio(before, layer1.worker.state_snapshot())
            # a burst of ordinary-sized gradient ascent
            codes = []
            for i in range(60):
                before = layer1.worker.state_snapshot()
                try:
                    await _hop(p2p_attacker, layer1, "backward", [-g1, x], {"mb": f"a{i}"})
                    codes.append("ok")
                except StageError as exc:
                    codes.append(exc.code)
                assert _max_move_ratio(before, layer1.worker.state_snapshot()) <= 1.001
            await _train_honestly(p2p_honest, layer1, layer2, worker0, dataset, shards[0], 3, "after")
            return huge_move, codes
        finally:
            await p2p_honest.shutdown()
            await p2p_attacker.shutdown()

    huge_move, codes = asyncio.run(main())
    assert huge_move <= 1.001, "one message moved a tensor past the step bound"
    for peer in (layer1, layer2):
        assert all(bool(torch.isfinite(p).all()) for p in peer.worker.module.parameters())
    assert codes.count("ok") == 0, codes  # a driver authors no gradient: unsigned ones are never applied
    assert "banned" in codes, codes  # and relaying what nobody signed is a strike


def test_a_finishing_driver_may_still_evaluate_but_not_train():
    """Its record says finishing (not online) while it evaluates the pipeline one last time: infer and evaluate
    apply nothing and are served; a forward (new work) is not (the CI failure of test_export_then_eval)."""
    import asyncio

    from swarm.dht.records import MemberRecord
    from swarm.run.runconfig import IntegrityConfig
    from swarm.pipeline.stage.stage_gate import StageGate

    async def main() -> dict[str, object]:
        gate = StageGate(IntegrityConfig())
        gate.set_drivers([MemberRecord("done", "finishing", "v", 0.0, 0.0, shard=0)])
        return {op: await gate.admit("done", op) for op in ("infer", "evaluate", "backward", "forward")}

    answers = asyncio.run(main())
    assert answers["infer"] is None and answers["evaluate"] is None and answers["backward"] is None
    assert answers["forward"] is not None and answers["forward"].code == "unknown_driver"
