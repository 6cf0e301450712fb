"""The host's work a token: drawing one (gptkiln's `sampling.draw` against ``torch.multinomial``,
what the book's ``generate`` and transformers' sampling use), top-p's probabilities (against
transformers' warpers) and reading its text
(`TextStream` in pieces against decoding the whole text, as it did before), in ONE process.

    python bench/sampling.py [--rounds 30] [--generate]

- **draw**: one token a row from the same probabilities (temperature 1, the whole vocabulary,
  as ``gptkiln generate`` samples by default), at the vocabularies of GPT-2 (50,257), Llama 3
  (128,256) and Qwen3 (151,936), 1 and 16 rows; the two taken in turn each round, the ratio
  the median over rounds of multinomial's time over draw's (above 1: draw is faster).
- **top-p**: the probabilities a row is drawn from at temperature 0.8 with top-p 0.9 (and
  top-k 40 with it), from GPT-2-sized logits of a Zipf law, steep (top-p keeps tens of ids),
  flat (about a thousand) and near-uniform (tens of thousands, as an untrained model's: gptkiln
  sorts those rows whole, as transformers does every row): gptkiln's `logits_to_probs` against
  transformers' ``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper`` and a
  softmax, what its ``generate(do_sample=True)`` draws from; both keep as many ids (checked).
- **top-k**: a token a row drawn with top-k 40 (and top-p 0.9 with it) and top-k 1,000, at 1,
  8 and 16 rows, a seed a row: gptkiln's `sample_rows`, which reads each row's k candidates
  alone, against transformers' warpers, softmax and ``torch.multinomial``, and against gptkiln's
  draw from the whole row (``draw(logits_to_probs(...))``, what it did before).
- **serve**: the host's work of one decode step of `gptkiln serve`'s batcher (`Batcher._decode`
  with the model's forward replaced by fixed logits), 16 rows each with its own seed: the rows
  that sample alike drawn in one call (`_sampled_together`, as on the CPU by default) against
  each row sampling alone (``draws_together`` off, as seeded rows did before).
- **text**: a `TextStream` pushed 4,096 ids of real text (GPT-2's tokenizer, a stop string
  watched), its mean time a push by the position in the text, against the same stream with
  ``decode`` a plain function (so decoded whole at every push).
- ``--generate``: GPT-2 124M (random weights, fp32, the CPU decode backend), 200 tokens at
  temperature 1 with each sampler, and greedy beside them, in turn over 3 rounds: what the
  sampler costs a token over greedy's argmax; then 8 rows, 100 steps, top-k 40 and top-p 0.9
  drawn from each row's candidates against from the whole row, greedy beside them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402

VOCABS = {"GPT-2": 50257, "Llama 3": 128256, "Qwen3": 151936}
TEXT = (
    "Hello, world! Emoji: \U0001f642\U0001f600 caf\u00e9 na\u00efve \u2014 "
    "\u4f60\u597d\uff0c\u4e16\u754c\u3002 The quick brown fox jumps over the lazy dog.\n"
)


def multinomial(torch, probs, generator=None):
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def in_turn(fns: dict, rounds: int, calls: int = 10) -> dict[str, list[float]]:
    """Each function's seconds a call, a list over ``rounds``: warmed up, then taken in turn
    (the order reversed every other round), ``calls`` calls a round."""
    for fn in fns.values():
        for _ in range(5):
            fn()
    times = {k: [] for k in fns}
    for r in range(rounds):
        for k in fns if r % 2 == 0 else reversed(list(fns)):
            t0 = time.perf_counter()
            for _ in range(calls):
                fns[k]()
            times[k].append((time.perf_counter() - t0) / calls)
    return times


def draw_part(torch, rounds: int) -> None:
    from gptkiln.sampling import draw, logits_to_probs

    print("\n## drawing a token: draw against torch.multinomial (temperature 1)\n")
    rows_out = []
    for name, vocab in VOCABS.items():
        for rows in (1, 16):
            gen = torch.Generator().manual_seed(0)
            probs = logits_to_probs(torch.randn(rows, vocab, generator=gen) * 3, 1.0)
            fns = {
                "draw": lambda p=probs: draw(p),
                "multinomial": lambda p=probs: multinomial(torch, p),
            }
            times = in_turn(fns, rounds)
            ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            rows_out.append(
                dict(
                    vocab=f"{name} ({vocab:,})",
                    rows=rows,
                    draw=ms["draw"],
                    multinomial=ms["multinomial"],
                    ratio=common.paired_ratio(times["multinomial"], times["draw"]),
                )
            )
    common.print_table(
        rows_out,
        [
            ("vocab", "vocabulary"),
            ("rows", "rows"),
            ("draw", "draw ms"),
            ("multinomial", "multinomial ms"),
            ("ratio", "ratio (multinomial / draw)"),
        ],
    )


def zipf_logits(torch, rows: int, vocab: int, s: float):
    """Logits (rows, V) of a Zipf law of exponent ``s`` over each row's shuffled ids: id of rank
    r at -s log r, as a language model's next-token probabilities fall off."""
    gen = torch.Generator().manual_seed(0)
    ranked = -s * torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))
    return torch.stack([ranked[torch.randperm(vocab, generator=gen)] for _ in range(rows)])


