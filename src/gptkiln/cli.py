"""The ``gptkiln`` command: thin subcommands, each parsing flags and calling one library function.

A `GptkilnError` (bad input) prints one line and exits with code 2; so does a bad flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from gptkiln.config import PRESETS, SampleConfig, TrainConfig, check_values
from gptkiln.errors import GptkilnError

RECIPES_DIR = Path(__file__).parent / "recipes"


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (what, and where to look), exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")


# -- prepare ---------------------------------------------------------------------------------
def cmd_prepare(args: argparse.Namespace) -> None:
    from gptkiln.data.prepare import prepare

    meta = prepare(
        args.source,
        args.out,
        tokenizer=args.tokenizer,
        val_fraction=args.val_fraction,
        progress=not args.quiet,
        threads=args.threads,
    )
    print(
        f"wrote {args.out}: {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens "
        f"({meta['tokenizer']} tokenizer, vocab {meta['vocab_size']:,})"
    )


# -- train -----------------------------------------------------------------------------------
# TrainConfig fields whose default is None need their type spelled out for argparse.
_OPTIONAL_TYPES = {
    "data": str,
    "context_length": int,
    "dropout": float,
    "tie_embeddings": bool,
    "gelu": str,
    "stride": int,
}


def add_train_flags(p: argparse.ArgumentParser) -> None:
    """One flag per `TrainConfig` field (``max_steps`` -> ``--max-steps``)."""
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        if isinstance(default, bool) or _OPTIONAL_TYPES.get(f.name) is bool:
            p.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=f"(default: {default})",
            )
        else:
            kind = _OPTIONAL_TYPES.get(f.name, type(default))
            p.add_argument(
                flag,
                type=kind,
                default=argparse.SUPPRESS,
                metavar=f.name.upper(),
                help=f"(default: {default})",
            )


def load_recipe(name_or_path: str) -> dict[str, Any]:
    """A YAML training recipe: a bundled name (``book-verdict``) or a file path."""
    import yaml

    path = Path(name_or_path)
    if not path.is_file():
        bundled = RECIPES_DIR / f"{name_or_path}.yaml"
        if not bundled.is_file():
            names = ", ".join(sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
            raise GptkilnError(
                f"--config {name_or_path}: no such file or bundled recipe; bundled recipes: {names}"
            )
        path = bundled
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        problem = str(e).replace("\n", " ")
        raise GptkilnError(f"{path}: not valid YAML ({problem}); fix the file") from None
    if not isinstance(values, dict):
        raise GptkilnError(f"{path}: a recipe is a mapping of training settings (key: value)")
    return check_values(TrainConfig, values, str(path))


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the recipe (--config), then the flags given on the command line."""
    return _chosen_config(args)[0]


def _chosen_config(args: argparse.Namespace) -> tuple[TrainConfig, dict[str, str]]:
    """The `TrainConfig` of `train_config_from_args`, and where each setting a person chose came
    from: ``"recipe"`` or ``"flag"`` (a flag overrides the recipe)."""
    values: dict[str, Any] = {}
    given: dict[str, str] = {}
    if getattr(args, "config", None):
        values.update(load_recipe(args.config))
        given.update(dict.fromkeys(values, "recipe"))
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    flags = {k: v for k, v in vars(args).items() if k in names}
    values.update(flags)
    given.update(dict.fromkeys(flags, "flag"))
    return TrainConfig.from_dict(values), given


