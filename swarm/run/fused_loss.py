"""A language model's head and cross-entropy in one step, a few thousand rows at a time (issue 42: the last stage's
memory): llama's last stage (swarm/run/llama.py) and the byte-level transformer's (``models.TransformerStage``).

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
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[0]
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        want_b = bias is not None and ctx.needs_input_grad[2]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros_like(weight) if want_w else None
        grad_b = torch.zeros_like(bias) if want_b else None
        total = hidden.new_zeros(())
        step = chunk_rows(weight.shape[0])
        for start in range(0, rows, step):
            h, t = hidden[start : start + step], targets[start : start + step]
            logits = h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())
            logp = torch.log_softmax(logits, dim=-1)
            total -= logp.gather(1, t[:, None]).sum()
            if want_h or want_w or want_b:  # d(summed loss) / d(logits): the chunk's softmax minus the targets
                probs = logp.exp_().scatter_add_(1, t[:, None], logp.new_full((t.shape[0], 1), -1.0))
                if want_h:
                    torch.mm(probs, weight, out=grad_h[start : start + step])
                if want_w:
                    grad_w.addmm_(probs.t(), h)
                if want_b:
                    grad_b += probs.sum(0)
        ctx.rows = rows
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        return total / rows

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        scale = grad_out / ctx.rows  # of the mean
        return (*(None if g is None else g * scale for g in ctx.saved_tensors), None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy (nats per token) of ``hidden @ weight.T (+ bias)`` against ``targets``: hidden (..., d),
    weight (vocabulary, d), targets (...) token ids. Float32, outside any autocast."""
    with torch.autocast(hidden.device.type, enabled=False):
        flat = hidden.reshape(-1, hidden.shape[-1]).float()
        return _LinearCrossEntropy.apply(flat, weight.float(), None if bias is None else bias.float(),
                                         targets.reshape(-1))
