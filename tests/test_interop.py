"""GPT-2 weights in and out: parity with Hugging Face transformers and with the book's GPTModel.

Every model here is tiny and random, built locally; nothing is downloaded.
"""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path

import pytest
import torch

from gptkiln.checkpoint import save_model
from gptkiln.config import GPTConfig
from gptkiln.convert import download, export_hf, import_book, import_hf
from gptkiln.errors import GptkilnError
from gptkiln.interop import config_to_hf, gptkiln_state_dict_to_hf
from gptkiln.loading import (
    book_state_dict_to_gptkiln,
    config_from_hf,
    hf_state_dict_to_gptkiln,
    load_model,
)
from gptkiln.model import GPT
from gptkiln.sampling import generate

transformers = pytest.importorskip("transformers")

TEA_IDS = [15496, 11, 466, 345, 588, 8887, 30]  # "Hello, do you like tea?" in GPT-2 BPE


def randomize_(model: torch.nn.Module, std: float = 0.1) -> torch.nn.Module:
    """Every parameter random, biases and LayerNorms included, so a swapped or dropped tensor
    shows in the logits (default inits make biases 0 and LayerNorms 1, which hides that)."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std)
    return model.eval()


def tiny_hf_model(seed: int = 0, vocab_size: int = 100):
    """A random GPT2LMHeadModel; no bos/eos inside the vocabulary, so generation never stops."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        vocab_size=vocab_size,
        n_positions=32,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        attn_implementation="eager",
    )
    return randomize_(transformers.GPT2LMHeadModel(config))


@pytest.fixture
def hf_dir(tmp_path: Path):
    model = tiny_hf_model()
    model.save_pretrained(tmp_path / "hf")
    return model, tmp_path / "hf"


def hf_logits(model, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(idx).logits


def ids(seed: int = 1, shape=(2, 12), vocab_size: int = 100) -> torch.Tensor:
    return torch.randint(0, vocab_size, shape, generator=torch.Generator().manual_seed(seed))


# -- Hugging Face -> gptkiln -----------------------------------------------------------------
def test_import_from_safetensors_matches_transformers_logits(hf_dir):
    hf, path = hf_dir
    assert (path / "model.safetensors").is_file()
    model = import_hf(path)
    assert model.config.tie_embeddings and model.lm_head.weight is model.wte.weight
    assert not any(p.is_meta for p in model.parameters())
    idx = ids()
    with torch.no_grad():
        torch.testing.assert_close(model(idx), hf_logits(hf, idx), rtol=0, atol=1e-5)


def test_import_from_pytorch_model_bin(tmp_path):
    hf = tiny_hf_model(seed=3)
    path = tmp_path / "hf_bin"
    path.mkdir()
    hf.config.to_json_file(path / "config.json")
    torch.save(hf.state_dict(), path / "pytorch_model.bin")  # includes lm_head.weight
    model = import_hf(path)
    idx = ids(seed=2)
    with torch.no_grad():
        torch.testing.assert_close(model(idx), hf_logits(hf, idx), rtol=0, atol=1e-5)


def test_old_checkpoints_with_mask_buffers_import(hf_dir):
    hf, _ = hf_dir
    sd = {
        **hf.state_dict(),
        "transformer.h.0.attn.bias": torch.ones(1, 1, 32, 32),
        "transformer.h.1.attn.masked_bias": torch.tensor(-1e4),
    }
    config = config_from_hf(hf.config.to_dict())
    converted = hf_state_dict_to_gptkiln(sd, config)
    assert "h.0.attn.bias" not in converted and "lm_head.weight" not in converted
    weight = sd["transformer.h.1.mlp.c_fc.weight"]  # Conv1D: (in, out)
    assert torch.equal(converted["h.1.mlp.c_fc.weight"], weight.t())


def test_load_model_reads_an_imported_hf_directory_directly(hf_dir):
    hf, path = hf_dir
    idx = ids(seed=4)
    with torch.no_grad():
        torch.testing.assert_close(load_model(path)(idx), hf_logits(hf, idx), rtol=0, atol=1e-5)


def test_greedy_generation_with_kv_cache_equals_transformers(hf_dir):
    hf, path = hf_dir
    model = import_hf(path)
    prompt = [5, 17, 42, 8, 99, 3]
    ours = generate(model, prompt, max_new_tokens=20, temperature=0)
    theirs = hf.generate(
        torch.tensor([prompt]),
        do_sample=False,
        max_new_tokens=20,
        pad_token_id=0,
        eos_token_id=None,
        attention_mask=torch.ones(1, 6),
    )
    assert len(ours) == 20 and len(set(ours)) > 2  # not one token repeated
    assert ours == theirs[0, len(prompt) :].tolist()


def test_mismatched_checkpoint_names_the_setting_and_both_values(hf_dir):
    _, path = hf_dir
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "n_positions": 64}))
    with pytest.raises(GptkilnError) as info:
        import_hf(path)
    assert "says context_length 64, but the weights hold context_length 32" in str(info.value)
    assert str(path) in str(info.value)


