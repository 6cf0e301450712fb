"""What a run shows of its learning: each evaluation as a metrics.csv row, one printed line and
TensorBoard scalars; the samples; the progress bar; the plots at the end.

Every rank evaluates and samples (FSDP needs all ranks in every forward); rank 0 alone writes
and prints.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gptkiln import distributed as dist_utils
from gptkiln.errors import GptkilnError
from gptkiln.train.evaluation import BENCHMARK_PREFIX

if TYPE_CHECKING:
    from gptkiln.train.evaluation import TaskBenchmarks
    from gptkiln.train.task import Task
    from gptkiln.train.timing import TrainingClock

METRICS_FIELDS = ["step", "tokens", "train_loss", "val_loss", "val_bpc", "lr", "tokens_per_s"]
"""metrics.csv's columns for pretraining (``val_bpc``: bits per character of the validation
text; files written before it lack the column, and `read_metrics` reads them all the same); a
task's own columns go between tokens and lr."""


def read_metrics(path: str | os.PathLike, skip_bad: bool = False) -> list[dict]:
    """Rows of a metrics.csv as dicts of floats (empty cells become None); ``skip_bad``: a row
    with the NUL bytes a power cut leaves is given as ``{"step": None}``, not refused (a row
    of words still is: a hand's edit, to be named)."""
    rows = []
    fix = "fix that line, or delete the file to drop the run's loss history"
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        try:
            for line, row in enumerate(reader, start=2):
                try:
                    rows.append(
                        {k: (float(v) if v not in ("", None) else None) for k, v in row.items()}
                    )
                except (TypeError, ValueError):  # words, not a number cut short: named
                    if skip_bad and any("\x00" in str(v) for v in row.values()):
                        rows.append({"step": None})  # a power cut's NULs: a row cut short
                        continue
                    shown = repr(",".join(map(str, row.values())))[1:-1]  # a NUL as \x00
                    raise GptkilnError(
                        f"{path} line {line}: not a row of numbers ({shown}); {fix}"
                    ) from None
        except csv.Error as e:  # a NUL byte
            if skip_bad:  # the rest of the file is past the damage: a killed run's tail
                rows.append({"step": None})
                return rows
            raise GptkilnError(f"{path} line {reader.line_num} ({e}); {fix}") from None
        except UnicodeDecodeError:  # read a block at a time: the line is found in the bytes
            data = Path(path).read_bytes()
            try:
                data.decode("utf-8")
                line = "?"
            except UnicodeDecodeError as e:
                line = data[: e.start].count(b"\n") + 1
            raise GptkilnError(f"{path} line {line} is not UTF-8 text; {fix}") from None
    return rows


