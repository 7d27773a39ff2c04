"""The machine comes first: the idle policy, the bandwidth cap, the GPU memory cap.

``Governors`` polls the idle policy (volunteer/headless.py ``IdleGovernor``) and hands its verdicts
to the commands part, which knows who paused; it throttles the stage over the bandwidth cap; and it
keeps the stage taking new work only while the node is online and under the cap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from volunteer.snapshot import EventLevel, NodeState

if TYPE_CHECKING:
    from volunteer.node.commands import Verdict
    from volunteer.node.core import Node


class Governors:
    def __init__(self, node: Node):
        self.node = node
        self.idle: Any = None  # volunteer.headless.IdleGovernor while idle.enabled
        self.budget: Any = None  # volunteer.headless.BandwidthBudget while a cap is set
        self.throttled = False
        self._accepting = True  # mirrors the peer's pause()/resume()

    def start(self) -> None:
        from volunteer.headless import BandwidthBudget, IdleGovernor

        node = self.node
        if node.options.idle.enabled:
            device = node.peer.device if node.peer is not None else node.options.device
            self.idle = IdleGovernor(node.options.idle, device, wake=node.wake)
            node.board.emit("idle mode: training only while this machine is idle (see `volunteer doctor`)",
                            kind="idle")
        if node.options.resources.bandwidth_mbit_s > 0 and node.peer is not None:
            self.budget = BandwidthBudget(node.options.resources.bandwidth_mbit_s)

    def tick(self, now_s: float) -> None:
        self.follow_idle_policy()
        self.follow_bandwidth_cap()

    def close(self) -> None:
        """Stop observing the machine (idempotent: the node closes it first on leave, then with all parts)."""
        if self.idle is not None:
            self.idle.close()
            self.idle = None

    def verdict(self) -> Verdict | None:
        """The idle policy's last verdict (None without idle mode or before its first poll)."""
        return self.idle.verdict if self.idle is not None else None

    def throttle_reason(self) -> str | None:
        return self.budget.reason() if self.throttled and self.budget is not None else None

    def follow_idle_policy(self) -> None:
        if self.idle is None:
            return
        verdict = self.idle.poll()
        if verdict is not None:
            self.node.commands.follow_policy(verdict)

    def follow_bandwidth_cap(self) -> None:
        peer = self.node.peer
        if self.budget is None or peer is None:
            return
        m = peer.metrics()
        throttled = self.budget.update(m.bytes_in + m.bytes_out)
        if throttled != self.throttled:
            self.throttled = throttled
            self.sync_accepting()
            if throttled:
                self.node.board.emit(self.budget.reason(), kind="throttled")

    def sync_accepting(self) -> None:
        """The stage takes new work only while online and under the bandwidth cap."""
        peer = self.node.peer
        if peer is None:
            return
        accepting = self.node.board.snapshot().state == NodeState.ONLINE and not self.throttled
        if accepting != self._accepting:
            self._accepting = accepting
            if accepting:
                peer.resume()
            else:
                peer.pause()

    def apply_gpu_memory_fraction(self, device: str) -> None:
        from volunteer.headless import apply_gpu_memory_fraction

        fraction = self.node.options.resources.gpu_memory_fraction
        board = self.node.board
        try:
            if apply_gpu_memory_fraction(device, fraction):
                board.emit(f"using at most {fraction:.0%} of the GPU's memory", kind="joining")
        except (RuntimeError, ValueError) as exc:
            board.emit(f"could not cap the GPU memory at {fraction:.0%}: {exc}", EventLevel.WARNING, "joining")