def check_prepared_data_agrees(cfg: TrainConfig, given: dict[str, str], recipe: str | None):
    """Prepared data has its tokenizer and its split already, and training keeps them. A
    ``--tokenizer`` or ``--val-fraction`` flag that contradicts them would be ignored, so it is
    refused; a recipe's (made for preparing raw text) gets a note on stderr. ``bpe`` alone
    agrees with a BPE of any size; ``bpe:N`` with one prepared as ``bpe:N`` (a small corpus can
    give fewer ids than N) or of N ids."""
    import math
    import shlex

    from gptkiln.data.prepare import is_prepared, read_meta
    from gptkiln.tokenizers import parse_tokenizer_spec

    meta = read_meta(cfg.data) if is_prepared(cfg.data) else None
    if meta is None:  # text to prepare, or damaged data: loading it names what is wrong
        return
    clashes = []  # (setting, what was asked, what the data has)
    made, spec = meta.get("tokenizer"), meta.get("tokenizer_spec")
    if "tokenizer" in given and isinstance(made, str):
        kind, size = parse_tokenizer_spec(cfg.tokenizer)
        if made == "bpe":
            sizes = {meta.get("vocab_size")}
            try:
                sizes.add(parse_tokenizer_spec(spec)[1])  # the N asked for when prepared
            except GptkilnError:  # prepared with a run's tokenizer: the spec is its folder
                pass
            agrees = kind == "bpe" and (":" not in cfg.tokenizer or size in sizes)
            made = f"a BPE tokenizer of {meta.get('vocab_size')} ids"
        else:
            agrees = kind == made
            made = f"the {made} tokenizer"
        if not agrees:
            clashes.append(("tokenizer", cfg.tokenizer, f"prepared with {made}"))
    fraction = meta.get("val_fraction")
    if "val_fraction" in given and isinstance(fraction, (int, float)):
        if not math.isclose(cfg.val_fraction, fraction, rel_tol=1e-9):
            has = f"split with val_fraction {fraction}"
            clashes.append(("val_fraction", str(cfg.val_fraction), has))
    flags = [c for c in clashes if given[c[0]] == "flag"]
    for name, asked, has in clashes:
        if given[name] == "recipe" and not flags and os.environ.get("RANK", "0") == "0":
            print(
                f"note: --config {recipe} sets {name}: {asked}, but --data {cfg.data} was {has}, "
                "which training keeps",
                file=sys.stderr,
            )
    if flags:
        names = " and ".join("--" + name.replace("_", "-") for name, _, _ in flags)
        asked = " ".join(f"--{name.replace('_', '-')} {value}" for name, value, _ in flags)
        source = shlex.quote(str(meta["source"])) if meta.get("source") else "TEXT"
        raise GptkilnError(
            f"{asked}: --data {cfg.data} was {' and '.join(has for _, _, has in flags)}, which "
            f"training keeps; drop {names} to train on it as it is, or prepare the text again: "
            f"gptkiln prepare {source} {asked} --out NEW_DIR"
        )


def cmd_train(args: argparse.Namespace) -> None:
    cfg, given = _chosen_config(args)
    check_prepared_data_agrees(cfg, given, args.config)
    if args.nproc is not None:
        _check_before_launch(cfg, args)
        return launch_torchrun(args.nproc)
    from gptkiln.allocator import keep_freed_memory
    from gptkiln.devices import resolve_device
    from gptkiln.train import train

    if resolve_device(cfg.device).startswith("cpu"):  # our own process: no page faults per step
        keep_freed_memory()
    result = train(cfg, resume=args.resume, overwrite=args.overwrite)
    if result.val_loss is not None and int(os.environ.get("RANK", 0)) == 0:
        print(
            f"done: {result.steps} steps, {result.tokens_seen:,} tokens; "
            f"train loss {result.train_loss:.3f}, val loss {result.val_loss:.3f}; "
            f"run saved in {result.run_dir}"
        )


def _check_before_launch(cfg: TrainConfig, args: argparse.Namespace) -> None:
    """What every worker would refuse, refused once here: one line instead of N tracebacks in
    torchrun's report."""
    from gptkiln.checkpoint import check_run_dir_for_training
    from gptkiln.data.prepare import is_prepared
    from gptkiln.data.sources import check_source

    if not is_prepared(cfg.data):
        check_source(cfg.data)
    check_run_dir_for_training(Path(cfg.out), resume=args.resume, overwrite=args.overwrite)


