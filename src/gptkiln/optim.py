"""The optimizers (AdamW, or Muon with AdamW beside it) and the learning-rate schedules."""

from __future__ import annotations

import math
import re

import torch
import torch.nn as nn

_BLOCK_PARAM = re.compile(r"(^|\.)h\.\d+\.")  # a parameter of a transformer block: h.3.mlp...


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices and embeddings (>= 2-D) only, never on biases or LayerNorms."""
    params = [p for p in model.parameters() if p.requires_grad]
    return _decay_groups(params, weight_decay)


def _decay_groups(params: list[torch.Tensor], weight_decay: float) -> list[dict]:
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def hidden_matrices(model: nn.Module) -> list[torch.Tensor]:
    """The matrices inside the transformer blocks (attention and MLP projections, LoRA
    adapters): what Muon trains. The embeddings, the head (tied or not), norms and biases are
    left to AdamW, as modded-nanogpt and nanochat split them."""
    return [
        p
        for name, p in model.named_parameters()
        if p.requires_grad and p.dim() == 2 and _BLOCK_PARAM.search(name)
    ]


def make_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    kind: str = "adamw",
    momentum: float = 0.95,
    adamw_lr: float | None = None,
    embedding_lr: float | None = None,
) -> torch.optim.Optimizer:
    """The optimizer of ``model``'s trainable parameters: ``"adamw"``, AdamW over
    `param_groups`; ``"muon"``, `MuonAdamW` (Muon for `hidden_matrices`, AdamW with ``betas``
    for the rest, at ``adamw_lr``: None, ``lr``; the input embeddings' tables, the head too
    where it is tied, at ``embedding_lr``: None, AdamW's). AdamW takes the fused kernel where
    this torch build and device have one (one kernel for all parameters instead of a Python
    loop), else the multi-tensor one."""
    device = next(model.parameters()).device.type
    fused = device in ("cuda", "cpu") and _is_plain_tensor(model)
    adamw = dict(lr=lr, betas=betas, fused=fused or None, foreach=None if fused else True)
    if kind == "adamw":
        return torch.optim.AdamW(param_groups(model, weight_decay), **adamw)
    matrices = hidden_matrices(model)
    chosen = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in chosen]
    groups = _decay_groups(rest, weight_decay)
    if adamw_lr is not None:
        for group in groups:  # the schedule sets a group's lr to its lr_scale x the step's
            group.update(lr=adamw_lr, lr_scale=adamw_lr / lr)
    if embedding_lr is not None:
        tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        embedded = [p for p in groups[0]["params"] if id(p) in tables]
        groups[0]["params"] = [p for p in groups[0]["params"] if id(p) not in tables]
        scale = embedding_lr / lr
        groups.append(dict(params=embedded, weight_decay=weight_decay, lr=embedding_lr))
        groups[-1]["lr_scale"] = scale
    return MuonAdamW(matrices, groups, lr, weight_decay, momentum, adamw)


class MuonAdamW(torch.optim.Optimizer):
    """Muon (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/; torch's
    ``torch.optim.Muon``) for the hidden matrices and AdamW for every other parameter, as one
    optimizer: one list of param groups (Muon's first), one state, one ``state_dict``, so the
    trainer sets the learning rate, checkpoints and resumes it as it does AdamW.

    Muon's step is momentum (Nesterov), then the update orthogonalised by 5 Newton-Schulz
    iterations (in bf16), scaled by ``0.2 * sqrt(max(rows, cols))`` (Moonshot's
    ``match_rms_adamw``: its RMS is AdamW's, so one learning rate serves both), with AdamW's
    decoupled weight decay. The orthogonalisation needs each whole matrix: under DDP every rank
    holds it (the gradients are all-reduced first, each rank computes the same update); under
    FSDP2 a rank holds rows of it, so each update is gathered whole (one all-gather a matrix),
    orthogonalised on every rank alike, and each rank applies its own rows, as under DDP.

    Args:
        matrices: the 2-D parameters Muon trains.
        adamw_groups: AdamW's param groups (each with its ``weight_decay``, and where its
            learning rate differs from Muon's its ``lr`` and ``lr_scale``, the ratio of the two
            that the trainer's schedule keeps).
        lr, weight_decay, momentum: Muon's; ``adamw``: AdamW's keyword arguments.
    """

    def __init__(
        self,
        matrices: list[torch.Tensor],
        adamw_groups: list[dict],
        lr: float,
        weight_decay: float,
        momentum: float,
        adamw: dict,
    ) -> None:
        self.muon = torch.optim.Muon(
            matrices,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            adjust_lr_fn="match_rms_adamw",
        )
        self.adamw = torch.optim.AdamW([g for g in adamw_groups if g["params"]], **adamw)
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], defaults={})
        self._share()

    def _share(self) -> None:
        """Point the two optimizers at this one's groups and state (after a load replaced
        them)."""
        n = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = (
            self.param_groups[:n],
            self.param_groups[n:],
        )
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 (Optimizer's)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.muon.param_groups:
            _muon_group_step(self.muon, group)
        self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:  # noqa: D102 (Optimizer's)
        super().load_state_dict(state_dict)
        self._share()


def _muon_group_step(muon: torch.optim.Muon, group: dict) -> None:
    """``torch.optim.Muon``'s step for one param group (its state, hyperparameters and
    arithmetic: Nesterov momentum, the Newton-Schulz iterations in bf16, the adjusted learning
    rate, decoupled weight decay), with the matrices of one shape orthogonalised together, in
    batched matmuls: torch's Muon has no foreach path, and its loop of small products over
    the 28 matrices of ``qwen3-baby`` cost 32 ms of CPU a step against 19 ms batched (one
    thread; bench/README.md)."""
    from torch.optim._muon import _adjust_lr

    params: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    buffers: list[torch.Tensor] = []
    muon._init_group(group, params, grads, buffers)
    momentum, (a, b, c) = group["momentum"], group["ns_coefficients"]
    by_shape: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for p, grad, buf in zip(params, grads, buffers, strict=True):
        buf.lerp_(grad, 1 - momentum)
        update = grad.lerp(buf, momentum) if group["nesterov"] else buf
        by_shape.setdefault(tuple(p.shape), []).append((p, _whole(update)))
    for shape, pairs in by_shape.items():
        x = torch.stack([update for _, update in pairs]).bfloat16()  # (n, rows, cols)
        tall = shape[0] > shape[1]
        x = x.mT if tall else x  # the Gram matrix of the short side
        x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=group["eps"])
        for _ in range(group["ns_steps"]):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        x = x.mT if tall else x
        lr = _adjust_lr(group["lr"], group["adjust_lr_fn"], torch.Size(shape))
        for (p, _), orthogonal in zip(pairs, x, strict=True):
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(_rows_of(orthogonal.to(p.dtype), p), alpha=-lr)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """An FSDP2 shard's whole matrix (an all-gather); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _rows_of(whole: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The part of ``whole`` that ``p`` holds: ``whole`` itself for a plain tensor, this rank's
    shard for an FSDP2 one (every rank computed the same ``whole``: no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(p, DTensor):
        return whole
    return distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)


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
    schedule: str = "cosine",
    cooldown: float = 0.3,
) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warm-up from lr/warmup to lr over
    ``warmup_steps``, then (``schedule``) ``"cosine"`` decay to ``min_lr`` at ``total_steps``,
    or ``"wsd"``, warm-up-stable-decay: ``lr`` until the last ``cooldown`` share of the steps
    after warm-up, then a straight line down to ``min_lr`` (Hägele et al. 2024,
    https://arxiv.org/abs/2405.18392; modded-nanogpt's schedule). Constant lr when ``decay``
    is False, as in the book's chapter 5.

    ``time_used`` is the share of a time budget spent by the end of this step, foreseen (0
    without one): the decay follows whichever of the steps and the time is further along, so a
    run cut by its time budget still ends at ``min_lr``, from warm-up too.
    """
    if decay and time_used >= 1.0:
        return min_lr
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if not decay:
        return lr
    progress = max((step - warmup_steps) / max(1, total_steps - warmup_steps), time_used)
    if step >= total_steps or progress >= 1.0:
        return min_lr
    if schedule == "wsd":
        into_cooldown = (progress - (1.0 - cooldown)) / cooldown
        return lr if into_cooldown <= 0 else lr + into_cooldown * (min_lr - lr)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)
