"""Spot checks of stage 0's outputs (swarm/integrity/spot.py ``judge_author``, swarm/pipeline/stage/stage0_replicas.py,
swarm/pipeline/control/stage0_checks.py): the pure verdict, the door a driver keeps for recomputations, and a stage-1
peer's checker against fake layer0 peers (no network). A made-up output is refused and its author struck; honest
copies that differ as label-skewed ones do, a slow peer, or a lone second copy blame nobody."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hostile import made_up_activations
from swarm.integrity.receipts import ReceiptKey, ids_digest, tensor_digest
from swarm.integrity.spot import (
    AGREED,
    AUTHOR_ODD,
    DISAGREED,
    REPLICA_ODD,
    SKIPPED,
    UNDECIDED,
    judge_author,
)
from swarm.pipeline.transport.keybook import KeyBook
from swarm.pipeline.control.stage0_checks import Stage0Checker
from swarm.pipeline.stage.stage0_replicas import ReplicaDoor, check_train_ids, ids_bytes, ids_from_meta
from swarm.pipeline.transport.wire import WireError, serialize_once
from swarm.run.runconfig import RunConfig

RUN = RunConfig.model_validate({"name": "stage0spot", "model": {"stages": 3, "hidden_dim": 16},
                                "training": {"batch_size": 8}})
TWO_STAGES = RunConfig.model_validate({"name": "stage0spot2", "model": {"stages": 2, "hidden_dim": 16},
                                       "training": {"batch_size": 8}})
BATCH, WIDTH = 8, 16


def _honest(seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.relu(torch.randn(BATCH, WIDTH)) + 0.05


def _skewed_copy(h: torch.Tensor, cosine: float, seed: int) -> torch.Tensor:
    """Another honest copy's output: each row at about ``cosine`` from ``h``'s (two copies trained apart on
    label-skewed shards had a median row cosine of 0.88), of the same norm."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for row in h:
        noise = torch.randn(row.shape, generator=g)
        noise -= (noise @ row) / (row @ row) * row  # orthogonal to the row
        noise *= row.norm() / noise.norm()
        rows.append(cosine * row + (1 - cosine**2) ** 0.5 * noise)
    return torch.stack(rows)


def _row_cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a, b, dim=1)


# ----- the verdict


@pytest.mark.parametrize("kind", ["random", "scaled_x10"])
def test_a_made_up_output_is_the_odd_one_out_when_two_copies_agree(kind):
    h = _honest()
    made_up = made_up_activations(kind, h, torch.Generator().manual_seed(1))
    replicas = [h + 0.01 * torch.randn(BATCH, WIDTH), h * 1.02]
    assert judge_author(made_up, replicas) == (AUTHOR_ODD, None)
    assert judge_author(h, replicas) == (AGREED, None)


def test_honest_label_skewed_copies_are_never_blamed():
    h = _honest()
    for seed in range(20):
        a, b = _skewed_copy(h, 0.85, 2 * seed + 1), _skewed_copy(h, 0.85, 2 * seed + 2)
        assert float(_row_cosines(h, a).median()) == pytest.approx(0.85, abs=0.01)
        for author, replicas in ((h, [a, b]), (a, [h, b]), (b, [a, h])):
            verdict, _ = judge_author(author, replicas)
            assert verdict in (AGREED, UNDECIDED), verdict


@pytest.mark.parametrize("scale", [0.43, 0.5, 2.0, 2.3])
def test_a_specialist_copy_whose_outputs_on_its_own_classes_are_larger_is_not_blamed(scale):
    """Session 10: on label-skewed shards a copy's activations on the classes it trains on grew to about twice the
    other copies' (the same direction: cosine 0.84-0.93, norm ratio 0.43-0.50 after 60 s of a live run), and the
    norm-ratio bound of 0.5 made that honest driver the odd one out, struck and banned. Far is now a ratio < 0.25."""
    h = _honest()
    a, b = _skewed_copy(h, 0.88, 1), _skewed_copy(h, 0.88, 2)
    author = _skewed_copy(h, 0.88, 3) * scale
    for verdict in (judge_author(author, [a, b])[0], judge_author(a, [author, b])[0]):
        assert verdict in (AGREED, UNDECIDED), (scale, verdict)
    assert judge_author(h * 10, [a, b]) == (AUTHOR_ODD, None), "a liar scaling by 10 is still far"
    assert judge_author(h * 0.1, [a, b]) == (AUTHOR_ODD, None)


