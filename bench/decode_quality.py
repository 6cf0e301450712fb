"""What the decoding kernels cost in quality: perplexity computed token by token, as decoding runs.

    python bench/decode_quality.py RUN --text FILE [--max-tokens 2048]

`bench/quantize_quality.py` measures int8 weights through ``gptkiln perplexity``, whose forwards
multiply hundreds of rows at once and so never reach the few-row kernels the tuner hands out
for decoding (`gptkiln.cpu`). Here every token goes through the static KV cache one at a
time (`gptkiln.sampling.decode_one_token`, batch 1, the kernels tuned for one row), over
windows of the model's context from the first ``--max-tokens`` tokens of FILE, and the
perplexity of the next token is accumulated. Rows:

- ``fp32``: the run as stored, every layer on ``F.linear`` (the reference);
- ``int8, reference kernel``: int8 weights (`gptkiln.quantize`), every layer on
  `gptkiln.cpu.products.dequantize_linear` (fp32 activations);
- ``int8, kernel <name>``: the same weights with every layer on one int8 kernel of the spec
  table (`gptkiln.cpu.specs`), e.g. ``dynamic`` (int8 activations too,
  `gptkiln.cpu.products.dynamic_int8`) or ``q8_rows`` (q8_0's 8-bit activations);
- ``fp32 weights, kernel <name>``: the run with every float layer on one float kernel, e.g.
  ``bf16`` (`gptkiln.cpu.products.bf16_linear`) or ``bf16_rows`` (bf16 weights, fp32
  activations: the ``bf16`` precision); a kernel this machine does not offer is skipped;

each with its change against fp32 in percent (the target: within 1%). 2 threads.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402


def decode_perplexity(model, ids: list[int]) -> float:
    """exp(mean NLL) of each next token, fed one at a time through the KV cache, in windows of
    the model's context length."""
    import torch
    import torch.nn.functional as F

    from gptkiln.sampling import decode_one_token

    ctx = model.config.context_length
    total, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, ctx):
            window = ids[start : start + ctx + 1]
            model.setup_cache(1, len(window) - 1, torch.zeros(1, dtype=torch.long))
            for pos in range(len(window) - 1):
                logits = decode_one_token(model, torch.tensor([window[pos]]), pos)  # (1, V)
                total += float(F.cross_entropy(logits, torch.tensor([window[pos + 1]])))
                count += 1
    model.clear_cache()
    return math.exp(total / count)


def kernel_of(name: str, weight: str):
    """The spec table's kernel ``name`` for ``weight`` ("float32" or "int8") weights, or None
    where this machine does not offer it (its library or CPU check)."""
    from gptkiln.cpu import specs

    spec = specs.BY_NAME.get(name)
    if spec is None or spec.weight != weight:
        kinds = sorted(s.name for s in specs.SPECS if s.weight == weight)
        raise SystemExit(f"{name}: not a {weight} kernel; choose from {', '.join(kinds)}")
    return spec.kernel if specs.available(spec) else None


def with_kernel(model, name: str):
    """Every int8 layer of ``model`` on the int8 kernel ``name`` for one row."""
    from gptkiln.cpu.planned import give_kernel
    from gptkiln.quantize import Int8Linear

    kernel = kernel_of(name, "int8")
    for module in model.modules():
        if isinstance(module, Int8Linear):
            give_kernel(module, 1, kernel)
    return model


def with_float_kernel(model, name: str):
    """Every float layer of ``model`` on the float kernel ``name`` for one row."""
    from gptkiln.cpu.planned import give_kernel
    from gptkiln.model import Linear

    kernel = kernel_of(name, "float32")
    for module in model.modules():
        if isinstance(module, Linear):
            give_kernel(module, 1, kernel)
    return model.eval()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run")
    p.add_argument("--text", required=True, help="a UTF-8 text file")
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument(
        "--kernels", nargs="+", default=["dynamic"], help="int8 kernels (gptkiln.cpu.specs)"
    )
    p.add_argument(
        "--float-kernels", nargs="+", default=["bf16"], help="float kernels (where offered)"
    )
    args = p.parse_args()
    common.setup_torch()
    from gptkiln.loading import load_run

    common.print_machine()
    model, tokenizer, _ = load_run(args.run)
    ids = tokenizer.encode(Path(args.text).read_text(encoding="utf-8"))[: args.max_tokens]
    rows = [{"model": "fp32", "ppl": decode_perplexity(with_float_kernel(model, "linear"), ids)}]
    for name in args.float_kernels:
        if kernel_of(name, "float32") is None:
            print(f"# float kernel {name}: not offered here (its library, or the CPU)")
            continue
        again, _, _ = load_run(args.run)
        label = f"fp32 weights, kernel {name}"
        rows.append({"model": label, "ppl": decode_perplexity(with_float_kernel(again, name), ids)})
    int8, _, _ = load_run(args.run, quantize="int8")
    for name in ["dequantize", *args.kernels]:
        if kernel_of(name, "int8") is None:
            print(f"# int8 kernel {name}: not offered here (its library, or the CPU)")
            continue
        label = "int8, reference kernel" if name == "dequantize" else f"int8, kernel {name}"
        rows.append({"model": label, "ppl": decode_perplexity(with_kernel(int8, name), ids)})
    for row in rows:
        row["change_pct"] = 100 * (row["ppl"] / rows[0]["ppl"] - 1)
    print(f"# {args.run}: {len(ids)} tokens of {args.text}, one at a time through the KV cache")
    common.print_table(
        rows, [("model", "model"), ("ppl", "perplexity"), ("change_pct", "vs fp32 %")]
    )


if __name__ == "__main__":
    main()
