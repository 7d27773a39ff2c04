"""How the two messages of an edge exchange are paired, as plain functions over a node and a graph.

ECL-ISVR (PDMM, ADMM) and pair-wise DSGD assume that an exchange on edge (i, j) is a *swap*: i's
message ``y_ij`` and j's message ``y_ji`` are both made before either is applied. The reference code
(and ``simulate.py``) makes both, then applies both. Two peers that each push on their own clock do
not: a neighbour that applied our message before it made its own sends back a message that already
holds ours, and PDMM's dual then integrates the disagreement instead of swapping it (docs/ECL.md,
"Message pairing", measures what that costs).

The swap a swarm runs, and the live simulation (``live_sim.py``) with it:

- one end starts each swap: the smaller id (``initiates``), at its own local step ``s`` when
  ``s % K == offset(i, j)`` (``swaps_due``); the other end's step counter plays no part, so peers
  whose counters are out of phase (they joined at different times) still exchange once per K steps;
- the initiator sends ``y_ij``; the responder answers with ``y_ji`` made from its state *before* it
  applies ``y_ij`` (``answer_swap``), then applies it; the initiator applies ``y_ji`` when the reply
  comes back (at its next step);
- at most one swap per edge is in flight: a due swap is skipped while the previous reply is awaited;
- an edge that is rebuilt (its peer left and came back, or was banned) starts a new *generation*
  with a fresh neutral dual; a reply that belongs to an older generation is dropped, so a message
  paired with a reset dual is never applied (``EdgeGenerations``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from swarm.ecl.graph import PeerGraph
from swarm.ecl.updates import DecentralizedNode


def initiates(me: str, peer: str) -> bool:
    """Whether ``me`` starts the swaps of edge (me, peer): the smaller id does, so both ends agree."""
    if me == peer:
        raise ValueError(f"a peer has no edge to itself ({me!r})")
    return me < peer


def swaps_due(graph: PeerGraph, me: str, step: int) -> list[str]:
    """The neighbours ``me`` starts a swap with at its local step ``step``."""
    return [peer for peer in graph.neighbours(me) if initiates(me, peer) and graph.exchanges_at(me, peer, step)]


def answer_swap(node: DecentralizedNode, sender: str, message: Any) -> Any:
    """The responder's half of a swap: our message to ``sender`` made *before* we apply theirs, then
    theirs applied. Raises BadMessageError (nothing applied, nothing answered) for a bad message."""
    reply = node.make_message(sender)
    node.on_messages({sender: message})
    return reply


class EdgeGenerations:
    """A generation number per edge of one node: it changes whenever the edge (and its dual) is created
    anew, so a swap's reply can be matched to the dual it was paired with."""

    def __init__(self) -> None:
        self._current: dict[str, int] = {}
        self._counter = 0

    def update(self, neighbours: Iterable[str]) -> None:
        """Adopt the neighbours of a rebuilt graph: new edges get a new generation, gone ones are forgotten."""
        kept: dict[str, int] = {}
        for peer in neighbours:
            if peer in self._current:
                kept[peer] = self._current[peer]
            else:
                self._counter += 1
                kept[peer] = self._counter
        self._current = kept

    def current(self, peer: str) -> int | None:
        """The edge's generation, or None when ``peer`` is not a neighbour now."""
        return self._current.get(peer)

    def matches(self, peer: str, generation: int) -> bool:
        """Whether a reply sent in ``generation`` still belongs to the edge to ``peer``."""
        return self._current.get(peer) == generation