def launch_torchrun(nproc: int) -> None:
    """Re-run this train command under torchrun with ``nproc`` processes on this machine."""
    if nproc < 1:
        raise GptkilnError(f"--nproc must be >= 1, got {nproc}")
    argv = sys.argv[1:]
    rest, skip = [], False
    for a in argv:  # drop --nproc N / --nproc=N, keep everything else as given
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    from gptkiln.launch import launch

    raise SystemExit(launch(nproc, rest))


# -- generate / eval -------------------------------------------------------------------------
def cmd_generate(args: argparse.Namespace) -> None:
    from gptkiln.api import stream_text
    from gptkiln.devices import resolve_device

    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes on the command line
        raise GptkilnError("--prompt is not valid UTF-8 text; pass the prompt in UTF-8") from None
    cfg = SampleConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    notice = lambda msg: print(f"note: {msg}", file=sys.stderr)
    device = resolve_device(args.device)
    pieces = stream_text(
        args.run_dir,
        args.prompt,
        cfg,
        device=device,
        on_notice=notice,
        input=args.input,
        raw=args.raw,
    )
    first = next(pieces, "")  # the run is loaded and the prompt checked before anything is shown
    echo = args.raw or not _instruction_tuned(args.run_dir)  # else: the response alone
    sys.stdout.write((args.prompt if echo else "") + first)
    sys.stdout.flush()
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")


def _instruction_tuned(run_dir: str) -> bool:
    from gptkiln.finetune.runs import run_template
    from gptkiln.loading import read_config

    return run_template(read_config(run_dir), run_dir) is not None


def cmd_eval(args: argparse.Namespace) -> None:
    from gptkiln.api import evaluate_run
    from gptkiln.devices import resolve_device

    r = evaluate_run(
        args.run_dir,
        args.data,
        batch_size=args.batch_size,
        device=resolve_device(args.device),
        progress=not args.quiet,
    )
    print(f"loss {r.loss:.4f} | perplexity {r.perplexity:.2f} | {r.tokens:,} tokens")


# -- inspect ---------------------------------------------------------------------------------
def cmd_inspect(args: argparse.Namespace) -> None:
    from gptkiln.devices import resolve_device
    from gptkiln.inspect import check_view, inspect_run, pick
    from gptkiln.plots import plot_attention

    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes on the command line
        raise GptkilnError("--prompt is not valid UTF-8 text; pass the prompt in UTF-8") from None
    notice = lambda msg: print(f"note: {msg}", file=sys.stderr)
    result = inspect_run(
        args.run_dir,
        args.prompt,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        device=resolve_device(args.device),
    )
    check_view(result, layer=args.layer, head=args.head, position=args.position)
    if result.crop_note():
        notice(result.crop_note())
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
        on_notice=notice,
    )
    print(f"wrote {', '.join(str(f) for f in files)}")
    if args.json:
        print(f"wrote {result.write_json(args.json)}")


# -- finetune / classify / chat --------------------------------------------------------------
# The loop's settings `gptkiln finetune` takes, with their help; the defaults are
# `gptkiln.finetune.train_config`'s (the book's chapters 6-7).
FINETUNE_LOOP_FLAGS = {
    "batch_size": "examples a micro-batch, >= 1",
    "grad_accum": "micro-batches an optimizer step, >= 1",
    "epochs": "passes over the training examples, >= 0 (used when --max-steps is 0)",
    "max_steps": "optimizer steps, >= 0 (0: --epochs decides)",
    "lr": "AdamW learning rate, > 0 (default: 5e-05; 5e-04 with LoRA)",
    "min_lr": "learning rate the cosine decay ends at, in [0, lr]",
    "warmup_steps": "steps of linear warm-up, >= 0",
    "decay_lr": "cosine decay of the learning rate after warm-up (the book: constant)",
    "weight_decay": "AdamW weight decay on matrices, >= 0",
    "grad_clip": "clip the gradient norm to this, >= 0 (0: no clipping)",
    "eval_interval": "evaluate every N steps, >= 1",
    "eval_batches": "batches per split evaluated, >= 1",
    "eval_train": "also evaluate on training examples",
    "sample_interval": "instruct: a response to a held-out entry every N steps, >= 1",
    "sample_tokens": "instruct: tokens of that response, >= 0",
    "checkpoint_interval": "save every N steps, >= 1",
    "seed": "seed of the data order, the new head and the adapters, in [0, 2**63)",
    "device": "auto | cpu | cuda | cuda:N | mps",
    "precision": "auto (bf16 on CUDA) | fp32 | bf16",
    "compile": "run the model under torch.compile",
    "progress": "show a progress bar",
}


