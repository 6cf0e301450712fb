"""One optimizer step, the loop's hot path: the scheduled learning rate, forward and backward
over ``grad_accum`` micro-batches under autocast, clipping, the update. One host sync a step:
the loss, read once after the last micro-batch."""

from __future__ import annotations

from collections.abc import Callable

import torch

from gptkiln import distributed as dist_utils
from gptkiln.config import TrainConfig
from gptkiln.optim import lr_at
from gptkiln.train.precision import static_precision
from gptkiln.train.prefetch import Prefetched, batches_for
from gptkiln.train.task import BatchSource


def autocast_for(device: str, precision: str) -> torch.autocast:
    """The autocast context of ``precision`` on ``device``: ``"bf16"`` or ``"fp32"``, as
    `gptkiln.train.precision` resolved it (``"auto"``, unresolved: bf16 on CUDA, fp32
    elsewhere)."""
    device_type = device.split(":")[0]
    if precision == "auto":
        precision = static_precision(device)
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=precision == "bf16")


class OptimizerStep:
    """Optimizer step ``step`` of ``total``, called as ``optimizer_step(step, total, time_used)``.

    Args:
        model: the model that trains, as wrapped for the ranks (plain, DDP or FSDP): its
            gradients are synchronised on the last micro-batch only, and clipped.
        forward: what runs the forward pass: ``model``, or torch.compile's wrapper of it.
        optimizer: the optimizer of ``model``'s parameters; its learning rate is set each step.
        batches: the (x, y) of each micro-batch, ``(batch_size, T)`` each; on CUDA read ahead
            into pinned memory while the step before runs (`gptkiln.train.prefetch`).
        cfg: the schedule, ``grad_accum`` and ``grad_clip``.
        device: where the batches go.

    ``precision``: what the steps run in, ``"fp32"`` or ``"bf16"`` autocast (`Trainer` sets
    the one it resolved; ``cfg.precision`` until then). ``loss``: a task's own
    ``training_loss(forward, x, y)`` (DPO's), set by `Trainer`; None: the model's own loss.
    ``learnt``: a task's ``learnt(x, y)``, how many items (learnt tokens, rows, pairs) a
    micro-batch's loss is the mean of; with it the step's gradient is the mean over every item
    of the step, on every rank, as one batch of them all would give (a fine-tuning step's
    micro-batches hold uneven learnt tokens). None: each micro-batch weighs the same (pretraining:
    every target is learnt). ``world``: the ranks, which count the items together.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        forward: Callable,
        optimizer: torch.optim.Optimizer,
        batches: BatchSource,
        cfg: TrainConfig,
        device: str,
    ) -> None:
        self.model, self.forward, self.optimizer = model, forward, optimizer
        self.batches = batches_for(batches, cfg.grad_accum, device)
        self.cfg, self.device = cfg, device
        self.precision = cfg.precision
        self.loss: Callable | None = None
        self.learnt: Callable | None = None
        self.world = dist_utils.World()

    def __call__(self, step: int, total: int, time_used: float) -> tuple[float, float]:
        """Step ``step`` of ``total`` (``time_used``: the fraction of a time budget spent, 0.0
        without one); (its learning rate, its mean loss on this rank; with ``learnt``, per item
        over every rank's)."""
        cfg = self.cfg
        lr = lr_at(
            step,
            lr=cfg.lr,
            min_lr=cfg.min_lr,
            warmup_steps=cfg.warmup_steps,
            total_steps=total,
            decay=cfg.decay_lr,
            time_used=time_used,
            schedule=cfg.schedule,
            cooldown=cfg.cooldown,
        )
        for group in self.optimizer.param_groups:  # a group's own peak: `optim.MuonAdamW`
            group["lr"] = lr * group.get("lr_scale", 1.0)
        loss_sum = torch.zeros((), device=self.device)
        items = torch.zeros((), device=self.device)
        for micro in range(cfg.grad_accum):
            x, y = self.batches.get(step, micro)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with dist_utils.gradient_sync(self.model, micro == cfg.grad_accum - 1):
                with autocast_for(self.device, self.precision):
                    if self.loss is None:
                        _, loss = self.forward(x, y)
                    else:
                        loss = self.loss(self.forward, x, y)
                if self.learnt is None:
                    (loss / cfg.grad_accum).backward()
                    loss_sum += loss.detach()
                else:  # the sum over the micro-batch's items; divided by the step's below
                    n = self.learnt(x, y)
                    (loss * n).backward()
                    loss_sum += loss.detach() * n
                    items += n
        if self.learnt is None:
            mean = loss_sum / cfg.grad_accum
        else:  # the loss and the items of every rank, in one collective
            summed, every = dist_utils.all_reduce_sum(torch.stack([loss_sum, items]), self.world)
            every = every.clamp(min=1)
            mean = summed / every  # the same on every rank: the whole step's loss per item
            scale = self.world.world_size / every  # the ranks' gradients are averaged
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale.to(p.grad.dtype))
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return lr, mean.item()

    def close(self) -> None:
        """Stop reading ahead (on CUDA a batch past the last step is being read, pinned)."""
        if isinstance(self.batches, Prefetched):
            self.batches.close()
