"""Dial-back reachability (swarm/dht/reachability.py): which addresses a peer dials for a stranger, the
verdict from the answers, the probe against a real libp2p listener, and the responder's bounds. A node
behind NAT in the network lab: tests/test_netlab.py."""

from __future__ import annotations

import asyncio
import socket

import pytest

from swarm.dht.reachability import (
    DIAL_OP, MAX_DIALS_PER_MINUTE, MAX_MADDRS, RATE_PERIOD_S, REACHABLE, UNKNOWN, UNREACHABLE, DialBackServicer, dial_target,
    dialable_maddrs, is_loopback_only, probe, verdict_from,
)
from swarm.pipeline.transport.wire import pack_metadata

ME = ["/ip4/203.0.113.7/tcp/4001"]


def test_only_plain_tcp_addresses_off_the_responders_own_machine_are_dialled():
    assert dial_target("/ip4/203.0.113.7/tcp/4001") == ("203.0.113.7", 4001)
    assert dial_target("/ip4/10.0.0.2/tcp/4001/p2p/QmPeer") == ("10.0.0.2", 4001)  # a LAN run is fine
    assert dial_target("/ip6/2001:db8::1/tcp/4001") == ("2001:db8::1", 4001)
    for refused in ("/ip4/127.0.0.1/tcp/22", "/ip4/0.0.0.0/tcp/4001", "/ip6/::1/tcp/4001", "/ip4/169.254.1.1/tcp/80",
                    "/ip4/224.0.0.1/tcp/80", "/ip4/203.0.113.7/udp/4001/quic-v1", "/dns4/example.org/tcp/80",
                    "/ip4/203.0.113.7/tcp/0", "/ip4/203.0.113.7/tcp/99999", "/ip4/not-an-ip/tcp/1", "/ip6/1.2.3.4/tcp/1",
                    "/ip4/203.0.113.7/tcp/4001/p2p-circuit", "ip4/203.0.113.7/tcp/1", ""):
        assert dial_target(refused) is None, refused
    assert is_loopback_only(["/ip4/127.0.0.1/tcp/1/p2p/Qm", "/ip6/::1/tcp/2"])
    assert not is_loopback_only(["/ip4/127.0.0.1/tcp/1", "/ip4/10.0.0.2/tcp/1"]) and not is_loopback_only([])
    many = [f"/ip4/10.0.0.{i}/tcp/1/p2p/Qm" for i in range(1, 9)] + ["/ip4/127.0.0.1/tcp/1"]
    assert dialable_maddrs(many) == [f"/ip4/10.0.0.{i}/tcp/1" for i in range(1, MAX_MADDRS + 1)]


def test_one_peer_that_reached_us_is_enough_and_one_liar_cannot_make_us_unreachable():
    reached = verdict_from(ME, [{ME[0]: "refused"}, {ME[0]: "libp2p"}, None])
    assert reached.status == REACHABLE and reached.record_value == 1 and reached.reached_at == (ME[0],)
    assert "1 of 2 peer(s)" in reached.detail
    alone = verdict_from(ME, [{ME[0]: "timeout"}, None, None])
    assert alone.status == UNKNOWN and alone.record_value == -1, "one answer cannot tell NAT from a liar"
    behind = verdict_from(ME, [{ME[0]: "timeout"}, {ME[0]: "no_route"}, None])
    assert behind.status == UNREACHABLE and behind.record_value == 0
    assert "no_route" in behind.detail and "timeout" in behind.detail
    # a result for an address we did not ask about proves nothing, either way
    assert verdict_from(ME, [{"/ip4/198.51.100.1/tcp/1": "libp2p"}, {ME[0]: "refused"}]).status == UNKNOWN
    assert verdict_from([], []).status == UNKNOWN and "network.listen" in verdict_from([], []).detail
    # peers on this machine skip our addresses: volunteers that share a machine and listen on every
    # interface must not all call each other unreachable (nobody would route to anybody)
    same_machine = verdict_from(ME, [{ME[0]: "skipped"}, {ME[0]: "skipped"}, {ME[0]: "skipped"}])
    assert same_machine.status == UNKNOWN and same_machine.record_value == -1


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_the_probe_tells_a_libp2p_listener_from_a_silent_port_and_a_closed_one():
    from hivemind import DHT

    dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        port = int(str(dht.get_visible_maddrs()[0]).split("/")[4])
        assert _run(probe("127.0.0.1", port)) == "libp2p"
    finally:
        dht.shutdown()
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        assert _run(probe("127.0.0.1", silent.getsockname()[1], timeout_s=0.5)) == "not_libp2p"
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        free_port = closed.getsockname()[1]
    assert _run(probe("127.0.0.1", free_port, timeout_s=2.0)) == "refused"


