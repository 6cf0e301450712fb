"""The CLI as a user meets it: the main paths work, and bad input gets one line and exit code 2."""

import hashlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gptkiln.cli import build_parser, main, train_config_from_args
from gptkiln.config import GPTConfig, SampleConfig, TrainConfig
from gptkiln.errors import GptkilnError
from gptkiln.model import GPT
from gptkiln.train import model_config_for, read_metrics


def cli(*argv, capsys):
    """Run the CLI in-process; return (exit code, stdout, stderr)."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, *needles):
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one line, no traceback
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, play_path):
    out = tmp_path_factory.mktemp("cli") / "run"
    code = main(
        [
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
            "6",
            "--eval-interval",
            "3",
            "--eval-batches",
            "1",
            "--sample-interval",
            "100",
            "--sample-tokens",
            "5",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    return out


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_prepare_over_other_prepared_data_says_what_it_replaced(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello world, more text here\n" * 3)
    (tmp_path / "b.txt").write_text("other words entirely\n" * 3)
    out = tmp_path / "prepared"
    base = ["--tokenizer", "char", "--out", out, "--quiet"]
    code, _, err = cli("prepare", tmp_path / "a.txt", *base, capsys=capsys)
    assert code == 0 and err == ""
    code, _, err = cli("prepare", tmp_path / "a.txt", *base, capsys=capsys)
    assert code == 0 and err == ""  # the same data again: nothing to say
    code, out_text, err = cli("prepare", tmp_path / "b.txt", *base, capsys=capsys)
    assert code == 0 and "b.txt" not in out_text
    assert (
        err.startswith(f"note: {out} held prepared data of ")
        and "a.txt (char tokenizer, 75 train tokens), now replaced" in err
    )


def test_bpe_sample_mb_is_for_a_bpe_trained_here(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello world, more text here\n" * 3)
    for tokenizer, value, needle in [
        ("char", "4", "--bpe-sample-mb is for a bpe tokenizer trained here, and --tokenizer char"),
        ("bpe:300", "-1", "--bpe-sample-mb -1: the MiB of text a BPE learns from, >= 0"),
    ]:
        flags = ["--tokenizer", tokenizer, "--bpe-sample-mb", value, "--out", tmp_path / "o"]
        code, _, err = cli("prepare", tmp_path / "a.txt", *flags, capsys=capsys)
        assert_one_line_error(code, err, needle)
    for tokenizer, value, needle in [  # train takes it too, for the text it prepares
        ("char", "4", "bpe tokenizer trained on the text, and tokenizer char trains none"),
        ("bpe:300", "-1", "-1: the MiB of text a BPE learns from, >= 0"),
    ]:
        flags = ["--tokenizer", tokenizer, "--bpe-sample-mb", value, "--out", tmp_path / "r"]
        code, _, err = cli("train", "--data", tmp_path / "a.txt", *flags, capsys=capsys)
        assert_one_line_error(code, err, needle)
        assert not (tmp_path / "r").exists()


def test_train_prepares_its_bpe_from_the_sample_asked_and_again_for_another(tmp_path, capsys):
    """``train --bpe-sample-mb N``: the BPE of the text it prepares learns from the first N MiB
    (0: all), recorded in the data's meta.json; asked another, the text is prepared again (the
    data of another tokenizer is not reused); a prepared folder, with its own tokenizer, refuses
    it."""
    import json

    (tmp_path / "a.txt").write_text("hello world, more text here and there\n" * 40)
    flags = ["--data", tmp_path / "a.txt", "--tokenizer", "bpe:300", "--model", "tiny",
             "--max-steps", "1", "--batch-size", "2", "--context-length", "16", "--eval-batches",
             "1", "--sample-tokens", "0", "--no-progress", "--out", tmp_path / "run"]  # fmt: skip
    meta = tmp_path / "run" / "data" / "meta.json"
    code, _, err = cli("train", *flags, "--bpe-sample-mb", "0", capsys=capsys)
    assert code == 0, err
    assert json.loads(meta.read_text())["bpe_sample_limit"] is None
    code, _, err = cli("train", *flags, "--overwrite", capsys=capsys)
    assert code == 0, err
    assert json.loads(meta.read_text())["bpe_sample_limit"] == 32 << 20  # the default
    made = meta.stat().st_mtime_ns
    code, _, err = cli("train", *flags, "--overwrite", capsys=capsys)  # the same: reused
    assert code == 0 and meta.stat().st_mtime_ns == made, err
    code, _, err = cli("train", *flags, "--overwrite", "--bpe-sample-mb", "1", capsys=capsys)
    assert code == 0 and json.loads(meta.read_text())["bpe_sample_limit"] == 1 << 20, err
    code, _, err = cli("train", "--data", tmp_path / "run" / "data", "--bpe-sample-mb", "1",
                       "--out", tmp_path / "other", capsys=capsys)  # fmt: skip
    assert_one_line_error(code, err, "is prepared already, with its own tokenizer")


def test_bad_sources_through_prepare(tmp_path, capsys):
    out = tmp_path / "prepared"
    code, _, err = cli("prepare", tmp_path / "missing.txt", "--out", out, capsys=capsys)
    assert_one_line_error(code, err, "missing.txt")
    (tmp_path / "empty.txt").write_text("")
    code, _, err = cli("prepare", tmp_path / "empty.txt", "--out", out, capsys=capsys)
    assert_one_line_error(code, err, "empty.txt")
    (tmp_path / "blob.txt").write_bytes(b"abc\x00\x01\x02" * 10)
    code, _, err = cli("prepare", tmp_path / "blob.txt", "--out", out, capsys=capsys)
    assert_one_line_error(code, err, "blob.txt", "binary")
    (tmp_path / "latin.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    code, _, err = cli("prepare", tmp_path / "latin.txt", "--out", out, capsys=capsys)
    assert_one_line_error(code, err, "latin.txt", "UTF-8")
    (tmp_path / "docs.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    code, _, err = cli("prepare", tmp_path / "docs.jsonl", "--out", out, capsys=capsys)
    assert_one_line_error(code, err, "docs.jsonl", "line 2")
    code, _, err = cli(
        "prepare", tmp_path / "docs.jsonl", "--out", out, "--tokenizer", "wordpiece", capsys=capsys
    )
    assert_one_line_error(code, err, "wordpiece")
    (tmp_path / "half.jsonl").write_text('{"text": "fine"}\n{"text": "half \\ud800 a pair"}\n')
    code, _, err = cli("prepare", tmp_path / "half.jsonl", "--out", out, capsys=capsys)
    assert_one_line_error(code, err, "half.jsonl line 2", "surrogate")
    assert not out.exists() or not (out / "train.bin").exists()  # nothing half-written


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--model", "gpt5"], "gpt5"),
        (["--max-steps", "0"], "max_steps"),
        (["--batch-size", "-2"], "batch_size"),
        (["--lr", "-1"], "lr"),
        (["--eval-interval", "0"], "eval_interval"),
        (["--context-length", "0"], "context_length"),
        (["--max-steps", "ten"], "--max-steps"),
        (["--max-time", "0"], "max_time"),
        (["--max-time", "-3"], "max_time"),
        (["--max-time", "inf"], "max_time"),
        (["--max-time", "3min"], "--max-time"),
        (["--tokenizer", "morse"], "morse"),
        (["--tokenizer", "bpe:2147483648"], "bpe:2147483648"),
        (["--tokenizer", "/"], "gptkiln prepare TEXT --tokenizer / --out DATA"),  # a folder's
        (["--data", ""], "empty name"),
        (["--config", "no-such-recipe"], "no-such-recipe"),
        (["--nproc", "0"], "nproc"),
        (["--nproc", "2", "--data", "/no/such/corpus.txt"], "corpus.txt"),  # before torchrun
        (["--beta1", "-0.5"], "beta1"),
        (["--beta2", "1"], "beta2"),
        (["--optimizer", "adamw", "--adamw-lr", "0.01"], "--adamw-lr acts only with --optimizer"),
        (["--config", "baseline", "--muon-momentum", "0.9"], "this run has --optimizer adamw"),
        (["--schedule", "cosine", "--cooldown", "0.3"], "drop --cooldown"),
        (["--no-decay-lr", "--cooldown", "0.3"], "--cooldown acts only with --decay-lr"),
        (["--no-decay-lr", "--min-lr", "1e-5"], "this run has --no-decay-lr; drop --min-lr"),
        (["--sampling", "random", "--stride", "16"], "--stride acts only with --sampling windows"),
        (["--epochs", "3", "--max-steps", "2"], "--epochs acts only with --max-steps 0"),
    ],
)
def test_bad_train_flags(flags, needle, tmp_path, capsys, play_path):
    code, _, err = cli("train", "--data", play_path, "--out", tmp_path / "r", *flags, capsys=capsys)
    assert_one_line_error(code, err, needle)
    assert not (tmp_path / "r" / "model.safetensors").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="names devices this machine lacks")
@pytest.mark.parametrize(
    "device, needle",
    [
        ("mps", "cannot run on mps here"),  # torch names it; a Linux build cannot run it
        ("xpu", "cannot run on xpu here"),
        ("meta", "holds shapes, not values"),
        ("cuda:1", "CUDA is not available here"),
        ("gpu", "is not a torch device"),  # quoted: "--device 'gpu'"
    ],
)
def test_a_device_this_build_cannot_run_on_is_one_line(run_dir, capsys, device, needle):
    if device == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine runs mps")
    code, _, err = cli("generate", run_dir, "--prompt", "I", "--device", device, capsys=capsys)
    assert_one_line_error(code, err, device, needle)


def test_a_misspelt_flag_is_named_by_its_command_with_the_nearest_flag(run_dir, capsys):
    code, _, err = cli("train", "--max-stpes", "5", capsys=capsys)
    assert_one_line_error(code, err, "gptkiln train: error: unrecognized arguments: --max-stpes 5",
                          "did you mean --max-steps?", "see 'gptkiln train --help'")  # fmt: skip
    code, _, err = cli("generate", run_dir, "--prompt", "I", "--tempreature=0.5", capsys=capsys)
    assert_one_line_error(code, err, "gptkiln generate: error:", "did you mean --temperature?")


@pytest.mark.parametrize(
    "argv, named",
    [
        (["generate", "RUN", "--prompt", "a", "--stop", "\udcff"], "--stop"),
        (["train", "--sample-prompt", "a\udcffb", "--out", "OUT"], "--sample-prompt"),
        (["info", "r\udcff"], "RUN"),
    ],
)
def test_an_argument_that_is_not_utf8_is_one_line_naming_it(argv, named, run_dir, tmp_path, capsys):
    """Bytes that are not UTF-8 on the command line (kept by Python as surrogates) are refused
    before the command runs, whichever flag holds them."""
    argv = [{"RUN": run_dir, "OUT": tmp_path / "out"}.get(a, a) for a in argv]
    code, _, err = cli(*argv, capsys=capsys)
    assert_one_line_error(code, err, f"{named} is not valid UTF-8 text")
    assert not (tmp_path / "out").exists()


def test_a_file_whose_name_is_not_utf8_is_read(run_dir, tmp_path, capsys, monkeypatch):
    """A Latin-1 file name is a good name: only text that is not a path there is refused, and
    an argument documented as TEXT is text even where a file has its name."""
    latin = tmp_path / "caf\udce9.txt"  # the byte 0xE9, as Python keeps it
    latin.write_text("to be or not to be\n" * 40)
    code, out, err = cli("prepare", latin, "--tokenizer", "char", "--out", tmp_path / "o",
                         capsys=capsys)  # fmt: skip
    assert code == 0, err
    monkeypatch.chdir(tmp_path)
    code, _, err = cli("generate", run_dir, "--prompt", latin.name, capsys=capsys)
    assert_one_line_error(code, err, "--prompt is not valid UTF-8 text")


def test_an_out_that_is_a_file_and_a_data_folder_for_a_run_are_named(play_path, tmp_path, capsys):
    from gptkiln.data.prepare import prepare

    (tmp_path / "notes.txt").write_text("mine")
    code, _, err = cli("train", "--data", play_path, "--out", tmp_path / "notes.txt",
                       "--model", "tiny", capsys=capsys)  # fmt: skip
    assert_one_line_error(code, err, "notes.txt is a file; give a folder for the run")
    assert (tmp_path / "notes.txt").read_text() == "mine"
    prepare(play_path, tmp_path / "data", "char", progress=False)
    code, _, err = cli("info", tmp_path / "data", capsys=capsys)
    assert_one_line_error(code, err, "is prepared data, not a run", "gptkiln train --data")


def test_perplexity_reads_a_source_as_prepare_names_it(monkeypatch):
    """--data hf:NAME or shakespeare reached the reader as a Path, which is neither."""
    import gptkiln.data.sources as sources
    from gptkiln.api import eval_tokens
    from gptkiln.tokenizers import load_tokenizer

    seen = []
    monkeypatch.setattr(
        sources, "iter_documents", lambda data, text_field: seen.append(data) or ["a b"]
    )
    for name in ("hf:owner/name", "shakespeare"):
        assert eval_tokens(name, load_tokenizer("gpt2")).tolist() == [64, 275]
    assert seen == ["hf:owner/name", "shakespeare"]


def test_perplexity_holds_a_texts_ids_as_one_array(tmp_path):
    """Held-out text's ids are one int64 array, joined as prepare joins documents: a list of
    Python ints took ~64 bytes a token (a 52 MB jsonl: 1,146 MB peak, 581 MB as an array)."""
    import numpy as np

    from gptkiln.api import eval_tokens
    from gptkiln.tokenizers import load_tokenizer

    docs = ["To be, or not to be", "that is the question", "Whether 'tis nobler"]
    (tmp_path / "held.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    gpt2 = load_tokenizer("gpt2")
    ids = eval_tokens(tmp_path / "held.jsonl", gpt2)
    assert isinstance(ids, np.ndarray) and ids.dtype == np.int64
    joined = gpt2.encode(docs[0]) + [gpt2.eot_id] + gpt2.encode(docs[1])
    assert ids.tolist() == joined + [gpt2.eot_id] + gpt2.encode(docs[2])


def test_generate_streams_and_is_seeded(run_dir, capsys):
    args = ["generate", run_dir, "--prompt", "I had", "--max-new-tokens", "20", "--seed", "1"]
    code, out1, _ = cli(*args, capsys=capsys)
    assert code == 0 and out1.startswith("I had") and len(out1.strip()) > len("I had")
    code, out2, _ = cli(*args, capsys=capsys)
    assert out1 == out2


def test_generate_takes_stop_strings_and_penalties(run_dir, capsys):
    from gptkiln.api import generate_text

    base = ["generate", run_dir, "--prompt", "I had", "--max-new-tokens", "30", "--seed", "2"]
    code, free, _ = cli(*base, capsys=capsys)
    assert code == 0
    stop = free[len("I had") + 3 : len("I had") + 5]  # two characters it writes anyway
    code, cut, _ = cli(*base, "--stop", stop, "--stop", "zzzz", capsys=capsys)
    assert code == 0 and cut == free[: free.index(stop, len("I had"))] + "\n"
    flags = ["--presence-penalty", "1.5", "--frequency-penalty", "-0.5"]
    code, penalised, _ = cli(*base, *flags, capsys=capsys)
    cfg = SampleConfig(
        max_new_tokens=30,
        temperature=0.8,  # the command's default
        seed=2,
        presence_penalty=1.5,
        frequency_penalty=-0.5,
    )
    assert code == 0 and penalised == generate_text(run_dir, "I had", cfg) + "\n"
    assert penalised != free
    code, _, err = cli(*base, "--frequency-penalty", "3", capsys=capsys)
    assert_one_line_error(code, err, "--frequency-penalty")


def test_prompt_longer_than_context_is_cropped_with_a_notice(run_dir, capsys):
    long_prompt = "the " * 40  # 160 characters, context 32
    code, out, err = cli(
        "generate",
        run_dir,
        "--prompt",
        long_prompt,
        "--max-new-tokens",
        "5",
        "--temperature",
        "0",
        capsys=capsys,
    )
    assert code == 0
    assert "note: prompt has 160 tokens" in err and "keeping the last 32" in err
    assert out.startswith(long_prompt)


def test_generating_past_the_context_slides_the_window_and_says_so(run_dir, capsys):
    """The policy `generate --help` states: past the context the window slides (the book's
    way), with one line on stderr; every token asked for is written. (The server refuses.)"""
    args = ["generate", run_dir, "--prompt", "I had", "--temperature", "0"]
    code, out, err = cli(*args, "--max-new-tokens", "40", capsys=capsys)  # 5 + 40 > 32
    err = _without_precision_note(err)
    assert code == 0 and err.count("\n") == 1
    assert "prompt's 5 tokens and up to 40 new ones pass the model's context of 32" in err
    assert "the window slides" in err and "gptkiln serve refuses" in err
    assert len(out) == len("I had") + 40 + 1  # a char run: 40 tokens, 40 characters
    code, _, err = cli(*args, "--max-new-tokens", "27", capsys=capsys)  # 5 + 27 fits
    assert code == 0 and _without_precision_note(err) == ""
    code, _, err = cli(*args, "--prompt", "I", "--max-new-tokens", "30", capsys=capsys)
    assert code == 0 and "prompt 1's 5 tokens and up to 30 new ones" in err
    assert "prompt 2" not in err  # 1 + 30 fits


def _without_precision_note(err: str) -> str:
    """stderr less the line every CPU generate writes once (what it decodes at, issue 43)."""
    lines = err.splitlines(keepends=True)
    kept = [line for line in lines if not line.startswith("note: decoding at ")]
    assert len(lines) - len(kept) == 1, err
    return "".join(kept)


def test_perplexity_prints_loss_and_perplexity(run_dir, play_path, capsys):
    code, out, _ = cli("perplexity", run_dir, "--data", play_path, "--quiet", capsys=capsys)
    assert code == 0
    loss = float(out.split("loss ")[1].split()[0])
    ppl = float(out.split("perplexity ")[1].split()[0])
    assert 0 < loss < 5 and ppl == pytest.approx(2.718281828**loss, rel=1e-3)
    bits = float(out.split(" | ")[2].removesuffix(" bits/char"))  # a char run: the loss in bits
    assert bits == pytest.approx(loss / math.log(2), abs=1e-4)


def test_perplexity_reads_the_text_field_a_run_was_trained_on(run_dir, play_path, tmp_path, capsys):
    """A run trained with --text-field content is scored on held-out records of that shape; the
    refusal of such a file named a --text-field perplexity did not have."""
    lines = Path(play_path).read_text().splitlines()[:400]
    for name, key in (("text.jsonl", "text"), ("content.jsonl", "content")):
        with open(tmp_path / name, "w") as f:
            for i in range(0, len(lines), 20):
                f.write(json.dumps({key: "\n".join(lines[i : i + 20]), "id": i}) + "\n")
    args = ["--quiet", "--data"]
    code, by_text, err = cli("perplexity", run_dir, *args, tmp_path / "text.jsonl", capsys=capsys)
    assert code == 0, err
    code, by_content, err = cli("perplexity", run_dir, *args, tmp_path / "content.jsonl",
                                "--text-field", "content", capsys=capsys)  # fmt: skip
    assert code == 0, err
    assert by_content == by_text
    code, _, err = cli("perplexity", run_dir, *args, run_dir / "data", "--text-field", "content",
                       capsys=capsys)  # fmt: skip
    assert_one_line_error(code, err, "--text-field content", "is prepared data")


def test_the_old_name_eval_says_the_new_one(run_dir, play_path, capsys):
    code, out, err = cli("eval", run_dir, "--data", play_path, capsys=capsys)
    assert_one_line_error(code, err, "gptkiln eval", "renamed", "gptkiln perplexity")
    assert out == ""


def test_perplexity_keeps_freed_memory_on_the_cpu(run_dir, play_path, capsys, monkeypatch):
    import gptkiln.allocator

    calls = []
    monkeypatch.setattr(gptkiln.allocator, "keep_freed_memory", lambda: calls.append(1) or True)
    code, _, err = cli("perplexity", run_dir, "--data", play_path, "--device", "cpu", "--quiet",
                       capsys=capsys)  # fmt: skip
    assert code == 0, err
    assert calls == [1]


def test_convert_quantize_then_generate_and_perplexity(run_dir, tmp_path, play_path, capsys):
    q = tmp_path / "q"
    code, out, _ = cli("convert", "quantize", run_dir, "--out", q, capsys=capsys)
    assert code == 0 and out.strip() == f"wrote {q}"
    assert json.loads((q / "config.json").read_text())["quantization"]["method"] == "int8"
    greedy = ["--prompt", "I had", "--max-new-tokens", "12", "--temperature", "0"]
    code, from_run, _ = cli("generate", q, *greedy, capsys=capsys)
    assert code == 0 and from_run.startswith("I had") and len(from_run) > len("I had\n")
    code, on_load, _ = cli("generate", run_dir, *greedy, "--quantize", "int8", capsys=capsys)
    assert code == 0 and on_load == from_run  # the saved int8 run is the float run quantized

    def loss(*argv):
        code, out, _ = cli("perplexity", *argv, "--data", play_path, "--quiet", capsys=capsys)
        assert code == 0
        return float(out.split("loss ")[1].split()[0])

    fp32, int8 = loss(run_dir), loss(q)  # printed to 4 decimals: see test_quantize for more
    assert int8 == loss(run_dir, "--quantize", "int8") == pytest.approx(fp32, rel=0.01)


@pytest.mark.parametrize(
    "shape",
    [
        ["--prompt", "I had"],  # streamed
        ["--prompt", "I had", "--prompt", "To be"],  # one batch through api.complete
        ["--prompt", "I had", "--num-samples", "2", "--seed", "1"],
        ["--prompt", "I had", "--json"],
    ],
)
def test_every_path_of_generate_honours_quantize(shape, run_dir, monkeypatch, capsys):
    import gptkiln.loading as loading
    from gptkiln.quantize import quantization_of

    loaded = []
    real = loading.load_run

    def spy(*args, **kwargs):
        result = real(*args, **kwargs)
        loaded.append(quantization_of(result[0]))
        return result

    monkeypatch.setattr(loading, "load_run", spy)
    code, out, err = cli(
        "generate", run_dir, *shape, "--max-new-tokens", "4", "--quantize", "int8", capsys=capsys
    )
    assert code == 0, err
    assert len(loaded) == 1 and loaded[0] is not None and loaded[0]["method"] == "int8"


def test_quantized_runs_refuse_what_they_cannot_do(run_dir, tmp_path, capsys):
    q = tmp_path / "q"
    assert cli("convert", "quantize", run_dir, "--out", q, capsys=capsys)[0] == 0
    code, _, err = cli("convert", "quantize", run_dir, "--out", q, capsys=capsys)
    assert_one_line_error(code, err, "already holds a model", "--overwrite")
    code, out, err = cli("convert", "to-hf", q, "--out", tmp_path / "hf", capsys=capsys)
    assert code == 0 and "quantized (int8): its weights are written dequantized" in out, err
    code, _, err = cli(
        "convert", "quantize", run_dir, "--out", q, "--method", "int3", capsys=capsys
    )
    assert_one_line_error(code, err, "--method 'int3'", "int8")
    weights = (q / "model.safetensors").read_bytes()
    mismatched = Path(shutil.copytree(run_dir, tmp_path / "mismatched"))
    (mismatched / "model.safetensors").write_bytes(weights)  # int8 weights, a float config.json
    code, _, err = cli("perplexity", mismatched, "--data", run_dir / "config.json", capsys=capsys)
    assert_one_line_error(code, err, "records no quantization: wrong dtype", "int8")
    (q / "model.safetensors").write_bytes(weights[: len(weights) - 64])
    code, _, err = cli("generate", q, "--prompt", "x", capsys=capsys)
    assert_one_line_error(code, err, "model.safetensors", "truncated or corrupt")


@pytest.mark.parametrize("command", ["generate", "generate-batch", "perplexity"])
@pytest.mark.parametrize("value", ["int4", "INT8", "none"])
def test_a_bad_quantize_value_is_refused_in_one_line(command, value, run_dir, capsys):
    rest = {
        "generate": ["--prompt", "x"],
        "generate-batch": ["--prompt", "x", "--prompt", "y"],
        "perplexity": ["--data", run_dir / "config.json"],
    }[command]
    command = command.removesuffix("-batch")
    code, out, err = cli(command, run_dir, *rest, "--quantize", value, capsys=capsys)
    assert_one_line_error(code, err, f"quantize {value!r}", "int8")
    assert out == ""


def test_bad_run_directories(run_dir, tmp_path, capsys):
    code, _, err = cli("generate", tmp_path, "--prompt", "x", capsys=capsys)
    assert_one_line_error(code, err, str(tmp_path))
    code, _, err = cli("generate", run_dir, "--prompt", "x", "--temperature", "-1", capsys=capsys)
    assert_one_line_error(code, err, "--temperature must be")  # the flag, not the field
    code, _, err = cli("generate", run_dir, "--prompt", "x", "--presence-penalty", "5",
                       capsys=capsys)  # fmt: skip
    assert_one_line_error(code, err, "--presence-penalty must be in [-2, 2]")
    for flag, value in (("--repetition-penalty", "0"), ("--min-p", "2"), ("--num-samples", "0"),
                        ("--batch-size", "0")):  # fmt: skip
        code, _, err = cli("generate", run_dir, "--prompt", "x", flag, value, capsys=capsys)
        assert_one_line_error(code, err, f"{flag} must be")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in run_dir.iterdir():
        if f.is_file():
            (broken / f.name).write_bytes(f.read_bytes())
    weights = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    code, _, err = cli("generate", broken, "--prompt", "x", capsys=capsys)
    assert_one_line_error(code, err, "model.safetensors", "truncated")
    import torch
    from safetensors.torch import save_file

    save_file({"encoder.weight": torch.zeros(2, 2)}, broken / "model.safetensors")
    code, _, err = cli("perplexity", broken, "--data", run_dir / "config.json", capsys=capsys)
    assert_one_line_error(code, err, "model.safetensors")


def test_resume_with_a_changed_model_loses_nothing(run_dir, play_path, capsys):
    before = sha(run_dir / "model.safetensors"), sha(run_dir / "trainer_state.pt")
    code, _, err = cli(
        "train",
        "--data",
        play_path,
        "--model",
        "baby",
        "--tokenizer",
        "char",
        "--context-length",
        "32",
        "--max-steps",
        "8",
        "--out",
        run_dir,
        "--resume",
        "--no-progress",
        capsys=capsys,
    )
    assert_one_line_error(code, err, "cannot resume", "n_layer")
    code, _, err = cli(
        "train",
        "--data",
        play_path,
        "--model",
        "tiny",
        "--out",
        run_dir,
        "--no-progress",
        capsys=capsys,
    )
    assert_one_line_error(code, err, "already holds a checkpoint", "--resume")
    assert (sha(run_dir / "model.safetensors"), sha(run_dir / "trainer_state.pt")) == before


def test_book_verdict_recipe_holds_the_books_settings():
    args = build_parser().parse_args(["train", "--config", "book-verdict", "--data", "x.txt"])
    cfg = train_config_from_args(args)
    assert (cfg.model, cfg.context_length, cfg.lr, cfg.weight_decay, cfg.batch_size) == (
        "book-124m",
        256,
        4e-4,
        0.1,
        2,
    )
    assert (cfg.epochs, cfg.max_steps, cfg.eval_interval, cfg.eval_batches, cfg.seed) == (
        10,
        0,
        5,
        5,
        123,
    )
    assert (cfg.sampling, cfg.stride, cfg.val_fraction, cfg.data) == ("windows", 256, 0.1, "x.txt")
    # the book trains in fp32: --precision auto could take bf16 autocast on a CPU with bf16
    # instructions (or CUDA), by a timing a busy machine tips either way
    assert cfg.precision == "fp32"
    # flags override the recipe
    args = build_parser().parse_args(["train", "--config", "book-verdict", "--epochs", "2"])
    assert train_config_from_args(args).epochs == 2
    assert train_config_from_args(args).data == "the-verdict.txt"  # the recipe names its text


def test_a_recipes_own_text_that_is_not_here_is_one_line_not_the_plays(
    tmp_path, monkeypatch, capsys
):
    """``--config book-verdict`` without ``--data`` trains on the book's text, looked for where
    the command runs; absent, it is said in the recipe's words (never the bundled plays)."""
    monkeypatch.chdir(tmp_path)
    code, _, err = cli("train", "--config", "book-verdict", "--out", tmp_path / "r",
                       capsys=capsys)  # fmt: skip
    assert_one_line_error(code, err, "--config book-verdict trains on the-verdict.txt, which is")
    assert "book-verdict.yaml" in err and not (tmp_path / "r").exists()


