"""Signed hop receipts (swarm/integrity/receipts.py): what they vouch for, and what they refuse (pure, no network)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swarm.integrity.receipts import (
    Expect,
    Receipt,
    ReceiptError,
    ReceiptKey,
    ids_digest,
    mismatch,
    parse_all,
    bytes_signature_valid,
    signature_valid,
    tensor_digest,
    verification_stats,
)
from swarm.pipeline.transport.wire import decode_tensors, encode_tensors, payload_of, serialize_once

RUN = "run-12345678"


def _signed(key: ReceiptKey, **changes) -> Receipt:
    fields = dict(run_id=RUN, mb="mb-1", op="forward", stage=1, version=7, input=b"i" * 16, output=b"o" * 16,
                  ids=b"d" * 16, weights=b"w" * 16, forward_weights=b"f" * 16)
    fields.update(changes)
    return key.sign(**fields)


def test_a_receipt_verifies_with_its_signers_key_only():
    alice, mallory = ReceiptKey("QmAlice"), ReceiptKey("QmMallory")
    receipt = _signed(alice)
    assert signature_valid(receipt, alice.public)
    assert not signature_valid(receipt, mallory.public)
    # any field changed after signing breaks the signature: a relay cannot edit what it relays
    for change in (dict(output=b"x" * 16), dict(mb="mb-2"), dict(stage=2), dict(op="backward"), dict(ids=b"e" * 16),
                   dict(signer="QmMallory"), dict(version=8), dict(run_id="run-other"), dict(weights=b"v" * 16),
                   dict(forward_weights=b"g" * 16)):
        assert not signature_valid(dataclasses.replace(receipt, **change), alice.public), change


def test_a_signature_verified_once_is_answered_again_only_for_the_same_key_and_bytes():
    alice, mallory = ReceiptKey("QmAlice"), ReceiptKey("QmMallory")
    theirs = ReceiptKey("QmBob")
    receipt = _signed(theirs)
    before = verification_stats()
    assert signature_valid(receipt, theirs.public) and signature_valid(receipt, theirs.public)
    after = verification_stats()
    # our own signatures are known as we make them: the first check of Bob's in this process is a hit too
    assert after["hits"] - before["hits"] == 2 and after["misses"] == before["misses"]
    # what was verified is no licence for anything else: another key, any field changed, the signature on other bytes
    assert not signature_valid(receipt, mallory.public)
    assert not signature_valid(dataclasses.replace(receipt, output=b"x" * 16), theirs.public)
    assert not signature_valid(dataclasses.replace(_signed(alice), signature=receipt.signature), alice.public)
    assert not bytes_signature_valid(receipt.body() + b"x", receipt.signature, theirs.public)
    assert not bytes_signature_valid(receipt.body(), receipt.signature, bytearray(theirs.public))  # not bytes: no
    assert bytes_signature_valid(receipt.body(), receipt.signature, theirs.public)
    # a stranger's valid signature, verified in full once, then answered from memory
    seed_key = ReceiptKey("QmCarol", bytes(range(32)))
    stranger = dataclasses.replace(_signed(seed_key), version=9)
    forged = stranger.signature
    assert not signature_valid(stranger, seed_key.public)  # the version changed after signing: refused, not kept
    assert not signature_valid(stranger, seed_key.public) and forged == stranger.signature


def test_a_key_derived_from_the_same_seed_signs_the_same():
    seed = bytes(range(32))
    first, again = ReceiptKey("QmA", seed), ReceiptKey("QmA", seed)
    assert first.public == again.public
    assert signature_valid(_signed(first), again.public)


def test_the_wire_form_round_trips_and_malformed_ones_are_refused():
    receipt = _signed(ReceiptKey("QmAlice"))
    assert Receipt.from_wire(receipt.to_wire()) == receipt
    wire = receipt.to_wire()
    assert receipt.weights == b"w" * 16 and receipt.forward_weights == b"f" * 16  # committed, and signed
    bad = [None, "text", [], wire[:-1], [1, *wire[1:]], [*wire[:4], "1", *wire[5:]], [*wire[:6], b"short", *wire[7:]],
           [*wire[:3], "explode", *wire[4:]], [*wire[:12], b"\0" * 10], [*wire[:2], {"a": 1}, *wire[3:]],
           [*wire[:9], b"short", *wire[10:]], [*wire[:10], None, *wire[11:]],
           [*wire[:4], True, *wire[5:]], [*wire[:4], -1, *wire[5:]]]
    for raw in bad:
        with pytest.raises(ReceiptError):
            Receipt.from_wire(raw)
    with pytest.raises(ReceiptError):
        parse_all([wire], 2)
    with pytest.raises(ReceiptError):
        parse_all("not a list", 1)


def test_mismatch_names_what_does_not_hold():
    receipt = _signed(ReceiptKey("QmAlice"))
    expect = Expect(RUN, 1, frozenset({"forward"}), b"o" * 16, mb="mb-1", input=b"i" * 16, ids=b"d" * 16,
                    signer="QmAlice")
    assert mismatch(receipt, expect) is None
    cases = {
        "another run": dict(run_id="run-other"),
        "not of": dict(stage=2),
        "another micro-batch": dict(mb="mb-9"),
        "not by": dict(signer="QmBob"),
        "not the one the receipt's signer produced": dict(output=b"z" * 16),
        "not the output it must follow": dict(input=b"z" * 16),
        "sample ids": dict(ids=b"z" * 16),
    }
    for text, change in cases.items():
        assert text in mismatch(receipt, dataclasses.replace(expect, **change)), text


def test_the_digest_is_of_what_travels_and_a_relay_keeps_the_bytes():
    """The driver relays a stage's output byte for byte: the digest at the next stage is the signer's."""
    h = torch.randn(8, 32)
    for codec in ("float32", "float16", "int8"):
        item = serialize_once(h.clone(), codec)
        (received,) = decode_tensors([item], 2**20, coded=True)
        (relayed,) = encode_tensors([received], codec)
        assert tensor_digest(relayed) == tensor_digest(item), codec
        assert payload_of(received) is item
    # another tensor, or the same bytes declared as another shape, has another digest
    a, b = encode_tensors([h]), encode_tensors([h + 1e-6])
    assert tensor_digest(a[0]) != tensor_digest(b[0])
    reshaped = encode_tensors([h.reshape(16, 16)])[0]
    assert reshaped.buffer == a[0].buffer and tensor_digest(reshaped) != tensor_digest(a[0])


def test_ids_digest_is_of_the_values():
    ids = torch.arange(8, dtype=torch.int64)
    assert ids_digest(ids) == ids_digest(ids.numpy()) == ids_digest(ids.clone())
    assert ids_digest(ids) != ids_digest(ids.flip(0))


def test_a_stream_cut_short_is_a_network_fault_not_a_hostile_reply():
    """A pull whose stream broke carries fewer tensors, or a last one shorter than it declares: the puller retries
    and bans nobody (a cut stream made newcomers start from seeded weights and banned honest donors for 300 s)."""
    from swarm.averaging.params_rpc import _cut_short

    (whole,) = encode_tensors([torch.randn(64, 32)])
    cut = type(whole)()
    cut.CopyFrom(whole)
    cut.buffer = whole.buffer[: len(whole.buffer) // 2]
    assert not _cut_short(whole) and _cut_short(cut)


def test_export_asks_the_best_copy_first_and_the_others_after():
    from swarm.dht.records import MemberRecord
    from volunteer_cli.commands.export import export_order

    def record(peer, loss, clock, state="online", reachable=1):
        return MemberRecord(peer, state, "v", 0.0, 0.0, loss=loss, clock=clock, reachable=reachable)

    records = [record("a", 0.5, 10), record("b", 0.2, 5), record("c", -1.0, 99), record("d", 0.1, 1, "offline"),
               record("e", 0.05, 1, reachable=0)]
    assert [r.peer_id for r in export_order(records)] == ["b", "a", "c"]


def test_the_keybook_keeps_half_its_fetches_for_the_peers_its_views_list():
    """Issue 25: a stranger naming random signers spent the 8 fetches a second the keys of known peers needed.
    Signers no view lists may take fetches only while more than half the budget is left."""
    import asyncio

    from swarm.pipeline.transport.keybook import KeyBook

    asked = []

    async def fetch(peer_id: str, swarm: str) -> bytes:
        asked.append(peer_id)
        return bytes(32)

    async def main():
        book = KeyBook(fetch)
        assert await book.key("early", "layer2") == bytes(32), "no view of the swarm yet: asked"
        book.prefetch(["honest"], "layer2")
        await asyncio.sleep(0.05)
        strangers = [await book.key(f"random{k}", "layer2") for k in range(50)]
        assert 1 <= sum(key is not None for key in strangers) <= 4, "at most half of the 8 tokens"
        assert len(asked) <= 2 + 4, asked
        book.prefetch(["newer"], "layer2")
        await asyncio.sleep(0.05)
        assert "newer" in asked and book.known("newer"), "a listed peer still gets its fetch"

    asyncio.run(asyncio.wait_for(main(), 10))


def test_one_requesters_flood_of_forwards_evicts_its_own_emitted_digests_not_the_others():
    """Issue 25: the forwards' output digests a backward is checked against were kept first-in first-out for every
    requester together, so one identity's flood of forwards evicted the honest drivers' (their backwards then
    needed the longer chain of receipts)."""
    from hivemind.proto import runtime_pb2

    from swarm.integrity.receipts import ReceiptKey
    from swarm.pipeline.stage import stage_receipts
    from swarm.pipeline.transport.keybook import KeyBook

    desk = stage_receipts.ReceiptDesk("run-x", 1, ReceiptKey("QmStage1"), KeyBook())
    out = [runtime_pb2.Tensor(buffer=b"\0" * 16, size=[4], dtype="float32")]
    for k in range(10):
        desk.sign("honest", "forward", stage_receipts.Vouched(mb=f"h{k}", input=b"i" * 16, ids=b"d" * 16), out, 1)
    for k in range(stage_receipts.MAX_EMITTED + 100):
        desk.sign("flooder", "forward", stage_receipts.Vouched(mb=f"f{k}", input=b"i" * 16, ids=b"d" * 16), out, 1)
    assert all(("honest", f"h{k}") in desk.emitted for k in range(10))
    assert sum(1 for r, _ in desk.emitted if r == "flooder") == stage_receipts.MAX_EMITTED_PER_REQUESTER


def test_a_key_not_had_yet_is_waited_for_and_a_gone_signer_is_given_up(monkeypatch):
    """Session 10: a stage that could not fetch a neighbour's receipt key at start-up refused the micro-batches it
    signed as ``unknown_signer`` (dropped at once). A failing fetch now backs off from 0.5 s, and the signer is
    waited for (``key_pending``) until its fetches have failed for ``KEY_PATIENCE_S``."""
    import asyncio

    from swarm.pipeline.transport import keybook

    attempts = []
    answer = {"key": None}

    async def fetch(peer_id: str, swarm: str) -> bytes:
        attempts.append(peer_id)
        if answer["key"] is None:
            raise ConnectionError("not reachable yet")
        return answer["key"]

    async def main():
        book = keybook.KeyBook(fetch)
        assert await book.key("late", "layer2") is None
        wait = book.wait_s("late")
        assert wait is not None and 0.1 <= wait <= keybook.FIRST_RETRY_S
        assert await book.key("late", "layer2") is None and len(attempts) == 1, "not asked again before the backoff"
        await asyncio.sleep(wait + 0.05)
        assert await book.key("late", "layer2") is None and len(attempts) == 2
        assert book.wait_s("late") > keybook.FIRST_RETRY_S, "the backoff doubles"
        answer["key"] = bytes(32)
        await asyncio.sleep(book.wait_s("late") + 0.05)
        assert await book.key("late", "layer2") == bytes(32)
        monkeypatch.setattr(keybook, "KEY_PATIENCE_S", 0.3)
        answer["key"] = None
        assert await book.key("gone", "layer2") is None and book.wait_s("gone") is not None
        await asyncio.sleep(0.35)
        assert book.wait_s("gone") is None, "failing for longer than the patience: taken for gone"

    asyncio.run(asyncio.wait_for(main(), 10))


def test_the_stage_says_key_pending_while_the_key_may_come_and_unknown_signer_after():
    import asyncio
    import time

    from swarm.integrity.receipts import ReceiptKey
    from swarm.pipeline.transport import keybook
    from swarm.pipeline.stage import stage_receipts

    async def fetch(peer_id: str, swarm: str) -> bytes:
        raise ConnectionError("not reachable")

    async def main():
        signer = ReceiptKey("QmLayer2")
        desk = stage_receipts.ReceiptDesk("run-x", 1, ReceiptKey("QmStage1"), keybook.KeyBook(fetch))
        receipt = stage_receipts.Receipt.from_wire(signer.sign("run-x", "mb1", "backward", 2, 1, b"i" * 16,
                                                               b"o" * 16, b"d" * 16).to_wire())
        expect = stage_receipts.Expect("run-x", 2, stage_receipts.GRADIENT_OPS, b"o" * 16, mb="mb1")
        with pytest.raises(stage_receipts.ReceiptRefusal) as first:
            await desk._verify("driver", receipt, 2, expect)
        assert first.value.code == "key_pending" and not first.value.strike and first.value.retry_after_s > 0
        now = time.monotonic()  # failing since long before the patience, next try in 5 s
        desk.keys._failed["QmLayer2"] = (now - 2 * keybook.KEY_PATIENCE_S, 10.0, now + 5)
        with pytest.raises(stage_receipts.ReceiptRefusal) as later:
            await desk._verify("driver", receipt, 2, expect)
        assert later.value.code == "unknown_signer" and not later.value.strike

    asyncio.run(asyncio.wait_for(main(), 10))
