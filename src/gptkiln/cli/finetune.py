"""``gptkiln finetune``, and the commands that use what it makes: ``classify`` (a classifier's
labels) and ``chat`` (an instruction-tuned run, a conversation). `gptkiln.finetune` and
`gptkiln.chat` do the work."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from pathlib import Path

from gptkiln.cli.common import (
    add_device_flag,
    add_overwrite_flag,
    add_precision_flag,
    add_run_argument,
    add_sampling_flags,
    example,
    keep_freed_memory_on_cpu,
    model_sampling_note,
    named_by_flag,
    recorded_settings,
    sample_config,
)
from gptkiln.cli.judge import add_judge_endpoint_flags, judge_of, print_verdict
from gptkiln.cli.train import flag_shape
from gptkiln.config import FinetuneConfig, TrainConfig


def add_finetune_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "finetune",
        help="fine-tune a model to follow instructions, classify, chat or prefer (full or LoRA)",
        description="Fine-tune a run or a Hugging Face model (GPT-2, Llama 3 or Qwen3) with the "
        "loop of `gptkiln train`: instruction following (the book's chapter 7), classification "
        "(chapter 6), chat on conversations in the model's own template, or preference tuning "
        "(DPO, the chapter's bonus); all layers, the last N, or LoRA adapters (appendix E), "
        "which a LoRA run stores with a reference to its base.",
        epilog=example(
            "gptkiln finetune runs/gpt2 --data instructions.json --out runs/instruct",
            "gptkiln finetune runs/gpt2 --task classify --data sms.csv --lora-rank 16 "
            "--out runs/spam",
            "gptkiln finetune Qwen3-0.6B --task chat --data chats.jsonl --show-examples 2",
            "gptkiln finetune runs/instruct --task dpo --data pairs.json --beta 0.1 --out runs/dpo",
        ),
    )
    add_finetune_flags(p)
    p.set_defaults(func=run_finetune)


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
    "sample_interval": "instruct, chat, dpo: a response to a held-out entry every N steps, >= 1",
    "sample_tokens": "instruct, chat, dpo: tokens of that response, >= 0",
    "checkpoint_interval": "save every N steps, >= 1",
    "seed": "seed of the data order, the new head and the adapters, in [0, 2**63)",
    "device": "auto | cpu | cuda | cuda:N | mps",
    "precision": "auto (bf16 on CUDA, and on a CPU with AMX or AVX512-BF16 where a short "
    "measurement finds it faster) | fp32 | bf16",
    "compile": "run the model under torch.compile",
    "progress": "show a progress bar",
}


def add_finetune_flags(p: argparse.ArgumentParser) -> None:
    """`FinetuneConfig`'s flags (the model, the data and the task; what trains), then the
    loop's (`FINETUNE_LOOP_FLAGS`)."""
    _add_data_flags(p)
    _add_task_flags(p)
    _add_split_flags(p)
    _add_trainable_flags(p)
    p.add_argument(
        "--show-examples",
        type=int,
        metavar="N",
        help="instruct, chat, dpo: print the first N training examples (dpo: pairs, chosen then "
        "rejected) with the trained text between « and », then exit without training "
        "(default: none, train)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='with --show-examples: one JSON object a line, {"ids": [...], "trained": [...]} '
        '(dpo: with "answer": "chosen" or "rejected"); with --judge-url: end with the judge\'s '
        'JSON line {"mean", "scored", "unparsed", "entries"}',
    )
    add_judge_endpoint_flags(p, after_training=True)
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out, with its recorded settings (--task, --lora-rank, "
        "--lr, ...) for each flag not given (the base and --data are given again)",
    )
    add_overwrite_flag(p, help="replace a run already in --out")
    _add_loop_flags(p)
    # a setting not given stays out of ``args``: FinetuneConfig's default, or on --resume the
    # run's own (the helps say the defaults, which are FinetuneConfig's)
    for action in p._actions:
        if action.dest in RESUMED_SETTINGS:
            action.default = argparse.SUPPRESS


# FinetuneConfig's settings a resume takes from the run where no flag gives another: all but
# the base and the data, given each time (and the data's contents checked against the run's).
RESUMED_SETTINGS = tuple(
    f.name for f in dataclasses.fields(FinetuneConfig) if f.name not in ("base", "data")
)