def test_shakespeare_char_recipe_unties_the_head_takes_exact_gelu_and_flags_override():
    def model_config(*flags):
        cfg = train_config_from_args(build_parser().parse_args(["train", *flags]))
        return model_config_for(cfg, vocab_size=65)

    char = model_config("--config", "shakespeare-char")
    assert (char.n_layer, char.n_embd, char.context_length) == (4, 128, 64)
    assert char.tie_embeddings is False and char.gelu == "exact"
    model = GPT(char)
    assert model.lm_head.weight.data_ptr() != model.wte.weight.data_ptr()
    assert model_config("--config", "shakespeare-char", "--tie-embeddings").tie_embeddings
    assert model_config("--config", "shakespeare-char", "--gelu", "tanh").gelu == "tanh"
    baby = model_config("--model", "baby")  # the preset's own GPT-2 layout
    assert baby.tie_embeddings and baby.gelu == "tanh"
    assert not model_config("--model", "baby", "--no-tie-embeddings").tie_embeddings
    with pytest.raises(GptkilnError, match="tie_embeddings must be true or false, got 'no'"):
        TrainConfig(tie_embeddings="no")
    with pytest.raises(GptkilnError, match="gelu must be 'tanh' or 'exact', got 'erf'"):
        TrainConfig(gelu="erf")