def test_conv1d_shape_errors_are_reported_in_hf_layout(hf_dir):
    hf, _ = hf_dir
    sd = hf.state_dict()
    sd["transformer.h.1.attn.c_attn.weight"] = torch.zeros(32, 95)
    del sd["transformer.ln_f.bias"]
    with pytest.raises(GptkilnError) as info:
        hf_state_dict_to_gptkiln(sd, config_from_hf(hf.config.to_dict()))
    message = str(info.value)
    assert "h.1.attn.c_attn.weight (32, 95) (expected (32, 96))" in message
    assert "missing ln_f.bias" in message


def test_import_of_an_untied_hf_model_keeps_its_own_head(tmp_path):
    torch.manual_seed(3)
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=32,
        tie_word_embeddings=False, attn_implementation="eager",
    )  # fmt: skip
    hf = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        hf.lm_head.weight.normal_()  # a head unlike the embedding
    hf.save_pretrained(tmp_path / "hf")
    model = import_hf(tmp_path / "hf")
    assert not model.config.tie_embeddings
    with torch.no_grad():
        torch.testing.assert_close(model(ids()), hf_logits(hf, ids()), rtol=0, atol=1e-4)


def test_config_from_hf_reads_defaults_and_refuses_other_models():
    config = config_from_hf({"model_type": "gpt2"})  # save_pretrained omits default values
    assert (config.n_layer, config.n_head, config.n_embd, config.context_length) == (
        12,
        12,
        768,
        1024,
    )
    assert config.vocab_size == 50257 and config.tie_embeddings and config.qkv_bias
    assert config.gelu == "tanh"
    assert config_from_hf({"model_type": "gpt2", "activation_function": "gelu"}).gelu == "exact"
    with pytest.raises(GptkilnError, match="activation_function='relu'"):
        config_from_hf({"model_type": "gpt2", "activation_function": "relu"})
    with pytest.raises(GptkilnError, match="layer_norm_epsilon=1e-06"):  # gptkiln's LN: 1e-5
        config_from_hf({"model_type": "gpt2", "layer_norm_epsilon": 1e-6})
    with pytest.raises(GptkilnError, match="model_type is 'llama'"):
        config_from_hf({"model_type": "llama"})
    # a value of the wrong kind: one line naming the key and the file, not a TypeError
    for bad, needle in (
        ({"layer_norm_epsilon": None}, "layer_norm_epsilon is None, not a number"),
        ({"layer_norm_epsilon": "1e-5"}, "layer_norm_epsilon is '1e-5', not a number"),
        ({"n_embd": "64"}, "x/config.json: n_embd is '64', not a whole number"),
        ({"n_embd": None}, "x/config.json: n_embd is None, not a whole number"),
        ({"tie_word_embeddings": "no"}, "x/config.json: model config: tie_embeddings"),
        ({"n_embd": 64, "n_head": 12}, r"divisible by n_head \(12\)$"),  # no head_dim: GPT-2's
    ):
        with pytest.raises(GptkilnError, match=needle):
            config_from_hf({"model_type": "gpt2", **bad}, "x/config.json")
    from gptkiln.loading.hf_llama import config_from_hf as llama_config

    with pytest.raises(GptkilnError, match="n_embd must be a whole number, got '64'"):
        llama_config({"model_type": "llama", "hidden_size": "64"}, "x/config.json")


