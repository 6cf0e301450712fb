"""What every command's module shares: the parser class and its help layout, the one-line error,
the example epilog, and the flags several commands take, each defined here once.

A flag whose wording differs between commands takes that wording as a parameter, so the
commands' ``--help`` stays as it reads (tests/golden/help). Nothing here imports torch: the
whole parser is built before a command imports its library.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import textwrap
from collections.abc import Iterable, Iterator
from typing import Any

from gptkiln.config import SampleConfig
from gptkiln.config.sample import MODEL_SAMPLING, sampling_said


class HelpFormatter(argparse.HelpFormatter):
    """Each flag's help beside it where it fits; a description's lines wrapped to the terminal,
    and indented lines (the examples) kept as written."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)

    def add_argument(self, action: argparse.Action) -> None:
        """argparse measures a command's name in a list of commands without the list's own
        indent, so a name longer than the flags (``perplexity``) would wrap under its help."""
        super().add_argument(action)
        if action.help is not argparse.SUPPRESS and hasattr(action, "_get_subactions"):
            names = [self._format_action_invocation(a) for a in action._get_subactions()]
            indent = self._current_indent + self._indent_increment
            self._action_max_length = max(
                self._action_max_length, max(map(len, names), default=0) + indent
            )

    def _fill_text(self, text: str, width: int, indent: str) -> str:
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


def example(*commands: str) -> str:
    """A subcommand's epilog: its example command(s)."""
    return "example:\n" + "".join(f"  {c}\n" for c in commands)


def fail(line: str, code: int = 2) -> int:
    """One line on stderr (under `--nproc`, once for all ranks); exit code 2 for bad input."""
    from gptkiln.launch import report_error

    if not report_error(line):
        print(line, file=sys.stderr)
    return code


def note(message: str) -> None:
    """A library's notice (a cropped prompt, a fallback taken), on stderr, apart from output."""
    print(f"note: {message}", file=sys.stderr)


def keep_freed_memory_on_cpu(device: str) -> None:
    """Training on the CPU in our own process: keep freed blocks (no page faults per step)."""
    from gptkiln.allocator import keep_freed_memory
    from gptkiln.devices import resolve_device

    if resolve_device(device).startswith("cpu"):
        keep_freed_memory()


# -- flags several commands take --------------------------------------------------------------
RUN_HELP = "a run directory, or a Hugging Face model directory (GPT-2, Llama 3 or Qwen3)"


NOT_CARRIED_ON_RESUME = ("out", "progress", "precision", "device", "compile", "parallel")
"""Settings a resume never takes from the run's record: where it is (given), the bar, the
machine's (device, compile, how its processes share the model: this machine's defaults, as
for a new run), and the precision (recorded as resolved: the trainer keeps the run's own
unless another is asked)."""