def add_finetune_flags(p: argparse.ArgumentParser) -> None:
    """`FinetuneConfig`'s flags, then the loop's (`FINETUNE_LOOP_FLAGS`)."""
    from gptkiln.finetune import FINETUNE_TRAIN_DEFAULTS

    p.add_argument(
        "base", help="the model to start from: a run directory or a Hugging Face GPT-2 directory"
    )
    p.add_argument(
        "--data",
        required=True,
        metavar="FILE",
        help="instruct: a .json list or .jsonl of {instruction, input, output}; "
        "classify: a .csv, .tsv (with a header row) or .jsonl of texts and labels",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="the run directory to write")
    p.add_argument(
        "--task",
        choices=["instruct", "classify"],
        default="instruct",
        help="instruct: follow instructions (the book's ch. 7); classify: a label "
        "per text (ch. 6) (default: instruct)",
    )
    p.add_argument(
        "--template",
        default="alpaca",
        metavar="NAME|FILE",
        help="instruct: the prompt template, 'alpaca' (the book's) or a JSON file "
        "with system, instruction, input, response (default: alpaca)",
    )
    p.add_argument(
        "--mask-prompt",
        action="store_true",
        help="instruct: learn the responses only (no loss on the prompt's tokens)",
    )
    p.add_argument(
        "--text-column",
        default="text",
        metavar="NAME",
        help="classify: the column (or JSON key) of the texts (default: text)",
    )
    p.add_argument(
        "--label-column",
        default="label",
        metavar="NAME",
        help="classify: the column (or JSON key) of the labels (default: label)",
    )
    p.add_argument(
        "--max-length",
        type=int,
        metavar="N",
        help="classify: tokens each text is cut or padded to, 1 to the context "
        "(default: the longest training text's, at most the context)",
    )
    p.add_argument(
        "--val-fraction",
        type=float,
        metavar="F",
        help="share of the examples for validation, in (0, 1) (default: 0.05 "
        "instruct, 0.1 classify)",
    )
    p.add_argument(
        "--test-fraction",
        type=float,
        metavar="F",
        help="share of the examples for testing, in [0, 1) (default: 0.1 instruct, 0.2 classify)",
    )
    p.add_argument(
        "--train-layers",
        default="default",
        metavar="all|last-N|lora",
        help="what trains: all; the last N blocks, final norm and head; or LoRA "
        "adapters (default: all for instruct, last-1 for classify)",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        metavar="R",
        help="LoRA adapters of rank R >= 1 on the attention and MLP projections, "
        "base frozen (default: 0, no LoRA; 16 with --train-layers lora)",
    )
    p.add_argument(
        "--lora-alpha",
        type=float,
        metavar="A",
        help="adapters scaled by A / R, > 0 (peft's convention; the book's alpha "
        "16 at rank 16 is 256) (default: 2 x R)",
    )
    p.add_argument(
        "--lora-qkv",
        choices=["split", "fused"],
        default="split",
        help="split: an adapter per query, key and value (the book's placement); "
        "fused: one on the fused c_attn (Hugging Face's) (default: split)",
    )
    p.add_argument(
        "--lora-head",
        action="store_true",
        help="also put an adapter on the head (the book's appendix E; a classify "
        "head is otherwise trained in full)",
    )
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for name, text in FINETUNE_LOOP_FLAGS.items():
        default = FINETUNE_TRAIN_DEFAULTS.get(name, fields[name].default)
        flag = "--" + name.replace("_", "-")
        shown = "" if name == "lr" else f" (default: {default})"
        if isinstance(default, bool):
            p.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=text + shown,
            )
        else:
            p.add_argument(
                flag,
                type=type(default),
                default=argparse.SUPPRESS,
                metavar=name.upper(),
                help=text + shown,
            )


