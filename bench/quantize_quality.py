"""What int8 weight-only quantization costs in quality: validation perplexity and greedy text.

    python bench/quantize_quality.py RUN [--data DATA] [--max-tokens N] [--prompt TEXT]
                                         [--new-tokens 100]

Three models from the same weights of RUN (a run directory or a Hugging Face GPT-2 one):

- ``fp32``: as stored (`gptkiln.loading.load_model`);
- ``int8``: ``load_model(RUN, quantize="int8")``, gptkiln's choice: every linear layer, the
  output head and the token embedding in int8 (`gptkiln.quantize`);
- ``int8, head fp32``: the blocks' linear layers in int8, the head and the token embedding
  kept in fp32 (``quantize_model(..., embedding_and_head=False)``), for the comparison.

Perplexity: `gptkiln.api.perplexity_of_model` (what ``gptkiln perplexity`` computes) over the
validation split of DATA (a prepared data directory; default RUN/data, where ``gptkiln train``
prepares its corpus) or a text file, the first ``--max-tokens`` of it, in non-overlapping windows
of the model's context; the change against fp32 in percent (the target: within 1%). Greedy text:
``--new-tokens`` tokens from ``--prompt`` with each model (`gptkiln.sampling.generate`); the
first position where a model's tokens differ from fp32's is reported, not asserted: a near tie
between two tokens can flip under any change to the weights, and from there the texts part.
fp32, 2 threads; no timing here (speed is `generate.py`'s).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (the shorter one's end counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", help="a run directory or a Hugging Face GPT-2 directory")
    p.add_argument("--data", help="prepared data directory (val split) or text; default RUN/data")
    p.add_argument("--max-tokens", type=int, default=200_000, help="of the validation text")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--prompt", default="ROMEO:")
    p.add_argument("--new-tokens", type=int, default=100)
    args = p.parse_args()
    torch = common.setup_torch()
    from gptkiln.api import eval_tokens, perplexity_of_model
    from gptkiln.cpu import prepare_for_decoding as prepare
    from gptkiln.loading import load_model, load_run
    from gptkiln.quantize import quantize_model
    from gptkiln.sampling import generate

    common.print_machine()
    fp32, tokenizer, _ = load_run(args.run)
    models = {
        "fp32": fp32,
        "int8": load_model(args.run, quantize="int8"),
        "int8, head fp32": quantize_model(load_model(args.run), embedding_and_head=False),
    }
    data = args.data or str(Path(args.run) / "data")
    tokens = eval_tokens(data, tokenizer)[: args.max_tokens]
    prompt = tokenizer.encode(args.prompt)
    rows, texts = [], {}
    for name, model in models.items():
        result = perplexity_of_model(model, tokens, tokenizer, batch_size=args.batch_size)
        with torch.inference_mode():
            new = generate(
                model, prompt, max_new_tokens=args.new_tokens, temperature=0, prepare=prepare
            )
        texts[name] = new
        rows.append({"model": name, "loss": result.loss, "ppl": result.perplexity})
    base = rows[0]
    for row, new in zip(rows, texts.values()):
        row["delta"] = f"{100 * (row['ppl'] / base['ppl'] - 1):+.2f}%"
        row["within"] = "yes" if abs(row["ppl"] / base["ppl"] - 1) <= 0.01 else "NO"
        diff = first_difference(texts["fp32"], new)
        row["diverges"] = "never" if diff is None else f"token {diff}"
    n_params = sum(t.numel() for t in fp32.parameters())
    print(
        f"\n{args.run}: {n_params / 1e6:.1f}M parameters, validation {data}: first "
        f"{result.tokens:,} tokens scored; greedy {args.new_tokens} tokens from {args.prompt!r}\n"
    )
    common.print_table(
        rows,
        [
            ("model", "weights"),
            ("loss", "val loss"),
            ("ppl", "val perplexity"),
            ("delta", "vs fp32"),
            ("within", "within 1%"),
            ("diverges", "greedy text first differs at"),
        ],
    )
    for name, new in texts.items():
        print(f"\n# {name}:\n{args.prompt}{tokenizer.decode(new)}")


if __name__ == "__main__":
    main()
