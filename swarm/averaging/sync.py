"""Newcomers: download the layer (weights, optimizer state, clock, loss EMA) before going online.

The donor order spreads newcomers over the swarm: a random one of the ``DONOR_TOP_K`` most trained
online peers first, then the others by clock (``rules.donor_order``). Each download is checked like
any pull (``checks``), the optimizer state too, and travels as float32 whatever
``averaging.wire_dtype`` says (one download, so the newcomer's copy is the donor's exactly). A donor
that fails or refuses is skipped, one that serves bad tensors is also banned. The whole sync is
bounded by ``averaging.sync_timeout_s``. With no donor (a new swarm) or none that answers, the peer
keeps the seeded initial weights, which every first peer of a swarm shares.

Witnesses (the decision): the checks above only bound a download's shapes, finiteness and norm, and a
newcomer has no trained copy of its own to compare with, so a stranger who ranks first among the donors
could hand it any finite layer of a plausible norm (a newcomer and a volunteer moving to another swarm
both sync here). So the weights of up to ``WITNESSES`` other online peers are fetched too (weights only,
no optimizer state) and compared with the download: honest copies of one swarm stay within
``averaging.influence.max_distance_ratio`` of each other's norm (a pull farther than that is an outlier,
the same bound). One witness that agrees confirms the download. Two that agree with each other and not
with it reject it and ban its donor, and the next donor is tried. Without a witness (the only other peer
of the swarm, or none answered) or with an undecided vote (1 against 1) the download is kept and the
event says so (a warning when a witness disagreed): averaging then pulls the copy toward the swarm under
the usual bounds. Sybils that hold the donor and both witnesses pass: this raises the cost of a lie
from one peer to three.
"""

from __future__ import annotations

import time

from swarm.averaging.agent import SwarmAveraging
from swarm.averaging.checks import ParamsRejected, check_optimizer, check_params, total_norm
from swarm.averaging.influence import distance
from swarm.averaging.rules import donor_order
from swarm.dht.records import MemberRecord
from swarm.pipeline.stage.worker import WorkerState

SYNC_WIRE_DTYPE = "float32"  # a newcomer starts from an exact copy; averaging.wire_dtype is for pulls
SYNC_TRIES_PER_DONOR = 3
WITNESSES = 2  # other peers' copies a download is compared with, at most
NOT_CONFIRMED = "not confirmed"


async def sync_layer(averaging: SwarmAveraging, records: list[MemberRecord]) -> str | None:
    """Load the layer from a donor of ``records``; returns the donor's peer id, or None (seeded init)."""
    swarm, cfg = averaging.swarm, averaging.cfg
    donors = [p for p in donor_order(records, averaging.me, averaging._choice_rng)
              if p not in averaging.excluded(time.monotonic())]
    if not donors:
        averaging.notify("info", "synced", f"no online peer in {swarm} yet: starting from the seeded initial weights")
        return None
    deadline = time.monotonic() + cfg.sync_timeout_s
    for peer in donors:
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            break
        fetched = None
        for _ in range(SYNC_TRIES_PER_DONOR):  # a cut stream is a network fault: ask the same donor again
            fetched = await averaging._fetch(peer, max(0.1, deadline - time.monotonic()), with_optimizer=True,
                                             wire_dtype=SYNC_WIRE_DTYPE)
            if fetched is not None or time.monotonic() >= deadline or peer in averaging.excluded(time.monotonic()):
                break
        if fetched is None:
            continue
        state, meta = fetched
        try:
            await averaging.loop.run_in_executor(averaging.executor, _check, averaging, state, meta)
        except ParamsRejected as exc:
            averaging._reject(peer, str(exc))
            continue
        verdict, said = await _witnessed(averaging, peer, state, [d for d in donors if d != peer], deadline)
        if verdict is False:
            averaging._reject(peer, said)
            continue
        try:
            await averaging.loop.run_in_executor(averaging.executor, _load, averaging, state, meta)
        except ParamsRejected as exc:
            averaging._reject(peer, str(exc))
            continue
        loss = f"{meta['loss']:.3f}" if meta["loss"] is not None else "not measured yet"
        undecided = verdict is None and said.startswith(NOT_CONFIRMED)  # a disagreement seen: worth a warning
        averaging.notify("warning" if undecided else "info", "synced",
                         f"synced {swarm} from {peer[-8:]}: clock {meta['clock']:.0f}, loss {loss} "
                         f"({meta['bytes'] / 2**20:.1f} MB in {meta['seconds']:.1f} s); {said}")
        return peer
    averaging.notify("warning", "synced",
                     f"could not download {swarm} from any of {len(donors)} peer(s) in "
                     f"{cfg.sync_timeout_s:.0f} s: starting from the seeded initial weights")
    return None


