"""Which micro-batches a stage has applied an update for: one update per micro-batch per copy, whatever arrives twice.

A micro-batch can reach the same peer twice: a driver resends a hop whose answer it never got (a relayed
``forward_backward`` that timed out, a broken push that it resumes by relay while the pushed copy is still on its way
or still queued at the gate). Without this record the second copy applies its update again (one micro-batch, two
steps): the suite's clean-stop test saw a last stage's sample clock one micro-batch past its driver's count.

A stage claims ``(driver, micro-batch id)`` before an update op runs and keeps the claim once the update is applied;
a second update op for the same pair is refused with ``duplicate`` (nothing applied, nobody struck: a resend after a
cut stream is not an attack), and the driver counts that micro-batch lost rather than trying another peer with it.
A claim whose op applied nothing (refused, healing, need_input) is released, so the driver's honest retry runs.

Bounded: per driver the last ``PER_DRIVER`` claims within ``TTL_S``, at most ``DRIVERS`` drivers and ``TOTAL``
claims in all (~200 bytes each: ~6 MiB; the longest idle driver's oldest claims go first). What eviction costs is
one resend applied twice, the state before this ledger. A driver's id for a micro-batch is unique per driver start (swarm/pipeline/control/driver.py), so a restarted
driver's ids never meet its old claims.
"""

from __future__ import annotations

import time
from collections import OrderedDict

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