def test_a_recipe_reads_yaml_numbers_and_names_itself_on_a_wrong_kind(tmp_path, capsys, play_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("model: tiny\nlr: 3e-4\nmin_lr: 0\nbatch_size: 2\n")  # YAML: "3e-4"
    cfg = train_config_from_args(build_parser().parse_args(["train", "--config", str(recipe)]))
    assert cfg.lr == 3e-4 and isinstance(cfg.lr, float) and cfg.min_lr == 0.0
    for line, needle in [
        ("lr: fast", "lr must be a number, got 'fast'"),
        ("batch_size: 2.5", "batch_size must be a whole number"),
        ("compile: 'no'", "compile must be true or false"),
        ("sample_prompt: 7", "sample_prompt must be text"),
        ("learning_rate: 1", "unknown key(s) learning_rate"),
    ]:
        recipe.write_text(f"model: tiny\n{line}\n")
        code, _, err = cli(
            "train", "--config", recipe, "--data", play_path, "--out", tmp_path / "r",
            capsys=capsys,
        )  # fmt: skip
        assert_one_line_error(code, err, "mine.yaml", needle)
    with pytest.raises(GptkilnError, match="qkv_bias must be true or false"):
        GPTConfig(qkv_bias="yes")  # e.g. a hand-edited config.json


def test_convert_and_prepare_never_write_over_a_run(run_dir, tmp_path, capsys, play_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    before = {p.name: sha(p) for p in run.iterdir() if p.is_file()}
    code, _, err = cli("convert", "book", tmp_path / "model.pth", "--out", run, capsys=capsys)
    assert_one_line_error(code, err, "already holds a model", "--overwrite")
    code, _, err = cli("prepare", play_path, "--out", run, capsys=capsys)
    assert_one_line_error(code, err, "holds a model", str(run / "data"))
    code, _, err = cli(  # a failed conversion, even with --overwrite, leaves the run whole
        "convert", "book", tmp_path / "model.pth", "--out", run, "--overwrite", capsys=capsys
    )
    assert_one_line_error(code, err, "model.pth")
    assert {p.name: sha(p) for p in run.iterdir() if p.is_file()} == before
    (tmp_path / "afile").write_text("x")
    for argv, needle in [
        (["prepare", play_path, "--out", tmp_path / "afile"], "is a file"),
        (["convert", "book", tmp_path / "model.pth", "--out", tmp_path / "afile"], "is a file"),
        (["prepare", play_path, "--out", tmp_path / "afile" / "sub"], "afile"),  # OSError
    ]:
        code, _, err = cli(*argv, capsys=capsys)
        assert_one_line_error(code, err, needle)


def test_streamed_text_ends_with_what_a_last_partial_character_leaves(tmp_path, monkeypatch):
    # GPT-2 token 12520 is " \xf0\x9f": a space and half an emoji. When generation stops there,
    # the stream held it back waiting for the rest; it must still come out at the end.
    import gptkiln.sampling
    from gptkiln.api import generate_text
    from gptkiln.checkpoint import save_model
    from gptkiln.tokenizers import load_tokenizer

    run, gpt2 = tmp_path / "run", load_tokenizer("gpt2")
    save_model(GPT(GPTConfig.from_name("tiny", vocab_size=50257, context_length=16)), run,
               tokenizer=gpt2)  # fmt: skip

    def fake_stream(*args, streams, chosen, **kwargs):  # these tokens, pushed as the real one does
        for t in chosen:
            streams[0].push(t)
            yield torch.tensor([t])

    for chosen in ([71, 12520, 236], [10545, 245], [71, 12520]):
        monkeypatch.setattr(
            gptkiln.sampling,
            "generate_stream",
            lambda *a, chosen=chosen, **k: fake_stream(*a, chosen=chosen, **k),
        )
        text = generate_text(run, "Hi", SampleConfig(max_new_tokens=len(chosen)))
        assert text == "Hi" + gpt2.decode(chosen), chosen


def test_convert_overwrite_replaces_the_run_and_drops_its_training_state(tmp_path, capsys):
    from gptkiln.checkpoint import PREVIOUS_STATE_FILE, TRAINER_STATE_FILE, save_model
    from gptkiln.tokenizers import load_tokenizer

    run = tmp_path / "run"
    model = GPT(GPTConfig.from_name("tiny", vocab_size=50257, context_length=16))
    save_model(model, run, tokenizer=load_tokenizer("gpt2"))
    old_run_files = [TRAINER_STATE_FILE, PREVIOUS_STATE_FILE, "metrics.csv", "loss.png"]
    for name in old_run_files:
        (run / name).write_bytes(b"a file of the run being replaced")
    export = tmp_path / "hf"
    code, _, err = cli("convert", "to-hf", run, "--out", export, capsys=capsys)
    assert code == 0, err
    code, _, err = cli("convert", "hf", export, "--out", run, capsys=capsys)
    assert_one_line_error(code, err, "already holds a model")
    assert (run / TRAINER_STATE_FILE).exists()
    code, _, err = cli("convert", "hf", export, "--out", run, "--overwrite", capsys=capsys)
    assert code == 0, err
    assert not any((run / name).exists() for name in old_run_files)
    code, _, err = cli("convert", "to-hf", run, "--out", export, capsys=capsys)  # again: refused
    assert_one_line_error(code, err, "already holds a model")


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--device", "bogus"], "bogus"),
        (["--temperature", "nan"], "temperature"),
        (["--temperature", "inf"], "temperature"),
        (["--seed", str(2**70)], "seed"),
    ],
)
def test_bad_generate_flags(flags, needle, run_dir, capsys):
    code, out, err = cli("generate", run_dir, "--prompt", "I had", *flags, capsys=capsys)
    assert_one_line_error(code, err, needle)
    assert out == ""  # nothing printed before the checks


