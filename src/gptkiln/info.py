"""`gptkiln info`: what a run directory (or a Hugging Face model directory) holds, from its
files' headers, without loading the weights (`run_info`; also `gptkiln.api.run_info`).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from gptkiln.errors import GptkilnError


@dataclass
class RunInfo:
    """What a run directory (or a Hugging Face model directory) holds; see `run_info`.

    Attributes:
        path: the directory.
        kind: ``"run"`` (gptkiln's) or ``"huggingface"``.
        preset: the model preset it was trained from, or (without training settings) the one
            whose shape it has; None when neither.
        preset_changes: the model settings that differ from that preset's (the vocabulary
            follows the tokenizer and is not one), e.g. ``{"context_length": 32}``.
        model: the model config (`GPTConfig` fields).
        parameters: parameters stored (a tied head counts once; a quantized run's scales are
            not parameters).
        tokenizer: the tokenizer's kind (gpt2, char, bpe); None when the run records none.
        vocab_size: the model's vocabulary.
        data: the training data: ``source``, and where its prepared tokens are known
            ``train_tokens``, ``val_tokens``, ``prepared`` (the folder); None when not trained.
        steps_done, steps_total: optimizer steps of the checkpoint, and of the whole run.
        tokens_seen: training tokens read up to the checkpoint.
        best_val, last_val: ``{"step", "loss", "perplexity"}`` of the lowest and the last
            validation loss in metrics.csv; None without one.
        files: bytes on disk of the weights files and the trainer state, by file name.
        resumable: whether ``gptkiln train --resume`` can continue it.
        resume_note: why it can or cannot.
        history: what is known of its training, in words, when nothing is.
        quantization: what a quantized run's config.json records (``method``, ``scheme``,
            ``embedding_and_head``); None for float weights.
        decodes_at: the precision `generate`, `chat` and `serve` decode at on a CPU unless
            ``--precision`` says otherwise: its weights' own (int8, bf16 or fp32).
    """

    path: str
    kind: str
    preset: str | None
    preset_changes: dict[str, Any]
    model: dict[str, Any]
    parameters: int
    tokenizer: str | None
    vocab_size: int
    data: dict[str, Any] | None
    steps_done: int | None
    steps_total: int | None
    tokens_seen: int | None
    best_val: dict[str, float] | None
    last_val: dict[str, float] | None
    files: dict[str, int]
    resumable: bool
    resume_note: str
    history: str | None
    quantization: dict[str, Any] | None = None
    exports: str | None = None  # what `gptkiln convert` can write it as
    decodes_at: str = "fp32"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def _int8(self) -> str:
        q = self.quantization
        if q is None:
            return ""
        float_head = "" if q["embedding_and_head"] else ", the head and embedding float"
        return f", {q['method']} weights ({q['scheme']}{float_head})"

    def summary(self) -> str:
        """The information as a few aligned lines, for a person."""
        m = self.model
        family = m.get("family", "gpt2")
        kv = m.get("n_kv_head")
        heads = f"{m['n_head']} heads" + (f" ({kv} key/value)" if kv and kv != m["n_head"] else "")
        shape = (
            f"{'' if family == 'gpt2' else family + ', '}{m['n_layer']} layers, {heads}, "
            f"{m['n_embd']} wide, context {m['context_length']}, vocabulary {m['vocab_size']:,}"
        )
        if m.get("padded_vocab_size"):  # the parameters count the embedding's and head's rows
            shape += f" in {m['padded_vocab_size']:,} rows (padded)"
        changes = ", ".join(
            f"{k} {v}" for k, v in self.preset_changes.items() if k != "padded_vocab_size"
        )
        preset = (
            f"{self.preset} preset{f' ({changes})' if changes else ''}: " if self.preset else ""
        )
        what = "a gptkiln run" if self.kind == "run" else "a Hugging Face model directory"
        lines = [
            f"{self.path}: {what}",
            ("model", f"{preset}{shape}; {self.parameters:,} parameters{self._int8()}"),
            ("tokenizer", f"{self.tokenizer or 'none saved with it'}, {self.vocab_size:,} ids"),
        ]
        if self.history:
            lines.append(("training", self.history))
        if self.data:
            tokens = ""
            if self.data.get("train_tokens") is not None:
                tokens = (
                    f": {self.data['train_tokens']:,} train and {self.data['val_tokens']:,} val "
                    f"tokens (prepared in {self.data['prepared']})"
                )
            lines.append(("data", f"{self.data['source']}{tokens}"))
        if self.steps_done is not None:
            total = f" of {self.steps_total:,}" if self.steps_total is not None else ""
            lines.append(("steps", f"{self.steps_done:,}{total}"))
        if self.tokens_seen is not None:
            lines.append(("tokens seen", f"{self.tokens_seen:,}"))
        for name, val in (("best val loss", self.best_val), ("last val loss", self.last_val)):
            if val:
                lines.append(
                    (
                        name,
                        f"{val['loss']:.4f} (perplexity {val['perplexity']:.2f}) at step "
                        f"{val['step']:,}",
                    )  # fmt: skip
                )
        sizes = ", ".join(f"{name} {_size(n)}" for name, n in self.files.items())
        lines.append(("checkpoint", sizes))
        lines.append(("resumable", f"{'yes' if self.resumable else 'no'}: {self.resume_note}"))
        if self.exports:
            lines.append(("exports to", self.exports))
        lines.append(("decodes at", f"{self.decodes_at} on a CPU (--precision fp32, bf16, int8)"))
        width = max(len(line[0]) for line in lines[1:])
        return "\n".join(
            line if isinstance(line, str) else f"  {line[0]:<{width}}  {line[1]}" for line in lines
        )


def _exports(config: Any, tokenizer: str | None) -> str:
    """What ``gptkiln convert`` can write a run as: Hugging Face always (a classifier not); GGUF
    with a tokenizer (a char vocabulary where it has a newline: `gptkiln.export.gguf_vocab`)."""
    if config.num_classes:
        return "nothing: a classifier (convert writes language models)"
    hf = "Hugging Face (convert to-hf)"
    if tokenizer is None:
        return f"{hf}; not GGUF: it records no tokenizer"
    return f"{hf}, GGUF + Ollama Modelfile (convert to-gguf)"


def _size(n: int) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:,} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError  # the loop returns


def run_info(path: str | os.PathLike) -> RunInfo:
    """What a run directory, or a Hugging Face model directory, holds, read without loading
    its weights: the model (preset, shape, parameters) from config.json and the weights files'
    headers (checked against each other as a load checks them), the tokenizer, the training
    data (the run's config and its prepared data's meta.json), steps and tokens seen (the trainer
    state, memory-mapped), the best and last validation loss (metrics.csv), file sizes, and
    whether it can be resumed (a trainer state that matches the weights' step).
    """
    from gptkiln.checkpoint import ADAPTER_FILE, PREVIOUS_STATE_FILE, TRAINER_STATE_FILE
    from gptkiln.loading import describe_weights, read_config, tokenizer_name
    from gptkiln.loading.run import has_tokenizer_files
    from gptkiln.quantize import read_quantization

    run_dir = Path(path)
    cfg = read_config(run_dir)
    config, sd, weights_files = describe_weights(run_dir)
    hf = "model_type" in cfg
    quantization = None if hf else read_quantization(cfg.get("quantization"), str(run_dir))
    scales = {f"{n[: -len('.weight')]}.scale" for n, t in sd.items() if t.dtype == torch.int8}
    train = cfg.get("train") if isinstance(cfg.get("train"), dict) else None
    # a LoRA run's base is another directory's (config.json's base_weights): named so
    files = {
        (
            f.name if f.parent.resolve() == run_dir.resolve() else f"base's {f.name}"
        ): f.stat().st_size
        for f in weights_files
    }
    states = [run_dir / n for n in (ADAPTER_FILE, TRAINER_STATE_FILE, PREVIOUS_STATE_FILE)]
    files.update({f.name: f.stat().st_size for f in states if f.is_file()})
    preset, changes = _preset_of(config, _model_train_settings(cfg))
    kind = tokenizer_name(run_dir)
    if not hf and not has_tokenizer_files(run_dir):
        kind = None  # recorded, but its files gone: every loading command refuses the run
    info = dict(
        path=str(run_dir),
        kind="huggingface" if hf else "run",
        preset=preset,
        preset_changes=changes,
        model=config.to_dict(),
        parameters=sum(t.numel() for name, t in sd.items() if name not in scales),
        tokenizer=kind,
        vocab_size=config.vocab_size,
        data=None if hf or train is None else _data_of(run_dir, train),
        steps_done=None,
        steps_total=None,
        tokens_seen=None,
        best_val=None,
        last_val=None,
        files=files,
        resumable=False,
        history=None,
        quantization=quantization,
        exports=_exports(config, kind),
        decodes_at=(
            "int8"
            if scales
            else "bf16"
            if any(t.dtype == torch.bfloat16 and t.dim() == 2 for t in sd.values())
            else "fp32"
        ),  # fmt: skip
    )
    if hf:
        info["history"] = "none: an imported Hugging Face model has no training history"
        info["resume_note"] = "it has no trainer state; train it further as a new run"
    else:
        info.update(_training_history(run_dir, weights_files[0], train))
    return RunInfo(**info)


def _training_history(run_dir: Path, weights: Path, train: dict | None) -> dict[str, Any]:
    """`run_info`'s entries of a run's training: steps done and planned, tokens seen, the best
    and last validation loss, and whether it resumes (a trainer state that matches the step of
    ``weights``, or of a LoRA run's adapters)."""
    from gptkiln.checkpoint import ADAPTER_FILE, matching_trainer_state
    from gptkiln.loading import safetensors_metadata
    from gptkiln.run_guard import RunLock

    info: dict[str, Any] = dict(steps_done=None, steps_total=None, tokens_seen=None)
    # a LoRA run's step is its adapters' (its base's weights are another's, or none's)
    adapters = run_dir / ADAPTER_FILE
    stepped = adapters if adapters.is_file() else weights
    weights_step = safetensors_metadata(stepped).get("step")
    try:
        state, why = matching_trainer_state(run_dir, weights_step, mmap=True, weights=stepped)
    except GptkilnError as e:  # a truncated or corrupt trainer state
        state, why = None, str(e).split(";")[0]
    info["resumable"], info["resume_note"] = state is not None, why
    training = RunLock.held(run_dir)
    if training:  # its checkpoint is the last one saved; more are coming
        info["resume_note"] = (
            f"{why}; it is training now (a gptkiln train or finetune holds it): --resume is "
            "refused until that run ends"
        )
    if state is not None:
        info["steps_done"] = int(state["step"])
        info["steps_total"] = (state.get("scheduler") or {}).get("total_steps")
        info["tokens_seen"] = state.get("tokens")
    elif weights_step is not None and weights_step.isdigit():
        info["steps_done"] = int(weights_step)
    if info["steps_total"] is None and train and train.get("max_steps"):
        info["steps_total"] = train["max_steps"]
    # Stopped, a run's rows past its checkpoint are of weights no longer there (a resume drops
    # them); training, its evaluations run ahead of its checkpoints.
    until = None if training else info["steps_done"]
    info["best_val"], info["last_val"] = _val_losses(run_dir / "metrics.csv", until)
    if train is None and info["steps_done"] is None:
        info["history"] = (
            "none recorded: a model saved for inference (e.g. by gptkiln convert), without "
            "its training settings, trainer state or metrics"
        )
    return info


def _model_train_settings(cfg: dict, depth: int = 0) -> dict | None:
    """The training settings that made a run's model: its own, or a fine-tune's base's (its own
    are the loop's, whose ``model`` is a default), followed up a chain of fine-tunes; None
    where they cannot be read (a base moved away, a Hugging Face base)."""
    info = cfg.get("finetune")
    if not info:
        return cfg.get("train") if isinstance(cfg.get("train"), dict) else None
    from gptkiln.loading import read_config

    base = info.get("base") if isinstance(info, dict) else None
    if not base or depth > 8:
        return None
    try:
        base_cfg = read_config(base)
    except GptkilnError:
        return None
    return None if "model_type" in base_cfg else _model_train_settings(base_cfg, depth + 1)


def _preset_of(config: Any, train: dict | None) -> tuple[str | None, dict[str, Any]]:
    """(the preset a run was trained from, the model settings it changed); for a model without
    training settings, (the preset whose shape it has, {}); (None, {}) when neither."""
    from gptkiln.config import PRESETS, GPTConfig

    values = config.to_dict()
    name = (train or {}).get("model")
    if name in PRESETS:  # the vocabulary always follows the tokenizer
        base = GPTConfig.from_name(name, vocab_size=config.vocab_size).to_dict()
        return name, {k: v for k, v in values.items() if base[k] != v}
    for name, preset in PRESETS.items():  # dropout and init shape nothing a model holds
        if all(values[k] == v for k, v in preset.items() if k not in ("dropout", "init")):
            return name, {}
    return None, {}


def _data_of(run_dir: Path, train: dict) -> dict[str, Any]:
    """The training data of a run: its source, and its prepared tokens where meta.json is."""
    from gptkiln.data.prepare import is_prepared, read_meta
    from gptkiln.data.sources import DEFAULT_SOURCE

    source = train.get("data")
    prepared = Path(source) if source and is_prepared(source) else run_dir / "data"
    meta = read_meta(prepared)
    if meta is None:
        return {"source": source or DEFAULT_SOURCE, "train_tokens": None, "val_tokens": None,
                "prepared": None}  # fmt: skip
    return {
        "source": meta.get("source") or source or DEFAULT_SOURCE,
        "train_tokens": meta.get("train_tokens"),
        "val_tokens": meta.get("val_tokens"),
        "prepared": str(prepared),
    }


def _val_losses(metrics: Path, until: int | None = None) -> tuple[dict | None, dict | None]:
    """The lowest and the last validation loss of a metrics.csv, of its rows up to step
    ``until`` where given (None, None without any)."""
    from gptkiln.train import read_metrics

    if not metrics.is_file():
        return None, None
    rows = [
        r for r in read_metrics(metrics)
        if r.get("val_loss") is not None and r.get("step") is not None
        and (until is None or int(r["step"]) <= until)
    ]  # fmt: skip
    if not rows:
        return None, None

    def point(row: dict) -> dict:
        loss = row["val_loss"]
        return {"step": int(row["step"]), "loss": loss, "perplexity": math.exp(min(loss, 50))}

    return point(min(rows, key=lambda r: r["val_loss"])), point(rows[-1])