def test_one_replica_only_says_and_none_skips():
    h = _honest()
    assert judge_author(h * 10, [h]) == (DISAGREED, None)  # two copies cannot tell which one lies
    assert judge_author(h, []) == (SKIPPED, None)


def test_a_replica_that_lies_is_the_odd_one_not_the_author():
    h = _honest()
    assert judge_author(h, [made_up_activations("random", h), h * 1.01]) == (REPLICA_ODD, 0)
    assert judge_author(h, [h * 0.99, -h]) == (REPLICA_ODD, 1)


# ----- the door of a driver


def test_the_door_serves_only_layer1_peers_within_bounds():
    door = ReplicaDoor(rate_per_s=2.0, burst=3.0, per_peer=2, total=3)
    assert door.admit("stranger", 0.0).code == "unknown_peer"
    door.set_callers(["a", "b"])
    assert door.admit("a", 0.0) is None and door.admit("a", 0.0) is None
    assert door.admit("a", 0.0).code == "busy"  # two in flight from one caller
    assert door.admit("b", 0.0) is None
    assert door.admit("b", 0.0).code == "busy"  # three in flight in all
    for peer in ("a", "a", "b"):
        door.finished(peer, 0.01, served=True)
    assert door.admit("a", 0.0) is None  # the third of its burst
    door.finished("a", 0.01, served=True)
    refusal = door.admit("a", 0.0)
    assert refusal.code == "busy" and refusal.retry_after_s == pytest.approx(0.5)  # bucket empty: 2 a second
    assert door.admit("a", 0.6) is None  # refilled
    door.finished("a", 0.0, served=False)
    assert door.stats() == {"served": 4, "refused": 4, "compute_s": 0.04}


def test_two_verdicts_in_a_half_life_ban_a_slow_liar():
    from swarm.integrity.requesters import RequesterBook
    from swarm.pipeline.control.stage0_checks import VERDICT_STRIKES

    book = RequesterBook(RUN.integrity)
    assert book.on_strike("liar", "spot check", 0.0, VERDICT_STRIKES) is None
    ban = book.on_strike("liar", "spot check", RUN.integrity.strike_half_life_s / 4, VERDICT_STRIKES)
    assert ban is not None and ban.requester == "liar"
    # one verdict a half-life apart never bans (a liar that slow has 97 % of its micro-batches pass anyway)
    assert all(book.on_strike("slow", "spot check", t * 2 * RUN.integrity.strike_half_life_s, VERDICT_STRIKES) is None
               for t in range(20))


def test_sample_ids_are_checked_like_any_strangers_tensor():
    ids = torch.tensor([3, 1, 4], dtype=torch.int64)
    assert torch.equal(ids_from_meta(ids_bytes(ids), 3), ids)
    assert torch.equal(check_train_ids(ids, 10, 8), ids)
    for bad, batch in ((b"\0" * 7, 1), ("3,1,4", 3), (ids_bytes(ids), 4)):
        with pytest.raises(WireError):
            ids_from_meta(bad, batch)
    for bad in (torch.tensor([0, 10]), torch.tensor([-1]), torch.zeros(9, dtype=torch.int64),
                torch.zeros(2, 2, dtype=torch.int64), torch.tensor([1.0, 2.0]), torch.zeros(0, dtype=torch.int64)):
        with pytest.raises(WireError):
            check_train_ids(bad, 10, 8)


# ----- a stage-1 peer's checker against fake layer0 peers