def test_prepare_knows_the_names_of_a_models_files():
    from gptkiln import checkpoint, loading
    from gptkiln.data.prepare import _MODEL_FILES

    names = {loading.WEIGHTS_FILE, checkpoint.TRAINER_STATE_FILE, checkpoint.PREVIOUS_STATE_FILE}
    assert set(_MODEL_FILES) == names


def test_an_os_error_without_a_path_is_not_passed_off_as_bad_input(monkeypatch, capsys):
    import gptkiln.cli.prepare

    def broken(args):
        raise OSError("a shared library failed to load")

    monkeypatch.setattr(gptkiln.cli.prepare, "run", broken)
    with pytest.raises(OSError, match="shared library"):  # a real failure keeps its traceback
        main(["prepare", "x.txt", "--out", "y"])


def test_typed_settings_take_paths_and_numpy_numbers_but_not_nan():
    from pathlib import Path

    import numpy as np

    cfg = TrainConfig(out=Path("runs/x"), batch_size=np.int64(4), lr=np.float32(0.5))
    assert (cfg.out, cfg.batch_size, cfg.lr) == ("runs/x", 4, 0.5)
    assert type(cfg.batch_size) is int and type(cfg.lr) is float
    for bad, needle in [
        (dict(lr="nan"), "lr must be a number"),
        (dict(lr=" 1_0e-3 "), "lr must be a number"),
        (dict(grad_clip=float("nan")), "grad_clip must be a finite number"),
        (dict(weight_decay=float("inf")), "weight_decay must be a finite number"),
        (dict(batch_size=True), "batch_size must be a whole number"),
    ]:
        with pytest.raises(GptkilnError, match=needle):
            TrainConfig(**bad)


