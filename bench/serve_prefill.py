"""Prefilling prompts together: time to the first tokens of a request with ``n`` samples.

    python bench/serve_prefill.py [--lengths 16 48 160] [--n 4] [--rounds 6]

A request with ``n`` samples (or ``n`` requests arriving in one step with prompts of one length)
puts ``n`` equal prompts into the serve batcher at once. `gptkiln.serve.batcher` prefills
prompts of similar length in one forward (`prefill.prefill_groups`); the peer is the same
batcher prefilling them one at a time (``prefill_groups`` patched to one prompt a group: what it
did before). Both run in this one process over the same 124M-shaped random model (fp32, 2
threads), alternating round by round; the figure is the median over ``--rounds`` (after one
warm-up round each) of the seconds from submitting the ``n`` sequences to the last one's first
token. One new token each: what is timed is the prefill and the first sampling.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402

SHAPE = dict(vocab=50257, context=1024, n_layer=12, n_head=12, n_embd=768)


async def first_tokens(batcher, prompt: list[int], n: int) -> float:
    """Seconds until each of ``n`` sequences of ``prompt`` has its first token."""
    from gptkiln.config import SampleConfig
    from gptkiln.serve.events import Sequence, Token

    cfg = SampleConfig(max_new_tokens=1, temperature=0)
    seqs = [Sequence(prompt, cfg, asyncio.Queue(), index=i) for i in range(n)]
    start = time.perf_counter()
    batcher.submit(seqs)
    for seq in seqs:
        while not isinstance(await seq.events.get(), Token):
            pass
    return time.perf_counter() - start


async def measure(lengths: list[int], n: int, rounds: int) -> list[dict]:
    from gptkiln.serve import batcher as batching
    from gptkiln.serve import prefill as prefilling
    from gptkiln.tokenizers import load_tokenizer

    torch = common.setup_torch()
    common.print_machine()
    model = common.gptkiln_gpt(SHAPE, "gpt2").eval()
    together = prefilling.prefill_groups

    def alone(slots):
        return [[slot] for slot in slots]

    # no prefix cache: the same prompt each round would be a hit, not a prefill
    batcher = batching.Batcher(
        model, load_tokenizer("gpt2"), max_batch=max(8, n), prefix_cache_bytes=0
    )
    await batcher.start()
    rows = []
    try:
        for length in lengths:
            prompt = torch.randint(0, SHAPE["vocab"], (length,)).tolist()
            times: dict[str, list[float]] = {"one at a time": [], "together": []}
            for r in range(rounds + 1):  # the first round warms up
                for name, grouping in (("one at a time", alone), ("together", together)):
                    prefilling.prefill_groups = grouping
                    seconds = await first_tokens(batcher, prompt, n)
                    if r:
                        times[name].append(seconds)
            before, after = (statistics.median(times[k]) for k in ("one at a time", "together"))
            rows.append(
                {
                    "prompt": length,
                    "n": n,
                    "alone": before,
                    "together": after,
                    "speed-up": common.ratio(before, after),
                }
            )
    finally:
        prefilling.prefill_groups = together
        await batcher.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 48, 160])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    rows = asyncio.run(measure(args.lengths, args.n, args.rounds))
    common.print_table(
        rows,
        [
            ("prompt", "prompt tokens"),
            ("n", "n"),
            ("alone", "one at a time s"),
            ("together", "together s"),
            ("speed-up", "speed-up"),
        ],
    )
    print(
        f"# seconds to the last of {args.n} first tokens, median of {args.rounds} rounds "
        "alternating the two; 124M-shaped random model, fp32"
    )


if __name__ == "__main__":
    main()
