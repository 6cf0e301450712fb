"""Running the harness's tasks on a run (`evaluate_run`, what ``gptkiln evaluate`` calls) or on a
model in hand (`evaluate_model`, `run_tasks`: a trainer's): loading the tasks (names, patterns,
YAML files of one's own), the harness's run, its results table, and the results JSON and the
samples written."""

from __future__ import annotations

import contextlib
import difflib
import functools
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from gptkiln.errors import GptkilnError
from gptkiln.evaluate.lm import GptkilnLM, harness
from gptkiln.evaluate.scoring import DEFAULT_BATCH_SIZE


class _TaskYamlLoader(yaml.SafeLoader):
    """YAML as the harness writes tasks: its ``!function module.name`` tags parse (to None)."""


_TaskYamlLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def task_names(tasks: str | Sequence[str]) -> list[str]:
    """Task names from ``"a,b"`` or a list of them (each may itself hold commas)."""
    items = [tasks] if isinstance(tasks, str) else list(tasks)
    names = [n.strip() for item in items for n in str(item).split(",") if n.strip()]
    if not names:
        raise GptkilnError("no tasks given; name at least one, e.g. --tasks hellaswag,arc_easy")
    return names


def check_task_files(
    include_path: str | os.PathLike | None, names: Sequence[str], flag: str = "--include-path"
) -> None:
    """One line for a task file that does not parse: every YAML file under ``include_path``
    (given as ``flag``) and every task given as a YAML file (the harness would skip such a file
    and then call its task unknown)."""
    files = [Path(n) for n in names if n.endswith((".yaml", ".yml")) and Path(n).is_file()]
    if include_path is not None:
        folder = Path(include_path)
        if not folder.is_dir():
            raise GptkilnError(
                f"{flag} {folder}: not a folder; give the folder of your task YAML files"
            )
        files += sorted(p for p in folder.rglob("*") if p.suffix in (".yaml", ".yml"))
    for path in files:
        try:
            yaml.load(path.read_text(encoding="utf-8"), Loader=_TaskYamlLoader)  # noqa: S506
        except (yaml.YAMLError, UnicodeDecodeError, OSError) as e:
            reason = " ".join(str(e).split())
            raise GptkilnError(
                f"{path}: the task file does not parse ({reason}); fix its YAML or move it out "
                "of the include path"
            ) from None


