"""A padded vocabulary (``--pad-vocab``) against none: training steps taken in turn in ONE process.

    python bench/padded_vocab.py [--models qwen3-baby-untied gpt2] [--rounds 40] [--fp32]

For each model, two copies of one preset (each freshly initialised from the same seed): at
GPT-2's 50,257 ids, and with the token embedding and output head padded to 50,304 rows (a
multiple of 64, what ``gptkiln train`` does on CUDA unless ``--pad-vocab`` says otherwise;
the logits and the loss stay over the 50,257 ids). Each
round takes one step of each (forward + loss + backward + AdamW, bf16 autocast as ``gptkiln
train`` chooses on a CPU with AVX512-BF16 or AMX unless ``--fp32``), the order alternating, so
both see the same machine; the ratio is the median over rounds of the unpadded step's time over
the padded one's (above 1: padding is faster). The models: the default run's
``qwen3-baby-untied`` (batch 12, context 64, as ``gptkiln train``) and GPT-2 124M (``gpt2``,
batch 2, context 256, to keep a round short on two cores). Eager, as ``gptkiln train`` runs on
a CPU. The peer is the same model unpadded, measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402

from gptkiln.config.model import rounded_vocab  # noqa: E402
from gptkiln.config.train import VOCAB_MULTIPLE  # noqa: E402

VOCAB = 50257
SHAPES = {  # preset: (batch, context)
    "qwen3-baby-untied": (12, 64),
    "gpt2": (2, 256),
}


def build(torch, preset: str, padded: int | None, context: int):
    from gptkiln.config import GPTConfig
    from gptkiln.model import GPT
    from gptkiln.optim import make_optimizer

    torch.manual_seed(0)
    config = GPTConfig.from_name(
        preset, vocab_size=VOCAB, padded_vocab_size=padded, context_length=context, dropout=0.0
    )
    model = GPT(config).train()
    opt = make_optimizer(model, 1e-4, 0.1, (0.9, 0.95), "adamw")
    return model, opt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rounds", type=int, default=40, help="timed steps of each, per model")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each, first")
    p.add_argument("--fp32", action="store_true", help="no autocast")
    args = p.parse_args()

    common.print_machine()
    torch = common.setup_torch()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.fp32)
    padded_rows = rounded_vocab(VOCAB, VOCAB_MULTIPLE)
    print(f"\n{'bf16 autocast' if not args.fp32 else 'fp32'}, eager; vocabulary {VOCAB:,} ids,"
          f" padded to {padded_rows:,} rows\n")  # fmt: skip
    print("| model | batch x context | unpadded ms/step | padded ms/step | ratio (unpadded / "
          "padded) |")  # fmt: skip
    print("|---|---|---|---|---|")
    for preset in args.models:
        batch, context = SHAPES[preset]
        gen = torch.Generator().manual_seed(0)
        x = torch.randint(0, VOCAB, (batch, context), generator=gen)
        y = torch.randint(0, VOCAB, (batch, context), generator=gen)
        runs = {}
        for name, rows in (("unpadded", None), ("padded", padded_rows)):
            model, opt = build(torch, preset, rows, context)
            runs[name] = lambda m=model, o=opt, x=x, y=y: common.training_step(
                lambda a, b: m(a, b)[1], o, x, y, autocast
            )
            for _ in range(args.warmup):
                runs[name]()
        times: dict[str, list[float]] = {name: [] for name in runs}
        ratios = []
        for r in range(args.rounds):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))
            took = {}
            for name in order:
                t0 = time.perf_counter()
                runs[name]()
                took[name] = time.perf_counter() - t0
                times[name].append(took[name])
            ratios.append(took["unpadded"] / took["padded"])
        plain, padded = (statistics.median(times[n]) * 1e3 for n in ("unpadded", "padded"))
        print(f"| {preset} | {batch} x {context} | {plain:.1f} | {padded:.1f} | "
              f"{statistics.median(ratios):.3f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
