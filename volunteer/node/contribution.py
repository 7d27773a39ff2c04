"""The node's contribution ledger: fold the stage's counters into this session's tally, keep the total.

Each tick adds the micro-batches and samples served since the last one (and the time, while online) to
``Session``; the session plus what earlier sessions of this identity gave the run (read once from
``<data_dir>/contribution/<peer id>.json``) is published in the snapshot and saved every
``SAVE_EVERY_S`` (first at the start) and on leave, so a crash loses at most that much. The file format and the pure fold
live in volunteer/contribution.py.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from volunteer.contribution import Session, Tally, contribution_path, farewell, load_runs, save_runs
from volunteer.snapshot import EventLevel, NodeState

if TYPE_CHECKING:
    from volunteer.node.core import Node

logger = logging.getLogger(__name__)

SAVE_EVERY_S = 30.0


class Contribution:
    def __init__(self, node: Node):
        self.node = node
        self.session: Session | None = None  # None until the node serves
        self.path: Path | None = None
        self._runs: dict[str, Tally] = {}  # the file's runs as read at the start (other runs kept as they are)
        self._next_save_s = 0.0
        self._save_failed = False

    def tick(self, now_s: float) -> None:
        if self.session is None and not self._start():
            return
        self._observe(now_s)
        if now_s >= self._next_save_s:
            self._next_save_s = now_s + SAVE_EVERY_S
            self.save()

    def close(self) -> None:
        if self.session is None:
            return
        self._observe(time.monotonic())
        self.save()

    def _start(self) -> bool:
        node = self.node
        peer_id = node.board.snapshot().peer_id
        if node.peer is None or not peer_id:
            return False
        self.path = contribution_path(node.options.data_dir, peer_id)
        self._runs = load_runs(self.path)
        self.session = Session(swarm=node.swarm)
        self._next_save_s = 0.0  # at once: `volunteer status` counts this session from its start
        return True

    def _observe(self, now_s: float) -> None:
        assert self.session is not None
        metrics = self.node.announcer.metrics
        if metrics is None:
            return
        state = self.node.board.snapshot().state
        self.session.observe(metrics.served, getattr(metrics, "samples", 0), state == NodeState.ONLINE, now_s,
                             time.time())
        session, total = self.session.tally, self.total()
        self.node.board.publish(session_samples=session.samples, session_online_s=round(session.online_s, 1),
                                total_microbatches=total.microbatches, total_samples=total.samples,
                                total_online_s=round(total.online_s, 1), total_sessions=total.sessions)

    def previous(self) -> Tally:
        return self._runs.get(self.node.run.run_id, Tally())

    def total(self) -> Tally:
        return self.previous().plus(self.session.tally) if self.session is not None else self.previous()

    def save(self) -> None:
        if self.session is None or self.path is None:
            return
        runs = dict(self._runs)
        runs[self.node.run.run_id] = self.total()
        peer_id = self.node.board.snapshot().peer_id
        try:
            save_runs(self.path, peer_id, runs)
        except OSError as exc:
            if not self._save_failed:  # once: the disk will not get better every minute
                self.node.board.emit(f"could not save this node's contribution to {self.path}: {exc}",
                                     EventLevel.WARNING, "contribution")
            self._save_failed = True

    def farewell(self) -> str:
        """What `volunteer join` prints as it exits; "" if the node never served."""
        if self.session is None:
            return ""
        return farewell(self.node.run.run_id, self.session.tally, self.total(), self.node.board.snapshot().log_path)

    def farewell_json(self) -> dict:
        """The farewell for --log-format json: ``{"type": "farewell", "run_id", "session", "total", "log_path"}``."""
        session = self.session.tally if self.session is not None else Tally()
        return {"type": "farewell", "time": round(time.time(), 3), "run_id": self.node.run.run_id,
                "session": session.to_json(), "total": self.total().to_json(),
                "log_path": self.node.board.snapshot().log_path}
