"""Run settings: training (`TrainConfig`, each field a `setting` with its help), sampling
(`SampleConfig`) and fine-tuning (`FinetuneConfig`). The model's own shape is `GPTConfig`
(`gptkiln.config.model`), as litgpt keeps `Config` apart from its `args.py`.

No torch import here, so the CLI can parse and validate flags before torch loads.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from gptkiln.config.checks import _check_seed, _check_types, _from_dict, _positive_int
from gptkiln.config.model import PRESETS
from gptkiln.errors import GptkilnError


@dataclass
class SampleConfig:
    """How to pick each next token, and when a sequence ends.

    temperature 0 means greedy (argmax); top_k keeps the k most likely tokens; top_p keeps the
    smallest set whose probability reaches p (nucleus sampling). ``stop_at_eos`` ends a sequence
    at the tokenizer's end-of-text id; ``stop`` ends it where one of these strings appears in the
    generated text (the text returned stops right before it). ``presence_penalty`` and
    ``frequency_penalty`` are OpenAI's: each logit is lowered by ``frequency_penalty`` times the
    number of times its token was generated so far, and by ``presence_penalty`` once if it was
    generated at all (in [-2, 2]; negative values favour repeats). ``min_p`` drops the tokens
    less likely than ``min_p`` times the likeliest (after temperature, top-k and top-p: Nguyen
    et al. 2024, https://arxiv.org/abs/2407.01082; transformers' ``min_p`` and order; llama.cpp
    applies its temperature last, so its min-p keeps another set at a temperature other than 1).
    ``repetition_penalty`` is CTRL's (Keskar et al. 2019), as transformers and vLLM apply it:
    the logit of every token in the prompt or generated so far divided by it where positive,
    multiplied where negative (> 0; 1 = off; above 1 discourages repeats), before the presence
    and frequency penalties (llama.cpp's ``repeat_penalty`` counts the last 64 tokens only).
    ``skip_special_tokens``: the text leaves out the
    tokenizer's special tokens (a chat template's markers), as vLLM's ``skip_special_tokens``
    and transformers' ``decode(..., skip_special_tokens=True)``; the ids keep them (chat and
    the server's chat answers set it; ``generate`` shows every token, as the book's does).
    ``logit_bias``: OpenAI's, ``(token id, bias)`` pairs (or a dict of them), each bias in
    [-100, 100] added to its token's logit before the draw (-100 all but forbids it).
    """

    max_new_tokens: int = 100
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_at_eos: bool = True
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        _check_types(self, "sampling config")
        if self.top_k == 0:  # off, as transformers reads 0 (a model's own top-k set aside)
            self.top_k = None
        check_sampling(self.temperature, self.top_k, self.top_p, self.min_p)
        if self.seed is not None:
            _check_seed(self.seed)
        if self.max_new_tokens < 0:
            raise GptkilnError(
                f"max_new_tokens must be >= 0, got {self.max_new_tokens}; pass e.g. 100"
            )
        self.stop = check_stop(self.stop)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise GptkilnError(
                    f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}"
                )
        if not 0 < self.repetition_penalty < math.inf:
            raise GptkilnError(
                "repetition_penalty must be a finite number > 0 (1 = off; e.g. 1.1 discourages "
                f"repeats), got {self.repetition_penalty}"
            )

        self.logit_bias = check_logit_bias(self.logit_bias)

    @property
    def penalised(self) -> bool:
        """Whether a token's logit depends on the tokens before it (a penalty is set)."""
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1


MODEL_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
"""The `SampleConfig` fields a model's ``generation_config.json`` may set for it."""


