"""Commands (pause, finish, resume, quit) and who paused: the user or the idle policy.

A pause the user asked for (ctl, TUI) is only ever lifted by the user; a pause the idle policy
made (``prefs.idle``) is lifted by the policy. The decisions are pure functions over the current
state (``on_command``, ``on_verdict``) that return a ``Transition``; ``Commands`` is the part of
the node that queues commands from any thread, hands out tickets, and carries transitions out.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from volunteer.snapshot import Command, NodeState

if TYPE_CHECKING:
    from volunteer.node.core import Node

PAUSED_BY_USER = "user"
PAUSED_BY_POLICY = "policy"
USER_PAUSE_REASON = "paused by you"
FINAL_EVAL_DEADLINE_S = 60.0  # layer0's evaluation when it finishes (drain, evaluate, pause), retries included


class Verdict(Protocol):
    """What the idle policy says now (volunteer.policy.Verdict)."""

    run: bool
    reason: str


@dataclass(frozen=True, slots=True)
class Transition:
    """Where a command or a policy verdict takes the node, and what the user is told."""

    state: NodeState
    reason: str
    paused_by: str | None  # PAUSED_BY_USER, PAUSED_BY_POLICY, or None while online
    event: str = ""  # "" = no event
    kind: str = ""
    save_checkpoint: bool = False  # a pause keeps the progress on disk
    quiet: bool = False  # only the reason changed ("user active 12 s ago" ages): no event, no announce


def on_command(command: Command, state: NodeState, paused_by: str | None,
               verdict: Verdict | None) -> Transition | None:
    """The user's command in this state; None = nothing to do (QUIT is the node's, not a transition)."""
    pausable = (NodeState.ONLINE, NodeState.FINISHING, NodeState.PAUSED, NodeState.HEALING)
    if command == Command.PAUSE and state in pausable:
        if state == NodeState.PAUSED and paused_by == PAUSED_BY_POLICY:
            return Transition(NodeState.PAUSED, USER_PAUSE_REASON, PAUSED_BY_USER, kind="paused",
                              event="paused by you: the idle policy will not resume it; `volunteer ctl resume` will")
        if state != NodeState.PAUSED:
            return Transition(NodeState.PAUSED, USER_PAUSE_REASON, PAUSED_BY_USER, kind="paused", save_checkpoint=True,
                              event="paused: no new work is taken; in-flight backward passes still complete")
        return Transition(NodeState.PAUSED, USER_PAUSE_REASON, PAUSED_BY_USER)
    if command == Command.FINISH and state == NodeState.ONLINE:
        return Transition(NodeState.FINISHING, "finishing in-flight work, then pausing", PAUSED_BY_USER,
                          event="finishing: draining in-flight micro-batches", kind="finishing")
    if command == Command.FINISH and state == NodeState.PAUSED:
        return Transition(NodeState.PAUSED, USER_PAUSE_REASON, PAUSED_BY_USER)
    if command == Command.RESUME and state in (NodeState.PAUSED, NodeState.FINISHING):
        if verdict is not None and not verdict.run:  # the user's pause is lifted; the policy's still holds
            return Transition(NodeState.PAUSED, verdict.reason, PAUSED_BY_POLICY, kind="paused",
                              event=f"resume: the idle policy keeps this node paused ({verdict.reason}); set "
                                    "idle.enabled: false in your preferences to train while you use this machine")
        return Transition(NodeState.ONLINE, "", None, event="resumed", kind="resumed")
    return None


def on_verdict(verdict: Verdict, state: NodeState, paused_by: str | None, reason: str) -> Transition | None:
    """The idle policy's new verdict: pause when it says so, resume only the pauses it made."""
    if not verdict.run and state == NodeState.ONLINE:
        return Transition(NodeState.PAUSED, verdict.reason, PAUSED_BY_POLICY, kind="paused", save_checkpoint=True,
                          event=f"paused by the idle policy: {verdict.reason}; it resumes by itself")
    if state == NodeState.PAUSED and paused_by == PAUSED_BY_POLICY:
        if verdict.run:
            return Transition(NodeState.ONLINE, "", None, event="resumed: the idle policy allows training again",
                              kind="resumed")
        if verdict.reason != reason:
            return Transition(NodeState.PAUSED, verdict.reason, PAUSED_BY_POLICY, quiet=True)
    return None


