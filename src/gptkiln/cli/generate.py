"""``gptkiln generate``: text from a run, streamed for one prompt, batched for several
(`gptkiln.api.stream_text` and `gptkiln.api.complete`)."""

from __future__ import annotations

import argparse
import codecs
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gptkiln.cli.common import (
    PendingNotes,
    add_device_flag,
    add_precision_flag,
    add_quantize_flag,
    add_run_argument,
    add_sampling_flags,
    example,
    model_sampling_note,
    note,
    sample_config,
)
from gptkiln.config import SampleConfig
from gptkiln.errors import GptkilnError

if TYPE_CHECKING:
    from gptkiln.finetune.templates import PromptTemplate

# The sampling flags' help (`common.add_sampling_flags`); the defaults are `SampleConfig`'s but
# for a temperature of 0.8; those of `MODEL_SAMPLING` the run's generation_config.json's first.
SAMPLING_HELP = {
    "max_new_tokens": "tokens to generate at most (>= 0); past the model's context the window "
    "slides, and a note says so (default: %(default)s)",
    "temperature": "softmax temperature (>= 0; 0 = greedy) (default: 0.8)",
    "top_k": "sample from the K most likely tokens only (>= 1; 0: all) (default: all tokens)",
    "top_p": "sample from the fewest tokens whose probability reaches P, in (0, 1] "
    "(default: all tokens)",
    "min_p": "drop the tokens less likely than P times the likeliest, in [0, 1] (e.g. 0.05) "
    "(default: off)",
    "stop": "end a sample where this text appears, leaving it out; repeatable; a newline in "
    "bash: $'\\n' (default: none)",
    "repetition_penalty": "divide the logit of each token of the prompt or the sample by X "
    "(multiply where negative), > 0; e.g. 1.1 discourages repeats (default: 1, off)",
    "presence_penalty": "lower a token's logit by X once it appeared in the sample, in [-2, 2] "
    "(OpenAI's) (default: %(default)s)",
    "frequency_penalty": "lower a token's logit by X for each time it appeared in the sample, "
    "in [-2, 2] (OpenAI's) (default: %(default)s)",
    "seed": "seed of the sampling, in [0, 2**63) (default: none, a new draw each run)",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text from a run (streams to the terminal)",
        description="Generate text from a run. One prompt streams to the terminal as it is "
        "generated; several "
        "prompts (and --num-samples) are generated together, --batch-size samples at a time, and "
        "printed one after another, each sample after a line '--- prompt P of M, sample S of N "
        "(seed X) ---' (each part where there are several). --json prints one JSON object a line "
        "instead (JSON Lines): prompt_index, prompt, index (the sample's, from 0), seed, text "
        "(without the prompt), token_ids (every token generated: a stop string's and an "
        "end-of-text that ended it too, as Hugging Face and vLLM give them) and finish_reason "
        "(stop: end-of-text or a stop string; length: --max-new-tokens). A prompt and its new "
        "tokens may pass the model's context: the window then slides, each new token seeing only "
        "the last context-length tokens (as the book's generate does), and a note on stderr says "
        "so; gptkiln serve refuses such a request instead (context_length_exceeded), and its page "
        "sizes Max tokens to fit. Temperature, top-k, top-p, min-p and the repetition "
        "penalty not given take what the run's generation_config.json sets (a Hugging Face "
        "model's, e.g. Qwen3's temperature 0.6, top-k 20, top-p 0.95), as transformers and "
        "vLLM do, with a note.",
        epilog=example(
            "gptkiln generate runs/char --prompt ROMEO: --prompt JULIET: --num-samples 2 --seed 1"
        ),
    )
    add_run_argument(p)
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
    add_sampling_flags(p, SAMPLING_HELP, defaults={"temperature": 0.8})
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
    add_device_flag(p)
    add_quantize_flag(p)
    add_precision_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from gptkiln.chat_template import is_chat_template
    from gptkiln.config.sample import model_sampling
    from gptkiln.devices import resolve_device

    prompts = _prompts(args)
    for flag, value in (("--batch-size", args.batch_size), ("--num-samples", args.num_samples)):
        if value < 1:  # (checked by `complete` too, which one streamed prompt does not call)
            raise GptkilnError(f"{flag} must be a whole number >= 1, got {value}")
    model = model_sampling(args.run_dir)
    cfg = sample_config(args, model)
    device = resolve_device(args.device)
    template = None if args.raw else _run_template(args.run_dir)
    wrapped = None
    if is_chat_template(template):  # a model's own template (a base model may ship one too)
        wrapped = (
            f"{args.run_dir} has a chat template: each prompt is sent as a user message in it "
            "(--raw sends the prompt as it is)"
        )
    # said once the run has loaded: one that does not says its error line alone
    notes = PendingNotes(wrapped, model_sampling_note(args, args.run_dir, model))
    if len(prompts) == 1 and args.num_samples == 1 and not args.json:  # streams as it comes
        _stream(args, prompts[0], cfg, device, echo=template is None, on_notice=notes)
    else:
        _complete(args, prompts, cfg, device, template, on_notice=notes)
    notes.flush()