def finetune_configs_from_args(args: argparse.Namespace):
    """(`FinetuneConfig`, the loop's `TrainConfig`) of a ``gptkiln finetune`` command line."""
    from gptkiln.config import FinetuneConfig
    from gptkiln.finetune import train_config

    names = {f.name for f in dataclasses.fields(FinetuneConfig)}
    ft = FinetuneConfig.from_dict({k: v for k, v in vars(args).items() if k in names})
    loop = {k: v for k, v in vars(args).items() if k in FINETUNE_LOOP_FLAGS}
    return ft, train_config(ft, out=args.out, **loop)


def cmd_finetune(args: argparse.Namespace) -> None:
    from gptkiln.allocator import keep_freed_memory
    from gptkiln.devices import resolve_device
    from gptkiln.finetune import finetune

    ft, cfg = finetune_configs_from_args(args)
    if resolve_device(cfg.device).startswith("cpu"):
        keep_freed_memory()
    result = finetune(ft, cfg, resume=args.resume, overwrite=args.overwrite)
    last = result.history[-1] if result.history else {}
    scores = ", ".join(
        f"{k.replace('_', ' ')} {100 * v:.1f}%"
        if k.endswith("accuracy")
        else f"{k.replace('_', ' ')} {v:.3f}"
        for k, v in last.items()
        if k.endswith(("loss", "accuracy")) and v is not None
    )
    print(f"done: {result.steps} steps; {scores}; run saved in {result.run_dir}")


def cmd_classify(args: argparse.Namespace) -> None:
    from gptkiln.devices import resolve_device
    from gptkiln.finetune.classify import classify

    for p in classify(args.run_dir, args.text, device=resolve_device(args.device)):
        probs = " ".join(f"{c}={v:.3f}" for c, v in p.probabilities.items())
        print(f"{p.label}\t{probs}")


def cmd_chat(args: argparse.Namespace) -> None:
    from gptkiln.chat import Chat, run_chat
    from gptkiln.devices import resolve_device

    cfg = SampleConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    chat = Chat(args.run_dir, cfg, device=resolve_device(args.device))
    run_chat(chat, interactive=not args.plain and sys.stdin.isatty())


# -- convert / download ----------------------------------------------------------------------
def cmd_convert(args: argparse.Namespace) -> None:
    from gptkiln import convert

    if args.direction == "hf":
        convert.import_hf(args.path, args.out, overwrite=args.overwrite)
    elif args.direction == "book":
        convert.import_book(args.path, args.out, n_head=args.n_head, overwrite=args.overwrite)
    elif args.direction == "merge-lora":
        convert.merge_lora(args.path, args.out, overwrite=args.overwrite)
    else:
        convert.export_hf(args.path, args.out, overwrite=args.overwrite)
    print(f"wrote {args.out}")


def cmd_download(args: argparse.Namespace) -> None:
    from gptkiln import convert

    convert.download(args.name, args.out, overwrite=args.overwrite)
    print(f"wrote {args.out}")


