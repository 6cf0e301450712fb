"""Time to quality: wall seconds until the char-level baby GPT first reaches val loss <= 1.88.

    python bench/time_to_quality.py --data TINY_SHAKESPEARE [--target 1.88] [-- extra flags]
    python bench/time_to_quality.py --data TEXT --against "--optimizer adamw" --rounds 2 \
        --config RECIPE --target LOSS -- --optimizer muon --schedule wsd   # a recipe vs AdamW
    python bench/time_to_quality.py --config speedrun --against "--config baseline" \
        --target 5.06 --rounds 2   # the default run against the one before it, on the plays

With ``--against FLAGS`` each round runs the recipe (the flags after ``--``) and the same
``--config`` with ``FLAGS`` instead (today's AdamW recipe: ``--optimizer adamw --schedule
cosine``), alternating, and prints both rows: seconds, steps and tokens to the target, and the
ratio. ``--config`` names the recipe both start from (``shakespeare-char``; on a GPU,
``gpt2-124m`` with ``--data`` a corpus of your own and its ``--target``); a ``--config`` in
``FLAGS`` replaces it (the last ``--config`` given wins), so ``--config speedrun --against
"--config baseline"`` is today's default against the default before issue 47, and without
``--data`` both train on the bundled plays, as ``gptkiln train`` does. Record the machine, the
data and the target with the figures so that a later run compares.

``--data`` is nanoGPT's tiny Shakespeare (its ``input.txt``, 1,115,394 characters; in the
workplace these figures were taken in, ``../shared/data/tinyshakespeare.txt``): the target and
the reference below are figures on that text. Another corpus runs, but its time says nothing
about them. Runs the bundled recipe, end to end, as a user would:

    gptkiln train --config shakespeare-char --data TINY_SHAKESPEARE \
        --out RUN --overwrite --no-progress

(4 layers, 4 heads, 128 dims, context 64, batch 12, lr 1e-3, 100 warm-up steps, cosine to 1e-4
over 2000 steps, dropout 0, evaluation every 250 steps; see src/gptkiln/recipes/). The clock
starts when the process is launched (imports, data preparation and evaluations included) and
the run's ``metrics.csv`` is watched while it trains: the time to quality is when the first row
with ``val_loss <= target`` appears. The reference: nanoGPT's baby GPT on this machine, 90 s for
2000 steps, final val loss 1.886.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402


def read_rows(path: Path) -> list[dict]:
    """metrics.csv rows (step, tokens, train_loss, val_loss, lr, tokens_per_s); "" -> None."""
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        text = f.read()
    if not text.endswith("\n"):  # a row being written: leave it for the next look
        text = text[: text.rfind("\n") + 1]
    return [
        {k: float(v) if v not in ("", None) else None for k, v in row.items()}
        for row in csv.DictReader(text.splitlines())
    ]


def run(
    data: Path | None,
    target: float,
    extra: list[str],
    run_dir: Path,
    poll_s: float = 0.05,
    recipe: str = "shakespeare-char",
) -> dict:
    """Train once, watching metrics.csv; the figures of the run."""
    cmd = [
        sys.executable,
        "-m",
        "gptkiln",
        "train",
        "--config",
        recipe,
        *(["--data", str(data)] if data else []),
        "--out",
        str(run_dir),
        "--overwrite",
        "--no-progress",
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(common.THREADS))
    metrics = run_dir / "metrics.csv"
    metrics.unlink(missing_ok=True)  # a kept run's old rows are not this run's (--overwrite
    # deletes them too, but only once the trainer has started, after the clock)
    reached = None
    seen = 0
    log_path = run_dir.parent / f"{run_dir.name}.log"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with (
        open(log_path, "w") as log,
        subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=common.REPO
        ) as proc,
    ):
        while proc.poll() is None:
            time.sleep(poll_s)
            rows = read_rows(metrics)
            seen = min(seen, len(rows))  # the file was started again
            for row in rows[seen:]:
                if reached is None and row["val_loss"] is not None and row["val_loss"] <= target:
                    reached = (time.perf_counter() - t0, row)
            seen = len(rows)
        wall = time.perf_counter() - t0
    output = log_path.read_text()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{output[-3000:]}")
    rows = read_rows(metrics)
    for row in rows[seen:]:  # rows written after the last look
        if reached is None and row["val_loss"] is not None and row["val_loss"] <= target:
            reached = (wall, row)
    final = rows[-1]
    compiled = re.search(r"compiled: step \d+ took ([0-9.]+) s", output)
    return {
        "compile_s": float(compiled.group(1)) if compiled else None,
        "wall_s": wall,
        "reached_s": reached[0] if reached else None,
        "reached_step": int(reached[1]["step"]) if reached else None,
        "reached_val": reached[1]["val_loss"] if reached else None,
        "reached_tokens": int(reached[1]["tokens"]) if reached else None,
        "final_step": int(final["step"]),
        "final_val": final["val_loss"],
        "tokens_per_s": final["tokens_per_s"],
        "rows": rows,
        "output": output,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--data",
        type=Path,
        help="nanoGPT's tiny Shakespeare (input.txt), the text the target and reference are on "
        "(with --against: any text; none, the bundled plays)",
    )
    p.add_argument("--target", type=float, default=1.88)
    p.add_argument("--keep", help="keep the run directory here instead of a temporary one")
    p.add_argument("--config", default="shakespeare-char", help="the recipe both runs start from")
    p.add_argument(
        "--against",
        help="flags of a run to compare with, e.g. '--optimizer adamw --schedule cosine' "
        "(default: no comparison)",
    )
    p.add_argument("--rounds", type=int, default=1, help="with --against: rounds, alternating")
    p.add_argument("extra", nargs="*", help="more `gptkiln train` flags (after --)")
    args = p.parse_args()
    if args.against is not None:
        return compare(args)
    if args.data is None or not args.data.is_file():
        sys.exit(f"--data {args.data}: no such file; give tiny Shakespeare's input.txt")
    data = args.data.resolve()  # the trainer runs from the repository's root

    info = common.print_machine()
    common.wait_for_quiet()
    with tempfile.TemporaryDirectory(prefix="gptkiln-bench-ttq-") as tmp:
        run_dir = Path(args.keep) if args.keep else Path(tmp) / "run"
        r = run(data, args.target, args.extra, run_dir)
    print("\n| step | val loss | tokens/s (EMA, trainer) |")
    print("|------|----------|-------------------------|")
    for row in r["rows"]:
        val = "-" if row["val_loss"] is None else f"{row['val_loss']:.4f}"
        speed = "-" if row["tokens_per_s"] is None else f"{row['tokens_per_s']:,.0f}"
        print(f"| {int(row['step'])} | {val} | {speed} |")
    print()
    losses = {k: None if r[k] is None else f"{r[k]:.4f}" for k in ("reached_val", "final_val")}
    common.print_table(
        [dict(r, target=args.target, **losses)],
        [
            ("target", "target val"),
            ("reached_s", "seconds to target"),
            ("reached_step", "at step"),
            ("reached_val", "val there"),
            ("final_val", "final val"),
            ("final_step", "steps"),
            ("wall_s", "total wall s"),
            *([("compile_s", "first step (compiling), s")] if r["compile_s"] is not None else []),
        ],
    )
    verdict = "MET" if r["reached_s"] is not None and r["reached_s"] <= 60 else "MISSED"
    print(
        f"\n# {args.data}: target val <= {args.target} within 60 s: {verdict}; nanoGPT reference "
        "(tiny Shakespeare): 90 s for "
        f"2000 steps, final 1.886; load average now {common.machine()['loadavg_1m']:.2f} "
        f"(at start {info['loadavg_1m']:.2f})"
    )


def compare(args: argparse.Namespace) -> None:
    """The recipe (``args.extra``) against ``args.against``, alternating for ``args.rounds``."""
    import shlex

    if args.data is not None and not args.data.is_file():
        sys.exit(f"--data {args.data}: no such file")
    data = args.data.resolve() if args.data else None
    info = common.print_machine()
    print(f"# recipe --config {args.config} {shlex.join(args.extra)}; against: {args.against}; "
          f"data {args.data or 'the bundled plays'}; target val loss <= {args.target}")  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory(prefix="gptkiln-bench-ttq-") as tmp:
        for round_ in range(args.rounds):
            for name, flags in (("recipe", args.extra), ("against", shlex.split(args.against))):
                r = run(data, args.target, flags, Path(tmp) / name, recipe=args.config)
                r.update(name=name, round=round_ + 1, load=common.machine()["loadavg_1m"])
                rows.append(r)
                where = f"{r['reached_s']} s at step {r['reached_step']}"
                print(f"{name} round {round_ + 1}: reached {where}, final val "
                      f"{r['final_val']:.4f}", flush=True)  # fmt: skip
    print()
    common.print_table(
        rows,
        [
            ("name", "run"),
            ("round", "round"),
            ("reached_s", "seconds to target"),
            ("reached_step", "steps"),
            ("reached_tokens", "tokens"),
            ("final_val", "final val"),
            ("wall_s", "total wall s"),
            ("load", "load average after"),
        ],
    )
    for name in ("recipe", "against"):
        times = [r["reached_s"] for r in rows if r["name"] == name and r["reached_s"]]
        print(f"# {name}: reached the target in {len(times)} of {args.rounds} rounds"
              + (f", median {sorted(times)[len(times) // 2]:.1f} s" if times else ""))  # fmt: skip
    print(f"# load average at start {info['loadavg_1m']:.2f}")


if __name__ == "__main__":
    main()
