"""A deterministic, single-process simulation of N nodes training over a peer graph.

Time runs in ticks; a full-speed node does one local step per tick. Every tick:
1. peers whose departure tick has come leave: the graph is rebuilt from the remaining ids and every
   remaining node gets it (``set_graph``), exactly as a swarm peer would on a new DHT view;
2. each node that is awake this tick (always, or with probability ``speed`` when speeds are on)
   computes its gradient through its oracle and takes a local step;
3. every edge due at this tick (``graph.edges_at(tick)``: every K ticks at the edge's offset) swaps
   messages: both ends' messages are made first, then each node receives all of its messages of the
   tick at once; with ``delay_ticks`` > 0 they arrive that many ticks later instead (a network whose
   latency spans several local steps), and a message whose edge is gone by then is dropped;
4. the swarm-level hook runs (best-model exchange uses it), then evaluation when due.

Everything random comes from generators seeded by ``SimConfig.seed``, so a run is reproducible.
The nodes are the real update classes of ``updates.py`` and ``gossip.py``: nothing here is specific
to one method.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from swarm.ecl.graph import PeerGraph
from swarm.ecl.updates import DecentralizedNode

Oracle = Callable[[torch.Tensor], tuple[float, torch.Tensor]]  # params -> (loss, gradient)
Evaluate = Callable[[Mapping[str, torch.Tensor]], float]  # parameters by peer -> a metric
SwarmHook = Callable[[int, Mapping[str, DecentralizedNode], Mapping[str, float]], None]  # tick, nodes, loss EMAs
LOSS_EMA_DECAY = 0.9


@dataclass(frozen=True, kw_only=True, slots=True)
class SimConfig:
    ticks: int
    eval_every_ticks: int
    seed: int = 0
    speed_range: tuple[float, float] | None = None  # per-node chance of stepping in a tick; None: always
    departures: Mapping[str, int] = field(default_factory=dict)  # peer -> tick at which it leaves
    record_exchanges: bool = False
    delay_ticks: int = 0  # messages arrive this many ticks after they were made

    def __post_init__(self) -> None:
        if self.delay_ticks < 0:
            raise ValueError(f"SimConfig.delay_ticks must be >= 0, got {self.delay_ticks}")
        if self.ticks < 0 or self.eval_every_ticks < 1:
            raise ValueError(f"SimConfig needs ticks >= 0 and eval_every_ticks >= 1, got {self.ticks}, "
                             f"{self.eval_every_ticks}")
        if self.speed_range is not None:
            low, high = self.speed_range
            if not 0 < low <= high <= 1:
                raise ValueError(f"SimConfig.speed_range must satisfy 0 < low <= high <= 1, got {self.speed_range}")


@dataclass(slots=True)
class SimResult:
    eval_ticks: list[int] = field(default_factory=list)
    metrics: list[float] = field(default_factory=list)
    exchanges: list[tuple[int, str, str]] = field(default_factory=list)  # (tick, smaller id, larger id)
    local_steps: dict[str, int] = field(default_factory=dict)
    final_params: dict[str, torch.Tensor] = field(default_factory=dict)


def node_speeds(peers: list[str], speed_range: tuple[float, float] | None, seed: int) -> dict[str, float]:
    """Each node's chance of stepping in a tick, drawn once from the seed (1.0 when speeds are off)."""
    if speed_range is None:
        return {peer: 1.0 for peer in peers}
    rng = np.random.default_rng([seed, 1])
    return {peer: float(rng.uniform(*speed_range)) for peer in sorted(peers)}


def simulate(
    nodes: Mapping[str, DecentralizedNode],
    oracles: Mapping[str, Oracle],
    rebuild_graph: Callable[[list[str]], PeerGraph],
    evaluate: Evaluate,
    config: SimConfig,
    swarm_hook: SwarmHook | None = None,
) -> SimResult:
    """Run ``config.ticks`` ticks; nodes must already hold the graph ``rebuild_graph(sorted(nodes))``."""
    live = dict(sorted(nodes.items()))
    graph = rebuild_graph(list(live))
    speeds = node_speeds(list(live), config.speed_range, config.seed)
    wake_rng = np.random.default_rng([config.seed, 2])
    loss_emas: dict[str, float] = {}
    result = SimResult(local_steps={peer: 0 for peer in live})
    in_transit: dict[int, list[tuple[str, str, object]]] = {}  # arrival tick -> (receiver, sender, message)
    _record(result, 0, live, evaluate)
    for tick in range(config.ticks):
        gone = [peer for peer in live if config.departures.get(peer) == tick]
        if gone:
            graph = _leave(live, gone, rebuild_graph)
        draws = wake_rng.random(len(speeds))  # one draw per original node keeps runs comparable
        for (peer, speed), draw in zip(speeds.items(), draws):
            if peer in live and draw < speed:
                loss, grad = oracles[peer](live[peer].params)
                live[peer].step(grad)
                result.local_steps[peer] += 1
                previous = loss_emas.get(peer, loss)
                loss_emas[peer] = LOSS_EMA_DECAY * previous + (1 - LOSS_EMA_DECAY) * loss
        sent = _exchange(live, graph.edges_at(tick), tick, result if config.record_exchanges else None,
                         deliver=config.delay_ticks == 0)
        if sent:
            in_transit.setdefault(tick + config.delay_ticks, []).extend(sent)
        _deliver(live, graph, in_transit.pop(tick, []))
        if swarm_hook is not None:
            swarm_hook(tick, live, loss_emas)
        if (tick + 1) % config.eval_every_ticks == 0:
            _record(result, tick + 1, live, evaluate)
    result.final_params = {peer: node.params.clone() for peer, node in live.items()}
    return result


def _leave(
    live: dict[str, DecentralizedNode], gone: list[str], rebuild_graph: Callable[[list[str]], PeerGraph]
) -> PeerGraph:
    for peer in gone:
        del live[peer]
    graph = rebuild_graph(list(live))
    for node in live.values():
        node.set_graph(graph)
    return graph


def _exchange(live: Mapping[str, DecentralizedNode], edges: list[tuple[str, str]], tick: int,
              result: SimResult | None, deliver: bool = True) -> list[tuple[str, str, object]]:
    """Make the messages of the due edges; deliver them now, or return them to deliver later."""
    made: list[tuple[str, str, object]] = []
    for a, b in edges:
        made.append((b, a, live[a].make_message(b)))
        made.append((a, b, live[b].make_message(a)))
        if result is not None:
            result.exchanges.append((tick, a, b))
    if not deliver:
        return made
    inbox: dict[str, dict[str, object]] = {}
    for receiver, sender, message in made:
        inbox.setdefault(receiver, {})[sender] = message
    for peer, messages in inbox.items():
        live[peer].on_messages(messages)
    return []


def _deliver(live: Mapping[str, DecentralizedNode], graph: PeerGraph,
             arriving: list[tuple[str, str, object]]) -> None:
    """Late messages, in the order they were made; those whose edge has gone meanwhile are dropped."""
    for receiver, sender, message in arriving:
        if receiver in live and sender in graph.neighbours(receiver):
            live[receiver].on_messages({sender: message})


def _record(result: SimResult, tick: int, live: Mapping[str, DecentralizedNode], evaluate: Evaluate) -> None:
    result.eval_ticks.append(tick)
    result.metrics.append(float(evaluate({peer: node.params for peer, node in live.items()})))