async def _witnessed(averaging: SwarmAveraging, donor: str, state: dict, others: list[str],
                     deadline: float) -> tuple[bool | None, str]:
    """(True: a witness's copy agrees; False: two witnesses agree with each other and not with it; None:
    no verdict) and what to say of it. See the module doc, "Witnesses"."""
    ratio = averaging.cfg.influence.max_distance_ratio
    witnesses: list[tuple[str, dict]] = []
    for other in others:
        remaining_s = deadline - time.monotonic()
        if len(witnesses) >= WITNESSES or remaining_s <= 0:
            break
        if other in averaging.excluded(time.monotonic()):  # e.g. a donor rejected a moment ago
            continue
        fetched = await averaging._fetch(other, remaining_s, wire_dtype=SYNC_WIRE_DTYPE)
        if fetched is None:
            continue
        try:
            await averaging.loop.run_in_executor(averaging.executor, _check, averaging, fetched[0], None)
        except ParamsRejected as exc:
            averaging._reject(other, str(exc))
            continue
        apart = relative_distance(state, fetched[0])
        if apart <= ratio:
            return True, f"checked against {other[-8:]}'s copy ({apart:.2f} of its norm apart)"
        witnesses.append((other, fetched[0]))
    if len(witnesses) >= 2 and relative_distance(witnesses[0][1], witnesses[1][1]) <= ratio:
        names = " and ".join(w[-8:] for w, _ in witnesses[:2])
        return False, (f"its copy is over {ratio:g} of its norm from those of {names}, which agree with each other "
                       "(averaging.influence.max_distance_ratio)")
    if not witnesses:
        return None, "not checked against another copy (no other peer of the swarm answered)"
    return None, (f"{NOT_CONFIRMED}: {witnesses[0][0][-8:]}'s copy is over {ratio:g} of its norm away and no second "
                  "copy decided; averaging pulls it toward the swarm")


def relative_distance(a: dict, b: dict) -> float:
    """``||a - b||`` over the larger of the two norms (0 for two empty copies)."""
    scale = max(total_norm(a), total_norm(b))
    return distance(a, b) / scale if scale > 0 else 0.0


def _check(averaging: SwarmAveraging, state: dict, meta: dict | None) -> None:
    """The download's (or a witness's) checks, without loading it."""
    worker = averaging.worker
    with worker.lock:
        check_params(worker.module.state_dict(), state, averaging.cfg.max_norm_ratio)
        if meta is not None:
            check_optimizer({name: p.shape for name, p in worker.module.named_parameters()},
                            meta.get("optimizer_state") or {})


def _load(averaging: SwarmAveraging, state: dict, meta: dict) -> None:
    worker = averaging.worker
    with worker.lock:
        check_params(worker.module.state_dict(), state, averaging.cfg.max_norm_ratio)
        optimizer = meta.get("optimizer_state") or {}
        check_optimizer({name: p.shape for name, p in worker.module.named_parameters()}, optimizer)
        worker.restore(WorkerState(params=state, optimizer=optimizer, clock=meta["clock"], loss_ema=meta["loss"],
                                   param_version=meta["param_version"]))
