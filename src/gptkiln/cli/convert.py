"""``gptkiln convert`` and ``gptkiln download``: models between formats, and GPT-2, Llama and
Qwen3 weights from the Hugging Face Hub (`gptkiln.convert`)."""

from __future__ import annotations

import argparse

from gptkiln.cli.common import add_out_flag, add_overwrite_flag, example

# convert's directions: what each makes of what, as its help lists them; `run_convert` calls
# the `gptkiln.convert` function of each.
DIRECTIONS = {
    "hf": "HF GPT-2 / Llama / Qwen3 dir -> run",
    "book": "the book's model.pth -> run",
    "to-hf": "run -> HF dir of its family (GPT2LMHeadModel, LlamaForCausalLM, Qwen3ForCausalLM)",
    "merge-lora": "a LoRA run -> a run with the adapters in its weights",
    "quantize": "run -> int8 run (loads directly)",
}


def add_convert_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="Hugging Face / book checkpoints in, Hugging Face out",
        description="Convert models: a Hugging Face GPT-2, Llama or Qwen3 directory (one "
        "safetensors file or its shards; its tokenizer's files kept) or the book's model.pth "
        "into a run directory, or a run into a directory Hugging Face transformers loads.",
        epilog=example("gptkiln convert to-hf runs/tiny-gpt2 --out exported/tiny-gpt2"),
    )
    p.add_argument(
        "direction",
        choices=list(DIRECTIONS),
        help="; ".join(f"{name}: {what}" for name, what in DIRECTIONS.items()),
    )
    p.add_argument("path", help="the directory or file to convert")
    add_out_flag(p)
    p.add_argument(
        "--n-head",
        type=int,
        default=12,
        metavar="N",
        help="attention heads of a book model, which its file does not record (>= 1) "
        "(default: %(default)s, the book's 124M)",
    )
    p.add_argument(
        "--method",
        default="int8",
        metavar="METHOD",
        help="quantize: the quantization, int8 (default: %(default)s)",
    )
    p.add_argument(
        "--float-head",
        action="store_true",
        help="quantize: keep the output head and token embedding in fp32 (default: int8 too)",
    )
    p.add_argument(
        "--max-shard-size",
        default="50GB",
        metavar="SIZE",
        help="to-hf: weights larger than this are written as shards with an index, as "
        "transformers' save_pretrained does (e.g. 5GB, 500MB) (default: %(default)s)",
    )
    add_overwrite_flag(p)
    p.set_defaults(func=run_convert)


def run_convert(args: argparse.Namespace) -> None:
    from gptkiln import convert

    if args.direction == "hf":
        convert.import_hf(args.path, args.out, overwrite=args.overwrite)
    elif args.direction == "book":
        convert.import_book(args.path, args.out, n_head=args.n_head, overwrite=args.overwrite)
    elif args.direction == "to-hf":
        convert.export_hf(
            args.path,
            args.out,
            overwrite=args.overwrite,
            max_shard_size=args.max_shard_size,
            on_note=print,
        )
    elif args.direction == "merge-lora":
        convert.merge_lora(args.path, args.out, overwrite=args.overwrite)
    elif args.direction == "quantize":
        convert.quantize_run(
            args.path,
            args.out,
            method=args.method,
            embedding_and_head=not args.float_head,
            overwrite=args.overwrite,
        )
    else:  # a name added to DIRECTIONS without its branch here
        raise AssertionError(f"convert {args.direction}: no conversion")
    print(f"wrote {args.out}")


def add_download_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "download",
        help="download GPT-2, Llama or Qwen3 weights (needs internet)",
        description="Download a GPT-2, Llama or Qwen3 model from the Hugging Face Hub into a "
        "run directory (a Llama or Qwen3 run keeps the model's own tokenizer).",
        epilog=example("gptkiln download gpt2 --out runs/gpt2"),
    )
    p.add_argument(
        "name",
        help="gpt2 (124M) | gpt2-medium | gpt2-large | gpt2-xl (1.5B) | llama3.2-1b | "
        "llama3.2-3b | qwen3-0.6b | qwen3-1.7b, or a Hub repository id (owner/name) of a GPT-2, "
        "Llama or Qwen3 model",
    )
    add_out_flag(p)
    add_overwrite_flag(p)
    p.set_defaults(func=run_download)


def run_download(args: argparse.Namespace) -> None:
    from gptkiln import convert

    convert.download(args.name, args.out, overwrite=args.overwrite)
    print(f"wrote {args.out}")
