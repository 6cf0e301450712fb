"""The training loop: `Trainer` sets a run up (torchrun, the task, the wrapped model, the
optimizer, a fresh start or a resume) and takes its optimizer steps to the last, checking for
divergence; the step itself is `OptimizerStep`'s, evaluation, samples and logging `RunLog`'s,
checkpoints and resume `Checkpoints`', time `TrainingClock`'s. `train(cfg)` is one pretraining
run.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gptkiln import distributed as dist_utils
from gptkiln import run_guard
from gptkiln.config import GPTConfig, TrainConfig
from gptkiln.devices import free_memory, resolve_device
from gptkiln.errors import GptkilnError, RunStopped
from gptkiln.model import GPT
from gptkiln.optim import make_optimizer
from gptkiln.train.agreement import check_settings_act
from gptkiln.train.checkpointing import Checkpoints, Progress, start_mode
from gptkiln.train.evaluation import TaskBenchmarks
from gptkiln.train.optimizer_step import OptimizerStep, autocast_for
from gptkiln.train.precision import PrecisionChoice, precision_for_run, resumed_precision
from gptkiln.train.run_log import ProgressBar, RunLog, tensorboard_writer_class
from gptkiln.train.stops import diverged_message, nothing_to_train, stopped_message, where_kept
from gptkiln.train.task import LanguageModeling, RunContext, Task
from gptkiln.train.timing import Speedometer, TrainingClock


def now() -> float:
    """The clock the loop times its steps by (tests replace it with one of their own)."""
    return time.perf_counter()


@dataclass
class TrainResult:
    """What a finished run reports."""

    run_dir: Path
    steps: int
    tokens_seen: int
    train_loss: float | None
    val_loss: float | None
    sample: str | None
    history: list[dict] = field(default_factory=list)
    val_bpc: float | None = None  # bits per character of the validation text
    trained: bool = True  # False: a resume with no step left (`stops.nothing_to_train`)


def train(cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False) -> TrainResult:
    """Train a GPT as ``cfg`` says, writing a run directory at ``cfg.out``.

    Args:
        resume: continue the run in ``cfg.out`` from its last checkpoint; the result is the same,
            bit for bit on CPU, as a run that was never interrupted.
        overwrite: start afresh even if ``cfg.out`` already holds a checkpoint.

    Under torchrun (``torchrun --nproc-per-node N -m gptkiln train ...``) every process calls
    this; rank 0 alone logs and writes. After torchrun restarts failed workers
    (``--max-restarts``), the run resumes from its last checkpoint by itself.
    """
    trainer = Trainer(cfg, resume=resume, overwrite=overwrite)
    # Not left on a failure: another rank may be inside a collective, and leaving the group
    # could then deadlock (torchtitan#1342); the CLI ends such a process with os._exit.
    result = trainer.fit()
    trainer.close()
    return result


class Trainer:
    """One training run: the loop over what a `Task` gives it, then `fit()`.

    Args:
        cfg: the loop's settings (``out`` is the run directory).
        resume: continue from the checkpoint in ``cfg.out``.
        overwrite: start afresh over a checkpoint in ``cfg.out``.
        task: builds the task from the `RunContext`; `LanguageModeling` (pretraining) when None.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        resume: bool = False,
        overwrite: bool = False,
        task: Callable[[RunContext], Task] | None = None,
    ):
        # the run's own copy: what it takes from prepared data (`agreement`) stays its own
        self.cfg = cfg = dataclasses.replace(cfg)
        self.run_dir = Path(cfg.out)
        self.device = resolve_device(cfg.device)
        check_one_gpu_each(self.device, os.environ)
        self.owns_process_group = dist_utils.launched_by_torchrun() and not dist_utils.initialized()
        self.world = dist_utils.setup(self.device)
        self.log: RunLog | None = None  # what close() closes, set in _set_up
        self.optimizer_step: OptimizerStep | None = None  # and this
        self.lock = run_guard.RunLock(self.run_dir)
        try:
            # rank 0 takes the directory; one another run holds stops every rank
            dist_utils.rank_0_checks(self.lock.acquire, self.world)
            self._set_up(cfg, resume, overwrite, task)
        except BaseException:
            # A bad input found while setting up: leave the group (this rank has no collective
            # in flight) so that the process exits with its code, not a gloo abort at exit.
            checkpoints = getattr(self, "checkpoints", None)
            if checkpoints is not None:
                checkpoints.restore_replaced()
            elif self.world.is_main and not dist_utils.restarts_left():
                run_guard.restore_replaced_data(self.run_dir)  # the data a new run replaced
            self.close()
            raise

    def _set_up(
        self,
        cfg: TrainConfig,
        resume: bool,
        overwrite: bool,
        task: Callable[[RunContext], Task] | None,
    ) -> None:
        check_settings_act(cfg)
        if self.device == "cuda":
            self.device = f"cuda:{self.world.local_rank}"
        self.guard = dist_utils.TerminationGuard()
        if cfg.tensorboard:  # a missing package fails before any data is prepared
            tensorboard_writer_class()
        # so do a missing harness and a bad task of --eval-tasks
        benchmarks = TaskBenchmarks(cfg, self.run_dir, self.world) if cfg.eval_tasks else None
        resume, overwrite, restarted = start_mode(self.run_dir, resume, overwrite, self.world)
        context = RunContext(cfg, self.run_dir, self.device, self.world, resume)
        self.task = (task or LanguageModeling)(context)
        self.tokenizer = self.task.tokenizer
        self.batches = self.task.batches
        first = self.batches.get(0, 0)  # rank 0's free memory decides for every rank
        config = self.task.model.config
        dist_utils.rank_0_checks(
            lambda: check_logits_fit(config, first[0], self.device), self.world
        )
        # measured on the bare model, before a wrapper would synchronise its backward
        self.precision: PrecisionChoice | None = None
        if not resume:
            self.precision = precision_for_run(
                cfg.precision,
                self.device,
                self.task.model,
                first,
                self.world,
                getattr(self.task, "training_loss", None),
            )
        self.model = dist_utils.parallelize(self.task.model, self.world, cfg.parallel)
        self.compiled = compiles(cfg, self.device)
        self.forward = torch.compile(self.model) if self.compiled else self.model
        betas = (cfg.beta1, cfg.beta2)
        self.optimizer = make_optimizer(
            self.model,
            cfg.lr,
            cfg.weight_decay,
            betas,
            cfg.optimizer,
            cfg.muon_momentum,
            adamw_lr=cfg.adamw_lr,
            embedding_lr=cfg.embedding_lr,
        )
        self.log = RunLog(self.task, self.run_dir, self.world, self.guard)
        self.log.benchmarks = benchmarks
        self.checkpoints = Checkpoints(
            self.task, cfg, self.world, self.device, self.guard, restarted
        )
        self.step, self.tokens = 0, 0
        self.clock = TrainingClock(cfg.max_time, self.world)
        torch.manual_seed(cfg.seed + self.world.rank)  # dropout differs across ranks
        if resume:
            progress = self.checkpoints.restore(self.model, self.optimizer, self.batches)
            self.step, self.tokens = progress.step, progress.tokens
            self.clock.seconds = progress.train_seconds
            self.clock.step_seconds = progress.step_seconds  # the first step's foresight too
            self.precision = resumed_precision(cfg.precision, progress.precision, self.device)
            self.log.keep_rows_until(self.step)
        elif self.world.is_main:
            self.checkpoints.set_aside_replaced(overwrite)
            self.log.start_afresh()
        self.optimizer_step = OptimizerStep(
            self.model, self.forward, self.optimizer, self.batches, cfg, self.device
        )
        self.optimizer_step.precision = self.precision.precision
        self.optimizer_step.loss = getattr(self.task, "training_loss", None)
        self.optimizer_step.learnt = getattr(self.task, "learnt", None)
        self.optimizer_step.world = self.world
        if self.world.is_main:
            print(self.precision.line(), flush=True)
        if cfg.tensorboard and self.world.is_main:
            self.log.open_tensorboard(self.step + 1 if resume else None)

    @property
    def tokens_per_step(self) -> int:
        """Input tokens of the next optimizer step, over all ranks and micro-steps."""
        return self.batches.tokens(self.step)

    def close(self) -> None:
        """Close the TensorBoard log, let the run directory go; leave the process group, if
        this trainer joined it; stop reading batches ahead."""
        if self.log is not None:
            self.log.close()
        if self.optimizer_step is not None:
            self.optimizer_step.close()
        self.lock.release()
        if self.owns_process_group:
            dist_utils.teardown()

    @property
    def autocast(self) -> torch.autocast:
        """The autocast context of the precision this run trains in (`self.precision`)."""
        return autocast_for(self.device, self.precision.precision)

    @property
    def raw_model(self) -> GPT:
        return dist_utils.unwrap(self.model)

    # -- the loop ----------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        """Train to the last step, then plot the losses and print a sample.

        Raises:
            GptkilnError: when this process was stopped (SIGTERM) or lost the other ranks (one
                died or hung past GPTKILN_DIST_TIMEOUT); the message names the last checkpoint.
        """
        clock, total = self.clock, self.batches.total_steps
        if message := nothing_to_train(self.run_dir, self.step, total, clock, self.cfg.max_time):
            if self.world.is_main:  # the same on every rank: the step and clock are the run's
                print(message, file=sys.stderr)
            return TrainResult(  # no evaluation, sample or plot: nothing changed
                self.run_dir, self.step, self.tokens, None, None, None, self.log.history,
                trained=False,
            )  # fmt: skip
        warmup = self.cfg.warmup_steps
        if self.world.is_main and self.step == 0 and not self.cfg.max_time and warmup > total:
            print(
                f"note: the warm-up of {warmup} steps outlasts the run of {total}: the "
                f"learning rate never reaches --lr {self.cfg.lr:g} (nor decays); lower "
                "--warmup-steps",
                file=sys.stderr,
            )
        bar = ProgressBar(self.cfg.progress and self.world.is_main, total, self.step, clock)
        try:
            with self.guard:
                row = self._loop(bar) or {}  # the last evaluation's
                if self.world.is_main:
                    self.log.plot()
                sample = self.log_sample(bar)
        except BaseException as e:
            # before its first checkpoint, a run that replaced another (--overwrite) puts it back
            restored = self.checkpoints.restore_replaced()
            self.lock.release()  # no collective: another rank may still be inside one
            back = f"; {restored} is back in {self.run_dir}" if restored else ""
            saved = self.checkpoints.saved_step
            if isinstance(e, KeyboardInterrupt):  # Ctrl-C: the CLI says "interrupted" + this
                raise KeyboardInterrupt(
                    f"at step {self.step}; {where_kept(saved, self.run_dir)}{back}"
                ) from None
            if isinstance(e, (RuntimeError, dist_utils.WorkerStopped)):
                message = stopped_message(e, self.world, self.step, saved, self.run_dir)
                if message is not None:
                    raise RunStopped(message + back) from e
            if back and type(e) is GptkilnError:
                raise GptkilnError(f"{e}{back}") from None
            raise
        finally:
            bar.close()
        train_loss, val_loss, val_bpc = (row.get(k) for k in ("train_loss", "val_loss", "val_bpc"))
        history = self.log.history
        return TrainResult(
            self.run_dir, self.step, self.tokens, train_loss, val_loss, sample, history, val_bpc
        )

    def _loop(self, bar: ProgressBar) -> dict | None:
        """Optimizer steps until the last (``max_steps``, epochs, or the time budget);
        evaluates, samples and saves at their intervals. Returns the last evaluation's row
        (None: no step was left to train)."""
        cfg, total, clock = self.cfg, self.batches.total_steps, self.clock
        evaluated = None
        speed = Speedometer(self.compiled and self.step < total and not clock.out_of_time())
        origin = None  # where this process's clock reads 0 training seconds (set at step 1)
        if speed.compiling and self.world.is_main:  # torch.compile works in the next step
            bar.compiling(self.step + 1)
        while self.step < total and not clock.out_of_time():
            dist_utils.fail_for_test(self.step, self.world)
            t0 = now()
            first = origin is None  # this process's first step: compiles, warms up
            if first:
                origin = t0 - clock.seconds
            elif clock.budget_s is not None:  # the evaluation, sample or save just done counts
                clock.record(t0 - origin)
            step_tokens = self.batches.tokens(self.step)
            lr, loss = self.train_step(total)
            self.step += 1
            self.tokens += step_tokens
            t1 = now()
            clock.record(t1 - origin, None if first else t1 - t0)  # no step's time, the first
            # the compile time is no step's speed: kept out of tokens/s
            if speed.add(step_tokens, t1 - t0) and self.world.is_main:
                bar.compiled(self.step, t1 - t0)
            if self.cfg.progress and self.world.distributed:  # the whole batch's, not rank 0's
                shown = dist_utils.all_reduce_mean(torch.tensor(loss), self.world).item()
            else:
                shown = loss
            bar.step_done(self.step, shown, speed.tokens_per_s)
            last = self.step == total or clock.out_of_time()
            if (
                self.step % cfg.eval_interval == 0
                or last
                or self.log.benchmarks_due(self.step, last)
            ):
                evaluated = self.log.log_eval(
                    self.model,
                    self.autocast,
                    self.step,
                    self.tokens,
                    loss,
                    lr,
                    speed.tokens_per_s,
                    bar,
                    last=last,
                )
            save = self.checkpoints.due(self.step, last)
            sample = self.step % cfg.sample_interval == 0 and not last
            self._stop_if_diverged(loss, check_weights=save or sample)
            if save:
                self.save()
            if sample:  # after the save: a sample that fails never costs a checkpoint
                self.log_sample(bar)
        return evaluated

    def _stop_if_diverged(self, loss: float, check_weights: bool) -> None:
        """Raise when this step's loss is not finite (in one process; every rank's before a
        save or a sample, ``check_weights``, with the weights too): the checkpoint before it is
        kept."""
        if not self.world.distributed and not math.isfinite(loss):
            what = f"the loss is {loss}"
        elif check_weights and dist_utils.any_rank(not self._finite(loss), self.world):
            what = "the loss or the weights are not finite"
        else:
            return
        saved = self.checkpoints.saved_step
        raise GptkilnError(diverged_message(self.step, what, saved, self.run_dir, self.cfg))

    def _finite(self, loss: float) -> bool:
        """This rank's last loss and weights (its shards, with FSDP) are all finite numbers."""
        return math.isfinite(loss) and all(
            bool(torch.isfinite(p).all()) for p in self.model.parameters()
        )

    def train_step(self, total: int) -> tuple[float, float]:
        """One optimizer step over grad_accum micro-batches; (lr, its mean loss: on this rank, or
        per learnt item over every rank's in fine-tuning)."""
        return self.optimizer_step(self.step, total, self.clock.time_used())

    # -- what the loop hands on --------------------------------------------------------------
    def log_sample(self, bar) -> str | None:
        """Every rank generates (FSDP needs all of them); rank 0 prints. None with
        ``sample_tokens`` 0: no samples."""
        if self.cfg.sample_tokens == 0:
            return None
        use_cache = self.cfg.parallel != "fsdp"
        return self.log.log_sample(self.raw_model, self.step, use_cache, bar)

    def save(self) -> None:
        """Write the checkpoint (all ranks gather, rank 0 writes)."""
        progress = Progress(
            self.step, self.tokens, self.clock.seconds, self.precision.precision,
            self.clock.step_seconds,
        )  # fmt: skip
        self.checkpoints.save(self.model, self.optimizer, self.batches, progress)


