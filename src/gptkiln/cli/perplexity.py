"""``gptkiln perplexity``: a run's loss, perplexity and bits per character on text
(`gptkiln.api.perplexity_of_run`). (Called ``eval`` before; `cli.RENAMED` says so.)"""

from __future__ import annotations

import argparse

from gptkiln.cli.common import (
    add_device_flag,
    add_quantize_flag,
    add_quiet_flag,
    add_run_argument,
    example,
    keep_freed_memory_on_cpu,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "perplexity",
        help="loss, perplexity and bits per character of a run on text",
        description="Cross-entropy loss and perplexity of a run on text: every token after "
        "the first scored once, over the text's non-overlapping context windows and, for the "
        "tokens they leave, one more window ending at the last (each document begun as the "
        "tokenizer begins a text: Llama 3's BOS first, as Hugging Face and lm-eval score it).",
        epilog=example("gptkiln perplexity runs/char --data data/plays-char"),
    )
    add_run_argument(p)
    p.add_argument(
        "--data",
        required=True,
        metavar="PATH",
        help="a prepared data folder (its validation split) or a text/.jsonl file, tokenized "
        "with the run's tokenizer (required)",
    )
    p.add_argument(
        "--text-field",
        default="text",
        metavar="NAME",
        help="the JSON key, or Parquet or dataset column, of a --data file that holds the text, "
        "as train's --text-field (default: %(default)s)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=8,
        metavar="N",
        help="windows per forward pass (>= 1) (default: %(default)s)",
    )
    add_device_flag(p)
    add_quiet_flag(p)
    add_quantize_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from gptkiln.api import perplexity_of_run
    from gptkiln.devices import resolve_device

    keep_freed_memory_on_cpu(args.device)  # each batch's logits: no page faults to map again
    r = perplexity_of_run(
        args.run_dir,
        args.data,
        batch_size=args.batch_size,
        device=resolve_device(args.device),
        progress=not args.quiet,
        quantize=args.quantize,
        text_field=args.text_field,
    )
    print(
        f"loss {r.loss:.4f} | perplexity {r.perplexity:.2f} | {r.bits_per_char:.4f} bits/char "
        f"| {r.tokens:,} tokens, {r.characters:,} characters"
    )
