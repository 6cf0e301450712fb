"""`gptkiln convert to-gguf` / `convert gguf`: runs out to GGUF (run by llama.cpp with gptkiln's
greedy ids and tokenizer ids), GGUF files in (ours and those llama.cpp's own converter writes),
the Ollama Modelfile beside each, and bad files refused in one line.

llama.cpp (``llama-cpp-python``) and its ``convert_hf_to_gguf.py`` are optional peers: the tests
that need them skip with a message where they are missing. Every model is tiny and random.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_export_hf import MIXED, tiny_run

from gptkiln.cli import main
from gptkiln.errors import GptkilnError
from gptkiln.export.gguf import export_gguf
from gptkiln.export.gguf_import import import_gguf
from gptkiln.loading import load_run
from gptkiln.sampling import generate

PROMPT = "To be, or not"
CASES = [("qwen3", "bpe"), ("llama3", "gpt2"), ("gpt2", "char"), ("qwen3", "char")]
# llama.cpp's q8_0 (weights, and activations in its products): max |difference| / std of fp32's
Q8_TOLERANCE = 0.15


def llama_cpp_or_skip():
    return pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed (pip install llama-cpp-python)"
    )


def llama_logits(path: Path, ids: list[int], greedy: int = 0) -> tuple[np.ndarray, list[int]]:
    """llama.cpp's logits for ``ids`` (T, V) and ``greedy`` greedy ids after them."""
    llama_cpp = llama_cpp_or_skip()
    llm = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1)
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)])
    out = []
    for _ in range(greedy):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return logits, out


@pytest.mark.parametrize(("family", "kind"), CASES)
def test_llama_cpp_runs_the_export_with_gptkilns_ids(tmp_path, family, kind):
    llama_cpp = llama_cpp_or_skip()
    model, tokenizer, run = tiny_run(tmp_path, family, kind)
    out = export_gguf(run, tmp_path / "m.gguf")
    vocab_only = llama_cpp.Llama(str(out), vocab_only=True, verbose=False)
    assert vocab_only.tokenize(MIXED.encode(), add_bos=False, special=True) == tokenizer.encode(
        MIXED
    )
    prompt = tokenizer.encode(PROMPT)
    ours = generate(model, prompt, max_new_tokens=12, temperature=0, stop_at_eos=False)
    logits, theirs = llama_logits(out, prompt, greedy=12)
    assert theirs == ours
    with torch.no_grad():
        expected = model(torch.tensor([prompt]))[0].numpy()
    np.testing.assert_allclose(logits, expected, atol=1e-3, rtol=0)


@pytest.mark.parametrize("type", ["q8_0", "bf16", "f16"])
def test_llama_cpp_runs_the_smaller_types_within_a_tolerance(tmp_path, type):
    model, tokenizer, run = tiny_run(tmp_path, "qwen3", "bpe")
    out = export_gguf(run, tmp_path / f"m-{type}.gguf", type=type)
    prompt = tokenizer.encode(PROMPT)
    logits, _ = llama_logits(out, prompt)
    with torch.no_grad():
        expected = model(torch.tensor([prompt]))[0].numpy()
    assert np.abs(logits - expected).max() / expected.std() < Q8_TOLERANCE
    assert (logits.argmax(-1) == expected.argmax(-1)).mean() >= 0.8


@pytest.mark.parametrize(("family", "kind"), CASES[:3])
def test_a_gguf_comes_back_as_the_same_run(tmp_path, family, kind):
    model, tokenizer, run = tiny_run(tmp_path, family, kind)
    for type in ("f32", "q8_0"):
        out = export_gguf(run, tmp_path / f"m-{type}.gguf", type=type)
        import_gguf(out, tmp_path / f"back-{type}")
        back, back_tokenizer, _ = load_run(tmp_path / f"back-{type}")
        assert back_tokenizer.kind == ("char" if kind == "char" else "hf")
        assert back_tokenizer.encode(MIXED) == tokenizer.encode(MIXED)
        assert back_tokenizer.stop_ids == tokenizer.stop_ids
        idx = torch.tensor([tokenizer.encode(PROMPT)])
        with torch.no_grad():
            difference = (back(idx) - model(idx)).abs().max().item()
        assert difference == 0 if type == "f32" else difference < 0.05


