"""Training: `train(config)` runs the loop, evaluates, samples, logs, checkpoints and resumes.

Two parts, one seam: `Trainer` is the loop (optimizer steps with gradient accumulation and
clipping, the schedule, evaluation, samples, metrics.csv, loss.png, atomic checkpoints, exact
resume, torchrun), over any model and batch source that a `Task` gives it; `LanguageModeling`
is pretraining's task (prepared text, sliding or random windows, a fresh GPT). Fine-tuning's
tasks (`gptkiln.finetune`) give the same loop an instruction-following or a classification
model, so `gptkiln train` and `gptkiln finetune` share one loop, one checkpoint format, one
resume and one metrics file.

Data order is a pure function of (seed, step): optimizer step s reads the global items
[s*G, (s+1)*G) of an epoch's seeded permutation (or of a seeded random stream), G = batch_size x
grad_accum x world_size, and rank r takes its own slice of them. So a resumed run needs only the
step to continue the exact data order, and N processes read disjoint items that together are
exactly what one process with N times the batch would read.
"""

from __future__ import annotations

import csv
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from gptkiln import distributed as dist_utils
from gptkiln.config import GPTConfig, SampleConfig, TrainConfig
from gptkiln.devices import resolve_device
from gptkiln.errors import GptkilnError, RunStopped
from gptkiln.model import GPT
from gptkiln.optim import lr_at, make_optimizer

METRICS_FIELDS = ["step", "tokens", "train_loss", "val_loss", "val_bpc", "lr", "tokens_per_s"]
"""metrics.csv's columns for pretraining (``val_bpc``: bits per character of the validation
text; files written before it lack the column, and `read_metrics` reads them all the same); a
task's own columns go between tokens and lr."""


