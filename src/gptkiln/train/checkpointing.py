"""A run's checkpoints: when they are written, what the trainer's state holds beside the weights
(step, tokens seen, the optimizer, every rank's random generators, the clock), how a resume puts
it all back, and whether this attempt of a run starts afresh or resumes.

The task writes and reads the files (`Task.save`, `Task.load`: a full GPT, or LoRA adapters);
this module decides what goes in them, so every task resumes exactly.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gptkiln import checkpoint, run_guard
from gptkiln import distributed as dist_utils
from gptkiln.config import TrainConfig
from gptkiln.errors import GptkilnError
from gptkiln.train.task import BatchSource, LanguageModeling, Task


@dataclass(frozen=True)
class Progress:
    """Where a run stands, what a checkpoint saves and a resume restores: its optimizer step,
    the input tokens seen so far (over all ranks), the seconds spent training so far, and the
    precision it trains in (``"fp32"`` or ``"bf16"``, what ``--precision auto`` chose at its
    start; None in a checkpoint written before the choice was recorded)."""

    step: int
    tokens: int
    train_seconds: float
    precision: str | None = None
    step_seconds: float = 0.0  # the last step's: a time budget's schedule foresees the next


class Checkpoints:
    """When a run saves, what its checkpoint holds, and restoring it.

    Args:
        task: writes and reads the checkpoint's files.
        cfg: the loop's settings (``out``, ``checkpoint_interval``; saved with the checkpoint).
        world: this process's rank: all ranks gather the state, rank 0 writes it.
        device: this process's device (its CUDA generator is saved too).
        guard: holds SIGTERM while the files are written, so that none is left half written.
        restarted: torchrun restarted the workers (a resume then says so).
    """

    def __init__(
        self,
        task: Task,
        cfg: TrainConfig,
        world: dist_utils.World,
        device: str,
        guard: dist_utils.TerminationGuard,
        restarted: bool = False,
    ) -> None:
        self.task, self.cfg, self.world, self.device = task, cfg, world, device
        self.guard, self.restarted = guard, restarted
        self.run_dir = Path(cfg.out)
        self.saved_step: int | None = None  # the step of the last checkpoint written or read
        self.replacing = False  # an --overwrite's replaced run is set aside (rank 0)

    def due(self, step: int, last: bool) -> bool:
        """Whether the loop saves after step ``step``: every ``checkpoint_interval`` steps and
        after the last."""
        return step % self.cfg.checkpoint_interval == 0 or last

    def save(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        batches: BatchSource,
        progress: Progress,
    ) -> None:
        """Write the checkpoint of ``progress.step`` (all ranks gather, rank 0 writes)."""
        step = progress.step
        model_sd, optim_sd = dist_utils.full_state(model, optimizer)
        rng = _gather_rng(self.world, torch.get_rng_state)
        cuda_rng = []
        if self.device.startswith("cuda"):
            cuda_rng = _gather_rng(self.world, lambda: torch.cuda.get_rng_state(self.device))
        if self.world.is_main:
            state = {
                "step": step,
                "tokens": progress.tokens,
                "global_batch": batches.global_batch,
                "seed": self.cfg.seed,  # with sampling, the data order: a resume keeps both
                "sampling": self.cfg.sampling,
                "stride": batches.stride,  # with sampling windows, which windows there are
                "world_size": self.world.world_size,
                "optimizer": optim_sd,
                "optimizer_kind": self.cfg.optimizer,  # adamw | muon: what optimizer holds
                "rng": rng,
                "cuda_rng": cuda_rng,  # each rank's own device's generator
                "scheduler": {"step": step, "total_steps": batches.total_steps},
                "train_seconds": progress.train_seconds,
                "step_seconds": progress.step_seconds,
                "precision": progress.precision,
            }
            # config.json records the arithmetic the run trains in, not "auto"
            train_config = self.cfg.to_dict()
            if progress.precision is not None:
                train_config["precision"] = progress.precision
            with self.guard.hold():  # a SIGTERM now would leave half a checkpoint
                self.task.save(model_sd, state, train_config)
                self.saved_step = step
            aside = (self.run_dir / run_guard.REPLACED_DATA_DIR).exists()
            if self.replacing or aside:  # the new run has a checkpoint: what it replaced goes
                self.replacing = False  # first: a stop while it goes must not bring it back
                run_guard.drop_replaced(self.run_dir)
        dist_utils.barrier(self.world)
        self.saved_step = step

    def restore(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: BatchSource
    ) -> Progress:
        """Load the task's checkpoint into ``model`` and ``optimizer`` and this rank's random
        generators; where the run stands. Raises when this resume's global batch would change
        the order of an epoch-walking run."""
        model_sd, state = self.task.load()
        saved_kind = state.get("optimizer_kind", "adamw")  # before Muon: AdamW's
        if saved_kind != self.cfg.optimizer:
            raise GptkilnError(
                f"{self.run_dir} was trained with --optimizer {saved_kind} and this resume asks "
                f"for {self.cfg.optimizer}: the saved optimizer state is {saved_kind}'s. Resume "
                f"with --optimizer {saved_kind}, or start a new run"
            )
        # the saved state brings back each group's settings too: this resume's own (its weight
        # decay, betas, learning-rate scales, Muon's momentum), which config.json records, win
        settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        dist_utils.load_full_state(model, optimizer, model_sd, state["optimizer"])
        for group, own in zip(optimizer.param_groups, settings, strict=True):
            group.update(own)
        step = self.saved_step = int(state["step"])
        progress = Progress(
            step=step,
            # a resume may change the batch or the processes: the tokens seen so far are counted
            tokens=int(state.get("tokens", step * batches.tokens(0))),
            # a checkpoint from before time budgets has no clock: its time so far counts as 0
            train_seconds=float(state.get("train_seconds", 0.0)),
            precision=state.get("precision"),
            step_seconds=float(state.get("step_seconds", 0.0)),
        )
        self._check_same_global_batch(state.get("global_batch"), batches)
        self._check_same_order(state, batches)
        if self.world.is_main and self.restarted:
            print(
                f"torchrun restarted the workers: resuming from step {step} in {self.run_dir}",
                flush=True,
            )
        rng = state["rng"]
        if len(rng) == self.world.world_size:
            torch.set_rng_state(rng[self.world.rank])
        cuda_rng = state.get("cuda_rng") or []
        if self.device.startswith("cuda") and len(cuda_rng) == self.world.world_size:
            torch.cuda.set_rng_state(cuda_rng[self.world.rank], self.device)
        return progress

    def _check_same_order(self, state: dict[str, Any], batches: BatchSource) -> None:
        """A resume keeps the data order the run was trained in: its ``--sampling``, and where
        it walks epochs, the ``--seed`` each epoch's shuffle is drawn from and the ``--stride``
        of its windows (another would read some windows twice and skip others, as another
        batch would). A trainer state from before they were saved in it is checked against
        config.json's record of them."""
        recorded = {}  # a trainer state from before they were saved: config.json's record
        if state.get("seed") is None or "stride" not in state:
            with contextlib.suppress(GptkilnError, OSError):
                recorded = checkpoint.read_config(self.run_dir).get("train") or {}
        saved = {k: state.get(k, recorded.get(k)) for k in ("sampling", "seed")}
        stride = state.get("stride", recorded.get("stride"))
        if "stride" not in state and batches.stride is not None:  # recorded: None, the context
            stride = stride or getattr(batches, "context_length", None)
        if saved["sampling"] is not None and saved["sampling"] != self.cfg.sampling:
            changed = ("sampling", saved["sampling"], self.cfg.sampling)
        elif batches.walks_epochs and saved["seed"] not in (None, self.cfg.seed):
            changed = ("seed", saved["seed"], self.cfg.seed)
        elif batches.stride is not None and stride not in (None, batches.stride):
            changed = ("stride", stride, batches.stride)
        else:
            return
        flag, was, now = f"--{changed[0]}", changed[1], changed[2]
        raise GptkilnError(
            f"{self.run_dir} was trained with {flag} {was} and this resume asks for {now}: the "
            f"order of its data depends on it, so another would read some of it twice and "
            f"skip other parts. Resume with {flag} {was}, or start a new run"
        )

    def _check_same_global_batch(self, saved_batch: int | None, batches: BatchSource) -> None:
        if batches.walks_epochs and saved_batch not in (None, batches.global_batch):
            what = "windows" if isinstance(self.task, LanguageModeling) else "examples"
            raise GptkilnError(
                f"{self.run_dir} was trained on {saved_batch} {what} a step and this resume "
                f"takes {batches.global_batch} (batch_size x grad_accum x processes): "
                "each epoch is walked in steps of that size, so a new size would "
                f"read some {what} twice and skip others. Keep the product at {saved_batch}, "
                "or start a new run"
            )

    def set_aside_replaced(self, overwrite: bool) -> None:
        """Rank 0 of a new run over an old one (``overwrite``): the old run's files go into
        ``RUN/.replaced`` (`run_guard.set_aside_replaced`), so that a restart after a failure
        never resumes it and none of its files stays beside the new run's; it is deleted at
        the new run's first checkpoint, and put back if the run fails before one
        (`restore_replaced`)."""
        if overwrite:
            run_guard.set_aside_replaced(self.run_dir)
            self.replacing = True

    def restore_replaced(self) -> str | None:
        """Rank 0 of a run that failed before its first checkpoint: the run it replaced back in
        place, or only the data it replaced; what came back, in words ("the run it replaced"),
        or None. Not while torchrun would restart the workers: the next attempt must start
        afresh as this one did, not resume the replaced run; it finds it still aside."""
        if not (self.saved_step is None and self.world.is_main) or dist_utils.restarts_left():
            return None
        if not self.replacing:  # a new run's data may have taken the place of a run's
            restored = run_guard.restore_replaced_data(self.run_dir)
            return "the data it replaced" if restored else None
        self.replacing = False
        return "the run it replaced" if run_guard.restore_replaced(self.run_dir) else None


