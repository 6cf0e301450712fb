"""Fine-tuning settings (`FinetuneConfig`): the base, the data, the task and the layers it
trains; the loop's own settings are a `TrainConfig` (`gptkiln.config.train`).

No torch import here, so the CLI can parse and validate flags before torch loads.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from gptkiln.config.checks import _check_types, _from_dict, _positive_int
from gptkiln.errors import GptkilnError

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
