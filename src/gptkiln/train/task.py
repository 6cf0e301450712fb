"""What a kind of training gives the loop (`Task`, `BatchSource`, handed a `RunContext`), and
pretraining's task, `LanguageModeling`: prepared text, windows of it, a fresh GPT.

Fine-tuning's tasks (`gptkiln.finetune`) implement the same protocol, so `gptkiln train` and
`gptkiln finetune` share one loop, one checkpoint format, one resume and one metrics file.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from gptkiln import checkpoint, run_guard
from gptkiln import distributed as dist_utils
from gptkiln.config import GPTConfig, TrainConfig
from gptkiln.config.model import rounded_vocab
from gptkiln.config.train import BPE_SAMPLE_BYTES, DEFAULT_SAMPLE_PROMPT, VOCAB_MULTIPLE
from gptkiln.errors import GptkilnError
from gptkiln.model import GPT
from gptkiln.train.agreement import keep_prepared_settings
from gptkiln.train.data_order import Batches, eval_batches
from gptkiln.train.evaluation import evaluate, evaluate_text, sample_text


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
    stride: int | None  # the step of the windows an epoch walks (None: examples, random windows)

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

    The loss is the model's own: ``model(x, y)`` returns ``(logits, loss)``; a task may define
    ``training_loss(forward, x, y) -> loss`` instead (preference tuning's, `gptkiln.finetune.dpo`),
    which the optimizer step then calls with the (wrapped) model's forward.
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

        self.ctx, self.cfg, self.run_dir = ctx, ctx.cfg, ctx.run_dir
        cfg = ctx.cfg
        self.prepared_anew = False  # a resume's text prepared again into RUN/data (said so)
        self.data = self._load_data()
        self.data_digest = data_digest(self.data_dir)
        self.tokenizer = self.data.tokenizer
        if ctx.resume:
            self._check_same_tokenizer(self.tokenizer)
        self._check_sample_prompt()
        self.model_config = model_config_for(
            cfg, self.tokenizer.vocab_size, self._resumed(), str(ctx.device)
        )
        self._check_splits_hold_a_window()
        if ctx.resume:
            self._check_not_a_baseline_run()
            checkpoint.check_same_model_config(self.run_dir, self.model_config)
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        self.model = GPT(self.model_config).to(ctx.device)
        rows = self.model_config.padded_vocab_size
        if rows and not ctx.resume and ctx.world.is_main:
            why = f"--pad-vocab {cfg.pad_vocab}" if cfg.pad_vocab else "unset: on CUDA"
            print(
                f"vocabulary: {self.tokenizer.vocab_size:,} ids in {rows:,} rows, a multiple of "
                f"{cfg.pad_vocab or VOCAB_MULTIPLE} for the head's matmul ({why}; --pad-vocab 1: "
                "none); the extra rows are never a token",
                flush=True,
            )
        ctx_len = self.model_config.context_length
        eot = self.tokenizer.eot_id
        self.batches = Batches(self.data.train, cfg, ctx_len, ctx.world, eot)
        # eval_batches of the global batch, split across ranks: N x b evaluates what 1 x Nb does.
        n_eval = cfg.eval_batches * ctx.world.world_size
        self.val_batches = eval_batches(self.data.val, ctx_len, cfg.batch_size, n_eval)
        self.char_counts = torch.tensor(self.tokenizer.char_counts())
        self.train_eval_batches = (
            eval_batches(self.data.train, ctx_len, cfg.batch_size, n_eval) if cfg.eval_train else []
        )

    # -- set-up ------------------------------------------------------------------------------
    def _load_data(self):
        """The run's data: a prepared folder as it is, or text prepared into ``RUN/data`` (by
        rank 0; every rank learns whether it failed, so the others stop at once, quietly). A
        resume whose data must be prepared anew prepares it beside the old (``RUN/.data-next``)
        and keeps it only once its tokenizer is the run's: a refused resume loses nothing. A new
        run over a run's data prepares it there too, and the old data waits in
        ``RUN/.replaced-data`` until the first checkpoint (`run_guard.restore_replaced`)."""
        from gptkiln.data.prepare import is_prepared, load_prepared, read_meta

        cfg, world = self.cfg, self.ctx.world
        if is_prepared(cfg.data):
            if cfg.bpe_sample_mb is not None:
                raise GptkilnError(
                    f"--bpe-sample-mb: {cfg.data} is prepared already, with its own tokenizer; "
                    "drop the flag, or give the text itself to prepare it with a BPE"
                )
            data = load_prepared(cfg.data)
            keep_prepared_settings(cfg, read_meta(cfg.data) or {})
            self.data_dir = Path(cfg.data)
            return data
        data_dir = self.data_dir = self.run_dir / "data"
        error = None
        if world.is_main and not _prepared_matches(
            data_dir, cfg.data, cfg.tokenizer, cfg.val_fraction, cfg.text_field,
            cfg.bpe_sample_bytes(),
        ):  # fmt: skip
            try:
                self._prepare_into(data_dir)
            except GptkilnError as e:
                error = e
        said = dist_utils.error_of_rank_0(error, world)  # also the barrier after prepare
        if error is not None:
            raise error
        if said is not None:  # the same line as rank 0's: the launcher prints it once
            raise GptkilnError(said)
        return load_prepared(data_dir)

    def _prepare_into(self, data_dir: Path) -> None:
        """Rank 0: prepare ``--data`` into ``data_dir``; see `_load_data`."""
        from gptkiln.data.prepare import is_prepared, load_prepared, prepare

        cfg = self.cfg
        # A run's prepared data is kept whole until the new is prepared (and, for a new run,
        # until its first checkpoint); a folder of anything else there, or one that holds the
        # text itself, is prepare's to refuse or to write beside, and is never set aside.
        staged = is_prepared(data_dir) and not _inside(cfg.data, data_dir)
        target = self.run_dir / ".data-next" if staged else data_dir
        if staged:
            shutil.rmtree(target, ignore_errors=True)  # an attempt that stopped halfway
        made = not self.run_dir.exists()
        # a resume reads the new text with the run's own tokenizer (a bpe:N trained again on
        # other text would be another tokenizer, which the resume must refuse)
        tokenizer = self._run_tokenizer() if self.ctx.resume else None
        try:
            try:  # (the run's tokenizer recorded as the spec it was made from, so reused later)
                prepare(cfg.data, target, tokenizer=tokenizer or cfg.tokenizer,
                        val_fraction=cfg.val_fraction, text_field=cfg.text_field,
                        progress=cfg.progress, tokenizer_spec=cfg.tokenizer,
                        bpe_sample_bytes=cfg.bpe_sample_bytes())  # fmt: skip
            except GptkilnError as e:
                if tokenizer is None:
                    raise
                raise GptkilnError(
                    f"cannot resume {self.run_dir} on --data {cfg.data}, read with the run's own "
                    f"tokenizer: {e}; resume on text it can read, or train a new run"
                ) from None
            if staged and self.ctx.resume:
                self._check_same_tokenizer(load_prepared(target).tokenizer)
        except BaseException:
            if staged:
                shutil.rmtree(target, ignore_errors=True)
            if made and self.run_dir.is_dir() and not any(self.run_dir.iterdir()):
                self.run_dir.rmdir()  # a run directory this attempt made, and left empty
            raise
        if staged and self.ctx.resume:  # the new data checked: it replaces the old
            shutil.rmtree(data_dir)
            os.replace(target, data_dir)
            self.prepared_anew = True
            print(
                f"note: --data {cfg.data or 'shakespeare'} is not what {data_dir} was prepared "
                "from (other text, or another split or field): prepared anew for this resume, "
                "so the losses from here on are of the new data and its validation split",
                file=sys.stderr,
            )
        elif staged:  # a new run: the old data waits aside until its first checkpoint
            run_guard.set_aside_replaced_data(self.run_dir, target)

    def _run_tokenizer(self):
        """The tokenizer of the run being resumed, from its files, where ``--tokenizer`` names
        its kind; None where it keeps none, or another kind is asked (the resume then refuses
        in its own words)."""
        from gptkiln.loading import load_run_tokenizer
        from gptkiln.tokenizers import parse_tokenizer_spec

        try:
            tokenizer = load_run_tokenizer(self.run_dir)
            asked = parse_tokenizer_spec(self.cfg.tokenizer)[0]
        except GptkilnError:
            return None
        return tokenizer if tokenizer.kind == asked else None

    def _resumed(self) -> GPTConfig | None:
        """The model config the checkpoint being resumed saved (None for a new run, or where
        it has none: the resume refuses that later, in its own words)."""
        from gptkiln.loading.files import CONFIG_FILE, read_config
        from gptkiln.loading.run import run_model_config

        if not self.ctx.resume or not (self.run_dir / CONFIG_FILE).is_file():
            return None
        try:
            return run_model_config(read_config(self.run_dir), self.run_dir / CONFIG_FILE)
        except GptkilnError:
            return None

    def _check_same_tokenizer(self, tokenizer) -> None:
        """A resumed run reads its data with the tokenizer it was trained with (the same kind
        and size are not enough: two char alphabets or two trained BPEs differ in their ids)."""
        from gptkiln.tokenizers import META_FILE, load_tokenizer

        if not (self.run_dir / META_FILE).is_file():
            return
        saved = load_tokenizer(self.run_dir)
        if saved.fingerprint() != tokenizer.fingerprint():
            data = f"--data {self.cfg.data or 'shakespeare'}"
            if saved.kind == tokenizer.kind:
                which = (
                    f"a {saved.kind!r} tokenizer of another vocabulary than the one of {data} "
                    f"({saved.vocab_size:,} and {tokenizer.vocab_size:,} ids)"
                )
            else:
                which = (
                    f"a {saved.kind!r} tokenizer ({saved.vocab_size:,} ids), not the "
                    f"{tokenizer.kind!r} one of {data} ({tokenizer.vocab_size:,} ids)"
                )
            raise GptkilnError(
                f"{self.run_dir} was trained with {which}: its ids would mean other text. "
                "Resume with the data the run was trained on, prepare new text with the run's "
                "tokenizer (gptkiln prepare TEXT --tokenizer RUN_DIR --out DIR), or start a new "
                "run with --overwrite"
            )

    def _check_not_a_baseline_run(self) -> None:
        """A run of the default from before issue 47 (AdamW, qwen3-baby, ...) resumed with
        today's defaults would be refused for its model, then its optimizer, and continue on
        another schedule and batch: say at once that ``--config baseline`` is its recipe. Only
        where the model or the optimizer differs, which a resume refuses anyway (a resume of
        it may change its learning rate or batch on purpose)."""
        from gptkiln.config.recipes import RECIPES_DIR, load_recipe
        from gptkiln.loading.files import read_config

        baseline = load_recipe(str(RECIPES_DIR / "baseline.yaml"))  # the bundled one, always
        saved = read_config(self.run_dir).get("train") or {}
        keys = [k for k in baseline if k != "max_steps"]
        was_baseline = all(saved.get(k) == baseline[k] for k in keys)
        if was_baseline and any(
            getattr(self.cfg, k) != baseline[k] for k in ("model", "optimizer")
        ):
            raise GptkilnError(
                f"cannot resume {self.run_dir}: it was trained with the settings of the default "
                "run before it became the speedrun recipe (AdamW, qwen3-baby, 8 random windows "
                "a step), which are now --config baseline; resume it with those settings "
                "(gptkiln train --out RUN --resume takes them from the run), or start a new run "
                "with --overwrite"
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
        """The prompt of the samples while training: encodable, checked before step 1. Unset,
        it is ``ROMEO:`` on the bundled plays, and on other text the end-of-text token (or the
        tokenizer's first token, where it has none), as a document starts."""
        self.sample_prompt = self.cfg.sample_prompt
        if self.sample_prompt is None:
            eot = self.tokenizer.eot_id
            start = "" if eot is not None else self.tokenizer.decode([0])
            self.sample_prompt = DEFAULT_SAMPLE_PROMPT if self._plays() else start
            return
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

    def _plays(self) -> bool:
        """Whether the run trains on the bundled plays alone (prepared or not)."""
        from gptkiln.data.sources import DEFAULT_SOURCE

        return self.data.meta.get("source") == DEFAULT_SOURCE and "mix" not in self.data.meta

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
            model, self.tokenizer, self.sample_prompt, cfg.sample_tokens, cfg.seed, use_cache
        )

    def save(self, model_sd: dict, state: dict, train_config: dict) -> None:

        checkpoint.write_checkpoint(
            self.run_dir,
            self.model_config,
            model_sd,
            {**state, "data_digest": self.data_digest},  # a resume on other tokens says so
            train_config=train_config,
            tokenizer=self.tokenizer,
        )

    def load(self) -> tuple[dict, dict]:

        model_sd, state = checkpoint.read_checkpoint(self.run_dir)
        recorded = state.get("data_digest")
        changed = recorded not in (None, self.data_digest) and not self.prepared_anew
        if changed and self.ctx.world.is_main:  # (RUN/data prepared anew has said so)
            print(
                f"note: {self.data_dir} holds other tokens than the run trained on until step "
                f"{state.get('step')} (prepared again since): the losses from here on are of "
                "these, and of their validation split",
                file=sys.stderr,
            )
        return model_sd, state


