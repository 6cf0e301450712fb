"""gptkiln: a GPT-2 style language model from scratch, and what it takes to train, run, share it.

The public API::

    from gptkiln import GPT, GPTConfig, load_tokenizer, generate
"""

import importlib
from typing import TYPE_CHECKING

from gptkiln.config import GPTConfig, SampleConfig, TrainConfig
from gptkiln.errors import GptkilnError

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

__version__ = "0.1.0"


# Loaded on first use: torch (model, sampling) and tiktoken/tokenizers take seconds to import, and
# the `gptkiln` command parses and checks its flags (config.py) before it needs any of them.
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
