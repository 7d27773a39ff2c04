"""The stage's compute in turns: requests of different peers are served round-robin, not first come first served.

The compute thread runs one request at a time. Served in arrival order, one identity with many requests queued
(the in-flight cap allows 16) holds every other driver behind its queue: measured, 500 concurrent forwards from one
stranger monopolised a stage for ~45 s. Here each requester has its own queue and the compute thread takes the
next request from the next requester in turn, so a driver with one request waiting waits for at most one request
of each other requester, however many they queued. (Many identities still get a turn each: the per-identity
limits are in swarm/integrity/requesters.py.)

A request whose compute has begun cannot be taken back: the compute thread runs it to the end whatever its caller
does. ``started`` names the tasks whose compute began (the task that called ``run``), so that a caller that leaves
(a cut stream, a dead peer) can tell work that will still land (an update applied) from work that never ran.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any
from weakref import WeakSet


class FairQueue:
    """Runs ``fn(*args)`` on ``executor`` one at a time, requesters in turn (use from one event loop)."""

    def __init__(self, executor: Executor | None):
        self.executor = executor
        self._queues: OrderedDict[str, deque[tuple[asyncio.Future, Callable, tuple, asyncio.Task | None]]] = OrderedDict()
        self._running = False
        self.started: WeakSet[asyncio.Task] = WeakSet()  # tasks whose request's compute began (see the docstring)

    def waiting(self) -> int:
        return sum(len(q) for q in self._queues.values())

    async def run(self, requester: str, fn: Callable, *args: Any) -> Any:
        future = asyncio.get_running_loop().create_future()
        self._queues.setdefault(requester, deque()).append((future, fn, args, asyncio.current_task()))
        if not self._running:
            self._running = True
            asyncio.ensure_future(self._drain())
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._queues:
                requester, queue = next(iter(self._queues.items()))
                future, fn, args, caller = queue.popleft()
                self._queues.move_to_end(requester)  # its next request waits for one of every other requester's
                if not queue:
                    del self._queues[requester]
                if future.cancelled():  # its caller gave up (a timeout): nothing to compute
                    continue
                if caller is not None:
                    self.started.add(caller)
                try:
                    result = await loop.run_in_executor(self.executor, fn, *args)
                except BaseException as exc:  # handed to the caller, whatever it is
                    if not future.done():
                        future.set_exception(exc)
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                    continue
                if not future.done():
                    future.set_result(result)
        finally:
            self._running = False
            for queue in self._queues.values():  # a drain that ends early (the loop is closing) fails the rest
                for future, *_ in queue:
                    if not future.done():
                        future.cancel()
            self._queues.clear()
