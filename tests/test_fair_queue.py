"""The stage's compute in turns (swarm/pipeline/stage/fair_queue.py): one peer's pile of requests never holds another's."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from swarm.pipeline.stage.fair_queue import FairQueue


def test_a_flooding_requester_does_not_hold_the_others_behind_its_queue():
    order: list[str] = []

    def work(name: str) -> str:
        time.sleep(0.005)
        order.append(name)
        return name

    async def main() -> list[str]:
        fair = FairQueue(ThreadPoolExecutor(max_workers=1))
        flood = [asyncio.ensure_future(fair.run("stranger", work, f"s{i}")) for i in range(50)]
        await asyncio.sleep(0)  # the stranger's 50 are queued first
        honest = [asyncio.ensure_future(fair.run("driver", work, f"d{i}")) for i in range(3)]
        assert [await h for h in honest] == ["d0", "d1", "d2"]
        await asyncio.gather(*flood)
        return order

    order = asyncio.run(main())
    # each of the honest driver's requests waited for at most one of the stranger's: they are done by the 7th turn
    assert max(order.index(f"d{i}") for i in range(3)) <= 6, order
    assert sorted(order) == sorted([f"s{i}" for i in range(50)] + ["d0", "d1", "d2"])


def test_errors_reach_their_caller_and_the_queue_goes_on():
    def fail():
        raise ValueError("bad request")

    async def main():
        fair = FairQueue(ThreadPoolExecutor(max_workers=1))
        with pytest.raises(ValueError, match="bad request"):
            await fair.run("a", fail)
        assert await fair.run("a", lambda: 42) == 42
        waiter = asyncio.ensure_future(fair.run("b", time.sleep, 0.05))
        gone = asyncio.ensure_future(fair.run("c", lambda: "never needed"))
        await asyncio.sleep(0)
        gone.cancel()  # a caller that gave up (a timeout): its job is skipped
        await waiter
        return fair.waiting()

    assert asyncio.run(main()) == 0