def _add_data_flags(p: argparse.ArgumentParser) -> None:
    """The model to start from, the examples, the task and its template."""
    p.add_argument(
        "base",
        help="the model to start from: a run directory or a Hugging Face model directory "
        "(GPT-2, Llama 3 or Qwen3)",
    )
    p.add_argument(
        "--data",
        required=True,
        metavar="FILE",
        help="instruct: a .json list or .jsonl of {instruction, input, output}; "
        "classify: a .csv, .tsv (with a header row) or .jsonl of texts and labels; chat: "
        ".json, .jsonl, .parquet or hf:NAME[:CONFIG][@SPLIT] of {messages} or ShareGPT "
        "{conversations}; dpo: the same of {prompt, chosen, rejected}",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        help="the run directory to write (default: none; required unless --show-examples)",
    )
    p.add_argument(
        "--task",
        choices=["instruct", "classify", "chat", "dpo"],
        default="instruct",
        help="instruct: follow instructions (the book's ch. 7); classify: a label "
        "per text (ch. 6); chat: conversations, loss on the assistant's turns; dpo: "
        "preference pairs (default: instruct)",
    )
    p.add_argument(
        "--template",
        default="alpaca",
        metavar="NAME|FILE",
        help="instruct: the prompt template, 'alpaca' (the book's) or a JSON file "
        "with system, instruction, input, response (default: alpaca); chat, dpo: a .jinja "
        "chat template (default: the model's own, else ChatML)",
    )


def _add_task_flags(p: argparse.ArgumentParser) -> None:
    """What one task makes of its examples: masks, columns, lengths, packing, DPO's loss."""
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
        "(default: the longest training text's, at most the context); chat, dpo: the longest "
        "example (longer ones are cut after a turn, or dropped) (default: the context)",
    )
    p.add_argument(
        "--pack",
        action="store_true",
        help="instruct, chat: pack short training examples end to end into windows of "
        "--max-length (chat) or the context, none attending another; --batch-size then counts "
        "windows (default: off, one example a row)",
    )
    p.add_argument(
        "--beta",
        type=float,
        default=0.1,
        metavar="B",
        help="dpo: how strongly the model is held to the reference, > 0 (default: 0.1)",
    )
    p.add_argument(
        "--dpo-loss",
        choices=["sigmoid", "ipo"],
        default="sigmoid",
        help="dpo: sigmoid (the DPO paper's) or ipo (default: sigmoid)",
    )


def _add_split_flags(p: argparse.ArgumentParser) -> None:
    """The shares of the examples held out for validation and testing."""
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


def _add_trainable_flags(p: argparse.ArgumentParser) -> None:
    """What trains: all, the last blocks, or LoRA adapters (and where they go)."""
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


def _add_loop_flags(p: argparse.ArgumentParser) -> None:
    """`FINETUNE_LOOP_FLAGS`, each defaulting to `gptkiln.finetune`'s (the book's) value, else
    `TrainConfig`'s; a flag not given stays out of ``args`` (`train_config` fills it in)."""
    from gptkiln.finetune import FINETUNE_TRAIN_DEFAULTS

    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    hints = typing.get_type_hints(TrainConfig)
    for name, text in FINETUNE_LOOP_FLAGS.items():
        default = FINETUNE_TRAIN_DEFAULTS.get(name, fields[name].default)
        flag = "--" + name.replace("_", "-")
        said = ("on" if default else "off") if isinstance(default, bool) else default
        shown = "" if name == "lr" else f" (default: {said})"  # lr: its help names both
        kind, choices, metavar = flag_shape(name, hints)
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
                type=kind,
                choices=choices,
                default=argparse.SUPPRESS,
                metavar=metavar,
                help=text + shown,
            )