class FakeLayer0:
    """layer0 peers that recompute stage 0 (``outputs[peer]``: the tensor it answers), sign it, or do not answer."""

    def __init__(self, outputs: dict[str, torch.Tensor | None], delay_s: float = 0.0, run_id: str = RUN.run_id):
        self.outputs = outputs
        self.run_id = run_id
        self.delay_s = delay_s
        self.keys = {peer: ReceiptKey(peer) for peer in outputs}
        self.calls: list[str] = []

    async def __call__(self, p2p, peer, namespace, op, tensors, meta, *, timeout_s, **_):
        assert op == "infer" and namespace.endswith(".layer0")
        self.calls.append(peer)
        out = self.outputs[peer]
        if out is None or self.delay_s > timeout_s:
            await asyncio.sleep(timeout_s)
            raise TimeoutError()
        await asyncio.sleep(self.delay_s)
        out = out.clone()
        ids_d = ids_digest(tensors[0])
        receipt = self.keys[peer].sign(self.run_id, meta["mb"], "infer", 0, 0, ids_d,
                                       tensor_digest(serialize_once(out)), ids_d)
        return [out], {"ok": True, "rc": receipt.to_wire(), "rk": self.keys[peer].public}, self.delay_s


def _check(outputs: dict, author_out: torch.Tensor, delay_s: float = 0.0, budget_s: float = 0.5, seed: int = 0,
           credit: dict[str, int] | None = None):
    fake = FakeLayer0(outputs, delay_s)
    struck: list[tuple[str, str]] = []
    checker = Stage0Checker(RUN, None, KeyBook(), lambda: ["author", *outputs], lambda p, r, w: struck.append((p, r)),
                            share=1.0, budget_s=budget_s, seed=seed, call=fake)
    checker.credit.update(credit or {})
    return _verdict(checker, author_out), struck, checker, fake


def _verdict(checker: Stage0Checker, author_out: torch.Tensor, author: str = "author") -> str:
    async def go():
        task = checker.start(author, "mb-1", author_out, torch.arange(BATCH))
        return await task

    return asyncio.run(go())


@pytest.mark.parametrize("kind", ["random", "scaled_x10"])
def test_a_made_up_stage0_output_is_refused_and_its_author_struck(kind):
    h = _honest()
    verdict, struck, checker, fake = _check({"p": h, "q": h * 1.01}, made_up_activations(kind, h),
                                            credit={"p": 1, "q": 1})
    assert verdict == AUTHOR_ODD
    assert [peer for peer, _ in struck] == ["author"] and "far from the recomputations" in struck[0][1]
    author, mb, receipts = checker.evidence[0]
    assert (author, mb, len(receipts)) == ("author", "mb-1", 2)  # the signed recomputations that convicted it
    assert sorted(fake.calls) == ["p", "q"]


def test_an_honest_output_costs_one_recomputation():
    h = _honest()
    verdict, struck, checker, fake = _check({"p": h, "q": h}, h * 1.01)
    assert verdict == AGREED and not struck and len(fake.calls) == 1


def test_skewed_honest_copies_blame_nobody():
    h = _honest()
    verdict, struck, checker, fake = _check({"p": _skewed_copy(h, 0.85, 1), "q": _skewed_copy(h, 0.85, 2)}, h)
    assert verdict in (AGREED, UNDECIDED) and not struck
    assert checker.credit == {"author": 1}  # not far from either: its work is corroborated all the same


def test_a_slow_or_absent_layer0_peer_is_no_evidence():
    h = _honest()
    verdict, struck, checker, _ = _check({"p": None, "q": None}, h * 10, budget_s=0.2)
    assert verdict == SKIPPED and not struck
    verdict, struck, _, _ = _check({"p": h, "q": h}, h * 10, delay_s=0.3, budget_s=0.2)
    assert verdict == SKIPPED and not struck


def test_with_one_other_layer0_peer_a_disagreement_is_only_said(caplog):
    h = _honest()
    verdict, struck, _, _ = _check({"p": h}, h * 10)
    assert verdict == DISAGREED and not struck
    assert "no third layer0 peer" in caplog.text


def test_a_lying_replica_is_struck_and_not_asked_again():
    h = _honest()
    caught = 0
    for seed in range(8):  # the replicas are asked in a random order: when q comes first, the liar is never asked
        verdict, struck, checker, _ = _check({"liar": made_up_activations("random", h), "q": h * 1.01}, h, seed=seed,
                                             credit={"author": 1, "q": 1})
        assert verdict in (AGREED, REPLICA_ODD) and "author" not in [peer for peer, _ in struck]
        if verdict == REPLICA_ODD:
            caught += 1
            assert [peer for peer, _ in struck] == ["liar"] and checker._held["liar"] > 0
    assert caught >= 1


