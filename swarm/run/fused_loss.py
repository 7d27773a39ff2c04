"""A language model's head and cross-entropy in one step, a few thousand rows at a time (issue 42: the last stage's
memory).

``F.cross_entropy(lm_head(h))`` holds the whole (tokens x vocabulary) logits, their log-softmax for the backward
and, in the backward, a gradient of each: four tensors of 8 MiB for an llm-tiny micro-batch (16 x 64 tokens x
2,048), of 64 MiB for llm-small's (8 x 1,024 x 2,048). glibc keeps what they took as heap between micro-batches
(benchmarks/README.md, session 19), so they set a volunteer's resident memory, not only its peak.

Here the loss is computed over row chunks of at most ``CHUNK_BYTES`` of logits, and since it is the last operation
of the graph its gradients with respect to the hidden states and the head's weight are computed in the same pass
(the softmax minus the target, over the token count, times the weight or the hidden states), as Liger Kernel's
fused linear cross-entropy does: the backward only scales them by the incoming gradient (1.0 from
``loss.backward()``). No logits are recomputed and none outlive their chunk: memory is the chunk, the hidden
states' gradient (as large as the hidden states) and the weight's (as large as the weight).

The same loss and gradients as the unfused head up to float rounding (tests/test_fused_loss.py), computed in
float32 whatever autocast says around it.
"""

from __future__ import annotations

import torch

CHUNK_BYTES = 4 * 2**20  # float32 logits of one chunk


def chunk_rows(vocab_size: int) -> int:
    return max(1, CHUNK_BYTES // (4 * vocab_size))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[0]
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros_like(weight) if want_w else None
        total = hidden.new_zeros(())
        step = chunk_rows(weight.shape[0])
        for start in range(0, rows, step):
            h, t = hidden[start : start + step], targets[start : start + step]
            logp = torch.log_softmax(h @ weight.t(), dim=-1)
            total -= logp.gather(1, t[:, None]).sum()
            if want_h or want_w:  # d(summed loss) / d(logits): the chunk's softmax minus the targets, in place
                probs = logp.exp_().scatter_add_(1, t[:, None], logp.new_full((t.shape[0], 1), -1.0))
                if want_h:
                    torch.mm(probs, weight, out=grad_h[start : start + step])
                if want_w:
                    grad_w.addmm_(probs.t(), h)
        ctx.rows = rows
        ctx.save_for_backward(grad_h, grad_w)
        return total / rows

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_out / ctx.rows  # of the mean
        return (None if grad_h is None else grad_h * scale, None if grad_w is None else grad_w * scale, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats per token) of ``hidden @ weight.T`` against ``targets``: hidden (..., d), weight
    (vocabulary, d), targets (...) token ids. Float32, outside any autocast."""
    with torch.autocast(hidden.device.type, enabled=False):
        flat = hidden.reshape(-1, hidden.shape[-1]).float()
        return _LinearCrossEntropy.apply(flat, weight.float(), targets.reshape(-1))
