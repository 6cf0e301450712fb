"""What a fine-tuned run records in its config.json, and reading it back.

``config.json["finetune"]`` holds::

    task          "instruct" | "classify" | "chat" | "dpo"
    config        the `FinetuneConfig` it was trained with (base, data, train_layers, ...)
    data_sha256   a digest of the data file (a resume reads the same data)
    split         entries in train / val / test
    template      instruct: the `PromptTemplate` (what generate, chat and serve format with);
                  chat, dpo: null when the run keeps a chat template (chat_template.jinja, read
                  by `run_template` through `gptkiln.chat_template.load_chat_template`)
    classes       classify: the class names by id
    max_length    classify: the tokens every text is cut or padded to
    pad_id        the id batches are padded with
    lora          a LoRA run: its `LoraSpec` (adapter.safetensors holds the adapters; the
                  base is config.json's "base_weights", `gptkiln.loading.base`)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gptkiln.chat_template import ChatTemplate, load_chat_template
from gptkiln.errors import GptkilnError
from gptkiln.finetune.templates import PromptTemplate
from gptkiln.loading import CONFIG_FILE


def finetune_info(run_cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The ``"finetune"`` entry of a parsed config.json, or None for a run not fine-tuned."""
    info = run_cfg.get("finetune")
    return info if isinstance(info, dict) else None


def run_template(
    run_cfg: dict[str, Any], run_dir: str | os.PathLike
) -> PromptTemplate | ChatTemplate | None:
    """The prompt template an instruction-tuned run was trained with, else the model's own chat
    template (tokenizer_config.json's, `gptkiln.chat_template`); None: it has neither."""
    info = finetune_info(run_cfg)
    if not info or info.get("template") is None:
        return load_chat_template(run_dir) if Path(run_dir).is_dir() else None
    return PromptTemplate.from_dict(info["template"], f"{Path(run_dir) / CONFIG_FILE} template")


def require_template(
    run_cfg: dict[str, Any], run_dir: str | os.PathLike
) -> PromptTemplate | ChatTemplate:
    """`run_template`, refusing a run that was not instruction-tuned."""
    template = run_template(run_cfg, run_dir)
    if template is None:
        raise GptkilnError(
            f"{run_dir} was not instruction-tuned (its config.json has no prompt template, "
            "and it has no chat template); "
            f"fine-tune it first (gptkiln finetune {run_dir} --data INSTRUCTIONS.json --out DIR), "
            "or continue text with gptkiln generate"
        )
    return template


def classifier_info(run_cfg: dict[str, Any], run_dir: str | os.PathLike) -> dict[str, Any]:
    """Classes, max_length and pad_id of a classification run; an error for any other run."""
    info = finetune_info(run_cfg) or {}
    if not info.get("classes"):
        raise GptkilnError(
            f"{run_dir} is not a classifier (its config.json has no classes); fine-tune one with "
            f"gptkiln finetune BASE --task classify --data LABELLED.csv --out DIR"
        )
    return info
