"""The attacks of benchmarks/adversary.py: each starts on a hostile peer (tests/hostile.py) and runs until stopped.

An attack is a role and a loop: a *driver* attack announces a layer0 record and sends raw stage RPCs
as fast as its ``concurrency`` allows; a *server* attack announces an online record in a swarm and
answers with a misbehaviour; a *poison* attack serves honest stage work but poisoned copies to
averaging pulls. ``stop()`` withdraws the record and returns what the attacker saw (reply codes,
first refusal).
"""

from __future__ import annotations

import asyncio
import collections
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from copies import CopyOracle  # noqa: E402
from hostile import (  # noqa: E402
    HostilePeer, Reply, crafted_gradient, mismatched_ids, poisoned_params, wrong_targets,
)

BATCH = 32
STAGE0_LANES = 4  # made-up stage-0 micro-batches in flight (each one forward, forward_backward, backward)
CONCURRENCY = 8  # requests in flight: ~100 requests/s on the benchmark machine, as in issue 14
FLOOD_SIZE = 500
ORACLE_REFRESH_S = 2.0
KNOWN_GRACE_S = 3.0  # unknown_driver this soon after announcing is the record's propagation, not a refusal
POISON_CLOCK_FACTOR = 10.0  # the poisoner claims this many times the honest clock, so clock interpolation favours it


@dataclass(slots=True, frozen=True)
class Attack:
    name: str
    role: str  # driver | server | signed_server | poison | stage0 | none
    kind: str  # gradient kind, label mode, server behaviour, poison, flood
    swarm: str = "layer1"
    per_swarm: int = 1
    optimizer: str = "adam"
    busy: int = 0
    identities: int = 1  # signed servers: this many keys, each its own stage peer (each pays its identity work)
    lone: bool = False  # the attacked swarm's honest peers leave as the attack starts: the liar is its only copy

    @property
    def shape(self) -> tuple:
        return (self.per_swarm, self.optimizer, self.busy)

    @property
    def baseline(self) -> tuple:
        return (self.per_swarm, self.optimizer, 0)


