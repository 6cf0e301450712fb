"""``gptkiln evaluate``: EleutherAI's lm-evaluation-harness tasks (HellaSwag, ARC, LAMBADA,
WikiText, ... or YAML tasks of one's own) on a run, through gptkiln's own model
(`gptkiln.evaluate.evaluate_run`); prints the harness's results table and writes its JSON."""

from __future__ import annotations

import argparse

from gptkiln.cli.common import (
    add_device_flag,
    add_quantize_flag,
    add_quiet_flag,
    add_run_argument,
    example,
    keep_freed_memory_on_cpu,
)


def _limit(text: str) -> int | float:
    """``--limit``: a whole number of documents, or a fraction of them below 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    return int(value) if value >= 1 and value.is_integer() else value


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "evaluate",
        help="benchmarks (HellaSwag, ARC, ...) with EleutherAI's lm-evaluation-harness",
        description="Run lm-evaluation-harness tasks on a run through gptkiln's own model, "
        "print the harness's results table and write its results JSON. Needs the eval extra: "
        'pip install -e ".[eval]". The harness downloads a task\'s data from the Hugging Face '
        "hub the first time; tasks of your own (--include-path) may read local files.",
        epilog=example(
            "gptkiln evaluate runs/gpt2 --tasks hellaswag,arc_easy --limit 200",
            "gptkiln evaluate runs/char --tasks my_task --include-path tasks/",
        ),
    )
    add_run_argument(p)
    p.add_argument(
        "--tasks",
        required=True,
        metavar="NAME[,NAME...]",
        help="the harness's task or group names, glob patterns (mmlu_*) or task YAML files, "
        "comma-separated; list them with `lm_eval ls tasks` (required)",
    )
    p.add_argument(
        "--num-fewshot",
        type=int,
        metavar="N",
        help="examples put before each question (>= 0) (default: each task's own, else 0)",
    )
    p.add_argument(
        "--limit",
        type=_limit,
        metavar="N",
        help="documents per task at most, or a fraction of them below 1; for a quick look, "
        "not for scores to report (default: all)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=16,
        metavar="N",
        help="contexts per forward pass, sequences generated at once (>= 1) (default: %(default)s)",
    )
    p.add_argument(
        "--include-path",
        metavar="DIR",
        help="a folder of task YAML files of your own (default: the harness's tasks only)",
    )
    p.add_argument(
        "--output-path",
        metavar="PATH",
        help="a folder for results_DATE.json (and the samples), or a .json file "
        "(default: RUN/eval/)",
    )
    p.add_argument(
        "--log-samples",
        action="store_true",
        help="also write every request's prompt, answers and scores, one JSON Lines file a "
        "task beside the results",
    )
    p.add_argument(
        "--seed",
        type=int,
        metavar="N",
        help="the harness's seeds (Python, NumPy, torch, few-shot order), all set to N "
        "(default: the harness's: 0, 1234, 1234, 1234)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        metavar="DTYPE",
        help="float32, bfloat16 or float16: the weights' dtype while evaluating, as the "
        "harness's hf backend's dtype: "
        "bfloat16 halves the memory and, on a GPU or a CPU with AMX, the time; scores move "
        "slightly (default: as stored)",
    )
    add_device_flag(p)
    add_quantize_flag(p)
    add_quiet_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from gptkiln.evaluate import evaluate_run

    keep_freed_memory_on_cpu(args.device)  # each batch's logits: no page faults to map again
    report = evaluate_run(
        args.run_dir,
        args.tasks,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        batch_size=args.batch_size,
        include_path=args.include_path,
        output_path=args.output_path,
        log_samples=args.log_samples,
        seed=args.seed,
        device=args.device,
        quantize=args.quantize,
        dtype=args.dtype,
        progress=not args.quiet,
    )
    print(report.table)
    written = [report.path, *report.sample_paths]
    print("written: " + ", ".join(str(p) for p in written))
