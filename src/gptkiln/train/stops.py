"""Why a run stops or does not start, each in one line for a person: what happened, where the
last checkpoint is, and what to do next."""

from __future__ import annotations

from pathlib import Path

from gptkiln import distributed as dist_utils
from gptkiln.config import TrainConfig
from gptkiln.train.timing import TrainingClock


def diverged_message(
    step: int, what: str, saved_step: int | None, run_dir: Path, cfg: TrainConfig
) -> str:
    """Training diverged at ``step`` (``what``: the loss or weights that are not finite), the
    checkpoint is kept, and what to change."""
    if saved_step is None:
        kept, then = "no checkpoint was written", "start again"
    else:
        kept = f"the checkpoint of step {saved_step} in {run_dir} is kept as it was"
        then = "continue with --resume or start again with --overwrite"
    return (
        f"training diverged at step {step}: {what}; {kept}. Lower --lr (now "
        f"{cfg.lr:g}) or lengthen --warmup-steps (now {cfg.warmup_steps}), then {then}"
    )


def stopped_message(
    error: BaseException,
    world: dist_utils.World,
    step: int,
    saved_step: int | None,
    run_dir: Path,
) -> str | None:
    """Who stopped at ``step``, why, and where the last checkpoint is, when ``error`` stopped
    the run from outside: SIGTERM (`WorkerStopped`), or, with several ranks, a lost peer
    (`is_peer_failure`). None for any other error: it is not a stop, and is raised as it is."""
    if not isinstance(error, dist_utils.WorkerStopped) and not (
        world.distributed and dist_utils.is_peer_failure(error)
    ):
        return None
    who = f"rank {world.rank} of {world.world_size}" if world.distributed else "training"
    if isinstance(error, dist_utils.WorkerStopped):
        why = str(error)
        if world.distributed:
            why += " (torchrun stops every worker when one fails)"
    else:
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        why = f"lost contact with the other ranks ({first_line[:200]})"
    return f"{who} stopped at step {step}: {why}; {where_kept(saved_step, run_dir)}"


def where_kept(saved_step: int | None, run_dir: Path) -> str:
    """Where a stopped run's last checkpoint is, and how to go on from it."""
    if saved_step is None:
        return "no checkpoint was written"
    return f"the last checkpoint, step {saved_step}, is in {run_dir}: continue with --resume"


def nothing_to_train(
    run_dir: Path, step: int, total_steps: int, clock: TrainingClock, max_time: float | None
) -> str | None:
    """Why a resumed run has no step left to train (None when it has): it is at its last step,
    or it has spent its time budget (``max_time`` minutes)."""
    if step >= total_steps:
        return (
            f"nothing to train: {run_dir} is already at step {step} of "
            f"{total_steps}; raise --max-steps (or --epochs) to go on"
        )
    if clock.out_of_time():
        return (
            f"nothing to train: {run_dir} has trained {clock.seconds / 60:.2f} "
            f"minutes, its --max-time is {max_time:g}; raise --max-time to go on"
        )
    return None
