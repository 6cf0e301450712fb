"""``gptkiln prepare``: a corpus -> train.bin, val.bin and meta.json (`gptkiln.data.prepare`)."""

from __future__ import annotations

import argparse

from gptkiln.cli.common import add_out_flag, add_quiet_flag, example, note
from gptkiln.config import TrainConfig
from gptkiln.config.train import BPE_SAMPLE_BYTES
from gptkiln.errors import GptkilnError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare",
        help="tokenize a corpus into train.bin / val.bin",
        description="Tokenize a corpus into train.bin, val.bin and meta.json (streaming), for "
        "`gptkiln train --data DIR`.",
        epilog=example("gptkiln prepare shakespeare --tokenizer char --out data/plays-char"),
    )
    p.add_argument(
        "source",
        nargs="?",
        help="a .txt/.md, .jsonl, .json or .parquet file (the text and JSON ones may end in .gz "
        "or .zst), a folder of them, a folder saved by datasets, hf:NAME[:CONFIG][@SPLIT] (a "
        "Hugging Face dataset), a .yaml mixture, or shakespeare (the bundled plays); none with "
        "--mix",
    )
    p.add_argument(
        "--tokenizer",
        default=TrainConfig.tokenizer,  # what `gptkiln train` prepares its text with
        metavar="SPEC",
        help="gpt2 (OpenAI's BPE) | char | bpe:N (a byte-level BPE of N ids trained on the "
        "text; bpe alone: 8192) | a directory with a saved tokenizer (a run, prepared data) "
        "(default: %(default)s, as train's)",
    )
    p.add_argument(
        "--bpe-sample-mb",
        type=int,
        metavar="N",
        help="a bpe tokenizer learns from the first N MiB of the text, which bounds the "
        "trainer's memory (about 100 times the text for Chinese or Japanese, a few times for "
        f"English); 0: the whole text (default: {BPE_SAMPLE_BYTES >> 20})",
    )
    add_out_flag(p)
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.1,
        metavar="X",
        help="share of the text, taken from its end, held out for validation, in (0, 1) "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--text-field",
        default="text",
        metavar="NAME",
        help="the JSON key, or Parquet or dataset column, that holds the text "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--mix",
        nargs="+",
        metavar="SOURCE:WEIGHT",
        help="draw documents from several sources in proportion to their weights, by tokens, "
        "instead of one SOURCE, e.g. --mix data/web:3 hf:roneneldan/TinyStories:1 (default: "
        "one SOURCE)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="N",
        help="seed of a mixture's draw: the same seed, sources and tokenizer give the same data "
        "(default: %(default)s)",
    )
    add_quiet_flag(p)
    p.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="threads encoding with the gpt2 tokenizer (>= 1; default: every core)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from gptkiln.data.prepare import prepare, read_meta
    from gptkiln.run_guard import check_folder_writable

    mb = BPE_SAMPLE_BYTES >> 20 if args.bpe_sample_mb is None else args.bpe_sample_mb
    if mb < 0:
        raise GptkilnError(
            f"--bpe-sample-mb {mb}: the MiB of text a BPE learns from, >= 0 (0: all)"
        )
    if args.bpe_sample_mb is not None and not str(args.tokenizer).startswith("bpe"):
        raise GptkilnError(
            "--bpe-sample-mb is for a bpe tokenizer trained here, and --tokenizer "
            f"{args.tokenizer} trains none; drop it"
        )
    if args.source is None and not args.mix:
        raise GptkilnError(
            "give a SOURCE to prepare (a file, a folder, hf:NAME, a .yaml "
            "mixture or shakespeare), or several with --mix SOURCE:WEIGHT ..."
        )
    check_folder_writable(args.out, "--out")  # before a tokenizer is trained for it
    before = read_meta(args.out)  # the prepared data there now, if any
    meta = prepare(
        args.source,
        args.out,
        tokenizer=args.tokenizer,
        val_fraction=args.val_fraction,
        text_field=args.text_field,
        mix=args.mix,
        seed=args.seed,
        progress=not args.quiet,
        threads=args.threads,
        bpe_sample_bytes=mb << 20 if mb else None,
    )
    print(
        f"wrote {args.out}: {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens "
        f"({meta['tokenizer']} tokenizer, vocab {meta['vocab_size']:,})"
    )
    same = ("source", "checksums", "tokenizer_spec", "val_fraction", "train_tokens")
    if before is not None and any(before.get(k) != meta.get(k) for k in same):
        note(
            f"{args.out} held prepared data of {before.get('source')} "
            f"({before.get('tokenizer_spec')} tokenizer, {before.get('train_tokens', 0):,} train "
            "tokens), now replaced; a run trained on it notes the change when it resumes"
        )
