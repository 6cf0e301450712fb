"""The ``gptkiln`` command: thin subcommands, each parsing flags and calling one library function.

A `GptkilnError` (bad input) prints one line and exits with code 2; so does a bad flag.

One module per command, or per close group, each holding its parser and what runs it:

    common.py    the parser class, help layout, one-line error, and the flags several commands
                 share (--device, --quantize, --out, --overwrite, the sampling flags, RUN, ...)
    prepare.py   prepare                    train.py     train (flags from TrainConfig; --nproc)
    generate.py  generate                   perplexity.py perplexity (loss on text)
    evaluate.py  evaluate (lm-eval tasks)   inspect.py   inspect
    info.py      info
    serve.py     serve                      convert.py   convert, download
    finetune.py  finetune, classify, chat   judge.py     judge

A command's ``add_parser(sub)`` adds its subparser and sets ``func`` to the function that runs
it, so `main` calls ``args.func(args)``; `run` is the program (``gptkiln``, ``python -m
gptkiln``): `main`, then the end of the process. A new command is a module here with those two
functions and one line in `COMMANDS`, where it takes its place in ``gptkiln --help``.
Nothing here imports torch: each command imports its library when it runs.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from gptkiln import __version__
from gptkiln.cli import (
    convert,
    evaluate,
    finetune,
    generate,
    info,
    inspect,
    judge,
    perplexity,
    prepare,
    serve,
    train,
)
from gptkiln.cli.common import (
    HelpFormatter,
    Parser,
    add_quantize_flag,
    example,
    fail,
)
from gptkiln.cli.finetune import FINETUNE_LOOP_FLAGS, add_finetune_flags, finetune_configs_from_args
from gptkiln.cli.generate import read_prompt_file
from gptkiln.cli.train import (
    RECIPES_DIR,
    add_train_flags,
    check_prepared_data_agrees,
    launch_torchrun,
    load_recipe,
    train_config_from_args,
)
from gptkiln.errors import GptkilnError, out_of_space

__all__ = [
    "COMMANDS",
    "EXAMPLES",
    "FINETUNE_LOOP_FLAGS",
    "RECIPES_DIR",
    "HelpFormatter",
    "Parser",
    "add_finetune_flags",
    "add_quantize_flag",
    "add_train_flags",
    "build_parser",
    "check_prepared_data_agrees",
    "example",
    "finetune_configs_from_args",
    "launch_torchrun",
    "load_recipe",
    "main",
    "read_prompt_file",
    "train_config_from_args",
]

# Each command's subparser, in the order `gptkiln --help` lists them.
COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    prepare.add_parser,
    train.add_parser,
    generate.add_parser,
    perplexity.add_parser,
    evaluate.add_parser,
    inspect.add_parser,
    info.add_parser,
    serve.add_parser,
    convert.add_convert_parser,
    finetune.add_finetune_parser,
    finetune.add_classify_parser,
    finetune.add_chat_parser,
    judge.add_parser,
    convert.add_download_parser,
)

EXAMPLES = """\
examples:
  gptkiln train                                       a small Qwen3-shaped model on the plays
  gptkiln generate runs/default --prompt "ROMEO:"     more of the play, as it is written
  gptkiln info runs/default                           what a run holds: model, data, losses
"""


def build_parser() -> argparse.ArgumentParser:
    """The ``gptkiln`` parser with every command of `COMMANDS` (imports no torch)."""
    parser = Parser(
        prog="gptkiln",
        description="Train, run and share GPT-2, Llama 3 and Qwen3 style language models. "
        "'gptkiln COMMAND --help' explains a command and its flags.",
        epilog=EXAMPLES,
    )
    parser.add_argument("--version", action="version", version=f"gptkiln {__version__}")
    sub = parser.add_subparsers(
        dest="command", required=True, parser_class=Parser, title="commands", metavar="COMMAND"
    )
    for add_parser in COMMANDS:
        add_parser(sub)
    parser.commands = sub.choices  # each command's parser, which says what it does not know
    return parser


def _not_utf8(args: argparse.Namespace, command: argparse.ArgumentParser) -> str | None:
    """The first argument whose bytes are not UTF-8 (Python keeps them as surrogates, which
    fail wherever the text is encoded: a tokenizer, a file, a JSON body), as ``command`` names
    it (its flag, or its metavar). An argument documented as ``TEXT`` is always text; of any
    other, the name of a file or folder that is there is not: a Latin-1 file name is good."""
    for action in command._actions:
        value = getattr(args, action.dest, None)
        text_only = action.metavar == "TEXT"
        for text in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(text, str) and (text_only or not os.path.lexists(text)):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    return (
                        action.option_strings[-1]
                        if action.option_strings
                        else (action.metavar or action.dest.upper())
                    )
    return None


def _unrecognized(words: list[str], command: argparse.ArgumentParser) -> str:
    """The usage error of flags a command does not have: named by the command, with the
    nearest flag it has for each misspelt one."""
    import difflib

    flags = [f for f in command._option_string_actions if f.startswith("--")]
    near = []
    for word in words:
        flag = word.split("=", 1)[0]
        if flag.startswith("--") and (close := difflib.get_close_matches(flag, flags, n=1)):
            near.append(f"{flag}: did you mean {close[0]}?")
    return "unrecognized arguments: " + " ".join(words) + "".join(f" ({n})" for n in near)


RENAMED = {"eval": "perplexity"}
"""Commands renamed, their old word -> the new one: the old word is one line naming the new
(``eval`` and ``evaluate`` were two commands with close names: loss on text, and the
lm-evaluation-harness tasks)."""


DECODING = ("generate", "chat", "serve")
"""The commands that decode on the CPU unless told otherwise: they begin loading the CPU
backend's library (`gptkiln.cpu.library.build_soon`) first."""