class CommandQueue:
    """Commands from any thread, applied in order by the engine; tickets say when one was applied."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._applied = threading.Condition(self._lock)
        self._pending: deque[Command] = deque()
        self._sent = 0
        self._done = 0

    def put(self, command: Command) -> int:
        with self._lock:
            self._pending.append(Command(command))
            self._sent += 1
            return self._sent

    def pop(self) -> Command | None:
        with self._lock:
            return self._pending.popleft() if self._pending else None

    def mark_applied(self) -> None:
        with self._applied:
            self._done += 1
            self._applied.notify_all()

    def wait_applied(self, ticket: int, timeout_s: float | None) -> bool:
        with self._applied:
            return self._applied.wait_for(lambda: self._done >= ticket, timeout_s)


class Commands:
    """The node part that applies queued commands and policy verdicts, and ends a finish."""

    def __init__(self, node: Node):
        self.node = node
        self.queue = CommandQueue()
        self.paused_by: str | None = None  # PAUSED_BY_USER or PAUSED_BY_POLICY while not online
        self._final_eval: Future | None = None  # layer0's last evaluation while finishing

    def tick(self, now_s: float) -> None:
        self.apply_pending()
        self.check_finishing()

    def close(self) -> None:
        self._drop_final_evaluation()

    def _drop_final_evaluation(self) -> None:
        if self._final_eval is not None:
            self._final_eval.cancel()
            self._final_eval = None

    def apply_pending(self) -> None:
        while (command := self.queue.pop()) is not None:
            try:
                self._apply(command)
                self.node.announcer.announce()
            finally:
                self.queue.mark_applied()

    def follow_policy(self, verdict: Verdict) -> None:
        state, reason = self.node.board.snapshot().state, self.node.board.snapshot().reason
        transition = on_verdict(verdict, state, self.paused_by, reason)
        if transition is not None:
            self.enact(transition)

    def enact(self, transition: Transition) -> None:
        node = self.node
        if transition.quiet:
            node.board.publish(reason=transition.reason)
            return
        self.paused_by = transition.paused_by
        if transition.state != NodeState.FINISHING:
            self._drop_final_evaluation()  # a pause or resume while layer0 evaluates at a finish: it wins
        node.set_state(transition.state, transition.reason)
        node.governors.sync_accepting()
        if transition.event:
            node.board.emit(transition.event, kind=transition.kind)
        if transition.save_checkpoint:
            node.checkpoints.save("paused")

    def check_finishing(self) -> None:
        """A finishing node pauses once nothing is in flight; layer0 first evaluates the pipeline once more,
        without blocking the engine (the node says it is evaluating; a pause or resume meanwhile wins)."""
        node, peer = self.node, self.node.peer
        if node.board.snapshot().state != NodeState.FINISHING:
            self._drop_final_evaluation()
            return
        if peer is not None and peer.in_flight() > 0:
            return
        if self._final_eval is None:
            future = peer.start_final_evaluation(FINAL_EVAL_DEADLINE_S) if peer is not None else None
            if future is not None:
                self._final_eval = future
                node.board.emit("finished in-flight work; evaluating the pipeline once more before pausing",
                                kind="finishing")
                node.board.publish(reason="evaluating the pipeline once more, then pausing")
                return
            node.board.emit("finished in-flight work, now paused", kind="paused")
        elif not self._final_eval.done():
            return
        else:
            published = not self._final_eval.cancelled() and self._final_eval.exception() is None \
                and self._final_eval.result()
            self._final_eval = None
            if published:
                node.board.publish(**node.announcer.work_fields())  # layer0: what the swarm reached, at the pause
            node.board.emit("finished, now paused", kind="paused")
        node.set_state(NodeState.PAUSED, f"finished, {USER_PAUSE_REASON}")
        node.checkpoints.save("paused")

    def _apply(self, command: Command) -> None:
        if command == Command.QUIT:
            self.node.request_stop()
            return
        transition = on_command(command, self.node.board.snapshot().state, self.paused_by,
                                self.node.governors.verdict())
        if transition is not None:
            self.enact(transition)