def test_the_responder_checks_the_request_and_limits_each_requester():
    clock = [1000.0]
    servicer = DialBackServicer("run-1", monotonic=lambda: clock[0])

    def ask(meta, requester="QmA"):
        return _run(servicer.answer(pack_metadata(meta), requester))

    good = {"op": DIAL_OP, "run_id": "run-1", "maddrs": ["/ip4/127.0.0.1/tcp/22"]}
    assert ask(good) == {"ok": True, "results": {"/ip4/127.0.0.1/tcp/22": "skipped"}}, "never its own machine"
    assert ask(good)["code"] == "rate_limited"
    assert ask(good, requester="QmB")["ok"] is True, "the limit is per requester"
    clock[0] += RATE_PERIOD_S
    assert ask(good)["ok"] is True
    assert ask({**good, "run_id": "other"}, "QmC")["code"] == "wrong_run"
    assert ask({**good, "op": "params"}, "QmC")["code"] == "rejected"
    for bad in ([], ["/ip4/1.2.3.4/tcp/1"] * (MAX_MADDRS + 1), [7], ["x" * 300], "not a list"):
        assert ask({**good, "maddrs": bad}, "QmC")["code"] == "rejected", bad
    assert _run(servicer.answer(b"\xc1garbage", "QmD"))["code"] == "rejected"


def test_fresh_identities_cannot_make_a_peer_dial_faster_than_its_global_limit():
    clock = [1000.0]
    servicer = DialBackServicer("run-1", monotonic=lambda: clock[0])
    meta = pack_metadata({"op": DIAL_OP, "run_id": "run-1", "maddrs": ["/ip4/127.0.0.1/tcp/22"]})
    codes = [_run(servicer.answer(meta, f"QmSybil{i}")).get("code", "ok") for i in range(MAX_DIALS_PER_MINUTE + 5)]
    assert codes.count("ok") == MAX_DIALS_PER_MINUTE and codes[-5:] == ["busy"] * 5
    clock[0] += 60.0
    assert _run(servicer.answer(meta, "QmLate")).get("ok") is True, "the limit is per minute"


@pytest.mark.parametrize("requesters", [5])
def test_a_crowd_of_requesters_is_served_at_most_a_few_at_a_time(requesters):
    servicer = DialBackServicer("run-1")
    with socket.socket() as silent:  # each probe waits for a header that never comes
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]

        async def crowd():
            import swarm.dht.reachability as reach

            # probes of loopback are refused by dial_target; dial this silent listener through a stand-in
            real = reach.dial_target
            reach.dial_target = lambda maddr: ("127.0.0.1", port)
            try:
                meta = pack_metadata({"op": DIAL_OP, "run_id": "run-1", "maddrs": ["/ip4/10.0.0.9/tcp/1"]})
                return await asyncio.gather(*(servicer.answer(meta, f"Qm{i}") for i in range(requesters)))
            finally:
                reach.dial_target = real

        answers = _run(crowd())
    codes = [a.get("code", "ok") for a in answers]
    assert codes.count("ok") == 2 and codes.count("busy") == requesters - 2, codes


