"""Typed configuration: the model (`GPTConfig`, the families and the presets, in
`gptkiln.config.model`) apart from run settings: training (`TrainConfig`, in
`gptkiln.config.train`), sampling (`SampleConfig`, in `gptkiln.config.sample`) and fine-tuning
(`FinetuneConfig`, in `gptkiln.config.finetune`); `gptkiln.config.checks` holds the type checks
they share.

No torch import here, so the CLI can parse and validate flags before torch loads.
"""

from gptkiln.config.checks import check_values
from gptkiln.config.finetune import FINETUNE_DEFAULTS, FINETUNE_TASKS, FinetuneConfig
from gptkiln.config.model import (
    FAMILIES,
    GPT2_VOCAB_SIZE,
    PRESETS,
    ROPE_SCALING_KEYS,
    GPTConfig,
)
from gptkiln.config.sample import SampleConfig, check_sampling, check_stop
from gptkiln.config.train import TRAIN_GROUPS, TrainConfig, setting

__all__ = [
    "FAMILIES",
    "FINETUNE_DEFAULTS",
    "FINETUNE_TASKS",
    "GPT2_VOCAB_SIZE",
    "PRESETS",
    "ROPE_SCALING_KEYS",
    "TRAIN_GROUPS",
    "FinetuneConfig",
    "GPTConfig",
    "SampleConfig",
    "TrainConfig",
    "check_sampling",
    "check_stop",
    "check_values",
    "setting",
]