def test_a_padded_vocabulary_goes_out_without_its_padding_rows_and_back(tmp_path):
    """``--pad-vocab``'s rows leave no unused tokens in the GGUF: its vocabulary is the
    tokenizer's, and the run it imports back is the same model, unpadded."""
    model, tokenizer, run = tiny_run(tmp_path, "qwen3", "bpe", padded=20)
    out = export_gguf(run, tmp_path / "m.gguf")
    import_gguf(out, tmp_path / "back")
    back, _, _ = load_run(tmp_path / "back")
    assert back.config.vocab_size == tokenizer.vocab_size
    assert back.config.padded_vocab_size is None
    idx = torch.tensor([tokenizer.encode(PROMPT)])
    with torch.no_grad():
        assert torch.equal(back(idx), model(idx))


def test_llama3_rope_scaling_goes_out_as_rope_freqs_and_back(tmp_path):
    from gptkiln.checkpoint import save_model
    from gptkiln.config import GPTConfig
    from gptkiln.model import GPT
    from gptkiln.tokenizers import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer(["to be or not to be\n" * 30], 280)
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
    config = GPTConfig.from_name(
        "llama3-baby",
        vocab_size=tokenizer.vocab_size,
        n_embd=256,
        rope_theta=500000.0,
        rope_scaling={**scaling, "original_context_length": 8192},
    )
    save_model(GPT(config), tmp_path / "run", tokenizer=tokenizer)
    import_gguf(export_gguf(tmp_path / "run", tmp_path / "m.gguf"), tmp_path / "back")
    back, _, _ = load_run(tmp_path / "back")
    torch.testing.assert_close(back.rope_cos, GPT(config).rope_cos, rtol=0, atol=1e-6)


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_llama3_rope_scalings_are_read_back_from_their_rope_freqs(head_dim, theta):
    """Whatever frequencies fall in the blend: none, one (head_dim 16 or 32 at theta 500000),
    or several; over a grid of factors, bounds and original contexts."""
    import itertools

    from gptkiln.config import GPTConfig
    from gptkiln.export.gguf import rope_factors
    from gptkiln.export.gguf_import import _rope_scaling

    grid = itertools.product(
        (4.0, 8.0, 29.429, 32.0), (1.0, 2.0), (1.5, 2.0, 4.0), (64, 512, 8192, 32768, 100000)
    )
    for factor, low, high, original in grid:
        if high <= low:
            continue
        ours = dict(factor=factor, low_freq_factor=low, high_freq_factor=high)
        config = GPTConfig.from_name(
            "llama3-baby",
            head_dim=head_dim,
            rope_theta=theta,
            rope_scaling={**ours, "original_context_length": original},
        )
        factors = rope_factors(config)
        got = _rope_scaling(factors, theta, head_dim, Path("m.gguf"))  # checks itself, or raises
        if got is not None:
            back = {k: got[k] for k in ("factor", "low_freq_factor", "high_freq_factor")}
            back["original_context_length"] = got["original_max_position_embeddings"]
            again = dataclasses.replace(config, rope_scaling=back)
            torch.testing.assert_close(rope_factors(again), factors, rtol=1e-4, atol=1e-5)


def test_rope_scalings_of_any_bounds_are_read_back_and_llama_31s_as_written():
    """Bounds off any grid (a low factor other than 1, a context not a power of two) come back
    as bounds that give the same frequencies; Llama 3.1's come back as its own numbers."""
    import random

    from gptkiln.config import GPTConfig
    from gptkiln.export.gguf import rope_factors
    from gptkiln.export.gguf_import import _rope_scaling

    def config(head_dim, theta, factor, low, high, original):
        ours = dict(factor=factor, low_freq_factor=low, high_freq_factor=high)
        ours["original_context_length"] = original
        return GPTConfig.from_name("llama3-baby", head_dim=head_dim, rope_theta=theta,
                                   rope_scaling=ours)  # fmt: skip

    llama31 = rope_factors(config(128, 500000.0, 8.0, 1.0, 4.0, 8192))
    got = _rope_scaling(llama31, 500000.0, 128, Path("m.gguf"))
    assert (got["factor"], got["low_freq_factor"], got["high_freq_factor"]) == (8.0, 1.0, 4.0)
    assert got["original_max_position_embeddings"] == 8192
    rng = random.Random(0)
    for _ in range(300):
        head_dim, theta = rng.choice([16, 32, 64, 128]), rng.uniform(1e3, 1e6)
        low = rng.uniform(0.5, 4)
        made = config(head_dim, theta, rng.uniform(1.5, 40), low, low + rng.uniform(0.1, 8),
                      rng.randint(64, 65536))  # fmt: skip
        factors = rope_factors(made).float()  # as the file stores them
        got = _rope_scaling(factors, theta, head_dim, Path("m.gguf"))  # checks itself, or raises
        if got is not None:
            bounds = [got[k] for k in ("factor", "low_freq_factor", "high_freq_factor")]
            back = config(head_dim, theta, *bounds, got["original_max_position_embeddings"])
            torch.testing.assert_close(
                rope_factors(back).double(), factors.double(), rtol=1e-4, atol=1e-5
            )


