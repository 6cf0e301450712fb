"""``gptkiln info``: what a run holds, from its files' headers (`gptkiln.info.run_info`)."""

from __future__ import annotations

import argparse
import json

from gptkiln.cli.common import add_run_argument, example


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "info",
        help="what a run holds: model, tokenizer, data, steps, losses, size",
        description="What a run directory (or a Hugging Face model directory) holds: the "
        "model (its preset, shape and parameters), the tokenizer, the data it was trained on, "
        "steps done of total, tokens seen, the best and last validation loss, the checkpoint's "
        "size and whether it can be resumed. Reads only the files' headers, never the weights.",
        epilog=example("gptkiln info runs/char"),
    )
    add_run_argument(
        p, help="a run directory, or a Hugging Face model directory (GPT-2, Llama 3 or Qwen3)"
    )
    p.add_argument("--json", action="store_true", help="print it as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from gptkiln.info import run_info

    info = run_info(args.run_dir)
    print(json.dumps(info.to_dict(), indent=2) if args.json else info.summary())
