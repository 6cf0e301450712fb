"""The language model's cross-entropy on the CPU: the loss and its gradient in one pass over the
logits, a few rows at a time.

``F.cross_entropy(logits.float(), targets)`` over a small model's logits is much of a CPU
training step (issue 47: on ``qwen3-baby`` with a 16,384-id head, 512 rows of 16,384 logits a
step): under bf16 autocast it copies all of them to fp32, keeps their log-softmax for the
backward, fills a zero tensor of the same size for NLL's gradient and copies the gradient back
to bf16, each a pass over memory the size of the logits. `cross_entropy` computes each block of
rows' log-sum-exp and, where a gradient is wanted, its gradient (softmax minus the one-hot
target, over the number of targets) in the same pass, while the block is in cache; the backward
only scales it. The same arithmetic in fp32 (the loss agrees with torch's to fp32 rounding, the
gradient to bf16's where the logits are bf16). On other devices, and under ``torch.compile``
(which fuses torch's own), it is ``F.cross_entropy``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_BLOCK_ELEMENTS = 1 << 19  # a block of rows: about 2 MB of fp32 logits, the size of a core's L2


def cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    vocab: int | None = None,
) -> torch.Tensor:
    """The mean cross-entropy of ``logits`` (N, V) against ``targets`` (N,), positions whose
    target is ``ignore_index`` left out; computed in fp32 whatever the logits' dtype. With
    ``vocab``, only the first ``vocab`` columns are logits (a padded head's output: the others
    take no part, and get a zero gradient)."""
    if vocab is None or vocab == logits.shape[-1]:
        vocab = None
    if logits.device.type != "cpu" or torch.compiler.is_compiling() or logits.dim() != 2:
        used = logits if vocab is None else logits[:, :vocab]
        return F.cross_entropy(used.float(), targets, ignore_index=ignore_index)
    return _BlockwiseCrossEntropy.apply(logits, targets, ignore_index, vocab)


class _BlockwiseCrossEntropy(torch.autograd.Function):
    """Forward: the loss, and (when the logits want a gradient) d loss / d logits, block by
    block; backward: that gradient times the loss's."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, used):
        rows, width = logits.shape
        vocab = width if used is None else used  # the columns that are logits
        kept = targets != ignore_index
        count = kept.sum().clamp(min=1)
        weight = kept.float() / count  # each kept row's share of the mean
        safe = torch.where(kept, targets, 0)[:, None]
        losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
        grad = torch.empty_like(logits) if ctx.needs_input_grad[0] else None
        if grad is not None and vocab < width:
            grad[:, vocab:] = 0
        block = max(1, _BLOCK_ELEMENTS // max(vocab, 1))
        for start in range(0, rows, block):
            part = slice(start, start + block)
            x = logits[part, :vocab].to(torch.float32, copy=True)
            top = x.amax(-1, keepdim=True)
            x.sub_(top).exp_()  # exp(x - max): softmax's numerators, computed once
            total = x.sum(-1, keepdim=True)
            picked = logits[part].gather(1, safe[part]).float()
            losses[part] = (top + total.log() - picked).squeeze(1)
            if grad is not None:
                share = weight[part, None]
                x.mul_(share / total)  # softmax x the row's share of the mean
                x.scatter_add_(1, safe[part], -share)  # minus the one-hot target
                grad[part, :vocab] = x
        ctx.save_for_backward(grad)
        # nan where no target is kept, as F.cross_entropy's mean of nothing
        loss = (losses * kept).sum() / kept.sum()
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        (grad,) = ctx.saved_tensors
        if bool(grad_loss == 1):  # loss.backward(): the gradient as it is, no pass over it
            return grad, None, None, None
        return grad * grad_loss.to(grad.dtype), None, None, None
