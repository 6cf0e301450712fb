"""Training end to end: learning, metrics, plots, checkpoints, exact resume after a real kill."""

import csv
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gptkiln.checkpoint import read_checkpoint, read_config
from gptkiln.config import TrainConfig
from gptkiln.errors import GptkilnError
from gptkiln.train import Batches, Trainer, eval_batches, read_metrics, train


def tiny_config(data, out, **kw) -> TrainConfig:
    base = dict(
        data=str(data),
        out=str(out),
        model="tiny",
        tokenizer="char",
        context_length=32,
        batch_size=4,
        max_steps=12,
        eval_interval=4,
        eval_batches=2,
        sample_interval=6,
        sample_tokens=10,
        checkpoint_interval=4,
        warmup_steps=2,
        lr=3e-3,
        # the loop's mechanics on AdamW, a cosine and random windows (the default's Muon and
        # WSD: test_recipe.py)
        optimizer="adamw",
        schedule="cosine",
        sampling="random",
        progress=False,
        sample_prompt="I ",
        device="cpu",  # the CPU's step, bit for bit, also where a GPU is (tests/test_gpu.py)
    )
    return TrainConfig(**{**base, **kw})


def test_training_learns_and_writes_a_run_directory(play_path, play_text, tmp_path):
    result = train(tiny_config(play_path, tmp_path / "run", max_steps=40, eval_interval=10))
    run = tmp_path / "run"
    for name in [
        "config.json",
        "model.safetensors",
        "trainer_state.pt",
        "metrics.csv",
        "loss.png",
        "tokenizer_meta.json",
    ]:
        assert (run / name).is_file(), name
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    header = ["step", "tokens", "train_loss", "val_loss", "val_bpc", "lr", "tokens_per_s"]
    assert list(rows[0]) == header
    assert [int(r["step"]) for r in rows] == [10, 20, 30, 40]
    assert int(rows[-1]["tokens"]) == 40 * 4 * 32  # tokens seen
    assert all(float(r["tokens_per_s"]) > 4 * 32 for r in rows)  # more than a step a second
    losses = [float(r["train_loss"]) for r in rows]
    vocab = json.loads((run / "config.json").read_text())["model"]["vocab_size"]
    # It learns: most of the way from a uniform guess (ln 59 = 4.08) to the loss of knowing only
    # how often each character comes (3.27), which a tiny model reaches first.
    counts = Counter(play_text)
    frequencies = -sum(n / len(play_text) * math.log(n / len(play_text)) for n in counts.values())
    assert vocab == len(counts)
    assert losses[-1] < math.log(vocab) - 0.75 * (math.log(vocab) - frequencies)
    assert losses[-1] < losses[0]
    assert result.val_loss == pytest.approx(float(rows[-1]["val_loss"]))
    assert result.sample.startswith("I ") and len(result.sample) > 2
    assert (run / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_tokens_per_second_is_the_tokens_of_a_step_over_its_time(play_path, tmp_path, monkeypatch):
    import itertools

    import gptkiln.train.loop

    ticks = itertools.count()  # a clock that moves 0.5 s each time it is read: 0.5 s a step
    monkeypatch.setattr(gptkiln.train.loop, "now", lambda: next(ticks) / 2)
    train(tiny_config(play_path, tmp_path / "run", max_steps=8, eval_interval=4))
    rows = read_metrics(tmp_path / "run" / "metrics.csv")
    assert [r["tokens_per_s"] for r in rows] == [2 * 4 * 32] * 2  # batch 4 x context 32 / 0.5 s


def test_compile_says_so_and_keeps_its_first_step_out_of_tokens_per_second(
    play_path, tmp_path, monkeypatch, capsys
):
    """--compile: the trainer runs the model under torch.compile (dynamo's eager backend here,
    no code generation), says which step compiles and what it took, and the reported speed is
    that of the steps after it (a clock moving 10 s during the compiling step, 0.5 s after):
    at the compiling step itself nothing was timed, so its row leaves tokens/s empty."""
    import gptkiln.train.loop

    clock = [0.0]
    compiled_calls = []
    real_compile = torch.compile

    def fake_compile(model):
        graph = real_compile(model, backend="eager")

        def forward(*args, **kwargs):
            compiled_calls.append(1)  # each process compiles afresh: its first call is slow
            clock[0] += 10.0 if len(compiled_calls) in (1, 5) else 0.5
            return graph(*args, **kwargs)

        return forward

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(gptkiln.train.loop, "now", lambda: clock[0])
    cfg = tiny_config(play_path, tmp_path / "run", max_steps=4, eval_interval=1, compile=True)
    train(cfg)
    assert len(compiled_calls) == 4  # every training step went through the compiled model
    out = capsys.readouterr().out
    assert "compiling the model with torch.compile: step 1 takes longer" in out
    assert "compiled: step 1 took 10.0 s" in out
    step_lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert "tok/s" not in step_lines[0] and step_lines[1].endswith("| 256 tok/s")
    rows = read_metrics(tmp_path / "run" / "metrics.csv")
    # step 2: the second step's speed alone; an average seeded with the first would be ~1/11 of it
    assert [r["tokens_per_s"] for r in rows] == [None] + [2 * 4 * 32] * 3
    # a resumed run compiles again in its new process: its first step is the one it names
    train(dataclasses.replace(cfg, max_steps=6), resume=True)
    out = capsys.readouterr().out
    assert "step 5 takes longer" in out and "compiled: step 5 took 10.0 s" in out
    rows = read_metrics(tmp_path / "run" / "metrics.csv")
    assert [r["tokens_per_s"] for r in rows] == [None] + [256.0] * 3 + [None, 256.0]


def test_a_char_models_bits_per_character_are_its_loss_over_ln2(play_path, tmp_path, capsys):
    """One character a token: bits per character are exactly the loss in bits, in metrics.csv,
    the training log, the run's result and `gptkiln perplexity`."""
    from gptkiln.api import perplexity_of_run

    cfg = tiny_config(play_path, tmp_path / "run", max_steps=8, sample_prompt="RO", progress=True)
    result = train(cfg)
    rows = read_metrics(tmp_path / "run" / "metrics.csv")
    assert [r["step"] for r in rows] == [4, 8]
    for row in rows:
        assert row["val_bpc"] == row["val_loss"] / math.log(2)  # exact: same float operations
    assert result.val_bpc == rows[-1]["val_bpc"]
    log = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    assert log[-1].split(" | ")[2] == (
        f"val {rows[-1]['val_loss']:.3f} (ppl {math.exp(rows[-1]['val_loss']):.1f}, "
        f"{rows[-1]['val_bpc']:.3f} bits/char)"
    )
    r = perplexity_of_run(tmp_path / "run", tmp_path / "run" / "data", progress=False)
    assert r.characters == r.tokens and r.bits_per_char == r.loss / math.log(2)


def test_a_bpe_models_bits_per_character_are_its_summed_loss_over_the_decoded_text(tmp_path):
    """By hand: the summed cross-entropy of every target over the characters of the targets'
    text. Two batches whose boundary cuts 'é' (two byte ids: this BPE merged nothing with
    them) in two still count it once."""
    import torch.nn.functional as F

    from gptkiln.config import GPTConfig
    from gptkiln.model import GPT
    from gptkiln.tokenizers import train_bpe_tokenizer
    from gptkiln.train import evaluate_text

    tok = train_bpe_tokenizer(["to be or not to be, " * 30], 270)
    text = "to be, or not? café to be or"
    ids = torch.tensor(tok.encode(text))
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i].tolist()).endswith("\ufffd"))
    assert tok.decode(ids[cut - 1 : cut].tolist()) == "\ufffd"  # the first byte of 'é' alone
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=32, n_layer=1, n_head=1,
                          n_embd=8))  # fmt: skip
    x, y = ids[:-1], ids[1:]
    batches = [(x[None, :cut], y[None, :cut]), (x[None, cut:], y[None, cut:])]
    result = evaluate_text(model, batches, "cpu", torch.tensor(tok.char_counts()))
    with torch.no_grad():
        summed = sum(
            F.cross_entropy(model(xb)[0], yb[0], reduction="sum").item() for xb, yb in batches
        )
    decoded = tok.decode(y.tolist())
    assert text.endswith(decoded) and "café" in decoded  # the targets: all but the first id
    assert result.characters == len(decoded)
    assert result.tokens == len(y) < len(decoded)
    assert result.bits_per_char == pytest.approx(summed / len(decoded) / math.log(2), rel=1e-6)
    assert result.loss == pytest.approx(summed / len(y), rel=1e-6)


