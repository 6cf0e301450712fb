"""`gptkiln convert to-hf` for every run: any family with any tokenizer (gpt2, bpe:N, char),
fine-tuned (its template as jinja) and quantized (dequantized) runs, loaded by ``transformers``'
Auto classes alone, with gptkiln's greedy ids and tokenizer ids.

Every model is tiny and random; nothing is downloaded.
"""

from __future__ import annotations

import json

import pytest
import torch

from gptkiln.checkpoint import save_model
from gptkiln.config import GPTConfig
from gptkiln.convert import export_hf, quantize_run
from gptkiln.errors import GptkilnError
from gptkiln.interop import gptkiln_state_dict_to_hf
from gptkiln.loading import load_model
from gptkiln.model import GPT
from gptkiln.sampling import generate
from gptkiln.tokenizers import (
    GPT2Tokenizer,
    build_char_tokenizer,
    load_tokenizer,
    train_bpe_tokenizer,
)

transformers = pytest.importorskip("transformers")

CORPUS = (
    "To be, or not to be, that is the question:\n"
    "Whether 'tis nobler in the mind to suffer\n"
    "The slings and arrows of outrageous fortune, 1234 ... don't stop!\n"
)
MIXED = "The question, 42 times: don't  stop!\n\n  whether\tor not <|endoftext|> To be, café 日本."


def tokenizer_of(kind: str):
    if kind == "gpt2":
        return GPT2Tokenizer()
    if kind == "char":
        return build_char_tokenizer([CORPUS, MIXED.replace("<|endoftext|>", "")], with_eot=True)
    return train_bpe_tokenizer([CORPUS * 4], 300)