def test_a_run_whose_tokenizer_was_replaced_is_one_line(run_dir, tmp_path, capsys):
    import shutil

    from gptkiln.checkpoint import save_tokenizer
    from gptkiln.tokenizers import load_tokenizer

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    save_tokenizer(load_tokenizer("gpt2"), run)  # the char run now says gpt2
    code, out, err = cli("generate", run, "--prompt", "I had", capsys=capsys)
    assert_one_line_error(code, err, "do not belong to this model")
    assert out == ""  # the prompt is echoed only once the run loaded and took it
    (tmp_path / "text.txt").write_text("I had always thought Jack Gisburn rather a cheap genius")
    code, _, err = cli("perplexity", run, "--data", tmp_path / "text.txt", "--quiet", capsys=capsys)
    assert_one_line_error(code, err, "do not belong to this model")


def test_messages_name_what_is_really_wrong(run_dir, tmp_path, capsys, play_path):
    import shutil

    code, _, err = cli("generate", play_path, "--prompt", "I", capsys=capsys)
    assert_one_line_error(code, err, "is a file, not a run directory")
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    cfg = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**cfg, "format": "1"}))
    code, _, err = cli("generate", run, "--prompt", "I", capsys=capsys)
    assert_one_line_error(code, err, "format '1', not a format number")
    code, _, err = cli(  # the play's val split: 2,000 characters
        "train", "--data", play_path, "--model", "tiny", "--tokenizer", "char",
        "--context-length", "4000", "--out", tmp_path / "long", "--no-progress", capsys=capsys,
    )  # fmt: skip
    assert_one_line_error(code, err, "the val split has", "--val-fraction")


