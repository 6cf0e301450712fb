"""The ``gptkiln`` command: thin subcommands, each parsing flags and calling one library function.

A `GptkilnError` (bad input) prints one line and exits with code 2; so does a bad flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from gptkiln.config import TRAIN_GROUPS, SampleConfig, TrainConfig, check_values
from gptkiln.errors import GptkilnError

RECIPES_DIR = Path(__file__).parent / "recipes"


class HelpFormatter(argparse.HelpFormatter):
    """Each flag's help beside it where it fits; a description's lines wrapped to the terminal,
    and indented lines (the examples) kept as written."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap

        lines = [
            indent + line
            if line[:1].isspace() or not line
            else textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent)
            for line in text.splitlines()
        ]
        return "\n".join(lines) + "\n"


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (what, and where to look), exit code 2; help
    keeps its examples' layout (`HelpFormatter`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

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
_METAVARS = {int: "N", float: "X", str: "TEXT"}
_STR_METAVARS = {"data": "PATH", "out": "DIR", "model": "PRESET", "tokenizer": "SPEC"}
_STR_METAVARS |= {"device": "DEVICE", "gelu": "KIND", "max_time": "MINUTES"}


def add_train_flags(p: argparse.ArgumentParser) -> dict[str, Any]:
    """One flag per `TrainConfig` field (``max_steps`` -> ``--max-steps``), in the argument group
    the field names, with the help the field carries and its default. Returns the groups by
    name, for the flags of the command itself."""
    import typing

    groups = {name: p.add_argument_group(name) for name in TRAIN_GROUPS}
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        help = f"{f.metadata.get('help', '')} (default: {_shown_default(f)})".lstrip()
        kind, choices = _flag_type(hints[f.name])
        group = groups.get(f.metadata.get("group"), p)  # tests hold every field to a group
        if kind is bool:
            action = argparse.BooleanOptionalAction
            group.add_argument(flag, action=action, default=argparse.SUPPRESS, help=help)
        else:
            metavar = None if choices else _STR_METAVARS.get(f.name, _METAVARS[kind])
            group.add_argument(
                flag,
                type=kind,
                choices=choices,
                default=argparse.SUPPRESS,
                metavar=metavar,
                help=help,
            )
    return groups


def _flag_type(hint: Any) -> tuple[type, list | None]:
    """(the type argparse converts to, the choices or None) of a field's type hint."""
    import typing

    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Literal:
        return type(args[0]), list(args)
    if args:  # X | None
        return _flag_type(args[0])
    return hint, None


def _shown_default(f: dataclasses.Field) -> str:
    """A field's default as help shows it: what "not set" means for None, on/off for a bool."""
    if f.default is None:
        return f.metadata.get("unset") or "not set"
    if isinstance(f.default, bool):
        return "on" if f.default else "off"
    return str(f.default)


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
            f"train loss {result.train_loss:.3f}, val loss {result.val_loss:.3f} "
            f"({result.val_bpc:.3f} bits/char); "
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


# -- generate / eval / info ------------------------------------------------------------------
def cmd_generate(args: argparse.Namespace) -> None:
    from gptkiln.api import complete, stream_text
    from gptkiln.devices import resolve_device
    from gptkiln.finetune.templates import format_prompt

    prompts = _prompts(args)
    if args.batch_size < 1:  # checked by `complete`, which one streamed prompt does not call
        raise GptkilnError(f"batch_size must be a whole number >= 1, got {args.batch_size}")
    cfg = SampleConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
    )
    notice = lambda msg: print(f"note: {msg}", file=sys.stderr)
    device = resolve_device(args.device)
    template = None if args.raw else _run_template(args.run_dir)
    if len(prompts) == 1 and args.num_samples == 1 and not args.json:  # streams as it comes
        pieces = stream_text(
            args.run_dir,
            prompts[0],
            cfg,
            device=device,
            on_notice=notice,
            input=args.input,
            raw=args.raw,
            quantize=args.quantize,
        )
        first = next(pieces, "")  # the run is loaded and the prompt checked before anything shows
        echo = template is None  # an instruction-tuned run: the response alone
        sys.stdout.write((prompts[0] if echo else "") + first)
        sys.stdout.flush()
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return
    sent = prompts
    if template is not None:  # each prompt an instruction, formatted as stream_text does
        sent = [format_prompt(template, prompt, args.input) for prompt in prompts]
        cfg = dataclasses.replace(cfg, stop=tuple(cfg.stop) + template.stop_strings())
    elif args.input:
        why = "--raw leaves it out" if args.raw else f"{args.run_dir} is not instruction-tuned"
        raise GptkilnError(
            f"--input goes into an instruction-tuned run's prompt template, and {why}; put the "
            "whole prompt in --prompt"
        )
    samples = complete(
        args.run_dir,
        sent,
        cfg,
        num_samples=args.num_samples,
        batch_size=args.batch_size,
        device=device,
        on_notice=notice,
        quantize=args.quantize,
    )
    for s in samples:
        s = dataclasses.replace(s, prompt=prompts[s.prompt_index])  # as given, not formatted
        if args.json:
            print(json.dumps(s.to_dict()))
            continue
        where = [f"prompt {s.prompt_index + 1} of {len(prompts)}"] if len(prompts) > 1 else []
        if args.num_samples > 1:
            where.append(f"sample {s.index + 1} of {args.num_samples}")
        seed = f" (seed {s.seed})" if s.seed is not None else ""
        print(f"--- {', '.join(where)}{seed} ---\n{'' if template else s.prompt}{s.text}")


