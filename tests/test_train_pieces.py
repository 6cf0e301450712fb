"""The trainer's pieces on their own, without a training run: the run log (metrics.csv rows,
lines, samples), checkpoints (cadence, save and restore with a fake task), the clock and the
speedometer, the optimizer step, the one-line stop messages, and the package's names."""

from __future__ import annotations

import copy
import csv
import dataclasses
from pathlib import Path

import pytest
import torch

from gptkiln.config import TrainConfig
from gptkiln.distributed import TerminationGuard, WorkerStopped, World
from gptkiln.errors import GptkilnError
from gptkiln.optim import lr_at
from gptkiln.train import read_metrics
from gptkiln.train.checkpointing import Checkpoints, Progress, resume_after_restart
from gptkiln.train.optimizer_step import OptimizerStep
from gptkiln.train.run_log import RunLog
from gptkiln.train.stops import diverged_message, nothing_to_train, stopped_message
from gptkiln.train.timing import Speedometer, TrainingClock

# What `gptkiln.train` defined when it was one module: each must stay importable from there.
TRAIN_NAMES = [
    "METRICS_FIELDS", "EpochOrder", "Batches", "eval_batches", "spread_evenly",
    "sum_over_batches", "loss_sums", "evaluate", "Evaluation", "bits_per_char", "evaluate_text",
    "TrainResult", "model_config_for", "train", "read_metrics", "tensorboard_writer_class",
    "TensorBoardLog", "sample_text", "now", "RunContext", "BatchSource", "Task",
    "LanguageModeling", "Trainer", "resume_after_restart", "check_one_gpu_each", "_gather_rng",
    "_prepared_matches",
]  # fmt: skip


def test_every_name_of_the_training_module_is_still_importable_from_gptkiln_train():
    import gptkiln.train

    missing = [name for name in TRAIN_NAMES if not hasattr(gptkiln.train, name)]
    assert missing == []
    assert callable(gptkiln.train.train) and gptkiln.train.Trainer.__name__ == "Trainer"


class Bar:
    """A progress bar that keeps the lines written above it."""

    def __init__(self):
        self.lines: list[str] = []

    def write(self, text: str) -> None:
        self.lines.append(text)


class FakeTask:
    """What the run log and the checkpoints ask of a task, kept in memory."""

    columns = ("train_loss", "val_loss", "accuracy")
    plots = ("loss",)

    def __init__(self, values: dict | None = None):
        self.values = values or {"train_loss": None, "val_loss": 2.0, "accuracy": 0.5}
        self.saved: tuple | None = None

    def evaluate(self, model, autocast):
        return dict(self.values)

    def summary(self, row: dict) -> str:
        return f"train {row['train_loss']:.3f} | acc {row['accuracy']:.2f}"

    def sample(self, model, use_cache: bool) -> str:
        model.eval()  # as generation leaves it
        return f"a sample (cache {use_cache})"

    def save(self, model_sd: dict, state: dict, train_config: dict) -> None:
        self.saved = copy.deepcopy((model_sd, state, train_config))

    def load(self) -> tuple[dict, dict]:
        model_sd, state, _ = copy.deepcopy(self.saved)
        return model_sd, state


def _log(tmp_path: Path, task=None, world=None) -> RunLog:
    log = RunLog(task or FakeTask(), tmp_path / "run", world or World(), TerminationGuard())
    log.start_afresh()
    return log


# -- the run log -----------------------------------------------------------------------------
def test_an_evaluation_is_one_metrics_row_in_the_tasks_columns_and_one_line(tmp_path):
    log, bar = _log(tmp_path), Bar()
    model = torch.nn.Linear(2, 2)
    row = log.log_eval(model, None, 4, 512, 2.5, 1e-3, None, bar)
    log.log_eval(model, None, 8, 1024, 2.25, 5e-4, 1234.4, bar)
    assert row == {
        "step": 4, "tokens": 512, "train_loss": 2.5, "val_loss": 2.0, "accuracy": 0.5,
        "lr": 1e-3, "tokens_per_s": None,
    }  # fmt: skip
    path = tmp_path / "run" / "metrics.csv"
    lines = list(csv.reader(path.open()))
    header = ["step", "tokens", "train_loss", "val_loss", "accuracy", "lr", "tokens_per_s"]
    assert lines[0] == header
    assert lines[1] == ["4", "512", "2.5", "2.0", "0.5", "0.001", ""]  # untimed: an empty cell
    assert len(lines) == 3 and read_metrics(path)[1]["tokens_per_s"] == 1234.4
    assert bar.lines == [
        "step      4 | train 2.500 | acc 0.50 | lr 1.00e-03",
        "step      8 | train 2.250 | acc 0.50 | lr 5.00e-04 | 1,234 tok/s",
    ]
    assert [r["step"] for r in log.history] == [4, 8]


