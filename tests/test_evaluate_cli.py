"""`gptkiln evaluate` (lm-evaluation-harness tasks on a run, from the command line) and
`gptkiln train --eval-tasks` (the tasks on the final weights, and every N steps into
metrics.csv, TensorBoard and loss.png).

Offline like tests/test_evaluate.py, whose helpers these reuse: the tasks are YAML files
written here, over local JSON Lines read by the harness's ``json`` loader.
"""

from __future__ import annotations

import csv
import importlib
import json
import struct
import sys
from pathlib import Path

import pytest
import torch
from test_cli import assert_one_line_error, cli
from test_evaluate import CONTEXT, chain_model, needs_harness, task_yaml, write_jsonl

from gptkiln.checkpoint import save_model
from gptkiln.config import GPTConfig, TrainConfig
from gptkiln.errors import GptkilnError
from gptkiln.model import GPT
from gptkiln.train import read_metrics

MC_BODY = (
    'output_type: multiple_choice\ndoc_to_text: "{{q}}"\ndoc_to_target: answer\n'
    "doc_to_choice: choices\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n"
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A run with GPT-2's tokenizer and a multiple-choice task of five questions."""
    from gptkiln.tokenizers import load_tokenizer

    needs_harness()
    root = tmp_path_factory.mktemp("evaluate_cli")
    tokenizer = load_tokenizer("gpt2")
    save_model(chain_model(n_embd=32), root / "run", tokenizer=tokenizer)
    tasks = root / "tasks"
    tasks.mkdir()
    questions = [f"Question {i}: which word comes after number {i}?" for i in range(5)]
    choices = [" apple", " a long answer of several words", " tea"]
    rows = [{"q": q, "choices": choices, "answer": i % 3} for i, q in enumerate(questions)]
    task_yaml(tasks, "kiln_mc", write_jsonl(tasks / "mc.jsonl", rows), MC_BODY)
    return dict(root=root, run=root / "run", tasks=tasks, tokenizer=tokenizer)


def table_value(out: str, task: str, metric: str) -> float:
    """A metric's value as the harness's markdown table prints it."""
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|") and "Tasks" in line)
    rows = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.split("|")])
    header = rows[0]
    current = None
    for row in rows[2:]:
        current = row[header.index("Tasks")] or current
        if current == task and row[header.index("Metric")] == metric:
            return float(row[header.index("Value")])
    raise AssertionError(f"{task} {metric} not in the table:\n{out}")


# -- gptkiln evaluate --------------------------------------------------------------------------
def test_evaluate_prints_the_table_and_writes_the_json_into_the_run(setup, capsys):
    run = setup["run"]
    code, out, err = cli("evaluate", run, "--tasks", "kiln_mc", "--include-path",
                         setup["tasks"], "--quiet", capsys=capsys)  # fmt: skip
    assert code == 0, err
    assert out.startswith(f"gptkiln (run={run}), limit: None, num_fewshot: None, batch_size: 16")
    (written,) = sorted((run / "eval").glob("results_*.json"))
    assert f"written: {written}" in out
    results = json.loads(written.read_text())["results"]["kiln_mc"]
    for metric in ("acc", "acc_norm"):
        assert table_value(out, "kiln_mc", metric) == pytest.approx(
            results[f"{metric},none"], abs=5e-5
        )  # the table rounds to 4 places


def test_quiet_evaluate_shows_no_bar_of_the_harness_and_no_git_complaint(
    setup, tmp_path, monkeypatch, capfd
):
    """--quiet: no bar at all, the harness's own (building requests, tokenizing pairs) too; and
    outside a git repository, not git's "fatal" from the harness asking for the commit."""
    from gptkiln.cli import main

    monkeypatch.chdir(tmp_path)
    args = ["evaluate", setup["run"], "--tasks", "kiln_mc", "--include-path", setup["tasks"]]
    args += ["--output-path", tmp_path / "scores.json"]
    assert main([str(a) for a in args]) == 0
    err = capfd.readouterr().err
    assert "it/s]" in err and "fatal" not in err  # the bars, without --quiet
    assert main([str(a) for a in [*args, "--quiet"]]) == 0
    err = capfd.readouterr().err
    assert "it/s]" not in err and "fatal" not in err, err
    assert json.loads((tmp_path / "scores.json").read_text())["git_hash"] is None