def _prompts(args: argparse.Namespace) -> list[str]:
    """The prompts of ``--prompt`` (repeated) or ``--prompt-file``, checked to be UTF-8 text."""
    prompts = args.prompt if args.prompt_file is None else read_prompt_file(args.prompt_file)
    for prompt in prompts:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:  # undecodable bytes on the command line
            raise GptkilnError(
                "--prompt is not valid UTF-8 text; pass the prompt in UTF-8"
            ) from None
    return prompts


def read_prompt_file(path: str) -> list[str]:
    """The prompts of a ``--prompt-file``: one a line (``-``: standard input), UTF-8; blank lines
    are skipped, a line's other spaces kept."""
    name = "standard input" if path == "-" else path
    try:
        if path == "-":
            stdin = sys.stdin
            data = stdin.buffer.read() if hasattr(stdin, "buffer") else stdin.read().encode()
        else:
            data = Path(path).read_bytes()
    except FileNotFoundError:
        raise GptkilnError(
            f"--prompt-file {path}: no such file; give a text file with one prompt a line, "
            "or - to read them from standard input"
        ) from None
    except IsADirectoryError:
        raise GptkilnError(
            f"--prompt-file {path} is a directory; give a text file with one prompt a line"
        ) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GptkilnError(
            f"--prompt-file {name}: byte {e.start} is not UTF-8 text; save the file as UTF-8"
        ) from None
    prompts = [line.removesuffix("\r") for line in text.split("\n") if line.strip()]
    if not prompts:
        raise GptkilnError(
            f"--prompt-file {name} holds no prompt (it is empty or blank); write one prompt a line"
        )
    return prompts


def _run_template(run_dir: str):
    """An instruction-tuned run's prompt template (None: the run has none)."""
    from gptkiln.finetune.runs import run_template
    from gptkiln.loading import read_config

    return run_template(read_config(run_dir), run_dir)


def cmd_eval(args: argparse.Namespace) -> None:
    from gptkiln.api import evaluate_run
    from gptkiln.devices import resolve_device

    r = evaluate_run(
        args.run_dir,
        args.data,
        batch_size=args.batch_size,
        device=resolve_device(args.device),
        progress=not args.quiet,
        quantize=args.quantize,
    )
    print(
        f"loss {r.loss:.4f} | perplexity {r.perplexity:.2f} | {r.bits_per_char:.4f} bits/char "
        f"| {r.tokens:,} tokens, {r.characters:,} characters"
    )


# -- info ------------------------------------------------------------------------------------
def cmd_info(args: argparse.Namespace) -> None:
    from gptkiln.api import run_info

    info = run_info(args.path)
    print(json.dumps(info.to_dict(), indent=2) if args.json else info.summary())


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
        quantize=args.quantize,
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


# -- serve -----------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> None:
    from gptkiln.devices import resolve_device
    from gptkiln.serve import serve

    serve(
        args.run_dir,
        host=args.host,
        port=args.port,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        api_key=args.api_key or os.environ.get("GPTKILN_API_KEY") or None,
        max_body_bytes=args.max_body_bytes,
        model_name=args.model_name,
        device=resolve_device(args.device),
        quantize=args.quantize,
    )


# -- convert / download ----------------------------------------------------------------------
def cmd_convert(args: argparse.Namespace) -> None:
    from gptkiln import convert

    if args.direction == "hf":
        convert.import_hf(args.path, args.out, overwrite=args.overwrite)
    elif args.direction == "quantize":
        convert.quantize_run(
            args.path,
            args.out,
            method=args.method,
            embedding_and_head=not args.float_head,
            overwrite=args.overwrite,
        )
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
EXAMPLES = """\
examples:
  gptkiln train                                       a small GPT on the bundled plays
  gptkiln generate runs/default --prompt "ROMEO:"     more of the play, as it is written
  gptkiln info runs/default                           what a run holds: model, data, losses
"""