def test_a_tasks_own_training_loss_is_kept_over_the_batches_loss(tmp_path):
    task = FakeTask({"train_loss": 1.5, "val_loss": None, "accuracy": 0.75})
    log = _log(tmp_path, task)
    row = log.log_eval(torch.nn.Linear(2, 2), None, 2, 64, 9.0, 1e-3, 10.0, Bar())
    assert row["train_loss"] == 1.5
    assert read_metrics(tmp_path / "run" / "metrics.csv")[0]["val_loss"] is None


def test_only_rank_0_writes_and_prints_but_every_rank_keeps_the_history(tmp_path):
    log, bar = _log(tmp_path, world=World(rank=1, world_size=2)), Bar()
    row = {"step": 2, "tokens": 8, "train_loss": 1.0, "val_loss": 1.0, "accuracy": 1.0}
    log.write({**row, "lr": 1e-3, "tokens_per_s": 5.0}, bar)
    assert log.history[0]["step"] == 2
    assert bar.lines == [] and not (tmp_path / "run" / "metrics.csv").exists()


def test_a_resume_keeps_the_rows_up_to_its_checkpoint_and_goes_on_after_them(tmp_path):
    log, model = _log(tmp_path), torch.nn.Linear(2, 2)
    for step in (2, 4, 6):
        log.log_eval(model, None, step, step * 100, 1.0, 1e-3, 50.0, Bar())
    resumed = RunLog(FakeTask(), tmp_path / "run", World(), TerminationGuard())
    resumed.keep_rows_until(4)  # the attempt that logged step 6 was killed before saving it
    assert [(r["step"], r["tokens"]) for r in resumed.history] == [(2, 200), (4, 400)]
    assert all(type(r["step"]) is int and type(r["tokens"]) is int for r in resumed.history)
    resumed.log_eval(model, None, 6, 600, 1.0, 1e-3, 50.0, Bar())
    text = (tmp_path / "run" / "metrics.csv").read_text()
    assert text.count("step,tokens") == 1
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.csv")] == [2, 4, 6]


def test_a_fresh_start_drops_a_replaced_runs_metrics_and_events(tmp_path):
    run = tmp_path / "run"
    (run / "tensorboard").mkdir(parents=True)
    (run / "metrics.csv").write_text("step,tokens\n9,9\n")
    events = run / "tensorboard" / "events.out.tfevents.1.host.1.0"
    events.write_bytes(b"old")
    RunLog(FakeTask(), run, World(), TerminationGuard()).start_afresh()
    assert not (run / "metrics.csv").exists() and not events.exists()


def test_a_sample_is_printed_between_rules_and_leaves_the_model_training(tmp_path):
    log, bar, model = _log(tmp_path), Bar(), torch.nn.Linear(2, 2)
    assert log.log_sample(model, 3, False, bar) == "a sample (cache False)"
    assert bar.lines == ["--- sample at step 3 ---\na sample (cache False)\n---"]
    assert model.training


# -- checkpoints -----------------------------------------------------------------------------
@dataclasses.dataclass
class FakeBatches:
    global_batch: int = 8
    walks_epochs: bool = True
    total_steps: int = 20
    stride: int | None = 16

    def tokens(self, step: int) -> int:
        return self.global_batch * 4


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).square().mean().backward()
    optimizer.step()
    return model, optimizer


def _checkpoints(tmp_path: Path, task: FakeTask, **kw) -> Checkpoints:
    cfg = TrainConfig(out=str(tmp_path / "run"), checkpoint_interval=3)
    return Checkpoints(task, cfg, World(), "cpu", TerminationGuard(), **kw)


