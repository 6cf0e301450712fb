"""gptkiln: a GPT-2 style language model from scratch, and what it takes to train, run, share it.

The public API::

    from gptkiln import GPT, GPTConfig, load_tokenizer, generate
"""

from gptkiln.config import GPTConfig, SampleConfig, TrainConfig
from gptkiln.errors import GptkilnError
from gptkiln.model import GPT
from gptkiln.sampling import generate, generate_stream

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


def __getattr__(name):
    # Tokenizers pull in tiktoken/tokenizers; load them on first use.
    if name == "load_tokenizer":
        from gptkiln.tokenizers import load_tokenizer

        return load_tokenizer
    raise AttributeError(f"module 'gptkiln' has no attribute {name!r}")