# -- the parser ------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="gptkiln", description="Train, run and share GPT-2 style models.")
    parser.add_argument("--version", action="version", version="gptkiln 0.1.0")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    p = sub.add_parser("prepare", help="tokenize a corpus into train.bin / val.bin")
    p.add_argument("source", help="a .txt/.jsonl file, a folder of them, or 'shakespeare'")
    p.add_argument("--tokenizer", default="gpt2", help="gpt2 | char | bpe[:VOCAB_SIZE]")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--threads", type=int, help="encoding threads of the gpt2 tokenizer (default: all cores)"
    )
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser(
        "train",
        help="train a model (no flags: a small model on Shakespeare)",
        description="Train a GPT. Settings come from the defaults, then --config, "
        f"then flags. Model presets: {', '.join(PRESETS)}.",
    )
    p.add_argument("--config", help="a YAML recipe file, or a bundled recipe name")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    p.add_argument("--nproc", type=int, help="launch N processes on this machine via torchrun")
    add_train_flags(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("generate", help="generate text from a run (streams to the terminal)")
    p.add_argument("run_dir", help="a run directory, or an imported Hugging Face GPT-2 directory")
    p.add_argument(
        "--prompt",
        required=True,
        help="the text to continue; for an instruction-tuned run, the instruction",
    )
    p.add_argument(
        "--input",
        default="",
        help="instruction-tuned runs: the instruction's input (default: none)",
    )
    p.add_argument(
        "--raw",
        action="store_true",
        help="send --prompt as it is, without an instruction-tuned run's template",
    )
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("eval", help="loss and perplexity of a run on text")
    p.add_argument("run_dir")
    p.add_argument("--data", required=True, help="a prepared data dir (val split) or a text file")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser(
        "inspect",
        help="attention maps, next-token probabilities and per-token loss of a prompt",
        description="Run a model once on a prompt and show what it does with it: every layer's "
        "and head's attention weights as heat-maps (query tokens down, key tokens across, the "
        "masked future grey), the top-k next tokens after each prompt token, and the loss of "
        "each prompt token given the ones before it, with the perplexity. Layers, heads and "
        "positions count from 0 (layer 0 is h.0); -1 is the last.",
        epilog="example: gptkiln inspect runs/char --prompt 'ROMEO: What' --layer 0 --top-k 3 "
        "--out attention.png --json attention.json",
    )
    p.add_argument("run_dir", help="a run directory, or an imported Hugging Face GPT-2 directory")
    p.add_argument("--prompt", required=True, help="the text to inspect (at least one token)")
    p.add_argument(
        "--layer", type=int, help="draw only this layer, 0 to n_layer-1 (default: every layer)"
    )
    p.add_argument(
        "--head", type=int, help="draw only this head, 0 to n_head-1 (default: every head)"
    )
    p.add_argument(
        "--position",
        type=int,
        help="print the next-token table for this prompt position only, 0 to tokens-1 "
        "(default: every position)",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=5,
        help="next tokens listed per position, 1 to the vocabulary size (default: 5)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=64,
        help="inspect the prompt's first N tokens, N >= 1, at most the model's context; "
        "a longer prompt is cropped with a note (default: 64)",
    )
    p.add_argument(
        "--out",
        default="attention.png",
        help="the heat-map PNG; a grid too large for one figure becomes one file per layer, "
        "OUT with -layerN before .png (default: attention.png)",
    )
    p.add_argument(
        "--json",
        metavar="FILE",
        help="also write tokens, attention weights, top-k and losses as JSON (default: none)",
    )
    p.add_argument("--device", default="cpu", help="cpu | cuda | mps | auto (default: cpu)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("convert", help="Hugging Face / book checkpoints in, Hugging Face out")
    p.add_argument(
        "direction",
        choices=["hf", "book", "to-hf", "merge-lora"],
        help="hf: HF GPT-2 dir -> run; book: the book's model.pth -> run; "
        "to-hf: run -> HF GPT-2 dir; merge-lora: a LoRA run -> a run with the adapters in "
        "its weights",
    )
    p.add_argument("path", help="the directory or file to convert")
    p.add_argument("--out", required=True)
    p.add_argument("--n-head", type=int, default=12, help="heads of a book model (not in its file)")
    p.add_argument("--overwrite", action="store_true", help="replace a model already in --out")
    p.set_defaults(func=cmd_convert)

    example = "example:\n  gptkiln finetune runs/gpt2 --data instructions.json --out runs/instruct"
    p = sub.add_parser(
        "finetune",
        help="fine-tune a model to follow instructions or to classify texts (full or LoRA)",
        description="Fine-tune a run or a Hugging Face GPT-2 model with the loop of `gptkiln "
        "train`: instruction following (the book's chapter 7) or classification (chapter 6), "
        "all layers, the last N, or LoRA adapters (appendix E).",
        epilog=example + "\n  gptkiln finetune runs/gpt2 --task classify --data sms.csv "
        "--lora-rank 16 --out runs/spam",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_finetune_flags(p)
    p.set_defaults(func=cmd_finetune)

    p = sub.add_parser(
        "classify",
        help="the label of texts, by a classifier from `gptkiln finetune --task classify`",
        epilog='example:\n  gptkiln classify runs/spam --text "You won a prize! Call now"',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", help="a run fine-tuned with --task classify")
    p.add_argument(
        "--text",
        action="append",
        required=True,
        help="a text to classify; repeat for more (one line of output each: the "
        "label, a tab, each class's probability)",
    )
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | mps (default: cpu)")
    p.set_defaults(func=cmd_classify)

    p = sub.add_parser(
        "chat",
        help="chat with an instruction-tuned run (streams; /reset, /exit, Ctrl-C stops a reply)",
        description="Chat with a run from `gptkiln finetune` (instruct): each message and the "
        "conversation so far go through the run's prompt template. At a terminal: line "
        "editing, /reset forgets the conversation, /exit or Ctrl-D leaves, Ctrl-C stops a "
        "response. From a pipe (or --plain): a message a line in, each response out.",
        epilog="example:\n  gptkiln chat runs/instruct\n"
        "  printf 'Name a color.\\n/reset\\nName an animal.\\n' | gptkiln chat runs/instruct",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", help="a run fine-tuned with --task instruct")
    p.add_argument(
        "--plain",
        action="store_true",
        help="no prompts or banner, responses only (the default when stdin is not a terminal)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=200,
        help="longest response in tokens, >= 0 (default: 200)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 = greedy (the book's), > 0 samples (default: 0)",
    )
    p.add_argument(
        "--top-k", type=int, help="sample from the k likeliest tokens, >= 1 (default: all)"
    )
    p.add_argument("--top-p", type=float, help="nucleus sampling, in (0, 1] (default: off)")
    p.add_argument("--seed", type=int, help="seed of the sampling, in [0, 2**63) (default: none)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | mps (default: cpu)")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("download", help="download OpenAI's GPT-2 weights (needs internet)")
    p.add_argument("name", help="gpt2 | gpt2-medium | gpt2-large | gpt2-xl")
    p.add_argument("--out", required=True)
    p.add_argument("--overwrite", action="store_true", help="replace a model already in --out")
    p.set_defaults(func=cmd_download)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except GptkilnError as e:
        return _fail(f"gptkiln {args.command}: error: {e}", e.exit_code)
    except KeyboardInterrupt:
        from gptkiln.launch import quiet_on_interrupt

        if not quiet_on_interrupt():
            print(f"gptkiln {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `gptkiln generate ... | head`
        return 0
    except OSError as e:
        if not e.filename:  # not about a path the user gave: a real failure, with its traceback
            raise
        return _fail(  # a path that cannot be read or written: permissions, a full disk, a file
            f"gptkiln {args.command}: error: {e.filename}: {e.strerror or e}; check the path, "
            "its permissions and the free space"
        )
    return 0


def _fail(line: str, code: int = 2) -> int:
    """One line on stderr (under `--nproc`, once for all ranks); exit code 2 for bad input."""
    from gptkiln.launch import report_error

    if not report_error(line):
        print(line, file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