def data_digest(data_dir: Path) -> str | None:
    """A digest of what a prepared folder holds (its token counts, tokenizer and the source
    files' checksums, from meta.json), which the trainer state records: a resume on a folder
    prepared again from other text says so. None where meta.json cannot be read."""
    import hashlib
    import json

    from gptkiln.data.prepare import read_meta

    meta = read_meta(data_dir) or {}
    keys = ("tokenizer_spec", "vocab_size", "train_tokens", "val_tokens", "val_fraction",
            "checksums")  # fmt: skip
    if not meta:
        return None
    held = json.dumps({k: meta.get(k) for k in keys}, sort_keys=True)
    return hashlib.sha256(held.encode()).hexdigest()[:16]


def model_config_for(
    cfg: TrainConfig, vocab_size: int, resumed: GPTConfig | None = None, device: str = "cpu"
) -> GPTConfig:
    """The model config a training config asks for, sized to the tokenizer's vocabulary, its
    rows padded to a multiple of ``cfg.pad_vocab``; where that is unset, as a ``resumed`` run's
    were (the config its checkpoint saved), else to `VOCAB_MULTIPLE` on CUDA (the device the
    run trains on) and not at all elsewhere."""
    if cfg.pad_vocab is None and resumed is not None:
        padded = resumed.padded_vocab_size
    else:
        multiple = cfg.pad_vocab or (VOCAB_MULTIPLE if device.startswith("cuda") else 1)
        padded = rounded_vocab(vocab_size, multiple)
    overrides: dict = {
        "vocab_size": vocab_size,
        "padded_vocab_size": padded if padded and padded > vocab_size else None,
    }
    for name in ("context_length", "n_layer", "n_head", "n_kv_head", "n_embd"):
        if getattr(cfg, name) is not None:
            overrides[name] = getattr(cfg, name)
    if cfg.dropout is not None:
        overrides["dropout"] = cfg.dropout
    if cfg.tie_embeddings is not None:
        overrides["tie_embeddings"] = cfg.tie_embeddings
    if cfg.gelu is not None:
        overrides["gelu"] = cfg.gelu
    for name in ("relu2", "zero_init_out", "value_embeds"):
        if getattr(cfg, name) is not None:
            overrides[name] = getattr(cfg, name)
    if cfg.logit_softcap is not None:
        overrides["logit_softcap"] = cfg.logit_softcap or None  # 0: no cap
    if cfg.attention_windows is not None:
        overrides["attention_windows"] = _windows(cfg.attention_windows)
    _check_sizes(cfg)
    return GPTConfig.from_name(cfg.model, **overrides)