def test_an_output_path_over_a_runs_file_is_refused(setup, capsys):
    run = setup["run"]
    config = (run / "config.json").read_bytes()
    code, _, err = cli("evaluate", run, "--tasks", "kiln_mc", "--include-path", setup["tasks"],
                       "--output-path", run / "config.json", "--quiet", capsys=capsys)  # fmt: skip
    assert_one_line_error(code, err, "--output-path", "a file of the run in")
    assert (run / "config.json").read_bytes() == config
    tasks = ["--tasks", "kiln_mc", "--include-path", setup["tasks"]]
    code, out, err = cli("evaluate", run, *tasks, "--output-path", "/proc/scores.json",
                         "--quiet", capsys=capsys)  # fmt: skip
    assert_one_line_error(code, err, "--output-path /proc/scores.json: cannot write in /proc")
    assert out == ""  # refused before the evaluation, not after it
    data = run.parent / "prepared"  # prepared data's meta.json, written by slip
    data.mkdir(exist_ok=True)
    (data / "meta.json").write_text('{"tokenizer": "char"}')
    code, _, err = cli("evaluate", run, "--tasks", "kiln_mc", "--include-path", setup["tasks"],
                       "--output-path", data / "meta.json", "--quiet", capsys=capsys)  # fmt: skip
    assert_one_line_error(code, err, "--output-path", "a file of the prepared data in")
    assert (data / "meta.json").read_text() == '{"tokenizer": "char"}'
    from gptkiln.errors import GptkilnError
    from gptkiln.run_guard import check_not_a_run_file

    (data / "chat_template.jinja").write_text("{{ messages }}")  # an HF tokenizer's, kept
    with pytest.raises(GptkilnError, match="a file of the prepared data"):
        check_not_a_run_file(data / "chat_template.jinja", "--out")
    (data / "attention.png").write_bytes(b"an earlier inspect's picture")
    check_not_a_run_file(data / "attention.png", "--out")  # no file of prepare's: written over


def test_output_path_log_samples_limit_num_fewshot_seed_and_batch_size_reach_the_harness(
    setup, tmp_path, capsys, monkeypatch
):
    import gptkiln.evaluate.lm as ev

    sizes = []
    score_pairs = ev.score_pairs
    monkeypatch.setattr(
        ev, "score_pairs", lambda *a, **kw: sizes.append(kw["batch_size"]) or score_pairs(*a, **kw)
    )
    path = tmp_path / "scores.json"
    code, out, err = cli("evaluate", setup["run"], "--tasks", "kiln_mc", "--include-path",
                         setup["tasks"], "--output-path", path, "--log-samples", "--limit", "2",
                         "--num-fewshot", "1", "--seed", "7", "--batch-size", "3", "--quiet",
                         capsys=capsys)  # fmt: skip
    assert code == 0, err
    written = json.loads(path.read_text())
    assert written["n-samples"]["kiln_mc"] == {"original": 5, "effective": 2}
    assert written["n-shot"]["kiln_mc"] == 1
    assert (written["config"]["random_seed"], written["config"]["fewshot_seed"]) == (7, 7)
    assert sizes and set(sizes) == {3}
    samples = tmp_path / "samples_kiln_mc_scores.jsonl"
    assert [json.loads(line)["doc_id"] for line in samples.read_text().splitlines()] == [0, 1]
    assert f"written: {path}, {samples}" in out
    assert "limit: 2, num_fewshot: 1, batch_size: 3" in out.splitlines()[0]