def test_checkpoints_are_due_every_interval_and_after_the_last_step(tmp_path):
    checkpoints = _checkpoints(tmp_path, FakeTask())
    assert [s for s in range(1, 10) if checkpoints.due(s, last=False)] == [3, 6, 9]
    assert checkpoints.due(7, last=True)


def test_a_restored_checkpoint_continues_exactly_where_it_was_saved(tmp_path):
    task, batches = FakeTask(), FakeBatches()
    model, optimizer = _trained(seed=0)
    checkpoints = _checkpoints(tmp_path, task)
    assert checkpoints.saved_step is None
    torch.manual_seed(123)
    checkpoints.save(model, optimizer, batches, Progress(step=6, tokens=192, train_seconds=4.5))
    assert checkpoints.saved_step == 6
    next_draw = torch.rand(3)  # what the run would have drawn next
    model_sd, state, train_config = task.saved
    assert state["step"] == 6 and state["global_batch"] == 8 and state["world_size"] == 1
    assert state["scheduler"] == {"step": 6, "total_steps": 20}
    assert train_config["checkpoint_interval"] == 3

    other, other_optimizer = _trained(seed=1)  # another run's weights and moments
    restoring = _checkpoints(tmp_path, task)
    progress = restoring.restore(other, other_optimizer, batches)
    assert progress == Progress(step=6, tokens=192, train_seconds=4.5)
    assert restoring.saved_step == 6
    assert torch.equal(torch.rand(3), next_draw)  # the random stream goes on as it would have
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    moments = [optimizer.state[p]["exp_avg"] for p in model.parameters()]
    assert all(
        torch.equal(m, other_optimizer.state[p]["exp_avg"])
        for m, p in zip(moments, other.parameters())
    )


def test_a_checkpoint_from_before_tokens_and_clocks_were_saved_still_resumes(tmp_path):
    task, batches = FakeTask(), FakeBatches()
    model, optimizer = _trained(seed=0)
    _checkpoints(tmp_path, task).save(model, optimizer, batches, Progress(5, 160, 2.0))
    for key in ("tokens", "train_seconds"):
        del task.saved[1][key]
    progress = _checkpoints(tmp_path, task).restore(model, optimizer, batches)
    assert progress == Progress(step=5, tokens=5 * 32, train_seconds=0.0)


def test_a_resume_that_would_walk_epochs_in_other_steps_is_refused(tmp_path):
    task = FakeTask()
    model, optimizer = _trained(seed=0)
    _checkpoints(tmp_path, task).save(model, optimizer, FakeBatches(), Progress(5, 160, 2.0))
    wider = FakeBatches(global_batch=16)
    with pytest.raises(GptkilnError, match="trained on 8 examples a step.*takes 16.*at 8"):
        _checkpoints(tmp_path, task).restore(model, optimizer, wider)
    random_windows = FakeBatches(global_batch=16, walks_epochs=False)  # no epochs to keep
    assert _checkpoints(tmp_path, task).restore(model, optimizer, random_windows).step == 5


def test_a_restart_by_torchrun_says_where_it_resumes(tmp_path, capsys):
    task = FakeTask()
    model, optimizer = _trained(seed=0)
    _checkpoints(tmp_path, task).save(model, optimizer, FakeBatches(), Progress(5, 160, 2.0))
    _checkpoints(tmp_path, task).restore(model, optimizer, FakeBatches())
    assert capsys.readouterr().out == ""
    _checkpoints(tmp_path, task, restarted=True).restore(model, optimizer, FakeBatches())
    run = tmp_path / "run"
    assert capsys.readouterr().out == (
        f"torchrun restarted the workers: resuming from step 5 in {run}\n"
    )