def transformers_probs(torch, temperature: float, top_k: int | None, top_p: float | None):
    """What transformers' ``generate(do_sample=True)`` draws from: logits (B, V) through its
    ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and ``TopPLogitsWarper`` (those set),
    then a softmax."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = [TemperatureLogitsWarper(temperature)]
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p else []

    def probs(x):
        for w in warpers:
            x = w(None, x)
        return torch.softmax(x, dim=-1)

    return probs


def top_p_part(torch, rounds: int) -> None:
    from gptkiln.sampling import NUCLEUS_CANDIDATES, logits_to_probs

    vocab, temperature = VOCABS["GPT-2"], 0.8
    print(
        f"\n## top-p: the probabilities a token is drawn from (GPT-2's {vocab:,} ids, temperature "
        f"{temperature}): gptkiln's logits_to_probs against transformers' warpers and softmax\n"
    )
    rows_out = []
    laws = (("steep (Zipf 1.5)", 1.5), ("flat (Zipf 1.0)", 1.0), ("near-uniform (Zipf 0.3)", 0.3))
    for law, s in laws:
        for top_k, top_p in ((None, 0.9), (40, 0.9)):
            for rows in (1, 16):
                logits = zipf_logits(torch, rows, vocab, s)
                warped = transformers_probs(torch, temperature, top_k, top_p)

                def hf(x=logits, warped=warped):
                    return warped(x)

                def ours(x=logits, k=top_k, p=top_p):
                    return logits_to_probs(x, temperature, k, p)

                kept = int((ours()[0] > 0).sum())
                assert kept == int((hf()[0] > 0).sum()), "the two keep other tokens"
                times = in_turn({"gptkiln": ours, "transformers": hf}, rounds, calls=3)
                ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
                rows_out.append(
                    dict(
                        law=law,
                        filters=f"top-p {top_p}" + (f", top-k {top_k}" if top_k else ""),
                        rows=rows,
                        kept=kept,
                        ours=ms["gptkiln"],
                        hf=ms["transformers"],
                        ratio=common.paired_ratio(times["transformers"], times["gptkiln"]),
                    )
                )
    common.print_table(
        rows_out,
        [
            ("law", "next-token law"),
            ("filters", "filters"),
            ("rows", "rows"),
            ("kept", "tokens kept (row 0)"),
            ("ours", "gptkiln ms"),
            ("hf", "transformers ms"),
            ("ratio", "ratio (transformers / gptkiln)"),
        ],
    )
    print(
        "\ngptkiln ranks a row's "
        + ", then ".join(f"{m:,}" for m in NUCLEUS_CANDIDATES)
        + " most likely ids first, and sorts the whole row only where top-p keeps more."
    )


def top_k_part(torch, rounds: int) -> None:
    import gptkiln.sampling as sampling

    vocab, temperature = VOCABS["GPT-2"], 0.8
    print(
        f"\n## top-k: a token a row drawn with top-k (GPT-2's {vocab:,} ids, temperature "
        f"{temperature}, a seed a row, Zipf 1.0 logits): gptkiln's sample_rows (from each row's "
        "k candidates) against transformers' warpers, softmax and torch.multinomial, and against "
        "gptkiln's draw from the whole row (`draw(logits_to_probs(...))`, as before)\n"
    )
    rows_out = []
    for top_k, top_p in ((40, None), (40, 0.9), (1000, None)):
        for rows in (1, 8, 16):
            logits = zipf_logits(torch, rows, vocab, 1.0)
            seeds = [torch.Generator().manual_seed(r) for r in range(rows)]
            warped = transformers_probs(torch, temperature, top_k, top_p)

            def hf(x=logits, warped=warped):
                return torch.multinomial(warped(x), 1).squeeze(-1)

            def ours(x=logits, k=top_k, p=top_p, g=seeds):
                return sampling.sample_rows(x, temperature, k, p, g)

            def whole(x=logits, k=top_k, p=top_p, g=seeds):
                probs = sampling.logits_to_probs(x, temperature, k, p)
                return sampling.draw(probs, uniforms=sampling.row_uniforms(g, x.device))

            fns = {"gptkiln": ours, "whole row": whole, "transformers": hf}
            times = in_turn(fns, rounds, calls=5)
            ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            rows_out.append(
                dict(
                    filters=f"top-k {top_k}" + (f", top-p {top_p}" if top_p else ""),
                    rows=rows,
                    ours=ms["gptkiln"],
                    whole=ms["whole row"],
                    hf=ms["transformers"],
                    ratio=common.paired_ratio(times["transformers"], times["gptkiln"]),
                    before=common.paired_ratio(times["whole row"], times["gptkiln"]),
                )
            )
    common.print_table(
        rows_out,
        [
            ("filters", "filters"),
            ("rows", "rows"),
            ("ours", "gptkiln ms"),
            ("whole", "whole row ms"),
            ("hf", "transformers ms"),
            ("ratio", "ratio (transformers / gptkiln)"),
            ("before", "ratio (whole row / gptkiln)"),
        ],
    )


def text_part() -> None:
    from gptkiln.text_stream import TextStream
    from gptkiln.tokenizers import GPT2Tokenizer

    tok = GPT2Tokenizer()
    ids = []
    while len(ids) < 4096:
        ids += tok.encode(TEXT)
    ids = ids[:4096]
    marks = (128, 512, 1024, 2048, 4096)
    print("\n## a TextStream push (GPT-2's tokenizer, stop string '\\nUser:'), us by position\n")

    def pushes(decode) -> list[float]:
        stream = TextStream(decode, ("\nUser:",), (tok.eot_id,))
        took = []
        for t in ids:
            t0 = time.perf_counter()
            stream.push(t)
            took.append(time.perf_counter() - t0)
        return took

    def whole(i):  # a plain function: the stream decodes the whole text at every push
        return tok.decode(i)

    rows = []
    for name, decode in (("in pieces (gptkiln)", tok.decode), ("whole (before)", whole)):
        took = [statistics.median(v) for v in zip(*(pushes(decode) for _ in range(3)))]
        rows.append(
            {"how": name, **{str(m): 1e6 * statistics.mean(took[m - 64 : m]) for m in marks}}
        )
    ratio_row = {"how": "ratio (whole / pieces)"}
    for m in marks:
        ratio_row[str(m)] = common.ratio(rows[1][str(m)], rows[0][str(m)])
    rows.append(ratio_row)
    common.print_table(rows, [("how", "decoding"), *((str(m), f"at {m:,}") for m in marks)])


def serve_part(torch, rounds: int) -> None:
    import asyncio

    from gptkiln.config import GPTConfig, SampleConfig
    from gptkiln.model import GPT
    from gptkiln.serve import batcher as batching
    from gptkiln.serve import choosing
    from gptkiln.tokenizers import load_tokenizer

    rows, vocab = 16, VOCABS["GPT-2"]
    tokenizer = load_tokenizer("gpt2")
    model = GPT(GPTConfig.from_name("tiny", vocab_size=vocab, context_length=8192)).eval()
    logits = torch.randn(rows, 1, vocab, generator=torch.Generator().manual_seed(0)) * 3
    model.forward = lambda *args, **kwargs: logits  # the step's forward left out: its host work
    own = choosing.draws_together
    print(
        f"\n## serve: the host's work of a decode step, {rows} rows (GPT-2's vocabulary, the "
        "forward left out): the rows that sample alike drawn together against one by one\n"
    )
    settings = {
        "temperature 0.8, a seed each": dict(temperature=0.8),
        "... and frequency penalty 0.5": dict(temperature=0.8, frequency_penalty=0.5),
        "... top-k 40, top-p 0.9 (no penalty)": dict(temperature=0.8, top_k=40, top_p=0.9),
    }
    rows_out = []
    for name, kw in settings.items():
        batcher = batching.Batcher(model, tokenizer, max_batch=rows)
        slots = []
        for r in range(rows):
            cfg = SampleConfig(max_new_tokens=10**9, seed=r, stop_at_eos=False, **kw)
            slots.append(batcher._new_slot(r, batching.Sequence([1, 2, 3], cfg, asyncio.Queue())))
            slots[-1].pos = 3

        def step(together: bool, batcher=batcher, slots=slots) -> None:
            choosing.draws_together = own if together else (lambda device, temperature: False)
            try:
                batcher._decode(slots)
            finally:
                choosing.draws_together = own

        times = in_turn({"together": lambda: step(True), "alone": lambda: step(False)}, rounds)
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        rows_out.append(
            dict(
                how=name,
                together=ms["together"],
                alone=ms["alone"],
                ratio=common.paired_ratio(times["alone"], times["together"]),
            )
        )
    common.print_table(
        rows_out,
        [
            ("how", "each row's sampling"),
            ("together", "drawn together ms"),
            ("alone", "one by one ms"),
            ("ratio", "ratio (one by one / together)"),
        ],
    )


def generate_part(torch) -> None:
    import gptkiln.sampling as sampling
    from gptkiln.config import GPTConfig
    from gptkiln.cpu import prepare_for_decoding
    from gptkiln.model import GPT

    model = GPT(GPTConfig.from_name("gpt2")).eval()
    own = sampling.draw

    def run(temperature: float, sampler) -> float:
        sampling.draw = sampler
        try:
            t0 = time.perf_counter()
            sampling.generate(
                model,
                [1, 2, 3],
                max_new_tokens=200,
                temperature=temperature,
                prepare=prepare_for_decoding,
                stop_at_eos=False,
            )
            return (time.perf_counter() - t0) / 200 * 1e3
        finally:
            sampling.draw = own

    run(1.0, own)  # warm-up: the decode kernels tuned
    kinds = {
        "greedy": (0.0, own),
        "temperature 1, draw": (1.0, own),
        "temperature 1, multinomial": (1.0, lambda p, g=None: multinomial(torch, p, g)),
    }
    times = {k: [] for k in kinds}
    for _ in range(3):
        for k, (temperature, sampler) in kinds.items():
            times[k].append(run(temperature, sampler))
    greedy = statistics.median(times["greedy"])
    print("\n## generate: GPT-2 124M, fp32, the CPU decode backend, 200 tokens, 3 rounds\n")
    common.print_table(
        [
            dict(how=k, ms=statistics.median(v), over=statistics.median(v) - greedy)
            for k, v in times.items()
        ],
        [("how", "sampling"), ("ms", "ms a token (median)"), ("over", "over greedy, ms")],
    )
    candidates = sampling._from_candidates

    def batch(temperature: float, whole: bool) -> float:
        """ms a step of 8 rows, 100 steps, top-k 40 and top-p 0.9 (a seed a row)."""
        if whole:
            sampling._from_candidates = lambda logits, top_k: False
        try:
            t0 = time.perf_counter()
            sampling.generate(
                model,
                [[1, 2, 3]] * 8,
                max_new_tokens=100,
                temperature=temperature,
                top_k=40,
                top_p=0.9,
                seed=1,
                prepare=prepare_for_decoding,
                stop_at_eos=False,
            )
            return (time.perf_counter() - t0) / 100 * 1e3
        finally:
            sampling._from_candidates = candidates

    ways = {
        "greedy": (0.0, False),
        "top-k 40, top-p 0.9, from the candidates": (0.8, False),
        "top-k 40, top-p 0.9, from the whole row (before)": (0.8, True),
    }
    batch(0.8, False)  # warm-up: batch 8's kernels tuned
    times = {k: [] for k in ways}
    for r in range(3):
        for k in ways if r % 2 == 0 else reversed(list(ways)):
            times[k].append(batch(*ways[k]))
    greedy = statistics.median(times["greedy"])
    print("\n## generate, batch 8: GPT-2 124M, fp32, the CPU decode backend, 100 steps, 3 rounds\n")
    common.print_table(
        [
            dict(how=k, ms=statistics.median(v), over=statistics.median(v) - greedy)
            for k, v in times.items()
        ],
        [("how", "sampling"), ("ms", "ms a step (median)"), ("over", "over greedy, ms")],
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--generate", action="store_true", help="also GPT-2 124M's decoding (~1 min)")
    args = p.parse_args()
    common.print_machine()
    torch = common.setup_torch()
    draw_part(torch, args.rounds)
    top_p_part(torch, args.rounds)
    top_k_part(torch, args.rounds)
    serve_part(torch, args.rounds)
    text_part()
    if args.generate:
        generate_part(torch)


if __name__ == "__main__":
    main()
