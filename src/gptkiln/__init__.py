"""gptkiln: GPT-2, Llama 3 and Qwen3 language models from scratch, and what it takes to train, run
and share them.

The public API::

    from gptkiln import GPT, GPTConfig, load_tokenizer, generate
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptkiln import load_steps
from gptkiln.config import GPTConfig, SampleConfig, TrainConfig
from gptkiln.errors import GptkilnError
from gptkiln.version import __version__ as __version__

if TYPE_CHECKING:  # what type checkers and editors see; at run time, __getattr__ below
    from gptkiln.model import GPT
    from gptkiln.sampling import generate, generate_stream
    from gptkiln.tokenizers import load_tokenizer

__all__ = [
    "GPT",
    "GPTConfig",
    "GptkilnError",
    "SampleConfig",
    "TrainConfig",
    "generate",
    "generate_stream",
    "load_tokenizer",
]


# The steps features add to a load (`gptkiln.load_steps`). `gptkiln.loading` is below every
# feature and imports none; this module, which Python runs before any module of the package, is
# the one place above them all, so it tells loading, and no load can happen before it has.
def _finetuned(model: GPT, entry: Any, run_dir: Path) -> GPT:
    """A fine-tuned run's model as it was trained: a LoRA run's adapters merged into the base
    (`gptkiln.finetune.lora.merge_run_adapters`); the fine-tuning room is imported by the first
    load of a fine-tuned run, not by ``import gptkiln``."""
    from gptkiln.finetune.lora import merge_run_adapters

    return merge_run_adapters(model, entry, run_dir)


load_steps.register("finetune", _finetuned)


# Loaded on first use: torch (model, sampling) and tiktoken/tokenizers take seconds to import, and
# the `gptkiln` command parses and checks its flags (config/) before it needs any of them.
_LAZY = {
    "GPT": "gptkiln.model",
    "generate": "gptkiln.sampling",
    "generate_stream": "gptkiln.sampling",
    "load_tokenizer": "gptkiln.tokenizers",
}


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gptkiln' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])