@functools.lru_cache(maxsize=4)
def task_manager(include_path: str | None, defaults: bool):
    """The harness's index of tasks: its own (~15,000, some seconds to read) when ``defaults``,
    and those under ``include_path``. Kept, so that a trainer evaluating every N steps reads
    the index once."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=defaults)


def _matches(manager, name: str) -> list[str]:
    if name in manager.task_index:
        return [name]
    if any(c in name for c in "*?["):
        return manager.match_tasks([name])
    return []


def load_tasks(
    tasks: str | Sequence[str],
    include_path: str | os.PathLike | None = None,
    flag: str = "--include-path",
):
    """(the harness's task index, the tasks and groups to run) for task names, glob patterns
    (``mmlu_*``) or YAML files; tasks of one's own under ``include_path`` load without reading
    the harness's index when every name is found there. An unknown task, a file that does not
    parse or a task that cannot be built (its dataset, its config) is one line, which names
    ``include_path`` as ``flag``."""
    harness()
    names = task_names(tasks)
    check_task_files(include_path, names, flag)
    path = None if include_path is None else str(Path(include_path).resolve())
    manager = task_manager(path, False) if path else None
    if manager is None or not all(_matches(manager, n) or _is_file(n) for n in names):
        manager = task_manager(path, True)
    specs: list[str] = []
    for name in names:
        found = _matches(manager, name)
        if not found and not _is_file(name):
            close = difflib.get_close_matches(name, manager.all_tasks, n=3)
            where = f" or under {include_path}" if include_path else ""
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise GptkilnError(
                f"unknown task {name!r}: not among the harness's {len(manager.all_tasks):,} "
                f"tasks{where}; {hint}list them with `lm_eval ls tasks`, or give "
                f"{flag} DIR for task YAMLs of your own"
            )
        specs.extend(found or [name])
    return manager, [obj for spec in specs for obj in _build(manager, spec)]


def _is_file(name: str) -> bool:
    return name.endswith((".yaml", ".yml")) and Path(name).is_file()


def _build(manager, spec: str) -> list:
    """The top-level tasks and groups that one name builds (a tag: its tasks)."""
    try:
        loaded = manager.load([spec])
    except Exception as e:  # the harness raises what its config, dataset or code raised
        reason = " ".join(str(e).split()) or type(e).__name__
        if isinstance(e, StopIteration):  # datasets' reader found no record in a data file
            reason = "its data has no documents (an empty data file?)"
        raise GptkilnError(f"task {spec!r} could not be built: {reason}") from None
    children = {c for kids in loaded["group_map"].values() for c in kids}
    groups = [g for name, g in loaded["groups"].items() if name not in children]
    return groups + [t for name, t in loaded["tasks"].items() if name not in children]


def run_harness(
    lm,
    manager,
    tasks: list,
    *,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    log_samples: bool = False,
    seed: int | None = None,
    bootstrap_iters: int = 100_000,
) -> dict[str, Any]:
    """The harness's ``simple_evaluate`` on built tasks; its results dict (with ``samples``
    when ``log_samples``). ``seed`` sets the harness's four seeds (Python, NumPy, torch,
    few-shot sampling); None keeps its defaults (0, 1234, 1234, 1234)."""
    import lm_eval

    check_settings(num_fewshot, limit, seed)
    seeds = {} if seed is None else dict.fromkeys(
        ("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed"), seed
    )  # fmt: skip
    try:
        return lm_eval.simple_evaluate(
            model=lm,
            tasks=tasks,
            task_manager=manager,
            num_fewshot=num_fewshot,
            limit=limit,
            log_samples=log_samples,
            bootstrap_iters=bootstrap_iters,
            **seeds,
        )
    except ValueError as e:  # the few-shot sampler's random.sample
        if not str(e).startswith("Sample larger than population"):
            raise
        raise GptkilnError(
            f"num_fewshot {num_fewshot}: more examples than a task has to draw them from "
            "(its few-shot split, or its other documents); ask for fewer"
        ) from None


@contextlib.contextmanager
def harness_output(progress: bool):
    """The harness asks git for the working folder's commit, which prints "fatal: not a git
    repository" outside one: here it asks with git's complaint kept. Without ``progress``, the
    bars the harness makes with no way to turn them off (building requests; ``datasets``
    loading a task's data) are off while it runs."""
    harness()  # installed, or one line saying how
    import datasets
    import lm_eval.api.task
    import lm_eval.evaluator
    from tqdm import tqdm

    saved = lm_eval.evaluator.get_git_commit_hash, lm_eval.api.task.tqdm
    bars = datasets.is_progress_bar_enabled()
    lm_eval.evaluator.get_git_commit_hash = _git_commit
    if not progress:
        lm_eval.api.task.tqdm = functools.partial(tqdm, disable=True)
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        lm_eval.evaluator.get_git_commit_hash, lm_eval.api.task.tqdm = saved
        if bars:
            datasets.enable_progress_bars()


def _git_commit() -> str | None:
    """The working folder's ``git describe --always``, as the harness records it; None outside
    a repository or without git."""
    try:
        done = subprocess.run(
            ["git", "describe", "--always"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def check_settings(
    num_fewshot: int | None, limit: int | float | None, seed: int | None = None
) -> None:
    """One line for a number of few-shot examples, a limit or a seed the harness cannot take
    (NumPy's seeds are below 2**32)."""
    if seed is not None and not 0 <= seed < 2**32:
        raise GptkilnError(f"seed must be a whole number in [0, 2**32), got {seed}")
    if num_fewshot is not None and num_fewshot < 0:
        raise GptkilnError(f"num_fewshot must be >= 0, got {num_fewshot}")
    whole = limit is not None and 1 <= limit <= 2**62 and float(limit).is_integer()
    if limit is not None and not (whole or 0 < limit < 1):
        raise GptkilnError(
            f"limit must be a whole number of documents >= 1 or a fraction in (0, 1), got {limit}"
        )


def flat_metrics(results: dict[str, Any]) -> dict[str, float]:
    """Every task's (and group's) numeric metrics as ``TASK/METRIC`` (``TASK/METRIC/FILTER``
    for a filter other than ``none``): metrics.csv and TensorBoard columns. Standard errors are
    left out."""
    flat: dict[str, float] = {}
    for section in ("results", "groups"):
        for task, values in (results.get(section) or {}).items():
            for key, value in values.items():
                metric, _, filt = key.partition(",")
                if not filt or metric.endswith("_stderr"):
                    continue
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                flat[f"{task}/{metric}" + ("" if filt == "none" else f"/{filt}")] = float(value)
    return flat


def results_table(results: dict[str, Any]) -> str:
    """The harness's tables of a results dict, as its command line prints them."""
    from lm_eval.utils import make_table

    table = make_table(results)
    if results.get("groups"):
        table += "\n" + make_table(results, "groups")
    return table


@dataclass
class HarnessResults:
    """What `evaluate_run` (or `evaluate_model`) did.

    Attributes:
        results: the harness's results dict (``results``, ``groups``, ``configs``, ``versions``,
            ``n-shot``, ``higher_is_better``, ``n-samples``, ``config``, ...), as written.
        table: the harness's results table, with a first line naming the run and settings.
        path: the results JSON written (None: not written).
        sample_paths: one JSON Lines file of per-sample records a task, with ``log_samples``.
    """

    results: dict[str, Any]
    table: str
    path: Path | None
    sample_paths: list[Path]

    def metrics(self) -> dict[str, float]:
        """The metrics as flat columns (`flat_metrics`)."""
        return flat_metrics(self.results)


def evaluate_run(
    run_dir: str | os.PathLike,
    tasks: str | Sequence[str],
    *,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    include_path: str | os.PathLike | None = None,
    output_path: str | os.PathLike | None = None,
    log_samples: bool = False,
    seed: int | None = None,
    device: str = "cpu",
    quantize: str | None = None,
    dtype: str | None = None,
    bootstrap_iters: int = 100_000,
    progress: bool = True,
) -> HarnessResults:
    """Run lm-evaluation-harness tasks on a run, as ``lm_eval --model gptkiln`` would, and
    write the harness's results JSON.

    Args:
        run_dir: a run directory, a Hugging Face model directory, or a quantized run.
        tasks: task names (``"hellaswag,arc_easy"`` or a list), glob patterns or YAML files.
        num_fewshot: examples put before each question (None: each task's own, else 0).
        limit: documents per task at most (a fraction of them when below 1); for a quick look.
        batch_size: contexts a forward holds, sequences generated at once (>= 1).
        include_path: a folder of task YAMLs of one's own.
        output_path: a folder for ``results_DATE.json`` (and ``samples_TASK_DATE.jsonl``), or a
            ``.json`` file; default ``RUN/eval/``.
        log_samples: also write every request's prompt, answers and scores.
        seed: the harness's seeds (Python, NumPy, torch, few-shot order), all set to this; None
            keeps the harness's defaults.
        device: cpu | cuda | cuda:N | mps | auto.
        quantize: "int8" quantizes the weights as they load.
        dtype: float32, bfloat16 or float16 for the weights (None: as stored), as the ``hf``
            backend's ``dtype``.
        bootstrap_iters: resamples for the standard errors of metrics that need them (0: none).
        progress: progress bars.

    Returns:
        The results, the table as printed and the files written.
    """
    harness()
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise GptkilnError(f"batch_size must be a whole number >= 1, got {batch_size!r}")
    check_settings(num_fewshot, limit, seed)
    # the model first: a missing run or a classifier is refused before the harness reads its
    # task index (seconds) and logs what it makes of the tasks
    lm = GptkilnLM(
        run_dir,
        device=device,
        batch_size=batch_size,
        quantize=quantize,
        dtype=dtype,
        progress=progress,
    )
    with harness_output(progress):
        manager, built = load_tasks(tasks, include_path)
        folder, path = _output_paths(run_dir, output_path)
        results = run_harness(
            lm,
            manager,
            built,
            num_fewshot=num_fewshot,
            limit=limit,
            log_samples=log_samples,
            seed=seed,
            bootstrap_iters=bootstrap_iters,
        )
    model_args = {"run": str(run_dir)} | ({"quantize": quantize} if quantize else {})
    model_args |= {"dtype": dtype} if dtype else {}
    results["config"].update(model="gptkiln", model_args=model_args, device=device)
    samples = results.pop("samples", None)
    sample_paths = _write(results, samples, folder, path)
    args = ",".join(f"{k}={v}" for k, v in model_args.items())
    header = (
        f"gptkiln ({args}), limit: {limit}, num_fewshot: {num_fewshot}, batch_size: {batch_size}"
    )
    return HarnessResults(results, header + "\n" + results_table(results), path, sample_paths)


def evaluate_model(
    model,
    tokenizer,
    tasks: str | Sequence[str],
    *,
    include_path: str | os.PathLike | None = None,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    seed: int | None = None,
    bootstrap_iters: int = 0,
    output_path: str | os.PathLike | None = None,
    source: str = "the model",
) -> HarnessResults:
    """Harness tasks on a model in hand (a trainer's, at an evaluation step); the results
    JSON written to ``output_path`` (a folder or a ``.json`` file) when given.

    The model is used on its own device and put back in the mode it was in; pass the `GPT`
    itself, not a compiled or DDP wrapper, and call this on one rank. The harness's task index
    is read once per process; the tasks are built anew each call. Standard errors are computed
    only with ``bootstrap_iters`` > 0. ``source`` names the model in the table's first line and
    in the JSON's ``model_args``.

    Returns:
        The results and their table; ``path`` is None when nothing was written.
    """
    with harness_output(progress=False):  # a trainer's own bar is showing
        manager, built = load_tasks(tasks, include_path)
    lm = GptkilnLM.from_model(
        model, tokenizer, batch_size=batch_size, source=source, progress=False
    )
    folder, path = (None, None) if output_path is None else _output_paths(None, output_path)
    try:
        with harness_output(progress=False):
            results = run_harness(
                lm,
                manager,
                built,
                num_fewshot=num_fewshot,
                limit=limit,
                seed=seed,
                bootstrap_iters=bootstrap_iters,
            )
    finally:
        lm.release()  # a trainer's model goes on as it was
    results["config"].update(model="gptkiln", model_args={"source": source})
    results.pop("samples", None)
    if path is not None:
        _write(results, None, folder, path)
    header = f"gptkiln ({source}), limit: {limit}, num_fewshot: {num_fewshot}"
    return HarnessResults(results, header + "\n" + results_table(results), path, [])


def run_tasks(
    model,
    tokenizer,
    tasks: str | Sequence[str],
    *,
    include_path: str | os.PathLike | None = None,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    seed: int | None = None,
    bootstrap_iters: int = 0,
) -> dict[str, float]:
    """`evaluate_model`'s metrics as flat columns, ``TASK/METRIC`` (`flat_metrics`), for
    metrics.csv and TensorBoard; nothing is written."""
    return evaluate_model(
        model,
        tokenizer,
        tasks,
        include_path=include_path,
        num_fewshot=num_fewshot,
        limit=limit,
        batch_size=batch_size,
        seed=seed,
        bootstrap_iters=bootstrap_iters,
    ).metrics()


def _output_paths(run_dir, output_path) -> tuple[Path, Path]:
    """(the folder written into, the results JSON), the folder made now: a path that cannot be
    written is found before the evaluation, not after it."""
    date = datetime.now().isoformat(timespec="seconds").replace(":", "-")
    from gptkiln.run_guard import check_not_a_run_file, check_writable

    out = Path(run_dir) / "eval" if output_path is None else Path(output_path)
    folder, path = (
        (out.parent, out) if out.suffix == ".json" else (out, out / f"results_{date}.json")
    )
    check_not_a_run_file(path, "--output-path")
    check_writable(path, "--output-path")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GptkilnError(
            f"--output-path {out}: cannot make the folder {folder} ({e.strerror}); give "
            "another folder or .json file"
        ) from None
    if path.is_dir():
        raise GptkilnError(f"--output-path {path}: a folder; give a .json file name or a folder")
    return folder, path


def _write(results: dict, samples: dict | None, folder: Path, path: Path) -> list[Path]:
    """The results JSON, and each task's samples as JSON Lines beside it (named after it)."""
    from lm_eval.utils import handle_non_serializable

    def dump(obj, **kw) -> str:
        return json.dumps(obj, default=handle_non_serializable, ensure_ascii=False, **kw)

    path.write_text(dump(results, indent=2) + "\n", encoding="utf-8")
    written = []
    stem = path.stem.removeprefix("results")  # results_DATE.json: samples_TASK_DATE.jsonl
    stem = stem if not stem or stem.startswith("_") else f"_{stem}"  # out.json: ..._out.jsonl
    for task, rows in (samples or {}).items():
        sample_path = folder / f"samples_{task}{stem}.jsonl"
        sample_path.write_text("".join(dump(r) + "\n" for r in rows), encoding="utf-8")
        written.append(sample_path)
    return written


def main() -> None:
    """``python -m gptkiln.evaluate ...``: the harness's own command line (``lm_eval ...``,
    every flag of it) with the ``gptkiln`` model registered, for a harness without plugin
    discovery."""
    try:
        harness()
        from lm_eval.__main__ import cli_evaluate

        cli_evaluate()
    except GptkilnError as e:  # the model's own refusals (a run, a device, an argument)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
