"""The exchange orderings a swarm peer can run, simulated with per-node step counters and lag.

``simulate.py`` is the reference: one global clock, and every due edge swaps (both messages made, then
both applied). A swarm has no global clock: each peer counts its own steps, and a peer that joined
later counts from elsewhere; messages take ``lag_ticks`` to cross. This harness runs the same nodes
the way a peer of swarm/averaging/edges.py does, in one of two orderings:

- ``oneway`` (the swarm before the pairing fix): at its own step ``s`` each end of an edge with
  ``s % K == offset`` pushes its message; the receiver applies what arrived at its next step, before
  its gradient step and before it makes its own messages of that step.
- ``swap`` (``pairing.py``): the smaller id starts a swap at its own step; the responder answers with
  its message made before it applies the request, at once (a peer's event loop answers whether or
  not it is stepping); the initiator applies the reply at its next step.

A tick: every awake node (random speeds as in ``simulate.py``) applies its inbox, steps, and makes
its due messages; then the messages due at this tick are delivered. A message made at tick t is
delivered at the end of tick ``t + lag_ticks`` (0: the same tick, as the reference with no delay), a
swap's reply ``lag_ticks`` after its request. With ``lag_ticks = 0``, counters in phase and every node
awake every tick, ``swap`` is exactly the reference (tests/test_ecl_pairing.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from swarm.ecl.graph import PeerGraph, edge_key
from swarm.ecl.pairing import answer_swap, swaps_due
from swarm.ecl.simulate import LOSS_EMA_DECAY, Evaluate, Oracle, SimResult, _record, node_speeds
from swarm.ecl.updates import DecentralizedNode

Ordering = Literal["reference", "oneway", "swap"]
ORDERINGS: tuple[str, ...] = ("reference", "oneway", "swap")
PHASE_RANGE_STEPS = 10_000  # out-of-phase counters start anywhere in [0, this)


@dataclass(frozen=True, kw_only=True, slots=True)
class LiveConfig:
    ticks: int
    eval_every_ticks: int
    ordering: Ordering = "swap"
    lag_ticks: int = 0  # one way: a message is delivered this many ticks after it was made
    out_of_phase: bool = False  # each node's step counter starts at its own seeded value
    seed: int = 0
    speed_range: tuple[float, float] | None = None
    departures: Mapping[str, int] = field(default_factory=dict)  # peer -> tick at which it leaves
    returns: Mapping[str, int] = field(default_factory=dict)  # departed peer -> tick at which it comes back

    def __post_init__(self) -> None:
        if self.ordering not in ("oneway", "swap"):
            raise ValueError(f"LiveConfig.ordering must be 'oneway' or 'swap' (the reference is simulate.py), "
                             f"got {self.ordering!r}")
        if self.lag_ticks < 0 or self.ticks < 0 or self.eval_every_ticks < 1:
            raise ValueError(f"LiveConfig needs lag_ticks >= 0, ticks >= 0 and eval_every_ticks >= 1, got "
                             f"{self.lag_ticks}, {self.ticks}, {self.eval_every_ticks}")


def start_counters(peers: list[str], out_of_phase: bool, seed: int) -> dict[str, int]:
    """Each node's first local step number: 0, or a seeded value per node (peers that joined at
    different times)."""
    if not out_of_phase:
        return {peer: 0 for peer in peers}
    rng = np.random.default_rng([seed, 4])
    return {peer: int(rng.integers(0, PHASE_RANGE_STEPS)) for peer in sorted(peers)}


Message = tuple[str, str, str, object, int]  # (kind, receiver, sender, message, the edge's generation)


@dataclass(slots=True)
class _Wire:
    """Messages on their way, by delivery tick, and the generation of every edge (a new one each time
    the edge is created: a message of an older generation is dropped, as pairing.EdgeGenerations does)."""

    due: dict[int, list[Message]] = field(default_factory=dict)
    # (sender, receiver) of a push on its way, or of a swap until its reply is back: one per edge and way
    in_flight: set[tuple[str, str]] = field(default_factory=set)
    generations: dict[tuple[str, str], int] = field(default_factory=dict)
    created: int = 0

    def send(self, tick: int, kind: str, receiver: str, sender: str, message: object) -> bool:
        if (sender, receiver) in self.in_flight:
            return False  # the previous one is still travelling: skipped, as a peer does
        self.in_flight.add((sender, receiver))
        generation = self.generations[edge_key(sender, receiver)]
        self.due.setdefault(tick, []).append((kind, receiver, sender, message, generation))
        return True

    def current(self, sender: str, receiver: str, generation: int) -> bool:
        return self.generations.get(edge_key(sender, receiver)) == generation

    def adopt(self, graph: PeerGraph) -> None:
        kept = {edge: self.generations[edge] for edge in graph.edges if edge in self.generations}
        for edge in graph.edges:
            if edge not in kept:
                self.created += 1
                kept[edge] = self.created
        self.generations = kept
        self.in_flight = {pair for pair in self.in_flight if edge_key(*pair) in kept}


def simulate_live(nodes: Mapping[str, DecentralizedNode], oracles: Mapping[str, Oracle],
                  rebuild_graph: Callable[[list[str]], PeerGraph], evaluate: Evaluate, config: LiveConfig) -> SimResult:
    """Run ``config.ticks`` ticks of ``config.ordering``; nodes must hold ``rebuild_graph(sorted(nodes))``.
    A departed node drops its edges (a restarted peer's fresh state); when it returns, every edge it
    gets is new (neutral duals at both ends, a new generation)."""
    everyone = dict(sorted(nodes.items()))
    live = dict(everyone)
    graph = rebuild_graph(list(live))
    speeds = node_speeds(list(live), config.speed_range, config.seed)
    wake_rng = np.random.default_rng([config.seed, 2])
    counters = start_counters(list(live), config.out_of_phase, config.seed)
    inbox: dict[str, deque[tuple[str, object, int]]] = {peer: deque() for peer in live}
    wire = _Wire()
    wire.adopt(graph)
    loss_emas: dict[str, float] = {}
    result = SimResult(local_steps={peer: 0 for peer in live})
    _record(result, 0, live, evaluate)
    for tick in range(config.ticks):
        if tick in config.departures.values() or tick in config.returns.values():
            graph = _membership(everyone, live, tick, config, rebuild_graph, wire, inbox)
        draws = wake_rng.random(len(speeds))
        for (peer, speed), draw in zip(speeds.items(), draws):
            if draw >= speed or peer not in live:
                continue
            node = live[peer]
            while inbox[peer]:
                sender, message, generation = inbox[peer].popleft()
                if wire.current(sender, peer, generation):
                    node.on_messages({sender: message})
            loss, grad = oracles[peer](node.params)
            node.step(grad)
            step = counters[peer]
            counters[peer] += 1
            result.local_steps[peer] += 1
            loss_emas[peer] = LOSS_EMA_DECAY * loss_emas.get(peer, loss) + (1 - LOSS_EMA_DECAY) * loss
            _send_due(node, graph, step, tick + config.lag_ticks, config.ordering, wire, result)
        _deliver(live, wire, inbox, tick, config.lag_ticks)
        if (tick + 1) % config.eval_every_ticks == 0:
            _record(result, tick + 1, live, evaluate)
    result.final_params = {peer: node.params.clone() for peer, node in live.items()}
    return result


def _membership(everyone: Mapping[str, DecentralizedNode], live: dict[str, DecentralizedNode], tick: int,
                config: LiveConfig, rebuild_graph: Callable[[list[str]], PeerGraph], wire: _Wire,
                inbox: dict[str, deque[tuple[str, object, int]]]) -> PeerGraph:
    for peer, at in config.departures.items():
        if at == tick and peer in live:
            del live[peer]
            everyone[peer].set_graph(rebuild_graph([peer]))  # alone: its edges and duals are gone
            inbox[peer].clear()
    for peer, at in config.returns.items():
        if at == tick and peer not in live:
            live[peer] = everyone[peer]
    live_sorted = dict(sorted(live.items()))
    live.clear()
    live.update(live_sorted)
    graph = rebuild_graph(list(live))
    wire.adopt(graph)
    for node in live.values():
        node.set_graph(graph)
    return graph


def _send_due(node: DecentralizedNode, graph: PeerGraph, step: int, arrival: int, ordering: str, wire: _Wire,
              result: SimResult) -> None:
    me = node.peer_id
    if ordering == "swap":
        peers, kind = swaps_due(graph, me, step), "request"
    else:
        peers, kind = [peer for peer in graph.neighbours(me) if graph.exchanges_at(me, peer, step)], "push"
    for peer in peers:
        if wire.send(arrival, kind, peer, me, node.make_message(peer)):
            result.exchanges.append((arrival, *edge_key(me, peer)))


def _deliver(live: Mapping[str, DecentralizedNode], wire: _Wire, inbox: dict[str, deque[tuple[str, object, int]]],
             tick: int, lag_ticks: int) -> None:
    """The messages due at ``tick``: pushes and replies wait in the inbox for the receiver's next step;
    a request is answered at once, and its reply goes out ``lag_ticks`` later (the same tick at 0).
    A message whose edge was rebuilt or removed while it travelled is dropped."""
    arriving = wire.due.pop(tick, [])
    while arriving:
        kind, receiver, sender, message, generation = arriving.pop(0)
        if not wire.current(sender, receiver, generation):
            continue  # wire.adopt already cleared the edge's in-flight marks
        if kind != "request":  # a push, or a reply (whose swap was in flight as (receiver, sender))
            wire.in_flight.discard((sender, receiver) if kind == "push" else (receiver, sender))
            inbox[receiver].append((sender, message, generation))
            continue
        reply = answer_swap(live[receiver], sender, message)
        answer = ("reply", sender, receiver, reply, generation)
        if lag_ticks == 0:
            arriving.append(answer)
        else:
            wire.due.setdefault(tick + lag_ticks, []).append(answer)