def test_a_prompt_of_undecodable_bytes_is_one_line(run_dir, capsys):
    bad = b"I \xff".decode("utf-8", "surrogateescape")  # what Python makes of such argv bytes
    code, _, err = cli("generate", run_dir, "--prompt", bad, capsys=capsys)
    assert_one_line_error(code, err, "--prompt", "UTF-8")


def test_a_real_process_prints_one_line_and_exits_2(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gptkiln",
            "prepare",
            str(tmp_path / "nope.txt"),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "nope.txt" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_help_and_flag_errors_come_before_torch_is_imported():
    # `gptkiln --help` and a bad flag answer at once (torch takes seconds to import), and a
    # Ctrl-C while torch loads is inside main(), which turns it into one line.
    code = (
        "import sys, gptkiln, gptkiln.cli\n"
        "from gptkiln import GPTConfig, TrainConfig\n"
        "try:\n"
        "    gptkiln.cli.main(['train', '--lr', '-1'])\n"
        "finally:\n"
        "    print(sorted(m for m in ('torch', 'tiktoken') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr
    assert "lr must be" in proc.stderr


def test_run_directory_config_records_model_train_and_tokenizer(run_dir):
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["model"]["n_layer"] == 2 and cfg["train"]["max_steps"] == 6
    assert cfg["tokenizer"] == "char"


def test_a_prepared_mixture_of_another_field_takes_that_text_field(tmp_path, capsys):
    """A mixture records each member's field in its own entry, not at the top: --text-field
    as prepared is no clash."""
    import json

    from gptkiln.data.prepare import prepare

    rows = "".join(
        json.dumps({"content": f"to be or not to be, line {i}"}) + "\n" for i in range(300)
    )
    (tmp_path / "a.jsonl").write_text(rows)
    (tmp_path / "b.jsonl").write_text(rows)
    mixed = tmp_path / "mixed"
    prepare(None, mixed, "char", mix=[f"{tmp_path / 'a.jsonl'}:1", f"{tmp_path / 'b.jsonl'}:1"],
            text_field="content", progress=False)  # fmt: skip
    short = ["--model", "tiny", "--context-length", "16", "--max-steps", "1", "--no-progress"]
    short += ["--sample-prompt", "to", "--out", tmp_path / "run"]
    code, _, err = cli("train", "--data", mixed, "--text-field", "content", *short, capsys=capsys)
    assert code == 0, err


def test_train_refuses_a_tokenizer_or_split_that_prepared_data_contradicts(
    play_path, tmp_path, capsys
):
    """Prepared data fixed its tokenizer, split and text field: a --tokenizer, --val-fraction or
    --text-field flag that disagrees would be silently ignored, so it is one line and exit 2
    (naming both when both disagree), and no run directory is made; a recipe's disagreeing
    setting is a note; settings that agree (or none) train."""
    from gptkiln.data.prepare import prepare

    char, bpe, big = tmp_path / "char", tmp_path / "bpe", tmp_path / "bpe-8000"
    prepare(play_path, char, "char", progress=False)
    prepare(play_path, bpe, "bpe:300", val_fraction=0.2, progress=False)
    meta = prepare(play_path, big, "bpe:8000", progress=False)
    assert meta["vocab_size"] < 8000  # a small corpus: fewer ids than asked for
    assert "note: bpe:8000 gave" in capsys.readouterr().err  # said, and out of the way
    run = tmp_path / "run"
    short = [
        "--model",
        "tiny",
        "--max-steps",
        "2",
        "--warmup-steps",
        "1",
        "--no-progress",
        "--out",
        run,
    ]
    refused = [
        (["--data", char, "--tokenizer", "gpt2"], ["--tokenizer gpt2:", "the char tokenizer"]),
        (["--data", char, "--val-fraction", "0.2"], ["val_fraction 0.1", "drop --val-fraction"]),
        (["--data", bpe, "--tokenizer", "bpe:400"], ["a BPE tokenizer of 300 ids"]),
        (["--data", char, "--text-field", "body"], ["the field 'text'", "drop --text-field"]),
        (
            ["--data", char, "--tokenizer", "bpe", "--val-fraction", "0.3"],
            [
                "the char tokenizer and split with val_fraction 0.1",
                "--tokenizer bpe --val-fraction 0.3",
            ],
        ),
    ]
    for flags, needles in refused:
        code, _, err = cli("train", *flags, *short, capsys=capsys)
        assert_one_line_error(code, err, *needles, "gptkiln prepare", str(play_path))
        assert not run.exists()
    agreeing = [
        ["--data", char],
        ["--data", char, "--tokenizer", "char", "--val-fraction", "0.1", "--text-field", "text"],
        ["--data", bpe, "--tokenizer", "bpe:300", "--val-fraction", "0.2"],
        ["--data", bpe, "--tokenizer", "bpe"],
        ["--data", big, "--tokenizer", "bpe:8000"],  # as prepared, though it holds fewer ids
        ["--data", big, "--tokenizer", f"bpe:{meta['vocab_size']}"],
    ]
    notes = [
        (["--data", char, "--config", "mini-shakespeare"], "sets tokenizer: gpt2"),
        (["--data", bpe, "--config", "book-verdict"], "sets val_fraction: 0.1"),
    ]
    for flags, note in [(f, None) for f in agreeing] + notes:
        code, out, err = cli("train", *flags, *short, "--overwrite", capsys=capsys)
        assert code in (0, None), err
        assert "done: 2 steps" in out
        if note:
            assert f"note: --config {flags[3]} {note}" in err, err
            assert "which training keeps" in err
        else:
            assert "note:" not in err, err


def test_an_empty_prompt_generates_from_end_of_text_or_is_one_line_without_it(tmp_path, capsys):
    from gptkiln.checkpoint import save_model
    from gptkiln.sampling import generate
    from gptkiln.tokenizers import CharTokenizer, load_tokenizer

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny", vocab_size=50257, context_length=16)).eval()
    save_model(model, tmp_path / "gpt2", tokenizer=load_tokenizer("gpt2"))
    args = ["generate", tmp_path / "gpt2", "--prompt", "", "--max-new-tokens", "6"]
    code, out, err = cli(*args, "--temperature", "0", capsys=capsys)
    gpt2 = load_tokenizer("gpt2")
    new = generate(model, [gpt2.eot_id], max_new_tokens=6, temperature=0, eot_id=gpt2.eot_id)
    assert code == 0, err
    assert out == gpt2.decode(new) + "\n" and new  # the end-of-text's continuation
    chars = CharTokenizer(["a", "b"], with_eot=False)
    save_model(GPT(GPTConfig.from_name("tiny", vocab_size=2)), tmp_path / "char", tokenizer=chars)
    code, _, err = cli("generate", tmp_path / "char", "--prompt", "", capsys=capsys)
    assert_one_line_error(code, err, "prompt is empty", "no end-of-text")


@pytest.mark.parametrize(
    "direction, flags, needle",
    [
        ("to-hf", ["--method", "int8"], "--method is for convert quantize, not convert to-hf"),
        ("to-hf", ["--type", "f32"], "--type is for convert to-gguf"),
        ("to-gguf", ["--float-head"], "--float-head is for convert quantize"),
        ("quantize", ["--max-shard-size", "50GB"], "--max-shard-size is for convert to-hf"),
        ("merge-lora", ["--n-head", "12"], "--n-head is for convert book"),
    ],
)
def test_a_convert_flag_of_another_direction_is_refused_even_at_its_default(
    direction, flags, needle, run_dir, tmp_path, capsys
):
    """A flag the direction does not read is one line, given at its default value too (it
    would have been ignored, and the user believes it did something)."""
    out = tmp_path / "o"
    code, _, err = cli("convert", direction, run_dir, "--out", out, *flags, capsys=capsys)
    assert_one_line_error(code, err, needle)
    assert not out.exists()


def test_epochs_alone_decide_the_run(tmp_path, capsys, play_path):
    """``--epochs N`` without ``--max-steps`` is a run of N epochs (the default max_steps
    would otherwise win and the flag do nothing)."""
    argv = ["train", "--data", play_path, "--out", tmp_path / "r", "--model", "tiny"]
    argv += ["--context-length", 32, "--batch-size", 64, "--epochs", 1, "--no-progress"]
    code, out, err = cli(*argv, capsys=capsys)
    assert code == 0, err
    saved = json.loads((tmp_path / "r" / "config.json").read_text())["train"]
    assert (saved["max_steps"], saved["epochs"]) == (0, 1)
    assert read_metrics(tmp_path / "r" / "metrics.csv")[-1]["step"] > 1


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 51539607552 bytes."
        ),
        MemoryError(),
    ],
)
def test_out_of_memory_is_one_line(error, tmp_path, capsys, play_path, monkeypatch):
    """A model too big for the machine (``--n-embd 65536``: 51 GB) is one line, not torch's
    48-line traceback; another RuntimeError keeps its traceback (a bug to see whole)."""
    import gptkiln.train

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(gptkiln.train, "train", fail)
    argv = ["train", "--data", play_path, "--out", tmp_path / "r", "--model", "tiny"]
    code, _, err = cli(*argv, capsys=capsys)
    assert_one_line_error(code, err, "out of memory", "ask for less where the command takes it")
    monkeypatch.setattr(
        gptkiln.train,
        "train",
        lambda *a, **k: (_ for _ in ()).throw(RuntimeError("shapes do not match")),
    )
    with pytest.raises(RuntimeError, match="shapes do not match"):
        cli(*argv, capsys=capsys)


