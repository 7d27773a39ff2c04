"""``averaging.mode: allreduce``: synchronous group averaging of a swarm in rounds, all or nothing.

Rounds start on a common clock (every ``averaging.allreduce_every_s`` of DHT time). At the start of
round ``r`` each peer takes its group from the latest records (itself plus the online peers of the
swarm, sorted), freezes a copy of its layer between two steps, flattens it, and cuts the vector
into one part per member. Then, map-reduce style (a reduce-scatter, then an all-gather):

1. reduce: the member at position ``i`` pulls part ``i`` of every other member's frozen copy and
   averages it with its own;
2. gather: every member pulls each averaged part from its owner;
3. apply: only with *every* averaged part in hand, on the compute thread, the member moves its copy
   by ``average - frozen`` (so the steps it trained during the round are kept).

Every request carries the round and a key of the group (a hash of the sorted member ids): a member
that sees another group refuses, and an owner that missed any contribution refuses to serve its part.
So a peer applies the full group average or nothing at all, never a partial average (the failure
mode of hivemind's averager noted in HIVEMIND_NOTES.md). Each member sends and receives about two
copies of its layer per round, whatever the group size.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import torch
from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from swarm.averaging.agent import SwarmAveraging
from swarm.averaging.checks import ParamsRejected, check_params
from swarm.pipeline.stage.stage_rpc import stage_namespace
from swarm.pipeline.transport.streams import ASK_UID, join_stream, reply_stream, split_message
from swarm.pipeline.transport.wire import WireError, decode_tensors, encode_tensors, pack_metadata, unpack_metadata

logger = logging.getLogger(__name__)

ROUNDS_KEPT = 2
OPS = ("part", "reduced")


class RoundFailed(RuntimeError):
    """This round cannot complete for us; nothing is applied."""


def group_key(round_id: int, group: list[str]) -> str:
    return hashlib.sha256(f"{round_id}:{','.join(group)}".encode()).hexdigest()[:16]


def flatten(params: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in params.values() if t.is_floating_point()])


def unflatten(vector: torch.Tensor, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for name, tensor in like.items():
        if tensor.is_floating_point():
            out[name] = vector[offset: offset + tensor.numel()].view(tensor.shape).to(tensor.dtype)
            offset += tensor.numel()
        else:
            out[name] = tensor
    return out


@dataclass(slots=True)
class _Round:
    round_id: int
    key: str
    group: list[str]
    frozen: dict[str, torch.Tensor]
    parts: list[torch.Tensor]
    reduced: torch.Tensor | None = None
    reduce_done: asyncio.Event = field(default_factory=asyncio.Event)


class GroupServicer(ServicerBase):
    """Serves frozen parts and averaged parts of the current rounds."""

    def __init__(self, averager: "GroupAverager | None" = None):
        self.averager = averager

    async def rpc_allreduce(self, request: runtime_pb2.ExpertRequest,
                            context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        try:
            tensor = await self.averager.serve(unpack_metadata(request.metadata))
            serialized, reply = encode_tensors([tensor], self.averager.cfg.wire_dtype), {"ok": True}
        except (RoundFailed, WireError, asyncio.TimeoutError) as exc:
            serialized, reply = [], {"ok": False, "error": str(exc)[:300]}
        messages = split_message(serialized, pack_metadata(reply), runtime_pb2.ExpertResponse)
        serialized = tensor = None  # the messages hold the reply alone (reply_stream drops it before a hold)
        async for message in reply_stream(messages, request.uid == ASK_UID, str(context.remote_id)):  # streams.py
            yield message


class GroupAverager:
    def __init__(self, averaging: SwarmAveraging):
        self.averaging = averaging
        self.cfg = averaging.cfg
        self.rounds: dict[int, _Round] = {}
        self._round_ready: dict[int, asyncio.Event] = {}
        self._servicer = GroupServicer(self)
        self._task: asyncio.Task | None = None
        self.applied = 0
        self.failed = 0

    @property
    def namespace(self) -> str:
        return stage_namespace(self.averaging.run.run_id, self.averaging.swarm)

    async def start(self) -> None:
        await self._servicer.add_p2p_handlers(self.averaging.p2p, namespace=self.namespace)
        self._task = asyncio.ensure_future(self._rounds_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            await self._servicer.remove_p2p_handlers(self.averaging.p2p, namespace=self.namespace)
        except Exception as exc:
            logger.debug("removing the all-reduce service: %s", exc)

    async def _rounds_forever(self) -> None:
        from hivemind.utils import get_dht_time

        period_s = self.cfg.allreduce_every_s
        while True:
            now = get_dht_time()
            round_id = int(now // period_s) + 1
            await asyncio.sleep(round_id * period_s - now)
            try:
                await self.run_round(round_id)
            except Exception as exc:  # a round must never take the peer down
                logger.exception("all-reduce round %d", round_id)
                self.averaging.notify("warning", "averaging", f"all-reduce round failed: {exc}")

    def _group(self) -> list[str]:
        me = self.averaging.me
        return sorted({me} | {r.peer_id for r in self.averaging.records if r.state == "online"})

    # ----- one round (loop thread)
    async def run_round(self, round_id: int, group: list[str] | None = None) -> bool:
        """Take part in round ``round_id``; True if the group average was applied."""
        group = group if group is not None else self._group()
        me = self.averaging.me
        if len(group) < 2 or me not in group:
            return False
        loop, worker = self.averaging.loop, self.averaging.worker
        frozen = await loop.run_in_executor(self.averaging.executor, worker.state_snapshot)
        parts = list(torch.tensor_split(flatten(frozen), len(group)))
        current = _Round(round_id, group_key(round_id, group), group, frozen, parts)
        self.rounds[round_id] = current
        self._ready(round_id).set()
        for old in [r for r in self.rounds if r <= round_id - ROUNDS_KEPT]:
            self.rounds.pop(old, None)
            self._round_ready.pop(old, None)
        deadline = time.monotonic() + 2 * self.cfg.timeout_s
        try:
            await self._reduce(current, group.index(me), deadline)
            averaged = await self._gather(current, deadline)
            await loop.run_in_executor(self.averaging.executor, self._apply, current, averaged)
        except (RoundFailed, ParamsRejected) as exc:
            self.failed += 1
            self.averaging.notify("warning", "averaging", f"all-reduce round {round_id} with {len(group)} peers "
                                                          f"failed, nothing applied: {exc}")
            return False
        self.applied += 1
        self.averaging.notify("info", "averaged", f"applied the average of {len(group)} peers (all-reduce round "
                                                  f"{round_id})")
        return True

    async def _reduce(self, current: _Round, index: int, deadline: float) -> None:
        try:
            others = [peer for peer in current.group if peer != self.averaging.me]
            theirs = await asyncio.gather(*[self._call(peer, current, "part", index, deadline) for peer in others])
            total = current.parts[index].clone()
            for part in theirs:
                if part.shape != total.shape or not bool(torch.isfinite(part).all()):
                    raise RoundFailed("a member sent a malformed part")
                total += part
            current.reduced = total / len(current.group)
        finally:
            current.reduce_done.set()

    async def _gather(self, current: _Round, deadline: float) -> torch.Tensor:
        me = self.averaging.me
        parts = await asyncio.gather(*[
            asyncio.sleep(0, current.reduced) if owner == me else self._call(owner, current, "reduced", j, deadline)
            for j, owner in enumerate(current.group)
        ])
        for j, part in enumerate(parts):
            if part is None or part.shape != current.parts[j].shape:
                raise RoundFailed(f"averaged part {j} is missing or malformed")
        return torch.cat(parts)

    async def _call(self, peer: str, current: _Round, op: str, index: int, deadline: float) -> torch.Tensor:
        stub = GroupServicer.get_stub(self.averaging.p2p, PeerID.from_base58(peer), namespace=self.namespace)
        request = runtime_pb2.ExpertRequest(metadata=pack_metadata({
            "op": op, "round": current.round_id, "key": current.key, "index": index}), uid=ASK_UID)
        limit = int(self.cfg.max_state_mb * 2**20)

        async def call() -> tuple[list[Any], bytes]:
            return await join_stream(await stub.rpc_allreduce(request), limit)

        try:
            serialized, raw = await asyncio.wait_for(call(), max(0.1, deadline - time.monotonic()))
            reply = unpack_metadata(raw)
            if not reply.get("ok") or len(serialized) != 1:
                raise RoundFailed(f"{peer[-8:]} did not serve {op} {index}: {reply.get('error', '')}")
            (tensor,) = decode_tensors(serialized, limit)
            return tensor.to(torch.float32)
        except RoundFailed:
            raise
        except Exception as exc:
            raise RoundFailed(f"{op} {index} from {peer[-8:]}: {exc.__class__.__name__} {exc}") from None

    def _apply(self, current: _Round, averaged: torch.Tensor) -> None:
        worker = self.averaging.worker
        target = unflatten(averaged, current.frozen)
        check_params(current.frozen, target, self.cfg.max_norm_ratio)
        with worker.lock:
            moved = {name: tensor + (target[name] - current.frozen[name]) if tensor.is_floating_point() else tensor
                     for name, tensor in worker.state_snapshot().items()}
            worker.mix_in(moved, 1.0, worker.stats.clock)

    # ----- serving (loop thread)
    def _ready(self, round_id: int) -> asyncio.Event:
        return self._round_ready.setdefault(round_id, asyncio.Event())

    async def serve(self, meta: dict) -> torch.Tensor:
        op, round_id, key, index = meta.get("op"), meta.get("round"), meta.get("key"), meta.get("index")
        if op not in OPS or not isinstance(round_id, int) or not isinstance(index, int):
            raise WireError("malformed all-reduce request")
        newest = max(self.rounds, default=round_id)
        if round_id < newest - ROUNDS_KEPT + 1 or round_id > newest + 1:
            raise RoundFailed(f"round {round_id} is not current here")
        try:
            await asyncio.wait_for(self._ready(round_id).wait(), self.cfg.timeout_s)
        except asyncio.TimeoutError:
            raise RoundFailed(f"round {round_id} has not started here") from None
        current = self.rounds.get(round_id)
        if current is None or current.key != key:
            raise RoundFailed("this peer sees another group for the round")
        if not 0 <= index < len(current.parts):
            raise WireError("part index out of range")
        if op == "part":
            return current.parts[index]
        if current.group[index] != self.averaging.me:
            raise RoundFailed(f"part {index} is not averaged here")
        await asyncio.wait_for(current.reduce_done.wait(), 2 * self.cfg.timeout_s)
        if current.reduced is None:
            raise RoundFailed("the reduction of this part failed")
        return current.reduced
