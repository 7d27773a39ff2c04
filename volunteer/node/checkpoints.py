"""The node's checkpoints: decide whether to resume from one, restore it, save on pause, exit and timer.

The file format, the slot lock and the resume decision live in volunteer/checkpoint.py; this part
only wires them to the node's stage and tells the user what happened.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from volunteer.snapshot import EventLevel

if TYPE_CHECKING:
    from volunteer.node.core import Node

logger = logging.getLogger(__name__)


class Checkpoints:
    def __init__(self, node: Node):
        self.node = node
        self.checkpointer: Any = None  # volunteer.checkpoint.Checkpointer once a slot is claimed

    def tick(self, now_s: float) -> None:
        if self.checkpointer is not None and self.checkpointer.due():
            self.save(f"every {self.checkpointer.interval_s:g} s", periodic=True)

    def close(self) -> None:
        """Release our checkpoint slot (on leave, or before a move claims the next swarm's)."""
        if self.checkpointer is not None:
            self.checkpointer.close()
            self.checkpointer = None

    def folder(self) -> Any:
        """This node's folder for the run and swarm, not created here (healing's snapshots go there when the stage is
        built: swarm/integrity/snapshots.py, which says so and keeps them in memory where it cannot be made)."""
        from volunteer.paths import node_dir

        return node_dir(self.node.options.data_dir, self.node.run.run_id, self.node.swarm, create=False)

    def prepare_resume(self) -> Any:
        """Before the stage is built: read our checkpoint and decide whether to continue from it."""
        from volunteer import checkpoint
        from volunteer.paths import node_dir

        node = self.node
        run, swarm = node.run, node.swarm
        try:
            path, lock = checkpoint.claim_slot(node_dir(node.options.data_dir, run.run_id, swarm))
        except (checkpoint.CheckpointError, OSError) as exc:
            node.board.emit(f"no checkpoints for this node: {exc}", EventLevel.WARNING, "checkpoint")
            return checkpoint.Resume(None)
        self.checkpointer = checkpoint.Checkpointer(
            path, run.run_id, swarm, node.options.resources.checkpoint_interval_s,
            notify=lambda level, text: node.board.emit(text, EventLevel(level), "checkpoint"), lock=lock,
        )
        return checkpoint.prepare_resume(path, run.run_id, swarm, node.announcer.views.get(swarm, []),
                                         node.board.snapshot().peer_id, can_sync=self.can_download_layer())

    def finish_resume(self, resume: Any) -> None:
        """Once the stage is built: load the checkpoint (under the worker's lock) and say what happened."""
        from volunteer import checkpoint

        board = self.node.board
        if resume.state is not None:
            try:
                checkpoint.restore(self.node.peer.worker, resume.state)
            except checkpoint.CheckpointError as exc:
                checkpoint.move_aside(self.checkpointer.path, checkpoint.CORRUPT_SUFFIX)
                board.emit(f"not using the checkpoint: {exc}", EventLevel.WARNING, "checkpoint")
                return
            self.checkpointer.mark_restored(resume.state)
            self.node.peer.reset_good_snapshot()  # healing goes back to the checkpoint, not the seeded start
        if resume.message:
            board.emit(resume.message, EventLevel.WARNING if resume.warning else EventLevel.INFO, "checkpoint")

    def can_download_layer(self) -> bool:
        """Whether this node can take its layer from peers instead of a checkpoint the swarm has outrun.

        Yes: Node._start_training passes ``sync_from`` to SwarmPeer.start (swarm/averaging/sync.py),
        which downloads the layer from a peer, or keeps the weights it has when no peer answers.
        """
        return True

    def save(self, why: str, periodic: bool = False) -> None:
        peer = self.node.peer
        if self.checkpointer is not None and peer is not None and peer.worker is not None:
            sick = peer.healer.status().healing if peer.healer is not None else ""
            if sick:  # never persist a sick copy: a restart would restore it
                self.node.board.emit(f"not saving a checkpoint ({why}): this copy is sick ({sick})",
                                     EventLevel.WARNING, "checkpoint")
                return
            try:
                self.checkpointer.save(peer.worker, why, periodic)
            except Exception as exc:  # capturing failed (a torch error): training goes on, the user is told
                logger.exception("checkpoint capture failed")
                self.node.board.emit(f"could not save a checkpoint: {exc}", EventLevel.WARNING, "checkpoint")