def finetune_configs_from_args(
    args: argparse.Namespace,
) -> tuple[FinetuneConfig, TrainConfig]:
    """(`FinetuneConfig`, the loop's `TrainConfig`) of a ``gptkiln finetune`` command line."""
    from gptkiln.config.finetune import read_fields
    from gptkiln.errors import GptkilnError
    from gptkiln.finetune import train_config

    names = {f.name for f in dataclasses.fields(FinetuneConfig)}
    settings = {k: v for k, v in vars(args).items() if k in names}
    loop = {k: v for k, v in vars(args).items() if k in FINETUNE_LOOP_FLAGS}
    if not args.out:
        raise GptkilnError("gptkiln finetune: --out DIR is required (the run directory to write)")
    if args.resume:  # the run's own settings and loop, where no flag gives another
        recorded = recorded_settings(args.out, RESUMED_SETTINGS, section="finetune")
        other = [k for k in ("task", "train_layers") if k in settings and k in recorded
                 and settings[k] != recorded[k]]  # fmt: skip
        if other:  # another task or kind of training: not this run's to go on with
            asked = ", ".join(f"--{k.replace('_', '-')} {settings[k]}" for k in other)
            was = ", ".join(f"--{k.replace('_', '-')} {recorded[k]}" for k in other)
            raise GptkilnError(
                f"cannot resume {args.out}: it was fine-tuned with {was}, and this resume asks "
                f"for {asked}; drop it to go on, or start again with --overwrite in place of "
                "--resume"
            )
        settings = {**read_fields(recorded), **settings}  # (read_fields: only its task's)
        given = loop
        loop = {**recorded_settings(args.out, FINETUNE_LOOP_FLAGS), **given}
        if "epochs" in given and "max_steps" not in given:
            loop["max_steps"] = 0  # --epochs N alone: the epochs decide, as on a new run
    from gptkiln.finetune.templates import TEMPLATES

    template = settings.get("template")
    if template and template not in TEMPLATES and Path(template).is_file():  # recorded whole
        settings["template"] = str(Path(template).resolve())
    with named_by_flag([*(names - {"base"}), *FINETUNE_LOOP_FLAGS]):  # --max-length, not max_length
        ft = FinetuneConfig.from_dict(settings)
        return ft, train_config(ft, out=args.out, **loop)


def run_finetune(args: argparse.Namespace) -> None:
    from gptkiln.finetune import finetune

    if args.show_examples is not None:
        _show_examples(args)
        return
    ft, cfg = finetune_configs_from_args(args)
    judge = _judge_after_training(args, ft)  # its flags checked before hours of training
    keep_freed_memory_on_cpu(cfg.device)
    result = finetune(ft, cfg, resume=args.resume, overwrite=args.overwrite)
    if not result.trained:  # the line said why; the run is as it was
        return
    last = result.history[-1] if result.history else {}
    scores = ", ".join(
        f"{k.replace('_', ' ')} {100 * v:.1f}%"
        if k.endswith("accuracy")
        else f"{k.replace('_', ' ')} {v:.3f}"
        for k, v in last.items()
        if k.endswith(("loss", "accuracy")) and v is not None
    )
    print(f"done: {result.steps} steps; {scores}; run saved in {result.run_dir}")
    if judge is not None and os.environ.get("RANK", "0") == "0":
        from gptkiln.devices import resolve_device
        from gptkiln.finetune.judging import judge_run

        progress = cfg.progress and sys.stderr.isatty()
        verdict = judge_run(
            result.run_dir,
            judge,
            max_new_tokens=args.judge_answer_tokens,
            device=resolve_device(cfg.device),
            progress=progress,
        )
        print_verdict(verdict, args.json)


def _judge_after_training(args: argparse.Namespace, ft: FinetuneConfig):
    """The judge of --judge-url and --judge-model (None without them)."""
    from gptkiln.errors import GptkilnError

    if args.judge_url is None and args.judge_model is None:
        return None
    if args.judge_url is None or args.judge_model is None:
        raise GptkilnError("--judge-url and --judge-model go together: give both, or neither")
    if ft.task == "classify" or ft.test_fraction == 0:
        raise GptkilnError(
            "--judge-url scores answers to the run's test split: fine-tune an instruct, chat "
            "or dpo task with a --test-fraction above 0, or judge later with gptkiln judge --data"
        )
    return judge_of(args)


def _show_examples(args: argparse.Namespace) -> None:
    from gptkiln.errors import GptkilnError
    from gptkiln.finetune.show import show_examples

    if args.show_examples < 1:
        raise GptkilnError(f"--show-examples {args.show_examples}: give N >= 1 examples to show")
    names = {f.name for f in dataclasses.fields(FinetuneConfig)}
    ft = FinetuneConfig.from_dict({k: v for k, v in vars(args).items() if k in names})
    for text in show_examples(ft, args.show_examples, as_json=args.json):
        print(text)