def converter() -> Path:
    """llama.cpp's convert_hf_to_gguf.py (its source tree's, or llama-cpp-python's sdist's, with
    gguf-py beside it): $LLAMA_CPP_CONVERT, else skip."""
    path = Path(os.environ.get("LLAMA_CPP_CONVERT", "convert_hf_to_gguf.py"))
    if not path.is_file():
        pytest.skip("llama.cpp's convert_hf_to_gguf.py not found: set LLAMA_CPP_CONVERT to it")
    return path


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "outtype"), [("qwen3", "f32"), ("llama3", "f32"), ("gpt2", "f32"), ("qwen3", "q8_0")]
)
def test_a_gguf_made_by_llama_cpps_converter_imports(tmp_path, family, outtype):
    """A Hugging Face directory → llama.cpp's converter → GGUF → gptkiln: transformers' greedy
    ids on the original (q8_0: logits within the tolerance), and its tokenizer's ids."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter imports sentencepiece")
    from gptkiln.convert import export_hf

    _, tokenizer, run = tiny_run(tmp_path, family, "gpt2")  # a tokenizer llama.cpp recognizes
    hf_dir = export_hf(run, tmp_path / "hf")
    out = tmp_path / "llama.gguf"
    done = subprocess.run(
        [
            sys.executable,
            str(converter()),
            str(hf_dir),
            "--outfile",
            str(out),
            "--outtype",
            outtype,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(converter().parent / "gguf-py")},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    import_gguf(out, tmp_path / "run-back")
    back, back_tokenizer, _ = load_run(tmp_path / "run-back")
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert back_tokenizer.encode(MIXED) == hf_tok(MIXED)["input_ids"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    prompt = tokenizer.encode(PROMPT)
    with torch.no_grad():
        theirs = hf.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None
        )[0, len(prompt) :].tolist()
        expected, got = hf(torch.tensor([prompt])).logits, back(torch.tensor([prompt]))
    if outtype == "f32":
        assert generate(back, prompt, max_new_tokens=12, temperature=0, stop_at_eos=False) == theirs
    assert (got - expected).abs().max() / expected.std() < (
        1e-5 if outtype == "f32" else Q8_TOLERANCE
    )


def test_the_modelfile_beside_the_gguf(tmp_path):
    from gptkiln.finetune.templates import ALPACA

    _, _, run = tiny_run(
        tmp_path, "qwen3", "bpe", finetune={"task": "instruct", "template": ALPACA.to_dict()}
    )
    export_gguf(run, tmp_path / "mine.gguf")
    text = (tmp_path / "mine.Modelfile").read_text()
    lines = text.splitlines()
    assert "FROM ./mine.gguf" in lines
    assert 'PARAMETER stop "<|endoftext|>"' in lines
    assert 'PARAMETER stop "### Instruction:"' in lines
    template = text.split('TEMPLATE """', 1)[1].split('"""', 1)[0]
    assert template.count("{{") == template.count("}}")
    assert '{{ "\\n\\n### Response:\\n" }}' in template and "{{ .Content }}" in template
    _, _, base = tiny_run(tmp_path, "llama3", "gpt2")
    export_gguf(base, tmp_path / "base.gguf")
    assert 'TEMPLATE """{{ .Prompt }}"""' in (tmp_path / "base.Modelfile").read_text()
    assert "PARAMETER temperature" not in text  # no generation_config.json: Ollama's defaults


def test_the_modelfile_samples_as_the_runs_generation_config_asks(tmp_path):
    """Qwen3's generation_config.json (temperature 0.6, top-k 20, top-p 0.95) becomes Ollama's
    parameters, as `gptkiln generate` and serve take it; do_sample false is temperature 0 (a
    repetition penalty kept: Ollama's repeat_penalty)."""
    _, _, run = tiny_run(tmp_path, "qwen3", "bpe")
    config = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0}
    (run / "generation_config.json").write_text(json.dumps(config))
    export_gguf(run, tmp_path / "q.gguf")
    lines = (tmp_path / "q.Modelfile").read_text().splitlines()
    params = [line for line in lines if line.startswith("PARAMETER ") and "stop" not in line]
    assert params == [
        "PARAMETER temperature 0.6", "PARAMETER top_k 20", "PARAMETER top_p 0.95",
    ]  # fmt: skip
    greedy = {"do_sample": False, "temperature": 0.7, "repetition_penalty": 1.1}
    (run / "generation_config.json").write_text(json.dumps(greedy))
    export_gguf(run, tmp_path / "g.gguf")
    lines = (tmp_path / "g.Modelfile").read_text().splitlines()
    assert [line for line in lines if line.startswith(("PARAMETER temp", "PARAMETER repeat"))] == [
        "PARAMETER temperature 0.0",
        "PARAMETER repeat_penalty 1.1",
    ]