def test_dtype_loads_the_weights_in_it_and_is_recorded(setup, tmp_path, capsys, monkeypatch):
    import gptkiln.evaluate.lm as ev

    dtypes = []
    score_pairs = ev.score_pairs
    monkeypatch.setattr(
        ev,
        "score_pairs",
        lambda m, *a, **kw: dtypes.append(m.wte.weight.dtype) or score_pairs(m, *a, **kw),
    )
    path = tmp_path / "bf16.json"
    code, out, err = cli("evaluate", setup["run"], "--tasks", "kiln_mc", "--include-path",
                         setup["tasks"], "--output-path", path, "--dtype", "bfloat16",
                         "--quiet", capsys=capsys)  # fmt: skip
    assert code == 0, err
    assert dtypes and set(dtypes) == {torch.bfloat16}
    assert json.loads(path.read_text())["config"]["model_args"]["dtype"] == "bfloat16"
    assert out.startswith(f"gptkiln (run={setup['run']},dtype=bfloat16)")


def test_evaluate_keeps_freed_memory_on_the_cpu(setup, tmp_path, capsys, monkeypatch):
    import gptkiln.allocator

    calls = []
    monkeypatch.setattr(gptkiln.allocator, "keep_freed_memory", lambda: calls.append(1) or True)
    code, _, err = cli("evaluate", setup["run"], "--tasks", "kiln_mc", "--include-path",
                       setup["tasks"], "--limit", "1", "--output-path", tmp_path / "r.json",
                       "--device", "cpu", "--quiet", capsys=capsys)  # fmt: skip
    assert code == 0, err
    assert calls == [1]


def test_a_fractional_limit_is_a_share_of_the_documents(setup, tmp_path, capsys):
    code, _, err = cli("evaluate", setup["run"], "--tasks", "kiln_mc", "--include-path",
                       setup["tasks"], "--output-path", tmp_path / "r.json", "--limit", "0.4",
                       "--quiet", capsys=capsys)  # fmt: skip
    assert code == 0, err
    assert json.loads((tmp_path / "r.json").read_text())["n-samples"]["kiln_mc"]["effective"] == 2


# -- bad input: one line, exit 2 -----------------------------------------------------------------
def test_an_unknown_task_is_one_line(setup, capsys, monkeypatch):
    import gptkiln.evaluate.tasks as ev

    # an unknown name sends the search on to the harness's own ~15,000 tasks (half a minute to
    # index on 2 cores): here the index is the test's tasks alone
    local = ev.task_manager(str(setup["tasks"].resolve()), False)
    monkeypatch.setattr(ev, "task_manager", lambda path, defaults: local)
    before = sorted((setup["run"] / "eval").glob("*"))
    code, _, err = cli("evaluate", setup["run"], "--tasks", "kiln_mc,kiln_mcq", "--include-path",
                       setup["tasks"], capsys=capsys)  # fmt: skip
    assert_one_line_error(code, err, "gptkiln evaluate: error: unknown task 'kiln_mcq'",
                          "did you mean kiln_mc")  # fmt: skip
    assert sorted((setup["run"] / "eval").glob("*")) == before  # nothing written


def test_a_task_file_that_does_not_parse_is_one_line(setup, tmp_path, capsys):
    (tmp_path / "broken.yaml").write_text("task: broken\ndataset_path: [unclosed\n")
    code, _, err = cli("evaluate", setup["run"], "--tasks", "broken", "--include-path", tmp_path,
                       capsys=capsys)  # fmt: skip
    assert_one_line_error(code, err, f"{tmp_path / 'broken.yaml'}: the task file does not parse")


def test_a_classifier_run_is_one_line(setup, tmp_path, capsys):
    classifier = GPT(GPTConfig(vocab_size=50257, context_length=CONTEXT, n_layer=1, n_head=2,
                               n_embd=16, num_classes=2, tie_embeddings=False))  # fmt: skip
    save_model(classifier, tmp_path / "clf", tokenizer=setup["tokenizer"])
    code, _, err = cli("evaluate", tmp_path / "clf", "--tasks", "kiln_mc", "--include-path",
                       setup["tasks"], capsys=capsys)  # fmt: skip
    assert_one_line_error(code, err, "is a classifier of 2 classes")
    assert not (tmp_path / "clf" / "eval").exists()


def test_a_missing_run_is_one_line(setup, tmp_path, capsys):
    code, _, err = cli("evaluate", tmp_path / "nowhere", "--tasks", "kiln_mc", "--include-path",
                       setup["tasks"], capsys=capsys)  # fmt: skip
    assert_one_line_error(code, err, f"{tmp_path / 'nowhere'} does not exist")


