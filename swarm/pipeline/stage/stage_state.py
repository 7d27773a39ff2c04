"""A stage worker's copy as state (swarm/pipeline/stage/worker.py ``StageWorker``): a consistent snapshot, a copy pulled
from a peer mixed in, a snapshot restored. Every one under the worker's lock, in place (the optimizer keeps its
references and cached forward graphs stay valid)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from swarm.pipeline.stage.stage_stats import WorkerState
from swarm.run.optim_state import load_optimizer_tensors, optimizer_tensors


class StageState:
    """Mixed into StageWorker: needs ``lock``, ``module``, ``named_params``, ``optimizer``, ``stats`` and ``ring``
    (whatever writes into the weights releases the ring's live version first: swarm/integrity/weights.py)."""

    def state_snapshot(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """A consistent copy of the parameters (never half-updated); ``dtype``: floating tensors in it."""
        with self.lock:
            return {name: tensor.detach().to("cpu", dtype if dtype is not None and tensor.is_floating_point()
                                              else tensor.dtype, copy=True)
                    for name, tensor in self.module.state_dict().items()}

    def capture(self, include_optimizer: bool = False, dtype: torch.dtype | None = None) -> WorkerState:
        """Parameters with the clock, loss EMA and version they belong to, taken together under the lock. ``dtype``
        (healing's bfloat16 snapshot): the floating parameters and the optimizer's moments kept in it."""
        with self.lock:
            return WorkerState(
                params=self.state_snapshot(dtype),
                optimizer=optimizer_tensors(self.module, self.optimizer, dtype or torch.float32)
                if include_optimizer else None,
                clock=self.stats.clock, loss_ema=self.stats.loss_ema, param_version=self.stats.param_version,
            )

    @torch.no_grad()
    def mix_in(self, received: Mapping[str, torch.Tensor], factor: float, peer_clock: float) -> None:
        """``p <- factor * received + (1 - factor) * p`` in place, and the clock merged the same way.

        In place, so the optimizer keeps its references and cached forward graphs stay valid.
        ``received`` must already be checked (names, shapes, dtypes: swarm/averaging/checks.py).
        """
        if not 0.0 <= factor <= 1.0:
            raise ValueError(f"interpolation factor must be within [0, 1], got {factor}")
        with self.lock:
            self.ring.release_live()  # a referee may still ask for the version before the merge
            for name, tensor in self.module.state_dict().items():
                other = received[name].to(tensor.device)
                if tensor.is_floating_point():
                    tensor.lerp_(other.to(tensor.dtype), factor)
                elif factor >= 0.5:
                    tensor.copy_(other)
            self.stats.clock = factor * peer_clock + (1.0 - factor) * self.stats.clock
            self.stats.param_version += 1

    @torch.no_grad()
    def restore(self, state: WorkerState) -> None:
        """Make ``state`` our copy (in place), with its optimizer state when it carries one."""
        with self.lock:
            self.ring.release_live()
            for name, tensor in self.module.state_dict().items():
                tensor.copy_(state.params[name].to(tensor.device, tensor.dtype))
            if state.optimizer is not None:
                load_optimizer_tensors(self.module, self.optimizer, state.optimizer)
            self.stats.clock = state.clock
            self.stats.loss_ema = state.loss_ema
            self.stats.param_version += 1

    def _kept_params(self) -> list[torch.Tensor] | None:
        """The parameters as they are now, from the ring's latest version if nothing changed them since it was
        committed (an update op commits the weights it computes with, then steps): the guard's pre-step copy."""
        kept = self.ring.unchanged(self.module)
        if kept is None:
            return None
        try:
            return [kept[name] for name, _ in self.named_params]
        except KeyError:
            return None

    def weights_for(self, digest: bytes) -> dict[str, torch.Tensor] | None:
        """The weights of a version this stage computed with, by the digest its receipts signed; None once dropped."""
        kept = self.ring.get(digest)
        return None if kept is None else kept.tensors
