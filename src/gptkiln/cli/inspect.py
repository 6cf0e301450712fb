"""``gptkiln inspect``: one forward pass on a prompt, shown: attention heat-maps, the top-k next
tokens and each token's loss (`gptkiln.inspect.inspect_run`, `gptkiln.plots.plot_attention`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from gptkiln.cli.common import (
    add_device_flag,
    add_quantize_flag,
    add_run_argument,
    example,
    note,
)
from gptkiln.errors import GptkilnError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="attention maps, next-token probabilities and per-token loss of a prompt",
        description="Run a model once on a prompt and show what it does with it: every layer's "
        "and head's attention weights as heat-maps (query tokens down, key tokens across, the "
        "masked future grey), the top-k next tokens after each prompt token, and the loss of "
        "each prompt token given the ones before it, with the perplexity. Layers, heads and "
        "positions count from 0 (layer 0 is h.0); -1 is the last. With grouped-query attention "
        "(llama3, qwen3: fewer key/value heads than query heads) each query head still has its "
        "own map, titled with the key/value head it shares (head 3 · kv 1), and --json gives "
        "n_kv_head and kv_head_of, that head for each query head.",
        epilog=example(
            "gptkiln inspect runs/char --prompt 'ROMEO: What' --layer 0 --top-k 3 "
            "--out attention.png --json attention.json"
        ),
    )
    add_run_argument(p)
    p.add_argument(
        "--prompt",
        required=True,
        metavar="TEXT",
        help="the text to inspect, at least one token (required)",
    )
    p.add_argument(
        "--layer",
        type=int,
        metavar="L",
        help="draw only this layer, 0 to n_layer-1 or -1 for the last (default: every layer)",
    )
    p.add_argument(
        "--head",
        type=int,
        metavar="H",
        help="draw only this head, 0 to n_head-1 or -1 for the last (default: every head)",
    )
    p.add_argument(
        "--position",
        type=int,
        metavar="P",
        help="print the next-token table for this prompt position only, 0 to tokens-1 or -1 "
        "for the last (default: every position)",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=5,
        metavar="K",
        help="next tokens listed per position, 1 to the vocabulary size (default: %(default)s)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=64,
        metavar="N",
        help="inspect the prompt's first N tokens, N >= 1, at most the model's context; "
        "a longer prompt is cropped with a note (default: %(default)s)",
    )
    p.add_argument(
        "--out",
        default="attention.png",
        metavar="PNG",
        help="the heat-map PNG; a grid too large for one figure becomes one file per layer, "
        "PNG with -layerN before .png (default: %(default)s)",
    )
    p.add_argument(
        "--json",
        metavar="FILE",
        help="also write tokens, attention weights, top-k and losses as JSON (default: none)",
    )
    add_device_flag(p)
    add_quantize_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from gptkiln.devices import resolve_device
    from gptkiln.inspect import check_view, inspect_run, pick
    from gptkiln.plots import check_png_path, plot_attention
    from gptkiln.run_guard import check_not_a_run_file, check_writable

    check_png_path(args.out, "--out")  # before the model runs
    check_not_a_run_file(args.out, "--out")
    check_writable(args.out, "--out")
    if args.json:
        check_not_a_run_file(args.json, "--json")
        check_writable(args.json, "--json")
        if Path(args.json).resolve() == Path(args.out).resolve():
            raise GptkilnError(f"--json {args.json} is --out's picture too; give another path")
    result = inspect_run(
        args.run_dir,
        args.prompt,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        device=resolve_device(args.device),
        quantize=args.quantize,
    )
    check_view(result, layer=args.layer, head=args.head, position=args.position)
    if result.crop_note():
        note(result.crop_note())
    print(result.report(position=args.position))
    n_layer, n_head = result.attention.shape[:2]
    layers = None if args.layer is None else [pick("--layer", args.layer, n_layer, "layers")]
    heads = None if args.head is None else [pick("--head", args.head, n_head, "heads")]
    title = f"{Path(args.run_dir).name}: {args.prompt!r}"
    files = plot_attention(
        result.attention,
        result.labels,
        args.out,
        layers=layers,
        heads=heads,
        title=title if len(title) <= 90 else title[:89] + "…",
        on_notice=note,
        kv_heads=result.n_kv_head,
    )
    print(f"wrote {', '.join(str(f) for f in files)}")
    if args.json:
        print(f"wrote {result.write_json(args.json)}")