def test_a_restart_resumes_only_from_a_checkpoint_and_an_overwrite_forgets_the_old_one(tmp_path):
    from gptkiln.checkpoint import TRAINER_STATE_FILE, write_checkpoint
    from gptkiln.config import GPTConfig
    from gptkiln.model import GPT

    run = tmp_path / "run"
    run.mkdir()
    assert resume_after_restart(run, False, True, restarted=True) == (False, True)  # none yet
    from gptkiln.checkpoint import save_model

    save_model(GPT(GPTConfig(vocab_size=20, context_length=8, n_layer=1, n_head=1, n_embd=8)),
               tmp_path / "model")  # fmt: skip
    # a restart over a model no training wrote (a refused first attempt): refused again
    assert resume_after_restart(tmp_path / "model", False, False, True) == (False, False)
    (run / TRAINER_STATE_FILE).write_bytes(b"state")  # a first save cut short: no checkpoint
    assert resume_after_restart(run, False, False, restarted=True) == (False, True)
    model = GPT(GPTConfig(vocab_size=20, context_length=8, n_layer=1, n_head=1, n_embd=8))
    write_checkpoint(run, model.config, model.state_dict(), {"step": 4, "rng": []})
    state = (run / TRAINER_STATE_FILE).read_bytes()
    assert resume_after_restart(run, False, True, restarted=False) == (False, True)
    assert resume_after_restart(run, False, True, restarted=True) == (True, False)
    checkpoints = _checkpoints(tmp_path, FakeTask())
    checkpoints.set_aside_replaced(overwrite=False)
    assert (run / TRAINER_STATE_FILE).exists()
    checkpoints.set_aside_replaced(overwrite=True)
    assert not (run / TRAINER_STATE_FILE).exists()  # aside: a restart resumes nothing
    assert (run / ".replaced" / TRAINER_STATE_FILE).read_bytes() == state


def test_a_run_stopped_before_its_first_checkpoint_leaves_the_replaced_run_to_keep(tmp_path):
    """A hard stop (the process killed) before an --overwrite's first checkpoint leaves
    ``.replaced``: a plain start is refused, naming it; another --overwrite keeps it aside
    and deletes it at its own first checkpoint."""
    from gptkiln.checkpoint import TRAINER_STATE_FILE
    from gptkiln.run_guard import check_run_dir_for_training

    run = tmp_path / "run"
    (run / ".replaced").mkdir(parents=True)
    (run / ".replaced" / TRAINER_STATE_FILE).write_bytes(b"old")
    (run / "metrics.csv").write_text("step\n1\n")  # the stopped attempt's
    with pytest.raises(GptkilnError, match="holds the run an --overwrite replaced"):
        check_run_dir_for_training(run, resume=False, overwrite=False)
    with pytest.raises(GptkilnError, match="move the files"):
        check_run_dir_for_training(run, resume=True, overwrite=False)
    task = FakeTask()
    checkpoints = _checkpoints(tmp_path, task)
    checkpoints.set_aside_replaced(overwrite=True)
    assert not (run / "metrics.csv").exists()
    assert (run / ".replaced" / TRAINER_STATE_FILE).read_bytes() == b"old"
    model, optimizer = _trained(seed=0)
    checkpoints.save(model, optimizer, FakeBatches(), Progress(1, 32, 1.0))
    assert not (run / ".replaced").exists()


