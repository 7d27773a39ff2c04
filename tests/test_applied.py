"""One update per micro-batch per copy (swarm/pipeline/stage/applied.py): the ledger's rule and its bounds."""

from __future__ import annotations

import dataclasses

from swarm.pipeline.stage.applied import AppliedLedger


def test_a_claimed_micro_batch_is_refused_until_released_and_drivers_do_not_share_ids():
    ledger = AppliedLedger()
    assert ledger.claim("driverA", "m-1", now=0.0)
    assert not ledger.claim("driverA", "m-1", now=1.0)  # the resend
    assert ledger.claim("driverB", "m-1", now=1.0)  # another driver's id of the same spelling
    ledger.release("driverA", "m-1")  # the op applied nothing (refused, need_input, healing)
    assert ledger.claim("driverA", "m-1", now=2.0)
    assert ledger.refused == 1 and len(ledger) == 2


def test_the_ledger_is_bounded_by_age_per_driver_and_by_drivers():
    ledger = AppliedLedger(per_driver=3, ttl_s=10.0, drivers=2)
    for n in range(5):  # a flood of ids evicts only its own driver's oldest claims
        assert ledger.claim("flooder", f"m-{n}", now=0.0)
    assert len(ledger) == 3 and ledger.claim("flooder", "m-0", now=0.0)
    assert ledger.claim("honest", "h-0", now=0.0)
    assert not ledger.claim("honest", "h-0", now=9.0)
    assert ledger.claim("honest", "h-0", now=20.0)  # past the age every resend arrives within
    assert ledger.claim("third", "t-0", now=20.0)  # a third driver: the one idle longest is forgotten
    assert ledger.claim("flooder", "m-4", now=20.0)
    assert len(ledger._claims) == 2


def test_the_ledger_holds_at_most_its_total_the_longest_idle_drivers_claims_going_first():
    ledger = AppliedLedger(per_driver=10, ttl_s=100.0, drivers=10, total=4)
    for n in range(3):
        ledger.claim("idle", f"i-{n}", now=0.0)
    for n in range(3):
        ledger.claim("busy", f"b-{n}", now=1.0)
    assert len(ledger) == 4 and sum(len(c) for c in ledger._claims.values()) == 4
    assert ledger.claim("idle", "i-0", now=2.0)  # evicted: the idle driver's oldest went first
    assert len(ledger) == 4 and not ledger.claim("busy", "b-2", now=2.0)  # the newest claims stay


@dataclasses.dataclass
class _Item:  # a serialized tensor, as far as the replies' byte count reads one
    size: int
    tag: int = 0

    @property
    def buffer(self) -> bytes:
        return b"x" * self.size


def test_a_resend_is_answered_with_the_first_copys_reply_only_for_the_same_input_and_sender():
    import asyncio

    from swarm.pipeline.stage.applied import Replies

    async def body():
        replies = Replies(per_driver=2, max_bytes=100)
        replies.begin("drv", "m-1", "backward", [["g-receipt"], ["x"]], "stage2")
        waiting = asyncio.ensure_future(replies.again("drv", "m-1", "backward", [["g-receipt"]], "drv"))
        await asyncio.sleep(0.01)
        assert not waiting.done()  # the first copy still runs: the resend waits for its reply
        replies.finish("drv", "m-1", ([_Item(10)], {"ok": True}))
        assert await waiting == ([_Item(10)], {"ok": True})
        assert await replies.again("drv", "m-1", "backward", [["other-receipt"]], "drv") is None  # another input
        assert await replies.again("drv", "m-1", "forward_backward", [["g-receipt"]], "drv") is None  # another op
        assert await replies.again("drv", "m-1", "backward", [["g-receipt"]], "stranger") is None  # another sender
        replies.begin("drv", "m-2", "backward", [["g2"]], "drv")
        replies.finish("drv", "m-2", None)  # applied nothing, or failed: a resend is refused as before
        assert await replies.again("drv", "m-2", "backward", [["g2"]], "drv") is None
        for n in range(3, 6):  # at most per_driver kept, and at most max_bytes
            replies.begin("drv", f"m-{n}", "backward", [[n]], "drv")
            replies.finish("drv", f"m-{n}", ([_Item(60, n)], {"ok": True}))
        assert await replies.again("drv", "m-1", "backward", [["g-receipt"]], "drv") is None
        assert await replies.again("drv", "m-5", "backward", [[5]], "drv") == ([_Item(60, 5)], {"ok": True})
        assert replies._bytes <= 100 and replies.replayed == 2

    asyncio.run(body())


def test_doctor_counts_the_replies_a_stage_may_keep():
    from swarm.pipeline.stage.applied import REPLY_BYTES, REPLY_PER_DRIVER, replies_bytes
    from swarm.run.runconfig import RunConfig

    run = RunConfig.model_validate({"name": "replies", "model": {"stages": 3, "hidden_dim": 32},
                                    "training": {"batch_size": 8}})
    assert replies_bytes(run, 0) == 0  # stage 0 serves no other driver's updates
    assert replies_bytes(run, 1) == REPLY_PER_DRIVER * 8 * 32 * 4  # an input gradient each, float32
    assert replies_bytes(run, 2, drivers=10**6) == REPLY_BYTES
