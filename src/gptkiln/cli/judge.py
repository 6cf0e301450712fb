"""``gptkiln judge``: a run's answers to test entries, scored 0-100 by a larger model behind an
OpenAI-compatible endpoint (the book's section 7.8); `gptkiln.finetune.judge` does the work."""

from __future__ import annotations

import argparse
import json
import os
import sys

from gptkiln.cli.common import add_device_flag, add_overwrite_flag, add_run_argument, example


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "judge",
        help="score a fine-tuned run's answers 0-100 with a judge model (OpenAI-compatible API)",
        description="The book's section 7.8: the run answers each test entry (greedy, batched), "
        "then a judge model behind an OpenAI-compatible endpoint (Ollama's /v1, vLLM, OpenAI, "
        "another gptkiln serve) scores each answer from 0 to 100 against the correct output. "
        "An answer that is not a number is counted as unparsed and kept; a request the judge "
        "refuses (a question too long for it) is that entry's failure, its reason kept. Prints "
        "the mean of the scores; every entry goes to RUN/judgements.json, written as the run "
        "answers and as the judging goes; a judging again with the same judge, test entries, "
        "--max-new-tokens and run weights keeps the run's answers and the entries judged, has "
        "the run answer only the entries it had not and asks only about those that failed or "
        "were not asked (a judging stopped by Ctrl-C, a crash or a judge gone); another judge "
        "keeps the run's answers and is asked about every entry.",
        epilog=example(
            "gptkiln judge runs/instruct --judge-url http://localhost:11434/v1 "
            "--judge-model llama3",
            "gptkiln judge runs/chat --data test.jsonl --judge-url https://api.openai.com/v1 "
            "--judge-model gpt-4o-mini --json",
        ),
    )
    add_run_argument(p, help="a fine-tuned run (instruct, chat or dpo) whose answers are judged")
    p.add_argument(
        "--data",
        metavar="FILE",
        help="test entries: instruction entries {instruction, input, output}, conversations "
        "whose last message is the answer, or DPO pairs {prompt, chosen, rejected} (the chosen "
        "answer is the correct output; rejected may be left out) (default: the test split of "
        "the data the run was fine-tuned on)",
    )
    add_judge_endpoint_flags(p)
    p.add_argument(
        "--prompt-file",
        metavar="FILE",
        help="the judge's question with {input}, {output} and {response} (default: the book's)",
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=256, metavar="N", help="longest answer (default: 256)"
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=8,
        metavar="N",
        help="answers generated at once (default: 8)",
    )
    _add_asking_flags(p)
    p.add_argument(
        "--name", metavar="NAME", help="write RUN/judgements-NAME.json (default: judgements.json)"
    )
    add_overwrite_flag(
        p,
        help="answer and judge every entry anew, over the verdict in RUN/judgements.json "
        "(default: keep its answers when made of the same test entries, --max-new-tokens and "
        "run weights, and its judged entries when by the same judge too)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='end with one JSON line {"mean", "scored", "unparsed", "failed", "entries"}',
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="progress bars of the entries answered and judged, at a terminal (default: on)",
    )
    add_device_flag(p)
    p.set_defaults(func=run_judge)


def _add_asking_flags(p: argparse.ArgumentParser) -> None:
    """How the judge is asked: requests at once, their time, retries, its answers' length."""
    p.add_argument(
        "--concurrency",
        type=int,
        default=4,
        metavar="N",
        help="judge requests at once (default: 4)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds a request may take (default: 60)",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=3,
        metavar="N",
        help="attempts after a failed request, with exponential backoff (default: 3)",
    )
    p.add_argument(
        "--judge-max-tokens",
        type=int,
        metavar="N",
        help="the longest answer asked of the judge (default: the endpoint's)",
    )


def add_judge_endpoint_flags(p: argparse.ArgumentParser, after_training: bool = False) -> None:
    """--judge-url, --judge-model and --judge-key-env: required by ``gptkiln judge``; optional
    for ``gptkiln finetune``, which then judges the run it has trained."""
    url_help = "the endpoint's base URL"
    if after_training:
        url_help = (
            "after training, score the run's answers to its test split with the judge model "
            "behind this OpenAI-compatible endpoint, as gptkiln judge does (default: none)"
        )
    model_help = "the judge model's name" + (" (default: none)" if after_training else "")
    required = not after_training
    p.add_argument("--judge-url", required=required, metavar="URL", help=url_help)
    p.add_argument("--judge-model", required=required, metavar="NAME", help=model_help)
    p.add_argument(
        "--judge-key-env",
        metavar="VAR",
        help="the environment variable holding the API key, sent when set (default: "
        "OPENAI_API_KEY for an openai.com URL, none for any other host: an OpenAI key goes "
        "to OpenAI only)",
    )
    if after_training:
        p.add_argument(
            "--judge-answer-tokens",
            type=int,
            default=256,
            metavar="N",
            help="with --judge-url: the longest answer of the run to each test entry "
            "(default: 256)",
        )


def judge_of(args: argparse.Namespace, prompt: str | None = None, **settings):
    """The `Judge` of the command line's endpoint flags (``settings``: timeout, retries ...)."""
    from gptkiln.finetune.judge import BOOK_PROMPT, Judge

    return Judge(
        url=args.judge_url,
        model=args.judge_model,
        prompt=prompt or BOOK_PROMPT,
        key=os.environ.get(key_env(args.judge_url, args.judge_key_env), "") or None,
        **settings,
    )


def key_env(url: str, asked: str | None) -> str:
    """The environment variable whose key goes to ``url``: the one asked, else OpenAI's for an
    openai.com host, else none ("")."""
    from urllib.parse import urlsplit

    if asked is not None:
        return asked
    host = (urlsplit(url).hostname or "").lower()
    return "OPENAI_API_KEY" if host == "openai.com" or host.endswith(".openai.com") else ""


def print_verdict(verdict, as_json: bool) -> None:
    """The verdict's line, and with ``as_json`` its JSON line."""
    mean = "-" if verdict.mean is None else f"{verdict.mean:.2f}"
    n = verdict.failed
    failed = f", {n} request{'s' if n > 1 else ''} failed" if n else ""
    print(
        f"judged {len(verdict.entries)} entries: mean score {mean} over {verdict.scored} "
        f"scored ({verdict.unparsed} unparsed answers kept{failed})"
    )
    if as_json:
        print(json.dumps(verdict.summary()))


def run_judge(args: argparse.Namespace) -> None:
    from pathlib import Path

    from gptkiln.devices import resolve_device
    from gptkiln.errors import GptkilnError
    from gptkiln.finetune.judge import BOOK_PROMPT
    from gptkiln.finetune.judging import judge_run

    prompt = BOOK_PROMPT
    if args.prompt_file is not None:
        try:
            prompt = Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise GptkilnError(f"--prompt-file {args.prompt_file}: unreadable ({e})") from None
    judge = judge_of(
        args,
        prompt,
        timeout=args.timeout,
        retries=args.retries,
        concurrency=args.concurrency,
        max_tokens=args.judge_max_tokens,
    )
    verdict = judge_run(
        args.run_dir,
        judge,
        data=args.data,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        device=resolve_device(args.device),
        progress=args.progress and sys.stderr.isatty(),
        name=args.name,
        overwrite=args.overwrite,
    )
    print_verdict(verdict, args.json)
