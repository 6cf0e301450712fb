"""Typed configuration: the model (`GPTConfig`, the families and the presets, in
`gptkiln.config.model`) apart from run settings (`TrainConfig`, `SampleConfig`, `FinetuneConfig`, in
`gptkiln.config.run`); `gptkiln.config.checks` holds the type checks they share.

No torch import here, so the CLI can parse and validate flags before torch loads.
"""

from gptkiln.config.checks import check_values
from gptkiln.config.model import (
    FAMILIES,
    GPT2_VOCAB_SIZE,
    PRESETS,
    ROPE_SCALING_KEYS,
    GPTConfig,
)
from gptkiln.config.run import (
    FINETUNE_DEFAULTS,
    FINETUNE_TASKS,
    TRAIN_GROUPS,
    FinetuneConfig,
    SampleConfig,
    TrainConfig,
    check_sampling,
    check_stop,
    setting,
)

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