def modelfile_stops(text: str) -> list[str]:
    """The stops Ollama's parser reads from a Modelfile: a value between ``"`` or ``\"\"\"``
    taken as it is, no escapes, newlines inside kept."""
    stops = []
    for chunk in text.split("\nPARAMETER stop ")[1:]:
        quote = '"""' if chunk.startswith('"""') else '"'
        stops.append((chunk + "\n")[len(quote) :].split(quote + "\n", 1)[0])
    return stops


def test_the_modelfile_holds_stops_as_ollama_reads_them_and_a_chat_runs_turn_end(tmp_path):
    """Stops with newlines, quotes or text beyond ASCII go into the Modelfile as they are
    (Ollama's parser reads no escapes); a chat fine-tune's ChatML ends each turn with the token
    it was trained to end them with."""
    from gptkiln.finetune.chat import save_chat_template
    from gptkiln.finetune.templates import PromptTemplate, chatml_template

    zh = PromptTemplate(
        system='以下是"指令"。',
        instruction="### 指令：\n{instruction}",
        input="\n\n### 输入：\n{input}",
        response="\n\n### 回答：\n",
    )
    extra = {"finetune": {"task": "instruct", "template": zh.to_dict()}}
    _, _, run = tiny_run(tmp_path, "qwen3", "bpe", **extra)
    export_gguf(run, tmp_path / "zh.gguf")
    text = (tmp_path / "zh.Modelfile").read_text(encoding="utf-8")
    assert set(zh.stop_strings()) <= set(modelfile_stops(text))
    assert "\\u" not in text and '{{ "以下是\\"指令\\"。" }}' in text  # Go reads the quotes

    _, tokenizer, chat = tiny_run(tmp_path / "c", "qwen3", "bpe")
    eot = tokenizer.decode([tokenizer.eot_id])
    save_chat_template(chat, chatml_template(eot))
    export_gguf(chat, tmp_path / "chat.gguf")
    text = (tmp_path / "chat.Modelfile").read_text(encoding="utf-8")
    template = text.split('TEMPLATE """', 1)[1].split('"""\n', 1)[0]
    assert f'{{{{ .Content }}}}{{{{ "{eot}" }}}}\n' in template and "<|im_end|>" not in template
    assert eot in modelfile_stops(text)


def test_an_output_that_is_a_directory_a_modelfiles_name_or_a_modelfile_there_is_refused(
    tmp_path, capsys
):
    _, _, run = tiny_run(tmp_path, "qwen3", "bpe")
    (tmp_path / "adir").mkdir()
    mine = tmp_path / "mine.Modelfile"
    mine.write_text("FROM ./mine.gguf\nSYSTEM hand-written\n")
    for out, said in (
        ("adir", "is a directory"),
        ("x.Modelfile", "would be written over it"),
        ("mine.gguf", "mine.Modelfile already exists"),
    ):
        code = main(["convert", "to-gguf", str(run), "--out", str(tmp_path / out)])
        err = capsys.readouterr().err
        assert code == 2 and said in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "mine.gguf").exists() and not (tmp_path / "x.Modelfile").exists()
    assert "hand-written" in mine.read_text()
    code = main(["convert", "to-gguf", str(run), "--out", str(tmp_path / "mine.gguf"),
                 "--overwrite"])  # fmt: skip
    assert code == 0 and "hand-written" not in mine.read_text()


