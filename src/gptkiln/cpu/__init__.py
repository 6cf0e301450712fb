"""The CPU decode backend, whole: the C built and loaded as one library (`library`), one typed
entry per C function, the table of kernel specs (`specs`), the candidate products (`products`),
the tuner with its clock as a parameter (`tuner`), GPT-2's one-call step (`blocks`), the loops
for forwards without autograd (`loops`), and the one entry point, `prepare_for_decoding(model,
rows, steps, precision=...)`, which returns the `DecodePlan` its caller owns.

The model stays plain (speed applied from outside, as gpt-fast applies it); `gptkiln.sampling`
imports nothing of this package: whoever owns a decoding lifetime (`gptkiln.api`, serve's
batcher, the evaluation harness) prepares the model and hands sampling the hook.
"""

from gptkiln.cpu.plan import (
    DecodePlan,
    default_precision,
    loading_quantize,
    prepare_for_decoding,
    ready_for_decoding,
)
from gptkiln.cpu.specs import PRECISIONS, exact_kernels, exact_only

__all__ = [
    "PRECISIONS",
    "DecodePlan",
    "default_precision",
    "exact_kernels",
    "exact_only",
    "loading_quantize",
    "prepare_for_decoding",
    "ready_for_decoding",
]
