"""Edge swaps over real p2p daemons on 127.0.0.1 (swarm/averaging/edge_rpc.py): the unary path for
small layers, the streamed path above wire.py's unary limit (a charlm layer is ~0.8 MB), both ways,
float16 on the wire, and a refusal coming back as EdgeRefused with its code."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from swarm.averaging.edge_rpc import EdgeRefused, EdgeServicer, swap_edge_messages
from swarm.dht.dht import DHTSettings, fresh_p2p, shutdown_dht, start_dht
from swarm.pipeline.stage.stage_rpc import Traffic, stage_namespace
from swarm.pipeline.transport.wire import UNARY_LIMIT_BYTES

RUN = SimpleNamespace(run_id="edgerpc-0123abcd", averaging=SimpleNamespace(mode="pdmm_isvr"))
SMALL = 1000
LARGE = UNARY_LIMIT_BYTES // 4 + 50_000  # float32 values: over the unary limit, so it streams


def _exchange(numel: int, messages: list[tuple[torch.Tensor, str]], refuse: bool = False):
    received: list[tuple[str, torch.Tensor, int]] = []
    replies: list[torch.Tensor] = []

    async def answer(sender: str, message: torch.Tensor, step: int) -> torch.Tensor:
        if refuse:
            raise EdgeRefused("not_neighbour", "no edge to you")
        received.append((sender, message, step))
        return -2.0 * message  # the responder's own message: anything of the same size

    server_dht = start_dht(DHTSettings(), [])
    client_dht = start_dht(DHTSettings(initial_peers=[str(m) for m in server_dht.get_visible_maddrs()]), [])
    traffic = Traffic()
    client_id, server_id = str(client_dht.peer_id), str(server_dht.peer_id)

    async def run() -> list[str]:
        server, client = await fresh_p2p(server_dht), await fresh_p2p(client_dht)
        servicer = EdgeServicer(answer, run_id=RUN.run_id, swarm="layer1", mode="pdmm_isvr", numel=numel)
        await servicer.add_p2p_handlers(server, namespace=stage_namespace(RUN.run_id, "layer1"))
        codes = []
        try:
            for step, (message, wire_dtype) in enumerate(messages):
                try:
                    replies.append(await swap_edge_messages(client, server_id, RUN, "layer1", message, step,
                                                            timeout_s=20, wire_dtype=wire_dtype, traffic=traffic))
                    codes.append("ok")
                except EdgeRefused as exc:
                    codes.append(exc.code)
        finally:
            await client.shutdown()
            await server.shutdown()
        return codes

    try:
        codes = asyncio.run(run())
    finally:
        shutdown_dht(client_dht)
        shutdown_dht(server_dht)
    return codes, received, traffic, client_id, replies


@pytest.mark.timeout(120)
def test_small_and_streamed_messages_arrive_intact_from_the_authenticated_sender():
    small, large = torch.randn(SMALL), torch.randn(LARGE)
    codes, received, traffic, client_id, replies = _exchange(SMALL, [(small, "float32")])
    assert codes == ["ok"] and received[0][0] == client_id and torch.equal(received[0][1], small)
    assert torch.equal(replies[0], -2.0 * small)  # the responder's message came back
    codes, received, traffic, _, replies = _exchange(LARGE, [(large, "float32"), (large, "float16"),
                                                             (large[:-1], "float32")])
    assert codes == ["ok", "ok", "rejected"]
    assert torch.equal(received[0][1], large) and received[0][2] == 0 and torch.equal(replies[0], -2.0 * large)
    assert received[1][1].dtype == torch.float32 and torch.allclose(received[1][1], large, atol=2e-3)
    assert replies[1].dtype == torch.float32 and torch.allclose(replies[1], -2.0 * large, atol=4e-3)
    assert traffic.bytes_out > LARGE * 4 + LARGE * 2  # float16 halves the second message
    assert traffic.bytes_in == LARGE * 4 + LARGE * 2  # its reply travels as float16 too; a refusal has none


@pytest.mark.timeout(120)
def test_a_refusal_comes_back_with_its_code():
    codes, received, _, _, _ = _exchange(SMALL, [(torch.zeros(SMALL), "float32")], refuse=True)
    assert codes == ["not_neighbour"] and received == []