def test_a_check_soon_after_one_that_could_not_tell_asks_other_peers_and_counts_the_earlier_answers(monkeypatch):
    """Each responder serves a requester once per RATE_PERIOD_S: a retry asks peers that have not answered lately
    (the others would refuse it), and one answer from each of two checks tells what two answers to one check do."""
    import swarm.dht.reachability as reach
    from swarm.dht.reachability import RecentAnswers, check_reachability

    mine = "/ip4/10.0.0.5/tcp/4001"
    replies = {"a": {mine: "timeout"}, "b": None, "c": None, "d": {mine: "no_route"}}
    asked: list[str] = []

    async def ask(p2p, peer, run_id, maddrs):
        asked.append(peer)
        return replies[peer]

    class P2P:
        async def get_visible_maddrs(self):
            return [mine + "/p2p/QmMe", "/ip4/127.0.0.1/tcp/4001/p2p/QmMe"]

    monkeypatch.setattr(reach, "ask_dial_back", ask)
    clock = [100.0]
    recent = RecentAnswers(monotonic=lambda: clock[0])
    first = _run(check_reachability(P2P(), "run-1", ["a", "b", "c"], recent=recent))
    assert first.status == UNKNOWN and sorted(asked) == ["a", "b", "c"], (first, asked)
    asked.clear()
    clock[0] += 5.0
    second = _run(check_reachability(P2P(), "run-1", ["a", "b", "c", "d"], recent=recent))
    assert "a" not in asked, "a served us 5 s ago: it would refuse (rate_limited)"
    assert second.status == UNREACHABLE and second.answered == 2, second
    clock[0] += RATE_PERIOD_S
    assert recent.answered_lately() == set(), "answers older than a period are forgotten"
    alone = _run(check_reachability(P2P(), "run-1", ["b"]))  # no memory (`volunteer doctor`): one check
    assert alone.status == UNKNOWN


# ----- the node's side (volunteer/node/reachability.py), on a stand-in node
class _Peer:
    def __init__(self, verdicts):
        self.verdicts, self.asked = list(verdicts), []

    def check_reachability(self, responders):
        import concurrent.futures

        self.asked.append(responders)
        future = concurrent.futures.Future()
        future.set_result(self.verdicts.pop(0))
        return future


class _Record:
    def __init__(self, peer_id, state="online"):
        self.peer_id, self.state = peer_id, state


def _node(swarm: str, auto: bool, verdicts):
    from types import SimpleNamespace

    from volunteer.node.board import Board
    from volunteer.snapshot import NodeSnapshot, NodeState

    node = SimpleNamespace(swarm=swarm, peer=_Peer(verdicts), moves=[], announced=[])
    node.board = Board(NodeSnapshot(run_name="r", run_id="r-1", swarm=swarm, peer_id="me", state=NodeState.ONLINE))
    node.announcer = SimpleNamespace(views={"layer0": [_Record("me"), _Record("d")],
                                            "layer2": [_Record("s"), _Record("gone", "offline")]},
                                     announce=lambda: node.announced.append(True))
    node.rebalancer = SimpleNamespace(enabled=auto)
    node.move_to = lambda target, why: node.moves.append((target, why))
    return node


def test_a_node_that_nobody_can_dial_says_so_stops_being_routed_and_an_auto_one_moves_to_layer0():
    from swarm.dht.reachability import Verdict
    from volunteer.node.reachability import FIRST_CHECK_S, RECHECK_S, RETRY_FIRST_S, RETRY_JITTER, Reachability

    behind = Verdict(UNREACHABLE, "2 peer(s) could not dial /ip4/10.78.4.2/tcp/4001 (no_route)", answered=2)
    node = _node("layer2", auto=False, verdicts=[behind])
    part = Reachability(node)
    part.tick(0.0)
    assert node.peer.asked == [] and part.record_value == -1, "waits a little after going online"
    part.tick(FIRST_CHECK_S)
    assert node.peer.asked == [["d", "s"]], "asks online peers other than itself"
    assert node.board.snapshot().reachability == "checking"
    part.tick(FIRST_CHECK_S + 1)
    snap = node.board.snapshot()
    assert (snap.reachability, part.record_value, node.announced) == ("unreachable", 0, [True]), "announced at once"
    assert snap.reachability_at is not None and "no_route" in snap.reachability_detail
    assert "cannot serve layer2" in snap.events[-1].text and snap.events[-1].level.value == "warning"
    assert "no driver can send layer2 work" in part.cut_off_reason() and node.moves == []
    part.tick(FIRST_CHECK_S + RECHECK_S - 5)
    assert len(node.peer.asked) == 1, "checks again only after RECHECK_S"

    auto = _node("layer2", auto=True, verdicts=[behind])
    part = Reachability(auto)
    for now in (0.0, FIRST_CHECK_S, FIRST_CHECK_S + 1):
        part.tick(now)
    assert [target for target, _ in auto.moves] == ["layer0"]

    driver = _node("layer0", auto=False, verdicts=[behind])
    part = Reachability(driver)
    for now in (0.0, FIRST_CHECK_S, FIRST_CHECK_S + 1):
        part.tick(now)
    assert part.record_value == 0 and part.cut_off_reason() == "" and driver.moves == [], "layer0 needs no inbound"

    # an unknown answer keeps what was known, and is asked again sooner
    flaky = _node("layer1", auto=False, verdicts=[Verdict(REACHABLE, "1 of 3 peer(s) dialled us"),
                                                   Verdict(UNKNOWN, "0 of 3 answered")])
    part = Reachability(flaky)
    for now in (0.0, FIRST_CHECK_S, FIRST_CHECK_S + 1, FIRST_CHECK_S + 1 + RECHECK_S, FIRST_CHECK_S + 2 + RECHECK_S):
        part.tick(now)
    assert part.record_value == 1 and flaky.board.snapshot().reachability == "reachable"
    asked_again = FIRST_CHECK_S + 2 + RECHECK_S
    assert len(flaky.peer.asked) == 2
    assert asked_again + RETRY_FIRST_S <= part._next_at <= asked_again + RETRY_FIRST_S * (1 + RETRY_JITTER)