# -- gptkiln -> Hugging Face -----------------------------------------------------------------
def test_export_of_an_imported_run_loads_in_transformers(hf_dir, tmp_path):
    hf, path = hf_dir
    import_hf(path, tmp_path / "run")
    export_hf(tmp_path / "run", tmp_path / "out")
    reloaded, info = transformers.GPT2LMHeadModel.from_pretrained(
        tmp_path / "out", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    idx = ids(seed=5)
    torch.testing.assert_close(
        hf_logits(reloaded.eval(), idx), hf_logits(hf, idx), rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("tied, gelu", [(True, "tanh"), (False, "exact")])
def test_export_without_qkv_bias_or_tying_keeps_logits(tmp_path, tied, gelu):
    from gptkiln.tokenizers import load_tokenizer

    torch.manual_seed(0)
    model = randomize_(
        GPT(
            GPTConfig(
                vocab_size=100,
                context_length=32,
                n_layer=2,
                n_head=2,
                n_embd=32,
                qkv_bias=False,
                tie_embeddings=tied,
                gelu=gelu,
            )
        )
    )
    save_model(model, tmp_path / "run", tokenizer=load_tokenizer("gpt2"))
    export_hf(tmp_path / "run", tmp_path / "out")
    hf_config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf_config["tie_word_embeddings"] is tied
    assert hf_config["activation_function"] == {"tanh": "gelu_new", "exact": "gelu"}[gelu]
    assert config_from_hf(hf_config).gelu == gelu
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    assert not reloaded.transformer.h[0].attn.c_attn.bias.any()  # zero qkv biases
    idx = ids(seed=6)
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(reloaded, idx), model(idx), rtol=0, atol=1e-5)


def test_exported_tokenizer_loads_in_transformers(tmp_path):
    path = tmp_path / "hf"
    tiny_hf_model(vocab_size=50257).save_pretrained(path)  # GPT-2's vocabulary, its BPE's ids
    import_hf(path, tmp_path / "run")
    export_hf(tmp_path / "run", tmp_path / "out")
    tokenizer = transformers.GPT2TokenizerFast.from_pretrained(tmp_path / "out")
    assert tokenizer("Hello, do you like tea?")["input_ids"] == TEA_IDS
    assert tokenizer.model_max_length == 32  # the model's context, not GPT-2's 1024
    special = json.loads((tmp_path / "out" / "special_tokens_map.json").read_text())
    assert special["eos_token"] == special["bos_token"] == special["unk_token"] == "<|endoftext|>"
    assert tokenizer.eos_token == tokenizer.bos_token == "<|endoftext|>"
    assert tokenizer.eos_token_id == 50256


def test_a_gpt2_smaller_than_gpt2s_vocabulary_imports_without_a_tokenizer(hf_dir, tmp_path):
    """A GPT-2 of 100 ids with no tokenizer.json is not of GPT-2's BPE (whose ids reach
    50,256): it imports as a run without a tokenizer, which says so, not with GPT-2's."""
    from gptkiln.loading import load_run_tokenizer

    _, path = hf_dir
    notes = []
    import_hf(path, tmp_path / "run", on_note=notes.append)
    assert len(notes) == 1 and "has no tokenizer.json" in notes[0]  # said at once
    assert not (tmp_path / "run" / "tokenizer_meta.json").exists()
    with pytest.raises(GptkilnError, match="saved without its tokenizer"):
        load_run_tokenizer(tmp_path / "run")


def test_state_dict_round_trip_through_hf_names():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=60, context_length=16, n_layer=2, n_head=2, n_embd=16)
    sd = GPT(config).state_dict()
    hf_sd = gptkiln_state_dict_to_hf(sd, config)
    assert "lm_head.weight" not in hf_sd and hf_sd["transformer.h.0.attn.c_attn.weight"].shape == (
        16,
        48,
    )
    back = hf_state_dict_to_gptkiln(hf_sd, config)
    assert back.keys() == sd.keys() - {"lm_head.weight"}
    assert all(torch.equal(back[k], sd[k]) for k in back)
    hf = config_to_hf(config)
    assert hf["n_positions"] == 16 and hf["activation_function"] == "gelu_new"
    assert config_from_hf(hf) == config