def add_classify_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "classify",
        help="the label of texts, by a classifier from `gptkiln finetune --task classify`",
        description="Label texts with a classifier fine-tuned by `gptkiln finetune --task "
        "classify`: one line a text, its label, a tab, and each class's probability.",
        epilog=example('gptkiln classify runs/spam --text "You won a prize! Call now"'),
    )
    add_run_argument(p, help="a run fine-tuned with --task classify")
    p.add_argument(
        "--text",
        action="append",
        required=True,
        help="a text to classify; repeat for more (one line of output each: the "
        "label, a tab, each class's probability)",
    )
    add_device_flag(p)
    p.set_defaults(func=run_classify)


def run_classify(args: argparse.Namespace) -> None:
    from gptkiln.devices import resolve_device
    from gptkiln.finetune.classify import classify

    for prediction in classify(args.run_dir, args.text, device=resolve_device(args.device)):
        probs = " ".join(f"{c}={v:.3f}" for c, v in prediction.probabilities.items())
        print(f"{prediction.label}\t{probs}")


# chat's sampling flags (`common.add_sampling_flags`): greedy by default, as the book's chapter 7
# generates its responses, where the run's generation_config.json sets no sampling of its own.
CHAT_SAMPLING_HELP = {
    "max_new_tokens": "longest response in tokens, >= 0 (default: 200)",
    "temperature": "0 = greedy (the book's), > 0 samples (default: the run's "
    "generation_config.json's, as for top-k, top-p, min-p and the repetition penalty; else 0)",
    "top_k": "sample from the k likeliest tokens, >= 1 (0: all) (default: all)",
    "top_p": "nucleus sampling, in (0, 1] (default: off)",
    "min_p": "drop the tokens less likely than P times the likeliest, in [0, 1] (default: off)",
    "stop": "end a response where this text appears, leaving it out; repeatable (the "
    "template's own turn ends stop it too) (default: none)",
    "repetition_penalty": "divide the logit of each token of the conversation or the response "
    "by X (multiply where negative), > 0; e.g. 1.1 (default: 1, off)",
    "presence_penalty": "lower a token's logit by X once it appeared in the response, in "
    "[-2, 2] (OpenAI's) (default: 0)",
    "frequency_penalty": "lower a token's logit by X for each time it appeared in the "
    "response, in [-2, 2] (OpenAI's) (default: 0)",
    "seed": "seed of the sampling, in [0, 2**63) (default: none)",
}
CHAT_SAMPLING_DEFAULTS = {"max_new_tokens": 200, "temperature": 0.0}


def add_chat_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat",
        help="chat with an instruction-tuned run (streams; /reset, /exit, Ctrl-C stops a reply)",
        description="Chat with a run from `gptkiln finetune` (instruct, chat or dpo), or a model "
        "with a chat template of its own (a Hugging Face instruct model): each message and the "
        "conversation so far go through the run's template. At a terminal: line "
        "editing, /reset forgets the conversation, /exit or Ctrl-D leaves, Ctrl-C stops a "
        "response. From a pipe (or --plain): a message a line in, each response out; --jsonl: "
        "JSON lines both ways.",
        epilog=example("gptkiln chat runs/instruct --temperature 0.7 --seed 1"),
    )
    add_run_argument(
        p, help="a fine-tuned run (instruct, chat or dpo), or a model with a chat template"
    )
    p.add_argument(
        "--plain",
        action="store_true",
        help="no prompts or banner, responses only (the default when stdin is not a terminal)",
    )
    p.add_argument(
        "--jsonl",
        action="store_true",
        help='for scripts: each line in a JSON string or {"role": "user", "content": ...} (a '
        'message may hold newlines) or {"command": "reset"} / {"command": "exit"}, each '
        'response out whole as one JSON line {"role": "assistant", "content": ...}',
    )
    add_sampling_flags(p, CHAT_SAMPLING_HELP, CHAT_SAMPLING_DEFAULTS)
    add_device_flag(p)
    add_precision_flag(p)
    p.set_defaults(func=run_chat)


def run_chat(args: argparse.Namespace) -> None:
    from gptkiln import chat
    from gptkiln.config.sample import model_sampling
    from gptkiln.devices import resolve_device

    device = resolve_device(args.device)
    model = model_sampling(args.run_dir)
    cfg = sample_config(args, model)
    session = chat.Chat(args.run_dir, cfg, device=device, precision=args.precision)
    if said := model_sampling_note(args, args.run_dir, model):  # the run loaded: said now
        session.on_notice(said)
    interactive = not (args.plain or args.jsonl) and sys.stdin.isatty()
    chat.run_chat(session, interactive=interactive, jsonl=args.jsonl)