def test_a_resumed_run_reads_an_older_metrics_file_and_writes_every_column(play_path, tmp_path):
    """metrics.csv from before the val_bpc column: read as it is; a resume rewrites it under
    today's header, the old rows with the new column empty, and appends full rows."""
    run = tmp_path / "run"
    cfg = tiny_config(play_path, run, max_steps=4, eval_interval=2, sample_prompt="RO")
    train(cfg)
    old = ["step", "tokens", "train_loss", "val_loss", "lr", "tokens_per_s"]
    with open(run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    with open(run / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=old, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    assert [r["step"] for r in read_metrics(run / "metrics.csv")] == [2, 4]
    assert "val_bpc" not in read_metrics(run / "metrics.csv")[0]
    train(dataclasses.replace(cfg, max_steps=6), resume=True)
    with open(run / "metrics.csv") as f:
        lines = f.read().splitlines()
    assert lines[0] == "step,tokens,train_loss,val_loss,val_bpc,lr,tokens_per_s"
    rows = read_metrics(run / "metrics.csv")
    assert [r["step"] for r in rows] == [2, 4, 6]
    assert [r["val_bpc"] is None for r in rows] == [True, True, False]
    assert (run / "loss.png").is_file()


def test_a_metrics_line_cut_short_is_dropped_on_resume_not_a_traceback(play_path, tmp_path, capsys):
    """A run killed (or out of disk) while it appended a row leaves part of a line; the resume
    drops it with a note and goes on from its checkpoint."""
    run = tmp_path / "run"
    cfg = tiny_config(play_path, run, max_steps=4, eval_interval=2)
    train(cfg)
    with open(run / "metrics.csv", "a") as f:
        f.write("6")  # step 6 begun: no tokens, no losses
    capsys.readouterr()
    train(dataclasses.replace(cfg, max_steps=6), resume=True)
    assert "1 row(s) without a step or token count (written in part) dropped" in (
        capsys.readouterr().err
    )
    assert [r["step"] for r in read_metrics(run / "metrics.csv")] == [2, 4, 6]
    with open(run / "metrics.csv", "ab") as f:
        f.write(b"8,384,9.6\x00\x00\x00\x00")  # what a power cut can leave: not numbers
    train(dataclasses.replace(cfg, max_steps=8), resume=True)
    assert [r["step"] for r in read_metrics(run / "metrics.csv")] == [2, 4, 6, 8]


def _clock(monkeypatch, seconds_per_read: float = 0.5):
    """train.loop.now as a clock that moves ``seconds_per_read`` each time it is read: the trainer
    reads it before and after each step, so a step takes 0.5 s and so does the gap after it."""
    import itertools

    import gptkiln.train.loop

    ticks = itertools.count()
    monkeypatch.setattr(gptkiln.train.loop, "now", lambda: next(ticks) * seconds_per_read)


def test_max_time_ends_the_run_at_the_first_step_past_the_budget(play_path, tmp_path, monkeypatch):
    """Training time after step k is k - 0.5 s on this clock: a 5 s budget ends at step 6, which
    is evaluated and saved like the last step of any run; the cosine, fitted to the budget,
    has come down to its floor by then, though 6 steps are far from max_steps."""
    from gptkiln.optim import lr_at

    _clock(monkeypatch)
    run = tmp_path / "run"
    cfg = tiny_config(
        play_path, run, max_steps=1000, max_time=5 / 60, eval_interval=2, sample_prompt="RO",
        warmup_steps=1, lr=1e-3, min_lr=1e-4,
    )  # fmt: skip
    result = train(cfg)
    assert result.steps == 6 and result.val_loss is not None and result.val_bpc is not None
    _, state = read_checkpoint(run)
    assert state["step"] == 6 and state["train_seconds"] == 5.5
    assert (run / "loss.png").is_file()
    rows = read_metrics(run / "metrics.csv")
    assert [r["step"] for r in rows] == [2, 4, 6]
    # step s (1-based) is given the lr of the time it will have spent at its end, foreseen as
    # the time at its start (the evaluation after the step before included: s - 1 s) and one
    # step more as the last took (0.5 s; none known at step 2: the first step, which compiles,
    # is no measure) of 5; the last step, ending past the budget, is at the floor
    schedule = dict(lr=1e-3, min_lr=1e-4, warmup_steps=1, total_steps=1000)
    for row in rows:
        used = (row["step"] - 1 + 0.5 * (row["step"] > 2)) / (cfg.max_time * 60)
        assert row["lr"] == lr_at(int(row["step"]) - 1, **schedule, time_used=used)
    assert rows[-1]["lr"] == 1e-4 < 9e-4 < lr_at(5, **schedule)  # by steps alone: near the top


def test_a_time_budgeted_run_resumes_with_the_time_it_has_left(play_path, tmp_path, monkeypatch):
    _clock(monkeypatch)
    run = tmp_path / "run"
    cfg = tiny_config(play_path, run, max_steps=1000, max_time=5 / 60, sample_prompt="RO")
    train(cfg)
    assert read_checkpoint(run)[1]["train_seconds"] == 5.5
    assert read_checkpoint(run)[1]["step_seconds"] == 0.5  # a resume's first step foresees it
    from gptkiln.train import Trainer

    trainer = Trainer(dataclasses.replace(cfg, max_time=8 / 60), resume=True)
    assert trainer.clock.step_seconds == 0.5 and trainer.clock.time_used() == 6 / 8
    trainer.close()
    # the budget is spent: nothing to train, nothing changed
    result = train(cfg, resume=True)
    assert result.steps == 6 and read_checkpoint(run)[1]["step"] == 6
    # 8 s in all: the new process counts from its first step on (its start-up is no training):
    # 6.0, 7.0 and 8.0 s after steps 7, 8 and 9
    result = train(dataclasses.replace(cfg, max_time=8 / 60), resume=True)
    assert result.steps == 9
    assert read_checkpoint(run)[1]["train_seconds"] == 8.0


def test_max_steps_still_ends_a_run_whose_budget_is_not_spent(play_path, tmp_path, monkeypatch):
    _clock(monkeypatch)
    cfg = tiny_config(play_path, tmp_path / "run", max_steps=4, max_time=1.0, sample_prompt="RO")
    from gptkiln.optim import lr_at

    result = train(cfg)
    assert result.steps == 4 and read_checkpoint(tmp_path / "run")[1]["train_seconds"] == 3.5
    schedule = dict(lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=2, total_steps=4)
    # the steps are further along their cosine (step 4: 1/2) than the time (3 s of 60)
    assert [r["lr"] for r in result.history] == [lr_at(3, **schedule)]


def test_batches_are_disjoint_across_ranks_and_equal_one_big_batch():
    from gptkiln.distributed import World

    tokens = torch.arange(2000).numpy()
    for sampling in ("windows", "random"):
        cfg = dict(batch_size=2, max_steps=5, sampling=sampling, stride=8, seed=3)
        big = Batches(tokens, TrainConfig(**{**cfg, "batch_size": 4}), 8, World())
        ranks = [Batches(tokens, TrainConfig(**cfg), 8, World(r, 2)) for r in range(2)]
        for step in range(5):
            x_big, _ = big.get(step, 0)
            parts = [b.get(step, 0)[0] for b in ranks]
            assert torch.equal(torch.cat(parts), x_big)  # same windows as 1 process x 2b
            assert not set(parts[0][:, 0].tolist()) & set(parts[1][:, 0].tolist())


def test_eval_batches_cover_the_whole_split():
    import numpy as np

    # 100 windows of 4 tokens: the window index is written into its tokens.
    tokens = np.repeat(np.arange(100, dtype=np.uint16), 4)
    tokens = np.append(tokens, 0)  # one more token, so the last window has its target
    few = eval_batches(tokens, 4, batch_size=5, n_batches=3)  # 15 of the 100 windows
    firsts = [int(x[0]) for xb, _ in few for x in xb]
    assert len(few) == 3 and firsts[0] == 0 and firsts[-1] == 99  # from the start to the end
    assert firsts == sorted(set(firsts))
    assert max(b - a for a, b in zip(firsts, firsts[1:])) <= 8  # evenly spread
    every = eval_batches(tokens, 4, batch_size=8, n_batches=20)  # room for all: all, in order
    assert [int(x[0]) for xb, _ in every for x in xb] == list(range(100))
    assert [len(xb) for xb, _ in every] == [8] * 12 + [4]
    x, y = every[0]
    assert torch.equal(y[:, :-1], x[:, 1:])  # targets are the inputs shifted by one


def test_a_step_uses_the_scheduled_lr_and_the_clipped_gradient(play_path, tmp_path):
    cfg = tiny_config(play_path, tmp_path / "run", warmup_steps=4, grad_clip=1e-3)
    trainer = Trainer(cfg)
    seen = {}

    def before_step(optimizer, args, kwargs):
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
        seen["norm"] = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()
        seen["lrs"] = {group["lr"] for group in optimizer.param_groups}

    trainer.optimizer.register_step_pre_hook(before_step)
    try:
        lr, _ = trainer.train_step(cfg.max_steps)
    finally:
        trainer.close()
    assert lr == pytest.approx(cfg.lr / 4)  # the first of 4 warm-up steps
    assert seen["lrs"] == {lr}  # what AdamW is given, not only what is logged
    assert seen["norm"] == pytest.approx(1e-3, rel=1e-3)  # a fresh model's norm is far above


def test_evaluation_batches_come_from_their_own_split(play_path, tmp_path):
    trainer = Trainer(tiny_config(play_path, tmp_path / "run"))
    trainer.close()
    task = trainer.task
    for batches, split in [(task.val_batches, "val"), (task.train_eval_batches, "train")]:
        x, y = batches[0]
        tokens = torch.from_numpy(getattr(task.data, split)[:33].astype("int64"))
        assert torch.equal(x[0], tokens[:32]) and torch.equal(y[0], tokens[1:])
    assert not torch.equal(task.val_batches[0][0], task.train_eval_batches[0][0])


def _digests(run: Path) -> dict:
    import hashlib

    names = ("model.safetensors", "trainer_state.pt", "config.json")
    return {n: hashlib.sha256((run / n).read_bytes()).hexdigest() for n in names}


def test_a_diverging_run_stops_with_one_line_and_keeps_the_good_checkpoint(play_path, tmp_path):
    run = tmp_path / "run"
    train(tiny_config(play_path, run, max_steps=4, sample_interval=100))
    before = _digests(run)
    diverging = tiny_config(play_path, run, max_steps=40, lr=1e30, min_lr=0.0)
    with pytest.raises(GptkilnError, match=r"diverged at step \d+: the loss is nan.*step 4.*--lr"):
        train(diverging, resume=True)
    assert _digests(run) == before


@pytest.mark.parametrize("due", ["sample", "save"])
def test_weights_that_stop_being_finite_stop_the_run_before_a_sample_or_a_save(
    due, play_path, tmp_path
):
    # The loss of a step is measured before its update, so the weights are checked too.
    run = tmp_path / "run"
    intervals = dict(sample_interval=3, checkpoint_interval=4)
    if due == "save":
        intervals = dict(sample_interval=100, checkpoint_interval=3)
    trainer = Trainer(tiny_config(play_path, run, max_steps=6, eval_interval=100, **intervals))
    weight = trainer.model.h[0].mlp.c_fc.weight

    def break_it(optimizer, args, kwargs):
        if trainer.step == 2:  # the update of the step that then counts as step 3
            with torch.no_grad():
                weight[0, 0] = math.inf

    trainer.optimizer.register_step_post_hook(break_it)
    try:
        with pytest.raises(GptkilnError, match="step 3: the loss or the weights are not finite"):
            trainer.fit()
    finally:
        trainer.close()
    assert not (run / "model.safetensors").exists()


def test_a_sample_prompt_outside_the_alphabet_fails_before_training(tmp_path):
    corpus = tmp_path / "lower.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 60)
    with pytest.raises(GptkilnError, match="--sample-prompt 'JULIET:'.*'J'"):
        Trainer(tiny_config(corpus, tmp_path / "run", sample_prompt="JULIET:"))
    with pytest.raises(GptkilnError, match="--sample-prompt is empty"):
        Trainer(tiny_config(corpus, tmp_path / "run", sample_prompt=""))
    assert not (tmp_path / "run" / "model.safetensors").exists()


def test_resume_mends_damaged_prepared_data_and_names_a_damaged_metrics_row(
    play_path, tmp_path, capsys
):
    run = tmp_path / "run"
    train(tiny_config(play_path, run, max_steps=4, sample_interval=100))
    inode = lambda: (run / "data" / "train.bin").stat().st_ino
    first = inode()
    train(tiny_config(play_path, run, max_steps=6, sample_interval=100), resume=True)
    assert inode() == first  # the same source, tokenizer and split: reused, not prepared again
    (run / "data" / "meta.json").write_text("{not json")  # prepared again from the source
    train(tiny_config(play_path, run, max_steps=8, sample_interval=100), resume=True)
    assert json.loads((run / "data" / "meta.json").read_text())["tokenizer"] == "char"
    assert inode() != first
    capsys.readouterr()
    train(tiny_config(play_path, run, max_steps=6), resume=True)  # already at step 8
    assert "nothing to train" in capsys.readouterr().err
    with open(run / "metrics.csv", "a") as f:
        f.write("x,y\n")
    with pytest.raises(GptkilnError, match=r"metrics.csv line \d+: not a row of numbers"):
        train(tiny_config(play_path, run, max_steps=12), resume=True)


def test_resume_drops_metrics_rows_logged_after_the_checkpoint(play_path, tmp_path):
    run = tmp_path / "run"
    cfg = dict(eval_interval=2, checkpoint_interval=4, sample_interval=100)
    train(tiny_config(play_path, run, max_steps=4, **cfg))
    with open(run / "metrics.csv", "a") as f:  # logged at step 6, then killed before its save
        f.write("6,768,99.0,99.0,0.001,1000\n")
    train(tiny_config(play_path, run, max_steps=8, **cfg), resume=True)
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    assert [int(r["step"]) for r in rows] == [2, 4, 6, 8]
    assert all(float(r["train_loss"]) < 99 for r in rows)  # step 6 as the resumed run logged it


def test_a_resume_with_another_batch_counts_the_tokens_each_step_really_took(play_path, tmp_path):
    run = tmp_path / "run"
    cfg = dict(eval_interval=4, checkpoint_interval=4, sample_interval=100)
    train(tiny_config(play_path, run, max_steps=8, batch_size=4, **cfg))  # 128 tokens a step
    result = train(tiny_config(play_path, run, max_steps=16, batch_size=2, **cfg), resume=True)
    tokens = [int(r["tokens"]) for r in read_metrics(run / "metrics.csv")]
    assert tokens == [512, 1024, 1024 + 4 * 64, 1024 + 8 * 64]  # then 64 a step
    assert result.tokens_seen == 1536


def test_a_resume_trains_with_the_optimizer_settings_it_records(play_path, tmp_path):
    """A resume that changes weight decay or betas trains with them (the saved state brings
    back the old ones with the moments), as its config.json says."""
    run = tmp_path / "run"
    cfg = dict(eval_interval=4, checkpoint_interval=4, sample_interval=100)
    train(tiny_config(play_path, run, max_steps=4, weight_decay=0.1, **cfg))
    train(tiny_config(play_path, run, max_steps=8, weight_decay=0.0, beta2=0.9, **cfg), resume=True)
    state = torch.load(run / "trainer_state.pt", weights_only=True)
    groups = state["optimizer"]["param_groups"]
    assert [(g["weight_decay"], tuple(g["betas"])) for g in groups] == [(0.0, (0.9, 0.9))] * 2
    recorded = json.loads((run / "config.json").read_text())["train"]
    assert (recorded["weight_decay"], recorded["beta2"]) == (0.0, 0.9)


def test_windows_sampling_refuses_a_resume_with_another_step_size(play_path, tmp_path):
    # An epoch of windows is walked in steps of batch_size x grad_accum x processes windows:
    # resumed with another size, some windows would be read twice and others never.
    run = tmp_path / "run"
    cfg = dict(sampling="windows", eval_interval=4, checkpoint_interval=4, sample_interval=100)
    train(tiny_config(play_path, run, max_steps=4, batch_size=4, **cfg))
    with pytest.raises(GptkilnError, match="trained on 4 windows a step and this resume takes 2"):
        train(tiny_config(play_path, run, max_steps=8, batch_size=2, **cfg), resume=True)
    # the same 4 windows a step, split another way, is the same walk
    train(tiny_config(play_path, run, max_steps=8, batch_size=2, grad_accum=2, **cfg), resume=True)
    assert read_checkpoint(run)[1]["step"] == 8
    # so is each epoch's shuffle, by the seed, and the sampling itself
    with pytest.raises(GptkilnError, match="trained with --seed 1337 and this resume asks for 7"):
        train(tiny_config(play_path, run, max_steps=12, seed=7, **cfg), resume=True)
    with pytest.raises(GptkilnError, match="--sampling windows and this resume asks for random"):
        train(tiny_config(play_path, run, max_steps=12, **{**cfg, "sampling": "random"}),
              resume=True)  # fmt: skip


def test_a_trainer_state_from_before_the_order_was_saved_is_checked_by_config_json(
    play_path, tmp_path
):
    """A checkpoint saved before the trainer state recorded --seed: config.json's record of
    the run's seed stands in, so the first resume of it cannot change the order either."""
    run = tmp_path / "run"
    cfg = dict(sampling="windows", checkpoint_interval=4)
    train(tiny_config(play_path, run, max_steps=4, **cfg))
    state = torch.load(run / "trainer_state.pt", weights_only=True)
    del state["seed"], state["sampling"], state["stride"]
    torch.save(state, run / "trainer_state.pt")
    with pytest.raises(GptkilnError, match="trained with --seed 1337 and this resume asks for 7"):
        train(tiny_config(play_path, run, max_steps=8, seed=7, **cfg), resume=True)
    context = read_config(run)["model"]["context_length"]  # the record's stride: None, this
    with pytest.raises(GptkilnError, match=f"--stride {context} and this resume asks for 8"):
        train(tiny_config(play_path, run, max_steps=8, stride=8, **cfg), resume=True)
    train(tiny_config(play_path, run, max_steps=8, **cfg), resume=True)


def test_a_resume_on_data_prepared_anew_says_so(play_path, tmp_path, capsys):
    """Another --val-fraction (or other text) prepares RUN/data again: the resume goes on, and
    says its losses are of the new split from there."""
    run = tmp_path / "run"
    train(tiny_config(play_path, run, max_steps=4))
    capsys.readouterr()
    train(tiny_config(play_path, run, max_steps=8, val_fraction=0.2), resume=True)
    assert "prepared anew for this resume" in capsys.readouterr().err


def test_a_bpe_run_resumes_on_other_text_read_with_its_own_tokenizer(play_path, tmp_path, capsys):
    """A resume on other text tokenizes it with the run's own BPE: training a ``bpe:N`` again
    on the new text made another tokenizer, and every such resume was refused."""
    from gptkiln.data.prepare import load_prepared
    from gptkiln.loading import load_run_tokenizer

    run, other = tmp_path / "run", tmp_path / "other.txt"
    lines = Path(play_path).read_text().splitlines()
    other.write_text("\n".join(lines).upper())  # another BPE, were it trained again
    train(tiny_config(play_path, run, max_steps=4, tokenizer="bpe:300"))
    capsys.readouterr()
    train(tiny_config(other, run, max_steps=8, tokenizer="bpe:300"), resume=True)
    assert "prepared anew for this resume" in capsys.readouterr().err
    text = "To be, or not to be"
    assert load_prepared(run / "data").tokenizer.encode(text) == load_run_tokenizer(run).encode(
        text
    )
    train(tiny_config(other, run, max_steps=10, tokenizer="bpe:300"), resume=True)
    assert "prepared anew" not in capsys.readouterr().err  # the same text: its data reused
    with pytest.raises(GptkilnError, match=r"a 'bpe' tokenizer \(300 ids\), not the 'char' one"):
        train(tiny_config(other, run, max_steps=12, tokenizer="char"), resume=True)


def test_another_alphabet_of_the_same_size_is_refused_by_resume_and_perplexity(tmp_path):
    # Two char tokenizers of 9 ids each: their ids mean different letters.
    from gptkiln.api import perplexity_of_run
    from gptkiln.data.prepare import prepare

    (tmp_path / "a.txt").write_text("abcdefgh " * 300)
    (tmp_path / "b.txt").write_text("ijklmnop " * 300)
    prepare(tmp_path / "b.txt", tmp_path / "b", tokenizer="char", progress=False)
    run = tmp_path / "run"
    cfg = dict(max_steps=2, eval_interval=2, sample_prompt="ab", sample_interval=100)
    train(tiny_config(tmp_path / "a.txt", run, **cfg))
    with pytest.raises(
        GptkilnError, match="a 'char' tokenizer of another vocabulary than the one of --data"
    ):
        train(tiny_config(tmp_path / "b", run, **{**cfg, "max_steps": 4}), resume=True)
    with pytest.raises(GptkilnError, match="a 'char' tokenizer of another vocabulary, not the"):
        perplexity_of_run(run, tmp_path / "b", progress=False)
    prepare(tmp_path / "b.txt", tmp_path / "b-bpe", tokenizer="bpe:300", progress=False)
    with pytest.raises(GptkilnError, match="a 'bpe' tokenizer, not the run's 'char' one"):
        perplexity_of_run(run, tmp_path / "b-bpe", progress=False)
    text = perplexity_of_run(run, tmp_path / "a.txt", progress=False)  # text: encoded here
    assert text.tokens > 0


def test_several_processes_on_one_machine_need_a_gpu_each():
    from gptkiln.train import check_one_gpu_each

    check_one_gpu_each("cuda", {"LOCAL_WORLD_SIZE": "2"})  # cuda:LOCAL_RANK each
    check_one_gpu_each("cuda:1", {"LOCAL_WORLD_SIZE": "1"})  # one process: any GPU
    check_one_gpu_each("cuda:1", {})
    with pytest.raises(GptkilnError, match="--device cuda:0 would put all 2 processes"):
        check_one_gpu_each("cuda:0", {"LOCAL_WORLD_SIZE": "2"})


def test_the_process_group_on_cuda_carries_the_trainers_cpu_tensors_too():
    # The trainer all-reduces CPU tensors (the loss, "is anything not finite", RNG states):
    # a CUDA run needs a CPU backend beside NCCL, or its first collective fails.
    from torch.distributed.distributed_c10d import BackendConfig

    from gptkiln.distributed import backend_for

    assert BackendConfig(backend_for("cuda:0")).get_device_backend_map() == {
        "cpu": "gloo",
        "cuda": "nccl",
    }
    assert BackendConfig(backend_for("cpu")).get_device_backend_map()["cpu"] == "gloo"


def test_windows_sampling_walks_epochs_of_the_books_windows():
    from gptkiln.distributed import World

    tokens = torch.arange(100).numpy()  # context 10, stride 10: range(0, 90, 10) = 9 windows
    b = Batches(
        tokens,
        TrainConfig(batch_size=3, max_steps=0, epochs=2, sampling="windows", stride=10),
        10,
        World(),
    )
    assert b.steps_per_epoch == 3 and b.total_steps == 6
    epochs = [[int(x[0]) for s in range(e * 3, e * 3 + 3) for x in b.get(s, 0)[0]] for e in (0, 1)]
    for order in epochs:
        assert sorted(order) == list(range(0, 90, 10))  # one epoch = every window once
    assert epochs[0] != sorted(epochs[0]) and epochs[1] != epochs[0]  # shuffled, anew each epoch
    x, y = b.get(0, 0)
    assert torch.equal(y[:, :-1], x[:, 1:])  # targets are inputs shifted by one


def run_cli(*args, **kw):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "gptkiln", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def checkpoint_step(run: Path) -> int:
    """The step a resume would start from, as the trainer itself reads it (-1: none yet).

    A kill can land inside a save, after trainer_state.pt was moved aside to
    trainer_state.prev.pt; `read_checkpoint` then takes the state that matches the weights.
    """
    try:
        return int(read_checkpoint(run)[1]["step"])
    except Exception:  # not written yet, or caught mid-write while the run is alive
        return -1


@pytest.mark.slow
def test_killed_and_resumed_run_ends_with_the_same_weights(play_path, tmp_path):
    args = [
        "train",
        "--data",
        str(play_path),
        "--model",
        "tiny",
        "--tokenizer",
        "char",
        "--context-length",
        "32",
        "--batch-size",
        "4",
        "--max-steps",
        "60",
        "--dropout",
        "0.1",
        "--eval-interval",
        "20",
        "--eval-batches",
        "2",
        "--sample-interval",
        "30",
        "--sample-tokens",
        "5",
        "--checkpoint-interval",
        "5",
        "--no-progress",
        # two fresh runs compared bit for bit: auto's measurement could choose differently
        "--precision",
        "fp32",
    ]
    full = run_cli(*args, "--out", str(tmp_path / "full"))
    assert full.wait(timeout=300) == 0, full.stdout.read()

    victim = run_cli(*args, "--out", str(tmp_path / "cut"))
    deadline = time.time() + 240
    while checkpoint_step(tmp_path / "cut") < 10 and victim.poll() is None:
        assert time.time() < deadline
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    cut_at = checkpoint_step(tmp_path / "cut")
    assert 10 <= cut_at < 60, f"the run was not interrupted mid-way (checkpoint at {cut_at})"

    resumed = run_cli(*args, "--out", str(tmp_path / "cut"), "--resume")
    output = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, output
    a = load_file(tmp_path / "full" / "model.safetensors")
    b = load_file(tmp_path / "cut" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k  # bit for bit
    steps = [int(r["step"]) for r in csv.DictReader(open(tmp_path / "cut" / "metrics.csv"))]
    assert steps == [20, 40, 60]  # no duplicated rows from the killed run


def test_resume_refuses_a_changed_model_and_fresh_runs_refuse_to_overwrite(play_path, tmp_path):
    cfg = tiny_config(play_path, tmp_path / "run", max_steps=4)
    train(cfg)
    with pytest.raises(GptkilnError, match="already holds a checkpoint"):
        train(cfg)
    changed = tiny_config(play_path, tmp_path / "run", max_steps=8, model="baby")
    with pytest.raises(GptkilnError, match="n_layer 2 in the checkpoint, 4 now"):
        train(changed, resume=True)
    with pytest.raises(GptkilnError, match="cannot resume"):
        train(tiny_config(play_path, tmp_path / "none"), resume=True)
    longer = train(tiny_config(play_path, tmp_path / "run", max_steps=8), resume=True)
    assert longer.steps == 8  # resuming may extend a run


def test_an_overwrite_replaces_the_whole_run_and_one_that_fails_first_puts_it_back(
    play_path, tmp_path
):
    """``--overwrite`` sets the old run aside: a new run that diverges before its first
    checkpoint puts it back byte for byte; one that saves leaves none of the old run's files (a
    chat template, adapters, judgements) beside its own."""
    run = tmp_path / "run"
    train(tiny_config(play_path, run, max_steps=4))
    for stale in ("chat_template.jinja", "adapter.safetensors", "judgements.json"):
        (run / stale).write_text("the old run's")
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    diverging = tiny_config(play_path, run, max_steps=4, lr=1e30, warmup_steps=0)
    with pytest.raises(GptkilnError, match="diverged.*the run it replaced is back in"):
        train(diverging, overwrite=True)
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    assert not (run / ".replaced").exists()
    train(tiny_config(play_path, run, max_steps=4), overwrite=True)
    left = {p.name for p in run.iterdir()}
    assert not left & {"chat_template.jinja", "adapter.safetensors", "judgements.json"}
    assert ".replaced" not in left and "trainer_state.pt" in left


def test_an_overwrite_on_other_text_keeps_the_old_data_until_its_first_checkpoint(
    play_path, tmp_path
):
    """A new run over a run's data prepares its own text beside it: one that fails before its
    first checkpoint, in its set-up (a sample prompt the new alphabet lacks) or while training
    (diverging), leaves the old run's ``data/`` as it was; one that saves replaces it."""
    run = tmp_path / "run"
    train(tiny_config(play_path, run, max_steps=4))
    data = {p.name: p.read_bytes() for p in (run / "data").iterdir()}
    other = tmp_path / "other.txt"
    other.write_text("abc abc cab bac\n" * 400)
    for failing, said in [
        (dict(sample_prompt="ZEBRA"), "not in"),
        (dict(lr=1e30, warmup_steps=0, sample_prompt="cab"), "diverged.*the run it replaced"),
    ]:
        with pytest.raises(GptkilnError, match=said):
            train(tiny_config(other, run, max_steps=4, **failing), overwrite=True)
        assert {p.name: p.read_bytes() for p in (run / "data").iterdir()} == data
        assert not (run / ".replaced-data").exists() and not (run / ".data-next").exists()
    train(tiny_config(other, run, max_steps=4, sample_prompt="cab"), overwrite=True)
    assert (run / "data" / "train.bin").read_bytes() != data["train.bin"]
    assert not (run / ".replaced-data").exists()


def test_a_new_run_never_sets_aside_text_of_ones_own_in_its_data_folder(tmp_path):
    """RUN/data that holds the text itself (a file, or the whole --data folder) is not the
    run's prepared data: never moved aside or deleted."""
    own = tmp_path / "proj" / "data" / "input.txt"
    own.parent.mkdir(parents=True)
    own.write_text("to be or not to be, that is the question\n" * 80)
    train(tiny_config(own, tmp_path / "proj", max_steps=4, sample_prompt="to"))
    assert own.read_text().startswith("to be") and (tmp_path / "proj" / "trainer_state.pt").exists()
    folder = tmp_path / "proj2" / "data"
    folder.mkdir(parents=True)
    (folder / "a.txt").write_text(own.read_text())
    with pytest.raises(GptkilnError, match="inside the folder it reads"):
        train(tiny_config(folder, tmp_path / "proj2", max_steps=4, sample_prompt="to"))
    assert (folder / "a.txt").read_text() == own.read_text()


def test_the_default_sample_prompt_is_the_plays_and_another_corpus_samples_from_its_start(
    tmp_path, capsys
):
    """Unset, the sample prompt is "ROMEO:" on the bundled plays alone: a run on other text
    (here one without its letters, and one with them) samples from end-of-text, or without one
    (a char run on one document) from the alphabet's first character; "ROMEO:" given (a
    recipe's) is kept; sample_tokens=0 prints no sample at all; a prompt given that the corpus
    lacks is still refused."""
    text = tmp_path / "zh.txt"
    text.write_text("床前明月光，疑是地上霜。\n\n举头望明月，低头思故乡。\n" * 60)
    cfg = tiny_config(text, tmp_path / "run", max_steps=6, sample_prompt=None)
    assert train(cfg).sample.startswith("\n")  # "\n" is the alphabet's first character
    english = tmp_path / "en.txt"
    english.write_text("ROMEO: I am here. MERCUTIO: And I am there, to be or not to be.\n" * 80)
    cfg = tiny_config(english, tmp_path / "en", max_steps=6, sample_prompt=None)
    assert not train(cfg).sample.startswith("ROMEO:")
    cfg = tiny_config(english, tmp_path / "given", max_steps=6, sample_prompt="ROMEO:")
    assert train(cfg).sample.startswith("ROMEO:")
    capsys.readouterr()
    train(tiny_config(english, tmp_path / "quiet", max_steps=6, sample_tokens=0))
    assert "--- sample" not in capsys.readouterr().out
    with pytest.raises(GptkilnError, match="sample_interval .* got 0 .no samples: sample_tokens 0"):
        TrainConfig(sample_interval=0)
    with pytest.raises(GptkilnError, match="--sample-prompt 'ROMEO!'"):
        train(tiny_config(text, tmp_path / "run2", max_steps=6, sample_prompt="ROMEO!"))


def test_ctrl_c_says_where_the_last_checkpoint_is(play_path, tmp_path, monkeypatch):
    """Ctrl-C while training ends with the step and the last checkpoint, as SIGTERM's line."""
    calls = {"n": 0}
    step = Trainer.train_step

    def interrupted(self, total):
        calls["n"] += 1
        if calls["n"] == 6:  # in step 6, after the checkpoint of step 4
            raise KeyboardInterrupt
        return step(self, total)

    monkeypatch.setattr(Trainer, "train_step", interrupted)
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt) as caught:
        train(tiny_config(play_path, run))
    assert str(caught.value) == (
        f"at step 5; the last checkpoint, step 4, is in {run}: continue with --resume"
    )


def test_gradient_accumulation_equals_the_bigger_batch(play_path, tmp_path):
    a = train(
        tiny_config(
            play_path,
            tmp_path / "a",
            batch_size=4,
            grad_accum=2,
            max_steps=3,
            sampling="windows",
            stride=16,
        )
    )
    b = train(
        tiny_config(
            play_path,
            tmp_path / "b",
            batch_size=8,
            grad_accum=1,
            max_steps=3,
            sampling="windows",
            stride=16,
        )
    )
    wa = load_file(a.run_dir / "model.safetensors")
    wb = load_file(b.run_dir / "model.safetensors")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-5, rtol=1e-4)
    # Adam and clipping hide a constant factor on the gradient: compare the gradients and the
    # reported loss themselves.
    seen = {}
    for name, batch, accum in [("a", 4, 2), ("b", 8, 1)]:
        cfg = tiny_config(
            play_path, tmp_path / f"g{name}", batch_size=batch, grad_accum=accum,
            sampling="windows", stride=16, grad_clip=0.0,
        )  # fmt: skip
        trainer = Trainer(cfg)
        grads = {}
        trainer.optimizer.register_step_pre_hook(
            lambda opt, args, kwargs, grads=grads: grads.update(
                {
                    (g, i): p.grad.clone()
                    for g, gr in enumerate(opt.param_groups)
                    for i, p in enumerate(gr["params"])
                }
            )
        )
        _, loss = trainer.train_step(cfg.max_steps)
        trainer.close()
        seen[name] = grads, loss
    (ga, la), (gb, lb) = seen["a"], seen["b"]
    assert la == pytest.approx(lb, rel=1e-5)
    for i in ga:
        torch.testing.assert_close(ga[i], gb[i], atol=1e-6, rtol=1e-4)


def test_bf16_precision_runs_the_cpu_step_in_bf16_and_keeps_fp32_weights(play_path, tmp_path):
    runs = {}
    for precision in ("auto", "bf16"):
        cfg = tiny_config(play_path, tmp_path / precision, max_steps=8, precision=precision)
        trainer = Trainer(cfg)
        x, y = trainer.batches.get(0, 0)
        with trainer.autocast:
            logits, _ = trainer.model(x, y)
        assert logits.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
        trainer.close()
        result = train(cfg, overwrite=True)
        assert result.val_loss < 4.0  # learnt (it starts near ln(vocab) = 4.1), either precision
        runs[precision] = load_file(tmp_path / precision / "model.safetensors")
        assert all(t.dtype == torch.float32 for t in runs[precision].values())
    # the same seed and batches: only the arithmetic differs
    assert not torch.equal(runs["auto"]["h.0.mlp.c_fc.weight"], runs["bf16"]["h.0.mlp.c_fc.weight"])
    with pytest.raises(GptkilnError, match="precision must be 'auto', 'fp32' or 'bf16'"):
        TrainConfig(precision="fp16")


def test_train_config_rejects_nonsense():
    with pytest.raises(GptkilnError, match="batch_size"):
        TrainConfig(batch_size=0)
    with pytest.raises(GptkilnError, match="max_steps"):
        TrainConfig(max_steps=-5)
    with pytest.raises(GptkilnError, match="lr must be a finite number > 0"):
        TrainConfig(lr=0)
    with pytest.raises(GptkilnError, match="unknown key"):
        TrainConfig.from_dict({"learning_rate": 1})


def test_a_padded_vocabulary_trains_resumes_as_it_was_and_samples_only_real_ids(
    play_path, tmp_path, capsys
):
    """``--pad-vocab 64``: the char alphabet's model holds 64 rows a multiple (CUDA's default,
    asked for here on the CPU); its loss is that of the unpadded model with the same weights
    (tests/test_model.py); a resume without the flag keeps the run's padding (a resumed run on
    another device too), one that asks for other padding is refused, and samples decode."""
    from gptkiln.loading import load_run
    from gptkiln.sampling import generate
    from gptkiln.train import model_config_for

    cfg = tiny_config(play_path, tmp_path / "run", max_steps=4, pad_vocab=64)
    train(cfg)
    model, tokenizer, _ = load_run(tmp_path / "run")
    V = tokenizer.vocab_size
    assert V % 64 and model.config.padded_vocab_size == -(-V // 64) * 64
    rows = model.config.padded_vocab_size
    assert f"vocabulary: {V} ids in {rows} rows, a multiple of 64" in capsys.readouterr().out
    assert model.wte.weight.shape[0] == model.config.padded_vocab_size
    with torch.no_grad():
        model.lm_head.weight[V:] = 50.0  # a padding row, were it ever a logit, would win
    ids = generate(model, tokenizer.encode("I "), max_new_tokens=20, temperature=1.0, seed=0)
    assert max(ids) < V
    tokenizer.decode(ids)
    # unset, a resume keeps the run's padding; a new run on a CPU pads nothing, on CUDA to 64
    longer = train(dataclasses.replace(cfg, max_steps=6, pad_vocab=None), resume=True)
    assert longer.steps == 6 and "vocabulary:" not in capsys.readouterr().out  # said once
    with pytest.raises(GptkilnError, match="padded_vocab_size"):
        train(dataclasses.replace(cfg, max_steps=8, pad_vocab=1), resume=True)
    fresh = dataclasses.replace(cfg, pad_vocab=None)
    assert model_config_for(fresh, V).padded_vocab_size is None
    assert model_config_for(fresh, V, device="cuda:1").padded_vocab_size == -(-V // 64) * 64
    assert model_config_for(fresh, 50257, device="cuda").padded_vocab_size == 50304
    assert model_config_for(dataclasses.replace(fresh, pad_vocab=1), 50257, device="cuda")\
        .padded_vocab_size is None  # fmt: skip
    assert model_config_for(fresh, 16384, device="cuda").padded_vocab_size is None  # aligned
    resumed = model_config_for(cfg, V, device="cpu")
    assert model_config_for(fresh, V, resumed, device="cuda") == resumed


def test_compile_is_on_with_cuda_and_off_elsewhere_unless_asked(play_path, tmp_path):
    from gptkiln.train.loop import compiles

    unset = tiny_config(play_path, tmp_path / "run")
    assert unset.compile is None
    assert compiles(unset, "cuda") and compiles(unset, torch.device("cuda", 1))
    assert not compiles(unset, "cpu") and not compiles(unset, "mps")
    assert not compiles(dataclasses.replace(unset, compile=False), "cuda")
    assert compiles(dataclasses.replace(unset, compile=True), "cpu")


def test_a_corpus_too_small_to_split_leaves_no_run_directory(tmp_path):
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n")
    with pytest.raises(GptkilnError, match="corpus too small"):
        train(tiny_config(blank, tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_a_refused_resume_keeps_the_runs_prepared_data(play_path, tmp_path):
    """A resume with other text, whose char alphabet is not the run's, is refused before the
    run's data/ is touched (it was prepared anew into data/ first, and the old tokens lost)."""
    run = tmp_path / "run"
    train(tiny_config(play_path, run, max_steps=4))
    before = {p.name: p.read_bytes() for p in (run / "data").iterdir() if p.is_file()}
    other = tmp_path / "other.txt"
    other.write_text("ZQXJ 0123456789 {}[]<>\n" * 200)
    with pytest.raises(GptkilnError, match="read with the run's own tokenizer: char tokenizer: "
                       "character 'Z' .* is not in its vocabulary"):  # fmt: skip
        train(tiny_config(other, run, max_steps=8), resume=True)
    assert {p.name: p.read_bytes() for p in (run / "data").iterdir() if p.is_file()} == before
    assert not (run / ".data-next").exists()


def test_a_micro_batch_whose_logits_cannot_fit_in_free_memory_is_refused_before_a_step(
    play_path, tmp_path, monkeypatch
):
    """4 windows of 32 positions of the plays' char ids: their logits and gradient at 2 bytes
    each. With less free than that the run stops before its first step, nothing written."""
    from gptkiln.train import loop

    run = tmp_path / "run"
    monkeypatch.setattr(loop, "free_memory", lambda device: 1000)
    with pytest.raises(GptkilnError, match=r"4 windows of 32 tokens needs at least .* KiB for its "
                       r"logits \(128 positions x \d+ ids.*lower --batch-size"):  # fmt: skip
        train(tiny_config(play_path, run))
    assert not (run / "model.safetensors").exists()
    monkeypatch.setattr(loop, "free_memory", lambda device: 4 * 128 * 200)  # enough for 200 ids
    train(tiny_config(play_path, run, max_steps=1), overwrite=True)
    assert (run / "model.safetensors").exists()


def test_from_python_prepared_data_keeps_its_settings_and_config_json_says_so(play_path, tmp_path):
    """A setting left at its default takes the prepared data's value (config.json records the
    char tokenizer the run used, not the default BPE); one set to something else is refused,
    as the CLI refuses its flag."""
    from gptkiln.data.prepare import prepare

    data = tmp_path / "data"
    prepare(play_path, data, tokenizer="char", val_fraction=0.2, progress=False)
    run = tmp_path / "run"
    defaults = dict(tokenizer=TrainConfig.tokenizer, val_fraction=TrainConfig.val_fraction)
    train(tiny_config(data, run, max_steps=1, **defaults))
    recorded = json.loads((run / "config.json").read_text())["train"]
    assert (recorded["tokenizer"], recorded["val_fraction"]) == ("char", 0.2)
    with pytest.raises(GptkilnError, match=r"val_fraction=0\.5: data .* was split with "
                       r"val_fraction 0\.2, which training keeps"):  # fmt: skip
        train(tiny_config(data, tmp_path / "other", val_fraction=0.5))
    with pytest.raises(GptkilnError, match="tokenizer='gpt2'.*prepared with the char tokenizer"):
        train(tiny_config(data, tmp_path / "other", tokenizer="gpt2", val_fraction=0.2))


@pytest.mark.parametrize(
    "setting", [dict(adamw_lr=0.01), dict(embedding_lr=0.5), dict(muon_momentum=0.5)]
)
def test_from_python_a_setting_of_the_optimizer_not_used_is_refused(play_path, tmp_path, setting):
    """``optimizer="adamw"`` reads none of Muon's settings; ``schedule="cosine"`` no cooldown."""
    with pytest.raises(GptkilnError, match=f"{next(iter(setting))}=.* acts only with "
                       "optimizer='muon', and this run has optimizer='adamw'"):  # fmt: skip
        train(tiny_config(play_path, tmp_path / "run", **setting))
    with pytest.raises(GptkilnError, match="cooldown=0.3 acts only with schedule=.wsd."):
        train(tiny_config(play_path, tmp_path / "run", cooldown=0.3))
    assert not (tmp_path / "run").exists()


def test_a_warm_up_as_long_as_the_run_gets_a_note(play_path, tmp_path, capsys):
    train(tiny_config(play_path, tmp_path / "a", max_steps=3, warmup_steps=4))
    assert "the warm-up of 4 steps outlasts the run of 3" in capsys.readouterr().err
    train(tiny_config(play_path, tmp_path / "b", max_steps=3, warmup_steps=3))  # lr at step 3
    assert "warm-up" not in capsys.readouterr().err


def test_a_presets_sizes_are_settings_of_their_own(play_path, tmp_path):
    """``n_layer``, ``n_head``, ``n_kv_head``, ``n_embd`` over the preset (nanoGPT's --n_layer
    ...): the run's model has them, config.json records them, and a size the family cannot
    take is one line."""
    from gptkiln.loading import load_model

    run = tmp_path / "run"
    train(tiny_config(play_path, run, model="llama3-baby", n_layer=3, n_head=8, n_kv_head=4,
                      n_embd=64, max_steps=1))  # fmt: skip
    config = load_model(run).config
    assert (config.n_layer, config.n_head, config.n_kv_head, config.n_embd) == (3, 8, 4, 64)
    assert json.loads((run / "config.json").read_text())["train"]["n_layer"] == 3
    with pytest.raises(GptkilnError, match="n_kv_head 1: tiny is a GPT-2, which has one"):
        train(tiny_config(play_path, tmp_path / "gpt2", n_kv_head=1, max_steps=1))
    with pytest.raises(GptkilnError, match="n_embd 32 is not a whole number of heads of n_head 3"):
        train(tiny_config(play_path, tmp_path / "gpt2", n_head=3, max_steps=1))
    with pytest.raises(GptkilnError, match="n_layer must be a whole number >= 1"):
        TrainConfig(n_layer=0)


def test_a_resume_that_fails_while_it_rewrites_metrics_csv_keeps_the_file(
    play_path, tmp_path, monkeypatch
):
    """A resume trims metrics.csv to its checkpoint's rows: written beside it and renamed, so
    a failure halfway (a kill, a full disk) leaves the whole history, not the rows so far."""
    from gptkiln.train import run_log

    run = tmp_path / "run"
    train(tiny_config(play_path, run, max_steps=8))
    before = (run / "metrics.csv").read_bytes()
    real = run_log.RunLog._write_rows

    def fails_after_a_row(self, path, rows, mode):
        real(self, path, rows[:1], mode)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(run_log.RunLog, "_write_rows", fails_after_a_row)
    with pytest.raises(GptkilnError, match="no space left"):
        train(tiny_config(play_path, run, max_steps=12), resume=True)
    assert (run / "metrics.csv").read_bytes() == before


def test_a_metrics_csv_that_is_not_utf8_is_one_line(tmp_path):
    from gptkiln.train import read_metrics

    path = tmp_path / "metrics.csv"
    path.write_bytes(b"step,tokens,train_loss\n1,8,2.5\ngarbage\xff\n")
    with pytest.raises(GptkilnError, match=r"metrics.csv line 3 is not UTF-8 text; fix that line"):
        read_metrics(path)
    path.write_bytes(b"step,tokens,train_loss\n1,8,2.5\n\x00\x00\n")
    with pytest.raises(GptkilnError, match=r"line 3.*\\x00"):
        read_metrics(path)


def test_train_leaves_the_callers_config_as_it_was_and_records_a_setting_it_can_read(
    play_path, tmp_path
):
    """What a run takes from prepared data is its own: the caller's TrainConfig is unchanged.
    Data prepared with a folder's tokenizer records a tokenizer setting TrainConfig takes."""
    from gptkiln.data.prepare import prepare

    first = tmp_path / "first"
    prepare(play_path, first, "bpe:300", progress=False)
    again = tmp_path / "again"
    prepare(play_path, again, first, progress=False)  # the tokenizer of a folder
    cfg = tiny_config(again, tmp_path / "run", max_steps=1, tokenizer=TrainConfig.tokenizer)
    train(cfg)
    assert cfg.tokenizer == TrainConfig.tokenizer
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())["train"]
    assert TrainConfig.from_dict(recorded).tokenizer.startswith("bpe:")


def test_the_logits_bound_reads_packed_rows_as_rows(monkeypatch):
    """A packed fine-tuning batch is (B, 2, T), ids and segments: B rows of T positions."""
    from gptkiln.config import GPTConfig
    from gptkiln.train import loop

    config = GPTConfig(vocab_size=1000, context_length=1024, n_layer=1, n_head=1, n_embd=8)
    monkeypatch.setattr(loop, "free_memory", lambda device: 8 * 1024 * 1000 * 4 - 1)
    said = r"8 windows of 1,024 tokens needs at least 31.2 MiB .*\(8,192 positions"
    with pytest.raises(GptkilnError, match=said):
        loop.check_logits_fit(config, torch.zeros(8, 2, 1024, dtype=torch.long), "cpu")
    monkeypatch.setattr(loop, "free_memory", lambda device: 8 * 1024 * 1000 * 4)
    loop.check_logits_fit(config, torch.zeros(8, 2, 1024, dtype=torch.long), "cpu")


def test_a_run_directory_is_trained_by_one_run_at_a_time(play_path, tmp_path):
    """A second run into a directory another is training (here, set up and not yet fitted) is
    one line; once the first lets it go, it trains. A refused new run leaves no folder."""
    first = Trainer(tiny_config(play_path, tmp_path / "run", max_steps=2))
    try:
        with pytest.raises(GptkilnError, match="is being written by another training run"):
            train(tiny_config(play_path, tmp_path / "run", max_steps=2), overwrite=True)
        first.fit()
    finally:
        first.close()
    train(tiny_config(play_path, tmp_path / "run", max_steps=4), resume=True)
    with pytest.raises(GptkilnError):
        train(tiny_config(play_path, tmp_path / "new" / "run", max_steps=2, adamw_lr=0.1))
    assert not (tmp_path / "new").exists()


def test_a_config_json_edited_away_from_its_weights_is_named_on_resume(play_path, tmp_path):
    """The flags are the run's: what is wrong is config.json, and --overwrite (what a changed
    model is told) would lose the good weights."""
    run = tmp_path / "run"
    train(tiny_config(play_path, run, max_steps=4))
    config = json.loads((run / "config.json").read_text())
    config["model"]["n_layer"] = 3
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(GptkilnError, match="config.json does not belong to its weights .*restore"):
        train(tiny_config(play_path, run, max_steps=8), resume=True)


def test_a_resume_on_a_prepared_folder_prepared_again_from_other_text_says_so(
    play_path, tmp_path, capsys
):
    """``gptkiln prepare`` writes over a prepared folder; a run that trains on that folder,
    resumed, says its tokens are not those it trained on (its losses would seem to jump)."""
    from gptkiln.data.prepare import prepare

    data = tmp_path / "data"
    prepare(play_path, data, "char", progress=False)
    run = tmp_path / "run"
    cfg = tiny_config(data, run, max_steps=4)
    train(cfg)
    capsys.readouterr()
    train(dataclasses.replace(cfg, max_steps=6), resume=True)  # the same tokens: quiet
    assert "holds other tokens" not in capsys.readouterr().err
    other = tmp_path / "other.txt"
    other.write_text(play_path.read_text()[::-1])  # the same characters, other text
    prepare(other, data, "char", progress=False)
    train(dataclasses.replace(cfg, max_steps=8), resume=True)
    assert f"{data} holds other tokens than the run trained on until step 6" in (
        capsys.readouterr().err
    )