def test_a_recipes_idle_min_lr_stays_where_its_default_would_not_fit(tmp_path, capsys, play_path):
    """A recipe of a constant low rate with min_lr 0 trains: its idle min_lr is left as it is
    (reset to the default 1e-4, it was past the recipe's lr of 5e-5 and refused)."""
    recipe = tmp_path / "low.yaml"
    recipe.write_text("lr: 0.00005\ndecay_lr: false\nmin_lr: 0.0\nmodel: tiny\n")
    argv = ["train", "--config", recipe, "--data", play_path, "--out", tmp_path / "r"]
    code, _, err = cli(*argv, "--max-steps", 2, "--context-length", 32, "--no-progress",
                       capsys=capsys)  # fmt: skip
    assert code == 0, err


def test_resume_alone_continues_with_the_runs_own_settings(play_path, tmp_path, capsys):
    """``--resume`` takes what the run recorded for every flag not given (its data, model, lr
    and schedule): an interrupted run goes on with only ``--out`` and ``--resume``, and ends
    where one trained straight through with the same flags does; a flag given still wins."""
    from safetensors.torch import load_file

    flags = ["--data", play_path, "--model", "tiny", "--tokenizer", "char", "--context-length",
             "32", "--lr", "0.02", "--schedule", "cosine", "--optimizer", "adamw",
             "--warmup-steps", "3", "--eval-interval", "2", "--sample-tokens", "0",
             "--batch-size", "3", "--no-progress"]  # fmt: skip
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    assert cli("train", *flags, "--max-steps", 6, "--out", straight, capsys=capsys)[0] == 0
    assert cli("train", *flags, "--max-steps", 4, "--out", cut, capsys=capsys)[0] == 0
    code, _, err = cli("train", "--out", cut, "--resume", "--max-steps", 6, capsys=capsys)
    assert code == 0, err
    a, b = load_file(straight / "model.safetensors"), load_file(cut / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [  # every column but the speed
        [line.split(",")[:-1] for line in (run / "metrics.csv").read_text().splitlines()]
        for run in (straight, cut)
    ]
    assert rows[0] == rows[1] and len(rows[0]) == 4
    code, _, err = cli(  # a flag given wins over the record: here refused, as it would be
        "train", "--out", cut, "--resume", "--max-steps", 8, "--optimizer", "muon",
        capsys=capsys,
    )  # fmt: skip
    assert_one_line_error(code, err, "--optimizer adamw")


def test_a_resume_unsets_a_recorded_setting_with_none_and_keeps_the_windows_stride(
    play_path, tmp_path, capsys
):
    """``--max-time none`` drops the time budget the run recorded (carried by a bare
    ``--resume``); another ``--stride`` over the windows an epoch walks is refused, as another
    ``--seed`` is (it would read some windows twice and skip others)."""
    out = tmp_path / "run"
    flags = ["--data", play_path, "--model", "tiny", "--tokenizer", "char", "--context-length",
             "32", "--batch-size", "3", "--eval-interval", "2", "--sample-tokens", "0",
             "--no-progress", "--out", out, "--sampling", "windows", "--stride", "16",
             "--max-time", "60", "--sample-prompt", "ROMEO"]  # fmt: skip
    assert cli("train", *flags, "--max-steps", 2, capsys=capsys)[0] == 0
    code, _, err = cli("train", "--out", out, "--resume", "--max-steps", 4, "--stride", 8,
                       capsys=capsys)  # fmt: skip
    assert_one_line_error(code, err, "--stride 16 and this resume asks for 8")
    code, _, err = cli("train", "--out", out, "--resume", "--max-steps", 4, "--max-time", "none",
                       "--sample-prompt", "None", capsys=capsys)  # fmt: skip
    assert code == 0, err
    recorded = json.loads((out / "config.json").read_text())["train"]
    assert recorded["max_time"] is None and recorded["sample_prompt"] is None
    assert recorded["stride"] == 16 and recorded["max_steps"] == 4
    config = json.loads((out / "config.json").read_text())
    config["train"]["lr"] = "fast"  # a hand's edit: the file is named, not the flag alone
    (out / "config.json").write_text(json.dumps(config))
    code, _, err = cli("train", "--out", out, "--resume", "--max-steps", 5, capsys=capsys)
    assert_one_line_error(code, err, f"{out / 'config.json'}: its record", "got 'fast'")


def test_the_harness_tasks_folder_is_recorded_as_found_from_where_the_run_started(
    tmp_path, monkeypatch
):
    """A resume from another directory still finds ``--eval-tasks-include-path tasks``."""
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--eval-tasks", "kiln_mc", "--eval-tasks-include-path", "tasks"]
    cfg = train_config_from_args(build_parser().parse_args(argv))
    assert cfg.eval_tasks_include_path == str(tmp_path.resolve() / "tasks")


def test_a_resumes_record_yields_to_none_and_to_a_recipe_only_where_it_should(
    tmp_path, monkeypatch
):
    """``--eval-tasks none`` unsets the recorded harness tasks with the settings that act only
    with them; a recipe named again on a resume keeps the run's own data (its ``data:`` is a
    file to find where a new run starts); a harness folder given again is found from here."""
    run = tmp_path / "run"
    run.mkdir()
    record = {"data": str(tmp_path / "prepared"), "eval_tasks": "kiln_mc",
              "eval_tasks_interval": 5, "eval_tasks_limit": 2.0,
              "eval_tasks_include_path": "/elsewhere/tasks"}  # fmt: skip
    (run / "config.json").write_text(json.dumps({"train": record}))

    def chosen(*flags):
        argv = ["train", "--out", str(run), "--resume", *flags]
        return train_config_from_args(build_parser().parse_args(argv))

    cfg = chosen("--eval-tasks", "none")
    assert (cfg.eval_tasks, cfg.eval_tasks_interval, cfg.eval_tasks_limit) == (None, None, None)
    assert cfg.eval_tasks_include_path is None and cfg.data == record["data"]
    assert chosen("--config", "book-verdict").data == record["data"]  # the-verdict.txt: not here
    (tmp_path / "other.txt").write_text("other text " * 50)
    (tmp_path / "recipe.yaml").write_text(f"data: {tmp_path / 'other.txt'}\n")
    assert chosen("--config", str(tmp_path / "recipe.yaml")).data == str(tmp_path / "other.txt")
    monkeypatch.chdir(tmp_path)
    cfg = chosen("--eval-tasks-include-path", "mine")
    assert cfg.eval_tasks_include_path == str(tmp_path.resolve() / "mine")
    assert chosen().eval_tasks_include_path == "/elsewhere/tasks"
    config = json.loads((run / "config.json").read_text())
    config["train"]["lr"] = -1.0  # a broken value the command replaces: not the file's fault
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(GptkilnError, match="batch_size") as e:
        chosen("--lr", "0.001", "--batch-size", "0")
    assert "config.json" not in str(e.value)


def test_resume_alone_reads_the_runs_own_tokens_from_any_directory(
    play_path, tmp_path, capsys, monkeypatch
):
    """The record's ``--data play.txt`` was typed relative to where the run started: a resume
    from elsewhere (beside another file of that name) trains on the tokens the run prepared."""
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir(), elsewhere.mkdir()
    shutil.copy(play_path, home / "play.txt")
    (elsewhere / "play.txt").write_text("Other words entirely, and not the play. " * 200)
    monkeypatch.chdir(home)
    flags = ["--data", "play.txt", "--model", "tiny", "--tokenizer", "char", "--context-length",
             "32", "--batch-size", "3", "--eval-interval", "2", "--sample-tokens", "0",
             "--no-progress", "--out", tmp_path / "run"]  # fmt: skip
    assert cli("train", *flags, "--max-steps", 2, capsys=capsys)[0] == 0
    tokens = (tmp_path / "run" / "data" / "train.bin").read_bytes()
    monkeypatch.chdir(elsewhere)
    code, _, err = cli("train", "--out", tmp_path / "run", "--resume", "--max-steps", 4,
                       capsys=capsys)  # fmt: skip
    assert code == 0, err
    assert (tmp_path / "run" / "data" / "train.bin").read_bytes() == tokens
    assert "prepared anew" not in err
