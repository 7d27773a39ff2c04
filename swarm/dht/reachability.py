"""Can strangers dial this node? A dial-back check, and the verdict a node behind NAT acts on.

A node asks up to ``ASK_PEERS`` online peers of the run to open a TCP connection to each address it
listens on (its visible multiaddrs) and to tell whether a libp2p listener answered there: go-libp2p
writes the multistream header (``MULTISTREAM_HEADER``) as soon as it accepts a connection, so the
answer needs no libp2p handshake and proves more than an open port. One RPC, in the run's namespace
``{run_id}.reach``::

    request metadata  {"op": "dial_back", "run_id": ..., "maddrs": [up to MAX_MADDRS multiaddrs]}
    reply metadata    {"ok": true, "results": {maddr: "libp2p" | "refused" | "timeout" | "no_route" |
                                               "not_libp2p" | "skipped"}}
                      or {"ok": false, "code": "busy" | "rate_limited" | "wrong_run" | "rejected", "error": ...}

The verdict (``verdict_from``): **reachable** when any peer reached a libp2p listener at one of our
addresses; **unreachable** when at least ``UNREACHABLE_QUORUM`` peers answered and none reached us (one
lying peer cannot make a node believe it is behind NAT); **unknown** otherwise (too few peers answered).
A node whose every address is loopback is **local**: its run lives on this machine, nothing to check.

What an unreachable node does (volunteer/node/reachability.py, swarm/pipeline/peer.py): it announces
``reachable: 0`` in its record, so nobody routes to it, pulls from it or pairs with it; it still
joins, drives (layer0) and pulls, because all of that dials out.

A stranger may use a peer's dial-back to make it open connections: bounded. The responder dials only
``/ip4|ip6/ADDR/tcp/PORT`` addresses that are not loopback, unspecified, multicast, link-local or its own
interfaces' (no probe of its own machine's services, and no "reachable" from a peer on the same host), at most ``MAX_MADDRS`` per request, one request per requester
every ``RATE_PERIOD_S``, ``MAX_DIALS_PER_MINUTE`` from everyone, ``MAX_CONCURRENT`` at once; it sends nothing and reads only the header, and
it reports only whether a libp2p listener answered.

Known limit: a peer on the asker's own LAN can dial a private address that nobody outside can, so one
such peer makes a node behind NAT "reachable" until the next check (every 10 minutes, other peers).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from swarm.pipeline.transport.wire import WireError, pack_metadata, unpack_metadata

logger = logging.getLogger(__name__)

DIAL_OP = "dial_back"
MULTISTREAM_HEADER = b"\x13/multistream/1.0.0\n"
PROBE_TIMEOUT_S = 3.0  # per address: a home link answers a SYN within a second
ASK_TIMEOUT_S = 4 * PROBE_TIMEOUT_S + 5.0  # MAX_MADDRS probes run at once; slack for a loaded responder
MAX_MADDRS = 4
RATE_PERIOD_S = 30.0
MAX_CONCURRENT = 2
ASK_PEERS = 3
UNREACHABLE_QUORUM = 2
MAX_RATE_ENTRIES = 4096  # requesters remembered for the rate limit
MAX_DIALS_PER_MINUTE = 20  # requests served per minute from everyone: peer ids are free, so the per-requester
# limit alone let a crowd of fresh identities make a peer dial whatever they name, as fast as refusals come back
CHECK_TIMEOUT_S = 60.0  # a whole check (addresses, then the asked peers), bounded

REACHABLE, UNREACHABLE, UNKNOWN, LOCAL, CHECKING = "reachable", "unreachable", "unknown", "local", "checking"
OUTCOMES = ("libp2p", "refused", "timeout", "no_route", "not_libp2p", "skipped")


def namespace(run_id: str) -> str:
    return f"{run_id}.reach"


# ----- addresses
def dial_target(maddr: str) -> tuple[str, int] | None:
    """(host, port) of a multiaddr this node may dial for a stranger, or None (not ip+tcp, or an address
    of the responder's own machine or link: loopback, unspecified, multicast, link-local)."""
    parts = maddr.split("/")
    if len(parts) < 5 or parts[0] != "" or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
        return None
    if len(parts) > 5 and parts[5] not in ("p2p", "ipfs"):
        return None  # /quic-v1, /ws, /p2p-circuit...: not a plain TCP listener
    try:
        address = ipaddress.ip_address(parts[2])
        port = int(parts[4])
    except ValueError:
        return None
    if address.version != (4 if parts[1] == "ip4" else 6) or not 1 <= port <= 65535:
        return None
    if address.is_loopback or address.is_unspecified or address.is_multicast or address.is_link_local:
        return None
    return str(address), port


def own_addresses() -> set[str]:
    """This machine's interface addresses: a responder never dials itself (a node and `volunteer doctor`
    on one machine, or two volunteers on it, would prove nothing about the outside)."""
    try:
        import psutil

        return {a.address.split("%", 1)[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    except Exception:  # psutil missing or the interface table unreadable: only dial_target's rules
        return set()


def is_loopback_only(maddrs: Sequence[str]) -> bool:
    """True when every ip address among maddrs is loopback (a run on this machine only)."""
    hosts = []
    for maddr in maddrs:
        parts = maddr.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
            try:
                hosts.append(ipaddress.ip_address(parts[2]))
            except ValueError:
                continue
    return bool(hosts) and all(host.is_loopback for host in hosts)


def dialable_maddrs(maddrs: Sequence[str]) -> list[str]:
    """The addresses worth asking about: ip+tcp, not loopback, without the /p2p/ suffix, deduplicated."""
    seen: dict[str, None] = {}
    for maddr in maddrs:
        base = maddr.split("/p2p/", 1)[0]
        if dial_target(base) is not None:
            seen.setdefault(base, None)
    return list(seen)[:MAX_MADDRS]


async def probe(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """Open a TCP connection to host:port and wait for the multistream header; one of OUTCOMES."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except asyncio.TimeoutError:
        return "timeout"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "no_route"  # network or host unreachable: a private address of someone else's LAN
    try:
        header = await asyncio.wait_for(reader.readexactly(len(MULTISTREAM_HEADER)), timeout_s)
        return "libp2p" if header == MULTISTREAM_HEADER else "not_libp2p"
    except (asyncio.TimeoutError, asyncio.IncompleteReadError, OSError):
        return "not_libp2p"
    finally:
        writer.close()


# ----- the responder
class DialBackServicer(ServicerBase):
    """Answers dial-back requests of one run. Built with no arguments it only lends its signatures."""

    def __init__(self, run_id: str = "", monotonic=time.monotonic):
        self.run_id = run_id
        self.monotonic = monotonic
        self._last: dict[str, float] = {}
        self._served: deque[float] = deque()  # when the requests of the last minute were served
        self._active = 0

    async def rpc_dial_back(self, request: runtime_pb2.ExpertRequest,
                            context: P2PContext) -> runtime_pb2.ExpertResponse:
        reply = await self.answer(request.metadata, str(context.remote_id))
        return runtime_pb2.ExpertResponse(metadata=pack_metadata(reply))

    async def answer(self, metadata: bytes, requester: str) -> dict:
        try:
            meta = unpack_metadata(metadata)
        except WireError as exc:
            return _refusal("rejected", str(exc))
        if meta.get("op") != DIAL_OP:
            return _refusal("rejected", f"expected op {DIAL_OP!r}")
        if meta.get("run_id") != self.run_id:
            return _refusal("wrong_run", f"this peer answers dial-backs of run {self.run_id}")
        maddrs = meta.get("maddrs")
        if not isinstance(maddrs, list) or not 1 <= len(maddrs) <= MAX_MADDRS or \
                not all(isinstance(m, str) and len(m) <= 256 for m in maddrs):
            return _refusal("rejected", f"maddrs must be a list of 1-{MAX_MADDRS} multiaddr strings")
        now = self.monotonic()
        if now - self._last.get(requester, -RATE_PERIOD_S) < RATE_PERIOD_S:
            return _refusal("rate_limited", f"one dial-back per peer every {RATE_PERIOD_S:g} s")
        if self._active >= MAX_CONCURRENT:
            return _refusal("busy", "dialling back other peers; ask another")
        while self._served and now - self._served[0] >= 60.0:
            self._served.popleft()
        if len(self._served) >= MAX_DIALS_PER_MINUTE:
            return _refusal("busy", f"served {MAX_DIALS_PER_MINUTE} dial-backs this minute; ask another")
        self._served.append(now)
        if len(self._last) >= MAX_RATE_ENTRIES:
            self._last = {peer: t for peer, t in self._last.items() if now - t < RATE_PERIOD_S}
        self._last[requester] = now
        self._active += 1
        try:
            own = own_addresses()
            targets = [target if target is not None and target[0] not in own else None
                       for target in map(dial_target, maddrs)]
            outcomes = await asyncio.gather(*(probe(*target) if target else _skipped() for target in targets))
        finally:
            self._active -= 1
        logger.debug("dial-back for %s: %s", requester[-8:], dict(zip(maddrs, outcomes)))
        return {"ok": True, "results": dict(zip(maddrs, outcomes))}


async def _skipped() -> str:
    return "skipped"


def _refusal(code: str, error: str) -> dict:
    return {"ok": False, "code": code, "error": error}


# ----- the asker
@dataclass(frozen=True, slots=True)
class Verdict:
    status: str  # REACHABLE, UNREACHABLE, UNKNOWN or LOCAL
    detail: str
    answered: int = 0  # peers that dialled us back
    reached_at: tuple[str, ...] = field(default_factory=tuple)  # our addresses a peer reached

    @property
    def record_value(self) -> int:
        """The record's ``reachable`` field: 1 yes, 0 no, -1 not known."""
        return {REACHABLE: 1, UNREACHABLE: 0}.get(self.status, -1)


def verdict_from(maddrs: Sequence[str], answers: Sequence[dict | None]) -> Verdict:
    """Pure: the verdict from each asked peer's results (None: it did not answer or refused)."""
    if not maddrs:
        return Verdict(UNKNOWN, "this node has no address another host could dial (it listens on loopback "
                                "only, or on no TCP address); set network.listen")
    # an answer where every address was skipped (the responder runs on this machine) tells nothing
    results = [a for a in answers if a is not None and any(a.get(m, "skipped") != "skipped" for m in maddrs)]
    reached = sorted({m for a in results for m, outcome in a.items() if outcome == "libp2p" and m in maddrs})
    if reached:
        return Verdict(REACHABLE, f"{sum(any(a.get(m) == 'libp2p' for m in maddrs) for a in results)} of "
                                  f"{len(results)} peer(s) dialled us at {', '.join(reached)}",
                       answered=len(results), reached_at=tuple(reached))
    if len(results) >= UNREACHABLE_QUORUM:
        seen = sorted({outcome for a in results for m, outcome in a.items() if m in maddrs})
        return Verdict(UNREACHABLE, f"{len(results)} peer(s) could not dial {', '.join(maddrs)} "
                                    f"({', '.join(seen) or 'no answer'})", answered=len(results))
    return Verdict(UNKNOWN, f"{len(results)} of {len(answers)} asked peer(s) could try our addresses (a peer on "
                            f"this machine does not); need {UNREACHABLE_QUORUM} to tell", answered=len(results))


async def ask_dial_back(p2p, peer_id: str, run_id: str, maddrs: Sequence[str],
                        timeout_s: float = ASK_TIMEOUT_S) -> dict | None:
    """One peer's results for our addresses, or None (no answer, a refusal, a malformed reply)."""
    stub = DialBackServicer.get_stub(p2p, PeerID.from_base58(peer_id), namespace=namespace(run_id))
    request = runtime_pb2.ExpertRequest(metadata=pack_metadata({"op": DIAL_OP, "run_id": run_id,
                                                                "maddrs": list(maddrs)}))
    try:
        reply = await asyncio.wait_for(stub.rpc_dial_back(request), timeout_s)
        meta = unpack_metadata(reply.metadata)
    except Exception as exc:  # a peer that cannot answer counts as no answer
        logger.debug("dial-back by %s failed: %s", peer_id[-8:], exc)
        return None
    results = meta.get("results")
    if meta.get("ok") is not True or not isinstance(results, dict):
        logger.debug("dial-back by %s refused: %s", peer_id[-8:], meta.get("error"))
        return None
    return {m: o for m, o in results.items() if isinstance(m, str) and o in OUTCOMES}


class RecentAnswers:
    """The answers a node got to its dial-backs over the last ``RATE_PERIOD_S`` (a responder serves one requester
    once a period): a check soon after one that could not tell asks peers that have not answered lately, and its
    verdict counts every answer still recent for the same addresses, so two checks that got one answer each tell
    what one check that got two would. Loop thread only."""

    def __init__(self, monotonic=time.monotonic):
        self.monotonic = monotonic
        self._answers: dict[str, tuple[float, tuple[str, ...], dict]] = {}  # peer -> (when, our maddrs, results)

    def _prune(self) -> float:
        now = self.monotonic()
        self._answers = {peer: a for peer, a in self._answers.items() if now - a[0] < RATE_PERIOD_S}
        return now

    def answered_lately(self) -> set[str]:
        self._prune()
        return set(self._answers)

    def add(self, peer: str, maddrs: Sequence[str], results: dict) -> None:
        self._answers[peer] = (self._prune(), tuple(maddrs), results)

    def for_maddrs(self, maddrs: Sequence[str]) -> dict[str, dict]:
        self._prune()
        return {peer: results for peer, (_, asked, results) in self._answers.items() if asked == tuple(maddrs)}


async def check_reachability(p2p, run_id: str, responders: Sequence[str], rng: random.Random | None = None,
                             ask_peers: int = ASK_PEERS, recent: RecentAnswers | None = None) -> Verdict:
    """Ask up to ask_peers of responders (peer ids, not ours) to dial our visible addresses; at most
    ``CHECK_TIMEOUT_S`` in all (then: unknown). ``recent``: the node's answers of the last period, read and
    added to (None: a check on its own, as `volunteer doctor` makes)."""
    try:
        return await asyncio.wait_for(_check(p2p, run_id, responders, rng, ask_peers, recent or RecentAnswers()),
                                      CHECK_TIMEOUT_S)
    except asyncio.TimeoutError:
        return Verdict(UNKNOWN, f"the check took over {CHECK_TIMEOUT_S:.0f} s")


async def _check(p2p, run_id: str, responders: Sequence[str], rng: random.Random | None, ask_peers: int,
                 recent: RecentAnswers) -> Verdict:
    visible = [str(m) for m in await p2p.get_visible_maddrs()]
    if is_loopback_only(visible):
        return Verdict(LOCAL, "this node listens on loopback only: a run on this machine, nothing to check")
    maddrs = dialable_maddrs(visible)
    if not maddrs:
        return verdict_from([], [])
    lately = recent.answered_lately()
    chosen = [peer for peer in responders if peer not in lately]  # the others would refuse: rate_limited
    (rng or random.Random()).shuffle(chosen)
    chosen = chosen[:ask_peers]
    if not chosen and not recent.for_maddrs(maddrs):
        return Verdict(UNKNOWN, "no other online peer to ask yet")
    answers = await asyncio.gather(*(ask_dial_back(p2p, peer, run_id, maddrs) for peer in chosen))
    for peer, answer in zip(chosen, answers):
        if answer is not None:
            recent.add(peer, maddrs, answer)
    earlier = [answer for peer, answer in recent.for_maddrs(maddrs).items() if peer not in chosen]
    return verdict_from(maddrs, [*answers, *earlier])


def advice(verdict: Verdict, swarm: str | None = None) -> str:
    """What a user behind NAT can do, in words ("" unless unreachable). swarm: the node's (None: a check
    before any node runs, `volunteer doctor`)."""
    if verdict.status != UNREACHABLE:
        return ""
    if swarm is None:
        serving = "a node here can drive and average in layer0, which only dials out, but serve no other swarm"
    elif swarm == "layer0":
        serving = "it still drives and averages, since that only dials out"
    else:
        serving = f"it cannot serve {swarm} (drivers must dial it); join layer0, which only dials out, or use --swarm auto"
    return (f"other peers cannot dial this machine: {serving}. To serve any swarm, forward a TCP port of your router "
            "to this machine, listen on it (network.listen) and announce your public address (network.announce); "
            "until then, network.client_mode: true spares the DHT from dialling you")
