"""``gptkiln convert`` and ``gptkiln download``: models between formats, and GPT-2, Llama and
Qwen3 weights from the Hugging Face Hub (`gptkiln.convert`)."""

from __future__ import annotations

import argparse

from gptkiln.cli.common import add_out_flag, add_overwrite_flag, example, note

# convert's directions: what each makes of what, as its help lists them; `run_convert` calls
# the `gptkiln.convert` function of each.
DIRECTIONS = {
    "hf": "HF GPT-2 / Llama / Qwen3 dir -> run",
    "book": "the book's model.pth -> run",
    "to-hf": "run -> HF dir of its family (GPT2LMHeadModel, LlamaForCausalLM, Qwen3ForCausalLM)",
    "to-gguf": "run -> one .gguf file (llama.cpp, Ollama, LM Studio) and an Ollama Modelfile",
    "gguf": "a GPT-2 / Llama / Qwen3 .gguf file -> run",
    "merge-lora": "a LoRA run -> a run with the adapters in its weights",
    "quantize": "run -> int8 run (loads directly)",
}


# the flags that only some directions read, with their defaults: given to another direction,
# one is refused rather than ignored, even at its default value (argparse's default is None, so
# a flag given can be told from one left out; `check_convert_flags` fills the defaults in)
DIRECTION_FLAGS = {
    "n_head": ("--n-head", None, ("book",)),
    "method": ("--method", "int8", ("quantize",)),
    "float_head": ("--float-head", False, ("quantize",)),
    "max_shard_size": ("--max-shard-size", "50GB", ("to-hf",)),
    "type": ("--type", "f32", ("to-gguf",)),
}


def add_convert_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="Hugging Face / GGUF / book checkpoints in, Hugging Face / GGUF out",
        description="Convert models: a Hugging Face GPT-2, Llama or Qwen3 directory (one "
        "safetensors file or its shards; its tokenizer's files kept), a GGUF file or the book's "
        "model.pth into a run directory, or a run into a directory Hugging Face transformers "
        "loads or a GGUF file llama.cpp and Ollama run.",
        epilog=example(
            "gptkiln convert to-hf runs/tiny-gpt2 --out exported/tiny-gpt2",
            "gptkiln convert to-gguf runs/mine --out exported/mine.gguf --type q8_0",
        ),
    )
    p.add_argument(
        "direction",
        choices=list(DIRECTIONS),
        help="; ".join(f"{name}: {what}" for name, what in DIRECTIONS.items()),
    )
    p.add_argument("path", help="the directory or file to convert")
    add_out_flag(p, help="the directory to write; to-gguf: the .gguf file (required)")
    p.add_argument(
        "--n-head",
        type=int,
        default=None,
        metavar="N",
        help="attention heads of a book model, which its file does not record (>= 1) "
        "(default: GPT-2's at the model's width: 12 at 768, the book's 124M; 16 at 1024, 20 at "
        "1280, 25 at 1600; another width needs it)",
    )
    p.add_argument(
        "--method",
        default=None,
        metavar="METHOD",
        help=f"quantize: the quantization, int8 (default: {DIRECTION_FLAGS['method'][1]})",
    )
    p.add_argument(
        "--float-head",
        action="store_true",
        default=None,
        help="quantize: keep the output head and token embedding in fp32 (default: int8 too)",
    )
    p.add_argument(
        "--max-shard-size",
        default=None,
        metavar="SIZE",
        help="to-hf: weights larger than this are written as shards with an index, as "
        "transformers' save_pretrained does (e.g. 5GB, 500MB) (default: "
        f"{DIRECTION_FLAGS['max_shard_size'][1]})",
    )
    p.add_argument(
        "--type",
        default=None,
        choices=["f32", "f16", "bf16", "q8_0"],
        help="to-gguf: the weights' type in the file (q8_0: llama.cpp's 8-bit blocks) "
        f"(default: {DIRECTION_FLAGS['type'][1]})",
    )
    add_overwrite_flag(p)
    p.set_defaults(func=run_convert)


def check_convert_flags(args: argparse.Namespace) -> None:
    """A flag another direction reads, and ``--out`` the very thing converted, are refused;
    the defaults of the flags left out are filled in."""
    from pathlib import Path

    from gptkiln.errors import GptkilnError

    for name, (flag, default, directions) in DIRECTION_FLAGS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
        elif args.direction not in directions:
            raise GptkilnError(
                f"{flag} is for convert {' and '.join(directions)}, not convert "
                f"{args.direction}; leave it out"
            )
    # (merge-lora and quantize refuse it in words of their own: `convert.merge_lora`, ...)
    same = Path(args.out).resolve() == Path(args.path).resolve()
    if same and args.direction not in ("merge-lora", "quantize"):
        raise GptkilnError(
            f"--out {args.out} is what convert {args.direction} reads; write somewhere else"
        )


def run_convert(args: argparse.Namespace) -> None:
    from gptkiln import convert

    check_convert_flags(args)

    if args.direction == "hf":
        convert.import_hf(args.path, args.out, overwrite=args.overwrite, on_note=note)
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
    elif args.direction == "to-gguf":
        from gptkiln.export.gguf import export_gguf
        from gptkiln.export.ollama import modelfile_path

        out = export_gguf(
            args.path, args.out, type=args.type, overwrite=args.overwrite, on_note=print
        )
        print(f"wrote {out}")  # the GGUF first, as it was written
        print(f"wrote {modelfile_path(out)} (Ollama: ollama create NAME -f {modelfile_path(out)})")
        return
    elif args.direction == "gguf":
        from gptkiln.export.gguf_import import import_gguf

        import_gguf(args.path, args.out, overwrite=args.overwrite)
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