class EpochOrder:
    """Which of ``n_items`` items each (optimizer step, micro-step, rank) reads, in epochs.

    Epoch e is a permutation of the items seeded with ``seed + e``, walked ``global_batch`` =
    batch_size x grad_accum x world_size items a step (the items left over at an epoch's end are
    dropped, as a DataLoader with ``drop_last``); rank r takes its own ``batch_size`` slice of
    each micro-step. Computed from indices alone, so resuming needs only the step.
    """

    def __init__(
        self,
        n_items: int,
        cfg: TrainConfig,
        world: dist_utils.World,
        what: str = "windows",
    ):
        self.n_items, self.batch_size, self.world = n_items, cfg.batch_size, world
        self.grad_accum = cfg.grad_accum
        self.seed, self.max_steps, self.epochs = cfg.seed, cfg.max_steps, cfg.epochs
        self.global_batch = cfg.batch_size * cfg.grad_accum * world.world_size
        self.steps_per_epoch = n_items // self.global_batch
        if self.steps_per_epoch == 0:
            fix = "or context_length, or use more text" if what == "windows" else "or use more data"
            raise GptkilnError(
                f"the training split has {n_items} {what}, fewer than one step's "
                f"{self.global_batch} (batch_size x grad_accum x processes); lower batch_size "
                + fix
            )
        self._perm: tuple[int, torch.Tensor] | None = None

    @property
    def total_steps(self) -> int:
        return self.max_steps or self.epochs * self.steps_per_epoch

    def _order(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = (epoch, torch.randperm(self.n_items, generator=gen))
        return self._perm[1]

    def ids(self, step: int, micro: int, rank: int | None = None) -> list[int]:
        """The items of this rank's (or ``rank``'s) micro-step ``micro`` of step ``step``."""
        rank = self.world.rank if rank is None else rank
        first = (micro * self.world.world_size + rank) * self.batch_size
        epoch, within = divmod(step, self.steps_per_epoch)
        order = self._order(epoch)
        return order[within * self.global_batch + first :][: self.batch_size].tolist()

    def step_ids(self, step: int) -> list[list[int]]:
        """The items of every micro-step of every rank of optimizer step ``step``."""
        ranks = range(self.world.world_size)
        return [self.ids(step, m, r) for m in range(self.grad_accum) for r in ranks]


class Batches:
    """Training windows by (step, micro-step, rank), computed from indices alone.

    ``"windows"`` sampling walks the sliding windows in epochs (`EpochOrder`); ``"random"``
    reads the windows of a seeded random stream in order.
    """

    walks_epochs: bool  # the order depends on the global batch: resuming must keep it

    def __init__(
        self, tokens: np.ndarray, cfg: TrainConfig, context_length: int, world: dist_utils.World
    ):
        from gptkiln.data.windows import RandomWindowDataset, SlidingWindowDataset

        self.cfg, self.world = cfg, world
        self.context_length = context_length
        self.global_batch = cfg.batch_size * cfg.grad_accum * world.world_size
        self.walks_epochs = cfg.sampling == "windows"
        self.order: EpochOrder | None = None
        if self.walks_epochs:
            stride = cfg.stride or context_length
            self.dataset = SlidingWindowDataset(tokens, context_length, stride)
            self.order = EpochOrder(len(self.dataset), cfg, world)
            self.steps_per_epoch = self.order.steps_per_epoch
        else:
            num = max(1, cfg.max_steps) * self.global_batch
            self.dataset = RandomWindowDataset(tokens, context_length, num, cfg.seed)
            self.steps_per_epoch = cfg.max_steps

    @property
    def total_steps(self) -> int:
        return self.cfg.max_steps or self.cfg.epochs * self.steps_per_epoch

    def tokens(self, step: int) -> int:
        """Input tokens that optimizer step ``step`` reads, over all ranks and micro-steps."""
        return self.global_batch * self.context_length

    def get(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of shape (batch_size, T) for this rank's micro-step of optimizer step ``step``."""
        b = self.cfg.batch_size
        if self.order is not None:
            ids = self.order.ids(step, micro)
        else:
            first = (micro * self.world.world_size + self.world.rank) * b
            ids = range(step * self.global_batch + first, step * self.global_batch + first + b)
        xs, ys = zip(*(self.dataset[i] for i in ids), strict=True)
        return torch.stack(xs), torch.stack(ys)


def eval_batches(
    tokens: np.ndarray, context_length: int, batch_size: int, n_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed list of evaluation batches over a split's non-overlapping windows.

    When the split has at most ``n_batches * batch_size`` windows, all of them, in order (the
    book's validation loader). When it has more, that many windows spread evenly from the split's
    start to its end, so the estimate covers the whole split and not only its first pages (on
    char-level tiny Shakespeare the first 15k characters of the validation split score ~0.015
    lower than the whole split). Raises when the split is shorter than one window.
    """
    from gptkiln.data.windows import SlidingWindowDataset

    dataset = SlidingWindowDataset(tokens, context_length, context_length)
    order = spread_evenly(len(dataset), n_batches * batch_size)
    batches = []
    for start in range(0, len(order), batch_size):
        xs, ys = zip(*(dataset[i] for i in order[start : start + batch_size]), strict=True)
        batches.append((torch.stack(xs), torch.stack(ys)))
    return batches


def spread_evenly(n: int, wanted: int) -> list[int]:
    """All of ``range(n)`` when ``n <= wanted``, else ``wanted`` indices spread evenly from the
    first to the last."""
    if n <= wanted:
        return list(range(n))
    spread = torch.linspace(0, n - 1, wanted, dtype=torch.float64)
    return spread.round().long().tolist()  # float64: exact for any real corpus


@torch.no_grad()
def sum_over_batches(
    model: torch.nn.Module,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    device: str,
    world: dist_utils.World | None,
    autocast,
    measure: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> list[float]:
    """Sums over ``batches`` of ``measure(logits, loss, y)``, a float64 tensor of sums per batch
    (e.g. loss x targets, targets), added up over all ranks, which split the batches.

    Every rank runs the same number of forwards (FSDP needs all ranks in every forward); the
    padding ones are not counted.
    """
    world = world or dist_utils.World()
    was_training = model.training
    model.eval()
    rounds = math.ceil(len(batches) / world.world_size)
    totals = None
    for i in range(rounds):
        j = i * world.world_size + world.rank
        x, y = batches[j % len(batches)]
        x, y = x.to(device), y.to(device)
        with autocast or torch.autocast(device_type="cpu", enabled=False):
            logits, loss = model(x, y)
        sums = measure(logits, loss, y)
        totals = torch.zeros_like(sums) if totals is None else totals
        if j < len(batches):
            totals += sums
    totals = dist_utils.all_reduce_sum(totals, world)
    model.train(was_training)
    return totals.tolist()


def loss_sums(logits: torch.Tensor, loss: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(summed loss, targets) of one batch: the loss is a mean over the targets that count,
    those not -100 (padding masked by a fine-tuning batch)."""
    count = (y != -100).sum().double()
    return torch.stack([loss.double() * count, count])


def evaluate(
    model: torch.nn.Module,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    device: str,
    world: dist_utils.World | None = None,
    autocast=None,
) -> float:
    """Mean cross-entropy over ``batches`` (weighted by targets), the work split across ranks."""
    loss_sum, count = sum_over_batches(model, batches, device, world, autocast, loss_sums)
    return loss_sum / count


@dataclass
class Evaluation:
    """What `evaluate_text` measured over a list of batches.

    Attributes:
        loss: mean cross-entropy per target token, in nats.
        tokens: target tokens scored.
        characters: characters of those targets' text (`Tokenizer.char_counts`).
    """

    loss: float
    tokens: int
    characters: int

    @property
    def bits_per_char(self) -> float | None:
        """The summed loss over the characters of the text scored, in bits: comparable across
        tokenizers, which cut the same text into different numbers of tokens."""
        if not self.characters:
            return None
        return bits_per_char(self.loss, self.tokens, self.characters)


def bits_per_char(loss: float, tokens: int, characters: int) -> float:
    """Bits per character of a text from its mean cross-entropy per token in nats: the summed
    loss over the characters, over ln 2 (for a char tokenizer exactly ``loss / ln 2``)."""
    return loss * (tokens / characters) / math.log(2)


def evaluate_text(
    model: torch.nn.Module,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    device: str,
    char_counts: torch.Tensor,
    world: dist_utils.World | None = None,
    autocast=None,
) -> Evaluation:
    """`evaluate`, also counting the characters of the targets' text for bits per character.

    Args:
        char_counts: characters per id, ``(vocab_size,)`` (`Tokenizer.char_counts`).
    """
    counts = char_counts.to(device)

    def measure(logits, loss, y):  # (summed loss, targets, characters) of one batch
        return torch.cat([loss_sums(logits, loss, y), counts[y].sum().double().reshape(1)])

    loss_sum, tokens, chars = sum_over_batches(model, batches, device, world, autocast, measure)
    return Evaluation(loss=loss_sum / tokens, tokens=int(tokens), characters=int(chars))


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


def model_config_for(cfg: TrainConfig, vocab_size: int) -> GPTConfig:
    """The model config a training config asks for, sized to the tokenizer's vocabulary."""
    overrides: dict = {"vocab_size": vocab_size}
    if cfg.context_length is not None:
        overrides["context_length"] = cfg.context_length
    if cfg.dropout is not None:
        overrides["dropout"] = cfg.dropout
    if cfg.tie_embeddings is not None:
        overrides["tie_embeddings"] = cfg.tie_embeddings
    if cfg.gelu is not None:
        overrides["gelu"] = cfg.gelu
    return GPTConfig.from_name(cfg.model, **overrides)


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


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Rows of a metrics.csv as dicts of floats (empty cells become None)."""
    rows = []
    with open(path, newline="") as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            try:
                rows.append(
                    {k: (float(v) if v not in ("", None) else None) for k, v in row.items()}
                )
            except (TypeError, ValueError):
                raise GptkilnError(
                    f"{path} line {line}: not a row of numbers ({','.join(map(str, row.values()))}"
                    "); fix that line, or delete the file to drop the run's loss history"
                ) from None
    return rows


def tensorboard_writer_class():
    """torch's `SummaryWriter`, or one line naming the fix when the tensorboard package (which
    it writes with) is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise GptkilnError(
            "--tensorboard needs the tensorboard package, which is not installed: "
            "pip install tensorboard (or drop --tensorboard)"
        ) from None
    return SummaryWriter


class TensorBoardLog:
    """Every metric of the rows a run writes to metrics.csv (each column but ``step``, a scalar
    of that name), and the samples as text, in TensorBoard's event files under ``log_dir``.

    ``purge_step``: on resuming, events of this step and later, logged by an attempt that went
    past its last checkpoint, are hidden (as metrics.csv drops those rows).
    """

    def __init__(self, log_dir: Path, purge_step: int | None = None) -> None:
        self.writer = tensorboard_writer_class()(str(log_dir), purge_step=purge_step)

    def log_row(self, row: dict) -> None:
        for name, value in row.items():
            if name != "step" and value is not None:
                self.writer.add_scalar(name, value, int(row["step"]))
        self.writer.flush()  # readable while the run goes on

    def log_sample(self, step: int, text: str) -> None:
        # TensorBoard shows text as Markdown: indented, it keeps the sample's lines as written
        self.writer.add_text("sample", "    " + text.replace("\n", "\n    "), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def sample_text(
    model: GPT, tokenizer, prompt: str, max_new_tokens: int, seed: int, use_cache: bool = True
) -> str:
    """A short sample from ``prompt`` (top-k 50, temperature 0.8) for watching a run learn."""
    from gptkiln.sampling import generate

    ids = tokenizer.encode(prompt)
    cfg = SampleConfig(max_new_tokens=max_new_tokens, temperature=0.8, top_k=50, seed=seed)
    new = generate(model, ids, cfg, eot_id=tokenizer.eot_id, use_cache=use_cache)
    return prompt + tokenizer.decode(new)


def now() -> float:
    return time.perf_counter()


# -- what a kind of training gives the loop ---------------------------------------------------
@dataclass(frozen=True)
class RunContext:
    """Where a run trains, handed to a task as it builds its data and model.

    Attributes:
        cfg: the loop's settings.
        run_dir: the run directory (``cfg.out``).
        device: the torch device of this process (``cuda:LOCAL_RANK`` under torchrun).
        world: this process's rank among the training processes.
        resume: whether the run continues from the checkpoint in ``run_dir``.
    """

    cfg: TrainConfig
    run_dir: Path
    device: str
    world: dist_utils.World
    resume: bool


class BatchSource(Protocol):
    """Training batches by (optimizer step, micro-step), the same on every resume."""

    global_batch: int  # items an optimizer step reads over all ranks and micro-steps
    walks_epochs: bool  # the order depends on global_batch, so a resume must keep it

    @property
    def total_steps(self) -> int: ...

    def tokens(self, step: int) -> int:
        """Input tokens that optimizer step ``step`` reads, over all ranks and micro-steps."""
        ...

    def get(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of this rank's micro-step ``micro`` of step ``step``."""
        ...


class Task(Protocol):
    """What a kind of training gives `Trainer`: a model, its batches, how to evaluate and
    sample it, and how its checkpoint is written and read back.

    The loss is the model's own: ``model(x, y)`` returns ``(logits, loss)``.
    """

    model: GPT  # built on the device; the parameters that train have requires_grad
    tokenizer: Any
    batches: BatchSource
    columns: tuple[str, ...]  # what `evaluate` returns: metrics.csv columns between tokens and lr
    plots: tuple[str, ...]  # metrics drawn at the end, each as METRIC.png (train_ / val_ columns)

    def evaluate(self, model: torch.nn.Module, autocast) -> dict[str, float | None]:
        """One value per column, on the task's fixed evaluation batches."""
        ...

    def summary(self, row: dict) -> str:
        """The evaluation's part of the line printed at each evaluation."""
        ...

    def sample(self, model: GPT, use_cache: bool) -> str | None:
        """A text to watch the run learn by (None: the task has none)."""
        ...

    def save(self, model_sd: dict, state: dict, train_config: dict) -> None:
        """Write the checkpoint (rank 0 only): the model state dict, the trainer's state."""
        ...

    def load(self) -> tuple[dict, dict]:
        """(full model state dict, trainer state) of the checkpoint to resume from."""
        ...


class LanguageModeling:
    """Pretraining's task: text prepared into tokens, windows of it, a fresh GPT predicting the
    next token, samples from ``cfg.sample_prompt``."""

    columns = ("train_loss", "val_loss", "val_bpc")
    plots = ("loss",)

    def __init__(self, ctx: RunContext):
        from gptkiln import checkpoint

        self.ctx, self.cfg, self.run_dir = ctx, ctx.cfg, ctx.run_dir
        cfg = ctx.cfg
        self.data = self._load_data()
        self.tokenizer = self.data.tokenizer
        if ctx.resume:
            self._check_same_tokenizer()
        self._check_sample_prompt()
        self.model_config = model_config_for(cfg, self.tokenizer.vocab_size)
        self._check_splits_hold_a_window()
        if ctx.resume:
            checkpoint.check_same_model_config(self.run_dir, self.model_config)
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        self.model = GPT(self.model_config).to(ctx.device)
        ctx_len = self.model_config.context_length
        self.batches = Batches(self.data.train, cfg, ctx_len, ctx.world)
        # eval_batches of the global batch, split across ranks: N x b evaluates what 1 x Nb does.
        n_eval = cfg.eval_batches * ctx.world.world_size
        self.val_batches = eval_batches(self.data.val, ctx_len, cfg.batch_size, n_eval)
        self.char_counts = torch.tensor(self.tokenizer.char_counts())
        self.train_eval_batches = (
            eval_batches(self.data.train, ctx_len, cfg.batch_size, n_eval) if cfg.eval_train else []
        )

    # -- set-up ------------------------------------------------------------------------------
    def _load_data(self):
        from gptkiln.data.prepare import is_prepared, load_prepared, prepare

        cfg, world = self.cfg, self.ctx.world
        if is_prepared(cfg.data):
            return load_prepared(cfg.data)
        data_dir = self.run_dir / "data"
        source = cfg.data
        if world.is_main and not _prepared_matches(
            data_dir, source, cfg.tokenizer, cfg.val_fraction
        ):
            prepare(
                source,
                data_dir,
                tokenizer=cfg.tokenizer,
                val_fraction=cfg.val_fraction,
                progress=cfg.progress,
            )
        dist_utils.barrier(world)
        return load_prepared(data_dir)

    def _check_same_tokenizer(self) -> None:
        """A resumed run reads its data with the tokenizer it was trained with (the same kind
        and size are not enough: two char alphabets or two trained BPEs differ in their ids)."""
        from gptkiln.tokenizers import META_FILE, load_tokenizer

        if not (self.run_dir / META_FILE).is_file():
            return
        saved = load_tokenizer(self.run_dir)
        if saved.fingerprint() != self.tokenizer.fingerprint():
            raise GptkilnError(
                f"{self.run_dir} was trained with another {saved.kind!r} tokenizer than the one "
                f"of --data {self.cfg.data or 'shakespeare'} ({self.tokenizer.kind!r}, "
                f"{self.tokenizer.vocab_size:,} ids): its ids would mean other text. Resume with "
                "the data the run was trained on, prepare new text with the run's tokenizer "
                "(gptkiln prepare TEXT --tokenizer RUN_DIR --out DIR), or start a new run with "
                "--overwrite"
            )

    def _check_splits_hold_a_window(self) -> None:
        """Each split holds one window at least (checked before the model is built)."""
        from gptkiln.data.prepare import is_prepared

        need = self.model_config.context_length + 1
        prepared = is_prepared(self.cfg.data)
        for split in ("train", "val"):
            tokens = len(getattr(self.data, split))
            if tokens < need:
                if split == "val" and not prepared:
                    more = ", raise --val-fraction or give more text"
                else:
                    more = " or prepare more text" if prepared else " or give more text"
                raise GptkilnError(
                    f"the {split} split has {tokens:,} tokens, fewer than one window of "
                    f"context_length + 1 = {need:,}; lower --context-length{more}"
                )

    def _check_sample_prompt(self) -> None:
        """The prompt of the samples while training: encodable, checked before step 1."""
        try:
            ids = self.tokenizer.encode(self.cfg.sample_prompt)
        except GptkilnError as e:
            raise GptkilnError(
                f"--sample-prompt {self.cfg.sample_prompt!r}: {e}; pass a prompt in the "
                "corpus's alphabet with --sample-prompt"
            ) from None
        if not ids:
            raise GptkilnError(
                "--sample-prompt is empty; samples while training need at least one token, "
                "e.g. --sample-prompt 'The'"
            )

    # -- what the loop asks --------------------------------------------------------------------
    def evaluate(self, model: torch.nn.Module, autocast) -> dict[str, float | None]:
        """Loss on the fixed validation and training batches (None for a set left out), and
        bits per character of the validation batches' text."""
        device, world = self.ctx.device, self.ctx.world
        train = self.train_eval_batches
        val = evaluate_text(model, self.val_batches, device, self.char_counts, world, autocast)
        return {
            "train_loss": evaluate(model, train, device, world, autocast) if train else None,
            "val_loss": val.loss,
            "val_bpc": val.bits_per_char,
        }

    def summary(self, row: dict) -> str:
        val, bpc = row["val_loss"], row.get("val_bpc")
        val_text = ""
        if val is not None:
            bpc_text = "" if bpc is None else f", {bpc:.3f} bits/char"
            val_text = f" | val {val:.3f} (ppl {math.exp(min(val, 50)):.1f}{bpc_text})"
        return f"train {row['train_loss']:.3f}{val_text}"

    def sample(self, model: GPT, use_cache: bool) -> str:
        cfg = self.cfg
        return sample_text(
            model, self.tokenizer, cfg.sample_prompt, cfg.sample_tokens, cfg.seed, use_cache
        )

    def save(self, model_sd: dict, state: dict, train_config: dict) -> None:
        from gptkiln import checkpoint

        checkpoint.write_checkpoint(
            self.run_dir,
            self.model_config,
            model_sd,
            state,
            train_config=train_config,
            tokenizer=self.tokenizer,
        )

    def load(self) -> tuple[dict, dict]:
        from gptkiln import checkpoint

        return checkpoint.read_checkpoint(self.run_dir)


# -- the loop ---------------------------------------------------------------------------------
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
        self.cfg, self.run_dir = cfg, Path(cfg.out)
        self.device = resolve_device(cfg.device)
        check_one_gpu_each(self.device, os.environ)
        self.owns_process_group = dist_utils.launched_by_torchrun() and not dist_utils.initialized()
        self.world = dist_utils.setup(self.device)
        self.tensorboard: TensorBoardLog | None = None  # what close() closes, set in _set_up
        try:
            self._set_up(cfg, resume, overwrite, task)
        except BaseException:
            # A bad input found while setting up: leave the group (this rank has no collective
            # in flight) so that the process exits with its code, not a gloo abort at exit.
            self.close()
            raise

    def _set_up(
        self,
        cfg: TrainConfig,
        resume: bool,
        overwrite: bool,
        task: Callable[[RunContext], Task] | None,
    ) -> None:
        if self.device == "cuda":
            self.device = f"cuda:{self.world.local_rank}"
        self.guard = dist_utils.TerminationGuard()
        if cfg.tensorboard:  # a missing package fails before any data is prepared
            tensorboard_writer_class()
        resume, overwrite = self._start_mode(resume, overwrite)
        context = RunContext(cfg, self.run_dir, self.device, self.world, resume)
        self.task = (task or LanguageModeling)(context)
        self.tokenizer = self.task.tokenizer
        self.model = dist_utils.parallelize(self.task.model, self.world, cfg.parallel)
        self.forward = torch.compile(self.model) if cfg.compile else self.model
        betas = (cfg.beta1, cfg.beta2)
        self.optimizer = make_optimizer(self.model, cfg.lr, cfg.weight_decay, betas)
        self.batches = self.task.batches
        self.metrics_fields = ["step", "tokens", *self.task.columns, "lr", "tokens_per_s"]
        self.step, self.tokens, self.history, self.saved_step = 0, 0, [], None
        self.train_seconds = 0.0  # wall time spent in the training loop, over all its resumes
        self.budget_s = None if cfg.max_time is None else cfg.max_time * 60
        torch.manual_seed(cfg.seed + self.world.rank)  # dropout differs across ranks
        if resume:
            self._restore()
        elif self.world.is_main:
            self._start_afresh(overwrite)
        if cfg.tensorboard and self.world.is_main:
            from gptkiln.checkpoint import TENSORBOARD_DIR

            purge = self.step + 1 if resume else None
            self.tensorboard = TensorBoardLog(self.run_dir / TENSORBOARD_DIR, purge)

    @property
    def tokens_per_step(self) -> int:
        """Input tokens of the next optimizer step, over all ranks and micro-steps."""
        return self.batches.tokens(self.step)

    def close(self) -> None:
        """Close the TensorBoard log; leave the process group, if this trainer joined it."""
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.owns_process_group:
            dist_utils.teardown()

    # -- set-up ------------------------------------------------------------------------------
    def _start_mode(self, resume: bool, overwrite: bool) -> tuple[bool, bool]:
        """(resume, overwrite) for this attempt, the same on every rank, or an error."""
        from gptkiln import checkpoint

        # Any rank: restart counts are per machine, and an agent whose workers were healthy
        # restarts them without counting it.
        self.restarted = dist_utils.any_rank(dist_utils.restart_count() > 0, self.world)
        resume, overwrite = resume_after_restart(self.run_dir, resume, overwrite, self.restarted)
        checkpoint.check_run_dir_for_training(self.run_dir, resume=resume, overwrite=overwrite)
        if not dist_utils.all_equal(int(resume), self.world):
            raise GptkilnError(
                f"the ranks disagree whether {self.run_dir} holds a checkpoint to resume; "
                "with several machines, --out must be on a filesystem that every machine sees"
            )
        return resume, overwrite

    def _start_afresh(self, overwrite: bool) -> None:
        from gptkiln.checkpoint import TRAINER_STATE_FILE, tensorboard_events

        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "metrics.csv").unlink(missing_ok=True)
        for events in tensorboard_events(self.run_dir):
            events.unlink()  # a replaced run's: its curves must not mix with this one's
        if overwrite:  # so that a restart after a failure never resumes the replaced run
            (self.run_dir / TRAINER_STATE_FILE).unlink(missing_ok=True)

    @property
    def autocast(self):
        """The autocast context of ``cfg.precision`` ("auto": bf16 on CUDA, fp32 elsewhere)."""
        device_type = self.device.split(":")[0]
        precision = self.cfg.precision
        bf16 = precision == "bf16" or (precision == "auto" and device_type == "cuda")
        return torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16)

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
        if self.world.is_main:
            self._say_if_nothing_to_train()
        bar = self._progress_bar()
        try:
            with self.guard:
                train_loss, val_loss, val_bpc = self._loop(bar)
                if self.world.is_main:
                    self.plot()
                sample = self.log_sample(bar)
        except (RuntimeError, dist_utils.WorkerStopped) as e:
            if isinstance(e, dist_utils.WorkerStopped) or (
                self.world.distributed and dist_utils.is_peer_failure(e)
            ):
                raise RunStopped(self._stopped_message(e)) from e
            raise
        finally:
            bar.close()
        return TrainResult(
            self.run_dir,
            self.step,
            self.tokens,
            train_loss,
            val_loss,
            sample,
            self.history,
            val_bpc,
        )

    def _progress_bar(self):
        """A bar of steps, or of seconds when the run has a time budget (its steps are unknown)."""
        from tqdm.auto import tqdm

        options = dict(dynamic_ncols=True, disable=not (self.cfg.progress and self.world.is_main))
        if self.budget_s is None:
            return tqdm(total=self.batches.total_steps, initial=self.step, unit="step", **options)
        shown = "{l_bar}{bar}| {n:.0f}/{total:.0f} s [{elapsed}<{remaining}{postfix}]"
        start = min(self.train_seconds, self.budget_s)
        return tqdm(total=self.budget_s, initial=start, bar_format=shown, **options)

    def _say_if_nothing_to_train(self) -> None:
        if self.step >= self.batches.total_steps:
            print(
                f"nothing to train: {self.run_dir} is already at step {self.step} of "
                f"{self.batches.total_steps}; raise --max-steps (or --epochs) to go on",
                file=sys.stderr,
            )
        elif self._out_of_time():
            print(
                f"nothing to train: {self.run_dir} has trained {self.train_seconds / 60:.2f} "
                f"minutes, its --max-time is {self.cfg.max_time:g}; raise --max-time to go on",
                file=sys.stderr,
            )

    def _out_of_time(self) -> bool:
        return self.budget_s is not None and self.train_seconds >= self.budget_s

    def _clock(self, seconds: float) -> None:
        """Record ``seconds`` of training so far. With a time budget, every rank takes the
        slowest rank's clock, so all agree on the learning rate and on the last step."""
        if self.budget_s is not None:
            seconds = dist_utils.all_reduce_max(seconds, self.world)
        self.train_seconds = seconds

    def _loop(self, bar) -> tuple[float | None, float | None, float | None]:
        """Optimizer steps until the last (``max_steps``, epochs, or the time budget);
        evaluates, samples and saves at their intervals. Returns the last evaluation's (train
        loss, val loss, val bits per character)."""
        cfg, total = self.cfg, self.batches.total_steps
        train_loss = val_loss = val_bpc = None
        tokens_per_s = None  # no step timed yet
        origin = None  # where this process's clock reads 0 training seconds (set at step 1)
        compiling = cfg.compile and self.step < total and not self._out_of_time()
        if compiling and self.world.is_main:  # torch.compile works in the next step
            bar.write(
                f"compiling the model with torch.compile: step {self.step + 1} takes longer (tens "
                "of seconds; torch caches the compiled code, so later runs start sooner)"
            )
        while self.step < total and not self._out_of_time():
            dist_utils.fail_for_test(self.step, self.world)
            t0 = now()
            origin = t0 - self.train_seconds if origin is None else origin
            step_tokens = self.batches.tokens(self.step)
            lr, loss = self.train_step(total)
            self.step += 1
            self.tokens += step_tokens
            t1 = now()
            self._clock(t1 - origin)
            dt = t1 - t0
            if compiling:  # the compile time is no step's speed: keep it out of tokens/s
                compiling = False
                if self.world.is_main:
                    bar.write(f"compiled: step {self.step} took {dt:.1f} s")
            elif tokens_per_s is None:
                tokens_per_s = step_tokens / dt
            else:
                tokens_per_s = 0.9 * tokens_per_s + 0.1 * step_tokens / dt
            bar.update(1 if self.budget_s is None else min(self.train_seconds, bar.total) - bar.n)
            if self.cfg.progress and self.world.distributed:  # the whole batch's, not rank 0's
                shown = dist_utils.all_reduce_mean(torch.tensor(loss), self.world).item()
            else:
                shown = loss
            speed = "-" if tokens_per_s is None else f"{tokens_per_s:,.0f}"
            bar.set_postfix(step=self.step, loss=f"{shown:.3f}", tok_s=speed, refresh=False)
            last = self.step == total or self._out_of_time()
            if self.step % cfg.eval_interval == 0 or last:
                train_loss, val_loss, val_bpc = self.log_eval(loss, lr, tokens_per_s, bar)
            if not self.world.distributed and not math.isfinite(loss):
                raise GptkilnError(self._diverged_message(f"the loss is {loss}"))
            save = self.step % cfg.checkpoint_interval == 0 or last
            sample = self.step % cfg.sample_interval == 0 and not last
            if (save or sample) and dist_utils.any_rank(not self._finite(loss), self.world):
                raise GptkilnError(self._diverged_message("the loss or the weights are not finite"))
            if save:
                self.save()
            if sample:  # after the save: a sample that fails never costs a checkpoint
                self.log_sample(bar)
        return train_loss, val_loss, val_bpc

    def _finite(self, loss: float) -> bool:
        """This rank's last loss and weights (its shards, with FSDP) are all finite numbers."""
        return math.isfinite(loss) and all(
            bool(torch.isfinite(p).all()) for p in self.model.parameters()
        )

    def _diverged_message(self, what: str) -> str:
        """One line: training diverged, the checkpoint is kept, and what to change."""
        if self.saved_step is None:
            kept = "no checkpoint was written"
        else:
            kept = f"the checkpoint of step {self.saved_step} in {self.run_dir} is kept as it was"
        return (
            f"training diverged at step {self.step}: {what}; {kept}. Lower --lr (now "
            f"{self.cfg.lr:g}) or lengthen --warmup-steps (now {self.cfg.warmup_steps}), then "
            "continue with --resume or start again with --overwrite"
        )

    def _stopped_message(self, error: BaseException) -> str:
        """One line for a person: who stopped, why, and where the last checkpoint is."""
        world = self.world
        who = f"rank {world.rank} of {world.world_size}" if world.distributed else "training"
        if isinstance(error, dist_utils.WorkerStopped):
            why = str(error)
            if world.distributed:
                why += " (torchrun stops every worker when one fails)"
        else:
            first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
            why = f"lost contact with the other ranks ({first_line[:200]})"
        if self.saved_step is None:
            where = "no checkpoint was written"
        else:
            where = f"the last checkpoint, step {self.saved_step}, is in {self.run_dir}"
            where += ": continue with --resume"
        return f"{who} stopped at step {self.step}: {why}; {where}"

    def train_step(self, total: int) -> tuple[float, float]:
        """One optimizer step over grad_accum micro-batches; (lr, mean loss on this rank)."""
        cfg = self.cfg
        lr = lr_at(
            self.step,
            lr=cfg.lr,
            min_lr=cfg.min_lr,
            warmup_steps=cfg.warmup_steps,
            total_steps=total,
            decay=cfg.decay_lr,
            time_used=0.0 if self.budget_s is None else self.train_seconds / self.budget_s,
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(cfg.grad_accum):
            x, y = self.batches.get(self.step, micro)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with dist_utils.gradient_sync(self.model, micro == cfg.grad_accum - 1):
                with self.autocast:
                    _, loss = self.forward(x, y)
                (loss / cfg.grad_accum).backward()
            loss_sum += loss.detach()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return lr, loss_sum.item() / cfg.grad_accum

    # -- watching it learn -------------------------------------------------------------------
    def log_eval(self, batch_loss: float, lr: float, tokens_per_s: float | None, bar):
        """The task's evaluation (e.g. loss and perplexity on fixed validation and training
        batches) as one CSV row and one line."""
        values = self.task.evaluate(self.model, self.autocast)
        mean_batch = dist_utils.all_reduce_mean(torch.tensor(batch_loss), self.world).item()
        if values.get("train_loss") is None:  # no training set evaluated: the batches' loss
            values["train_loss"] = mean_batch
        row = {
            "step": self.step,
            "tokens": self.tokens,
            **values,
            "lr": lr,
            # tokens counts every rank; None (an empty cell) until a step is timed: under
            # --compile the first step is compiling, no measure of speed
            "tokens_per_s": tokens_per_s,
        }
        self.history.append(row)
        if self.world.is_main:
            self._append_metrics(row)
            if self.tensorboard is not None:
                self.tensorboard.log_row(row)
            bar.write(
                f"step {self.step:>6} | {self.task.summary(row)} "
                f"| lr {lr:.2e}" + ("" if tokens_per_s is None else f" | {tokens_per_s:,.0f} tok/s")
            )
        return row["train_loss"], row.get("val_loss"), row.get("val_bpc")

    def log_sample(self, bar) -> str | None:
        """Every rank generates (FSDP needs all of them); rank 0 prints."""
        model = self.raw_model
        text = self.task.sample(model, use_cache=self.cfg.parallel != "fsdp")
        model.train()
        if text is not None and self.world.is_main:
            bar.write(f"--- sample at step {self.step} ---\n{text}\n---")
            if self.tensorboard is not None:
                self.tensorboard.log_sample(self.step, text)
        return text

    def _append_metrics(self, row: dict) -> None:
        path = self.run_dir / "metrics.csv"
        new = not path.exists()
        with self.guard.hold(), open(path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.metrics_fields)
            if new:
                writer.writeheader()
            writer.writerow(
                {k: ("" if row.get(k) is None else row[k]) for k in self.metrics_fields}
            )

    def plot(self) -> None:
        """loss.png, and a plot of each other metric the task draws (e.g. accuracy.png)."""
        from gptkiln.plots import plot_metric

        path = self.run_dir / "metrics.csv"
        if path.exists():
            rows = read_metrics(path)
            for metric in self.task.plots:
                plot_metric(rows, self.run_dir / f"{metric}.png", metric)

    # -- checkpoints -------------------------------------------------------------------------
    def save(self) -> None:
        """Write the checkpoint (all ranks gather, rank 0 writes)."""
        model_sd, optim_sd = dist_utils.full_state(self.model, self.optimizer)
        rng = _gather_rng(self.world, torch.get_rng_state)
        cuda_rng = []
        if self.device.startswith("cuda"):
            cuda_rng = _gather_rng(self.world, lambda: torch.cuda.get_rng_state(self.device))
        if self.world.is_main:
            state = {
                "step": self.step,
                "tokens": self.tokens,
                "global_batch": self.batches.global_batch,
                "world_size": self.world.world_size,
                "optimizer": optim_sd,
                "rng": rng,
                "cuda_rng": cuda_rng,  # each rank's own device's generator
                "scheduler": {"step": self.step, "total_steps": self.batches.total_steps},
                "train_seconds": self.train_seconds,
            }
            with self.guard.hold():  # a SIGTERM now would leave half a checkpoint
                self.task.save(model_sd, state, self.cfg.to_dict())
                self.saved_step = self.step
        dist_utils.barrier(self.world)
        self.saved_step = self.step

    def _restore(self) -> None:
        model_sd, state = self.task.load()
        dist_utils.load_full_state(self.model, self.optimizer, model_sd, state["optimizer"])
        self.step = self.saved_step = int(state["step"])
        # a resume may change the batch or the processes: the tokens seen so far are counted
        self.tokens = int(state.get("tokens", self.step * self.batches.tokens(0)))
        # a checkpoint from before time budgets has no clock: its time so far counts as 0
        self.train_seconds = float(state.get("train_seconds", 0.0))
        saved_batch = state.get("global_batch")
        if self.batches.walks_epochs and saved_batch not in (None, self.batches.global_batch):
            what = "windows" if isinstance(self.task, LanguageModeling) else "examples"
            raise GptkilnError(
                f"{self.run_dir} was trained on {saved_batch} {what} a step and this resume "
                f"takes {self.batches.global_batch} (batch_size x grad_accum x processes): "
                "each epoch is walked in steps of that size, so a new size would "
                f"read some {what} twice and skip others. Keep the product at {saved_batch}, "
                "or start a new run"
            )
        if self.world.is_main and self.restarted:
            print(
                f"torchrun restarted the workers: resuming from step {self.step} in {self.run_dir}",
                flush=True,
            )
        rng = state["rng"]
        if len(rng) == self.world.world_size:
            torch.set_rng_state(rng[self.world.rank])
        cuda_rng = state.get("cuda_rng") or []
        if self.device.startswith("cuda") and len(cuda_rng) == self.world.world_size:
            torch.cuda.set_rng_state(cuda_rng[self.world.rank], self.device)
        metrics = self.run_dir / "metrics.csv"
        if self.world.is_main and metrics.exists():
            # A killed run may have logged past its last checkpoint: keep rows up to the step.
            rows = [r for r in read_metrics(metrics) if r["step"] <= self.step]
            metrics.unlink()
            for row in rows:
                row["step"] = int(row["step"])
                row["tokens"] = int(row["tokens"])
                self._append_metrics(row)
            self.history = rows


def resume_after_restart(
    run_dir: Path, resume: bool, overwrite: bool, restarted: bool
) -> tuple[bool, bool]:
    """(resume, overwrite) for this attempt of the run.

    When torchrun has ``restarted`` the workers after a failure (``--max-restarts``), the run
    continues from the checkpoint the failed attempt left in ``run_dir``, whatever the command
    line said (it is the same command); before any checkpoint, it starts as the command says.
    """
    from gptkiln.checkpoint import TRAINER_STATE_FILE

    if restarted and (run_dir / TRAINER_STATE_FILE).is_file():
        return True, False
    return resume, overwrite


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


def _gather_rng(world: dist_utils.World, get_state) -> list[torch.Tensor]:
    """Every rank's generator state (``get_state()``, a CPU tensor), by rank."""
    state = get_state()
    if not world.distributed:
        return [state]
    import torch.distributed as dist

    states: list = [None] * world.world_size
    dist.all_gather_object(states, state)
    return states


def _prepared_matches(data_dir: Path, source, tokenizer: str, val_fraction: float) -> bool:
    """Whether data_dir already holds this source prepared the same way (so it is reused): the
    same source (files with the same contents), tokenizer spec (``bpe:N`` with its N) and split."""
    from gptkiln.data.prepare import read_meta
    from gptkiln.data.sources import DEFAULT_SOURCE, source_checksums

    meta = read_meta(data_dir)  # None when missing or damaged: prepare it again
    return (
        meta is not None
        and meta.get("source") == (DEFAULT_SOURCE if source is None else str(source))
        and meta.get("tokenizer_spec") == tokenizer
        and meta.get("val_fraction") == val_fraction
        and meta.get("checksums") == source_checksums(source)  # an edited file: prepare again
    )