def _has_gpu() -> bool:
    """Whether an NVIDIA GPU's device files are here (what ``--device auto`` would take), asked
    without importing torch."""
    return os.path.exists("/dev/nvidiactl")


def main(argv: list[str] | None = None) -> int:
    """Run one ``gptkiln`` command line (``argv``; None: this process's); the exit code: 0, 2
    for bad input, 1 for a run stopped from outside, 130 for Ctrl-C."""
    words = sys.argv[1:] if argv is None else list(argv)
    if words and words[0] in RENAMED:
        return fail(
            f"gptkiln {words[0]}: error: renamed; run 'gptkiln {RENAMED[words[0]]}' (same flags)"
        )
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # the command's usage error, not the top-level parser's
        command = parser.commands[args.command]
        command.error(_unrecognized(extra, command))
    if bad := _not_utf8(args, parser.commands[args.command]):
        return fail(
            f"gptkiln {args.command}: error: {bad} is not valid UTF-8 text; pass it in UTF-8"
        )
    args.argv = words  # what `train --nproc` reruns
    device = getattr(args, "device", "auto")
    if args.command in DECODING and (device == "cpu" or (device == "auto" and not _has_gpu())):
        from gptkiln.cpu.library import build_soon

        build_soon()  # the compiler works while torch imports and the model loads
    try:
        args.func(args)
    except GptkilnError as e:
        return fail(f"gptkiln {args.command}: error: {e}", e.exit_code)
    except KeyboardInterrupt as e:
        from gptkiln.launch import quiet_on_interrupt, report_error

        if quiet_on_interrupt():  # under --nproc the launcher says it, in rank 0's words
            report_error(str(e))
        else:  # training says where its last checkpoint is
            said = f" {e}" if str(e) else ""
            print(f"gptkiln {args.command}: interrupted{said}", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `gptkiln generate ... | head`
        return 0
    except (MemoryError, RuntimeError) as e:
        if not _out_of_memory(e):
            raise
        said = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        return fail(
            f"gptkiln {args.command}: error: out of memory ({said}); ask for less where the "
            "command takes it (a smaller model, --batch-size, --context-length), free memory, "
            "or use a machine with more"
        )
    except OSError as e:
        if not e.filename and out_of_space(e):  # a write of a log, a metrics row
            return fail(
                f"gptkiln {args.command}: error: no space left on the device ({e.strerror or e}); "
                "free some space, then run the command again (a run that saved a checkpoint: "
                "with --resume)"
            )
        if not e.filename:  # not about a path the user gave: a real failure, with its traceback
            raise
        return fail(  # a path that cannot be read or written: permissions, a full disk, a file
            f"gptkiln {args.command}: error: {e.filename}: {e.strerror or e}; check the path, "
            "its permissions and the free space"
        )
    return 0


def _out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is a failed allocation: Python's MemoryError, torch's
    OutOfMemoryError (CUDA), or its CPU allocator's RuntimeError ("can't allocate memory")."""
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":
        return True
    return "can't allocate memory" in str(error) or "out of memory" in str(error).lower()


QUICK_EXIT = frozenset({"generate", "perplexity", "info", "inspect"})
"""Commands that leave nothing open or running when they return (their output printed, any
file they write, `inspect`'s PNG and JSON, written and closed). Once one returns, `run` ends
the process at once (`os._exit`, after the atexit handlers and flushing the streams) instead of
letting the interpreter tear torch down module by module: ``python -c "import torch"`` spends
0.35-0.39 s exiting on a 2-core Xeon, a tenth of a 200-token int8 ``generate``. Commands that
train, serve or convert (writers, worker processes, threads) exit as usual."""


def run(argv: list[str] | None = None) -> NoReturn:
    """The ``gptkiln`` program (its console script and ``python -m gptkiln``): `main`, then
    the process ends with its exit code."""
    code = main(argv)
    if "gptkiln.distributed" in sys.modules:  # a torchrun worker may still be in its group
        from gptkiln.distributed import exit_process

        exit_process(code)
    words = sys.argv[1:] if argv is None else argv
    if words and words[0] in QUICK_EXIT:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe (`gptkiln generate ... | head`)
                pass
        os._exit(code)
    sys.exit(code)