def test_a_node_on_loopback_only_knows_it_at_its_first_check_with_nobody_to_ask():
    """A node that drives nothing reads the other swarms every few heartbeats: alone in its swarm it has nobody to
    ask at first. On loopback only it needs nobody (the check says so at once); elsewhere it is retried soon."""
    from swarm.dht.reachability import LOCAL, Verdict
    from volunteer.node.reachability import FIRST_CHECK_S, RETRY_FIRST_S, Reachability

    for verdict, status in ((Verdict(LOCAL, "this node listens on loopback only"), "local"),
                            (Verdict(UNKNOWN, "no other online peer to ask yet"), "unknown")):
        node = _node("layer1", auto=False, verdicts=[verdict])
        node.announcer.views = {"layer1": [_Record("me")]}
        part = Reachability(node)
        part.tick(0.0)
        part.tick(FIRST_CHECK_S)
        assert node.peer.asked == [[]] and node.board.snapshot().reachability_detail == \
            "no other online peer to ask yet"
        part.tick(FIRST_CHECK_S + 1)
        assert node.board.snapshot().reachability == status
        if status == "unknown":
            assert part._next_at <= FIRST_CHECK_S + 1 + 2 * RETRY_FIRST_S, "retried soon"


def test_a_check_that_cannot_tell_is_retried_soon_then_less_often_until_one_tells():
    """Peers that came online together are each other's only responders, and a busy one refuses: the first retry
    comes within seconds (one behind NAT stays in the drivers' routes until it knows), later ones back off to
    RETRY_S, and a verdict that tells resets the backoff."""
    from swarm.dht.reachability import Verdict
    from volunteer.node.reachability import FIRST_CHECK_S, RECHECK_S, RETRY_FIRST_S, RETRY_JITTER, RETRY_S, Reachability

    unknown = Verdict(UNKNOWN, "1 of 3 asked peer(s) could try our addresses; need 2 to tell")
    node = _node("layer1", auto=False, verdicts=[unknown] * 5 + [Verdict(REACHABLE, "2 of 2 peer(s) dialled us")])
    part = Reachability(node)
    part.tick(0.0)
    now, delays = FIRST_CHECK_S, []
    for _ in range(6):
        part.tick(now)  # asks
        part.tick(now + 1)  # adopts
        delays.append(part._next_at - (now + 1))
        now = part._next_at
    assert len(node.peer.asked) == 6 and part.record_value == 1
    expected = [min(RETRY_S, RETRY_FIRST_S * 2 ** k) for k in range(5)]
    assert all(d <= e * (1 + RETRY_JITTER) and d >= e for d, e in zip(delays, expected)), (delays, expected)
    assert delays[-1] == RECHECK_S and part._unknowns == 0, "a verdict that tells resets the backoff"