def test_a_run_set_aside_by_a_killed_overwrite_is_named_by_the_commands_that_read_runs(
    tmp_path, capsys
):
    """kill -9 before an --overwrite's first checkpoint: the good run waits in .replaced, and
    info, generate, perplexity... say where, instead of "not a gptkiln run directory"."""
    from gptkiln.checkpoint import save_model
    from gptkiln.cli import main
    from gptkiln.config import GPTConfig
    from gptkiln.model import GPT

    run = tmp_path / "run"
    save_model(GPT(GPTConfig(vocab_size=20, context_length=8, n_layer=1, n_head=1, n_embd=8)),
               run / ".replaced")  # fmt: skip
    (run / "metrics.csv").write_text("step\n1\n")  # the killed attempt's
    for command in (["info", str(run)], ["generate", str(run), "--prompt", "a"]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert f"its run waits in {run / '.replaced'}" in err and "--overwrite" in err
        assert len(err.strip().splitlines()) == 1


# -- time and speed --------------------------------------------------------------------------
def test_the_clock_spends_a_budget_and_without_one_never_runs_out():
    unbounded = TrainingClock(None, World())
    unbounded.record(1e9)
    assert not unbounded.out_of_time() and unbounded.time_used() == 0.0
    clock = TrainingClock(0.1, World())  # 6 seconds
    clock.record(3.0)
    assert clock.time_used() == 0.5 and not clock.out_of_time()
    clock.record(4.5, step_seconds=1.5)  # the next step foreseen to end at 6 s: the budget
    assert clock.time_used() == 1.0 and not clock.out_of_time()
    clock.record(6.0)
    assert clock.out_of_time() and clock.seconds == 6.0 and clock.step_seconds == 1.5


def test_tokens_per_second_leave_out_the_compiling_step_then_average():
    speed = Speedometer(compiling=True)
    assert speed.add(100, 10.0) is True and speed.tokens_per_s is None
    assert speed.add(100, 0.5) is False and speed.tokens_per_s == 200.0
    speed.add(100, 1.0)
    assert speed.tokens_per_s == pytest.approx(0.9 * 200 + 0.1 * 100)
    assert Speedometer(compiling=False).add(64, 2.0) is False


# -- the optimizer step ----------------------------------------------------------------------
class Regression(torch.nn.Module):
    """``model(x, y)`` returns (predictions, mean squared error), as a GPT returns its loss."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)

    def forward(self, x, y):
        out = self.linear(x)
        return out, (out - y).square().mean()


class TwoBatches:
    """Two micro-batches of (x, y), the same at every step."""

    def __init__(self):
        gen = torch.Generator().manual_seed(0)
        self.data = [
            (torch.randn(4, 3, generator=gen), torch.randn(4, 1, generator=gen)) for _ in range(2)
        ]

    def get(self, step: int, micro: int):
        return self.data[micro]


def test_an_optimizer_step_averages_its_micro_batches_at_the_scheduled_lr():
    torch.manual_seed(0)
    model, batches = Regression(), TwoBatches()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    cfg = TrainConfig(out="unused", grad_accum=2, grad_clip=0.0, lr=0.1, warmup_steps=4)
    step = OptimizerStep(model, model, optimizer, batches, cfg, "cpu")
    lr, loss = step(1, total=10, time_used=0.0)
    expected_lr = lr_at(1, lr=0.1, min_lr=cfg.min_lr, warmup_steps=4, total_steps=10)
    assert lr == pytest.approx(expected_lr) and optimizer.param_groups[0]["lr"] == lr
    losses = [reference(x, y)[1] for x, y in batches.data]
    assert loss == pytest.approx(sum(losses).item() / 2)
    (sum(losses) / 2).backward()  # one step on the mean of the two micro-batches' gradients
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q - lr * q.grad)
    assert all(p.grad is None for p in model.parameters())  # zeroed for the next step


def test_micro_batches_of_uneven_learnt_tokens_make_the_step_one_batch_would():
    """A fine-tuning step's gradient is the mean over every learnt token of the step, as one
    batch of all its rows gives: a micro-batch of one learnt token weighs one token, not half."""
    from gptkiln.config import GPTConfig
    from gptkiln.model import GPT

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, context_length=8, n_layer=1, n_head=2, n_embd=16))
    model.eval()  # no dropout: the same forward either way
    reference = copy.deepcopy(model)
    x = torch.randint(0, 32, (2, 8))
    y = torch.full((2, 8), -100)
    y[0, 7] = 3  # one learnt token in the first row, six in the second
    y[1, 2:] = torch.randint(0, 32, (6,))

    class Rows:
        def get(self, step, micro):
            return x[micro : micro + 1], y[micro : micro + 1]

    cfg = TrainConfig(out="unused", grad_accum=2, grad_clip=0.0, lr=0.1, warmup_steps=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    step = OptimizerStep(model, model, optimizer, Rows(), cfg, "cpu")
    step.loss = lambda forward, x, y: forward(x, y)[1]
    step.learnt = lambda x, y: (y != -100).sum()
    lr, loss = step(1, total=10, time_used=0.0)
    _, whole = reference(x, y)  # one batch of both rows
    assert loss == pytest.approx(whole.item(), rel=1e-5)
    whole.backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q - lr * q.grad, rtol=1e-5, atol=1e-6)


# -- one line when a run stops ---------------------------------------------------------------
def test_a_stop_from_outside_names_who_why_and_the_last_checkpoint(tmp_path):
    run, two = tmp_path / "run", World(rank=1, world_size=2)
    stopped = WorkerStopped("stopped by SIGTERM")
    assert stopped_message(stopped, World(), 9, None, run) == (
        "training stopped at step 9: stopped by SIGTERM; no checkpoint was written"
    )
    lost = RuntimeError("Connection reset by peer\nand a long trace")
    assert stopped_message(lost, two, 9, 8, run) == (
        "rank 1 of 2 stopped at step 9: lost contact with the other ranks (Connection reset by "
        f"peer); the last checkpoint, step 8, is in {run}: continue with --resume"
    )
    every = "(torchrun stops every worker when one fails)"
    assert every in stopped_message(stopped, two, 9, 8, run)
    # any other error is a bug here, raised as it is
    assert stopped_message(RuntimeError("shape mismatch"), two, 9, 8, run) is None
    assert stopped_message(RuntimeError("connection reset"), World(), 9, 8, run) is None


def test_a_diverged_run_names_the_kept_checkpoint_and_what_to_change(tmp_path):
    cfg = TrainConfig(out=str(tmp_path), lr=0.5, warmup_steps=7)
    message = diverged_message(12, "the loss is nan", 8, tmp_path, cfg)
    assert message.startswith("training diverged at step 12: the loss is nan; the checkpoint ")
    assert f"of step 8 in {tmp_path} is kept as it was" in message
    assert "--lr (now 0.5)" in message and "--warmup-steps (now 7)" in message
    assert "no checkpoint was written" in diverged_message(2, "x", None, tmp_path, cfg)


def test_nothing_to_train_says_which_limit_the_run_has_reached(tmp_path):
    clock = TrainingClock(1.0, World())
    assert nothing_to_train(tmp_path, 5, 10, clock, 1.0) is None
    assert "already at step 10 of 10; raise --max-steps" in nothing_to_train(
        tmp_path, 10, 10, clock, 1.0
    )
    clock.record(61.0)
    assert "trained 1.02 minutes, its --max-time is 1; raise --max-time" in nothing_to_train(
        tmp_path, 5, 10, clock, 1.0
    )


def test_an_epochs_order_is_torchs_permutation_held_in_four_bytes_an_item():
    """`EpochOrder` keeps each epoch's permutation in int32 (a 10B-token corpus at context 64
    holds 156M windows: 625 MB, not 1.25 GB), the very order an int64 randperm of the same seed
    gives, so a run's data order is what it was before."""
    from gptkiln.train import EpochOrder

    cfg = TrainConfig(batch_size=3, seed=7)
    order = EpochOrder(100_003, cfg, World())
    for epoch in (0, 1):
        perm = order._order(epoch)
        assert perm.dtype == torch.int32
        expected = torch.randperm(100_003, generator=torch.Generator().manual_seed(7 + epoch))
        assert torch.equal(perm.long(), expected)
    first = torch.randperm(100_003, generator=torch.Generator().manual_seed(7))[:3].tolist()
    assert order.ids(0, 0) == first