def _check_sizes(cfg: TrainConfig) -> None:
    """The size settings over a preset, in their own words (the model config's would name its
    fields, head_dim and family, which no setting of a run changes)."""
    preset = GPTConfig.from_name(cfg.model)
    heads = cfg.n_head or preset.n_head
    if cfg.n_kv_head is not None and preset.family == "gpt2":
        raise GptkilnError(
            f"n_kv_head {cfg.n_kv_head}: {cfg.model} is a GPT-2, which has one key/value head a "
            "query head; key/value heads of their own are the llama3-* and qwen3-* presets'"
        )
    if (
        (cfg.n_embd or cfg.n_head)
        and preset.head_dim is None
        and (cfg.n_embd or preset.n_embd) % heads
    ):
        raise GptkilnError(
            f"n_embd {cfg.n_embd or preset.n_embd} is not a whole number of heads of n_head "
            f"{heads} ({cfg.model}'s own where not set); choose sizes whose ratio is whole"
        )


def _windows(text: str) -> list[int] | None:
    """``--attention-windows 0,16,16,0`` as a list (all zeros: None); the model config checks
    that there is one a block."""
    try:
        windows = [int(w) for w in text.split(",")]
    except ValueError:
        raise GptkilnError(
            f"attention_windows must be whole numbers separated by commas (one a block, 0: "
            f"the whole context, e.g. 0,16,16,0), got {text!r}"
        ) from None
    return windows if any(windows) else None