def _stream(
    args: argparse.Namespace,
    prompt: str,
    cfg: SampleConfig,
    device: str,
    echo: bool,
    on_notice=note,
) -> None:
    """One sample of one prompt, written as its tokens come; ``echo``: the prompt first (an
    instruction-tuned run's response shows alone)."""
    from gptkiln.api import stream_text

    pieces = stream_text(
        args.run_dir,
        prompt,
        cfg,
        device=device,
        on_notice=on_notice,
        input=args.input,
        raw=args.raw,
        quantize=args.quantize,
        precision=args.precision,
    )
    first = next(pieces, "")  # the run is loaded and the prompt checked before anything shows
    sys.stdout.write((prompt if echo else "") + first)
    sys.stdout.flush()
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")


def _complete(
    args: argparse.Namespace,
    prompts: list[str],
    cfg: SampleConfig,
    device: str,
    template: PromptTemplate | None,
    on_notice=note,
) -> None:
    """Every prompt's ``--num-samples`` samples, generated in batches, printed each after its
    '--- prompt P of M, sample S of N (seed X) ---' line, or as JSON Lines (``--json``)."""
    from gptkiln.api import complete
    from gptkiln.chat_template import is_chat_template
    from gptkiln.finetune.templates import format_prompt

    sent, templated = prompts, False
    if template is not None:  # each prompt an instruction, formatted as stream_text does
        sent = [format_prompt(template, prompt, args.input) for prompt in prompts]
        templated = is_chat_template(template)
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
        on_notice=on_notice,
        quantize=args.quantize,
        templated=templated,
        precision=args.precision,
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
    """The prompts of ``--prompt`` (repeated) or ``--prompt-file``: UTF-8 text (a ``--prompt``'s
    bytes are checked as every ``TEXT`` argument's are, by `gptkiln.cli.main`)."""
    return args.prompt if args.prompt_file is None else read_prompt_file(args.prompt_file)


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
        text = data.decode("utf-8-sig")  # a BOM (Windows editors write one) is no text
    except UnicodeDecodeError as e:
        raise GptkilnError(
            f"--prompt-file {name}: byte {e.start + 3 * data.startswith(codecs.BOM_UTF8)} is "
            "not UTF-8 text; save the file as UTF-8"
        ) from None
    prompts = [line.removesuffix("\r") for line in text.split("\n") if line.strip()]
    if not prompts:
        raise GptkilnError(
            f"--prompt-file {name} holds no prompt (it is empty or blank); write one prompt a line"
        )
    return prompts


def _run_template(run_dir: str) -> PromptTemplate | None:
    """An instruction-tuned run's prompt template (None: the run has none)."""
    from gptkiln.finetune.runs import run_template
    from gptkiln.loading import read_config

    return run_template(read_config(run_dir), run_dir)
