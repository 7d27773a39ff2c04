"""What the copies of a run really are, whatever their peers publish: for the adversary tests and benchmark.

``CopyOracle`` pulls every layer through the real params service (as `volunteer export` does) and
evaluates the pipeline here; it also gives the honest gradient at a stage's output, which the
gradient attacks of tests/hostile.py perturb.
"""

from __future__ import annotations

import asyncio
import time

import torch

from hostile import HostilePeer

PULL_TRIES = 3


class CopyOracle:
    """Copies of every layer pulled through the real params service, evaluated here.

    Gives the honest gradient at a stage's output (what a gradient attack perturbs) and the true test
    accuracy of the pipeline, independent of what any peer publishes.
    """

    def __init__(self, peer: HostilePeer):
        from swarm.run.data import load_dataset
        from swarm.run.models import build_stages

        self.peer = peer
        self.run = peer.run
        self.dataset = load_dataset(self.run.data, self.run.model)
        self.stages = build_stages(self.run.model)
        self.pulled_at = 0.0

    def pull(self, peer_ids: dict[str, str], timeout_s: float = 20.0) -> None:
        """Load the copy of each swarm from the given peer (swarm -> peer id)."""
        from swarm.averaging.params_rpc import fetch_params

        async def one(k: int) -> dict[str, torch.Tensor]:
            # a stream cut on a loaded machine ("the stream ended early") is a network fault, not the test's
            # subject: the oracle tries again, as a volunteer's download does (PULL_TRIES in all)
            for attempt in range(PULL_TRIES):
                try:
                    return (await fetch_params(self.peer.p2p, peer_ids[f"layer{k}"], self.run, f"layer{k}",
                                               timeout_s=timeout_s))[0]
                except ConnectionError:
                    if attempt == PULL_TRIES - 1:
                        raise
                    await asyncio.sleep(0.5)
            raise AssertionError("unreachable")

        async def all_layers() -> list[dict[str, torch.Tensor]]:
            return [await one(k) for k in range(len(self.stages))]

        limit_s = (timeout_s + 1) * PULL_TRIES * len(self.stages) + 10
        for stage, state in zip(self.stages, self.peer.on_loop(all_layers(), limit_s)):
            stage.load_state_dict(state)
        self.pulled_at = time.monotonic()

    def honest_gradient(self, k: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(input of stage k, d loss / d output of stage k, loss) for the batch, through the pulled copies."""
        from swarm.run.models import loss_fn

        with torch.no_grad():
            h = x
            for stage in self.stages[:k]:
                h = stage(h)
        out = self.stages[k](h).detach().requires_grad_(True)
        logits = out
        for stage in self.stages[k + 1:]:
            logits = stage(logits)
        loss = loss_fn(self.run.model, logits, y)
        (grad,) = torch.autograd.grad(loss, out)
        for stage in self.stages:
            stage.zero_grad(set_to_none=True)
        return h.detach(), grad.detach(), loss.item()

    def stage_input(self, k: int, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for stage in self.stages[:k]:
                x = stage(x)
        return x

    def test_accuracy(self) -> float:
        with torch.no_grad():
            h = self.dataset.x_test
            for stage in self.stages:
                h = stage(h)
        return float((h.argmax(dim=-1) == self.dataset.y_test).float().mean())


def params_finite(state: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in state.values() if t.is_floating_point())


def relative_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over all tensors (inf when a holds non-finite values)."""
    diff = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in b) ** 0.5
    norm = sum(float(b[k].double().pow(2).sum()) for k in b) ** 0.5
    return diff / max(norm, 1e-12)