def test_a_failed_attempt_with_restarts_left_keeps_the_replaced_run_aside(tmp_path, monkeypatch):
    """With torchrun restarts left, a failure before the first checkpoint leaves the replaced
    run in .replaced (the next attempt must start afresh, not resume it); on the last attempt
    it comes back. A .replaced beside a run with a whole checkpoint of its own is stale and
    goes."""
    from gptkiln.checkpoint import TRAINER_STATE_FILE
    from gptkiln.run_guard import check_run_dir_for_training

    run = tmp_path / "run"
    run.mkdir()
    (run / TRAINER_STATE_FILE).write_bytes(b"old")
    checkpoints = _checkpoints(tmp_path, FakeTask())
    checkpoints.set_aside_replaced(overwrite=True)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    assert not checkpoints.restore_replaced()
    assert not (run / TRAINER_STATE_FILE).exists()  # a restart resumes nothing
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert checkpoints.restore_replaced()  # the last attempt: the old run back
    assert (run / TRAINER_STATE_FILE).read_bytes() == b"old"
    from gptkiln.checkpoint import write_checkpoint
    from gptkiln.config import GPTConfig
    from gptkiln.model import GPT

    model = GPT(GPTConfig(vocab_size=20, context_length=8, n_layer=1, n_head=1, n_embd=8))
    write_checkpoint(run, model.config, model.state_dict(), {"step": 4, "rng": []})
    (run / ".replaced").mkdir()
    (run / ".replaced" / "config.json").write_text("{}")
    check_run_dir_for_training(run, resume=True, overwrite=False)  # beside a whole checkpoint
    assert not (run / ".replaced").exists()
