"""Training across processes with PyTorch's own engine: torchrun, DDP, FSDP2.

Parallelism wraps a built model from outside (as torchtitan does); the model never knows.
Launch with ``torchrun --nproc-per-node N -m gptkiln train ...``: torchrun sets RANK, WORLD_SIZE,
LOCAL_RANK and the rendezvous; `setup` reads them. Without them, everything is a no-op and the
world is one process. docs/DISTRIBUTED.md tells the whole story (several machines, faults).
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from gptkiln.errors import GptkilnError

DEFAULT_TIMEOUT_S = 300.0
# Words in the errors a collective raises when a peer died, hung or lost its network (gloo's
# "Connection reset by peer", "Timed out waiting 300000ms", NCCL's watchdog, ...).
_PEER_FAILURE_MARKERS = ("gloo", "nccl", "connection", "timed out", "timeout", "broken pipe")


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


def restart_count() -> int:
    """How many times torchrun has restarted the workers (``--max-restarts``); 0 otherwise."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def restarts_left() -> bool:
    """Whether torchrun would restart the workers should this attempt fail (a
    ``--max-restarts`` not used up yet)."""
    return restart_count() < int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0))


def collective_timeout() -> datetime.timedelta:
    """How long a collective may wait for the other ranks: GPTKILN_DIST_TIMEOUT seconds (300)."""
    return datetime.timedelta(
        seconds=float(os.environ.get("GPTKILN_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
    )


def backend_for(device: str) -> str:
    """The process group's backends: gloo on CPU; on CUDA, NCCL for the model's tensors and gloo
    for the CPU ones the trainer exchanges (the loss, flags, RNG states), which plain "nccl"
    would refuse ("No backend type associated with device type cpu")."""
    return "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"


def setup(device: str) -> World:
    """Join the process group when launched by torchrun: gloo on CPU, nccl on CUDA.

    A collective that waits longer than GPTKILN_DIST_TIMEOUT seconds (default 300) fails instead
    of hanging, so a rank that hangs (not only one that dies) ends the job.
    """
    if not launched_by_torchrun():
        return World()
    world = World(
        int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    )
    if not dist.is_initialized():
        backend = backend_for(device)
        if device.startswith("cuda"):
            torch.cuda.set_device(world.local_rank)
        timeout = collective_timeout()
        store = _restart_store(world, timeout)
        dist.init_process_group(
            backend=backend,
            timeout=timeout,
            store=store,
            rank=world.rank if store else -1,
            world_size=world.world_size if store else -1,
        )
    return world


def _restart_store(world: World, timeout: datetime.timedelta):
    """The rendezvous store, under a prefix of its own, for workers that torchrun restarted.

    torchrun's agent keeps one store for all its attempts (pytorch#135712): restarted workers
    would read the addresses their dead predecessors published there and fail to connect. A
    prefix per attempt keeps every attempt to its own keys. None (the default store) otherwise,
    and when the agent does not share its store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1).
    """
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if restart_count() == 0 or not shared:
        return None
    store, _, _ = next(dist.rendezvous("env://", world.rank, world.world_size, timeout=timeout))
    return dist.PrefixStore(f"gptkiln/restart_{restart_count()}", store)


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def exit_process(code: int) -> None:
    """End this process with ``code``.

    A process still in a gloo process group can abort while the interpreter shuts down
    ("terminate called without an active exception", pytorch#190489): its exit code would
    read as a crash, and a bad input's 2 as a failure. So when a group is still joined
    (a rank that failed during training: leaving it could deadlock if another rank is inside a
    collective), the streams are flushed and the process ends at once, skipping that shutdown.
    """
    if initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def parallelize(model: nn.Module, world: World, strategy: str) -> nn.Module:
    """Wrap a built model for data parallelism.

    ``"ddp"``: a full copy per rank, gradients all-reduced in buckets during backward.
    ``"fsdp"``: FSDP2's `fully_shard` on every block, then on the root. Parameters, gradients and
    optimizer state are sharded across ranks; each block's parameters are all-gathered just for
    its forward and backward. The root unit holds what no block owns: ``wte``, ``wpe``, ``ln_f``
    and ``lm_head``; so a tied ``lm_head.weight``, the same Parameter as ``wte.weight``, lives in
    one FSDP unit and stays one (sharded) parameter. Buffers (the RoPE tables) are not sharded:
    each rank keeps its own copy, computed from the config.
    """
    if not world.distributed:
        return model
    if strategy == "fsdp":
        return shard(model)
    from torch.nn.parallel import DistributedDataParallel as DDP

    device_ids = [world.local_rank] if next(model.parameters()).is_cuda else None
    # The model's only buffers while it trains are the RoPE tables (Llama, Qwen), which every
    # rank computes the same from the config (`GPT.init_buffers`): broadcasting them from rank
    # 0 before every forward would only cost time (67 MB a step for Llama 3.2's 131,072
    # positions), so they are synced once, at the start (torch 2.13's forward_sync_buffers;
    # broadcast_buffers=False, the same but for that one sync, warns from 2.13 that it is
    # deprecated, and is what an older torch has). GPT-2 has none: for it nothing changes.
    import inspect

    if "forward_sync_buffers" in inspect.signature(DDP).parameters:
        return DDP(model, device_ids=device_ids, forward_sync_buffers=False)
    return DDP(model, device_ids=device_ids, broadcast_buffers=False)


def shard(model: nn.Module) -> nn.Module:
    """FSDP2's `fully_shard` on every block of ``model``, then on the root (`parallelize`'s
    ``"fsdp"``; in a process group already joined, which may be of one rank: bench/gpu.py)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.h:
        fully_shard(block)
    fully_shard(model)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The GPT inside a DDP wrapper (FSDP2 keeps the module itself)."""
    return getattr(model, "module", model)


@contextmanager
def gradient_sync(model: nn.Module, enabled: bool):
    """Skip the gradient all-reduce on all but the last micro-step of gradient accumulation.

    Gradients then accumulate locally (DDP: in ``.grad``; FSDP2: in the unsharded gradients) and
    the last micro-step reduces their sum once.
    """
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


def all_reduce_max(value: float, world: World) -> float:
    """The largest of every rank's ``value`` (``value`` itself in one process)."""
    if not world.distributed:
        return value
    values = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values.item()


def any_rank(flag: bool, world: World) -> bool:
    """Whether any rank passed True."""
    if not world.distributed:
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def error_of_rank_0(error: BaseException | None, world: World) -> str | None:
    """Rank 0's error message, on every rank (None: rank 0 had none), so that each rank can
    stop with the same line (the launcher prints a line once where the ranks' agree)."""
    if not world.distributed:
        return None if error is None else str(error)
    said = [None if error is None else str(error)]
    dist.broadcast_object_list(said, src=0)
    return said[0]


def rank_0_checks(check: Callable[[], None], world: World) -> None:
    """Run ``check`` on rank 0 alone; a GptkilnError it raises stops every rank with its line
    (`error_of_rank_0`), so that no rank goes on into a collective the others left."""
    error = None
    if world.is_main:
        try:
            check()
        except GptkilnError as e:
            error = e
    said = error_of_rank_0(error, world)
    if error is not None:
        raise error
    if said is not None:
        raise GptkilnError(said)


def all_equal(value: int, world: World) -> bool:
    """Whether every rank passed the same integer."""
    if not world.distributed:
        return True
    both = torch.tensor([value, -value], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)  # [max, -min]
    return int(both[0]) == -int(both[1])


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


# -- checkpoints -----------------------------------------------------------------------------
def full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None):
    """Full (unsharded) model and optimizer state dicts on CPU, keyed by parameter name, the same
    whether the model is plain, DDP or FSDP2: so checkpoints move between 1 and N processes.

    A collective under FSDP2 (every rank must call it); with ``cpu_offload`` only rank 0 gets the
    tensors, the other ranks get empty dicts.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=options)
    optim_sd = (
        None if optimizer is None else get_optimizer_state_dict(model, optimizer, options=options)
    )
    return model_sd, optim_sd


def load_full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict
) -> None:
    """Load full state dicts (as saved by `full_state`) into a plain, DDP or FSDP2 model; under
    FSDP2 every rank keeps its own shard of each tensor. The dicts are left as they were."""
    import copy

    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    # set_*_state_dict rename keys in place (``wte.weight`` -> ``module.wte.weight`` under DDP).
    model_sd, optim_sd = dict(model_sd), copy.copy(optim_sd)
    optim_sd["state"] = dict(optim_sd["state"])
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_sd, options=options)
    set_optimizer_state_dict(model, optimizer, optim_sd, options=options)


# -- faults ----------------------------------------------------------------------------------
class WorkerStopped(Exception):
    """SIGTERM arrived: torchrun ends every worker this way when one of them fails."""


class TerminationGuard:
    """SIGTERM as a `WorkerStopped` exception, held back while a checkpoint is written.

    When a worker fails, torchrun sends SIGTERM to the others (and SIGKILL 30 s later). Left at
    its default, SIGTERM kills a process on the spot, possibly between the files of a
    checkpoint, which would then not load. Inside `hold()` SIGTERM and SIGINT wait until the
    block ends, then take effect. Left by a stop (`is_peer_failure`), the guard leaves SIGTERM
    ignored: the process is on its way out and says why. Usable only from the main thread
    (elsewhere it does nothing).
    """

    def __init__(self) -> None:
        self._holding = False
        self._pending: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def active(self) -> bool:
        return threading.current_thread() is threading.main_thread()

    def __enter__(self) -> TerminationGuard:
        if self.active:
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_signal)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # A run leaving on a stop (a peer died, or SIGTERM came) ignores SIGTERM from here on:
        # torchrun sends it to the survivors as soon as one rank fails, and, at its default, it
        # killed rank 0 between here and its message saying where the last checkpoint is.
        stopping = exc is not None and is_peer_failure(exc)
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_IGN if stopping else handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame) -> None:
        if self._holding:
            self._pending = signum
        else:
            self._raise(signum)

    @staticmethod
    def _raise(signum: int) -> None:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise WorkerStopped(f"stopped by {signal.Signals(signum).name}")

    @contextmanager
    def hold(self):
        """Defer SIGTERM and SIGINT until the block has finished."""
        if not self.active:
            yield
            return
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        self._holding, self._pending = True, None
        try:
            yield
        finally:
            self._holding = False
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            if self._pending is not None:
                pending, self._pending = self._pending, None
                self._raise(pending)


def is_peer_failure(error: BaseException) -> bool:
    """Whether an error says another rank died, hung or became unreachable (not a bug here)."""
    if isinstance(error, WorkerStopped):
        return True
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(m in text for m in _PEER_FAILURE_MARKERS)


def fail_for_test(step: int, world: World) -> None:
    """A fault to test recovery with: given GPTKILN_FAULT_AT_STEP=N, the last rank kills itself
    (SIGKILL, as the OOM killer would) on reaching step N, in torchrun's first attempt only."""
    at = os.environ.get("GPTKILN_FAULT_AT_STEP")
    if not at or not world.distributed or restart_count() > 0:
        return
    if step == int(at) and world.rank == world.world_size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
