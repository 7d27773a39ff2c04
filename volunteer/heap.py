"""Give the heap torch freed back to the operating system.

glibc's malloc keeps freed memory in its arenas for reuse: a stage's micro-batch allocates tens of MiB of
activations and logits and frees them, and the process's RSS stays at the high-water mark of every thread's arena
long after. Measured on an llm-tiny last stage (1 micro-batch in flight, 41 MiB of activations each), in-process:
+111 MiB over the ``import torch, hivemind`` floor after 40 micro-batches, +46 MiB right after ``malloc_trim(0)``.
``HeapTrimmer`` calls it every ``TRIM_EVERY_S`` from the node's loop (a few ms: it hands free pages back with
madvise, nothing in use moves), and ``limit_arenas`` caps the arenas at ``ARENAS`` before the node's threads start
(glibc gives each thread that allocates its own, each with its own high-water mark). A real llm-tiny last-stage
volunteer after 30 s of training (benchmarks/footprint.py): RSS 538 -> 497 MiB with the trim, ~475 with both.
A fixed mmap threshold (every block over 1 MiB mapped and unmapped) took it to 408 MiB but cost 18 % of the
swarm's throughput in page faults: not done. Elsewhere than glibc (macOS, musl) these do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

TRIM_EVERY_S = 10.0
ARENAS = 2
M_ARENA_MAX = -8  # mallopt's parameter number (malloc.h)

_LIBC: list = []  # the C library once loaded (None where it cannot be)


def _libc_function(name: str):
    """glibc's ``name`` (malloc_trim, mallopt), or None elsewhere (macOS, musl): loaded once."""
    if not _LIBC:
        try:
            _LIBC.append(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"))
        except OSError as exc:
            logger.debug("no C library to load: %s", exc)
            _LIBC.append(None)
    return getattr(_LIBC[0], name, None) if _LIBC[0] is not None else None


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas (call before threads start); False where the C library cannot."""
    mallopt = _libc_function("mallopt")
    return bool(mallopt(M_ARENA_MAX, arenas)) if mallopt is not None else False


def trim_heap() -> bool:
    """Return freed heap memory to the OS now; False where the C library cannot."""
    trim = _libc_function("malloc_trim")
    if trim is None:
        return False
    try:
        trim(0)
        return True
    except Exception as exc:  # never worth failing a node for
        logger.debug("malloc_trim: %s", exc)
        return False


class HeapTrimmer:
    """A node part (volunteer/node/board.py ``Part``): trims the heap every ``every_s``."""

    def __init__(self, every_s: float = TRIM_EVERY_S):
        self.every_s = every_s
        self._next_s = 0.0
        self.trims = 0

    def tick(self, now_s: float) -> None:
        if now_s >= self._next_s:
            self._next_s = now_s + self.every_s
            self.trims += int(trim_heap())

    def close(self) -> None:
        pass
