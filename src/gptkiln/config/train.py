"""Training settings: `TrainConfig`, each field a `setting` with its group and help (what
``gptkiln train --help`` prints), checked by `check_train_config`. The model's own shape is
`GPTConfig` (`gptkiln.config.model`), as litgpt keeps `Config` apart from its `args.py`.

No torch import here, so the CLI can parse and validate flags before torch loads.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from gptkiln.config.checks import _check_seed, _check_types, _from_dict, _positive_int
from gptkiln.config.model import PRESETS
from gptkiln.errors import GptkilnError

DEFAULT_SAMPLE_PROMPT = "ROMEO:"
"""The samples' prompt while training on the bundled plays, where `TrainConfig.sample_prompt`
is unset (on other text, samples start from end-of-text)."""
DEFAULT_TOKENIZER = "bpe:16384"
"""What ``train``, ``gptkiln prepare`` and `gptkiln.data.prepare` tokenize text with, unsaid: a
BPE trained on the corpus (``gpt2`` for GPT-2's weights and export)."""
BPE_SAMPLE_BYTES = 32 << 20
"""The most text, in UTF-8 bytes, a ``bpe`` tokenizer is trained on: the first this many of
the source (or of a mixture's draw). Hugging Face's trainer holds about 100 times the bytes of
text whose pre-tokenized words rarely repeat (Chinese or Japanese, where a run of characters
up to a punctuation mark is one word: 2.1 GB for 20 MB of Chinese text on a 2-core EPYC),
against a few times them for English; 32 MiB of Chinese then needs about 3.5 GB, and 32 MiB of
English is millions of words, ample for 32k merges. ``prepare(bpe_sample_bytes=None)`` trains
on the whole text."""
VOCAB_MULTIPLE = 64
"""What a new run on CUDA rounds its model's vocabulary up to a multiple of (``--pad-vocab``'s
default there; nanoGPT's 50,304 for GPT-2's 50,257): the head's matmul in whole tensor-core
tiles. Not on a CPU unless asked, where the gain measured small (a step 1.02-1.04x faster in
bf16, bench/padded_vocab.py) and a run's model stays the one it names (the book's 124M: its
163,009,536 parameters)."""

# The groups of `TrainConfig`'s settings, in the order `gptkiln train --help` shows them.
TRAIN_GROUPS = (
    "data",
    "model",
    "optimisation",
    "evaluation and samples",
    "checkpoints",
    "hardware",
)


def setting(default: Any, group: str, help: str, *, unset: str | None = None) -> Any:
    """A `TrainConfig` field that carries what ``gptkiln train --help`` says of it.

    Args:
        default: the field's default.
        group: one of `TRAIN_GROUPS`.
        help: one line: what it is, and its range or choices (the default is added).
        unset: what a default of None means (e.g. "the preset's"); required for one.
    """
    return dataclasses.field(
        default=default, metadata={"group": group, "help": help, "unset": unset}
    )


@dataclass
class TrainConfig:
    """Everything about a training run except the model's shape.

    Sampling of training data: ``"windows"`` walks the book's sliding windows (``stride``) in
    seeded-shuffled epochs; ``"random"`` draws windows at seeded random offsets (nanoGPT style,
    for corpora far larger than one pass). The run length is ``max_steps`` optimizer steps, or
    ``epochs`` passes over the windows when ``max_steps`` is 0 (windows sampling only); with
    ``max_time`` (minutes), the run also ends at the first step after that much training wall
    time (steps, evaluations, samples and checkpoints; not data preparation), and the learning
    rate's schedule decays over whichever of the two ends first.

    Each field carries its group and one line of help (`setting`), which ``gptkiln train
    --help`` shows; every field is also a key of a YAML recipe.
    """

    data: str | None = setting(
        None,
        "data",
        "text to train on: a .txt/.jsonl/.json/.parquet file (.gz, .zst), a folder of them, "
        "hf:NAME, a .yaml mixture (prepared into OUT/data/), or a folder made by `gptkiln prepare`",
        unset="the bundled Shakespeare plays",
    )
    out: str = setting(
        "runs/default",
        "checkpoints",
        "the run directory: weights, tokenizer, trainer state, metrics.csv, loss.png",
    )
    model: str = setting(
        # qwen3-baby learned most in 3 minutes (bench/first_run.py; GPT-2's baby: --model baby);
        # its head untied learned more with Muon (issue 47; the run before it: --config baseline)
        "qwen3-baby-untied",
        "model",
        f"model preset, which names its architecture too (llama3-*, qwen3-*; the others gpt2): "
        f"{' | '.join(PRESETS)}",
    )
    text_field: str = setting(
        "text",
        "data",
        "the JSON key, or Parquet or dataset column, of --data that holds the text",
    )
    tokenizer: str = setting(
        DEFAULT_TOKENIZER,
        "data",
        "gpt2 (OpenAI's BPE) | char | bpe:N (a byte-level BPE of N ids trained on the text; "
        "bpe alone: 8192); prepared data keeps its own",
    )
    bpe_sample_mb: int | None = setting(
        None,
        "data",
        "a bpe tokenizer learns from the first N MiB of the text, which bounds its trainer's "
        "memory; 0: the whole text",
        unset=f"{BPE_SAMPLE_BYTES >> 20}",
    )
    val_fraction: float = setting(
        0.1, "data", "share of the text, taken from its end, held out for validation, in (0, 1)"
    )
    context_length: int | None = setting(
        None, "model", "tokens the model sees at once (>= 1)", unset="the preset's"
    )
    n_layer: int | None = setting(None, "model", "transformer blocks (>= 1)", unset="the preset's")
    n_head: int | None = setting(
        None, "model", "attention (query) heads a block (>= 1)", unset="the preset's"
    )
    n_kv_head: int | None = setting(
        None,
        "model",
        "key/value heads a block, dividing --n-head (llama3, qwen3; gpt2 has one a query head)",
        unset="the preset's",
    )
    n_embd: int | None = setting(
        None,
        "model",
        "the embedding width (>= 1; the preset's MLP width is kept where it names one)",
        unset="the preset's",
    )
    dropout: float | None = setting(None, "model", "dropout rate, in [0, 1)", unset="the preset's")
    tie_embeddings: bool | None = setting(
        None, "model", "share the token embedding with the output head", unset="the preset's"
    )
    pad_vocab: int | None = setting(
        None,
        "model",
        "round the rows of the token embedding and the output head up to a multiple of N "
        "(nanoGPT's 50,304 for GPT-2's 50,257: the head's matmul at a size the hardware tiles "
        "well); the model still predicts the tokenizer's ids only; 1 = no padding (>= 1)",
        unset=f"{VOCAB_MULTIPLE} for a new run on CUDA, none elsewhere; a resumed run keeps "
        "its own",
    )
    gelu: str | None = setting(
        None,
        "model",
        "the MLP's activation: tanh (GPT-2's approximation) | exact (the erf form)",
        unset="the preset's",
    )
    relu2: bool | None = setting(
        None,
        "model",
        "gate a swiglu MLP (llama3, qwen3) with ReLU squared in place of SiLU",
        unset="the preset's",
    )
    logit_softcap: float | None = setting(
        None,
        "model",
        "cap the logits to c * tanh(logits / c) with this c (> 0; 0: no cap)",
        unset="the preset's",
    )
    zero_init_out: bool | None = setting(
        None,
        "model",
        "start the residual projections (attention and MLP outputs) at zero",
        unset="the preset's",
    )
    value_embeds: int | None = setting(
        None,
        "model",
        "extra token embeddings added into the attention values of the first and the last N "
        "blocks (modded-nanogpt's value embeddings; 0: none)",
        unset="the preset's",
    )
    attention_windows: str | None = setting(
        None,
        "model",
        "sliding-window attention by block: one window a block, comma-separated, each the "
        "positions a query attends to, 0 for all (e.g. 0,16,16,0)",
        unset="the preset's",
    )
    sampling: Literal["windows", "random", "aligned"] = setting(
        "windows",  # each window of the plays once before any twice (random: --config baseline)
        "data",
        "how training windows are drawn: random = at seeded random offsets (nanoGPT); "
        "windows = the book's sliding windows, each epoch in a seeded shuffle; aligned = "
        "random, but a window that would cross a document's end starts at it (with the end "
        "of text token)",
    )
    stride: int | None = setting(
        None,
        "data",
        "tokens between window starts with --sampling windows (>= 1)",
        unset="the context length",
    )
    batch_size: int = setting(
        12,  # with Muon, 12 windows of 64 learned more than 8 (or 4) in the same time
        "optimisation",
        "windows per micro-batch, per process (>= 1)",
    )
    grad_accum: int = setting(1, "optimisation", "micro-batches per optimizer step (>= 1)")
    max_steps: int = setting(
        1100,  # 1.940 bits/char in 132-143 s; 1,800 AdamW steps of 8 took 151-160 s for 2.044
        "optimisation",
        "optimizer steps to train (>= 0; 0: --epochs decides)",
    )
    epochs: int = setting(
        0,
        "optimisation",
        "passes over the windows when --max-steps is 0 (>= 0; needs --sampling windows)",
    )
    max_time: float | None = setting(
        None,
        "optimisation",
        "also end at the first step past this many minutes of training (> 0); the schedule "
        "follows whichever of steps and time is further along",
        unset="no time limit",
    )
    lr: float = setting(
        2e-3,  # Muon's, measured (bench/README.md, "The speedrun recipe"); AdamW's was 1e-3
        "optimisation",
        "peak learning rate, reached after warm-up (> 0)",
    )
    min_lr: float = setting(
        1e-4, "optimisation", "learning rate at the end of the decay, in [0, lr]"
    )
    warmup_steps: int = setting(30, "optimisation", "steps of linear warm-up from 0 to --lr (>= 0)")
    decay_lr: bool = setting(
        True, "optimisation", "decay the learning rate to --min-lr after warm-up (on --schedule)"
    )
    weight_decay: float = setting(
        0.1, "optimisation", "AdamW's weight decay, on matrices only (>= 0)"
    )
    beta1: float = setting(0.9, "optimisation", "AdamW's first-moment decay, in [0, 1)")
    beta2: float = setting(0.95, "optimisation", "AdamW's second-moment decay, in [0, 1)")
    grad_clip: float = setting(
        1.0, "optimisation", "clip the gradients' norm to this (>= 0; 0: no clipping)"
    )
    optimizer: Literal["adamw", "muon"] = setting(
        "muon",  # issue 47: AdamW alone (--config baseline) ended 0.1 bits/char above it
        "optimisation",
        "adamw | muon = Muon (orthogonalised momentum) for the blocks' matrices at --lr (its "
        "update scaled to AdamW's size), AdamW for the embeddings, head, norms and biases at "
        "--adamw-lr; the run before this default: --config baseline",
    )
    muon_momentum: float = setting(
        0.95, "optimisation", "Muon's (Nesterov) momentum with --optimizer muon, in [0, 1)"
    )
    adamw_lr: float | None = setting(
        8e-3,
        "optimisation",
        "with --optimizer muon: the peak learning rate of AdamW's part (embeddings, head, "
        "norms, biases), on the same schedule (> 0)",
    )
    embedding_lr: float | None = setting(
        None,
        "optimisation",
        "with --optimizer muon: the peak learning rate of the input embedding's table (and of "
        "the head where it is tied), on the same schedule (> 0)",
        unset="--adamw-lr",
    )
    schedule: Literal["cosine", "wsd"] = setting(
        "wsd",
        "optimisation",
        "the decay after warm-up: cosine to --min-lr | wsd = warm-up, stable at --lr, then a "
        "straight line to --min-lr over the last --cooldown of the steps after warm-up",
    )
    cooldown: float = setting(
        0.5,
        "optimisation",
        "with --schedule wsd: the share of the steps after warm-up that decays, in (0, 1]",
    )
    eval_interval: int = setting(
        100,
        "evaluation and samples",
        "evaluate every N steps and at the end, one row of OUT/metrics.csv each (>= 1)",
    )
    eval_batches: int = setting(
        10, "evaluation and samples", "batches of each split per evaluation (>= 1)"
    )
    eval_train: bool = setting(
        True,
        "evaluation and samples",
        "evaluate on fixed training batches too (off: the train loss is the last step's)",
    )
    sample_interval: int = setting(
        600,
        "evaluation and samples",
        "print a sample every N steps, and one at the end (>= 1; no samples: --sample-tokens 0)",
    )
    sample_prompt: str | None = setting(
        None,
        "evaluation and samples",
        "the samples' prompt",
        unset=f"{DEFAULT_SAMPLE_PROMPT} on the bundled plays, the end-of-text token on other text",
    )
    sample_tokens: int = setting(
        60, "evaluation and samples", "tokens per sample (>= 0; 0: no samples)"
    )
    tensorboard: bool = setting(
        False,
        "evaluation and samples",
        "also log every metric and the samples for TensorBoard, into OUT/tensorboard/ "
        "(view: tensorboard --logdir OUT)",
    )
    eval_tasks: str | None = setting(
        None,
        "evaluation and samples",
        "lm-evaluation-harness tasks, comma-separated, run on the final weights: the results "
        "JSON into OUT/eval/, the table printed, the metrics into metrics.csv (needs the eval "
        "extra)",
        unset="none",
    )
    eval_tasks_interval: int | None = setting(
        None,
        "evaluation and samples",
        "also run --eval-tasks every N steps: a metrics.csv column per task metric "
        "(eval/TASK/METRIC), drawn beside the loss in loss.png (>= 1)",
        unset="at the end only",
    )
    eval_tasks_limit: float | None = setting(
        None,
        "evaluation and samples",
        "documents per task at most in each run of --eval-tasks, or a fraction of them below 1",
        unset="all",
    )
    eval_tasks_include_path: str | None = setting(
        None,
        "evaluation and samples",
        "a folder of task YAML files of your own for --eval-tasks",
        unset="the harness's tasks only",
    )
    checkpoint_interval: int = setting(
        100, "checkpoints", "save a checkpoint every N steps, and at the end (>= 1)"
    )
    seed: int = setting(
        1337, "data", "seed of the initial weights, the data order and the samples, in [0, 2**63)"
    )
    device: str = setting(
        "auto", "hardware", "auto (cuda, else mps, else cpu) | cpu | cuda | cuda:N | mps"
    )
    compile: bool | None = setting(
        None,
        "hardware",
        "run the model under torch.compile (the first step compiles it: tens of seconds)",
        unset="on with CUDA, off elsewhere",
    )
    # On CPUs with AMX (e.g. Xeon Sapphire Rapids) "bf16" makes a 124M step ~1.7x faster; on
    # small models the casts cost more than they save: auto measures (gptkiln.train.precision).
    precision: Literal["auto", "fp32", "bf16"] = setting(
        "auto",
        "hardware",
        "auto = bf16 autocast on CUDA, and on a CPU with AMX or AVX512-BF16 when a short "
        "measurement of this model's step finds it faster (a resume keeps the run's choice), "
        "fp32 elsewhere; bf16 = autocast on any device (weights and optimizer stay fp32); "
        "fp32 = no autocast",
    )
    parallel: Literal["ddp", "fsdp"] = setting(
        "ddp",
        "hardware",
        "with several processes (--nproc, torchrun): ddp = a whole model each; fsdp = each "
        "holds a shard (FSDP2)",
    )
    progress: bool = setting(True, "evaluation and samples", "show a progress bar")

    def __post_init__(self) -> None:
        check_train_config(self)

    def bpe_sample_bytes(self) -> int | None:
        """What `gptkiln.data.prepare.prepare` takes: the bytes a BPE learns from (None: all)."""
        mb = BPE_SAMPLE_BYTES >> 20 if self.bpe_sample_mb is None else self.bpe_sample_mb
        return mb << 20 if mb else None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        return _from_dict(cls, values, "training config")


def check_train_config(cfg: TrainConfig) -> None:
    """Raise `GptkilnError` for a `TrainConfig` value out of its type or range, or for
    settings that contradict each other; names (preset, tokenizer) first."""
    _check_types(cfg, "training config")
    _check_names(cfg)  # first: a wrong preset or tokenizer fails before data is prepared
    positive = ["batch_size", "grad_accum", "eval_interval", "eval_batches"]
    positive += ["checkpoint_interval"]
    if cfg.sample_interval < 1:
        raise GptkilnError(
            f"sample_interval must be a whole number >= 1, got {cfg.sample_interval!r} "
            "(no samples: sample_tokens 0, --sample-tokens 0)"
        )
    for name in positive:
        _positive_int(name, getattr(cfg, name))
    for name in ("max_steps", "epochs", "warmup_steps", "sample_tokens"):
        value = getattr(cfg, name)
        if value < 0:
            raise GptkilnError(f"{name} must be a whole number >= 0, got {value!r}")
    for name in ("context_length", "stride", "pad_vocab", "n_layer", "n_head", "n_kv_head",
                 "n_embd"):  # fmt: skip
        if getattr(cfg, name) is not None:
            _positive_int(name, getattr(cfg, name))
    if cfg.max_steps == 0 and cfg.epochs == 0:
        raise GptkilnError("set max_steps > 0, or epochs > 0 with sampling 'windows'")
    if cfg.max_steps == 0 and cfg.sampling != "windows":
        raise GptkilnError("epochs need sampling 'windows'; with 'random' set max_steps")
    if cfg.sampling not in ("windows", "random", "aligned"):
        raise GptkilnError(
            f"sampling must be 'windows', 'random' or 'aligned', got {cfg.sampling!r}"
        )
    if cfg.parallel not in ("ddp", "fsdp"):
        raise GptkilnError(f"parallel must be 'ddp' or 'fsdp', got {cfg.parallel!r}")
    if cfg.max_time is not None and not 0 < cfg.max_time < math.inf:
        raise GptkilnError(
            f"max_time must be a number of minutes > 0 (or unset for no time limit), "
            f"got {cfg.max_time!r}"
        )
    if not 0 < cfg.lr < math.inf:
        raise GptkilnError(f"lr must be a finite number > 0, got {cfg.lr!r}")
    _check_seed(cfg.seed)
    if not 0 <= cfg.grad_clip < math.inf:
        raise GptkilnError(
            f"grad_clip must be a finite number >= 0 (0 turns clipping off), got {cfg.grad_clip!r}"
        )
    if not 0 <= cfg.min_lr <= cfg.lr:
        raise GptkilnError(f"min_lr must be in [0, lr={cfg.lr}], got {cfg.min_lr!r}")
    if not 0 <= cfg.weight_decay < math.inf:
        raise GptkilnError(f"weight_decay must be a finite number >= 0, got {cfg.weight_decay!r}")
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(cfg, name) < 1.0:
            raise GptkilnError(
                f"{name} must be in [0, 1) (Adam's moment decay), got {getattr(cfg, name)!r}"
            )
    if not 0.0 < cfg.val_fraction < 1.0:
        raise GptkilnError(f"val_fraction must be in (0, 1), got {cfg.val_fraction!r}")
    _check_recipe(cfg)
    if cfg.dropout is not None and not 0.0 <= cfg.dropout < 1.0:
        raise GptkilnError(f"dropout must be in [0, 1), got {cfg.dropout!r}")
    if cfg.precision not in ("auto", "fp32", "bf16"):
        raise GptkilnError(f"precision must be 'auto', 'fp32' or 'bf16', got {cfg.precision!r}")
    _check_eval_tasks(cfg)
    if cfg.gelu not in (None, "tanh", "exact"):
        raise GptkilnError(f"gelu must be 'tanh' or 'exact', got {cfg.gelu!r}")


def _check_names(cfg: TrainConfig) -> None:
    """The model preset and the tokenizer (and its ``bpe_sample_mb``) by name."""
    from gptkiln.tokenizers import TOKENIZER_KINDS, parse_tokenizer_spec

    if cfg.model not in PRESETS:
        raise GptkilnError(
            f"unknown model preset {cfg.model!r}; choose one of: {', '.join(PRESETS)}"
        )
    if cfg.tokenizer not in TOKENIZER_KINDS and Path(cfg.tokenizer).is_dir():
        raise GptkilnError(
            f"--tokenizer {cfg.tokenizer}: training takes a tokenizer by name (gpt2, char, "
            "bpe:N); to train with the one saved in that folder, prepare the text with it "
            f"first: gptkiln prepare TEXT --tokenizer {cfg.tokenizer} --out DATA, then "
            "gptkiln train --data DATA"
        )
    parse_tokenizer_spec(cfg.tokenizer)
    _check_bpe_sample(cfg)


def _check_bpe_sample(cfg: TrainConfig) -> None:
    """``bpe_sample_mb``: a whole number >= 0, for a ``bpe`` tokenizer trained here."""
    mb = cfg.bpe_sample_mb
    if mb is None:
        return
    if not 0 <= mb < 2**40:
        raise GptkilnError(f"bpe_sample_mb {mb}: the MiB of text a BPE learns from, >= 0 (0: all)")
    if not cfg.tokenizer.startswith("bpe"):
        raise GptkilnError(
            f"bpe_sample_mb is for a bpe tokenizer trained on the text, and tokenizer "
            f"{cfg.tokenizer} trains none; drop it"
        )


def _check_recipe(cfg: TrainConfig) -> None:
    """The optimizer, schedule and model choices of the speedrun recipe."""
    if cfg.optimizer not in ("adamw", "muon"):
        raise GptkilnError(f"optimizer must be 'adamw' or 'muon', got {cfg.optimizer!r}")
    if cfg.schedule not in ("cosine", "wsd"):
        raise GptkilnError(f"schedule must be 'cosine' or 'wsd', got {cfg.schedule!r}")
    if not 0.0 <= cfg.muon_momentum < 1.0:
        raise GptkilnError(f"muon_momentum must be in [0, 1), got {cfg.muon_momentum!r}")
    if cfg.adamw_lr is not None and not 0.0 < cfg.adamw_lr < math.inf:
        raise GptkilnError(f"adamw_lr must be a number > 0, got {cfg.adamw_lr!r}")
    if cfg.embedding_lr is not None and not 0.0 < cfg.embedding_lr < math.inf:
        raise GptkilnError(f"embedding_lr must be a number > 0, got {cfg.embedding_lr!r}")
    if not 0.0 < cfg.cooldown <= 1.0:
        raise GptkilnError(f"cooldown must be in (0, 1], got {cfg.cooldown!r}")
    cap = cfg.logit_softcap
    if cap is not None and not 0 <= cap < math.inf:
        raise GptkilnError(f"logit_softcap must be a number >= 0 (0: no cap), got {cap!r}")


def _check_eval_tasks(cfg: TrainConfig) -> None:
    """The settings of harness tasks while training: each needs ``eval_tasks``."""
    if cfg.eval_tasks is not None and not cfg.eval_tasks.strip(" ,"):
        raise GptkilnError("eval_tasks is empty; name tasks (hellaswag,arc_easy) or leave it out")
    for name in ("eval_tasks_interval", "eval_tasks_limit", "eval_tasks_include_path"):
        if getattr(cfg, name) is not None and cfg.eval_tasks is None:
            flag = "--" + name.replace("_", "-")
            raise GptkilnError(f"{flag} needs --eval-tasks, the tasks to run; add it")
    if cfg.eval_tasks_interval is not None:
        _positive_int("eval_tasks_interval", cfg.eval_tasks_interval)
    limit = cfg.eval_tasks_limit
    if limit is not None and not (0 < limit < math.inf and (limit < 1 or limit.is_integer())):
        raise GptkilnError(
            f"eval_tasks_limit must be a whole number of documents >= 1 or a fraction in "
            f"(0, 1), got {limit!r}"
        )
