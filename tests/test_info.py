"""`gptkiln info`: what a run or a Hugging Face directory holds, read without its weights."""

import json
import math
import shutil

import pytest
import torch
from test_cli import assert_one_line_error, cli

from gptkiln.api import run_info
from gptkiln.cli import main


@pytest.fixture(scope="module")
def run(tmp_path_factory, play_path):
    out = tmp_path_factory.mktemp("info") / "run"
    code = main(
        ["train", "--data", str(play_path), "--model", "tiny", "--tokenizer", "char",
         "--context-length", "32", "--batch-size", "4", "--max-steps", "6",
         "--eval-interval", "2", "--eval-batches", "1", "--sample-interval", "100",
         "--sample-tokens", "5", "--no-progress", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    return out


@pytest.fixture(scope="module")
def hf_and_converted(tmp_path_factory):
    """A Hugging Face directory (exported), and the run `convert hf` makes of it: a model with
    no training settings, trainer state or metrics."""
    from gptkiln.checkpoint import save_model
    from gptkiln.config import GPTConfig
    from gptkiln.convert import export_hf, import_hf
    from gptkiln.model import GPT
    from gptkiln.tokenizers import load_tokenizer

    tmp = tmp_path_factory.mktemp("hf")
    model = GPT(GPTConfig.from_name("tiny", vocab_size=50257))
    save_model(model, tmp / "saved", tokenizer=load_tokenizer("gpt2"))
    export_hf(tmp / "saved", tmp / "hf")
    import_hf(tmp / "hf", tmp / "converted")
    return tmp / "hf", tmp / "converted", model.num_parameters()


def test_a_trained_run(run, play_path, capsys):
    from gptkiln.loading import load_run
    from gptkiln.train import read_metrics

    info = run_info(run)
    model, tokenizer, _ = load_run(run)
    meta = json.loads((run / "data" / "meta.json").read_text())
    rows = read_metrics(run / "metrics.csv")
    assert len(rows) == 3
    best = min(rows, key=lambda r: r["val_loss"])
    assert (info.kind, info.preset, info.preset_changes) == ("run", "tiny", {"context_length": 32})
    assert info.model == model.config.to_dict() and info.parameters == model.num_parameters()
    assert (info.tokenizer, info.vocab_size) == ("char", tokenizer.vocab_size)
    assert info.data == {
        "source": str(play_path),
        "train_tokens": meta["train_tokens"],
        "val_tokens": meta["val_tokens"],
        "prepared": str(run / "data"),
    }
    assert (info.steps_done, info.steps_total, info.tokens_seen) == (6, 6, 6 * 4 * 32)
    assert info.best_val == {
        "step": int(best["step"]),
        "loss": best["val_loss"],
        "perplexity": pytest.approx(math.exp(best["val_loss"])),
    }
    assert info.last_val["step"] == 6 and info.last_val["loss"] == rows[-1]["val_loss"]
    sizes = {n: (run / n).stat().st_size for n in ("model.safetensors", "trainer_state.pt")}
    assert info.files == sizes
    assert info.resumable and "matches the weights (step 6)" in info.resume_note
    assert info.history is None
    code, out, _ = cli("info", run, capsys=capsys)
    assert code == 0
    for line in [
        "model          tiny preset (context_length 32): 2 layers, 2 heads, 32 wide, context 32",
        f"{info.parameters:,} parameters",
        f"tokenizer      char, {tokenizer.vocab_size} ids",
        f"data           {play_path}: {meta['train_tokens']:,} train and",
        "steps          6 of 6",
        "tokens seen    768",
        f"best val loss  {best['val_loss']:.4f} (perplexity {math.exp(best['val_loss']):.2f})",
        f"checkpoint     model.safetensors {sizes['model.safetensors'] / 1000:.1f} KB",
        "resumable      yes: trainer_state.pt matches the weights (step 6)",
    ]:
        assert line in out, (line, out)
    code, out, _ = cli("info", run, "--json", capsys=capsys)
    assert json.loads(out) == json.loads(json.dumps(info.to_dict()))


def test_a_run_being_trained_says_so(run):
    """While a training process holds the run (its lock), info says it is training now: a
    resume then would be refused, and its checkpoint is not the last."""
    from gptkiln.run_guard import RunLock

    lock = RunLock(run)
    lock.acquire()
    try:
        info = run_info(run)
        assert info.resumable and "it is training now" in info.resume_note
    finally:
        lock.release()
    assert "training now" not in run_info(run).resume_note


def test_rows_past_the_checkpoint_of_a_stopped_run_are_not_its_losses(run, tmp_path):
    """A run killed after evaluations it never saved (eval every 10, checkpoint every 20,
    stopped at 45): its rows past the checkpoint are of weights no longer there, which a resume
    drops; info gave them as the best and last val loss beside "steps 20 of 60". While the
    run trains, its evaluations run ahead of its checkpoints: then they are its latest."""
    import csv

    from gptkiln.run_guard import RunLock

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    with open(copy / "metrics.csv", newline="") as f:
        fields = next(csv.reader(f))
    with open(copy / "metrics.csv", "a", newline="") as f:
        for step in (8, 10):
            row = {k: "" for k in fields} | {"step": step, "tokens": step * 128, "val_loss": 0.5}
            csv.DictWriter(f, fieldnames=fields).writerow(row)
    info = run_info(copy)
    assert info.steps_done == 6
    assert info.last_val["step"] == 6 and info.best_val["step"] <= 6
    assert info.best_val["loss"] > 0.5
    lock = RunLock(copy)
    lock.acquire()
    try:
        training = run_info(copy)
    finally:
        lock.release()
    assert training.last_val["step"] == 10 and training.best_val["loss"] == 0.5


def test_a_training_run_starting_while_info_looks_still_takes_its_lock(tmp_path):
    """`RunLock.held` holds a shared lock for an instant; a trainer acquiring then waits that
    instant out instead of being refused."""
    import fcntl
    import os
    import threading

    from gptkiln.run_guard import RunLock

    fd = os.open(tmp_path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)  # as held() takes it
    threading.Timer(0.03, os.close, [fd]).start()
    lock = RunLock(tmp_path)
    lock.acquire()  # refused at once before: no retry
    try:
        assert lock.fd is not None and RunLock.held(tmp_path)
    finally:
        lock.release()


def test_info_reads_headers_not_weights(run, monkeypatch):
    import safetensors.torch

    import gptkiln.loading

    def refuse(*args, **kwargs):
        raise AssertionError("info read the weights")

    monkeypatch.setattr(gptkiln.loading, "read_safetensors", refuse)
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    monkeypatch.setattr(gptkiln.loading, "load_model", refuse)
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(k) or real_load(*a, **k))
    assert run_info(run).parameters > 0
    assert loads == [dict(map_location="cpu", weights_only=True, mmap=True)]  # trainer state


def test_a_trainer_state_of_another_step_cannot_be_resumed(run, tmp_path, play_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    state = torch.load(copy / "trainer_state.pt", weights_only=True)
    torch.save({**state, "step": 3}, copy / "trainer_state.pt")
    info = run_info(copy)
    assert not info.resumable
    why = "model.safetensors is from step 6 but trainer_state.pt from step 3"
    assert info.resume_note == why
    assert info.steps_done == 6  # from the weights themselves
    code, _, err = cli("train", "--data", play_path, "--model", "tiny", "--tokenizer", "char",
                       "--context-length", "32", "--batch-size", "4", "--max-steps", "8",
                       "--out", copy, "--resume", "--no-progress", capsys=capsys)  # fmt: skip
    assert_one_line_error(code, err, why)  # what info says is what resuming finds


def test_a_run_copied_without_its_tokenizer_files_says_it_has_none(run, tmp_path, capsys):
    """What every loading command refuses ("saved without its tokenizer") is not reported as
    a tokenizer, nor as something to export."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(run / name, bare / name)
    info = run_info(bare)
    assert info.tokenizer is None and "none saved with it" in info.summary()
    assert "not GGUF: it records no tokenizer" in info.exports
    assert run_info(run).tokenizer == "char"


def test_a_converted_run_and_a_hugging_face_directory_have_no_history(hf_and_converted, capsys):
    hf, converted, parameters = hf_and_converted
    info = run_info(converted)
    assert (info.kind, info.preset, info.parameters) == ("run", "tiny", parameters)
    assert (info.tokenizer, info.vocab_size) == ("gpt2", 50257)
    assert info.data is None and info.steps_done is None and info.best_val is None
    assert "saved for inference" in info.history
    assert not info.resumable and info.resume_note == "trainer_state.pt is missing"
    info = run_info(hf)
    assert (info.kind, info.preset, info.parameters) == ("huggingface", "tiny", parameters)
    assert (info.tokenizer, info.steps_done, info.tokens_seen) == ("gpt2", None, None)
    assert "no training history" in info.history and not info.resumable
    assert info.files == {"model.safetensors": (hf / "model.safetensors").stat().st_size}
    code, out, _ = cli("info", hf, capsys=capsys)
    assert code == 0 and "a Hugging Face model directory" in out
    assert "training    none: an imported Hugging Face model has no training history" in out
    assert "resumable   no:" in out


def test_a_hugging_face_directory_with_a_torch_file(hf_and_converted, tmp_path):
    from safetensors.torch import load_file

    hf, _, parameters = hf_and_converted
    copy = tmp_path / "hf-bin"
    shutil.copytree(hf, copy)
    torch.save(load_file(copy / "model.safetensors"), copy / "pytorch_model.bin")
    (copy / "model.safetensors").unlink()
    info = run_info(copy)
    assert info.parameters == parameters and list(info.files) == ["pytorch_model.bin"]


def test_what_is_not_a_run_is_one_line(run, tmp_path, capsys):
    code, _, err = cli("info", tmp_path, capsys=capsys)
    assert_one_line_error(code, err, str(tmp_path), "config.json is missing")
    (tmp_path / "notes.txt").write_text("x")
    code, _, err = cli("info", tmp_path / "notes.txt", capsys=capsys)
    assert_one_line_error(code, err, "is a file, not a run directory")
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["model"]["n_layer"] = 10**9
    (copy / "config.json").write_text(json.dumps(cfg))
    code, _, err = cli("info", copy, capsys=capsys)
    assert_one_line_error(code, err, "n_layer 1000000000", "the weights hold n_layer 2")


def test_a_padded_vocabulary_is_named_beside_its_ids(tmp_path):
    """A run whose embedding and head are padded (``--pad-vocab``): its ids and its rows, the
    parameters counting the rows (what the file holds)."""
    from gptkiln.checkpoint import save_model
    from gptkiln.config import GPTConfig
    from gptkiln.model import GPT
    from gptkiln.tokenizers import load_tokenizer

    config = GPTConfig.from_name("tiny", vocab_size=50257, padded_vocab_size=50304)
    model = GPT(config)
    save_model(model, tmp_path / "run", tokenizer=load_tokenizer("gpt2"))
    info = run_info(tmp_path / "run")
    assert info.parameters == model.num_parameters()
    assert "vocabulary 50,257 in 50,304 rows (padded);" in info.summary()
    assert "padded_vocab_size" not in info.summary()  # said once, in words


def test_a_fine_tunes_preset_is_its_bases(run, tmp_path):
    """A fine-tune's config.json records the loop's settings, whose ``model`` is a default, not
    the model it tuned: its preset is read from its base (none where the base is gone)."""
    tuned = tmp_path / "tuned"
    shutil.copytree(run, tuned)
    cfg = json.loads((tuned / "config.json").read_text())
    cfg["train"]["model"] = "qwen3-baby-untied"  # what a fine-tune's TrainConfig holds
    cfg["finetune"] = {"base": str(run), "config": {"task": "instruct"}}
    (tuned / "config.json").write_text(json.dumps(cfg))
    info = run_info(tuned)
    assert (info.preset, info.preset_changes) == ("tiny", {"context_length": 32})
    cfg["finetune"]["base"] = str(tmp_path / "gone")
    (tuned / "config.json").write_text(json.dumps(cfg))
    assert run_info(tuned).preset != "qwen3-baby-untied"
