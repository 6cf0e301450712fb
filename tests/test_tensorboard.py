"""`train --tensorboard`: every metric of metrics.csv, and the samples, as TensorBoard events."""

import sys

import pytest
from test_cli import assert_one_line_error, cli

from gptkiln.train import METRICS_FIELDS, read_metrics


def train_args(play_path, out, steps):
    return [
        "train", "--data", play_path, "--model", "tiny", "--tokenizer", "char",
        "--context-length", "32", "--batch-size", "2", "--max-steps", steps,
        "--eval-interval", "2", "--eval-batches", "1", "--sample-interval", "3",
        "--sample-tokens", "4", "--sample-prompt", "The", "--checkpoint-interval", "2",
        "--no-progress", "--out", out,
    ]  # fmt: skip


def events(log_dir):
    """(scalars by tag as [(step, value)], samples as [(step, text)]) read back by TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    samples = [
        (e.step, make_ndarray(e.tensor_proto).item().decode())
        for e in acc.Tensors("sample/text_summary")
    ]
    return scalars, samples


def assert_events_equal_metrics(run):
    rows = read_metrics(run / "metrics.csv")
    scalars, samples = events(run / "tensorboard")
    columns = [c for c in rows[0] if c != "step"]
    assert sorted(scalars) == sorted(columns)  # every metric the trainer logs, no other
    for column in columns:
        logged = [(int(r["step"]), r[column]) for r in rows if r[column] is not None]
        assert [s for s, _ in scalars[column]] == [s for s, _ in logged], column
        assert [v for _, v in scalars[column]] == pytest.approx([v for _, v in logged], rel=1e-6), (
            column
        )  # TensorBoard keeps float32
    return rows, samples


def test_tensorboard_events_equal_metrics_csv_through_a_resume_and_an_overwrite(
    play_path, tmp_path, capsys
):
    run = tmp_path / "run"
    code, out, err = cli(*train_args(play_path, run, 6), "--tensorboard", capsys=capsys)
    assert code == 0, err
    rows, samples = assert_events_equal_metrics(run)
    assert [int(r["step"]) for r in rows] == [2, 4, 6]
    assert (run / "metrics.csv").read_text().splitlines()[0] == ",".join(METRICS_FIELDS)
    assert [step for step, _ in samples] == [3, 6]  # every 3 steps, and the one at the end
    for step, text in samples:  # as printed, indented so that Markdown keeps its lines
        printed = out.split(f"--- sample at step {step} ---\n")[1].split("\n---")[0]
        assert text == "    " + printed.replace("\n", "\n    ") and "The" in text
    code, _, err = cli(*train_args(play_path, run, 10), "--tensorboard", "--resume", capsys=capsys)
    assert code == 0, err
    rows, samples = assert_events_equal_metrics(run)
    assert [int(r["step"]) for r in rows] == [2, 4, 6, 8, 10]
    code, _, err = cli(
        *train_args(play_path, run, 4), "--tensorboard", "--overwrite", capsys=capsys
    )
    assert code == 0, err
    rows, _ = assert_events_equal_metrics(run)  # the replaced run's events are gone
    assert [int(r["step"]) for r in rows] == [2, 4]


def test_a_resume_hides_what_a_killed_attempt_logged_past_its_checkpoint(
    play_path, tmp_path, capsys
):
    from torch.utils.tensorboard import SummaryWriter

    run = tmp_path / "run"
    code, _, err = cli(*train_args(play_path, run, 4), "--tensorboard", capsys=capsys)
    assert code == 0, err
    stale = SummaryWriter(str(run / "tensorboard"))  # an attempt that got to step 6, unsaved
    stale.add_scalar("val_loss", 99.0, 6)
    stale.close()
    code, _, err = cli(*train_args(play_path, run, 8), "--tensorboard", "--resume", capsys=capsys)
    assert code == 0, err
    rows, _ = assert_events_equal_metrics(run)
    assert 99.0 not in [r["val_loss"] for r in rows]


def test_no_flag_no_tensorboard_and_a_missing_package_is_one_line(
    play_path, tmp_path, capsys, monkeypatch
):
    code, _, err = cli(*train_args(play_path, tmp_path / "plain", 2), capsys=capsys)
    assert code == 0, err
    assert not (tmp_path / "plain" / "tensorboard").exists()
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    run = tmp_path / "run"
    code, _, err = cli(*train_args(play_path, run, 2), "--tensorboard", capsys=capsys)
    assert_one_line_error(code, err, "--tensorboard", "pip install tensorboard")
    assert not (run / "data").exists()  # refused before the data was prepared


def test_convert_overwrite_drops_the_replaced_runs_events(tmp_path, capsys):
    from gptkiln.checkpoint import save_model
    from gptkiln.config import GPTConfig
    from gptkiln.model import GPT
    from gptkiln.tokenizers import load_tokenizer

    model = GPT(GPTConfig.from_name("tiny", vocab_size=50257, context_length=16))
    save_model(model, tmp_path / "run", tokenizer=load_tokenizer("gpt2"))
    code, _, err = cli(
        "convert", "to-hf", tmp_path / "run", "--out", tmp_path / "hf", capsys=capsys
    )
    assert code == 0, err
    events = tmp_path / "run" / "tensorboard" / "events.out.tfevents.1.host.1.0"
    events.parent.mkdir()
    events.write_bytes(b"the curves of the run being replaced")
    code, _, err = cli("convert", "hf", tmp_path / "hf", "--out", tmp_path / "run", "--overwrite",
                       capsys=capsys)  # fmt: skip
    assert code == 0, err
    assert not events.exists()