def _attacks() -> dict[str, Attack]:
    import os

    items = [Attack(k, "driver", k) for k in ("huge_1e30", "huge_3e38", "ascent", "scaled_x100", "random")]
    items += [
        Attack("wrong_labels", "driver", "wrong_labels", swarm="layer2"),
        Attack("foreign_ids", "driver", "foreign_ids", swarm="layer2"),
        Attack("flood", "driver", "flood"),
        Attack("black_hole", "server", "black_hole", per_swarm=2),
        *(Attack(f"malformed_{b}", "server", b, swarm="layer2") for b in ("no_tensor", "wrong_shape", "nan",
                                                                            "garbage_metadata")),
        Attack("last_stage_huge_gradient", "server", "huge", swarm="layer2"),
        # a last stage that signs its replies (its receipts hold) and lies in one way (tests/hostile_stage.py)
        Attack("signed_last_stage_huge_gradient", "signed_server", "huge_gradient", swarm="layer2"),
        Attack("signed_last_stage_lying_eval", "signed_server", "lying_eval", swarm="layer2"),
        # plausible but wrong gradients, signed (gradient spot checks: a third peer of the swarm is needed to tell
        # which of two disagreeing copies lies, hence 2 honest peers per swarm)
        Attack("signed_last_stage_ascent_gradient", "signed_server", "ascent_gradient", swarm="layer2", per_swarm=2),
        Attack("signed_middle_ascent_gradient", "signed_server", "ascent_gradient", swarm="layer1", per_swarm=2),
        # the same with many keys: four liars in the last swarm next to its two honest peers
        Attack("sybil_last_stage_ascent_gradient", "signed_server", "ascent_gradient", swarm="layer2", per_swarm=2,
               identities=4),
        # where votes cannot settle it (issue 40): one liar beside the one honest peer of its swarm (a swarm of two),
        # and two liars' keys beside it, at the last and at a middle stage: settled by the referee's recomputation
        Attack("pair_last_ascent", "signed_server", "ascent_gradient", swarm="layer2"),
        Attack("pair_middle_ascent", "signed_server", "ascent_gradient", swarm="layer1"),
        Attack("two_keys_last_ascent", "signed_server", "ascent_gradient", swarm="layer2", identities=2),
        Attack("two_keys_middle_ascent", "signed_server", "ascent_gradient", swarm="layer1", identities=2),
        # ... and six keys beside that one honest peer (a stranger with many keys: each pays its identity work)
        Attack("six_keys_middle_ascent", "signed_server", "ascent_gradient", swarm="layer1", identities=6),
        # weights trained to harm, computed from honestly: every recomputation holds; the loss through it does not
        Attack("pair_middle_harm", "signed_server", "trained_to_harm", swarm="layer1"),
        Attack("pair_last_harm", "signed_server", "trained_to_harm", swarm="layer2"),
        Attack("two_keys_middle_harm", "signed_server", "trained_to_harm", swarm="layer1", identities=2),
        Attack("six_keys_middle_harm", "signed_server", "trained_to_harm", swarm="layer1", identities=6),
        Attack("six_keys_last_harm", "signed_server", "trained_to_harm", swarm="layer2", identities=6),
        # the same beside an honest copy that steps with SGD and momentum (the run's optimizer: everyone's)
        Attack("pair_last_harm_sgd", "signed_server", "trained_to_harm", swarm="layer2", optimizer="sgd_momentum"),
        # ... and one that keeps its loss under the floor at which a last stage is held off (0.8 of the chance loss)
        Attack("pair_last_capped_harm", "signed_server", "capped_harm", swarm="layer2"),
        # ... and a last stage that hides it behind the loss it signs (a quarter of the truth): its own route losses
        # look better than the honest copy's; the referee recomputes the loss from its committed weights
        Attack("pair_last_hidden_harm", "signed_server", "hidden_harm", swarm="layer2"),
        Attack("two_keys_last_hidden_harm", "signed_server", "hidden_harm", swarm="layer2", identities=2),
        # ... and a copy trained to harm that is its swarm's only one (its honest peer left): nothing to compare it
        # with; the referee's audits of its updates (swarm/integrity/audit.py) find them climbing the loss
        Attack("lone_last_harm", "signed_server", "trained_to_harm", swarm="layer2", lone=True),
        Attack("lone_middle_harm", "signed_server", "trained_to_harm", swarm="layer1", lone=True),
        # ... and one that shows a referee every other version only: no audit of an update gets its next version
        Attack("lone_last_withholding_harm", "signed_server", "withholding_harm", swarm="layer2", lone=True),
        Attack("lone_middle_withholding_harm", "signed_server", "withholding_harm", swarm="layer1", lone=True),
        # ... that keeps no version for an audit, or shows none at all: held off as a copy nothing can audit
        Attack("lone_last_unpinned_harm", "signed_server", "unpinned_harm", swarm="layer2", lone=True),
        Attack("lone_last_hiding_harm", "signed_server", "hiding_harm", swarm="layer2", lone=True),
        Attack("lone_middle_hiding_harm", "signed_server", "hiding_harm", swarm="layer1", lone=True),
        *(Attack(f"poison_{p}", "poison", p, per_swarm=2) for p in ("nan", "x1000", "same_norm")),
        # a registered driver that signs made-up stage-0 outputs as its own (tests/hostile.py made_up_activations):
        # two honest drivers are there to recompute them (stage-0 spot checks, swarm/pipeline/control/stage0_checks.py)
        *(Attack(f"made_up_stage0_{k}", "stage0", k, per_swarm=2) for k in ("random", "scaled_x10")),
        Attack("sgd_momentum_oversubscribed", "none", "busy", per_swarm=2, optimizer="sgd_momentum",
               busy=3 * (os.cpu_count() or 2)),
    ]
    return {a.name: a for a in items}


ATTACKS = _attacks()


class Handle:
    """A running attack: ``stop()`` ends it and returns the attacker's view."""

    def __init__(self, hostile: HostilePeer, attack: Attack):
        self.hostile = hostile
        self.attack = attack
        self.codes: collections.Counter = collections.Counter()
        self.started = time.monotonic()
        self.announced_at = self.started
        self.first_refusal_s: float | None = None
        self.stopping = False
        self.task: Any = None
        self.servicers: list[Any] = []
        self.extras: list[HostilePeer] = []  # the attacker's other identities (Attack.identities)

    @property
    def peer_ids(self) -> list[str]:
        return [self.hostile.peer_id, *(extra.peer_id for extra in self.extras)]

    def note(self, reply: Reply) -> None:
        self.codes[reply.code or "ok"] += 1
        grace = reply.code == "unknown_driver" and time.monotonic() - self.announced_at < KNOWN_GRACE_S
        if reply.refused and not grace and self.first_refusal_s is None:
            self.first_refusal_s = time.monotonic() - self.started

    def stop(self) -> dict[str, Any]:
        self.stopping = True
        if self.task is not None:
            try:
                self.task.result(60)
            except Exception as exc:  # the attack loop's own failure is part of the result
                self.codes[f"attacker_error:{exc.__class__.__name__}"] += 1
        served = sum(getattr(s, "requests", getattr(s, "served", 0)) for s in self.servicers)
        # a stage peer that lies: drivers hold it off silently (routing), so what shows it is the training ops it
        # stops being sent; seconds after the attack's start of each one (signed servers only)
        training = sorted(t - self.started for s in self.servicers for t in getattr(s, "training_at", []))
        self.hostile.withdraw()
        for servicer in self.servicers:
            release = getattr(servicer, "release", None)
            if release is not None:
                self.hostile._loop.call_soon_threadsafe(release.set)
        for extra in self.extras:
            extra.close()
        return {"replies": dict(self.codes), "first_refusal_s": self.first_refusal_s,
                "requests_served_by_attacker": served, "seconds": time.monotonic() - self.started,
                **({"training_ops_sent_to_attacker": len(training),
                    "training_ops_after_10s": sum(1 for t in training if t > 10.0),
                    "last_training_op_s": round(training[-1], 2) if training else None}
                   if any(hasattr(s, "training_at") for s in self.servicers) else {})}


