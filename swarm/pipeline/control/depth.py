"""How many micro-batches a driver keeps in flight when ``training.in_flight`` is ``auto`` (pure).

A lane sends one micro-batch through every stage and back, then the next: with ``d`` lanes the driver
passes at most ``d / RTT`` micro-batches per second. A far volunteer (tens of ms per hop, several hops)
needs many lanes to keep the swarms busy; a near one needs few, and every extra lane only adds
staleness (updates between a micro-batch's forward and its backward) and saved activations.

The rule is BBR's (Cardwell et al. 2016) applied to micro-batches instead of packets:

- ``rate``: the most micro-batches per second completed in any of the last few windows (the
  bottleneck's delivery rate as this driver sees it);
- ``rtt``: the shortest micro-batch round trip in the last ``RTT_HORIZON_S`` (forward through every
  stage and back, with as little queueing as was seen);
- depth = ``ceil(GAIN x rate x rtt)`` (the bandwidth-delay product with headroom), between 1 and the
  cap (``training.in_flight_max`` and the stages' per-driver limit: memory and staleness bounds).

While the lanes limit the rate (``rate = d / rtt``) the depth grows by ``GAIN`` per decision; once a
stage is the bottleneck, the rate stops growing and the depth settles at ``GAIN`` times the product.
Queueing inflates the round trips at that depth, so every ``PROBE_EVERY_S`` the depth drops to 1 until
one micro-batch went alone (BBR's ProbeRTT): the shortest round trip stays honest.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

GAIN = 1.5
DECIDE_EVERY_S = 2.0
RATE_WINDOW_S = 4.0
RATE_WINDOWS = 3  # the rate is the best of this many recent windows
RTT_HORIZON_S = 30.0
PROBE_EVERY_S = 20.0
START_DEPTH = 2


@dataclass
class DepthController:
    cap: int
    depth: int = START_DEPTH
    rtt_s: float | None = None  # the shortest recent round trip
    rate_per_s: float = 0.0  # the best recent completion rate (micro-batches/s)
    probing: bool = False
    _trips: deque = field(default_factory=deque)  # (finished_at, round trip s)
    _window_start: float | None = None
    _window_count: int = 0
    _rates: deque = field(default_factory=lambda: deque(maxlen=RATE_WINDOWS))
    _next_decision: float = 0.0
    _next_probe: float | None = None  # the first probe comes PROBE_EVERY_S after the first round trip

    def __post_init__(self) -> None:
        self.cap = max(1, int(self.cap))
        self.depth = min(self.depth, self.cap)

    def completed(self, now: float, round_trip_s: float, alone: bool) -> None:
        """A micro-batch finished after ``round_trip_s``; ``alone``: no other was in flight meanwhile."""
        if not math.isfinite(round_trip_s) or round_trip_s <= 0:
            return
        self._trips.append((now, round_trip_s))
        while self._trips and self._trips[0][0] < now - RTT_HORIZON_S:
            self._trips.popleft()
        if self._window_start is None:
            self._window_start = now
        if self._next_probe is None:
            self._next_probe = now + PROBE_EVERY_S
        self._window_count += 1
        if self.probing and alone:
            self.probing = False
            self._next_probe = now + PROBE_EVERY_S

    def decide(self, now: float) -> int:
        """The depth from now on (call often; it changes at most every DECIDE_EVERY_S)."""
        if self._window_start is not None and now - self._window_start >= RATE_WINDOW_S:
            self._rates.append(self._window_count / (now - self._window_start))
            self._window_start, self._window_count = now, 0
        if now < self._next_decision:
            return 1 if self.probing else self.depth
        self._next_decision = now + DECIDE_EVERY_S
        if not self.probing and self._next_probe is not None and now >= self._next_probe and self.depth > 1:
            self.probing = True  # until one micro-batch went alone
            return 1
        if self.probing:
            return 1
        if not self._trips or not self._rates:
            return self.depth
        self.rtt_s = min(trip for _, trip in self._trips)
        self.rate_per_s = max(self._rates)
        self.depth = target_depth(self.rate_per_s, self.rtt_s, self.cap, self.depth)
        return self.depth


def target_depth(rate_per_s: float, rtt_s: float, cap: int, current: int) -> int:
    """``GAIN x rate x rtt`` micro-batches, between 1 and ``cap``, growing at most 2x per decision."""
    wanted = math.ceil(GAIN * rate_per_s * rtt_s - 1e-9)
    return max(1, min(cap, wanted, 2 * max(1, current)))