def check_one_gpu_each(device: str, env) -> None:
    """Several processes on one machine each take their own GPU (cuda:LOCAL_RANK): a device
    with an index would put them all on that one."""
    local_procs = int(env.get("LOCAL_WORLD_SIZE", "1"))
    if device.startswith("cuda:") and local_procs > 1:
        raise GptkilnError(
            f"--device {device} would put all {local_procs} processes of this machine on one "
            "GPU; pass --device cuda (process i takes cuda:i) and choose the GPUs with "
            "CUDA_VISIBLE_DEVICES"
        )


def check_logits_fit(config: GPTConfig, inputs: torch.Tensor, device: str) -> None:
    """Refuse, before anything runs, a micro-batch whose logits alone cannot fit in the memory
    the device has free (a --context-length or --batch-size far past the machine), which would
    otherwise grow for minutes and end in the kernel's out-of-memory kill. The bound is low on
    purpose: the logits and their gradient at 2 bytes each, nothing else of the step."""
    if config.num_classes:  # a classifier's head scores a few classes, not the vocabulary
        return
    windows, length = inputs.shape[0], inputs.shape[-1]  # packed rows: (B, 2, T), ids first
    positions = windows * length
    needed = 2 * 2 * positions * config.vocab_size
    free = free_memory(device)
    if free is not None and needed > free:
        where = "this machine's memory" if torch.device(device).type == "cpu" else device
        raise GptkilnError(
            f"a micro-batch of {windows:,} windows of {length:,} tokens needs at least "
            f"{_size(needed)} for its logits ({positions:,} positions x "
            f"{config.vocab_size:,} ids, and their gradient), more than the "
            f"{_size(free)} free in {where}; lower --batch-size (keeping the step's "
            "size with --grad-accum) or --context-length"
        )


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:,} bytes"


def compiles(cfg: TrainConfig, device: str | torch.device) -> bool:
    """Whether a run's model runs under torch.compile: ``--compile`` / ``--no-compile`` as
    given; unset, on CUDA (where a compiled step is much faster and a run long enough to repay
    its tens of seconds) and not elsewhere (on a CPU a short run rarely earns its compile back)."""
    if cfg.compile is not None:
        return cfg.compile
    return torch.device(device).type == "cuda"