def test_bad_numbers_are_one_line(setup, tmp_path, capsys):
    for flags, needle in [
        (["--limit", "0"], "limit must be a whole number of documents >= 1 or a fraction"),
        (["--limit", "inf"], "limit must be a whole number"),
        (["--limit", "1e30"], "limit must be a whole number"),
        (["--limit", "2.5"], "limit must be a whole number"),
        (["--limit", "many"], "argument --limit: 'many' is not a number"),
        (["--num-fewshot", "-1"], "num_fewshot must be >= 0"),
        (["--batch-size", "0"], "batch_size must be a whole number >= 1, got 0"),
        (["--seed", "-1"], "seed must be a whole number in [0, 2**32), got -1"),
        (["--seed", str(2**32)], "seed must be a whole number in [0, 2**32)"),
    ]:
        code, _, err = cli("evaluate", setup["run"], "--tasks", "kiln_mc", "--include-path",
                           setup["tasks"], "--output-path", tmp_path, *flags,
                           capsys=capsys)  # fmt: skip
        assert_one_line_error(code, err, needle)
    # more shots than the task has: found as the harness draws them (after datasets' progress)
    code, _, err = cli("evaluate", setup["run"], "--tasks", "kiln_mc", "--include-path",
                       setup["tasks"], "--output-path", tmp_path, "--num-fewshot", "100000",
                       capsys=capsys)  # fmt: skip
    assert code == 2 and "Traceback" not in err
    assert "more examples than a task has to draw them from" in err.strip().splitlines()[-1]