def start_attack(attack: Attack, hostile: HostilePeer, labels: str) -> Handle:
    handle = Handle(hostile, attack)
    if attack.role == "none":
        return handle
    if attack.role == "server":
        handle.servicers.append(hostile.serve_stage(attack.swarm, attack.kind))
        hostile.announce(attack.swarm)
        return handle
    if attack.role == "poison":
        _start_poison(handle)
        return handle
    if attack.role == "signed_server":
        _start_signed_server(handle)
        return handle
    if attack.role == "stage0":
        _start_stage0(handle)
        return handle
    honest_driver = hostile.online("layer0")[0]
    hostile.announce("layer0", shard=(honest_driver.shard + 1) % hostile.run.data.shards)
    handle.announced_at = time.monotonic()
    loop_body = {"flood": _flood}.get(attack.kind, _driver_loop)
    handle.task = asyncio.run_coroutine_threadsafe(loop_body(handle, labels, honest_driver.shard), hostile._loop)
    return handle


def _start_stage0(handle: Handle) -> None:
    """``STAGE0_LANES`` lanes of micro-batches whose stage-0 output is made up from the honest copy's (pulled once),
    signed as ours, each to a random online layer1 peer; from our own shard (the last stage checks ids)."""
    import concurrent.futures
    import random

    from swarm.run.data import make_shards

    hostile, kind = handle.hostile, handle.attack.kind
    honest_driver = hostile.online("layer0")[0]
    own_shard = (honest_driver.shard + 1) % hostile.run.data.shards
    oracle = CopyOracle(hostile)
    oracle.pull({f"layer{k}": hostile.online(f"layer{k}")[0].peer_id for k in range(len(oracle.stages))})
    shards = make_shards(oracle.dataset.y_train, hostile.run.data, oracle.dataset.num_classes)
    own = shards[own_shard]
    hostile.announce("layer0", shard=own_shard)
    handle.announced_at = time.monotonic()
    last = f"layer{len(oracle.stages) - 1}"

    def lane(seed: int) -> None:
        rng = random.Random(seed)
        while not handle.stopping:
            ids = torch.as_tensor([int(own[rng.randrange(len(own))]) for _ in range(BATCH)], dtype=torch.int64)
            layer1, tail = hostile.online("layer1"), hostile.online(last)
            if not layer1 or not tail:
                time.sleep(0.2)
                continue
            reply = hostile.train_made_up(kind, oracle.stages[0], oracle.dataset.x_train[ids], ids,
                                          rng.choice(layer1).peer_id, rng.choice(tail).peer_id)
            handle.note(reply)
            if reply.refused:
                time.sleep(min(2.0, float(reply.meta.get("retry_after_s", 0.1) or 0.1)))

    def lanes() -> None:
        with concurrent.futures.ThreadPoolExecutor(STAGE0_LANES) as pool:
            for future in [pool.submit(lane, i) for i in range(STAGE0_LANES)]:
                future.result()

    handle.task = concurrent.futures.ThreadPoolExecutor(1).submit(lanes)


def _start_signed_server(handle: Handle) -> None:
    """A stage of the attacked swarm that computes from the honest copy's weights and signs what it returns."""
    from hostile_stage import serve_signed_stage
    from swarm.averaging.params_rpc import fetch_params

    hostile, swarm = handle.hostile, handle.attack.swarm
    donor = hostile.online(swarm)[0]
    params, _ = hostile.on_loop(fetch_params(hostile.p2p, donor.peer_id, hostile.run, swarm, timeout_s=20))
    handle.servicers.append(serve_signed_stage(hostile, swarm, params, handle.attack.kind))
    hostile.announce(swarm)
    if handle.attack.identities > 1:
        folder = Path(tempfile.mkdtemp(prefix="volunteer-sybil-"))
        maddrs = [str(m) for m in hostile.dht.get_visible_maddrs()]
        for i in range(handle.attack.identities - 1):
            extra = HostilePeer(hostile.run, maddrs, folder / f"sybil-{i}.key", heartbeat_s=hostile.heartbeat_s)
            handle.extras.append(extra)
            handle.servicers.append(serve_signed_stage(extra, swarm, params, handle.attack.kind))
            extra.announce(swarm)


