"""What a stage's pushed hops received and sent, kept a little while for their driver's spot checks
(swarm/pipeline/stage/push.py ``show``): the driver draws which hops to check only after they ran, so a stage keeps
every recent hop's tensors, as the payloads that travelled (a middle stage x, y, g and gx; the last x and gx; stage 1
no x: its driver holds it).

Bounded by count per driver (``OUTBOX_PER_DRIVER``), by age (``OUTBOX_TTL_S``) and by bytes in all: at least
``OUTBOX_MAX_BYTES``, and at least two whole hops of the stage at the run's sizes for each micro-batch a driver
keeps in flight, for each of the run's drivers up to ``OUTBOX_MAX_DRIVERS`` (``outbox_cap``). Until session 32 the
bytes were 64 MiB whatever the stage: an llm-small middle stage's hop is 50 MB in float16 (four tensors of 8 x 1,024
tokens x 768), so with 4 micro-batches in flight the forwards of the later ones evicted the earlier ones' x and y
before their backwards came, every drawn hop's show came back without them, and after ``UNSHOWN_IN_ROW`` such misses
its honest peer was relayed (swarm/pipeline/control/push_checks.py): the route fell back to the relay for the model
whose activations a home link can least carry twice. Session 32 sized it for one driver, so a second driver's hops
pushed the first's out the same way; and the bytes went oldest first whoever held them, so anyone who signs pushes
(a key costs nothing) could push an honest driver's hops out with a flood. Now, past the bytes, what goes first is
a hop of a driver no layer0 record names (the gate's view of the run's drivers), then the oldest hop of the driver
holding the most: one driver's flood evicts its own hops (as the activation cache does, activations.py), and a
push refused before it ran keeps nothing.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

OUTBOX_TTL_S = 30.0
OUTBOX_PER_DRIVER = 32
OUTBOX_MAX_BYTES = 64 * 2**20
OUTBOX_MAX_DRIVERS = 4  # the bytes bound grows with the run's drivers up to this many (each its share)
# hops of a driver's micro-batches in flight, and as many completed whose checks may still ask: twice the run's
# training.in_flight (with in_flight auto, twice the usual depth of a near driver), at least this many
OUTBOX_MIN_HOPS = 8


def hop_bytes(run: Any, index: int) -> int:
    """What stage ``index`` keeps of one pushed hop, coded as it travels (the run's batch size and wire codec)."""
    from swarm.pipeline.transport.wire import coded_bytes
    from swarm.run.models import stage_input_spec, stage_output_spec

    model, training = run.model, run.training
    batch = training.batch_size

    def coded(spec: Any) -> int:
        return coded_bytes(tuple(spec.shape), training.codec, training.wire_rank)

    per_mb = (2 if index > 1 else 1) * coded(stage_input_spec(model, index, batch))
    if index + 1 < model.stages:
        per_mb += 2 * coded(stage_output_spec(model, index, batch))
    return per_mb


def driver_bytes(run: Any, index: int) -> int:
    """The bytes one driver's hops need at stage ``index``: two micro-batches' hops for each it keeps in flight
    (``OUTBOX_MIN_HOPS`` at least)."""
    in_flight = run.training.in_flight
    hops = max(OUTBOX_MIN_HOPS, 2 * (in_flight if isinstance(in_flight, int) else OUTBOX_MIN_HOPS // 2))
    return hops * hop_bytes(run, index)


def outbox_cap(run: Any, index: int, drivers: int = 1) -> int:
    """The bytes stage ``index``'s outbox may hold in all while the run has ``drivers`` drivers:
    ``OUTBOX_MAX_BYTES``, or ``driver_bytes`` for each driver (at most ``OUTBOX_MAX_DRIVERS``), whichever is more."""
    return max(OUTBOX_MAX_BYTES, min(max(1, drivers), OUTBOX_MAX_DRIVERS) * driver_bytes(run, index))


def outbox_bytes(run: Any, index: int, drivers: int = 1) -> int:
    """What stage ``index``'s outbox may hold for ``drivers`` drivers (``volunteer doctor``): ``OUTBOX_PER_DRIVER``
    hops each, at most ``outbox_cap`` in all (8 drivers' llm-tiny micro-batches of 16 x 64 tokens reach the cap)."""
    return min(outbox_cap(run, index, drivers), max(1, drivers) * OUTBOX_PER_DRIVER * hop_bytes(run, index))


class Outbox:
    """What pushed hops received and sent, per (driver, micro-batch): bounded by count per driver, by age, and by
    bytes in all (``limit``: at least ``max_bytes``, and ``driver_bytes`` for each of the run's ``drivers()``, at most
    OUTBOX_MAX_DRIVERS). Past the bytes, a hop of a driver ``known`` does not name goes first, then the oldest hop
    of the driver holding the most bytes. ``drivers`` and ``known`` read the stage gate's view of the run's drivers
    (None: one driver, all known)."""

    def __init__(self, ttl_s: float = OUTBOX_TTL_S, per_driver: int = OUTBOX_PER_DRIVER,
                 max_bytes: int = OUTBOX_MAX_BYTES, driver_bytes: int = 0,
                 drivers: Callable[[], int] | None = None, known: Callable[[str], bool] | None = None):
        self.ttl_s, self.per_driver, self.max_bytes, self.driver_bytes = ttl_s, per_driver, max_bytes, driver_bytes
        self._drivers, self._known = drivers, known
        self._items: OrderedDict[tuple[str, str], tuple[float, dict[str, Any]]] = OrderedDict()
        self._bytes = 0
        self._held: Counter[str] = Counter()  # bytes by driver

    @property
    def limit(self) -> int:
        drivers = self._drivers() if self._drivers is not None else 1
        return max(self.max_bytes, min(max(1, drivers), OUTBOX_MAX_DRIVERS) * self.driver_bytes)

    def put(self, driver: str, mb: str, **items: Any) -> None:
        """Tensors (payloads: ``SHOWN``) and receipts (wire form: ``RECEIPTS``) or ``loss``, by name."""
        now = time.monotonic()
        key = (driver, mb)
        _, kept = self._items.pop(key, (now, {}))
        for name, item in items.items():
            if item is not None:
                self._count(driver, _size(item) - _size(kept.get(name)))
                kept[name] = item
        self._items[key] = (now, kept)
        self._evict(now, driver)

    def get(self, driver: str, mb: str) -> dict[str, Any] | None:
        self._evict(time.monotonic(), driver)
        entry = self._items.get((driver, mb))
        return None if entry is None else entry[1]

    def has(self, driver: str, mb: str) -> bool:
        return (driver, mb) in self._items

    def discard(self, driver: str, mb: str) -> None:
        if (driver, mb) in self._items:
            self._drop((driver, mb))

    def held_by(self, driver: str) -> int:
        return self._held[driver]

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def _evict(self, now: float, driver: str) -> None:
        """Past a driver's count its oldest, past the age the oldest, past the bytes ``_victim``."""
        mine = [key for key in self._items if key[0] == driver]
        for key in mine[: max(0, len(mine) - self.per_driver)]:
            self._drop(key)
        for key in list(self._items):
            if now - self._items[key][0] <= self.ttl_s:
                break
            self._drop(key)
        limit = self.limit
        while self._bytes > limit and self._items:
            self._drop(self._victim())

    def _victim(self) -> tuple[str, str]:
        """A hop of a driver no layer0 record names, else the oldest of the driver holding the most bytes."""
        if self._known is not None:
            for key in self._items:
                if self._held[key[0]] and not self._known(key[0]):
                    return key
        largest = max(self._held, key=self._held.__getitem__)
        return next(key for key in self._items if key[0] == largest)

    def _count(self, driver: str, delta: int) -> None:
        self._bytes += delta
        self._held[driver] += delta
        if self._held[driver] <= 0:
            del self._held[driver]

    def _drop(self, key: tuple[str, str]) -> None:
        _, kept = self._items.pop(key)
        self._count(key[0], -sum(_size(item) for item in kept.values()))


def _size(item: Any) -> int:
    return len(item.buffer) if hasattr(item, "buffer") else 0
