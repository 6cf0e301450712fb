"""The CPU decode backend, whole: the C built and loaded as one library (`library`), one typed
entry per C function, the table of kernel specs (`specs`), the candidate products (`products`),
the tuner with its clock as a parameter (`tuner`), GPT-2's one-call step (`blocks`), the loops
for forwards without autograd (`loops`), and the one entry point, `prepare_for_decoding(model,
rows, steps, precision=...)`, which returns the `DecodePlan` its caller owns.

The model stays plain (speed applied from outside, as gpt-fast applies it); `gptkiln.sampling`
imports nothing of this package: whoever owns a decoding lifetime (`gptkiln.api`, serve's
batcher, the evaluation harness) prepares the model and hands sampling the hook.
"""

# Read as they are first asked for (PEP 562), so that `gptkiln.cpu.library` imports without
# torch: a command that decodes starts the library's build before it imports torch.
_PLAN = ("DecodePlan", "default_precision", "loading_quantize", "prepare_for_decoding",
         "ready_for_decoding")  # fmt: skip
_SPECS = ("PRECISIONS", "exact_kernels", "exact_only")

__all__ = sorted(_PLAN + _SPECS)


def __getattr__(name: str):
    if name in _PLAN:
        from gptkiln.cpu import plan

        return getattr(plan, name)
    if name in _SPECS:
        from gptkiln.cpu import specs

        return getattr(specs, name)
    raise AttributeError(f"module 'gptkiln.cpu' has no attribute {name!r}")
