"""A hostile peer that speaks the real protocol, for tests/test_adversary.py and benchmarks/adversary.py.

It joins a run's real DHT with its own libp2p identity, announces a signed ``MemberRecord`` in a swarm
of its choice (and keeps it alive with heartbeats), and then misbehaves in one of three roles:

- driver (a ``layer0`` record): raw stage RPCs whose ``ExpertRequest``s are built here, so nothing on
  our side sanitises them: crafted gradients (``GRADIENT_ATTACKS``), wrong labels / foreign sample
  ids (``label_request``), floods of concurrent forwards (``flood``), made-up stage-0 outputs it signs as
  its own (``STAGE0_ATTACKS``, ``train_made_up``);
- server (an ``online`` record in ``layer{k}``): handlers under the real names with a misbehaviour
  from ``SERVER_BEHAVIOURS`` (a black hole, malformed replies, huge values);
- averaging peer: a params service (``rpc_fetch``) that serves poisoned copies (``POISONS``).

Map:
    HostilePeer          identity, DHT, record heartbeat, own event loop; call / flood / serve_*
    Reply                what came back from one raw call (never raises)
    crafted_gradient     pure: the payload of each gradient attack from the honest gradient
    made_up_activations  pure: the stage-0 output a hostile driver signs instead of its copy's
    poisoned_params      pure: the poisoned copy served to pulls
    wrong_targets        pure: labels that are certainly wrong
(tests/copies.py: ``CopyOracle``, the copies as they really are: honest gradients, true accuracy.)
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator  # typing's: hivemind spots streaming handlers by typing.AsyncIterator

import torch
from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from swarm.pipeline.stage import stage_rpc
from swarm.dht.records import MemberRecord
from swarm.run.runconfig import RunConfig
from swarm.pipeline.transport.streams import join_stream, split_message
from swarm.pipeline.transport.wire import WireError, decode_tensors, encode_tensors, pack_metadata, unpack_metadata

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
FLOAT32_MAX = 3.0e38
GRADIENT_ATTACKS = ("huge_1e30", "huge_3e38", "ascent", "scaled_x100", "random")
SERVER_BEHAVIOURS = ("black_hole", "no_tensor", "wrong_shape", "nan", "huge", "garbage_metadata")
POISONS = ("nan", "x1000", "same_norm")
STAGE0_ATTACKS = ("random", "scaled_x10", "honest")  # "honest": the control, what an honest driver sends
REFUSAL_CODES = frozenset({"rejected", "busy", "banned", "unknown_driver", "wrong_shard", "paused", "healing",
                           "spot_check"})
CALL_TIMEOUT_S = 10.0
LOOP_TIMEOUT_S = 120.0
BIG_REPLY_BYTES = 64 * 2**20


# ----- pure payloads


def crafted_gradient(kind: str, honest: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """The output gradient a hostile driver sends instead of ``honest`` (same shape, always finite)."""
    if kind == "huge_1e30":
        return torch.full_like(honest, 1e30)
    if kind == "huge_3e38":
        return torch.full_like(honest, FLOAT32_MAX)  # float32's largest finite value: passes every wire check
    if kind == "ascent":
        return -honest
    if kind == "scaled_x100":
        return honest * 100.0
    if kind == "random":
        noise = torch.randn(honest.shape, generator=generator)
        return noise * (honest.norm() / noise.norm().clamp_min(1e-12))  # the honest norm, a random direction
    raise ValueError(f"unknown gradient attack {kind!r}; choose one of {GRADIENT_ATTACKS}")


def made_up_activations(kind: str, honest: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """The stage-0 output a hostile driver signs as its own instead of ``honest`` (same shape, finite)."""
    if kind == "random":  # the honest norm, a random direction (a non-negative one, like ReLU outputs, has a cosine
        noise = torch.randn(honest.shape, generator=generator)  # of ~0.56 with the honest output: not "far")
        return noise * (honest.norm() / noise.norm().clamp_min(1e-12))
    if kind == "scaled_x10":
        return honest * 10.0
    if kind == "honest":
        return honest.clone()
    raise ValueError(f"unknown stage-0 attack {kind!r}; choose one of {STAGE0_ATTACKS}")


def poisoned_params(kind: str, honest: dict[str, torch.Tensor], generator: torch.Generator | None = None,
                    ) -> dict[str, torch.Tensor]:
    """What a poisoned averaging peer serves: NaN, the copy x1000, or a random copy of the same norms."""
    out = {}
    for name, tensor in honest.items():
        if not tensor.is_floating_point():
            out[name] = tensor.clone()
        elif kind == "nan":
            out[name] = torch.full_like(tensor, float("nan"))
        elif kind == "x1000":
            out[name] = tensor * 1000.0
        elif kind == "same_norm":
            noise = torch.randn(tensor.shape, generator=generator)
            out[name] = noise * (tensor.norm() / noise.norm().clamp_min(1e-12))
        else:
            raise ValueError(f"unknown poison {kind!r}; choose one of {POISONS}")
    return out


def wrong_targets(y: torch.Tensor, num_classes: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Labels that differ from ``y`` everywhere (a random other class)."""
    shift = torch.randint(1, num_classes, y.shape, generator=generator)
    return (y + shift) % num_classes