def recorded_settings(out: str, names, section: str = "train") -> dict[str, Any]:
    """What the run in ``out`` recorded (its config.json's ``train``, or a fine-tuning's
    ``finetune`` ``config``) of the settings ``names``: a resume continues with them where no
    flag or recipe gives another (text it prepared into its own ``data/``: that folder). {}
    where nothing is recorded (no run there yet: the resume itself then says so)."""
    import json
    from pathlib import Path

    try:
        recorded = json.loads((Path(out) / "config.json").read_text(encoding="utf-8"))
        recorded = recorded["train"] if section == "train" else recorded[section]["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    if not isinstance(recorded, dict):
        return {}
    carried = {k: v for k, v in recorded.items() if k in names and k not in NOT_CARRIED_ON_RESUME}
    own = Path(out) / "data"
    if "data" in carried and (own / "meta.json").is_file():
        # text the run prepared into its data/: those tokens, not the path as it was typed
        # (relative to another directory, perhaps; another file of that name, perhaps)
        carried["data"] = str(own)
    return carried


def add_run_argument(
    p: argparse.ArgumentParser, help: str = RUN_HELP, metavar: str | None = "RUN"
) -> None:
    """The model a command loads, as ``args.run_dir``."""
    p.add_argument("run_dir", metavar=metavar, help=help)


def add_device_flag(
    p: argparse.ArgumentParser, devices: str = "cpu | cuda | cuda:N | mps | auto"
) -> None:
    """``--device`` of a command that loads a model to use it (default cpu); ``devices`` is the
    list its help shows. (``train`` and ``finetune`` take theirs from `TrainConfig`.)"""
    p.add_argument("--device", default="cpu", help=f"{devices} (default: %(default)s)")


def add_quantize_flag(p: argparse.ArgumentParser) -> None:
    """``--quantize``, for any command that loads a model (checked by the loader: one line)."""
    p.add_argument(
        "--quantize",
        metavar="METHOD",
        help="int8: int8 weights (per output channel), quantized as the model loads; a run "
        "saved by `convert quantize` loads quantized without it (default: none, as stored)",
    )


def add_precision_flag(p: argparse.ArgumentParser) -> None:
    """``--precision``, for the commands that decode (generate, chat, serve): what the CPU
    backend decodes at, and on a GPU the weights' dtype (`gptkiln.cpu.ready_for_decoding`
    checks it against the run)."""
    p.add_argument(
        "--precision",
        choices=("fp32", "bf16", "int8"),
        help="what a CPU decodes at: fp32 (exact), bf16 (bf16 weights, fp32 activations, as "
        "llama.cpp's bf16 file), int8 (int8 weights, as its q8_0; activations in 8 bits "
        "where the CPU has AVX-512 VNNI, in fp32 elsewhere; "
        "quantizes a float run as it loads) (default: the run's own: int8 for a quantized "
        "run, bf16 for a bf16 one, else fp32); on a GPU, fp32 or bf16 casts the weights to it",
    )


def add_out_flag(p: argparse.ArgumentParser, help: str = "the directory to write (required)"):
    """``--out DIR``, required: where a command writes what it makes."""
    p.add_argument("--out", required=True, metavar="DIR", help=help)


def add_overwrite_flag(
    p: argparse.ArgumentParser | argparse._ArgumentGroup,
    help: str = "replace a model already in --out",
) -> None:
    """``--overwrite``: replace what ``--out`` holds instead of refusing to."""
    p.add_argument("--overwrite", action="store_true", help=help)


def add_quiet_flag(p: argparse.ArgumentParser) -> None:
    """``--quiet``: no progress bar (``args.quiet``; the library takes ``progress=not quiet``)."""
    p.add_argument("--quiet", action="store_true", help="no progress bar")


# The sampling flags, in the order a command lists them: (type, metavar). Each is a field of
# `SampleConfig`, which `sample_config` builds from those a command has.
SAMPLING_FLAGS: dict[str, tuple[type, str]] = {
    "max_new_tokens": (int, "N"),
    "temperature": (float, "X"),
    "top_k": (int, "K"),
    "top_p": (float, "P"),
    "min_p": (float, "P"),
    "stop": (str, "TEXT"),
    "repetition_penalty": (float, "X"),
    "presence_penalty": (float, "X"),
    "frequency_penalty": (float, "X"),
    "seed": (int, "N"),
}


def add_sampling_flags(
    p: argparse.ArgumentParser,
    helps: dict[str, str],
    defaults: dict[str, Any],
) -> None:
    """The `SAMPLING_FLAGS` that ``helps`` names (``--max-new-tokens`` for ``max_new_tokens``),
    in that order, each with its help.

    Args:
        p: the command's parser.
        helps: {field: help} of the flags the command takes.
        defaults: {field: default} where the command's differs from `SampleConfig`'s.
    """
    fields = {f.name: f.default for f in dataclasses.fields(SampleConfig)}
    fallback = {}  # what a flag of `MODEL_SAMPLING` not given is where the model sets none
    for name, (kind, metavar) in SAMPLING_FLAGS.items():
        if name not in helps:
            continue
        if name == "stop":  # repeatable: each --stop adds one
            value: dict[str, Any] = dict(action="append", default=[])
        elif name in MODEL_SAMPLING:  # unset: the model's generation_config.json, else this
            fallback[name] = defaults.get(name, fields[name])
            value = dict(type=kind, default=None)
        else:
            value = dict(type=kind, default=defaults.get(name, fields[name]))
        flag = "--" + name.replace("_", "-")
        p.add_argument(flag, metavar=metavar, help=helps[name], **value)
    p.set_defaults(sampling_fallback=fallback)


def sample_config(args: argparse.Namespace, model: dict[str, Any] | None = None) -> SampleConfig:
    """The `SampleConfig` of a command's sampling flags (`add_sampling_flags`): a flag given;
    else, for `MODEL_SAMPLING`, what ``model`` (`model_sampling`: the run's
    generation_config.json) sets, else the command's default; a flag the command does not take
    keeps `SampleConfig`'s default. A bad value is named by its flag (``--presence-penalty``),
    not by the field it sets."""
    values = {name: getattr(args, name) for name in SAMPLING_FLAGS if name in args}
    for name, default in getattr(args, "sampling_fallback", {}).items():
        if values.get(name) is None:
            values[name] = (model or {}).get(name, default)
    with named_by_flag(SAMPLING_FLAGS):
        return SampleConfig(**values)


def model_sampling_note(args: argparse.Namespace, run_dir, model: dict[str, Any]) -> str | None:
    """The note that says which sampling settings came from the run's generation_config.json
    (the flags not given that it sets), or None."""
    taken = {
        name: value
        for name, value in model.items()
        if name in getattr(args, "sampling_fallback", {}) and getattr(args, name, None) is None
    }
    if not taken:
        return None
    said = sampling_said(taken, lambda field: field.replace("_", " "))
    return f"sampling as {run_dir}'s generation_config.json sets it: {said} (a flag overrides it)"


class PendingNotes:
    """Notes said before the first of a library's own (``on_notice``: after the run loaded), or
    at `flush`: a run that fails to load says its one error line only."""

    def __init__(self, *texts: str | None) -> None:
        self.texts = [t for t in texts if t]

    def __call__(self, text: str) -> None:
        self.flush()
        note(text)

    def flush(self) -> None:
        for text in self.texts:
            note(text)
        self.texts.clear()


@contextlib.contextmanager
def named_by_flag(fields: Iterable[str]) -> Iterator[None]:
    """A `GptkilnError` that names one of ``fields`` first (``max_length must be ...``) names
    its flag instead (``--max-length must be ...``): what the user typed."""
    from gptkiln.errors import GptkilnError

    try:
        yield
    except GptkilnError as e:
        said = str(e)
        name = next((n for n in fields if said.startswith(f"{n} ")), None)
        if name is None:
            raise
        raise GptkilnError(f"--{name.replace('_', '-')}{said[len(name) :]}") from None