def tensorboard_writer_class():
    """torch's `SummaryWriter`, or one line naming the fix when the tensorboard package (which
    it writes with) is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise GptkilnError(
            "--tensorboard needs the tensorboard package, which is not installed: "
            "pip install tensorboard (or drop --tensorboard)"
        ) from None
    return SummaryWriter


class TensorBoardLog:
    """Every metric of the rows a run writes to metrics.csv (each column but ``step``, a scalar
    of that name), and the samples as text, in TensorBoard's event files under ``log_dir``.

    ``purge_step``: on resuming, events of this step and later, logged by an attempt that went
    past its last checkpoint, are hidden (as metrics.csv drops those rows).
    """

    def __init__(self, log_dir: Path, purge_step: int | None = None) -> None:
        self.writer = tensorboard_writer_class()(str(log_dir), purge_step=purge_step)

    def log_row(self, row: dict) -> None:
        for name, value in row.items():
            if name != "step" and value is not None:
                self.writer.add_scalar(name, value, int(row["step"]))
        self.writer.flush()  # readable while the run goes on

    def log_sample(self, step: int, text: str) -> None:
        # TensorBoard shows text as Markdown: indented, it keeps the sample's lines as written
        self.writer.add_text("sample", "    " + text.replace("\n", "\n    "), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class ProgressBar:
    """The loop's tqdm bar (shown with ``enabled``: rank 0 with ``cfg.progress``), of steps, or
    of seconds when the run has a time budget (its steps are unknown); lines print above it."""

    def __init__(self, enabled: bool, total_steps: int, step: int, clock: TrainingClock) -> None:
        from tqdm.auto import tqdm

        self.clock = clock
        options = dict(dynamic_ncols=True, disable=not enabled)
        if clock.budget_s is None:
            self.bar = tqdm(total=total_steps, initial=step, unit="step", **options)
        else:
            shown = "{l_bar}{bar}| {n:.0f}/{total:.0f} s [{elapsed}<{remaining}{postfix}]"
            start = min(clock.seconds, clock.budget_s)
            self.bar = tqdm(total=clock.budget_s, initial=start, bar_format=shown, **options)

    def write(self, text: str) -> None:
        """Print ``text`` above the bar (printed as it is when the bar is hidden)."""
        self.bar.write(text)

    def compiling(self, step: int) -> None:
        self.write(
            f"compiling the model with torch.compile: step {step} takes longer (tens "
            "of seconds; torch caches the compiled code, so later runs start sooner)"
        )

    def compiled(self, step: int, seconds: float) -> None:
        self.write(f"compiled: step {step} took {seconds:.1f} s")

    def step_done(self, step: int, loss: float, tokens_per_s: float | None) -> None:
        """Move on one step (or to the clock's seconds, with a budget) and show the step's loss
        and speed."""
        bar = self.bar
        bar.update(1 if self.clock.budget_s is None else min(self.clock.seconds, bar.total) - bar.n)
        speed = "-" if tokens_per_s is None else f"{tokens_per_s:,.0f}"
        bar.set_postfix(step=step, loss=f"{loss:.3f}", tok_s=speed, refresh=False)

    def close(self) -> None:
        self.bar.close()


class RunLog:
    """A run's evaluations and samples, written as it trains: metrics.csv in ``run_dir`` (the
    task's columns between tokens and lr), a line each, TensorBoard events when opened.

    Args:
        task: evaluates and samples the model, and names the columns.
        run_dir: where metrics.csv, the plots and the TensorBoard events go.
        world: this process's rank: rank 0 alone writes and prints.
        guard: holds SIGTERM while a row is written, so that none is left half written.
    """

    def __init__(
        self, task: Task, run_dir: Path, world: dist_utils.World, guard: dist_utils.TerminationGuard
    ) -> None:
        self.task, self.run_dir, self.world, self.guard = task, run_dir, world, guard
        self.fields = ["step", "tokens", *task.columns, "lr", "tokens_per_s"]
        self.history: list[dict] = []  # every evaluation's row, those before a resume too
        self.tensorboard: TensorBoardLog | None = None
        self.benchmarks: TaskBenchmarks | None = None  # harness tasks, when the run has them

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.csv"

    # -- a run starting or resuming ------------------------------------------------------------
    def start_afresh(self) -> None:
        """Rank 0 of a new run: the run directory, without a replaced run's metrics.csv and
        TensorBoard events (its curves must not mix with this one's)."""
        from gptkiln.run_guard import tensorboard_events

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path.unlink(missing_ok=True)
        for events in tensorboard_events(self.run_dir):
            events.unlink()

    def keep_rows_until(self, step: int) -> None:
        """Rank 0 of a resumed run: metrics.csv and the history keep the rows up to ``step``,
        the checkpoint's (a killed run may have logged past its last checkpoint)."""
        if not (self.world.is_main and self.metrics_path.exists()):
            return
        rows = read_metrics(self.metrics_path, skip_bad=True)
        whole = [r for r in rows if r.get("step") is not None and r.get("tokens") is not None]
        if len(whole) < len(rows):  # a line cut short as a killed run (a full disk) wrote it
            import sys

            print(
                f"note: {self.metrics_path}: {len(rows) - len(whole)} row(s) without a step or "
                "token count (written in part) dropped",
                file=sys.stderr,
            )
        rows = [r for r in whole if r["step"] <= step]
        for row in rows:
            row["step"], row["tokens"] = int(row["step"]), int(row["tokens"])
        self.fields += [
            k for k in dict.fromkeys(k for r in rows for k in r) if k not in self.fields
        ]
        with self.guard.hold():  # written whole beside it, then in its place: never half a file
            self._rewrite(rows)
        self.history = rows

    def open_tensorboard(self, purge_step: int | None) -> None:
        """Log to TensorBoard too (rank 0), hiding events from ``purge_step`` on."""
        from gptkiln.checkpoint import TENSORBOARD_DIR

        self.tensorboard = TensorBoardLog(self.run_dir / TENSORBOARD_DIR, purge_step)

    # -- watching it learn ---------------------------------------------------------------------
    def log_eval(
        self,
        model: torch.nn.Module,
        autocast,
        step: int,
        tokens: int,
        batch_loss: float,
        lr: float,
        tokens_per_s: float | None,
        bar: ProgressBar,
        last: bool = False,
    ) -> dict:
        """The task's evaluation of ``model`` (e.g. loss and perplexity on fixed validation and
        training batches) after optimizer step ``step``, and the harness tasks' metrics when
        they are due (`benchmarks_due`), as one row, written, printed and returned.

        Args:
            tokens: input tokens seen so far, over all ranks.
            batch_loss: this rank's loss of the last step; the ranks' mean stands in for
                train_loss when the task evaluated no training set.
            lr: the learning rate of the last step.
            tokens_per_s: the loop's speed, None until a step is timed.
            last: whether this is the run's final step.
        """
        values = self.task.evaluate(model, autocast)
        if self.benchmarks_due(step, last):
            tokenizer = self.task.tokenizer
            raw = dist_utils.unwrap(model)
            values.update(self.benchmarks.run(raw, tokenizer, step, last, bar.write))
        mean_batch = dist_utils.all_reduce_mean(torch.tensor(batch_loss), self.world).item()
        if values.get("train_loss") is None:  # no training set evaluated: the batches' loss
            values["train_loss"] = mean_batch
        row = {
            "step": step,
            "tokens": tokens,
            **values,
            "lr": lr,
            # tokens counts every rank; None (an empty cell) until a step is timed: under
            # --compile the first step is compiling, no measure of speed
            "tokens_per_s": tokens_per_s,
        }
        self.write(row, bar)
        return row

    def benchmarks_due(self, step: int, last: bool) -> bool:
        """Whether the harness tasks run after step ``step`` (``last``: the final one)."""
        return self.benchmarks is not None and self.benchmarks.due(step, last)

    def write(self, row: dict, bar: ProgressBar) -> None:
        """Keep ``row`` in the history; rank 0 appends it to metrics.csv and TensorBoard and
        prints its line."""
        self.history.append(row)
        if self.world.is_main:
            self._append(row)
            if self.tensorboard is not None:
                self.tensorboard.log_row(row)
            speed = row["tokens_per_s"]
            tasks = "".join(
                f" | {name.removeprefix(BENCHMARK_PREFIX)} {value:.4g}"
                for name, value in row.items()
                if name.startswith(BENCHMARK_PREFIX) and value is not None
            )
            bar.write(
                f"step {row['step']:>6} | {self.task.summary(row)}{tasks} | lr {row['lr']:.2e}"
                + ("" if speed is None else f" | {speed:,.0f} tok/s")
            )

    def log_sample(self, model: torch.nn.Module, step: int, use_cache: bool, bar) -> str | None:
        """The task's sample of ``model`` (every rank generates: FSDP needs all of them); rank 0
        prints it and logs it to TensorBoard. Leaves the model in training mode."""
        text = self.task.sample(model, use_cache=use_cache)
        model.train()
        if text is not None and self.world.is_main:
            bar.write(f"--- sample at step {step} ---\n{text}\n---")
            if self.tensorboard is not None:
                self.tensorboard.log_sample(step, text)
        return text

    def plot(self) -> None:
        """loss.png (with the harness tasks' metrics in a panel beside the loss, when the run
        has them), and a plot of each other metric the task draws (e.g. accuracy.png)."""
        from gptkiln.plots import plot_metric

        if self.metrics_path.exists():
            rows = read_metrics(self.metrics_path)
            tasks = [c for c in self.fields if c.startswith(BENCHMARK_PREFIX)]
            for metric in self.task.plots:
                beside = tasks if metric == "loss" else []
                plot_metric(rows, self.run_dir / f"{metric}.png", metric, beside=beside)

    def close(self) -> None:
        """Close the TensorBoard log, if one is open."""
        if self.tensorboard is not None:
            self.tensorboard.close()

    def _append(self, row: dict) -> None:
        """One row at the end of metrics.csv. A column the file has not yet (a harness task's
        metric, known once the task has run) is added after the others: the file is written
        again with it, empty in the rows before, and replaces the old one at once."""
        added = [k for k in row if k not in self.fields]
        self.fields += added
        with self.guard.hold():
            if not (added and self.metrics_path.exists()):
                self._write_rows(self.metrics_path, [row], "a")
                return
            rows = read_metrics(self.metrics_path)
            for old in rows:
                old["step"], old["tokens"] = int(old["step"]), int(old["tokens"])
            self._rewrite([*rows, row])

    def _rewrite(self, rows: list[dict]) -> None:
        """metrics.csv as ``rows``, written atomically (`checkpoint.atomic_write`)."""
        from gptkiln.checkpoint import atomic_write

        atomic_write(self.metrics_path, lambda tmp: self._write_rows(Path(tmp), rows, "w"))

    def _write_rows(self, path: Path, rows: list[dict], mode: str) -> None:
        new = mode == "w" or not path.exists()
        with open(path, mode, newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.fields)
            if new:
                writer.writeheader()
            for row in rows:
                writer.writerow({k: ("" if row.get(k) is None else row[k]) for k in self.fields})