def mismatched_ids(ids: torch.Tensor, y_train: torch.Tensor, pool: Sequence[int],
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """For each id, another id from ``pool`` whose label differs: inputs of one sample, labels of another."""
    pool_t = torch.as_tensor(list(pool), dtype=torch.int64)
    out = []
    for i in ids.tolist():
        candidates = pool_t[y_train[pool_t] != y_train[i]]
        out.append(int(candidates[torch.randint(len(candidates), (1,), generator=generator)]))
    return torch.tensor(out, dtype=torch.int64)


# ----- one raw call


@dataclass(slots=True)
class Reply:
    ok: bool
    code: str = ""
    error: str = ""
    tensors: list[torch.Tensor] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def refused(self) -> bool:
        return not self.ok and self.code in REFUSAL_CODES


# ----- the peer


class HostilePeer:
    """One hostile participant of a run. Use as a context manager; ``close`` is idempotent."""

    def __init__(self, run: RunConfig, initial_peers: list[str], identity_path: Path, *,
                 process_group: int | None = None, heartbeat_s: float | None = None, work: bool = True):
        from swarm.dht.dht import DHTSettings, ensure_identity, make_validators, start_dht
        from swarm.dht.membership import Membership

        self.run = run
        ensure_identity(identity_path)
        validators = make_validators(run.run_id, run.swarm_names, identity_path)
        self.dht = start_dht(DHTSettings(initial_peers=initial_peers, host_maddrs=[LOOPBACK],
                                         identity_path=identity_path, process_group=process_group), validators)
        self.peer_id = str(self.dht.peer_id)
        self.membership = Membership(self.dht, run, validators[0].local_public_key)
        if work:  # a stranger pays for its identity as a volunteer does (``work=False``: one that does not)
            from swarm.integrity.identity_work import identity_work

            self.membership.work = identity_work(identity_path, self.peer_id, run.integrity.identity_bits)
        self.heartbeat_s = heartbeat_s or run.timeouts.heartbeat_s
        self._record: tuple[str, MemberRecord] | None = None
        self._started_at = time.time()
        self._ids = itertools.count()
        self._closed = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="hostile-loop", daemon=True)
        self._thread.start()
        self._beat = threading.Thread(target=self._heartbeat, name="hostile-beat", daemon=True)
        self._beat.start()
        self.servicers: list[Any] = []
        self.p2p = self.on_loop(self._fresh_p2p())
        from swarm.integrity.receipts import ReceiptKey

        self.receipt_key = ReceiptKey(self.peer_id)  # a driver signs its own stage 0's outputs (and anything it likes)

    async def _fresh_p2p(self) -> Any:
        from swarm.dht.dht import fresh_p2p

        return await fresh_p2p(self.dht)

    def __enter__(self) -> "HostilePeer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def on_loop(self, coro: Any, timeout_s: float = LOOP_TIMEOUT_S) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    # ----- membership
    def announce(self, swarm: str, state: str = "online", *, shard: int = -1, **fields: Any) -> bool:
        """Announce (and keep announcing every heartbeat) a signed record of ours in ``swarm``."""
        from volunteer import __version__

        fields.setdefault("version", __version__)
        record = MemberRecord(peer_id=self.peer_id, state=state,
                              started_at=float(self._started_at), updated_at=float(time.time()), shard=shard,
                              **fields)
        self._record = (swarm, record)
        return self.membership.announce(swarm, record)

    @property
    def announced(self) -> bool:
        return self._record is not None

    def withdraw(self) -> None:
        """Announce ``offline`` once and stop the heartbeat."""
        if self._record is not None:
            swarm, record = self._record
            self._record = None
            self.membership.announce(swarm, _fresh(record, state="offline"))

    def _heartbeat(self) -> None:
        while not self._closed.wait(self.heartbeat_s):
            current = self._record
            if current is not None:
                try:
                    self.membership.announce(current[0], _fresh(current[1]))
                except Exception as exc:  # a missed beat is retried next time; the test sees a stale record
                    print(f"hostile heartbeat failed: {exc}")

    def online(self, swarm: str) -> list[MemberRecord]:
        return [r for r in self.membership.read(swarm) if r.state == "online" and r.peer_id != self.peer_id]

    # ----- as a driver
    def mb(self) -> str:
        return f"hostile-{self.peer_id[-6:]}-{next(self._ids)}"

    def call(self, peer_id: str, swarm: str, op: str, tensors: list[torch.Tensor], meta: dict | None = None,
             timeout_s: float = CALL_TIMEOUT_S) -> Reply:
        return self.on_loop(self.acall(peer_id, swarm, op, tensors, meta, timeout_s), timeout_s + 30)

    async def acall(self, peer_id: str, swarm: str, op: str, tensors: list[torch.Tensor], meta: dict | None = None,
                    timeout_s: float = CALL_TIMEOUT_S) -> Reply:
        """One unary stage RPC with a request built here; every outcome is a Reply, nothing raises."""
        stub = stage_rpc.StageServicer.get_stub(self.p2p, PeerID.from_base58(peer_id),
                                                namespace=stage_rpc.stage_namespace(self.run.run_id, swarm))
        meta = {"mb": self.mb(), "rk": self.receipt_key.public, **(meta or {}), "op": op}
        request = runtime_pb2.ExpertRequest(tensors=encode_tensors(tensors), metadata=pack_metadata(meta))
        started = time.perf_counter()
        try:
            reply = await asyncio.wait_for(stub.rpc_call(request), timeout_s)
        except asyncio.TimeoutError:
            return Reply(False, "timeout", f"no reply in {timeout_s:g} s", seconds=time.perf_counter() - started)
        except Exception as exc:  # transport failures of every class are one outcome here
            return Reply(False, "transport", f"{exc.__class__.__name__}: {exc}", seconds=time.perf_counter() - started)
        elapsed = time.perf_counter() - started
        try:
            out_meta = unpack_metadata(reply.metadata)
            out = decode_tensors(list(reply.tensors), BIG_REPLY_BYTES)
        except WireError as exc:
            return Reply(False, "malformed_reply", str(exc), seconds=elapsed)
        return Reply(bool(out_meta.get("ok")), str(out_meta.get("code", "")), str(out_meta.get("error", "")),
                     out, out_meta, elapsed)

    def signed_as_stage0(self, mb: str, x: torch.Tensor, ids: torch.Tensor, op: str = "forward") -> dict:
        """The metadata that carries ``x`` as our own stage 0's output for sample ``ids``, signed by us (what an
        honest driver sends; a hostile one signs whatever it likes as its own stage 0)."""
        from swarm.integrity.receipts import ids_digest, tensor_digest
        from swarm.pipeline.transport.wire import serialize_once

        from swarm.pipeline.stage.stage0_replicas import ids_bytes

        ids_d = ids_digest(ids)
        receipt = self.receipt_key.sign(self.run.run_id, mb, op, 0, 0, ids_d, tensor_digest(serialize_once(x)), ids_d)
        return {"mb": mb, "rc": [receipt.to_wire()], "ids": ids_bytes(ids)}

    def forward_chain(self, x: torch.Tensor, ids: torch.Tensor, upto: int) -> tuple[str, torch.Tensor, list]:
        """Sign ``x`` as our stage 0's output for ``ids`` and run real forwards through stages 1..upto-1, relaying each
        receipt: (micro-batch id, the activations stage ``upto`` takes, their receipt's wire form)."""
        mb = self.mb()
        meta = self.signed_as_stage0(mb, x, ids)
        h = x
        for k in range(1, upto):
            swarm = f"layer{k}"
            reply = self.call(self.online(swarm)[0].peer_id, swarm, "forward", [h], meta)
            if not reply.ok:
                raise RuntimeError(f"forward at {swarm}: {reply.code}: {reply.error}")
            h, meta = reply.tensors[0], {"mb": mb, "rc": [reply.meta["rc"]]}
        return mb, h, meta["rc"]

    def train_made_up(self, kind: str, stage0: Any, x: torch.Tensor, ids: torch.Tensor, layer1: str,
                      last: str) -> Reply:
        """One micro-batch of a 3-stage run whose stage-0 output is made up (``made_up_activations`` of what the
        ``stage0`` module computes on ``x``), signed as ours: forward at ``layer1``, forward_backward at ``last``,
        backward at ``layer1``. The first reply that is not ok, or the final backward's."""
        with torch.no_grad():
            h0 = made_up_activations(kind, stage0(x))
        mb = self.mb()
        reply = self.call(layer1, "layer1", "forward", [h0], self.signed_as_stage0(mb, h0, ids))
        if not reply.ok:
            return reply
        h1, rc1 = reply.tensors[0], reply.meta["rc"]
        reply = self.call(last, "layer2", "forward_backward", [h1, ids], {"mb": mb, "rc": [rc1]})
        if not reply.ok:
            return reply
        return self.call(layer1, "layer1", "backward", [reply.tensors[0]],
                         {"mb": mb, "rc": [reply.meta["rc"]], "loss": reply.meta["loss"]})

    def flood(self, peer_id: str, swarm: str, x: torch.Tensor, count: int, timeout_s: float = 30.0) -> list[Reply]:
        """``count`` concurrent ``forward``s (each keeps activations at the server until it expires)."""
        async def all_at_once() -> list[Reply]:
            return list(await asyncio.gather(*(self.acall(peer_id, swarm, "forward", [x], None, timeout_s)
                                               for _ in range(count))))

        return self.on_loop(all_at_once(), timeout_s + 60)

    # ----- as a server
    def serve_stage(self, swarm: str, behaviour: str) -> "HostileStage":
        """Register stage handlers with ``behaviour`` under the real handler names of ``swarm``."""
        servicer = HostileStage(behaviour)
        self.on_loop(servicer.add_p2p_handlers(self.p2p, namespace=stage_rpc.stage_namespace(self.run.run_id, swarm)))
        self.servicers.append(servicer)
        return servicer

    def serve_params(self, swarm: str, params: dict[str, torch.Tensor], clock: float,
                     param_version: int = 1) -> "PoisonedParams":
        servicer = PoisonedParams(self.run.run_id, swarm, params, clock, param_version)
        self.on_loop(servicer.add_p2p_handlers(self.p2p, namespace=stage_rpc.stage_namespace(self.run.run_id, swarm)))
        self.servicers.append(servicer)
        return servicer

    def serve_honest_stage(self, swarm: str, params: dict[str, torch.Tensor]) -> Any:
        """A real StageServicer over a real worker (a poisoned averaging peer still does honest stage work)."""
        from concurrent.futures import ThreadPoolExecutor

        from swarm.pipeline.stage.worker import StageWorker

        worker = StageWorker(self.run, int(swarm.removeprefix("layer")))
        worker.module.load_state_dict(params)
        servicer = stage_rpc.make_servicer(worker, ThreadPoolExecutor(max_workers=1), codec="float32",
                                           max_bytes=int(self.run.training.max_payload_mb * 2**20),
                                           is_accepting=lambda: True, traffic=stage_rpc.Traffic())
        self.on_loop(servicer.add_p2p_handlers(self.p2p, namespace=stage_rpc.stage_namespace(self.run.run_id, swarm)))
        self.servicers.append(servicer)
        return servicer

    # ----- teardown
    def close(self) -> None:
        from swarm.dht.dht import shutdown_dht

        if self._closed.is_set():
            return
        try:
            self.withdraw()
        except Exception as exc:
            print(f"hostile withdraw failed: {exc}")
        self._closed.set()
        for servicer in self.servicers:
            if isinstance(servicer, HostileStage):
                self._loop.call_soon_threadsafe(servicer.release.set)
            elif hasattr(servicer, "end_sessions"):  # a real stage's sessions end on the loop, as a peer's stop does
                try:
                    self.on_loop(servicer.end_sessions(5), 10)
                except Exception as exc:
                    print(f"ending a hostile's stage sessions failed: {exc}")
        try:
            self.on_loop(self.p2p.shutdown(), 10)
        except Exception as exc:
            print(f"hostile p2p shutdown failed: {exc}")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        shutdown_dht(self.dht)


