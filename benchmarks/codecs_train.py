"""The run's pipeline in one process, with every stage boundary going through the wire codec.

What ``benchmarks.codecs`` measures with. The stages, optimizer, batches and loss are the ones of
``swarm.run.local.train_local``; at each boundary an autograd function sends the activations forward
and the gradients backward through ``swarm.pipeline.transport.wire.encode_tensors``/``decode_tensors`` (the real
serialized messages) in the topology of a swarm: stage 0 lives at the driver, so boundary 0|1 costs
one message per direction; every other boundary two (stage k -> driver -> stage k+1, the driver
relaying the coded payload unchanged). Same seed, same samples for every codec: only the codec
differs. CPU seconds count one encode and one decode per boundary and direction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from swarm.run.data import MicroBatches, load_dataset
from swarm.run.local import evaluate, make_optimizer
from swarm.run.models import build_stages, loss_fn
from swarm.run.runconfig import RunConfig
from swarm.pipeline.transport.wire import decode_tensors, encode_tensors

MAX_BYTES = 2**30


@dataclass
class WireTally:
    """Bytes on the wire and CPU spent coding, summed over a run."""

    activation_bytes: int = 0
    gradient_bytes: int = 0
    cpu_s: float = 0.0
    crossings: int = 0  # boundary crossings coded (one per boundary, direction and micro-batch)
    errors: list[float] = field(default_factory=list)  # relative error of each coded tensor
    feedback: frozenset[str] = frozenset()  # ablation: "activations"/"gradients" carry residuals across micro-batches
    residuals: dict[tuple[int, bool], torch.Tensor] = field(default_factory=dict)

    def send(self, tensor: torch.Tensor, codec: str, rank: int, hops: int, gradient: bool, boundary: int = 0,
             ) -> torch.Tensor:
        key = (boundary, gradient)
        carried = self.residuals.get(key)
        if ("gradients" if gradient else "activations") in self.feedback and carried is not None \
                and carried.shape == tensor.shape:
            tensor = tensor + carried  # naive error feedback: the last micro-batch's residual (other samples)
        started = time.process_time()
        serialized = encode_tensors([tensor], codec, rank)
        (out,) = decode_tensors(serialized, MAX_BYTES, coded=True)
        self.cpu_s += time.process_time() - started
        self.crossings += 1
        size = sum(item.ByteSize() for item in serialized) * hops
        if gradient:
            self.gradient_bytes += size
        else:
            self.activation_bytes += size
        self.residuals[key] = tensor.float() - out
        norm = float(tensor.norm())
        if norm > 0:
            self.errors.append(float((out - tensor.float()).norm()) / norm)
        return out.to(tensor.dtype).view_as(tensor)


class _Boundary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tally, codecs, ranks, hops, boundary):
        ctx.meta = (tally, codecs[1], ranks[1], hops, boundary)
        return tally.send(x.detach(), codecs[0], ranks[0], hops, gradient=False, boundary=boundary)

    @staticmethod
    def backward(ctx, grad):
        tally, codec, rank, hops, boundary = ctx.meta
        out = tally.send(grad.detach().contiguous(), codec, rank, hops, gradient=True, boundary=boundary)
        return out, None, None, None, None, None


@dataclass
class CodedResult:
    codec: str
    rank: int
    samples: int
    test_loss: float  # through the codec, as the swarm's own evaluation sees it
    test_loss_plain: float  # the same weights evaluated without a codec
    accuracy: float | None
    train_loss_tail: float  # mean training loss of the last 10 % of micro-batches
    tally: WireTally

    @property
    def bytes_per_sample(self) -> float:
        return (self.tally.activation_bytes + self.tally.gradient_bytes) / max(self.samples, 1)


def _forward(stages: list[torch.nn.Module], x: torch.Tensor, tally: WireTally, codec: str | tuple[str, str],
             rank: int) -> torch.Tensor:
    """``codec``: one for both directions, or (activations', gradients') for the ablation."""
    pair = (codec, codec) if isinstance(codec, str) else codec
    ranks = (rank, rank) if isinstance(rank, int) else rank
    h = stages[0](x)
    for k, stage in enumerate(stages[1:], start=1):
        h = _Boundary.apply(h, tally, pair, ranks, 1 if k == 1 else 2, k)
        h = stage(h)
    return h


@torch.no_grad()
def _coded_test_loss(stages, dataset, run: RunConfig, codec: str, rank: int) -> float:
    tally = WireTally()
    loss_sum, count = 0.0, 0
    for stage in stages:
        stage.eval()
    for start in range(0, len(dataset.x_test), 256):
        x, y = dataset.x_test[start : start + 256], dataset.y_test[start : start + 256]
        loss_sum += float(loss_fn(run.model, _forward(stages, x, tally, codec, rank), y)) * len(x)
        count += len(x)
    for stage in stages:
        stage.train()
    return loss_sum / count


def train_coded(run: RunConfig, codec: str | tuple[str, str], rank: int, num_samples: int, seed: int = 0,
                dataset=None, feedback: frozenset[str] = frozenset()) -> CodedResult:
    """Train the run's stages for ``num_samples`` samples with ``codec`` at every boundary (a pair: activations'
    and gradients' codecs; ``feedback``: which directions carry residuals to the next micro-batch)."""
    data = dataset if dataset is not None else load_dataset(run.data, run.model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        stages = build_stages(run.model)
        optimizers = [make_optimizer(stage.parameters(), run.optimizer) for stage in stages]
        batches = MicroBatches(data.x_train, data.y_train, np.arange(len(data.x_train)),
                               run.training.batch_size, seed)
        tally, losses, seen = WireTally(feedback=feedback), [], 0
        while seen < num_samples:
            x, y = next(batches)
            loss = loss_fn(run.model, _forward(stages, x, tally, codec, rank), y)
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            loss.backward()
            for optimizer in optimizers:
                optimizer.step()
            losses.append(float(loss.detach()))
            seen += len(x)
        accuracy, plain = evaluate(stages, data, run.model)
        coded = _coded_test_loss(stages, data, run, codec, rank)
    tail = losses[-max(1, len(losses) // 10):]
    return CodedResult(codec=str(codec), rank=rank, samples=seen, test_loss=coded, test_loss_plain=plain,
                       accuracy=accuracy, train_loss_tail=sum(tail) / len(tail), tally=tally)
