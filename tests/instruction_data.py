"""Toy instruction data the fine-tuning tests share: Alpaca-format entries a tiny model learns
in seconds (repeat a word, or the input)."""

from __future__ import annotations

import random

WORDS = "red green blue cat dog sun moon tree rain fish".split()


def instructions(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        word = rng.choice(WORDS)
        if i % 3:
            out.append({"instruction": f"Repeat {word}.", "input": "", "output": f"{word} {word}"})
        else:
            out.append({"instruction": "Repeat the input.", "input": word, "output": word})
    return out