def test_without_the_harness_the_command_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    for name in [m for m in sys.modules if m == "lm_eval" or m.startswith("lm_eval.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` now fails
    import gptkiln

    # imported afresh, as in a process without the harness; the old module put back afterwards
    monkeypatch.setattr(gptkiln, "evaluate", importlib.import_module("gptkiln.evaluate"))
    for name in [m for m in sys.modules if m.startswith("gptkiln.evaluate")]:  # and its modules
        monkeypatch.delitem(sys.modules, name)
    code, _, err = cli("evaluate", tmp_path, "--tasks", "hellaswag", capsys=capsys)
    assert_one_line_error(code, err, "needs the lm-eval package", 'pip install -e ".[eval]"')


# -- train --eval-tasks ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def play_tasks(tmp_path_factory):
    """A multiple-choice task in the plays' alphabet (the char tokenizer knows no other)."""
    needs_harness()
    tasks = tmp_path_factory.mktemp("play_tasks")
    rows = [
        {"q": "LYSANDER: The course of true love never did run", "choices": [" smooth", " long"],
         "answer": 0},
        {"q": "HERMIA: O cross! too high to be enthrall'd to", "choices": [" low", " high"],
         "answer": 0},
        {"q": "THESEUS: Now, fair Hippolyta, our nuptial hour", "choices": [" draws", " is"],
         "answer": 0},
    ]  # fmt: skip
    task_yaml(tasks, "play_mc", write_jsonl(tasks / "mc.jsonl", rows), MC_BODY)
    return tasks


def train_args(play_path, out, *extra):
    return [
        "train", "--data", play_path, "--model", "tiny", "--tokenizer", "char",
        "--context-length", "32", "--batch-size", "2", "--max-steps", "6", "--dropout", "0.1",
        "--eval-interval", "3", "--eval-batches", "1", "--sample-interval", "100",
        "--sample-tokens", "4", "--sample-prompt", "The", "--checkpoint-interval", "3",
        "--no-progress", "--out", out, *extra,
    ]  # fmt: skip


def png_width(path: Path) -> int:
    return struct.unpack(">I", path.read_bytes()[16:20])[0]  # the IHDR chunk's width


COLUMNS = ["eval/play_mc/acc", "eval/play_mc/acc_norm"]


def test_train_runs_the_tasks_every_n_steps_and_at_the_end(play_path, play_tasks, tmp_path,
                                                           capsys):  # fmt: skip
    from test_tensorboard import assert_events_equal_metrics

    run, plain = tmp_path / "run", tmp_path / "plain"
    tasks = ["--eval-tasks", "play_mc", "--eval-tasks-include-path", play_tasks]
    code, out, err = cli(*train_args(play_path, run, *tasks, "--eval-tasks-interval", "2",
                                     "--tensorboard"), capsys=capsys)  # fmt: skip
    assert code == 0, err
    header = next(csv.reader(open(run / "metrics.csv")))
    assert header[-2:] == COLUMNS  # after the run's own columns
    rows = read_metrics(run / "metrics.csv")
    assert [int(r["step"]) for r in rows] == [2, 3, 4, 6]  # every 2 steps, every 3, the end
    assert [r["eval/play_mc/acc"] is not None for r in rows] == [True, False, True, True]
    for r in rows:
        if r["eval/play_mc/acc"] is not None:
            assert r["eval/play_mc/acc"] in (0.0, 1 / 3, 2 / 3, 1.0)  # of three questions
    # the final weights' results: the JSON in OUT/eval, the table in the run's log
    (written,) = (run / "eval").glob("results_*.json")
    final = json.loads(written.read_text())["results"]["play_mc"]
    assert final["acc,none"] == rows[-1]["eval/play_mc/acc"]
    assert table_value(out, "play_mc", "acc") == pytest.approx(final["acc,none"], abs=5e-5)
    assert f"harness results written to {written}" in out
    assert "| play_mc/acc " in out  # in each evaluation's line
    assert_events_equal_metrics(run)  # TensorBoard has every column, the tasks' too

    # the same run without the tasks: the same losses (the harness's seeding does not reach
    # training's dropout) and a loss.png of one panel, not two
    code, _, err = cli(*train_args(play_path, plain), capsys=capsys)
    assert code == 0, err
    plain_rows = {int(r["step"]): r for r in read_metrics(plain / "metrics.csv")}
    assert sorted(plain_rows) == [3, 6]
    for r in rows:
        if int(r["step"]) in plain_rows:
            assert r["train_loss"] == plain_rows[int(r["step"])]["train_loss"]
    assert png_width(run / "loss.png") > 1.5 * png_width(plain / "loss.png")


def test_train_runs_the_tasks_on_the_final_weights_only_by_default_and_resumes(
    play_path, play_tasks, tmp_path, capsys
):
    run = tmp_path / "run"
    tasks = ["--eval-tasks", "play_mc", "--eval-tasks-include-path", play_tasks]
    limited = [*tasks, "--eval-tasks-limit", "2", "--max-steps", "3"]
    code, _, err = cli(*train_args(play_path, run, *limited), capsys=capsys)
    assert code == 0, err
    rows = read_metrics(run / "metrics.csv")
    assert [(int(r["step"]), r["eval/play_mc/acc"] is not None) for r in rows] == [(3, True)]
    (first,) = (run / "eval").glob("results_*.json")
    assert json.loads(first.read_text())["n-samples"]["play_mc"]["effective"] == 2  # the limit
    # resumed to step 6: the column kept, the new final weights evaluated and written (the
    # run's recorded limit carried: no flag gives another)
    code, _, err = cli(*train_args(play_path, run, *tasks), "--resume", capsys=capsys)
    assert code == 0, err
    rows = read_metrics(run / "metrics.csv")
    assert [(int(r["step"]), r["eval/play_mc/acc"] is not None) for r in rows] == [
        (3, True),
        (6, True),
    ]
    latest = max((run / "eval").glob("results_*.json"), key=lambda p: p.stat().st_mtime)
    assert json.loads(latest.read_text())["n-samples"]["play_mc"]["effective"] == 2


def test_train_refuses_bad_tasks_before_preparing_the_data(play_path, tmp_path, capsys):
    needs_harness()
    (tmp_path / "broken.yaml").write_text("task: broken\ndataset_path: [unclosed\n")
    run = tmp_path / "run"
    tasks = ["--eval-tasks", "broken", "--eval-tasks-include-path", tmp_path]
    code, _, err = cli(*train_args(play_path, run, *tasks), capsys=capsys)
    assert_one_line_error(code, err, "gptkiln train: error:", "the task file does not parse")
    assert not (run / "data").exists()  # refused before the text was prepared
    tasks = ["--eval-tasks", "broken", "--eval-tasks-include-path", tmp_path / "nope"]
    code, _, err = cli(*train_args(play_path, run, *tasks), capsys=capsys)
    assert_one_line_error(code, err, "--eval-tasks-include-path", "nope: not a folder")


@pytest.mark.parametrize(
    "values, needle",
    [
        (dict(eval_tasks_interval=5), "--eval-tasks-interval needs --eval-tasks"),
        (dict(eval_tasks_limit=3.0), "--eval-tasks-limit needs --eval-tasks"),
        (dict(eval_tasks="a", eval_tasks_interval=0), "eval_tasks_interval must be"),
        (dict(eval_tasks="a", eval_tasks_limit=2.5), "eval_tasks_limit must be"),
        (dict(eval_tasks=" , "), "eval_tasks is empty"),
    ],
)
def test_eval_task_settings_are_checked(values, needle):
    with pytest.raises(GptkilnError, match=needle):
        TrainConfig(**values)


def test_fsdp_is_refused_in_one_line(tmp_path):
    from gptkiln.distributed import World
    from gptkiln.train.evaluation import TaskBenchmarks

    cfg = TrainConfig(eval_tasks="play_mc", parallel="fsdp")
    with pytest.raises(GptkilnError, match="--eval-tasks with --parallel fsdp") as e:
        TaskBenchmarks(cfg, tmp_path, World(0, 2))
    assert "\n" not in str(e.value)


def test_the_plot_draws_the_task_metrics_beside_the_loss(tmp_path, monkeypatch):
    import matplotlib.figure

    from gptkiln.plots import plot_metric

    saved = []
    savefig = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(
        matplotlib.figure.Figure, "savefig", lambda fig, *a, **kw: saved.append(fig) or
        savefig(fig, *a, **kw)
    )  # fmt: skip
    rows = [
        {"step": s, "tokens": 64 * s, "train_loss": 4 - s / 10, "val_loss": 4.1 - s / 10,
         "eval/t/acc": (s / 10 if s % 2 == 0 else None), "eval/t/ppl": (900.0 if s == 4 else None)}
        for s in range(1, 7)
    ]  # fmt: skip
    plot_metric(rows, tmp_path / "loss.png", "loss", beside=["eval/t/acc", "eval/t/ppl"])
    (fig,) = saved
    loss_ax, tasks_ax = fig.axes[:2]
    assert [line.get_label() for line in loss_ax.lines] == ["Training loss", "Validation loss"]
    assert [line.get_label() for line in tasks_ax.lines] == ["t/acc", "t/ppl"]
    assert list(tasks_ax.lines[0].get_xdata()) == [2, 4, 6]  # the rows that have it
    assert tasks_ax.get_yscale() == "log"  # a perplexity beside an accuracy
    saved.clear()
    plot_metric(rows, tmp_path / "plain.png", "loss", beside=["eval/none"])
    assert len(saved[0].axes) == 2  # the loss and its tokens-seen axis: no empty panel


@pytest.mark.slow
def test_under_torchrun_rank_0_runs_the_tasks_while_the_other_waits(
    play_path, play_tasks, tmp_path
):
    from test_distributed import Launches, gptkiln_train, settings, worker_env

    run = tmp_path / "run"
    values = settings(play_path, run, max_steps=4, eval_tasks="play_mc",
                      eval_tasks_include_path=str(play_tasks), eval_tasks_interval=2)  # fmt: skip
    started = Launches()
    try:
        env = worker_env(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
        output = started.run(gptkiln_train(2, values), env=env)
    finally:
        started.close()
    rows = read_metrics(run / "metrics.csv")
    assert [int(r["step"]) for r in rows] == [2, 4]
    assert all(r["eval/play_mc/acc"] is not None for r in rows)
    assert len(list((run / "eval").glob("results_*.json"))) == 1  # written once, by rank 0
    assert output.count("harness results written to") == 1