def _inside(source, folder: Path) -> bool:
    """Whether a local ``source`` (a file or folder) is ``folder`` or lies inside it."""
    if not isinstance(source, (str, os.PathLike)) or not Path(source).exists():
        return False
    path, folder = Path(source).resolve(), folder.resolve()
    return path == folder or folder in path.parents


def _prepared_matches(
    data_dir: Path,
    source,
    tokenizer: str,
    val_fraction: float,
    text_field: str = "text",
    bpe_sample: int | None = BPE_SAMPLE_BYTES,
) -> bool:
    """Whether data_dir already holds this source prepared the same way (so it is reused): the
    same source (files with the same contents), tokenizer spec (``bpe:N`` with its N), split
    and, for a BPE trained there, the text it learned from (``bpe_sample`` bytes; None: all)."""
    from gptkiln.data.mixture import source_checksums
    from gptkiln.data.prepare import read_meta
    from gptkiln.data.sources import DEFAULT_SOURCE

    meta = read_meta(data_dir)  # None when missing or damaged: prepare it again
    return (
        meta is not None
        and meta.get("source") == (DEFAULT_SOURCE if source is None else str(source))
        and meta.get("tokenizer_spec") == tokenizer
        and meta.get("val_fraction") == val_fraction
        and meta.get("text_field", "text") == text_field  # prepare records it when not "text"
        and meta.get("checksums") == source_checksums(source)  # an edited file: prepare again
        and meta.get("bpe_sample_limit", bpe_sample) == bpe_sample  # unrecorded: not asked
    )