def model_sampling(directory: str | Path) -> dict[str, Any]:
    """The sampling a model directory's ``generation_config.json`` asks for, as transformers
    reads it and vLLM takes it for the requests that do not say (Qwen3: temperature 0.6, top-k
    20, top-p 0.95): ``do_sample`` false is greedy (its repetition penalty still applies, as
    transformers applies it; vLLM reads no ``do_sample``); a setting that changes nothing (top-k 0,
    top-p 1, min-p 0, a repetition penalty of 1) or is no valid value is left out. {} where it
    has no such file."""
    import json

    try:
        config = json.loads((Path(directory) / "generation_config.json").read_text("utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    valid = {
        "temperature": lambda v: 0 <= v,
        "top_k": lambda v: v >= 1 and v == int(v),
        "top_p": lambda v: 0 < v < 1,
        "min_p": lambda v: 0 < v <= 1,
        "repetition_penalty": lambda v: 0 < v < math.inf and v != 1,
    }
    out: dict[str, Any] = {}
    for name, ok in valid.items():
        value = config.get(name)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and math.isfinite(value) and ok(value):
            out[name] = int(value) if name == "top_k" else float(value)
    if config.get("do_sample") is False:  # greedy, as transformers reads it: no draw to shape
        out = {"temperature": 0.0, **{k: v for k, v in out.items() if k == "repetition_penalty"}}
    elif config.get("do_sample") is True:  # sampled: at transformers' temperature 1 if unsaid
        out = {"temperature": 1.0, **out}
    return out


def sampling_said(settings: dict[str, Any], name=lambda field: field) -> str:
    """`model_sampling`'s settings in words, each field written as ``name`` gives it: a
    temperature of 0 is "greedy (do_sample false)", the others "FIELD VALUE"."""
    return ", ".join(
        "greedy (do_sample false)" if (k, v) == ("temperature", 0.0) else f"{name(k)} {v}"
        for k, v in settings.items()
    )


def check_logit_bias(bias: Any) -> tuple[tuple[int, float], ...]:
    """``(token id, bias)`` pairs, sorted by id, from pairs or a dict: ids whole numbers >= 0,
    biases finite numbers in [-100, 100] (OpenAI's range)."""
    pairs = bias.items() if isinstance(bias, dict) else bias
    try:
        pairs = [(i, b) for i, b in pairs]
    except (TypeError, ValueError):
        raise GptkilnError(
            f"logit_bias must map token ids to numbers, e.g. {{50256: -100}}, got {bias!r}"
        ) from None
    out = {}
    for i, b in pairs:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise GptkilnError(f"logit_bias: token id {i!r} is not a whole number >= 0")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise GptkilnError(
                f"logit_bias: the bias of token {i} must be in [-100, 100], got {b!r}"
            )
        out[i] = float(b)
    return tuple(sorted(out.items()))


def check_stop(stop: Any) -> tuple[str, ...]:
    """Stop strings as a tuple: one string or a list of them, each non-empty."""
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise GptkilnError(f"stop must be a list of non-empty strings, got {stop!r}")
    return tuple(stop)


def check_sampling(
    temperature: float, top_k: int | None, top_p: float | None, min_p: float | None = None
) -> None:
    """Raise `GptkilnError` for sampling settings that have no meaning."""
    if not 0 <= temperature < math.inf:
        raise GptkilnError(
            f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}"
        )
    if top_k is not None and top_k < 1:
        raise GptkilnError(f"top_k must be >= 1 (or 0 to keep all tokens), got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise GptkilnError(f"top_p must be in (0, 1] (1 keeps all tokens), got {top_p}")
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        raise GptkilnError(f"min_p must be in [0, 1] (0 keeps all tokens; e.g. 0.05), got {min_p}")


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
        _check_types(self, "training config")
        # Names first: a wrong preset or tokenizer must fail before any data is prepared.
        from gptkiln.tokenizers import TOKENIZER_KINDS, parse_tokenizer_spec

        if self.model not in PRESETS:
            raise GptkilnError(
                f"unknown model preset {self.model!r}; choose one of: {', '.join(PRESETS)}"
            )
        if self.tokenizer not in TOKENIZER_KINDS and Path(self.tokenizer).is_dir():
            raise GptkilnError(
                f"--tokenizer {self.tokenizer}: training takes a tokenizer by name (gpt2, char, "
                "bpe:N); to train with the one saved in that folder, prepare the text with it "
                f"first: gptkiln prepare TEXT --tokenizer {self.tokenizer} --out DATA, then "
                "gptkiln train --data DATA"
            )
        parse_tokenizer_spec(self.tokenizer)
        self._check_bpe_sample()
        positive = ["batch_size", "grad_accum", "eval_interval", "eval_batches"]
        positive += ["checkpoint_interval"]
        if self.sample_interval < 1:
            raise GptkilnError(
                f"sample_interval must be a whole number >= 1, got {self.sample_interval!r} "
                "(no samples: sample_tokens 0, --sample-tokens 0)"
            )
        for name in positive:
            _positive_int(name, getattr(self, name))
        for name in ("max_steps", "epochs", "warmup_steps", "sample_tokens"):
            value = getattr(self, name)
            if value < 0:
                raise GptkilnError(f"{name} must be a whole number >= 0, got {value!r}")
        for name in ("context_length", "stride", "pad_vocab", "n_layer", "n_head", "n_kv_head",
                     "n_embd"):  # fmt: skip
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.max_steps == 0 and self.epochs == 0:
            raise GptkilnError("set max_steps > 0, or epochs > 0 with sampling 'windows'")
        if self.max_steps == 0 and self.sampling != "windows":
            raise GptkilnError("epochs need sampling 'windows'; with 'random' set max_steps")
        if self.sampling not in ("windows", "random", "aligned"):
            raise GptkilnError(
                f"sampling must be 'windows', 'random' or 'aligned', got {self.sampling!r}"
            )
        if self.parallel not in ("ddp", "fsdp"):
            raise GptkilnError(f"parallel must be 'ddp' or 'fsdp', got {self.parallel!r}")
        if self.max_time is not None and not 0 < self.max_time < math.inf:
            raise GptkilnError(
                f"max_time must be a number of minutes > 0 (or unset for no time limit), "
                f"got {self.max_time!r}"
            )
        if not 0 < self.lr < math.inf:
            raise GptkilnError(f"lr must be a finite number > 0, got {self.lr!r}")
        _check_seed(self.seed)
        if not 0 <= self.grad_clip < math.inf:
            raise GptkilnError(
                f"grad_clip must be a finite number >= 0 (0 turns clipping off), "
                f"got {self.grad_clip!r}"
            )
        if not 0 <= self.min_lr <= self.lr:
            raise GptkilnError(f"min_lr must be in [0, lr={self.lr}], got {self.min_lr!r}")
        if not 0 <= self.weight_decay < math.inf:
            raise GptkilnError(
                f"weight_decay must be a finite number >= 0, got {self.weight_decay!r}"
            )
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise GptkilnError(
                    f"{name} must be in [0, 1) (Adam's moment decay), got {getattr(self, name)!r}"
                )
        if not 0.0 < self.val_fraction < 1.0:
            raise GptkilnError(f"val_fraction must be in (0, 1), got {self.val_fraction!r}")
        self._check_recipe()
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise GptkilnError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise GptkilnError(
                f"precision must be 'auto', 'fp32' or 'bf16', got {self.precision!r}"
            )
        self._check_eval_tasks()
        if self.gelu not in (None, "tanh", "exact"):
            raise GptkilnError(f"gelu must be 'tanh' or 'exact', got {self.gelu!r}")

    def _check_bpe_sample(self) -> None:
        """``bpe_sample_mb``: a whole number >= 0, for a ``bpe`` tokenizer trained here."""
        mb = self.bpe_sample_mb
        if mb is None:
            return
        if not 0 <= mb < 2**40:
            raise GptkilnError(
                f"bpe_sample_mb {mb}: the MiB of text a BPE learns from, >= 0 (0: all)"
            )
        if not self.tokenizer.startswith("bpe"):
            raise GptkilnError(
                f"bpe_sample_mb is for a bpe tokenizer trained on the text, and tokenizer "
                f"{self.tokenizer} trains none; drop it"
            )

    def bpe_sample_bytes(self) -> int | None:
        """What `gptkiln.data.prepare.prepare` takes: the bytes a BPE learns from (None: all)."""
        mb = BPE_SAMPLE_BYTES >> 20 if self.bpe_sample_mb is None else self.bpe_sample_mb
        return mb << 20 if mb else None

    def _check_recipe(self) -> None:
        """The optimizer, schedule and model choices of the speedrun recipe."""
        if self.optimizer not in ("adamw", "muon"):
            raise GptkilnError(f"optimizer must be 'adamw' or 'muon', got {self.optimizer!r}")
        if self.schedule not in ("cosine", "wsd"):
            raise GptkilnError(f"schedule must be 'cosine' or 'wsd', got {self.schedule!r}")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise GptkilnError(f"muon_momentum must be in [0, 1), got {self.muon_momentum!r}")
        if self.adamw_lr is not None and not 0.0 < self.adamw_lr < math.inf:
            raise GptkilnError(f"adamw_lr must be a number > 0, got {self.adamw_lr!r}")
        if self.embedding_lr is not None and not 0.0 < self.embedding_lr < math.inf:
            raise GptkilnError(f"embedding_lr must be a number > 0, got {self.embedding_lr!r}")
        if not 0.0 < self.cooldown <= 1.0:
            raise GptkilnError(f"cooldown must be in (0, 1], got {self.cooldown!r}")
        cap = self.logit_softcap
        if cap is not None and not 0 <= cap < math.inf:
            raise GptkilnError(f"logit_softcap must be a number >= 0 (0: no cap), got {cap!r}")

    def _check_eval_tasks(self) -> None:
        """The settings of harness tasks while training: each needs ``eval_tasks``."""
        if self.eval_tasks is not None and not self.eval_tasks.strip(" ,"):
            raise GptkilnError(
                "eval_tasks is empty; name tasks (hellaswag,arc_easy) or leave it out"
            )
        for name in ("eval_tasks_interval", "eval_tasks_limit", "eval_tasks_include_path"):
            if getattr(self, name) is not None and self.eval_tasks is None:
                flag = "--" + name.replace("_", "-")
                raise GptkilnError(f"{flag} needs --eval-tasks, the tasks to run; add it")
        if self.eval_tasks_interval is not None:
            _positive_int("eval_tasks_interval", self.eval_tasks_interval)
        limit = self.eval_tasks_limit
        if limit is not None and not (0 < limit < math.inf and (limit < 1 or limit.is_integer())):
            raise GptkilnError(
                f"eval_tasks_limit must be a whole number of documents >= 1 or a fraction in "
                f"(0, 1), got {limit!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        return _from_dict(cls, values, "training config")


FINETUNE_TASKS = ("instruct", "classify", "chat", "dpo")
# Per task: (val_fraction, test_fraction, train_layers): the book's chapters 7 and 6 (chat and
# DPO split as instruct does).
FINETUNE_DEFAULTS = {
    "instruct": (0.05, 0.1, "all"),
    "classify": (0.1, 0.2, "last-1"),
    "chat": (0.05, 0.1, "all"),
    "dpo": (0.05, 0.1, "all"),
}
DPO_LOSSES = ("sigmoid", "ipo")
TASK_FIELDS = (
    ("mask_prompt", False, ("instruct",)),
    ("text_column", "text", ("classify",)),
    ("label_column", "label", ("classify",)),
    ("max_length", None, ("classify", "chat", "dpo")),
    ("template", "alpaca", ("instruct", "chat", "dpo")),
    ("beta", 0.1, ("dpo",)),
    ("dpo_loss", "sigmoid", ("dpo",)),
)
"""FinetuneConfig's fields that only some tasks read: (name, default, those tasks)."""


def read_fields(values: dict[str, Any]) -> dict[str, Any]:
    """A saved fine-tuning config's values with those its task (or, without LoRA, LoRA) never
    read set to their defaults: what a resume compares (a run saved before such settings were
    refused may hold one)."""
    out = dict(values)
    for name, default, tasks in TASK_FIELDS:
        if out.get("task", "instruct") not in tasks:
            out[name] = default
    if out.get("train_layers") != "lora":
        out["lora_alpha"], out["lora_qkv"] = None, "split"
    return out


@dataclass
class FinetuneConfig:
    """What a fine-tuning run starts from, learns and trains; the loop's own settings (steps,
    learning rate, evaluation, ...) are a `TrainConfig`.

    Tasks: ``"instruct"`` (the book's chapter 7: instruction entries in a prompt template,
    next-token loss on the whole example or, with ``mask_prompt``, on the response alone) and
    ``"classify"`` (chapter 6: texts with labels, a new head on the last position); ``"chat"``
    (conversations in the model's chat template, loss on the assistant's turns) and ``"dpo"``
    (preference pairs, Direct Preference Optimization with ``beta`` and ``dpo_loss``). With
    ``pack`` (instruct, chat), training examples are packed end to end into windows, none
    attending another (`gptkiln.finetune.packing`).

    ``train_layers``: ``"all"``; ``"last-N"``, the last N blocks, the final norm and the head
    (the rest frozen); or ``"lora"``, LoRA adapters of ``lora_rank`` on the linear layers (base
    frozen; see `gptkiln.finetune.lora`). ``"default"`` is the task's: all (instruct), last-1
    (classify); a ``lora_rank`` > 0 means ``"lora"``. Fractions left as None are the task's:
    0.05 / 0.1 of the entries for validation / test (instruct, in the book's order: train, test,
    val), 0.1 / 0.2 after a seeded shuffle (classify: train, val, test).
    """

    base: str  # a run directory, or a Hugging Face GPT-2 / Llama 3 / Qwen3 directory
    data: str  # .json / .jsonl; classify: .csv / .tsv too; chat, dpo: .parquet and hf: too
    task: Literal["instruct", "classify", "chat", "dpo"] = "instruct"
    template: str = "alpaca"  # instruct: a bundled name or a JSON file; chat, dpo: a .jinja file
    mask_prompt: bool = False  # instruct: no loss on the prompt's tokens
    text_column: str = "text"  # classify
    label_column: str = "label"  # classify
    max_length: int | None = None  # classify: tokens a text is cut / padded to; chat, dpo: the
    # longest example in tokens (longer ones are cut at a turn boundary or dropped); None: context
    val_fraction: float | None = None
    test_fraction: float | None = None
    train_layers: str = "default"
    lora_rank: int | None = None  # None: unset (16 with train_layers "lora"); 0: no LoRA
    lora_alpha: float | None = None  # None = 2 x lora_rank
    lora_qkv: Literal["split", "fused"] = "split"
    lora_head: bool = False
    beta: float = 0.1  # dpo: the strength of the pull towards the reference model
    dpo_loss: Literal["sigmoid", "ipo"] = "sigmoid"
    pack: bool = False  # instruct, chat: short training examples packed into one window each

    def __post_init__(self) -> None:
        _check_types(self, "fine-tuning config")
        if self.task not in FINETUNE_TASKS:
            raise GptkilnError(
                f"task must be one of {', '.join(FINETUNE_TASKS)}, got {self.task!r}"
            )
        val, test, layers = FINETUNE_DEFAULTS[self.task]
        self.val_fraction = val if self.val_fraction is None else self.val_fraction
        self.test_fraction = test if self.test_fraction is None else self.test_fraction
        if not 0 < self.val_fraction < 1 or not 0 <= self.test_fraction < 1:
            raise GptkilnError(
                f"val_fraction must be in (0, 1) and test_fraction in [0, 1), got "
                f"{self.val_fraction!r} and {self.test_fraction!r}"
            )
        if self.val_fraction + self.test_fraction >= 1:
            raise GptkilnError(
                f"val_fraction + test_fraction must leave entries to train on, got "
                f"{self.val_fraction} + {self.test_fraction}"
            )
        if self.lora_rank is not None and self.lora_rank < 0:
            raise GptkilnError(f"lora_rank must be >= 0 (0: no LoRA), got {self.lora_rank}")
        if self.lora_rank == 0 and self.train_layers == "lora":
            raise GptkilnError(
                "--lora-rank 0 means no LoRA, but --train-layers lora trains LoRA adapters; "
                "give a rank >= 1, or leave --lora-rank out for 16"
            )
        if self.lora_rank and self.train_layers not in ("default", "lora"):
            raise GptkilnError(
                f"--lora-rank {self.lora_rank} trains LoRA adapters, but --train-layers "
                f"{self.train_layers} asks for other layers; drop one of them"
            )
        if self.train_layers == "default":
            self.train_layers = "lora" if self.lora_rank else layers
        if self.train_layers == "lora" and not self.lora_rank:
            self.lora_rank = 16
        self.lora_rank = self.lora_rank or 0  # stored as a number: 0 without LoRA
        if self.lora_alpha is None and self.train_layers == "lora":
            self.lora_alpha = 2.0 * self.lora_rank
        if self.train_layers not in ("all", "lora") and not re.fullmatch(
            r"last-[1-9]\d*", self.train_layers
        ):
            raise GptkilnError(
                f"train_layers must be all, last-N (N >= 1) or lora, got {self.train_layers!r}"
            )
        if self.lora_alpha is not None and not 0 < self.lora_alpha < math.inf:
            raise GptkilnError(f"lora_alpha must be a number > 0, got {self.lora_alpha!r}")
        if self.lora_qkv not in ("split", "fused"):
            raise GptkilnError(f"lora_qkv must be 'split' or 'fused', got {self.lora_qkv!r}")
        if self.max_length is not None:
            _positive_int("max_length", self.max_length)
        if self.lora_head and self.train_layers != "lora":
            raise GptkilnError("--lora-head puts an adapter on the head: it needs --lora-rank")
        if not 0 < self.beta < math.inf:
            raise GptkilnError(f"beta must be a number > 0, got {self.beta!r}")
        if self.pack and self.task not in ("instruct", "chat"):
            raise GptkilnError(
                f"--pack packs instruct or chat examples into windows; --task {self.task} "
                "trains on whole rows of its own (drop --pack)"
            )
        if self.dpo_loss not in DPO_LOSSES:
            raise GptkilnError(
                f"dpo_loss must be one of {', '.join(DPO_LOSSES)}, got {self.dpo_loss!r}"
            )
        self._check_task_fields()

    def _check_task_fields(self) -> None:
        """A setting that only other tasks (or LoRA) read is refused, not ignored."""
        for name, default, tasks in TASK_FIELDS:
            if getattr(self, name) != default and self.task not in tasks:
                flag = "--" + name.replace("_", "-")
                raise GptkilnError(
                    f"{flag} is for --task {' or '.join(tasks)}; --task {self.task} does not "
                    "read it (drop it)"
                )
        if not self.lora:
            for name, flag, unset in (("lora_alpha", "--lora-alpha", None),
                                      ("lora_qkv", "--lora-qkv", "split")):  # fmt: skip
                if getattr(self, name) != unset:
                    raise GptkilnError(f"{flag} shapes LoRA adapters: it needs --lora-rank")

    @property
    def lora(self) -> bool:
        return self.train_layers == "lora"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> FinetuneConfig:
        return _from_dict(cls, values, "fine-tuning config")