def test_bad_files_are_refused_in_one_line_and_nothing_is_written(tmp_path, capsys):
    import gguf

    _, _, run = tiny_run(tmp_path, "qwen3", "bpe")
    good = export_gguf(run, tmp_path / "good.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    assert main(["convert", "gguf", str(cut), "--out", str(tmp_path / "r1")]) == 2
    err = capsys.readouterr().err.strip()
    assert "cut.gguf: not a readable GGUF file" in err and len(err.splitlines()) == 1
    other = tmp_path / "weights.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(64))  # a zip, named .gguf
    assert main(["convert", "gguf", str(other), "--out", str(tmp_path / "r1")]) == 2
    err = capsys.readouterr().err.strip()
    assert "weights.gguf: not a GGUF file (it begins with b'PK\\x03\\x04'" in err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "r1").exists()

    other = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(other), "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GptkilnError, match="falcon.gguf: a GGUF of the 'falcon' architecture"):
        import_gguf(other, tmp_path / "r2")

    q4 = tmp_path / "q4.gguf"
    writer = gguf.GGUFWriter(str(q4), "qwen3")
    data = gguf.quants.quantize(np.zeros((4, 32), np.float32), gguf.GGMLQuantizationType.Q4_0)
    writer.add_tensor("token_embd.weight", data, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GptkilnError, match="token_embd.weight is of type Q4_0"):
        import_gguf(q4, tmp_path / "r3")
    assert not (tmp_path / "r2").exists() and not (tmp_path / "r3").exists()

    assert main(["convert", "to-gguf", str(run), "--out", str(good)]) == 2  # no --overwrite
    assert "already exists" in capsys.readouterr().err
    from gptkiln.checkpoint import save_model
    from gptkiln.config import GPTConfig
    from gptkiln.model import GPT
    from gptkiln.tokenizers import build_char_tokenizer

    one_line = build_char_tokenizer(["to be or not to be"], with_eot=True)
    config = GPTConfig.from_name("qwen3-baby", vocab_size=one_line.vocab_size, n_layer=1)
    nolines = tmp_path / "one-line"
    save_model(GPT(config), nolines, tokenizer=one_line)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["convert", "to-gguf", str(nolines), "--out", str(tmp_path / "x.gguf")]) == 2
    assert "has no newline" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_llama_gguf_whose_head_count_is_missing_or_wrong_is_one_line(tmp_path, capsys):
    """A Llama GGUF's q and k rows are unpermuted by its head counts: a count that does not
    split them, or none, is a one-line error, not a traceback."""
    import shutil

    import gguf

    _, _, run = tiny_run(tmp_path, "llama3", "gpt2")
    good = export_gguf(run, tmp_path / "good.gguf")
    for case, value in (("three", 3), ("zero", 0), ("missing", None)):
        bad = tmp_path / f"{case}.gguf"
        shutil.copy(good, bad)
        reader = gguf.GGUFReader(bad, "r+")
        field = reader.fields["llama.attention.head_count"]
        if value is None:  # the key's name made another of the same length: no head_count
            field.parts[1][-1] = ord("X")
        else:
            field.parts[field.data[0]][0] = value
        reader.data.flush()
        del reader
        code = main(["convert", "gguf", str(bad), "--out", str(tmp_path / f"r-{case}")])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, err
        assert "llama.attention.head_count" in err and "Traceback" not in err
        assert not (tmp_path / f"r-{case}").exists()


def test_an_exact_gelu_run_is_exported_with_a_note_that_llama_cpp_computes_tanh(tmp_path):
    from gptkiln.checkpoint import save_model
    from gptkiln.config import GPTConfig
    from gptkiln.model import GPT
    from gptkiln.tokenizers import build_char_tokenizer

    chars = build_char_tokenizer(["to be or not to be\nthat is"], with_eot=True)
    config = GPTConfig.from_name("tiny", vocab_size=chars.vocab_size, n_layer=1, gelu="exact")
    save_model(GPT(config), tmp_path / "run", tokenizer=chars)
    notes = []
    export_gguf(tmp_path / "run", tmp_path / "m.gguf", on_note=notes.append)
    assert len(notes) == 1 and "exact (erf) GELU" in notes[0] and "tanh" in notes[0]
    save_model(GPT(dataclasses.replace(config, gelu="tanh")), tmp_path / "tanh", tokenizer=chars)
    export_gguf(tmp_path / "tanh", tmp_path / "t.gguf", on_note=notes.append)
    assert len(notes) == 1  # GPT-2's own GELU: nothing to say