def test_an_honest_output_corroborated_earns_its_author_credit():
    h = _honest()
    verdict, struck, checker, _ = _check({"p": h, "q": h}, h * 1.01)
    assert verdict == AGREED and checker.credit == {"author": 1}
    assert _verdict(checker, h * 0.99) == AGREED and checker.credit == {"author": 2}


def test_two_fresh_colluding_keys_cannot_strike_a_driver_with_validated_work():
    """A frame-up: two new layer0 keys recompute the same made-up output for an honest driver's ids. The odd-one-out
    rule alone cannot tell two liars from two honest copies; their standing can: they have no corroborated work
    here and the driver has. Its micro-batch is refused (the sampled share at most), it is not struck, and they
    cannot take its standing away."""
    h = _honest()
    framed = made_up_activations("random", h)
    verdict, struck, checker, _ = _check({"x": framed, "y": framed * 1.001}, h, credit={"author": 1})
    assert verdict == AUTHOR_ODD and not struck  # refused, not struck
    assert checker.stats()["outweighed"] == 1 and checker.stats()["caught"] == 0
    assert checker.credit["author"] == 1
    for _ in range(5):
        assert _verdict(checker, h) == AUTHOR_ODD
    assert not struck and checker.credit["author"] == 1
    # nor a driver with no corroborated output here yet: keys with no validated work strike nobody
    verdict, struck, _, _ = _check({"x": framed, "y": framed * 1.001}, h)
    assert verdict == AUTHOR_ODD and not struck


def test_a_fresh_liar_is_refused_then_struck_once_two_recomputers_have_validated_work():
    h = _honest()
    verdict, struck, checker, _ = _check({"p": h, "q": h * 1.01}, made_up_activations("random", h))
    assert verdict == AUTHOR_ODD and not struck  # refused: nobody here has validated work yet
    assert _verdict(checker, h, author="p") == AGREED and _verdict(checker, h, author="q") == AGREED
    assert _verdict(checker, made_up_activations("random", h)) == AUTHOR_ODD
    assert [p for p, _ in struck] == ["author"]


def test_an_established_liar_loses_its_standing_to_established_peers_then_is_struck():
    h = _honest()
    verdict, struck, checker, _ = _check({"p": h, "q": h * 1.01}, made_up_activations("random", h),
                                         credit={"author": 5, "p": 2, "q": 2})
    assert verdict == AUTHOR_ODD and not struck and checker.credit["author"] == 3  # outweighed: 5 - 2
    assert _verdict(checker, made_up_activations("random", h)) == AUTHOR_ODD and not struck
    assert checker.credit["author"] == 1
    assert _verdict(checker, made_up_activations("random", h)) == AUTHOR_ODD  # 2 > 1
    assert [p for p, _ in struck] == ["author"] and "author" not in checker.credit  # convicted: all credit gone


def test_colluders_cannot_strike_an_established_recomputer():
    """The author and a second key collude on a made-up output; the honest recomputer that disagrees is the odd one
    out, but is struck only if they have as much validated work here as it has."""
    h = _honest()
    lie = made_up_activations("random", h)
    for seed in range(6):
        verdict, struck, checker, _ = _check({"honest": h, "friend": lie * 1.001}, lie, seed=seed,
                                             credit={"honest": 2})
        assert "honest" not in [p for p, _ in struck], (seed, verdict)
        assert checker._held.get("honest", 0.0) == 0.0  # and it is still asked


def test_recomputers_with_validated_work_are_asked_first():
    h = _honest()
    outputs = {f"fresh{i}": h for i in range(8)} | {"established": h}
    first = []
    for seed in range(40):
        _, _, _, fake = _check(outputs, h, seed=seed, credit={"established": 20})
        first.append(fake.calls[0])
    assert first.count("established") >= 20, first  # weight 21 against 8 x 1: about 72 % of the time


