"""Bytes on the wire, per link (the remote peer), and the rates they make.

Every RPC this peer serves or calls (stage hops, parameter pulls, edge swaps) counts its tensor
payload bytes against the remote peer's id in one ``Traffic``. ``LinkRates`` turns two readings of
the counters into Mb/s in and out, per link and in all (pure: the node calls it once a heartbeat).

A stranger can make up peer ids as fast as it likes: at most ``MAX_LINKS`` links are kept, and a
new one pushes out the link with the fewest bytes (its bytes stay in the totals).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

MAX_LINKS = 256
MAX_OPS = 32  # ops named in by_op (ours are ~20); a stranger's made-up names go to "other"
SHOWN_LINKS = 8  # the busiest links a snapshot carries


class Traffic:
    """Totals and per-link counters; thread-safe (RPC loop, worker threads and the heartbeat read them)."""

    def __init__(self, max_links: int = MAX_LINKS):
        self.bytes_in = 0
        self.bytes_out = 0
        self.max_links = max_links
        self._links: dict[str, list[int]] = {}  # peer id -> [bytes in, bytes out]
        self.by_op: dict[str, list[int]] = {}  # op -> [bytes in, bytes out]: what the link carries, by purpose
        self._lock = threading.Lock()

    def count(self, peer: str, inbound: int = 0, outbound: int = 0, op: str = "") -> None:
        with self._lock:
            self.bytes_in += inbound
            self.bytes_out += outbound
            if op:
                kind = self.by_op.get(op) or self.by_op.setdefault(op if len(self.by_op) < MAX_OPS else "other", [0, 0])
                kind[0] += inbound
                kind[1] += outbound
            link = self._links.get(peer)
            if link is None:
                if len(self._links) >= self.max_links:
                    del self._links[min(self._links, key=lambda p: sum(self._links[p]))]
                link = self._links[peer] = [0, 0]
            link[0] += inbound
            link[1] += outbound

    def links(self) -> dict[str, tuple[int, int]]:
        with self._lock:
            return {peer: (b[0], b[1]) for peer, b in self._links.items()}


@dataclass(frozen=True, slots=True)
class LinkRate:
    peer_id: str
    mbps_in: float
    mbps_out: float


@dataclass
class LinkRates:
    """Mb/s from successive readings of a Traffic (``update`` once per heartbeat)."""

    _at: float | None = None
    _totals: tuple[int, int] = (0, 0)
    _links: dict[str, tuple[int, int]] = field(default_factory=dict)
    mbps_in: float = 0.0
    mbps_out: float = 0.0
    busiest: tuple[LinkRate, ...] = ()

    def update(self, now_s: float, traffic: Traffic) -> None:
        links, totals = traffic.links(), (traffic.bytes_in, traffic.bytes_out)
        if self._at is not None and now_s > self._at:
            span = now_s - self._at
            self.mbps_in, self.mbps_out = (mbps(totals[0] - self._totals[0], span),
                                           mbps(totals[1] - self._totals[1], span))
            rates = []
            for peer, (now_in, now_out) in links.items():
                then_in, then_out = self._links.get(peer, (0, 0))
                if now_in < then_in or now_out < then_out:  # pushed out and back: its earlier bytes are gone
                    then_in, then_out = 0, 0
                rate = LinkRate(peer, mbps(now_in - then_in, span), mbps(now_out - then_out, span))
                if rate.mbps_in > 0 or rate.mbps_out > 0:
                    rates.append(rate)
            rates.sort(key=lambda r: r.mbps_in + r.mbps_out, reverse=True)
            self.busiest = tuple(rates[:SHOWN_LINKS])
        self._at, self._totals, self._links = now_s, totals, links


def mbps(nbytes: int, seconds: float) -> float:
    """Megabits per second (10^6 bits, as links are sold)."""
    return max(0, nbytes) * 8 / 1e6 / seconds if seconds > 0 else 0.0