def test_a_tokenizer_without_an_end_of_text_is_refused_before_llama_cpp_stops_on_a_char(
    tmp_path,
):
    """A char run of one text has no end-of-text: llama.cpp would take id 11 for it and end
    every answer at that character."""
    from gptkiln.checkpoint import save_model
    from gptkiln.config import GPTConfig
    from gptkiln.model import GPT
    from gptkiln.tokenizers import build_char_tokenizer

    chars = build_char_tokenizer(["I had always thought;\nJack Gisburn"], with_eot=False)
    assert not chars.stop_ids and chars.vocab_size > 11
    config = GPTConfig.from_name("qwen3-baby", vocab_size=chars.vocab_size, n_layer=1)
    save_model(GPT(config), tmp_path / "run", tokenizer=chars)
    eleven = re.escape(repr(chars.decode([11])))
    with pytest.raises(GptkilnError, match=f"no end-of-text token.*id 11, {eleven}.*to-hf"):
        export_gguf(tmp_path / "run", tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


def _rewritten(good: Path, bad: Path, tensors=None, **edits) -> Path:
    """``good`` written again as ``bad`` with the metadata ``edits`` (a key's dots as ``__``);
    ``tensors(name, array)``: each f32 tensor's new array, None to leave it out."""
    import gguf

    edits = {k.replace("__", "."): v for k, v in edits.items()}
    reader = gguf.GGUFReader(good)
    writer = gguf.GGUFWriter(str(bad), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        if field.name in edits and edits[field.name] is None:  # None: the key left out
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = edits.get(field.name, field.contents())
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    for key in edits.keys() - reader.fields.keys():  # a key the file did not have: a text
        if edits[key] is not None:
            writer.add_key_value(key, edits[key], gguf.GGUFValueType.STRING)
    for t in reader.tensors:
        data = np.array(t.data) if tensors is None else tensors(t.name, np.array(t.data))
        if data is not None:
            writer.add_tensor(t.name, np.ascontiguousarray(data), raw_dtype=t.tensor_type)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    return bad


@pytest.mark.parametrize("family", ["gpt2", "llama3"])
def test_a_tensor_the_gguf_lacks_or_holds_at_another_shape_is_named_as_the_file_names_it(
    tmp_path, family
):
    """Not by gptkiln's names (h.1.mlp.down_proj.weight), which its reader never sees; a shape
    as the file holds it (GPT-2's Conv1D weights (out, in))."""
    _, _, run = tiny_run(tmp_path, family, "bpe")
    good = export_gguf(run, tmp_path / "good.gguf")
    down = "blk.1.ffn_down.weight"
    cut = _rewritten(good, tmp_path / "cut.gguf", lambda name, a: None if name == down else a)
    with pytest.raises(GptkilnError, match=rf"cut.gguf: the file lacks tensor {down}, which"):
        import_gguf(cut, tmp_path / "r1")
    up = "blk.0.ffn_up.weight"
    narrow = _rewritten(
        good, tmp_path / "narrow.gguf", lambda name, a: a[:, :32] if name == up else a
    )
    with pytest.raises(GptkilnError, match=rf"tensor {up} is \((\d+), 32\), not \(\1, 64\)"):
        import_gguf(narrow, tmp_path / "r2")
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()


@pytest.mark.parametrize(
    "edits, said",
    [
        ({"qwen3__attention__head_count": 0}, "qwen3.attention.head_count is 0"),
        ({"qwen3__context_length": 0}, "qwen3.context_length is 0"),
        ({"tokenizer__ggml__eos_token_id": 999999}, "eos_token_id is 999999, not an id"),
        ({"tokenizer__ggml__bos_token_id": 999999}, "bos_token_id is 999999, not an id"),
        ({"tokenizer__ggml__token_type": [1, 1]}, "and 2 token types for the"),
        ({"tokenizer__ggml__tokens": ["a", "b"]}, "has 2 tokens"),
        ({"tokenizer__chat_template": "{% if %}"}, "tokenizer.chat_template"),
        ({"qwen3__rope__scaling__type": "yarn"}, "qwen3.rope.scaling.type is 'yarn'"),
        ({"qwen3__rope__dimension_count": 2}, "qwen3.rope.dimension_count is 2 of"),
        ({"qwen3__rope__scaling__factor": "4"}, "qwen3.rope.scaling.factor is '4'"),
    ],
    ids=[
        "no heads",
        "no context",
        "eos past the end",
        "bos past the end",
        "types",
        "tokens",
        "template",
        "yarn",
        "partial rotary",
        "a factor alone",
    ],  # fmt: skip
)
def test_a_gguf_of_damaged_metadata_is_one_line(tmp_path, capsys, edits, said):
    _, _, run = tiny_run(tmp_path, "qwen3", "gpt2")
    bad = _rewritten(export_gguf(run, tmp_path / "good.gguf"), tmp_path / "bad.gguf", **edits)
    code = main(["convert", "gguf", str(bad), "--out", str(tmp_path / "back")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and said in err, err
    assert not (tmp_path / "back").exists()


def test_a_flag_of_another_direction_or_an_out_that_is_the_input_is_refused(tmp_path, capsys):
    """``convert to-hf --type bf16`` would write float32 without a word: refused, as is
    converting a run onto itself (``--out`` the run: its trainer state would be lost)."""
    _, _, run = tiny_run(tmp_path, "qwen3", "bpe")
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    before = sorted(p.name for p in run.iterdir())
    for argv, said in (
        (["to-hf", str(run), "--out", str(tmp_path / "hf"), "--type", "bf16"], "--type is for"),
        (["to-gguf", str(run), "--out", str(tmp_path / "m.gguf"), "--float-head"], "--float-head"),
        (["to-hf", str(run), "--out", str(run), "--overwrite"], "is what convert to-hf reads"),
        (["gguf", str(tmp_path), "--out", str(tmp_path / "r")], "is a directory; give the path"),
        (["hf", str(tmp_path / "x.gguf"), "--out", str(tmp_path / "r")], "convert gguf` makes"),
        (["to-hf", str(run), "--out", str(tmp_path / "x.gguf" / "hf")], "x.gguf is a file, not"),
    ):
        assert main(["convert", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert said in err and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in run.iterdir()) == before
    assert not (tmp_path / "hf").exists() and not (tmp_path / "m.gguf").exists()


def test_the_runs_token_ids_go_out_to_gguf_and_come_back(tmp_path):
    """config.json's bos/eos/pad ids (a Hugging Face model's, which `convert to-hf` writes back)
    leave in the GGUF's tokenizer keys and return in the imported run's config.json."""
    import json

    import gguf

    _, tokenizer, run = tiny_run(tmp_path, "qwen3", "bpe", pad_token_id=3)
    out = export_gguf(run, tmp_path / "m.gguf")
    assert gguf.GGUFReader(out).fields["tokenizer.ggml.padding_token_id"].contents() == 3
    import_gguf(out, tmp_path / "back")
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["pad_token_id"] == 3 and back["eos_token_id"] == tokenizer.eot_id


def test_a_llama3_gguf_that_does_not_say_whether_to_add_bos_adds_it_as_llama_cpp_does(tmp_path):
    """llama.cpp adds BOS for Llama 3's pre-tokenizer where ``add_bos_token`` is not written
    (older converters wrote none); the imported run does too, and keeps a file's ``false``."""
    _, tokenizer, run = tiny_run(tmp_path, "llama3", "gpt2")
    good = export_gguf(run, tmp_path / "m.gguf")
    bos = tokenizer.eot_id
    for add_bos, first in ((None, [bos]), (False, [])):
        edits = {"tokenizer__ggml__pre": "llama-bpe", "tokenizer__ggml__bos_token_id": bos,
                 "tokenizer__ggml__add_bos_token": add_bos}  # fmt: skip
        bad = _rewritten(good, tmp_path / f"{add_bos}.gguf", **edits)
        import_gguf(bad, tmp_path / f"back-{add_bos}")
        _, back, _ = load_run(tmp_path / f"back-{add_bos}")
        ids = back.encode("Hello there")
        assert (
            ids[: len(first)] == first and ids[len(first) :] != [] and bos not in ids[len(first) :]
        )


def test_an_instruction_tuned_run_with_a_bos_comes_back_from_gguf_prompting_as_it_was(tmp_path):
    """The GGUF's chat template of an Alpaca run on a Llama 3 tokenizer renders the BOS the run
    was trained with (llama.cpp drops it where its tokenizer adds one), so the run read back
    prompts with the ids the run did."""
    from hf_tokenizer_dirs import write_llama3_dir

    from gptkiln.checkpoint import save_model
    from gptkiln.config import GPTConfig
    from gptkiln.finetune.runs import run_template
    from gptkiln.finetune.templates import ALPACA, format_messages
    from gptkiln.model import GPT
    from gptkiln.tokenizers import encode_prompt, load_tokenizer

    tokenizer = load_tokenizer(write_llama3_dir(tmp_path / "tokenizer"))
    config = GPTConfig.from_name("llama3-baby", vocab_size=tokenizer.vocab_size, n_layer=1)
    run = tmp_path / "run"
    extra = {"finetune": {"task": "instruct", "template": ALPACA.to_dict()}}
    save_model(GPT(config), run, tokenizer=tokenizer, extra=extra)
    import_gguf(export_gguf(run, tmp_path / "m.gguf"), tmp_path / "back")
    _, back, cfg = load_run(tmp_path / "back")
    messages = [{"role": "user", "content": "Name a colour."}]
    template = run_template(cfg, tmp_path / "back")
    theirs = encode_prompt(back, format_messages(template, messages), templated=True)
    assert theirs == encode_prompt(tokenizer, format_messages(ALPACA, messages))


def test_an_out_that_holds_a_model_is_refused_before_the_gguf_is_dequantized(tmp_path, monkeypatch):
    """`convert gguf` into a run without --overwrite says so at once: dequantizing a large
    GGUF to float32 first would take minutes and its memory for a refusal."""
    from gptkiln.export import gguf_import

    _, _, run = tiny_run(tmp_path, "qwen3", "bpe")
    out = export_gguf(run, tmp_path / "m.gguf")

    def never(*args, **kwargs):
        raise AssertionError("the tensors were read before --out was checked")

    monkeypatch.setattr(gguf_import, "_hf_state_dict", never)
    with pytest.raises(GptkilnError, match="already holds a model"):
        import_gguf(out, run)


def test_to_gguf_never_writes_over_a_file_of_a_run_even_with_overwrite(tmp_path, capsys):
    _, _, run = tiny_run(tmp_path, "qwen3", "bpe")
    weights = (run / "model.safetensors").read_bytes()
    for name in ("model.safetensors", "tokenizer.json"):
        argv = ["convert", "to-gguf", str(run), "--out", str(run / name), "--overwrite"]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "a file of the run in" in err and len(err.splitlines()) == 1, err
    assert (run / "model.safetensors").read_bytes() == weights


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_the_stop_ids_fill_llama_cpps_slots_and_come_back_as_llama_cpp_reads_them(tmp_path, family):
    """A Llama 3 Instruct tokenizer stops at <|eot_id|>, <|end_of_text|> and <|eom_id|>, Qwen3's
    at <|im_end|> and <|endoftext|>: the GGUF's eos is the tokenizer's, its eot the end of turn
    and its eom <|eom_id|> (not whichever stop id came second), and a file read back stops where
    llama.cpp stops, at the named ids and at the tokens it ends at by their text, also when
    the file names its eos alone, as llama.cpp's own converter writes it."""
    import gguf
    from hf_tokenizer_dirs import write_llama3_dir, write_qwen3_dir

    from gptkiln.checkpoint import save_model
    from gptkiln.config import GPTConfig
    from gptkiln.model import GPT
    from gptkiln.tokenizers import load_tokenizer

    write = write_llama3_dir if family == "llama3" else write_qwen3_dir
    tokenizer = load_tokenizer(write(tmp_path / "tokenizer"))
    config = GPTConfig.from_name(
        f"{family}-baby", vocab_size=tokenizer.vocab_size, context_length=32, n_layer=1
    )
    run = tmp_path / "run"
    save_model(GPT(config), run, tokenizer=tokenizer)
    good = export_gguf(run, tmp_path / "m.gguf")
    fields = gguf.GGUFReader(good).fields
    slot = {
        name: fields[f"tokenizer.ggml.{name}_token_id"].contents()
        for name in ("eos", "eot", "eom")
        if f"tokenizer.ggml.{name}_token_id" in fields
    }
    text = {name: tokenizer.decode([i]) for name, i in slot.items()}
    if family == "llama3":
        assert text == {"eos": "<|eot_id|>", "eot": "<|eot_id|>", "eom": "<|eom_id|>"}
    else:
        assert text == {"eos": "<|im_end|>", "eot": "<|im_end|>"}
    eos_alone = _rewritten(
        good, tmp_path / "eos.gguf", tokenizer__ggml__eot_token_id=None,
        tokenizer__ggml__eom_token_id=None,
    )  # fmt: skip
    for i, path in enumerate((good, eos_alone)):
        import_gguf(path, tmp_path / f"back-{i}")
        _, back, _ = load_run(tmp_path / f"back-{i}")
        assert back.stop_ids[0] == tokenizer.stop_ids[0] == slot["eos"]
        assert set(back.stop_ids) == set(tokenizer.stop_ids), path