def test_what_still_passes_outputs_within_the_far_bound():
    """The known gap: replication catches made-up tensors, not subtle ones. A driver that sends the stage-0 outputs
    of other samples of the data set (its inputs paired with other labels), or a non-negative random tensor of the
    honest norm, stays within the FAR bound of an honest recomputation (stage 0 ends in a ReLU: every output
    shares a large positive mean)."""
    from swarm.run.data import load_dataset
    from swarm.run.models import build_stage

    run = RunConfig.model_validate({"name": "gap", "model": {"stages": 3}})
    torch.manual_seed(0)
    stage0 = build_stage(run.model, 0)
    x = load_dataset(run.data, run.model).x_train[:32]
    with torch.no_grad():
        h = stage0(x)
        other_samples = h[torch.randperm(32)]
    noise = torch.randn(h.shape).abs()
    for subtle in (other_samples, noise * h.norm() / noise.norm()):
        assert judge_author(subtle, [h, h * 1.01])[0] != AUTHOR_ODD
    assert judge_author(made_up_activations("random", h), [h, h * 1.01])[0] == AUTHOR_ODD
    # where honest copies disagree among themselves (label-skewed, row cosines of 0.85) the two recomputations are
    # still not far from each other: a made-up output is singled out there too, and an honest one is not
    skewed = [_skewed_copy(h, 0.85, 1), _skewed_copy(h, 0.85, 2)]
    assert judge_author(made_up_activations("random", h), skewed)[0] == AUTHOR_ODD
    assert judge_author(_skewed_copy(h, 0.85, 3), skewed)[0] in (AGREED, UNDECIDED)


# ----- stage 0's servicer: infer [ids] for layer1 only (no network: the handler called as p2p would)


def test_stage0_recomputes_on_ids_for_layer1_peers_only_and_signs_it():
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from swarm.integrity.receipts import Receipt, signature_valid
    from swarm.pipeline.stage.worker import StageWorker
    from swarm.pipeline.stage.stage0_replicas import ReplicaService
    from swarm.pipeline.stage.stage_receipts import ReceiptDesk
    from swarm.pipeline.stage.stage_rpc import StageServicer
    from swarm.pipeline.transport.wire import decode_tensors, encode_tensors, pack_metadata, unpack_metadata
    from swarm.run.data import load_dataset

    worker = StageWorker(RUN, 0)
    x_train = load_dataset(RUN.data, RUN.model).x_train
    key = ReceiptKey("stage0-peer")
    executor = ThreadPoolExecutor(max_workers=1)
    servicer = StageServicer(worker, executor, max_bytes=2**24, desk=ReceiptDesk(RUN.run_id, 0, key, KeyBook()))
    servicer.replicas = ReplicaService(ReplicaDoor(), lambda ids: x_train[ids], len(x_train), 8)
    servicer.replicas.door.set_callers(["layer1-peer"])
    ids = torch.tensor([5, 9, 2], dtype=torch.int64)

    async def ask(requester: str, op: str = "infer", tensors=(ids,)):
        out, meta = await servicer._handle(encode_tensors(list(tensors)), pack_metadata({"op": op, "mb": "m1"}),
                                          SimpleNamespace(remote_id=requester))
        return decode_tensors(out, 2**24, coded=True), unpack_metadata(pack_metadata(meta))

    async def go():
        return (await ask("layer1-peer"), await ask("stranger"), await ask("layer1-peer", "forward", (x_train[ids],)),
                await ask("layer1-peer", "infer", (torch.tensor([0, len(x_train)]),)))

    try:
        (out, meta), (_, stranger), (_, forward), (_, out_of_range) = asyncio.run(go())
    finally:
        executor.shutdown()
    assert meta["ok"] and torch.allclose(out[0], worker.infer(x_train[ids]))
    receipt = Receipt.from_wire(meta["rc"])
    assert (receipt.op, receipt.stage, receipt.signer, receipt.ids) == ("infer", 0, "stage0-peer", ids_digest(ids))
    assert receipt.input == ids_digest(ids) and signature_valid(receipt, key.public)
    assert stranger["code"] == "unknown_peer"
    assert forward["code"] == "rejected"  # stage 0 still trains for no one but its own driver
    assert out_of_range["code"] == "rejected"
    assert servicer.replicas.door.stats()["served"] == 1