# -- the book's GPTModel ---------------------------------------------------------------------
def book_model(vocab_size: int = 100, seed: int = 0, qkv_bias: bool = False):
    ch04 = pytest.importorskip("llms_from_scratch.ch04")
    torch.manual_seed(seed)
    cfg = {
        "vocab_size": vocab_size,
        "context_length": 32,
        "emb_dim": 32,
        "n_heads": 2,
        "n_layers": 2,
        "drop_rate": 0.0,
        "qkv_bias": qkv_bias,
    }
    return ch04, randomize_(ch04.GPTModel(cfg))


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_book_checkpoint_matches_generate_text_simple(tmp_path, qkv_bias):
    ch04, book = book_model(qkv_bias=qkv_bias)
    torch.save(book.state_dict(), tmp_path / "model.pth")
    model = import_book(tmp_path / "model.pth", n_head=2)
    assert model.config.qkv_bias is qkv_bias and not model.config.tie_embeddings
    prompt = torch.tensor([[7, 1, 64, 33]])
    with torch.no_grad():
        torch.testing.assert_close(model(prompt), book(prompt), rtol=0, atol=1e-5)
        expected = ch04.generate_text_simple(book, prompt, max_new_tokens=10, context_size=32)
    got = generate(model, prompt[0].tolist(), max_new_tokens=10, temperature=0)
    assert got == expected[0, 4:].tolist()


def test_book_checkpoint_with_gpt2_tokenizer_prompt(tmp_path):
    from gptkiln.tokenizers import load_tokenizer

    ch04, book = book_model(vocab_size=50257, seed=1)
    torch.save(
        {"model_state_dict": book.state_dict(), "optimizer_state_dict": {}},
        tmp_path / "model_and_optimizer.pth",
    )
    import_book(tmp_path / "model_and_optimizer.pth", tmp_path / "run", n_head=2)
    model = load_model(tmp_path / "run")
    tokenizer = load_tokenizer(tmp_path / "run")
    prompt = tokenizer.encode("Hello, I am")
    assert prompt == [15496, 11, 314, 716]
    with torch.no_grad():
        expected = ch04.generate_text_simple(
            book, torch.tensor([prompt]), max_new_tokens=10, context_size=32
        )
    got = generate(model, prompt, max_new_tokens=10, temperature=0)
    assert got == expected[0, len(prompt) :].tolist()


def test_a_book_model_with_its_head_tied_to_the_embedding_converts_tied(tmp_path):
    """The book's weight-tying exercise (``out_head.weight = tok_emb.weight``) saves one tensor
    under both names: the run is tied, the same logits; --n-head 0 is one line."""
    ch04, book = book_model(seed=2)
    book.out_head.weight = book.tok_emb.weight
    torch.save(book.state_dict(), tmp_path / "model.pth")
    import_book(tmp_path / "model.pth", tmp_path / "run", n_head=2)
    model = load_model(tmp_path / "run")
    assert model.config.tie_embeddings
    prompt = torch.tensor([[7, 1, 64, 33]])
    with torch.no_grad():
        torch.testing.assert_close(model(prompt), book(prompt), rtol=0, atol=1e-5)
    with pytest.raises(GptkilnError, match="--n-head 0: the attention heads"):
        import_book(tmp_path / "model.pth", n_head=0)


