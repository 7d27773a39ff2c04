"""Which micro-batches a stage has applied an update for: one update per micro-batch per copy, whatever arrives twice.

A micro-batch can reach the same peer twice: a driver resends a hop whose answer it never got (a relayed
``forward_backward`` that timed out, a broken push that it resumes by relay while the pushed copy is still on its way
or still queued at the gate). Without this record the second copy applies its update again (one micro-batch, two
steps): the suite's clean-stop test saw a last stage's sample clock one micro-batch past its driver's count.

A stage claims ``(driver, micro-batch id)`` before an update op runs and keeps the claim once the update is applied;
a second update op for the same pair is answered with the reply the first got when it is the same op on the same
signed input (``Replies``, kept briefly), else refused with ``duplicate`` (nothing applied, nobody struck: a resend
after a cut stream is not an attack), and the driver counts that micro-batch lost rather than trying another peer.
A claim whose op applied nothing (refused, healing, need_input) is released, so the driver's honest retry runs.

Bounded: per driver the last ``PER_DRIVER`` claims within ``TTL_S``, at most ``DRIVERS`` drivers and ``TOTAL``
claims in all (~200 bytes each: ~6 MiB; the longest idle driver's oldest claims go first). What eviction costs is
one resend applied twice, the state before this ledger. A driver's id for a micro-batch is unique per driver start (swarm/pipeline/control/driver.py), so a restarted
driver's ids never meet its old claims.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DUPLICATE_CODE = "duplicate"
PER_DRIVER = 4096  # ~ minutes of a fast driver's micro-batches; a flood only evicts its own driver's claims
TTL_S = 600.0  # longer than any hop's time budget: a resend arrives well within it
DRIVERS = 1024
TOTAL = 32768


class Ran:
    """Whether the claimed op applied its update (set on the compute thread's return)."""

    applied: bool = False


class AppliedLedger:
    def __init__(self, per_driver: int = PER_DRIVER, ttl_s: float = TTL_S, drivers: int = DRIVERS,
                 total: int = TOTAL):
        self.per_driver = per_driver
        self.ttl_s = ttl_s
        self.drivers = drivers
        self.total = total
        self._count = 0
        self._claims: OrderedDict[str, OrderedDict[str, float]] = OrderedDict()
        self.refused = 0  # duplicates refused

    def claim(self, driver: str, mb: str, now: float | None = None) -> bool:
        """True when ``mb`` of ``driver`` may apply its update here (claimed now); False for a duplicate."""
        now = time.monotonic() if now is None else now
        claims = self._claims.get(driver)
        if claims is None:
            claims = self._claims[driver] = OrderedDict()
            while len(self._claims) > self.drivers:
                self._count -= len(self._claims.popitem(last=False)[1])
        else:
            self._claims.move_to_end(driver)
        while claims and next(iter(claims.values())) < now - self.ttl_s:
            claims.popitem(last=False)
            self._count -= 1
        if mb in claims:
            self.refused += 1
            return False
        claims[mb] = now
        self._count += 1
        if len(claims) > self.per_driver:
            claims.popitem(last=False)
            self._count -= 1
        while self._count > self.total:  # the longest idle driver's oldest claim (ours, when we are the only one)
            oldest = next(iter(self._claims.values()))
            oldest.popitem(last=False)
            self._count -= 1
            if not oldest:
                del self._claims[next(iter(self._claims))]
        return True

    def release(self, driver: str, mb: str) -> None:
        """The claimed op applied nothing: the micro-batch may come again."""
        claims = self._claims.get(driver)
        if claims is not None and claims.pop(mb, None) is not None:
            self._count -= 1

    def __len__(self) -> int:
        return self._count


# A resend of an update op this stage ran (its driver timed out on it, or resumed a broken push by relay) is answered
# with the reply the first copy got, not refused: two micro-batches of a start-up were lost as `duplicate` at a
# middle stage that had only been slow (session 17). Kept briefly, few, and bounded in bytes (issue 42's footprint).
REPLY_TTL_S = 30.0
REPLY_PER_DRIVER = 8
REPLY_BYTES = 16 * 2**20
REPLY_WAIT_S = 30.0  # a resend that arrives while the first copy still runs waits this long for its reply


@dataclass(slots=True)
class _Reply:
    created: float
    op: str
    input: Any  # the first receipt of its request (what the op computes on)
    sender: str
    result: asyncio.Future  # (tensors, reply metadata), or None: applied nothing, failed, or dropped
    size: int = 0


class Replies:
    """The replies of update ops lately run here, by (driver, micro-batch), with the first receipt their requests
    carried (``rc``: what the op computes on): a resend is answered as the first was (the same tensors and signed
    receipt) only when it carries the same, i.e. the same signed input. Used on the RPC loop only."""

    def __init__(self, ttl_s: float = REPLY_TTL_S, per_driver: int = REPLY_PER_DRIVER, max_bytes: int = REPLY_BYTES):
        self.ttl_s, self.per_driver, self.max_bytes = ttl_s, per_driver, max_bytes
        self._items: OrderedDict[tuple[str, str], _Reply] = OrderedDict()
        self._bytes = 0
        self.replayed = 0

    def begin(self, driver: str, mb: str, op: str, rc: Any, sender: str) -> None:
        now = time.monotonic()
        self._evict(now)
        self._drop((driver, mb))
        self._items[(driver, mb)] = _Reply(now, op, _first(rc), sender, asyncio.get_running_loop().create_future())
        mine = [key for key in self._items if key[0] == driver]
        for key in mine[: max(0, len(mine) - self.per_driver)]:
            self._drop(key)

    def finish(self, driver: str, mb: str, result: tuple[list[Any], dict] | None) -> None:
        """The first copy's reply (None: it applied nothing, or failed: a resend is refused as before)."""
        from swarm.pipeline.transport.wire import buffer_bytes

        entry = self._items.get((driver, mb))
        if entry is None or entry.result.done():
            return
        entry.result.set_result(result)
        size = buffer_bytes(result[0]) if result is not None else 0
        if result is None or size > self.max_bytes:
            self._drop((driver, mb))
            return
        entry.size = size
        self._bytes += size
        self._evict(time.monotonic())

    async def again(self, driver: str, mb: str, op: str, rc: Any, sender: str) -> tuple[list[Any], dict] | None:
        """The reply of the first copy of this resend, waited for while it runs; None when there is none to give: it
        must be the same op on the same signed input (the first receipt), from the first copy's sender or the driver
        itself (a broken push resumed by relay)."""
        entry = self._items.get((driver, mb))
        if entry is None or (entry.op, entry.input) != (op, _first(rc)) or sender not in (entry.sender, driver):
            return None
        try:
            result = await asyncio.wait_for(asyncio.shield(entry.result), REPLY_WAIT_S)
        except TimeoutError:
            return None
        if result is not None:
            self.replayed += 1
        return result

    def _evict(self, now: float) -> None:
        for key, entry in list(self._items.items()):
            if now - entry.created <= self.ttl_s and self._bytes <= self.max_bytes:
                break
            if entry.result.done():  # one still running is kept, whatever its age
                self._drop(key)

    def _drop(self, key: tuple[str, str]) -> None:
        entry = self._items.pop(key, None)
        if entry is not None:
            self._bytes -= entry.size
            if not entry.result.done():
                entry.result.set_result(None)


def replies_bytes(run: Any, index: int, drivers: int = 1) -> int:
    """What stage ``index``'s ``Replies`` may hold for ``drivers`` drivers: ``REPLY_PER_DRIVER`` input gradients each
    (stage 0 serves no update op of another's), at most ``REPLY_BYTES`` (``volunteer doctor``)."""
    from swarm.pipeline.transport.wire import coded_bytes
    from swarm.run.models import stage_input_spec

    if index == 0:
        return 0
    training = run.training
    shape = tuple(stage_input_spec(run.model, index, training.batch_size).shape)
    return min(REPLY_BYTES, max(1, drivers) * REPLY_PER_DRIVER * coded_bytes(shape, training.codec, training.wire_rank))


def _first(rc: Any) -> Any:
    """The receipt of what an op computes on: the first of a request's ``rc`` list."""
    return rc[0] if isinstance(rc, list) and rc else None
