"""Training across processes with PyTorch's own engine: torchrun, DDP, FSDP2.

Parallelism wraps a built model from outside (as torchtitan does); the model never knows.
Launch with ``torchrun --nproc-per-node N -m gptkiln train ...``: torchrun sets RANK, WORLD_SIZE,
LOCAL_RANK and the rendezvous; `setup` reads them. Without them, everything is a no-op and the
world is one process.
"""

from __future__ import annotations

import datetime
import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn


@dataclass(frozen=True)
class World:
    """Where this process stands: rank among world_size, and its device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def setup(device: str) -> World:
    """Join the process group when launched by torchrun: gloo on CPU, nccl on CUDA.

    A collective that waits longer than GPTKILN_DIST_TIMEOUT seconds (default 300) fails instead
    of hanging, so a dead rank ends the job.
    """
    if not launched_by_torchrun():
        return World()
    world = World(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                  int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(world.local_rank)
        timeout = datetime.timedelta(seconds=float(os.environ.get("GPTKILN_DIST_TIMEOUT", 300)))
        dist.init_process_group(backend=backend, timeout=timeout)
    return world


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def parallelize(model: nn.Module, world: World, strategy: str) -> nn.Module:
    """Wrap a built model for data parallelism: DDP (a full copy per rank, gradients
    all-reduced) or FSDP2 (`fully_shard` per block, then the root: parameters, gradients and
    optimizer state sharded across ranks)."""
    if not world.distributed:
        return model
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.h:
            fully_shard(block)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    device_ids = [world.local_rank] if next(model.parameters()).is_cuda else None
    return DDP(model, device_ids=device_ids)


def unwrap(model: nn.Module) -> nn.Module:
    """The GPT inside a DDP wrapper (FSDP2 keeps the module itself)."""
    return getattr(model, "module", model)


@contextmanager
def gradient_sync(model: nn.Module, enabled: bool):
    """Skip the gradient all-reduce on all but the last micro-step of gradient accumulation."""
    if hasattr(model, "no_sync"):  # DDP
        with nullcontext() if enabled else model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
        yield
    else:
        yield


def all_reduce_mean(values: torch.Tensor, world: World) -> torch.Tensor:
    """Average a tensor over ranks (identity in one process)."""
    if world.distributed:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        values /= world.world_size
    return values


def all_reduce_sum(values: torch.Tensor, world: World) -> torch.Tensor:
    if world.distributed:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None):
    """Full (unsharded) model and optimizer state dicts on CPU, keyed by parameter name, the same
    whether the model is plain, DDP or FSDP2: so checkpoints move between 1 and N processes."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=options)
    optim_sd = None if optimizer is None else get_optimizer_state_dict(model, optimizer,
                                                                       options=options)
    return model_sd, optim_sd


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                    model_sd: dict, optim_sd: dict) -> None:
    """Load full state dicts (as saved by `full_state`) into a plain, DDP or FSDP2 model."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_sd, options=options)
    set_optimizer_state_dict(model, optimizer, optim_sd, options=options)