def test_a_pth_that_is_more_than_tensors_is_refused_without_torchs_unsafe_advice(tmp_path):
    """A pickle naming code (here os.getcwd, harmless) is not run, and the message does not
    repeat torch's advice to load it with weights_only=False."""
    import os
    import pickle

    class Payload:
        def __reduce__(self):
            return (os.getcwd, ())

    torch.save({"tok_emb.weight": torch.zeros(2, 2), "x": Payload()}, tmp_path / "model.pth",
               pickle_module=pickle)  # fmt: skip
    with pytest.raises(GptkilnError) as caught:
        import_book(tmp_path / "model.pth", n_head=1)
    said = str(caught.value)
    assert "it names objects that no state dict holds" in said and "weights_only" not in said


def openai_checkpoint(directory: Path) -> Path:
    """The files of OpenAI's TensorFlow GPT-2 checkpoint as the book's ``gpt_download.py``
    leaves them in ``gpt2/124M`` (their contents do not matter here)."""
    directory.mkdir(parents=True)
    (directory / "hparams.json").write_text('{"n_vocab": 50257, "n_embd": 768}')
    (directory / "checkpoint").write_text('model_checkpoint_path: "model.ckpt"\n')
    for name in ("model.ckpt.index", "model.ckpt.meta", "model.ckpt.data-00000-of-00001"):
        (directory / name).write_bytes(b"\x00" * 16)
    return directory


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["generate", "{pth}", "--prompt", "Hi"], ["model.pth", "gptkiln convert book"]),
        (["info", "{pth}"], ["model.pth", "gptkiln convert book"]),
        (["convert", "hf", "{tf}", "--out", "{out}"], ["TensorFlow", "gptkiln convert book"]),
        (["generate", "{tf}", "--prompt", "Hi"], ["TensorFlow", "load_weights_into_gpt"]),
        (["convert", "book", "{tf}", "--out", "{out}"], ["TensorFlow", "model.pth"]),
        (
            ["convert", "book", "{tf}/model.ckpt.data-00000-of-00001", "--out", "{out}"],
            ["TensorFlow", "gptkiln convert book"],
        ),
    ],
)
def test_the_books_own_files_given_where_a_run_goes_say_how_to_convert_them(
    tmp_path, capsys, argv, needles
):
    """A learner's files from the book: the model.pth of its section 5.4 given to a command that
    takes a run, and the TensorFlow checkpoint its gpt_download.py fetches (gpt2/124M) given
    anywhere, are each one line that says how to make a run of them, not a bare "config.json
    is missing" (whose fix was to train into the download's folder)."""
    from gptkiln.cli import main

    torch.save({"tok_emb.weight": torch.zeros(2, 2)}, tmp_path / "model.pth")
    tf = openai_checkpoint(tmp_path / "gpt2" / "124M")
    names = {"pth": tmp_path / "model.pth", "tf": tf, "out": tmp_path / "run"}
    assert main([arg.format(**names) for arg in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(n in err for n in needles), err
    assert f"gptkiln train --out {tf}" not in err
    assert not (tmp_path / "run").exists()


def test_book_conversion_infers_the_config_and_needs_n_head():
    _, book = book_model()
    config, sd = book_state_dict_to_gptkiln(book.state_dict(), n_head=4)
    assert (config.vocab_size, config.context_length, config.n_layer, config.n_embd) == (
        100,
        32,
        2,
        32,
    )
    assert config.n_head == 4 and not config.qkv_bias and not config.tie_embeddings
    block = book.trf_blocks[1].att
    expected = torch.cat([block.W_query.weight, block.W_key.weight, block.W_value.weight])
    assert torch.equal(sd["h.1.attn.c_attn.weight"], expected)
    with pytest.raises(GptkilnError, match="not divisible by n_head 12; pass"):
        book_state_dict_to_gptkiln(
            {**book.state_dict(), "tok_emb.weight": torch.zeros(100, 20)}, n_head=12
        )
    # unsaid, the heads are GPT-2's at its widths, and another width's are asked for
    with pytest.raises(GptkilnError, match="32 wide is none of GPT-2's sizes.*pass the number"):
        book_state_dict_to_gptkiln(book.state_dict())
    ch04 = pytest.importorskip("llms_from_scratch.ch04")
    cfg = dict(vocab_size=10, context_length=4, emb_dim=768, n_heads=12, n_layers=1,
               drop_rate=0.0, qkv_bias=True)  # fmt: skip
    assert book_state_dict_to_gptkiln(ch04.GPTModel(cfg).state_dict())[0].n_head == 12
    with pytest.raises(GptkilnError, match="not a state dict of the book's GPTModel"):
        book_state_dict_to_gptkiln({"wte.weight": torch.zeros(3, 4)})
    with pytest.raises(GptkilnError, match="unexpected trf_blocks.0.extra.weight"):
        book_state_dict_to_gptkiln(
            {
                **book.state_dict(),
                "trf_blocks.0.extra.weight": torch.zeros(1),
                "trf_blocks.1.x": torch.zeros(1),
            },
            n_head=2,
        )


# -- the Hub ---------------------------------------------------------------------------------
def test_download_unknown_name_lists_the_known_ones(tmp_path):
    with pytest.raises(GptkilnError, match="choose one of: gpt2, gpt2-medium, gpt2-large, gpt2-xl"):
        download("gpt3", tmp_path)


def test_download_offline_fails_fast_without_touching_the_network(tmp_path, monkeypatch):
    import huggingface_hub.constants

    connects = []
    monkeypatch.setattr(socket.socket, "connect", lambda *a: connects.append(a))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    start = time.perf_counter()
    with pytest.raises(GptkilnError) as info:
        download("gpt2", tmp_path / "run")
    assert time.perf_counter() - start < 5
    assert not connects
    message = str(info.value)
    assert "needs internet" in message and "gptkiln convert hf DIR" in message
    assert "\n" not in message
    assert not (tmp_path / "run").exists()
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)


def test_download_imports_what_the_hub_client_returns(tmp_path, monkeypatch):
    import huggingface_hub

    from gptkiln.loading import load_run

    hf, path = tiny_hf_model(vocab_size=50257), tmp_path / "hf"  # GPT-2's vocabulary
    hf.save_pretrained(path)
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(path)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    download("gpt2-medium", tmp_path / "run")
    ((repo_id, kwargs),) = calls
    assert repo_id == "openai-community/gpt2-medium"
    assert "model.safetensors" in kwargs["allow_patterns"] and not kwargs["local_files_only"]
    model, tokenizer, cfg = load_run(tmp_path / "run")
    assert tokenizer.kind == "gpt2" and cfg["tokenizer"] == "gpt2"
    idx = ids(seed=8)
    with torch.no_grad():
        torch.testing.assert_close(model(idx), hf_logits(hf, idx), rtol=0, atol=1e-5)


def test_generate_and_eval_cli_take_an_hf_directory_directly(tmp_path, capsys):
    from gptkiln.cli import main
    from gptkiln.tokenizers import load_tokenizer

    model = tiny_hf_model(vocab_size=50257)
    model.save_pretrained(tmp_path / "hf")
    prompt = "Hello, do you like tea?"
    assert (
        main(
            [
                "generate",
                str(tmp_path / "hf"),
                "--prompt",
                prompt,
                "--max-new-tokens",
                "6",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    with torch.no_grad():
        expected = model.generate(torch.tensor([TEA_IDS]), max_new_tokens=6, do_sample=False)
    assert out.rstrip("\n") == prompt + load_tokenizer("gpt2").decode(expected[0, 7:].tolist())
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    assert main(["perplexity", str(tmp_path / "hf"), "--data", str(text), "--quiet"]) == 0
    assert "perplexity" in capsys.readouterr().out


def test_an_hf_config_edited_to_a_billion_layers_is_refused_at_once(hf_dir):
    _, path = hf_dir
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "n_layer": 1_000_000_000}))
    with pytest.raises(
        GptkilnError, match="says n_layer 1000000000, but the weights hold n_layer 2"
    ):
        load_model(path)
