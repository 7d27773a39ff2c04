"""Committed weights: the digest of a stage's parameters at each version it computes with, and a bounded ring of
recent versions its signer can be made to show.

Every receipt a stage signs names the digest of the tensors it ran with (swarm/integrity/receipts.py ``weights``),
so every hop is a checkable claim: *these* weights, on this input, give this output. The tensors committed to are
the weights exactly as the stage computed with them (``COMMIT_DTYPE`` None: a version kept costs 4 bytes a float32
parameter). Session 13 committed them rounded to bfloat16 (2 bytes): a ReLU whose pre-activation lies within the
rounding of zero flips its mask, and with it that sample's whole gradient (a trained digits last stage reproduced
below the referee's 0.99 in 9 of 1,500 honest hops, and the referee convicted the only honest layer2 peer of a test
run on such a hop), so the commitment is what was computed with, and an honest hop reproduces to float rounding.
A referee that doubts the claim asks the signer for the weights of that digest and recomputes the hop
(swarm/pipeline/control/referee.py; Verde's refereed delegation). The digest is computed once per version, when the
first hop of that version is served, not per hop and not per update (an update nobody computes with is never hashed),
and the tensors of that version are kept beside it: a copy per served version, within ``max_bytes`` and ``keep_s``.

On the CPU the version the stage computes with now is not copied: it is the live weights (``Version.tensors`` None),
hashed in place. It is copied when the weights are about to change (``release_live``: the step guard's pre-step copy,
an averaging merge, a restore) or when a referee asks for it (the copy is then hashed again: if anything changed the
weights without releasing them first, the version is answered as gone, never shown wrong). A ring of ``RING_COPIES``
copies thus covers as many versions as ``RING_COPIES + 1`` eager ones (4 bytes a parameter saved). Beside a GPU the
commit copies to the host anyway (the digest is taken there), so that copy is kept as before.

Weight stashing (``stash``, the run's ``training.weight_stashing``): a forward's graph holds ``live_view``, the live
storage of the version it computes with, until its backward. Where a graph holds it when the weights are about to
change, the release keeps that storage as the version's copy and gives the live weights the new one (``moved``), so
nothing writes a version a graph computes with, at the same one copy a version; a buffer is reused for a copy only
when no graph holds it.

Pure except for the copies it keeps; thread-safe (the compute thread commits, the RPC loop reads).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from swarm.integrity.weights_copies import (  # noqa: F401  (re-exported: callers import them from here)
    COMMIT_DTYPE, committed_bytes, committed_copy, committed_dtype, copy_to_host as _copy_to_host, fits as _fits,
    stays_live as _stays_live, tensors_bytes, weights_digest,
)

logger = logging.getLogger(__name__)

KEEP_S = 30.0  # a version is shown for at least this long after it was last served (memory permitting)
RING_MIN_BYTES = 8 * 2**20  # a small stage keeps many versions (digits: ~120): a referee asks within a round trip
RING_COPIES = 3.0  # a large one keeps at most this many (committed) copies of older versions beside the live one: a
# referee asks for the version of a hop one round trip after it, and a backward's forward version is a pipeline round
# trip older (a heavy 16 MiB stage at ~3 updates a second; with 2 older versions a referee found its version gone).
# Beside a GPU the current version is a copy too: one more.
RING_COPIES_MAX = 8.0  # a referee that asks for a version the ring dropped less than keep_s ago grows it by a copy, up
# to this many: with two drivers a heavy stage updates twice as often, and a backward's forward version is their
# micro-batches in flight older; 3 copies left 36-65 % of a lone copy's refereed hops without a verdict (session 33)
RING_SHRINK_S = 300.0  # a copy so added goes again after this long without such an ask
STASHED_VERSIONS_MAX = 8  # versions forwards' graphs hold at most (weight stashing: ``live_view``; a copy of the
# weights each, past the ring's bound while held: swarm/pipeline/stage/activations.py drops the oldest past it; their
# backward recomputes the forward, as after any eviction). One driver at in_flight 4 holds ~4, two ~8.
GONE_KEPT = 256  # digests of dropped versions remembered (to tell a just-dropped version from one never kept)
# A referee shown an update's version asks the stage to keep the next one (the update's result) for its audit (``show``
# with ``pin_next``). An honest ring drops its oldest first, so while it shows a version it holds every later one: a
# pinned version called gone was withheld (referee_audits.Withheld: a copy trained to harm that showed only what its
# harmless updates made went to chance unconvicted). PIN_MAX pins at once, for PIN_S at most, over the ring's bound.
PIN_S, PIN_MAX, PIN_PER_PINNER = 20.0, 4, 2



@dataclass(slots=True)
class Version:
    version: int
    digest: bytes
    tensors: dict[str, torch.Tensor] | None  # None: the live weights (the current version on the CPU, not copied)
    nbytes: int
    served_at: float  # when a hop last ran on it (monotonic)


class WeightsRing:
    """The versions this stage computed with recently, by digest. ``commit`` is called by every op that computes with
    the weights, under the stage's lock; it hashes the weights only when they changed since the last commit (a new
    version, or any in-place change: the tensors' own version counters say so). Whatever changes the weights in
    place calls ``release_live`` first, under the stage's lock (module docstring)."""

    def __init__(self, max_bytes: int = RING_MIN_BYTES, keep_s: float = KEEP_S, lazy: bool = True):
        self.max_bytes = max_bytes
        self.keep_s = keep_s
        self.lazy = lazy  # the current version of CPU weights stays live until they change (module docstring)
        self._versions: OrderedDict[bytes, Version] = OrderedDict()
        self._key: tuple | None = None
        self._current: Version | None = None
        self._lock = threading.Lock()
        self._bytes = 0  # of the versions kept
        self._module: nn.Module | None = None  # the module whose tensors ``_tensors`` lists (parameters and buffers)
        self._tensors: list[tuple[str, torch.Tensor]] = []
        self.commits = 0  # versions hashed
        self.evicted = 0
        self.recycled = 0  # versions copied into an evicted version's buffers
        self.released = 0  # live versions copied before a change or for a referee
        self.lost = 0  # live versions changed without ``release_live`` (or while a referee's copy was taken)
        self.copy_bytes = 0  # one committed copy (``sized_for``): what a referee's ask for a just-dropped version adds
        self.max_copies = 0.0  # ... up to this many copies (0: the ring does not grow)
        self.grown = 0  # copies added so
        self._base_bytes = max_bytes
        self._last_miss = 0.0
        self._gone: OrderedDict[bytes, float] = OrderedDict()  # dropped versions' digests -> when
        self._pins: dict[tuple[str, int], float] = {}  # (referee, version number) kept for it -> until (monotonic)
        self.stash = False  # weight stashing (``live_view``): a forward's graph keeps the version it ran with
        self._view: dict[str, torch.Tensor] | None = None  # the live weights as graphs of this version hold them
        self.moved = 0  # live versions whose storage became their copy (graphs held it) instead of being copied

    @staticmethod
    def sized_for(module: nn.Module, keep_s: float = KEEP_S, stash: bool = False) -> WeightsRing:
        """A ring for ``module``: RING_MIN_BYTES, or RING_COPIES committed copies of its weights where that is more
        (one more beside a GPU, whose current version is a copy)."""
        state = module.state_dict()
        extra = 0.0 if _stays_live(state) else 1.0
        ring = WeightsRing(max(RING_MIN_BYTES, int((RING_COPIES + extra) * committed_bytes(state))), keep_s)
        ring.copy_bytes, ring.max_copies, ring.stash = committed_bytes(state), RING_COPIES_MAX + extra, stash
        return ring

    def commit(self, module: nn.Module, version: int, now: float | None = None) -> tuple[int, bytes]:
        """(version, digest) of ``module``'s weights now; keeps them (live, or a committed copy) under that digest."""
        now = time.monotonic() if now is None else now
        state = self._state(module)
        key = (version, tuple((t.data_ptr(), t._version) for t in state.values()))
        with self._lock:
            if key == self._key and self._current is not None:  # every op of a version but its first: no more
                self._current.served_at = now
                self._versions.move_to_end(self._current.digest)
                return self._current.version, self._current.digest
            live = self.lazy and _stays_live(state)
            current = self._current
            self._view = None  # graphs of the version before keep theirs
            if current is not None and current.tensors is None and self._key is not None and self._key[1] != key[1]:
                self._lose(current.digest)  # changed in place, never released
            # (a live version whose tensors did not change, only its number, stays current: a referee may still
            # copy it out while these weights are hashed)
            spare = None if live else self._take_spare(now, committed_bytes(state))
        if live:  # the caller holds the stage's lock: nothing changes the weights while they are hashed
            tensors = None
        elif spare is not None and _fits(spare, state):  # the oldest version's buffers, overwritten: no allocation
            tensors = _copy_to_host(spare, state)
            self.recycled += 1
        else:  # page-locked beside a GPU: its copies to the host run at the bus's speed, and this buffer is reused
            tensors = _copy_to_host({name: torch.empty(t.shape, dtype=committed_dtype(t), pin_memory=t.is_cuda)
                                  for name, t in state.items()}, state)
        digest = weights_digest(state if tensors is None else tensors)
        with self._lock:
            self._key = key
            kept = self._versions.get(digest)
            if tensors is None and kept is not None and kept.tensors is not None:  # the same weights again (a step
                kept.served_at, kept.version = now, version  # undone, a restore): their copy is kept already
                self._current = kept
            else:
                entry = Version(version, digest, tensors, 0 if tensors is None else tensors_bytes(tensors), now)
                self._bytes += entry.nbytes - (kept.nbytes if kept is not None else 0)
                self._versions[digest] = entry
                self._current = entry
            self._versions.move_to_end(digest)
            self.commits += 1
            self._evict(now)
        return version, digest

    def release_live(self, now: float | None = None) -> None:
        """Copy the current version out of the live weights, which the caller (holding the stage's lock) is about to
        change: a referee may still ask for it (and with ``stash``, forwards' graphs still compute with it)."""
        with self._lock:
            self._release(time.monotonic() if now is None else now)

    def live_view(self) -> dict[str, torch.Tensor] | None:
        """Weight stashing (``training.weight_stashing``): the current version's tensors as the live weights hold them
        (aliases, no copy), for a forward's graph to keep until its backward. While a graph holds this dict, the
        weights are given new storage before anything writes them (``_release``), so the backward computes with the
        weights its forward ran with (PipeDream's weight stashing) and a referee recomputes the hop from that one
        version. The caller holds the stage's lock and has just committed; None where stashing is off."""
        with self._lock:
            if not self.stash or self._current is None or self._key is None or self._key[1] != self._live_key():
                return None
            if self._view is None:
                self._view = {name: t.data for name, t in self._tensors}
            return self._view

    def _release(self, now: float) -> None:
        """The live weights are about to be written (the caller holds the stage's lock). Locked."""
        current, view = self._current, self._view
        self._view = None
        held = view is not None and sys.getrefcount(view) > 2  # our name and getrefcount's: more are graphs
        if current is not None and current.tensors is None:
            if held:  # the graphs' storage becomes the version's copy; the live weights get the new one
                self._copy_live(current, now, view)
            else:
                self._copy_live(current, now)
        elif held:  # a copy exists already (a referee's, or the host's beside a GPU): the live weights move off it
            for _, t in self._tensors:
                t.data = t.data.clone()
            self.moved += 1

    def get(self, digest: bytes, now: float | None = None) -> Version | None:
        return self.show(digest, now)[0]

    def show(self, digest: bytes, now: float | None = None, pinner: str = "", pin_next: bool = False,
             release: bool = False) -> tuple[Version | None, bool]:
        """(the version with this digest if still kept, the current one copied out of the live weights and hashed
        again: None if they no longer hash to it; whether the one after it is now kept for ``pinner``: ``pin_next``
        asks so, until it asks for it with ``release``, PIN_S at most, within PIN_MAX and PIN_PER_PINNER)."""
        with self._lock:
            now = time.monotonic() if now is None else now
            self._evict(now)
            entry = self._versions.get(digest)
            if entry is None:
                self._missed(digest, now)
                return None, False
            if entry.tensors is None:
                if entry is not self._current or self._key is None or self._key[1] != self._live_key():
                    self._lose(digest)  # changed since its commit
                    return None, False
                self._copy_live(entry, now)
                if weights_digest(entry.tensors) != digest:  # changed while copied, by a writer that did not release
                    self._lose(digest)
                    return None, False
            if release:  # its pinner's audit has it now (not any fetch of it: its next judgement may come first)
                self._pins.pop((pinner, entry.version), None)
            return entry, pin_next and self._pin(pinner, entry.version + 1, now)

    def _pin(self, pinner: str, version: int, now: float) -> bool:
        """Keep ``version`` (committed or not) for ``pinner``, PIN_S at most; False past the pins' bounds. Locked."""
        for key, until in list(self._pins.items()):
            if until < now:
                del self._pins[key]
        if (pinner, version) not in self._pins and (len(self._pins) >= PIN_MAX or sum(
                who == pinner for who, _ in self._pins) >= PIN_PER_PINNER):
            return False
        self._pins[(pinner, version)] = now + PIN_S
        return True

    def _pinned(self, entry: Version, now: float) -> bool:
        return any(version == entry.version and until >= now for (_, version), until in self._pins.items())

    def _bound_bytes(self, now: float) -> int:
        pinned = sum(v.nbytes for v in self._versions.values() if self._pinned(v, now)) if self._pins else 0
        return self._bytes - pinned

    def unchanged(self, module: nn.Module) -> dict[str, torch.Tensor] | None:
        """The latest version's tensors if ``module`` has not changed since it was committed (nothing stepped it or
        wrote into it since): an exact copy of the weights as they are now (copied out of the live weights here if
        the ring had not copied them), which the step guard undoes a step from instead of keeping a copy of its own
        (swarm/integrity/guard.py: 4 bytes a parameter). The caller must not write into them; they stay the ring's."""
        parts = tuple((t.data_ptr(), t._version) for t in self._state(module).values())
        with self._lock:
            if self._key is None or self._current is None or self._key[1] != parts:
                return None
            self._release(time.monotonic())
            return self._current.tensors

    def counts(self) -> dict[str, int]:
        """What the ring did (a node's log at its stop): versions hashed, copied out of the live weights, lost (changed
        without ``release_live``), kept now."""
        return {"hashed": self.commits, "released": self.released, "lost": self.lost, "kept": len(self),
                "grown": self.grown, "moved": self.moved}

    @property
    def largest_bytes(self) -> int:
        """The bound the ring may grow to (``max_copies`` copies, or its first bound where that is more)."""
        return max(self._base_bytes, int(self.max_copies * self.copy_bytes))

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def _state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """``module.state_dict()`` (detached tensors, sharing the parameters' storage and version counters), from
        a list of the module's tensors made once: a stage's parameters are updated in place, never replaced, and
        state_dict's walk of the module cost a digits stage ~0.03 ms a call, three calls an update."""
        if module is not self._module:
            self._tensors = list(module.state_dict(keep_vars=True).items())
            self._module = module
        return {name: t.detach() for name, t in self._tensors}

    def _live_key(self) -> tuple:
        return tuple((t.data_ptr(), t._version) for _, t in self._tensors)

    def _copy_live(self, entry: Version, now: float, view: dict[str, torch.Tensor] | None = None) -> None:
        """``entry`` (the current version, live) copied into an evicted version's buffers or new ones (under the
        lock). With ``view`` (the live storage forwards' graphs hold: ``live_view``) the copy becomes the live
        weights and the storage the graphs hold becomes the version's: the same one copy."""
        state = {name: t.detach() for name, t in self._tensors}
        spare = self._take_spare(now, committed_bytes(state))
        if spare is not None and _fits(spare, state):
            for name, t in state.items():
                spare[name].copy_(t)
            self.recycled += 1
        else:
            spare = {name: t.clone() for name, t in state.items()}
        if view is not None:
            for name, t in self._tensors:
                t.data = spare[name]
            spare = view
            self.moved += 1
        entry.tensors = spare
        entry.nbytes = tensors_bytes(spare)
        self._bytes += entry.nbytes
        self.released += 1
        self._evict(now)

    def _lose(self, digest: bytes) -> None:
        """A live version whose weights changed without ``release_live``: gone (a referee's ask is answered so,
        never with weights that do not hash to it). Under the lock."""
        entry = self._versions.pop(digest, None)
        if entry is not None:
            self._bytes -= entry.nbytes
            self.lost += 1
            logger.warning("weights of version %d changed in place before they were copied: that version is "
                           "gone for referees", entry.version)
        if entry is self._current:
            self._key, self._current = None, None

    def __len__(self) -> int:
        return len(self._versions)

    def _take_spare(self, now: float, incoming: int) -> dict[str, torch.Tensor] | None:
        """The tensors of the oldest version if a new one of ``incoming`` bytes evicts it anyway (past keep_s, or
        over max_bytes with it) and nobody outside the ring holds them (a door packing them for a referee does:
        overwriting those would show weights that do not hash to the digest signed, and convict an honest stage).
        Reusing them spares a fresh allocation per update: 53 of a 75 ms commit of a 100 MB stage here were the
        page faults of new memory. Under the lock."""
        if len(self._versions) < 2:
            return None
        digest, oldest = next(iter(self._versions.items()))
        if oldest is self._current or oldest.tensors is None or self._pinned(oldest, now) or (
                now - oldest.served_at <= self.keep_s and self._bound_bytes(now) + incoming <= self.max_bytes):
            return None
        # references: the Version's attribute and getrefcount's argument; for each tensor, the dict's value, the
        # loop's name and getrefcount's argument. More means someone outside the ring holds them.
        if sys.getrefcount(oldest.tensors) > 2 or any(sys.getrefcount(t) > 3 for t in oldest.tensors.values()):
            return None
        del self._versions[digest]
        self._bytes -= oldest.nbytes
        self.evicted += 1
        self._note_gone(digest, oldest, now)
        return oldest.tensors

    def _evict(self, now: float) -> None:
        """Oldest first: past keep_s, or past max_bytes (the version being served now always stays, and a pinned one
        while its pin lasts: the next oldest goes in its place)."""
        if self.grown and now - self._last_miss > RING_SHRINK_S:  # referees have not missed a version for a while
            self.grown -= 1
            self.max_bytes -= self.copy_bytes
            self._last_miss = now
        while len(self._versions) > 1:
            found = next(((d, v) for d, v in self._versions.items() if v is self._current or not self._pinned(v, now)),
                         None) if self._pins else next(iter(self._versions.items()))
            if found is None:
                break
            digest, oldest = found
            if oldest is self._current or (now - oldest.served_at <= self.keep_s and
                                           self._bound_bytes(now) <= self.max_bytes):
                break
            del self._versions[digest]
            self._bytes -= oldest.nbytes
            self.evicted += 1
            self._note_gone(digest, oldest, now)

    def _note_gone(self, digest: bytes, version: Version, now: float) -> None:
        """A version dropped for the ring's bytes (one past keep_s would have gone anyway) is remembered a while."""
        if now - version.served_at > self.keep_s:
            return
        self._gone[digest] = now
        while len(self._gone) > GONE_KEPT:
            self._gone.popitem(last=False)

    def _missed(self, digest: bytes, now: float) -> None:
        """A referee asked for ``digest``, not kept: if the ring dropped it for its bytes less than keep_s ago, it
        holds too few versions for the referees of this run: one copy more, up to ``max_copies`` (RING_SHRINK_S
        without such an ask takes it back). Under the lock."""
        dropped = self._gone.get(digest)
        if dropped is None or now - dropped > self.keep_s:
            return
        self._last_miss = now
        if self.copy_bytes and self.max_bytes + self.copy_bytes <= self.largest_bytes:
            self.max_bytes += self.copy_bytes
            self.grown += 1
            logger.info("a referee asked for a version of these weights dropped %.1f s before: keeping %.0f MiB of "
                        "versions now (%d copies more)", now - dropped, self.max_bytes / 2**20, self.grown)