def tiny_run(tmp_path, family: str, kind: str, seed: int = 0, padded: int = 0, **extra):
    """A random run of ``family`` with a ``kind`` tokenizer, saved; (model, tokenizer, dir).
    ``padded``: that many rows past the vocabulary in its embedding and head (``--pad-vocab``),
    their weights large, so that a padding row read anywhere would show."""
    tokenizer = tokenizer_of(kind)
    preset = "tiny" if family == "gpt2" else f"{family}-baby"
    config = GPTConfig.from_name(
        preset,
        vocab_size=tokenizer.vocab_size,
        padded_vocab_size=tokenizer.vocab_size + padded if padded else None,
        context_length=48,
        n_layer=2,
        n_embd=64,
    )
    torch.manual_seed(seed)
    model = GPT(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
        if padded:
            model.lm_head.weight[tokenizer.vocab_size :] = 5.0
    run = tmp_path / f"{family}-{kind}"
    save_model(model, run, tokenizer=tokenizer, extra=extra or None)
    return model, tokenizer, run


@pytest.mark.parametrize(
    ("family", "kind"),
    [("qwen3", "bpe"), ("qwen3", "char"), ("llama3", "gpt2"), ("gpt2", "char"), ("gpt2", "bpe")],
)
def test_every_tokenizer_exports_to_what_transformers_loads_alone(tmp_path, family, kind):
    model, tokenizer, run = tiny_run(tmp_path, family, kind)
    out = export_hf(run, tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenizer.encode(MIXED)
    assert hf_tok(MIXED)["input_ids"] == ids
    assert hf_tok.decode(ids) == tokenizer.decode(ids) == MIXED
    assert hf_tok.eos_token == "<|endoftext|>" and hf_tok.eos_token_id == tokenizer.eot_id
    assert load_tokenizer(out).encode(MIXED) == ids  # gptkiln reads the export back
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert generation.eos_token_id == tokenizer.eot_id

    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ours, theirs = greedy_ids(model, hf, tokenizer.encode("To be, or not"))
    assert theirs == ours


def greedy_ids(model, hf, prompt: list[int]) -> tuple[list[int], list[int]]:
    """12 greedy ids after ``prompt``: gptkiln's, then transformers' (no stop at end of text)."""
    ours = generate(model, prompt, max_new_tokens=12, temperature=0, stop_at_eos=False)
    with torch.no_grad():
        theirs = hf.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None
        )[0, len(prompt) :].tolist()
    return ours, theirs


@pytest.mark.parametrize("family", ["gpt2", "qwen3"])
def test_a_padded_vocabulary_leaves_without_its_padding_rows(tmp_path, family):
    """``--pad-vocab``'s rows mean no token: the export describes the tokenizer's vocabulary,
    its embedding and head cut to it, and transformers decodes the ids gptkiln does."""
    model, tokenizer, run = tiny_run(tmp_path, family, "bpe", padded=20)
    V = tokenizer.vocab_size
    assert model.wte.weight.shape[0] == V + 20
    out = export_hf(run, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["vocab_size"] == V
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.get_output_embeddings().weight.shape[0] == V
    prompt = tokenizer.encode("To be, or not")
    ours, theirs = greedy_ids(model, hf, prompt)
    assert theirs == ours and max(ours) < V
    with torch.no_grad():
        hf_logits = hf(torch.tensor([prompt])).logits
        torch.testing.assert_close(hf_logits, model(torch.tensor([prompt])), atol=1e-4, rtol=0)
    # the same without the export: interop's state dict describes the unpadded model too
    hf_sd = gptkiln_state_dict_to_hf(model.state_dict(), model.config)
    assert {
        t.shape[0]
        for n, t in hf_sd.items()
        if n.endswith(("wte.weight", "embed_tokens.weight", "lm_head.weight"))
    } == {V}


def test_an_instruction_tuned_runs_template_goes_out_as_jinja(tmp_path):
    from gptkiln.finetune.templates import ALPACA, format_messages

    _, _, run = tiny_run(
        tmp_path, "qwen3", "bpe", finetune={"task": "instruct", "template": ALPACA.to_dict()}
    )
    out = export_hf(run, tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    for messages in (
        [{"role": "user", "content": "Name a colour."}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "A {brace}?"},
        ],
    ):
        rendered = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert rendered == format_messages(ALPACA, messages)
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert "### Response:" in config["chat_template"]


def test_an_instruction_tuned_run_whose_tokenizer_adds_a_bos_exports_a_jinja_that_keeps_it(
    tmp_path,
):
    """An Alpaca run on a Llama 3 tokenizer was trained, and is prompted, with the BOS that
    tokenizer begins every text with; ``apply_chat_template`` adds none to what the template
    renders, so the exported template renders it: transformers' ids are gptkiln's."""
    from hf_tokenizer_dirs import write_llama3_dir

    from gptkiln.finetune.templates import ALPACA, format_messages
    from gptkiln.tokenizers import encode_prompt

    tokenizer = load_tokenizer(write_llama3_dir(tmp_path / "tokenizer"))
    config = GPTConfig.from_name("llama3-baby", vocab_size=tokenizer.vocab_size, n_layer=1)
    run = tmp_path / "run"
    extra = {"finetune": {"task": "instruct", "template": ALPACA.to_dict()}}
    save_model(GPT(config), run, tokenizer=tokenizer, extra=extra)
    out = export_hf(run, tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "Name a colour."}]
    ours = encode_prompt(tokenizer, format_messages(ALPACA, messages))
    assert ours[0] == tokenizer.encode("")[0]  # the BOS
    theirs = hf_tok.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    assert list(theirs) == ours


def test_a_quantized_run_exports_dequantized_and_says_so(tmp_path):
    _, tokenizer, run = tiny_run(tmp_path, "llama3", "char")
    quantize_run(run, tmp_path / "q")
    notes = []
    export_hf(tmp_path / "q", tmp_path / "hf", on_note=notes.append)
    assert len(notes) == 1 and "dequantized" in notes[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    quantized = load_model(tmp_path / "q")
    idx = torch.tensor([tokenizer.encode("To be, or not to be")])
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, quantized(idx), rtol=0, atol=1e-4)


def test_an_out_that_cannot_be_written_is_one_line_before_the_run_loads(
    tmp_path, capsys, monkeypatch
):
    from gptkiln.cli import main

    _, _, run = tiny_run(tmp_path, "gpt2", "char")

    def never(*args, **kwargs):
        raise AssertionError("the run was loaded before --out was checked")

    monkeypatch.setattr("gptkiln.export.hf.load_model", never)
    code = main(["convert", "to-hf", str(run), "--out", "/proc/gptkiln-export"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "cannot write in /proc" in err, err


def test_a_classifier_is_refused_in_one_line(tmp_path):
    model = GPT(
        GPTConfig.from_name(
            "tiny", vocab_size=60, context_length=8, num_classes=2, tie_embeddings=False
        )
    )
    save_model(model, tmp_path / "run")
    with pytest.raises(GptkilnError, match="is a classifier"):
        export_hf(tmp_path / "run", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_info_says_what_a_run_exports_to(tmp_path):
    from gptkiln.api import run_info

    _, _, run = tiny_run(tmp_path, "qwen3", "char")
    info = run_info(run)
    assert "Hugging Face (convert to-hf)" in info.exports and "GGUF" in info.exports
    assert "exports to" in info.summary()
    model = GPT(
        GPTConfig.from_name(
            "tiny", vocab_size=60, context_length=8, num_classes=2, tie_embeddings=False
        )
    )
    save_model(model, tmp_path / "classifier")
    assert run_info(tmp_path / "classifier").exports.startswith("nothing: a classifier")


@pytest.mark.parametrize("kind", ["bpe", "char", "gpt2"])
def test_a_gpt2_export_comes_back_with_its_own_tokenizer(tmp_path, kind):
    """``convert hf`` of an exported GPT-2 keeps the tokenizer it was trained on: GPT-2's BPE as
    gpt2, a ``bpe:N`` or ``char`` one as its tokenizer.json (not GPT-2's, whose ids the model
    has no rows for), so the round trip generates and fine-tunes as the run did."""
    from gptkiln.convert import import_hf
    from gptkiln.loading import load_run

    model, tokenizer, run = tiny_run(tmp_path, "gpt2", kind)
    import_hf(export_hf(run, tmp_path / "hf"), tmp_path / "back")
    back, back_tokenizer, cfg = load_run(tmp_path / "back")
    assert cfg["tokenizer"] == ("gpt2" if kind == "gpt2" else "hf")
    ids = tokenizer.encode(MIXED)
    assert back_tokenizer.encode(MIXED) == ids and back_tokenizer.decode(ids) == MIXED
    assert back_tokenizer.eot_id == tokenizer.eot_id
    prompt = tokenizer.encode("To be, or not")
    greedy = dict(max_new_tokens=12, temperature=0, stop_at_eos=False)
    assert generate(back.eval(), prompt, **greedy) == generate(model, prompt, **greedy)


@pytest.mark.parametrize("existing", [False, True], ids=["new", "overwrite"])
def test_an_export_cut_short_leaves_its_out_as_it_was(tmp_path, monkeypatch, existing):
    """Files are written beside ``--out`` and moved in whole: a failure in the last file (a
    full disk, Ctrl-C) leaves an earlier export byte for byte, or no directory at all; the
    next export completes, dropping the first's files it no longer writes (its shards)."""
    import gptkiln.export.hf as hf_export

    _, _, run = tiny_run(tmp_path, "gpt2", "bpe")
    out = tmp_path / "hf"
    if existing:
        export_hf(run, out, max_shard_size=20_000)  # sharded, so the second leaves shards stale
    before = {p.name: p.read_bytes() for p in out.iterdir()} if existing else None
    assert not existing or "model.safetensors.index.json" in before
    real = hf_export.write_json

    def cut_at_config(path, data):
        if path.name == "config.json":
            raise KeyboardInterrupt
        real(path, data)

    monkeypatch.setattr(hf_export, "write_json", cut_at_config)
    with pytest.raises(KeyboardInterrupt):
        export_hf(run, out, overwrite=True)
    if existing:
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    else:
        assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["gpt2-bpe", *["hf"] * existing])
    monkeypatch.setattr(hf_export, "write_json", real)
    export_hf(run, out, overwrite=True)
    assert not list(out.glob("model-*")) and (out / "model.safetensors").is_file()
    assert transformers.AutoModelForCausalLM.from_pretrained(out) is not None


def test_an_export_into_a_writable_out_whose_folder_is_not_stages_inside_it(tmp_path, monkeypatch):
    """Where --out's folder may not be written (a mounted volume), the files are written
    inside --out and moved into place there."""
    import errno
    from pathlib import Path

    _, _, run = tiny_run(tmp_path, "gpt2", "bpe")
    out = tmp_path / "volume" / "hf"
    out.mkdir(parents=True)
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if self.parent == out.parent and self.name.endswith(".writing"):  # a read-only mount
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    export_hf(run, out, overwrite=True)
    assert sorted(p.name for p in out.parent.iterdir()) == ["hf"]
    assert (out / "model.safetensors").is_file() and not (out / ".gptkiln-writing").exists()
    assert transformers.AutoModelForCausalLM.from_pretrained(out) is not None


@pytest.mark.parametrize("broken", ["tokenizer.json", "chat_template.jinja"])
def test_an_import_refuses_a_tokenizer_or_template_it_could_not_use_later(tmp_path, broken):
    """A garbage tokenizer.json, or a template jinja cannot compile, is one line at `convert
    hf`, not a run that fails at its first generate or chat."""
    from gptkiln.convert import import_hf

    _, _, run = tiny_run(tmp_path, "qwen3", "bpe")
    out = export_hf(run, tmp_path / "hf")
    (out / broken).write_text("{% if %}garbage" if broken.endswith("jinja") else "garbage")
    said = "not a readable tokenizers file" if broken == "tokenizer.json" else broken
    with pytest.raises(GptkilnError, match=said):
        import_hf(out, tmp_path / "back")
    assert not (tmp_path / "back").exists()
