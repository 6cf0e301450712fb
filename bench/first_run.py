"""The first run: which tokenizer, model size and compile setting learn the most Shakespeare in a
fixed training time on this machine, ranked by bits per character of the validation text.

    python bench/first_run.py speed  [NAME ...] [--minutes 0.75]  # each one's speed (exclusive)
    python bench/first_run.py steps  [NAME ...] --speeds FILE      # the steps that fit (shared)
    python bench/first_run.py budget [NAME ...] [--minutes 3]      # --max-time runs (exclusive)
    python bench/first_run.py score  [NAME ...]                    # score a run already trained
    python bench/first_run.py budget --family llama3 [--minutes 3] # one family's configurations

Every configuration (``CONFIGS``) trains on the bundled plays (``shakespeare``), prepared once per
tokenizer with val_fraction 0.1: ``prepare`` splits by characters, so every tokenizer's
validation split is the same text (the last 10% of the characters, 478,357 of them). Each run is
``gptkiln train --config baseline`` (AdamW and a cosine: the default before issue 47, which
these configurations were measured from; the speedrun recipe's choices are suffixes) in a fresh
process (``OMP_NUM_THREADS=2``; for ``--compile`` runs an empty
inductor cache, as on a new user's machine, so compiling counts as it would there), evaluating
only at its last step. Then, in the same process, the model is scored on the whole validation
split (`gptkiln.api.perplexity_of_run`: bits per character, the ranking) and samples 250 characters
from "ROMEO:" (seed 1, temperature 0.8, top-k 50).

- ``speed``: ``--max-time MINUTES`` runs; from the steps done and the first (compiling) step's
  seconds, the steps that fit in ``--budget`` minutes (default 3), written to ``--speeds``.
- ``steps``: trains each configuration for exactly those steps (``--max-steps N``: the cosine
  schedule over N steps). The result does not depend on the machine's load, so these runs may
  share the machine; their time is not a result.
- ``budget``: real ``--max-time`` runs (``--max-steps`` far out of reach, so the schedule follows
  the clock), to confirm the best with the clock running. ``--cut-schedule`` runs them with a
  schedule that ignores the clock (cosine to ``--max-steps``, the run cut by the budget), to
  measure what fitting the schedule to the budget gains.

``bpe16k-llama3-baby`` and ``bpe16k-qwen3-baby`` are the default (``bpe16k-baby``) with the
Llama 3 and Qwen3 shapes of its size (``llama3-baby``, ``qwen3-baby``); ``--family`` keeps one
family's configurations, so that each family can be run on its own.
Configurations take suffixes (`SUFFIXES`): ``+compile``, and the arithmetic, ``+fp32``,
``+bf16`` or ``+auto`` (the default: the run's first line says what auto chose, and the table's
precision column what each run trained in), so ``bpe16k-baby+fp32 bpe16k-baby`` compares fp32
with auto's choice in one batch.

The speedrun recipe's choices are suffixes too (``+muon``, ``+relu2``, ``+softcap``, ``+zero``,
``+wsd``, ``+lr2x``; ``+adamw`` and ``+cosine`` name today's), and ``budget --steps N`` trains
each for exactly N steps instead of a time (recipes of the same step cost compared where a
shared machine's load cannot skew them; `bench/recipe_steps.py` measures the cost), with
``--seeds S ...`` (each configuration once per seed) and ``--jobs J`` (runs at once, each with
``--threads`` threads).

Prints one row per run (``RESULT`` lines hold everything as JSON) and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402

EXTRA_PRESETS = {
    # model shapes tried beside the package's presets (baby 4x128 ctx 64, mini 4x192 ctx 128)
    "wide": dict(context_length=128, n_layer=4, n_head=4, n_embd=256),
    "deep": dict(context_length=128, n_layer=6, n_head=6, n_embd=192),
    "narrow": dict(context_length=128, n_layer=4, n_head=4, n_embd=128),
    "small": dict(context_length=128, n_layer=6, n_head=4, n_embd=128),
}
QWEN3_SHAPES = {
    # qwen3-baby's other shapes (the speedrun recipe's third round, issue 47): its preset with these
    "qwen3-l5": dict(n_layer=5),
    "qwen3-l6": dict(n_layer=6),
    "qwen3-w192": dict(n_embd=192, n_head=6, intermediate_size=512),
    "qwen3-i512": dict(intermediate_size=512),
}
"""Shapes registered in the worker process only (the package's presets stay as they are)."""

CONFIGS: dict[str, tuple[str, list[str]]] = {
    "gpt2-mini": ("gpt2", ["--model", "mini"]),
    "bpe2k-mini": ("bpe:2048", ["--model", "mini"]),
    "bpe4k-mini": ("bpe:4096", ["--model", "mini"]),
    "bpe8k-mini": ("bpe:8192", ["--model", "mini"]),
    "char-mini": ("char", ["--model", "mini"]),
    "char-mini-256": ("char", ["--model", "mini", "--context-length", "256"]),
    "char-baby": ("char", ["--model", "baby"]),
    "char-baby-256": ("char", ["--model", "baby", "--context-length", "256"]),
    "bpe4k-baby": ("bpe:4096", ["--model", "baby"]),
    "bpe4k-narrow": ("bpe:4096", ["--model", "narrow"]),
    "bpe2k-narrow": ("bpe:2048", ["--model", "narrow"]),
    "bpe4k-small": ("bpe:4096", ["--model", "small"]),
    "bpe4k-wide": ("bpe:4096", ["--model", "wide"]),
    "bpe4k-deep": ("bpe:4096", ["--model", "deep"]),
    "gpt2-baby": ("gpt2", ["--model", "baby"]),
    "bpe2k-baby": ("bpe:2048", ["--model", "baby"]),
    "bpe8k-baby": ("bpe:8192", ["--model", "baby"]),
    "bpe16k-baby": ("bpe:16384", ["--model", "baby"]),
    "bpe8k-narrow": ("bpe:8192", ["--model", "narrow"]),
    "bpe16k-narrow": ("bpe:16384", ["--model", "narrow"]),
    "bpe16k-mini": ("bpe:16384", ["--model", "mini"]),
    "bpe32k-baby": ("bpe:32768", ["--model", "baby"]),
    "bpe16k-baby-exact": ("bpe:16384", ["--model", "baby", "--gelu", "exact"]),
    "bpe16k-baby-b16": ("bpe:16384", ["--model", "baby", "--batch-size", "16"]),
    "bpe16k-baby-untied": ("bpe:16384", ["--model", "baby", "--no-tie-embeddings"]),
    # the default (bpe16k-baby) in the other families, at baby's size: llama3-baby and
    # qwen3-baby (4 layers, 4 query heads and 2 key/value heads of 32, 128 wide, SwiGLU 352)
    "bpe16k-llama3-baby": ("bpe:16384", ["--model", "llama3-baby"]),
    "bpe16k-qwen3-baby": ("bpe:16384", ["--model", "qwen3-baby"]),
    "bpe8k-qwen3-baby": ("bpe:8192", ["--model", "qwen3-baby"]),
    "bpe12k-qwen3-baby": ("bpe:12288", ["--model", "qwen3-baby"]),
    **{
        f"bpe16k-qwen3-{shape}": ("bpe:16384", ["--model", f"qwen3-{shape}"])
        for shape in ("l5", "l6", "w192", "i512")
    },
}
"""name -> (tokenizer, train flags); suffixes add flags to any of them (`SUFFIXES`)."""

SUFFIXES: dict[str, list[str]] = {
    "compile": ["--compile"],
    # the arithmetic: a name without one trains with the default, --precision auto (bf16 where
    # the CPU has AMX or AVX512-BF16 and a step measures faster in it; the run's first line and
    # the RESULT's "precision" say which)
    "fp32": ["--precision", "fp32"],
    "bf16": ["--precision", "bf16"],
    "auto": ["--precision", "auto"],
    # the speedrun recipe's choices (issue 47), each alone or together: bpe16k-qwen3-baby+muon+wsd
    "adamw": ["--optimizer", "adamw"],
    "muon": ["--optimizer", "muon"],
    "relu2": ["--relu2"],
    "softcap": ["--logit-softcap", "15"],
    "zero": ["--zero-init-out"],
    "wsd": ["--schedule", "wsd"],
    "cosine": ["--schedule", "cosine"],
    "lr2x": ["--lr", "2e-3"],
    "lr3x": ["--lr", "3e-3"],
    "untied": ["--no-tie-embeddings"],
}
"""``NAME+SUFFIX[+SUFFIX]``: e.g. ``bpe16k-baby+fp32`` against ``bpe16k-baby+bf16``; a suffix
``KEY=VALUE`` adds ``--KEY VALUE`` (``bpe16k-qwen3-baby+muon+lr=4e-3``)."""


def family_of(name: str) -> str:
    """The model family a configuration trains: ``llama3`` or ``qwen3`` where its ``--model``
    preset is one of theirs, else ``gpt2`` (every other preset and the shapes above)."""
    flags = CONFIGS[name.partition("+")[0]][1]
    model = flags[flags.index("--model") + 1] if "--model" in flags else "baby"
    return next((f for f in ("llama3", "qwen3") if model.startswith(f)), "gpt2")


ONLY_AT_THE_END = ["--eval-interval", "1000000", "--sample-interval", "1000000"]
ONLY_AT_THE_END += ["--checkpoint-interval", "1000000"]
SAMPLE_CHARS = 250


def config(name: str) -> tuple[str, list[str]]:
    base, *extras = name.split("+")
    if base not in CONFIGS or any(e not in SUFFIXES and "=" not in e for e in extras):
        raise SystemExit(
            f"unknown configuration {name!r}; known: {', '.join(CONFIGS)} "
            f"(+{' / +'.join(SUFFIXES)})"
        )
    tokenizer, flags = CONFIGS[base]
    return tokenizer, flags + [flag for extra in extras for flag in suffix_flags(extra)]


def suffix_flags(extra: str) -> list[str]:
    """A suffix's train flags: a named one (`SUFFIXES`), or ``KEY=VALUE`` for ``--KEY VALUE``
    (``+lr=4e-3+cooldown=0.5``: a sweep without a name for each value)."""
    if "=" in extra:
        key, _, value = extra.partition("=")
        return [f"--{key}", value]
    return SUFFIXES[extra]


def prepared(work: Path, tokenizer: str) -> Path:
    """The plays prepared with ``tokenizer`` (once; reused by later runs)."""
    out = work / ("data-" + tokenizer.replace(":", ""))
    if not (out / "meta.json").is_file():
        cmd = [sys.executable, "-m", "gptkiln", "prepare", "shakespeare", "--tokenizer"]
        subprocess.run([*cmd, tokenizer, "--out", str(out), "--quiet"], check=True)
    return out


def run_one(
    name: str,
    work: Path,
    flags: list[str],
    cut_schedule: bool = False,
    score: bool = True,
    train: bool = True,
    threads: int = common.THREADS,
    seed: int | None = None,
) -> dict:
    """Train, score and sample one configuration in a fresh process; its RESULT."""
    tokenizer, config_flags = config(name)
    data = prepared(work, tokenizer)
    label = name if seed is None else f"{name}@{seed}"
    run_dir = work / "runs" / re.sub(r"[^\w.-]", "_", label)
    if seed is not None:
        flags = [*flags, "--seed", str(seed)]
    argv = ["train", "--data", str(data), "--out", str(run_dir), "--overwrite", "--no-progress"]
    # every configuration starts from the run these were measured on (AdamW, cosine, 8 random
    # windows a step; the default since issue 47 is the speedrun recipe: +muon+wsd+... here)
    argv += ["--config", "baseline", *config_flags, *ONLY_AT_THE_END, *flags]
    job = {"argv": argv, "run_dir": str(run_dir), "cut_schedule": cut_schedule, "score": score}
    job["train"] = train
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    with tempfile.TemporaryDirectory(prefix="gptkiln-inductor-") as cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache  # compiling from nothing, as a new user does
        proc = subprocess.run(
            [sys.executable, __file__, "worker", json.dumps(job)],
            capture_output=True,
            text=True,
            env=env,
            cwd=common.REPO,
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(common.RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len(common.RESULT_PREFIX) :])
    result.update(name=name, seed=seed, command="gptkiln " + shlex.join(argv))
    print(proc.stdout, end="", flush=True)
    return result


def worker(job: dict) -> None:
    """In the fresh process: `gptkiln train` as the CLI runs it, then score and sample."""
    import torch

    from gptkiln import cli, config, optim
    from gptkiln import train as train_module
    from gptkiln.api import generate_text, perplexity_of_run
    from gptkiln.config import SampleConfig
    from gptkiln.data.prepare import read_meta
    from gptkiln.train import optimizer_step

    config.PRESETS.update(EXTRA_PRESETS)
    baby = config.PRESETS["qwen3-baby"]
    config.PRESETS.update({name: {**baby, **shape} for name, shape in QWEN3_SHAPES.items()})
    if job["cut_schedule"]:  # the cosine runs to max_steps whatever the clock says
        lr_at = optim.lr_at  # replaced where the optimizer step reads it
        optimizer_step.lr_at = lambda step, **kw: lr_at(step, **{**kw, "time_used": 0.0})
    import io
    from contextlib import redirect_stdout

    log = io.StringIO()
    if job.get("train", True):
        with redirect_stdout(log):
            code = cli.main(job["argv"])
        if code:
            raise SystemExit(code)
    output = log.getvalue()
    print(output, end="")
    run_dir = Path(job["run_dir"])
    data = job["argv"][job["argv"].index("--data") + 1]
    state = torch.load(run_dir / "trainer_state.pt", weights_only=True)
    last = train_module.read_metrics(run_dir / "metrics.csv")[-1]
    compiled = re.search(r"compiled: step 1 took ([0-9.]+) s", output)
    scored = {}
    if job["score"]:
        full = perplexity_of_run(run_dir, data, progress=False)
        meta = read_meta(data)
        chars_per_token = meta["val_characters"] / meta["val_tokens"]
        sample = SampleConfig(
            max_new_tokens=math.ceil(SAMPLE_CHARS / chars_per_token),
            temperature=0.8,
            top_k=50,
            seed=1,
        )
        text = generate_text(run_dir, "ROMEO:", sample)[: len("ROMEO:") + SAMPLE_CHARS]
        scored = {
            "val_loss": full.loss,
            "val_bpc": full.bits_per_char,
            "val_chars": full.characters,
            "sample": text,
        }
    common.emit(
        {
            **scored,
            "steps": int(state["step"]),
            "train_s": float(state["train_seconds"]),
            "first_step_s": float(compiled.group(1)) if compiled else None,
            "tokens": int(last["tokens"]),
            "tokens_per_s": int(last["tokens"]) / float(state["train_seconds"]),
            "steady_tokens_per_s": last["tokens_per_s"],
            "val_bpc_log": last["val_bpc"],
            "precision": state.get("precision"),  # what the run trained in (auto resolved)
        }
    )


def steps_in_budget(result: dict, budget_s: float) -> int:
    """The steps a run of ``result``'s speed does in ``budget_s`` seconds: its mean step time
    over the run, the first (compiling) step of a ``--compile`` run counted once, as it took.
    (The trainer's tokens/s, an average over the last few steps, moves too much on this machine
    to extrapolate from.)"""
    first = result["first_step_s"] or 0.0
    rest = result["steps"] - (1 if first else 0)
    return int((1 if first else 0) + (budget_s - first) * rest / (result["train_s"] - first))


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "worker":
        return worker(json.loads(sys.argv[2]))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=["speed", "steps", "budget", "score"])
    p.add_argument("names", nargs="*", help="configurations (default: all of CONFIGS)")
    p.add_argument(
        "--family",
        choices=["gpt2", "llama3", "qwen3"],
        help="only the configurations of this model family (with no names: all of them)",
    )
    p.add_argument("--minutes", type=float, help="--max-time of speed (0.75) / budget (3) runs")
    p.add_argument("--budget", type=float, default=3.0, help="minutes the steps should fill")
    p.add_argument("--speeds", type=Path, default=Path("/tmp/gptkiln-first-run/speeds.json"))
    p.add_argument("--work", type=Path, default=Path("/tmp/gptkiln-first-run"))
    p.add_argument("--flags", default="", help="more train flags for every run, e.g. '--lr 2e-3'")
    p.add_argument("--tag", default="", help="a label for this batch of runs")
    p.add_argument("--cut-schedule", action="store_true", help="budget: ignore the clock")
    p.add_argument(
        "--steps",
        type=int,
        help="budget: train exactly N steps instead of --minutes (configurations of the same "
        "step cost compared at equal steps, which a shared machine's load cannot skew)",
    )
    p.add_argument("--seeds", type=int, nargs="+", help="run each configuration with each seed")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (with --steps only)")
    p.add_argument("--threads", type=int, default=common.THREADS, help="threads of each run")
    args = p.parse_args()
    names = args.names or list(CONFIGS)
    for name in names:
        config(name)  # an unknown name stops here, before any run
    if args.family:
        names = [n for n in names if family_of(n) == args.family]
    args.work.mkdir(parents=True, exist_ok=True)
    extra = shlex.split(args.flags)
    common.print_machine()
    speeds = json.loads(args.speeds.read_text()) if args.speeds.is_file() else {}
    if args.jobs > 1 and not (args.mode == "budget" and args.steps):
        raise SystemExit("--jobs needs budget --steps: timed runs must run alone")
    for name in names:
        prepared(args.work, config(name)[0])  # once, before any run in parallel

    def one(job: tuple[str, int | None]) -> dict:
        name, seed = job
        if args.mode == "speed":
            flags = ["--max-time", str(args.minutes or 0.75), "--max-steps", "1000000"]
        elif args.mode in ("steps", "score"):
            flags = ["--max-steps", str(speeds[name]["steps_in_budget"])]
        elif args.steps:
            flags = ["--max-steps", str(args.steps)]
        else:
            flags = ["--max-time", str(args.minutes or 3.0), "--max-steps", "1000000"]
        return run_one(
            name,
            args.work,
            flags + extra,
            cut_schedule=args.cut_schedule,
            score=args.mode != "speed",
            train=args.mode != "score",
            threads=args.threads,
            seed=seed,
        )

    # seeds outermost: each round holds every configuration once, so a drifting machine
    # touches them alike
    jobs = [(name, seed) for seed in (args.seeds or [None]) for name in names]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(one, jobs))
    rows = []
    for r in results:
        name = r["name"]
        r["tag"] = args.tag
        if args.mode == "speed":
            r["steps_in_budget"] = steps_in_budget(r, args.budget * 60)
            keys = ("steps_in_budget", "train_s", "steps", "first_step_s", "steady_tokens_per_s")
            speeds[name] = {k: r[k] for k in keys}
            args.speeds.write_text(json.dumps(speeds, indent=2) + "\n")
        rows.append(r)
        print(common.RESULT_PREFIX + json.dumps(r), flush=True)
    print()
    for r in rows:
        r["sample_line"] = r.get("sample", "").replace("\n", " / ")[:120]
    common.print_table(
        rows,
        [
            ("name", "config"),
            ("seed", "seed"),
            ("tag", "tag"),
            ("precision", "precision"),
            ("steps", "steps"),
            ("train_s", "train s"),
            ("first_step_s", "first step s"),
            ("tokens_per_s", "tok/s (all)"),
            ("steady_tokens_per_s", "tok/s (steady)"),
            *(
                [("steps_in_budget", f"steps in {args.budget:g} min")]
                if args.mode == "speed"
                else []
            ),
            ("val_bpc_log", "val bits/char (log)"),
            ("val_loss", "val loss (all)"),
            ("val_bpc", "val bits/char (all)"),
            ("sample_line", "sample"),
        ],
    )


if __name__ == "__main__":
    main()
