"""What a stage peer checks of what it is sent, beside its gate (swarm/pipeline/peer.py): referees' convictions,
re-checked before it refuses the convict's tensors (and its healer told, so heals the convict caused are given
back); micro-batches pushed stage to stage (push.py); at stage 1, a share of the stage-0 outputs it is sent, recomputed by other layer0 peers; and the receipt keys
of the swarms whose receipts it checks, fetched while their peers are alive."""

from __future__ import annotations

import asyncio
from typing import Any


def attach_checks(peer: Any) -> None:
    """On ``peer``'s servicer, once its gate and servicer exist (on the peer's event loop)."""
    if peer.index > 0:
        from swarm.pipeline.stage.convictions import desk_for

        healer, executor = peer.healer, peer.executor

        def forgive(signer: str) -> None:  # on the compute thread, where heals and steps change the step size
            asyncio.get_running_loop().run_in_executor(executor, healer.forgive, signer)

        peer._servicer.convictions = desk_for(peer.run, peer.keys, peer.gate, on_convicted=forgive, device=peer.device)
        from swarm.pipeline.stage.push import PushServer

        # micro-batches pushed to us by the stage before (or the driver) and on by us (swarm/pipeline/stage/push.py)
        peer._servicer.push = PushServer(peer.p2p, peer.run, peer.keys, index=peer.index, traffic=peer.traffic,
                                         drivers=peer.gate.view if peer.gate is not None else None)
    if peer.index == 1:
        from swarm.pipeline.control.stage0_checks import Stage0Checker

        gate = peer.gate
        peer._servicer.spot0 = Stage0Checker(peer.run, peer.p2p, peer.keys, lambda: list(gate.view.current),
                                             gate.strike, share=peer.run.integrity.spot_share, device=peer.device)
        if peer._servicer.spot0.referee is not None:
            peer._servicer.spot0.referee.traffic = peer.traffic


def prefetch_keys(peer: Any, views: dict[str, list[Any]]) -> None:
    """The receipt keys of the swarms whose receipts ``peer`` checks (its own, the one before, the one after)
    (swarm/pipeline/transport/keybook.py). Stage 0's receipts are signed by the requester itself."""
    if peer._servicer is None or peer.index == 0:
        return
    for k in (peer.index - 1, peer.index, peer.index + 1):
        if 1 <= k < peer.run.model.stages:
            name = f"layer{k}"
            ids = [r.peer_id for r in views.get(name, []) if r.state != "offline"]
            peer._loop.call_soon_threadsafe(peer.keys.prefetch, ids, name)