def add_quantize_flag(p: argparse.ArgumentParser) -> None:
    """``--quantize``, for any command that loads a model (checked by the loader: one line)."""
    p.add_argument(
        "--quantize",
        metavar="METHOD",
        help="int8: int8 weights (per output channel), quantized as the model loads; a run "
        "saved by `convert quantize` loads quantized without it (default: none, as stored)",
    )


def example(*commands: str) -> str:
    """A subcommand's epilog: its example command(s)."""
    return "example:\n" + "".join(f"  {c}\n" for c in commands)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="gptkiln",
        description="Train, run and share GPT-2 style models. "
        "'gptkiln COMMAND --help' explains a command and its flags.",
        epilog=EXAMPLES,
    )
    parser.add_argument("--version", action="version", version="gptkiln 0.1.0")
    sub = parser.add_subparsers(
        dest="command", required=True, parser_class=Parser, title="commands", metavar="COMMAND"
    )

    p = sub.add_parser(
        "prepare",
        help="tokenize a corpus into train.bin / val.bin",
        description="Tokenize a corpus into train.bin, val.bin and meta.json (streaming), for "
        "`gptkiln train --data DIR`.",
        epilog=example("gptkiln prepare shakespeare --tokenizer char --out data/plays-char"),
    )
    p.add_argument(
        "source",
        help='a .txt/.md file, a .jsonl file (a "text" field a line), a folder of them, or '
        "shakespeare (the bundled plays)",
    )
    p.add_argument(
        "--tokenizer",
        default=TrainConfig.tokenizer,  # what `gptkiln train` prepares its text with
        metavar="SPEC",
        help="gpt2 (OpenAI's BPE) | char | bpe:N (a byte-level BPE of N ids trained on the "
        "text; bpe alone: 8192) | a directory with a saved tokenizer (a run, prepared data) "
        "(default: %(default)s, as train's)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="the directory to write (required)")
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.1,
        metavar="X",
        help="share of the text, taken from its end, held out for validation, in (0, 1) "
        "(default: %(default)s)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="threads encoding with the gpt2 tokenizer (>= 1; default: every core)",
    )
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser(
        "train",
        help="train a model (no flags: a small model on Shakespeare)",
        description="Train a GPT. Settings come from the defaults, then --config, then flags; "
        "every flag is also a key of a YAML recipe (max_steps: 600).",
        epilog=example(
            "gptkiln train --data data/plays-char --model baby --max-steps 600 --out runs/char"
        ),
    )
    p.add_argument(
        "--config",
        metavar="RECIPE",
        help="a YAML recipe file, or a bundled recipe: "
        f"{' | '.join(sorted(r.stem for r in RECIPES_DIR.glob('*.yaml')))} "
        "(default: none, the defaults below)",
    )
    groups = add_train_flags(p)
    groups["checkpoints"].add_argument(
        "--resume", action="store_true", help="continue the run in --out from its checkpoint"
    )
    groups["checkpoints"].add_argument(
        "--overwrite", action="store_true", help="start afresh over a run already in --out"
    )
    groups["hardware"].add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="train with N processes on this machine, launched through torchrun (>= 1; "
        "default: this process alone)",
    )
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "generate",
        help="generate text from a run (streams to the terminal)",
        description="Generate text from a run. One prompt streams to the terminal as it is "
        "generated; several prompts (and --num-samples) are generated together, --batch-size "
        "samples at a time, and printed one after another, each sample after a line "
        "'--- prompt P of M, sample S of N (seed X) ---'. --json prints one JSON object a "
        "line instead (JSON Lines): prompt_index, prompt, index (the sample's, from 0), "
        "seed, text (without the prompt), token_ids and finish_reason (stop: end-of-text or "
        "a stop string; length: --max-new-tokens).",
        epilog=example(
            "gptkiln generate runs/char --prompt ROMEO: --prompt JULIET: --num-samples 2 --seed 1"
        ),
    )
    p.add_argument(
        "run_dir",
        metavar="RUN",
        help="a run directory, or an imported Hugging Face GPT-2 directory",
    )
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument(
        "--prompt",
        action="append",
        metavar="TEXT",
        help="text to continue (an instruction-tuned run: the instruction); repeat for "
        'several, generated as one batch ("": start from end-of-text) (default: none; this or '
        "--prompt-file)",
    )
    prompt.add_argument(
        "--prompt-file",
        metavar="FILE",
        help="a UTF-8 file of prompts, one a line (blank lines skipped); - reads standard input "
        "(default: none; this or --prompt)",
    )
    p.add_argument(
        "--input",
        default="",
        metavar="TEXT",
        help="instruction-tuned runs: the instruction's input, the same for every prompt "
        "(default: none)",
    )
    p.add_argument(
        "--raw",
        action="store_true",
        help="send each prompt as it is, without an instruction-tuned run's template",
    )
    p.add_argument(
        "--num-samples",
        type=int,
        default=1,
        metavar="N",
        help="samples per prompt (>= 1); sample j is drawn with seed --seed + j, so sample 0 "
        "is the prompt's own with --seed (default: %(default)s)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=100,
        metavar="N",
        help="tokens to generate at most (>= 0) (default: %(default)s)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        metavar="X",
        help="softmax temperature (>= 0; 0 = greedy) (default: %(default)s)",
    )
    p.add_argument(
        "--top-k",
        type=int,
        metavar="K",
        help="sample from the K most likely tokens only (>= 1) (default: all tokens)",
    )
    p.add_argument(
        "--top-p",
        type=float,
        metavar="P",
        help="sample from the fewest tokens whose probability reaches P, in (0, 1] "
        "(default: all tokens)",
    )
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="end a sample where this text appears, leaving it out; repeatable; a newline in "
        "bash: $'\\n' (default: none)",
    )
    p.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        metavar="X",
        help="lower a token's logit by X once it appeared in the sample, in [-2, 2] "
        "(OpenAI's) (default: %(default)s)",
    )
    p.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        metavar="X",
        help="lower a token's logit by X for each time it appeared in the sample, in [-2, 2] "
        "(OpenAI's) (default: %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=int,
        metavar="N",
        help="seed of the sampling, in [0, 2**63) (default: none, a new draw each run)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=32,
        metavar="N",
        help="samples generated at once (>= 1); lower it for less memory (default: %(default)s)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object a sample, one a line (fields above)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu | cuda | cuda:N | mps | auto (default: %(default)s)",
    )
    add_quantize_flag(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "eval",
        help="loss and perplexity of a run on text",
        description="Cross-entropy loss and perplexity of a run on text, over the text's "
        "non-overlapping context windows.",
        epilog=example("gptkiln eval runs/char --data data/plays-char"),
    )
    p.add_argument(
        "run_dir",
        metavar="RUN",
        help="a run directory, or an imported Hugging Face GPT-2 directory",
    )
    p.add_argument(
        "--data",
        required=True,
        metavar="PATH",
        help="a prepared data folder (its validation split) or a text/.jsonl file, tokenized "
        "with the run's tokenizer (required)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=8,
        metavar="N",
        help="windows per forward pass (>= 1) (default: %(default)s)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu | cuda | cuda:N | mps | auto (default: %(default)s)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_quantize_flag(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser(
        "inspect",
        help="attention maps, next-token probabilities and per-token loss of a prompt",
        description="Run a model once on a prompt and show what it does with it: every layer's "
        "and head's attention weights as heat-maps (query tokens down, key tokens across, the "
        "masked future grey), the top-k next tokens after each prompt token, and the loss of "
        "each prompt token given the ones before it, with the perplexity. Layers, heads and "
        "positions count from 0 (layer 0 is h.0); -1 is the last.",
        epilog=example(
            "gptkiln inspect runs/char --prompt 'ROMEO: What' --layer 0 --top-k 3 "
            "--out attention.png --json attention.json"
        ),
    )
    p.add_argument(
        "run_dir",
        metavar="RUN",
        help="a run directory, or an imported Hugging Face GPT-2 directory",
    )
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
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu | cuda | cuda:N | mps | auto (default: %(default)s)",
    )
    add_quantize_flag(p)
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser(
        "info",
        help="what a run holds: model, tokenizer, data, steps, losses, size",
        description="What a run directory (or an imported Hugging Face GPT-2 one) holds: the "
        "model (its preset, shape and parameters), the tokenizer, the data it was trained on, "
        "steps done of total, tokens seen, the best and last validation loss, the checkpoint's "
        "size and whether it can be resumed. Reads only the files' headers, never the weights.",
        epilog=example("gptkiln info runs/char"),
    )
    p.add_argument(
        "path",
        metavar="RUN",
        help="a run directory, or a Hugging Face GPT-2 directory",
    )
    p.add_argument("--json", action="store_true", help="print it as one JSON object")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser(
        "serve",
        help="serve a model over HTTP: OpenAI's completions API and a web playground",
        description="Serve a run (or a Hugging Face GPT-2 directory) with an OpenAI-compatible "
        "API (POST /v1/completions, GET /v1/models; POST /v1/chat/completions for an "
        "instruction-tuned run, its messages in the run's template), GET /health, GET /metrics "
        "(Prometheus) and a playground page at /. Concurrent requests are batched together as "
        "they come.",
        epilog=example("gptkiln serve runs/default --port 8000")
        + "then open http://127.0.0.1:8000/ or point an OpenAI client at "
        "http://127.0.0.1:8000/v1\n",
    )
    p.add_argument("run_dir", help="a run directory, or an imported Hugging Face GPT-2 directory")
    p.add_argument(
        "--host",
        metavar="ADDRESS",
        default="127.0.0.1",
        help="address to listen on (default: 127.0.0.1, this machine only; any other address "
        "needs --api-key)",
    )
    p.add_argument(
        "--port", type=int, default=8000, metavar="PORT", help="TCP port, 1-65535 (default: 8000)"
    )
    p.add_argument(
        "--max-batch",
        metavar="N",
        type=int,
        default=8,
        help="sequences decoded together, 1-256 (default: 8); each holds a KV-cache row",
    )
    p.add_argument(
        "--max-queue",
        metavar="N",
        type=int,
        default=64,
        help="sequences that may wait for a free row, >= 0 (default: 64); more get HTTP 429",
    )
    p.add_argument(
        "--api-key",
        metavar="KEY",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/ requests (default: $GPTKILN_API_KEY, "
        "else none; required with a non-loopback --host)",
    )
    p.add_argument(
        "--max-body-bytes",
        metavar="BYTES",
        type=int,
        default=1 << 20,
        help="largest request body, >= 1024 bytes (default: 1048576); larger get HTTP 413",
    )
    p.add_argument(
        "--model-name",
        metavar="NAME",
        default=None,
        help="the model id clients send and /v1/models lists (default: the directory's name)",
    )
    p.add_argument("--device", default="cpu", help="cpu | cuda | mps | auto (default: cpu)")
    add_quantize_flag(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "convert",
        help="Hugging Face / book checkpoints in, Hugging Face out",
        description="Convert models: a Hugging Face GPT-2 directory or the book's model.pth "
        "into a run directory, or a run into a directory Hugging Face transformers loads.",
        epilog=example("gptkiln convert to-hf runs/tiny-gpt2 --out exported/tiny-gpt2"),
    )
    p.add_argument(
        "direction",
        choices=["hf", "book", "to-hf", "merge-lora", "quantize"],
        help="hf: HF GPT-2 dir -> run; book: the book's model.pth -> run; "
        "to-hf: run -> HF GPT-2 dir; merge-lora: a LoRA run -> a run with the adapters in "
        "its weights; quantize: run -> int8 run (loads directly)",
    )
    p.add_argument("path", help="the directory or file to convert")
    p.add_argument("--out", required=True, metavar="DIR", help="the directory to write (required)")
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
    p.add_argument("--overwrite", action="store_true", help="replace a model already in --out")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser(
        "finetune",
        help="fine-tune a model to follow instructions or to classify texts (full or LoRA)",
        description="Fine-tune a run or a Hugging Face GPT-2 model with the loop of `gptkiln "
        "train`: instruction following (the book's chapter 7) or classification (chapter 6), "
        "all layers, the last N, or LoRA adapters (appendix E).",
        epilog=example(
            "gptkiln finetune runs/gpt2 --data instructions.json --out runs/instruct",
            "gptkiln finetune runs/gpt2 --task classify --data sms.csv --lora-rank 16 "
            "--out runs/spam",
        ),
    )
    add_finetune_flags(p)
    p.set_defaults(func=cmd_finetune)

    p = sub.add_parser(
        "classify",
        help="the label of texts, by a classifier from `gptkiln finetune --task classify`",
        epilog=example('gptkiln classify runs/spam --text "You won a prize! Call now"'),
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
        epilog=example("gptkiln chat runs/instruct --temperature 0.7 --seed 1"),
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

    p = sub.add_parser(
        "download",
        help="download OpenAI's GPT-2 weights (needs internet)",
        description="Download OpenAI's GPT-2 weights from the Hugging Face Hub into a run "
        "directory.",
        epilog=example("gptkiln download gpt2 --out runs/gpt2"),
    )
    p.add_argument("name", help="gpt2 (124M) | gpt2-medium | gpt2-large | gpt2-xl (1.5B)")
    p.add_argument("--out", required=True, metavar="DIR", help="the directory to write (required)")
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
