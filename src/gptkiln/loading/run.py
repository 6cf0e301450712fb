"""A gptkiln run directory, as `gptkiln.checkpoint` writes it: config.json with ``"format"`` and
``"model"`` (a `GPTConfig`), model.safetensors (memory-mapped), the tokenizer's files.

A **quantized run** also records ``"quantization"`` in config.json (`gptkiln.quantize`) and
stores int8 weights with their scales; it is written as format 2, so that a gptkiln older than
quantization refuses it in one line. The entries the features write into config.json
(``"train"``, ``"finetune"``, ...) are theirs: those that change the model the weights build are
completed by the features' load steps (`gptkiln.load_steps`), which `gptkiln.loading.load`
runs on the model built from what this module reads. A run that records ``"base_weights"`` (a
LoRA run) keeps its weights by reference to another directory (`gptkiln.loading.base`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gptkiln.config import GPTConfig
from gptkiln.errors import GptkilnError
from gptkiln.loading.build import StoredModel
from gptkiln.loading.files import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    read_safetensors,
    read_safetensors_header,
)
from gptkiln.quantize import read_quantization

FORMAT = 2  # the newest config.json format gptkiln reads
FLOAT_FORMAT = 1  # what a run of float weights is written as (any gptkiln reads it)
QUANTIZED_FORMAT = 2  # a quantized run: a gptkiln older than quantization refuses it in one line


def read(
    run_dir: Path, cfg: dict[str, Any], weights: Path | None = None, *, headers_only: bool = False
) -> StoredModel:
    """The config and weights of a run (``cfg``: its parsed config.json; ``weights``: a weights
    file given explicitly, else model.safetensors), memory-mapped, or as meta tensors from the
    file's header with ``headers_only``."""
    config = run_model_config(cfg, run_dir / CONFIG_FILE)
    quantization = read_quantization(cfg.get("quantization"), str(run_dir / CONFIG_FILE))
    weights = run_weights(run_dir, weights)
    sd = read_safetensors_header(weights) if headers_only else read_safetensors(weights)
    return StoredModel(config, sd, str(weights), [weights], quantization, run_config=cfg)


def run_model_config(cfg: dict[str, Any], path: Path) -> GPTConfig:
    """The GPTConfig recorded in a gptkiln config.json."""
    fmt = cfg.get("format")
    if not isinstance(cfg.get("model"), dict) or fmt is None:
        raise GptkilnError(
            f"{path} is not a gptkiln config (no 'format'/'model' keys); give a "
            f"run directory from `gptkiln train` or `gptkiln convert`"
        )
    if not isinstance(fmt, int) or isinstance(fmt, bool):
        raise GptkilnError(
            f"{path} has format {fmt!r}, not a format number gptkiln writes; restore the file"
        )
    if fmt > FORMAT:
        raise GptkilnError(
            f"{path} has format {fmt!r}, newer than this gptkiln reads ({FORMAT}); upgrade gptkiln"
        )
    return GPTConfig.from_dict(cfg["model"])


def run_weights(run_dir: Path, weights: Path | None = None) -> Path:
    """The weights file of a run (``weights`` when one was given), which must exist."""
    weights = weights or run_dir / WEIGHTS_FILE
    if not weights.is_file():
        raise GptkilnError(
            f"{run_dir} is not a complete run directory ({weights.name} is "
            f"missing); re-run `gptkiln train --out {run_dir}` or restore the file"
        )
    return weights


def tokenizer_name(run_dir: Path, cfg: dict[str, Any]) -> str | None:
    """The kind of tokenizer the run uses ("gpt2", "char", "bpe"), None when it records none:
    config.json's ``"tokenizer"``, else tokenizer_meta.json's kind, else the training
    settings'."""
    name = cfg.get("tokenizer")
    meta = run_dir / "tokenizer_meta.json"
    if not name and meta.is_file():
        try:
            name = json.loads(meta.read_text(encoding="utf-8")).get("kind")
        except (ValueError, AttributeError):
            name = None
    if not name:
        name = (cfg.get("train") or {}).get("tokenizer")
    return name if isinstance(name, str) else None


def has_tokenizer_files(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a tokenizer's files: gptkiln's (tokenizer_meta.json) or a
    Hugging Face tokenizer's."""
    from gptkiln.tokenizers import is_hf_tokenizer_dir

    return (run_dir / "tokenizer_meta.json").exists() or is_hf_tokenizer_dir(run_dir)


def tokenizer_source(run_dir: Path, cfg: dict[str, Any]) -> str:
    """What `gptkiln.tokenizers.load_tokenizer` loads the run's tokenizer from: its files (its
    own, or a Hugging Face tokenizer.json it keeps). A run saved without any (``save_model(model,
    dir)`` with no tokenizer) is one line saying how to give it one."""
    if not has_tokenizer_files(run_dir):
        raise GptkilnError(
            f"{run_dir} holds a model saved without its tokenizer (no tokenizer_meta.json or "
            "tokenizer.json); give it the tokenizer its ids are of: a Hugging Face model's "
            "tokenizer.json and tokenizer_config.json copied in from its repository, or "
            "tokenizer.save(dir) (load_tokenizer('gpt2').save(dir) for GPT-2's own BPE); or "
            "load the model alone (load_model)"
        )
    return str(run_dir)