def _fresh(record: MemberRecord, **changes: Any) -> MemberRecord:
    import dataclasses

    return dataclasses.replace(record, updated_at=float(time.time()), **changes)


# ----- hostile handlers (hivemind names a handler by its class name: these must be called StageServicer and
# ParamsServicer to answer the real RPCs)


class StageServicer(ServicerBase):
    """Answers every stage op with ``behaviour`` instead of doing the work."""

    def __init__(self, behaviour: str = "black_hole"):
        if behaviour not in SERVER_BEHAVIOURS:
            raise ValueError(f"unknown server behaviour {behaviour!r}; choose one of {SERVER_BEHAVIOURS}")
        self.behaviour = behaviour
        self.requests = 0
        self.release = asyncio.Event()

    async def rpc_call(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return await self._reply(list(request.tensors), request.metadata)

    async def rpc_call_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                              context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        serialized, metadata = await join_stream(requests, BIG_REPLY_BYTES)
        yield await self._reply(serialized, metadata)

    async def _reply(self, serialized: list[Any], metadata: bytes) -> runtime_pb2.ExpertResponse:
        self.requests += 1
        if self.behaviour == "black_hole":
            await self.release.wait()  # accepted, never answered (until the harness closes)
            return runtime_pb2.ExpertResponse()
        tensors = decode_tensors(serialized, BIG_REPLY_BYTES)
        like = tensors[0].float() if tensors else torch.zeros(1, 1)
        meta: dict[str, Any] = {"ok": True, "loss": 0.01, "loss_sum": 0.0, "correct": 0, "count": int(like.shape[0])}
        out: list[torch.Tensor] = [torch.zeros_like(like)]
        if self.behaviour == "no_tensor":
            out = []
        elif self.behaviour == "wrong_shape":
            out = [torch.zeros(like.shape[0], like.shape[-1] + 3)]
        elif self.behaviour == "nan":
            out = [torch.full_like(like, float("nan"))]
        elif self.behaviour == "huge":
            out = [torch.full_like(like, FLOAT32_MAX)]
        elif self.behaviour == "garbage_metadata":
            meta = {"ok": True, "loss": {"not": "a number"}, "loss_sum": [1, 2], "correct": "many", "count": -1}
        return runtime_pb2.ExpertResponse(tensors=encode_tensors(out), metadata=pack_metadata(meta))


HostileStage = StageServicer


class ParamsServicer(ServicerBase):
    """Serves a fixed (poisoned) copy to every pull, claiming ``clock`` samples trained into it."""

    def __init__(self, run_id: str = "", swarm: str = "", params: dict[str, torch.Tensor] | None = None,
                 clock: float = 0.0, param_version: int = 1):
        self.run_id, self.swarm = run_id, swarm
        self.params = params or {}
        self.clock = float(clock)
        self.param_version = int(param_version)
        self.served = 0

    async def rpc_fetch(self, request: runtime_pb2.ExpertRequest,
                        context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        meta = pack_metadata({"ok": True, "names": list(self.params), "optimizer_names": [], "clock": self.clock,
                              "loss": 0.01, "param_version": self.param_version})
        serialized = encode_tensors(list(self.params.values()), "float32")
        self.served += 1
        for message in split_message(serialized, meta, runtime_pb2.ExpertResponse):
            yield message


PoisonedParams = ParamsServicer