def _start_poison(handle: Handle) -> None:
    from swarm.averaging.params_rpc import fetch_params

    hostile, swarm = handle.hostile, handle.attack.swarm
    donor = hostile.online(swarm)[0]
    params, meta = hostile.on_loop(fetch_params(hostile.p2p, donor.peer_id, hostile.run, swarm, timeout_s=20))
    handle.servicers.append(hostile.serve_honest_stage(swarm, params))
    poisoned = poisoned_params(handle.attack.kind, params, torch.Generator().manual_seed(0))
    clock = POISON_CLOCK_FACTOR * max(meta["clock"], 1.0)
    handle.servicers.append(hostile.serve_params(swarm, poisoned, clock, meta["param_version"] + 1))
    hostile.announce(swarm, clock=int(clock), param_version=meta["param_version"] + 1)


async def _driver_loop(handle: Handle, labels: str, honest_shard: int) -> None:
    """Gradient and label attacks: ``CONCURRENCY`` requests at a time until stopped."""
    from swarm.run.data import make_shards

    hostile, attack = handle.hostile, handle.attack
    oracle = CopyOracle(hostile)
    shards = make_shards(oracle.dataset.y_train, hostile.run.data, oracle.dataset.num_classes)
    own = shards[(honest_shard + 1) % len(shards)]
    generator = torch.Generator().manual_seed(1)
    refreshed = 0.0
    last = hostile.run.model.stages - 1
    peers: dict[str, str] = {}
    while not handle.stopping:
        if time.monotonic() - refreshed > ORACLE_REFRESH_S:
            peers = {f"layer{k}": hostile.online(f"layer{k}")[0].peer_id for k in range(last + 1)}
            await asyncio.to_thread(oracle.pull, peers)
            refreshed = time.monotonic()
        calls = []
        for _ in range(CONCURRENCY):
            request = _driver_request(handle, oracle, shards, own, honest_shard, labels, generator, peers)
            if request is None:  # our pulled copies are broken (the attack worked): nothing sane to send
                handle.codes["skipped_nonfinite"] += 1
                await asyncio.sleep(0.1)
                continue
            calls.append(hostile.acall(*request))
        for reply in await asyncio.gather(*calls):
            handle.note(reply)


def _driver_request(handle: Handle, oracle: CopyOracle, shards: list, own: Any, honest_shard: int, labels: str,
                    generator: torch.Generator, peers: dict[str, str]) -> tuple | None:
    """(peer, swarm, op, tensors, meta) of one attack request, or None when it would not be finite."""
    attack = handle.attack
    last = len(oracle.stages) - 1
    pool = shards[honest_shard] if attack.kind == "foreign_ids" else own
    ids = torch.as_tensor(pool[torch.randint(len(pool), (BATCH,), generator=generator).numpy()], dtype=torch.int64)
    x, y = oracle.dataset.x_train[ids], oracle.dataset.y_train[ids]
    if attack.kind in ("wrong_labels", "foreign_ids"):
        h = oracle.stage_input(last, x)
        if labels == "ids":
            label = ids if attack.kind == "foreign_ids" else mismatched_ids(ids, oracle.dataset.y_train, own,
                                                                            generator)
        else:  # targets on the wire: wrong ones, or (foreign samples) the true ones, which are harmless
            label = y if attack.kind == "foreign_ids" else wrong_targets(y, oracle.dataset.num_classes, generator)
        return (peers[f"layer{last}"], f"layer{last}", "forward_backward", [h, label]) if _finite(h) else None
    h, grad, loss = oracle.honest_gradient(1, x, y)
    crafted = crafted_gradient(attack.kind, grad, generator)
    if not (_finite(h) and _finite(crafted)):
        return None
    return peers["layer1"], "layer1", "backward", [crafted, h], {"loss": loss}


def _finite(tensor: torch.Tensor) -> bool:
    return bool(torch.isfinite(tensor).all())


async def _flood(handle: Handle, labels: str, honest_shard: int) -> None:
    """``FLOOD_SIZE`` concurrent forwards at layer1, again as soon as the last wave is answered."""
    hostile = handle.hostile
    x = torch.randn(BATCH, hostile.run.model.hidden_dim)
    while not handle.stopping:
        target = hostile.online("layer1")[0].peer_id
        replies = await asyncio.gather(*(hostile.acall(target, "layer1", "forward", [x], None, 30.0)
                                         for _ in range(FLOOD_SIZE)))
        for reply in replies:
            handle.note(reply)
