"""The optimizer and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
import torch.nn as nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices and embeddings (>= 2-D) only, never on biases or LayerNorms."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_optimizer(
    model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float]
) -> torch.optim.AdamW:
    """AdamW over `param_groups`, with the fused kernel where this torch build and device have one
    (one kernel for all parameters instead of a Python loop), else the multi-tensor one."""
    groups = param_groups(model, weight_decay)
    device = next(model.parameters()).device.type
    fused = device in ("cuda", "cpu") and _is_plain_tensor(model)
    return torch.optim.AdamW(
        groups, lr=lr, betas=betas, fused=fused or None, foreach=None if fused else True
    )


def _is_plain_tensor(model: nn.Module) -> bool:
    # FSDP2 parameters are DTensors; the fused kernel takes plain tensors only.
    return all(type(p) is torch.nn.Parameter or type(p) is torch.Tensor for p in model.parameters())


def lr_at(
    step: int,
    *,
    lr: float,
    min_lr: float,
    warmup_steps: int,
    total_steps: int,
    decay: bool = True,
    time_used: float = 0.0,
) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warm-up from lr/warmup to lr over
    ``warmup_steps``, then cosine decay to ``min_lr`` at ``total_steps`` (constant lr when
    ``decay`` is False, as in the book's chapter 5).

    ``time_used`` is the share of a time budget spent before this step (0 without one): the
    cosine follows whichever of the steps and the time is further along, so a run cut by its
    time budget still ends at ``min_lr``.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if not decay:
        return lr
    progress = max((step - warmup_steps) / max(1, total_steps - warmup_steps), time_used)
    if step >= total_steps or progress >= 1.0:
        return min_lr
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)