def start_mode(
    run_dir: Path, resume: bool, overwrite: bool, world: dist_utils.World
) -> tuple[bool, bool, bool]:
    """(resume, overwrite, restarted) for this attempt of the run, the same on every rank, or
    an error. ``restarted``: torchrun restarted the workers after a failure."""
    # Any rank: restart counts are per machine, and an agent whose workers were healthy
    # restarts them without counting it.
    restarted = dist_utils.any_rank(dist_utils.restart_count() > 0, world)
    resume, overwrite = resume_after_restart(run_dir, resume, overwrite, restarted)
    run_guard.check_run_dir_for_training(run_dir, resume=resume, overwrite=overwrite)
    if not dist_utils.all_equal(int(resume), world):
        raise GptkilnError(
            f"the ranks disagree whether {run_dir} holds a checkpoint to resume; "
            "with several machines, --out must be on a filesystem that every machine sees"
        )
    return resume, overwrite, restarted


def resume_after_restart(
    run_dir: Path, resume: bool, overwrite: bool, restarted: bool
) -> tuple[bool, bool]:
    """(resume, overwrite) for this attempt of the run.

    When torchrun has ``restarted`` the workers after a failure (``--max-restarts``), the run
    continues from the checkpoint the failed attempt left in ``run_dir``, whatever the command
    line said (it is the same command); before any whole checkpoint, it starts as the command
    says, over what a first save cut short left.
    """
    if restarted and checkpoint.has_whole_checkpoint(run_dir):
        return True, False
    if restarted and not resume and checkpoint.first_save_cut_short(run_dir):
        return False, True  # the failed attempt's first save: it starts again, over it
    return resume, overwrite


def _gather_rng(world: dist_utils.World, get_state) -> list[torch.Tensor]:
    """Every rank's generator state (``get_state()``, a CPU tensor), by rank."""
    state = get_state()
    if not world.distributed:
        return [state]
    import torch.distributed as dist

    states: list = [None] * world.world_size
    dist.all_gather_object(states, state)
    return states