def test_stage1_refuses_a_made_up_stage0_output_before_anything_applies_it():
    """Stage 1's servicer alone (no network): every forward names its ids; a sampled made-up output is refused
    (``spot_check``) and its saved forward dropped; at a last stage 1 the refusal comes before the update."""
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from receipting import stage0_meta
    from swarm.pipeline.stage.worker import StageWorker
    from swarm.pipeline.stage.stage_receipts import ReceiptDesk
    from swarm.pipeline.stage.stage_rpc import StageServicer
    from swarm.pipeline.transport.wire import decode_tensors, encode_tensors, pack_metadata, unpack_metadata
    from swarm.run.data import load_dataset

    x_train = load_dataset(RUN.data, RUN.model).x_train
    stage0 = StageWorker(RUN, 0)
    ids = torch.arange(BATCH, dtype=torch.int64)
    honest_h = stage0.infer(x_train[ids])
    driver = ReceiptKey("driver")

    def servicer_at(run: RunConfig, executor) -> tuple[StageServicer, list]:
        worker = StageWorker(run, 1)
        servicer = StageServicer(worker, executor, max_bytes=2**24,
                                 desk=ReceiptDesk(run.run_id, 1, ReceiptKey("layer1"), KeyBook()))
        struck: list = []
        fake = FakeLayer0({"p": honest_h, "q": honest_h.clone()}, run_id=run.run_id)
        servicer.spot0 = Stage0Checker(run, None, KeyBook(), lambda: ["driver", "p", "q"],
                                       lambda p, r, w: struck.append(p), share=1.0, seed=0, call=fake)
        servicer.spot0.credit.update(p=1, q=1)  # their own outputs corroborated here before
        return servicer, struck

    async def send(servicer, op, tensors, meta):
        out, reply = await servicer._handle(encode_tensors(tensors), pack_metadata({**meta, "op": op}),
                                           SimpleNamespace(remote_id="driver"))
        return decode_tensors(out, 2**24, coded=True), unpack_metadata(pack_metadata(reply))

    async def go(executor):
        servicer, struck = servicer_at(RUN, executor)
        made_up = honest_h * 10
        no_ids = {k: v for k, v in stage0_meta(driver, RUN.run_id, "m0", honest_h, ids).items() if k != "ids"}
        wrong_ids = {**stage0_meta(driver, RUN.run_id, "m1", honest_h, ids), "ids": ids_bytes(ids + 1)}
        replies = [await send(servicer, "forward", [honest_h], no_ids),
                   await send(servicer, "forward", [honest_h], wrong_ids),
                   await send(servicer, "forward", [made_up], stage0_meta(driver, RUN.run_id, "m2", made_up, ids)),
                   await send(servicer, "forward", [honest_h], stage0_meta(driver, RUN.run_id, "m3", honest_h, ids))]
        last, last_struck = servicer_at(TWO_STAGES, executor)
        meta = stage0_meta(driver, TWO_STAGES.run_id, "m4", made_up, ids)
        replies.append(await send(last, "forward_backward", [made_up, ids], meta))
        assert last.worker.stats.param_version == 0 and last_struck == ["driver"]  # refused before the update
        return replies, struck, servicer.worker.cache

    executor = ThreadPoolExecutor(max_workers=1)
    try:
        replies, struck, cache = asyncio.run(go(executor))
    finally:
        executor.shutdown()
    codes = [meta.get("code", "ok") for _, meta in replies]
    assert codes == ["bad_receipt", "bad_receipt", "spot_check", "ok", "spot_check"], [m.get("error") for _, m in replies]
    assert struck == ["driver"]
    assert cache.pop(("driver", "m2"), 0.0) is None  # the refused micro-batch's forward was dropped
    assert cache.held_by("driver") == 1  # the honest one's is kept for its backward


def test_the_credit_book_is_bounded_and_outvotes_only_with_more_validated_work():
    from swarm.integrity.spot import CreditBook

    book = CreditBook(max_peers=8)
    for i in range(20):  # a crowd of fresh keys cannot grow it without bound
        book.add(f"k{i}")
    assert len(book.credit) <= 8
    book.credit.clear()
    book.add("honest", 3)
    book.add("a", 1)
    book.add("b", 2)
    assert not book.outvoted("honest", "a", "b") and book.get("honest") == 2  # standing 1 taken off, not struck
    assert not book.outvoted("honest", "a", "b") and book.get("honest") == 1
    book.add("a", 1)
    assert book.outvoted("honest", "a", "b") and book.get("honest") == 0  # 2 > 1: convicted, credit cleared
    assert not book.outvoted("fresh", "x", "y")  # keys with no credit outvote nobody
