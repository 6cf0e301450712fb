"""A Hugging Face directory's tokenizer (kind ``hf``): the ids and text of
``transformers.AutoTokenizer`` on the same directory, BOS/EOS from its config files, several stop
ids ending generation, saved into a run and read back, gptkiln's own ``bpe`` files told apart,
and one-line errors. The directories are written here (`hf_tokenizer_dirs`), offline."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from hf_tokenizer_dirs import LLAMA3_SPECIALS, write_llama3_dir, write_qwen3_dir
from test_cli import cli

from gptkiln import sampling
from gptkiln.checkpoint import save_model
from gptkiln.config import GPTConfig, SampleConfig
from gptkiln.loading import load_run
from gptkiln.model import GPT
from gptkiln.sampling import generate
from gptkiln.text_stream import TextStream
from gptkiln.tokenizers import (
    BPETokenizer,
    HFTokenizer,
    load_tokenizer,
    train_bpe_tokenizer,
)

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world! How are you today?",
    "<|begin_of_text|>Hi<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nok",
    "<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n<think>\nhm\n</think>\n\nSo.",
    "日本語のテキスト, don't stop; it's fine! <|endoftext|> <|end_of_text|>",
    "  spaces   and\ttabs\n\nnewlines ",
    "",
]


def auto(directory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoTokenizer.from_pretrained(directory)


@pytest.fixture(params=["llama3", "qwen3", "wordlevel"])
def hf_dir(request, tmp_path):
    if request.param == "llama3":
        return write_llama3_dir(tmp_path / "llama3")
    if request.param == "qwen3":
        return write_qwen3_dir(tmp_path / "qwen3")
    return write_wordlevel_dir(tmp_path / "wordlevel")


def write_wordlevel_dir(directory):
    """A WordLevel tokenizer without a post-processor or a decoder (ids decode to words joined
    by spaces), whose config asks for space clean-up, and for BOS and EOS, which transformers
    5 does not read beside a tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "<s>", "</s>", "Hello", ",", "world", ".", "don", "'", "t", "!", "?"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "[UNK]",
        "add_bos_token": True,
        "add_eos_token": True,
        "clean_up_tokenization_spaces": True,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_encode_and_decode_equal_auto_tokenizers(hf_dir):
    hf, ours = auto(hf_dir), load_tokenizer(hf_dir)
    assert isinstance(ours, HFTokenizer) and ours.kind == "hf"
    assert ours.vocab_size == len(hf)
    texts = TEXTS + ["Hello , world . don ' t !", "Hello world ?"]
    for text in texts:
        ids = hf.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == hf.decode(ids), text
        # a chat template's text: no special tokens added, as apply_chat_template encodes it
        assert ours.encode_templated(text) == hf.encode(text, add_special_tokens=False), text
    assert ours.bos_id == hf.bos_token_id
    assert ours.eot_id == hf.eos_token_id


def test_a_wordlevel_tokenizers_spaces_are_cleaned_up_as_its_config_says(tmp_path):
    ours = load_tokenizer(write_wordlevel_dir(tmp_path / "w"))
    ids = ours.encode("Hello, world. don't!")
    assert ids == [3, 4, 5, 6, 7, 8, 9, 10]  # no <s> / </s>: tokenizer.json has no post-processor
    assert ours.decode(ids) == "Hello, world. don't!"  # " ," " ." " '" " !" cleaned up
    assert ours._hf.decode(ids) == "Hello , world . don ' t !"  # what tokenizers alone gives


def test_special_tokens_in_text_are_one_id_and_ordinary_batches_keep_them_text(tmp_path):
    ours = load_tokenizer(write_llama3_dir(tmp_path / "l"))
    eot = ours.encode_templated("<|eot_id|>")
    assert eot == [ours.eot_id]
    plain = ours.encode_ordinary_batch(["<|eot_id|>"])[0]
    assert len(plain) > 1 and ours.eot_id not in plain  # documents cannot smuggle one in
    assert ours.decode(plain) == "<|eot_id|>"


def test_bos_eos_and_every_stop_id_come_from_the_config_files(tmp_path):
    llama = load_tokenizer(write_llama3_dir(tmp_path / "l"))
    ids = {t: llama.encode_templated(t)[0] for t in LLAMA3_SPECIALS}
    assert llama.bos_id == ids["<|begin_of_text|>"]
    assert llama.eot_id == ids["<|eot_id|>"]  # tokenizer_config.json's eos_token
    assert set(llama.stop_ids) == {ids["<|eot_id|>"], ids["<|end_of_text|>"], ids["<|eom_id|>"]}
    assert llama.encode("x")[0] == llama.bos_id  # the post-processor adds BOS
    qwen = load_tokenizer(write_qwen3_dir(tmp_path / "q"))
    assert qwen.bos_id is None and qwen.encode("x")[0] != qwen.encode_templated("<|im_start|>")[0]
    im_end, endoftext = qwen.encode_templated("<|im_end|>"), qwen.encode_templated("<|endoftext|>")
    assert qwen.stop_ids == (im_end[0], endoftext[0])


def test_a_run_keeps_the_tokenizer_and_bpe_runs_stay_bpe(tmp_path):
    directory = write_llama3_dir(tmp_path / "l")
    (directory / "generation_config.json").unlink()  # the stop ids of config.json alone
    source = load_tokenizer(directory)
    assert len(source.stop_ids) == 3
    source.save(tmp_path / "saved")
    (tmp_path / "saved" / "config.json").write_text('{"model": {}}')  # a run's own config.json
    again = load_tokenizer(tmp_path / "saved")
    assert isinstance(again, HFTokenizer)
    assert json.loads((tmp_path / "saved" / "tokenizer_meta.json").read_text())["kind"] == "hf"
    assert again.fingerprint() == source.fingerprint() and again.stop_ids == source.stop_ids
    for text in TEXTS:
        assert again.encode(text) == source.encode(text)
    assert again.bos_id == source.bos_id and again.eot_id == source.eot_id
    assert (tmp_path / "saved" / "tokenizer_config.json").is_file()
    # gptkiln's own trained BPE also writes a tokenizer.json: it stays a bpe tokenizer
    bpe = train_bpe_tokenizer(["some text to learn from, twice " * 20], 300)
    bpe.save(tmp_path / "bpe")
    loaded = load_tokenizer(tmp_path / "bpe")
    assert type(loaded) is BPETokenizer and loaded.stop_ids == (loaded.eot_id,)


def scripted(monkeypatch, tokens):
    """sample_rows that draws ``tokens`` in turn (one row), whatever the logits."""
    it = iter(tokens)
    monkeypatch.setattr(sampling, "sample_rows", lambda *a, **k: torch.tensor([next(it)]))


def test_generation_stops_on_any_of_several_stop_ids(tmp_path, monkeypatch):
    tok = load_tokenizer(write_llama3_dir(tmp_path / "l"))
    config = GPTConfig.from_name("tiny", vocab_size=tok.vocab_size, context_length=64)
    model = GPT(config).eval()
    eot, eom = tok.eot_id, tok.encode_templated("<|eom_id|>")[0]
    assert eom != eot and eom in tok.stop_ids
    cfg = SampleConfig(max_new_tokens=8, temperature=0)
    scripted(monkeypatch, [5, 6, eom, 7, 8, 9, 10, 11])
    assert generate(model, [3, 4], cfg, tokenizer=tok) == [5, 6]  # ended by the second stop id
    scripted(monkeypatch, [5, 6, eom, 7, 8, 9, 10, 11])
    assert generate(model, [3, 4], cfg, eot_id=eot) == [5, 6, eom, 7, 8, 9, 10, 11]
    stream = TextStream(tok.decode, (), tok.stop_ids)
    stream.push(5)
    stream.push(tok.encode_templated("<|end_of_text|>")[0])
    assert stream.done and stream.text == tok.decode([5])


def test_serving_a_run_stops_on_any_stop_id(tmp_path, monkeypatch):
    from gptkiln.serve.batcher import Batcher

    tok = load_tokenizer(write_llama3_dir(tmp_path / "l"))
    model = GPT(GPTConfig.from_name("tiny", vocab_size=tok.vocab_size, context_length=64))
    batcher = Batcher(model.eval(), tok)
    seq_cfg = SampleConfig(max_new_tokens=8, temperature=0)
    slot = batcher._new_slot(0, type("Seq", (), {"cfg": seq_cfg})())
    slot.stream.push(5)
    slot.stream.push(tok.encode_templated("<|eom_id|>")[0])
    assert slot.stream.done


def test_a_gpt2_of_a_tokenizer_of_its_own_is_read_with_that_tokenizer(tmp_path, capsys):
    """A GPT-2 checkpoint of another vocabulary than OpenAI's (trained on a tokenizer of its
    own) is read with its tokenizer.json, not GPT-2's BPE (whose ids it does not have); one of
    GPT-2's size without a tokenizer.json keeps OpenAI's."""
    folder = write_qwen3_dir(tmp_path / "hf")
    tok = load_tokenizer(folder)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=32,
                                     vocab_size=tok.vocab_size)  # fmt: skip
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    model, loaded, _ = load_run(folder)
    assert isinstance(loaded, HFTokenizer) and loaded.vocab_size == tok.vocab_size
    code, out, err = cli("generate", folder, "--prompt", "Hello", "--raw",
                         "--max-new-tokens", "3", capsys=capsys)  # fmt: skip
    assert code == 0 and out.startswith("Hello"), err
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (folder / name).unlink()
    code, _, err = cli("generate", folder, "--prompt", "Hello", capsys=capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "a Hugging Face model folder without its tokenizer; copy tokenizer.json" in err
    config.vocab_size = 50257
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    assert load_run(folder)[1].kind == "gpt2"


def test_a_run_without_its_tokenizer_json_is_one_line(tmp_path, capsys):
    tok = load_tokenizer(write_llama3_dir(tmp_path / "l"))
    model = GPT(GPTConfig.from_name("tiny", vocab_size=tok.vocab_size, context_length=64))
    save_model(model, tmp_path / "run", tokenizer=tok)
    assert isinstance(load_run(tmp_path / "run")[1], HFTokenizer)
    (tmp_path / "run" / "tokenizer.json").unlink()
    code, _, err = cli("generate", tmp_path / "run", "--prompt", "hi", capsys=capsys)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "tokenizer.json" in err
    # a Hugging Face directory with a config but no tokenizer.json, read directly
    (tmp_path / "l" / "tokenizer.json").unlink()
    from gptkiln.errors import GptkilnError

    with pytest.raises(GptkilnError, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "l")


def test_a_byte_level_tokenizer_streams_in_pieces_what_decoding_whole_gives(hf_dir):
    """Llama 3's and Qwen3's byte-level decoders stream their text a few tokens at a time
    (`TextStream`), the same text; a decoder that joins words with spaces, and cleans them up,
    is decoded whole."""
    from test_text_stream import assert_decoded_in_pieces_as_whole

    tok = load_tokenizer(hf_dir)
    if hf_dir.name == "wordlevel":
        assert not tok.decodes_in_pieces
    else:
        assert_decoded_in_pieces_as_whole(tok)


def test_a_decoder_that_strips_across_tokens_is_decoded_whole(tmp_path):
    """A SentencePiece-style ``Metaspace`` decoder drops the space that starts the first word of
    what it decodes, so decoding in pieces would lose the spaces between words: its tokenizer is
    decoded whole, and its stream's text is the whole decoding's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["<unk>", "▁Hello", "▁world", "▁again"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    directory = tmp_path / "metaspace"
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    ours = load_tokenizer(directory)
    assert ours.decode([1, 2]) == "Hello world" != ours.decode([1]) + ours.decode([2])
    assert not ours.decodes_in_pieces
    stream = TextStream(ours.decode)
    assert "".join(stream.push(t) for t in [1, 2, 3]) + stream.flush() == "Hello world again"


def test_a_byte_level_tokenizer_gives_each_ids_own_bytes(hf_dir):
    """Llama 3's and Qwen3's ids give back the bytes of their text, a piece of a character its
    own bytes (not U+FFFD's): what a grammar (llguidance) and logprobs' ``bytes`` read."""
    tok = load_tokenizer(hf_dir)
    if hf_dir.name == "wordlevel":  # words joined by spaces: no bytes of its own to give
        return
    split = 0
    for text in [*TEXTS, "Zürich, Köln, café, 日本, 🙂"]:
        ids = tok.encode_templated(text)
        pieces = [tok.token_bytes(i) for i in ids]
        assert b"".join(pieces) == text.encode("utf-8"), text
        split += sum(b"\xef\xbf\xbd" in tok.decode([i]).encode() for i in ids)
    assert split > 0  # some ids hold part of a character, whose decoding alone shows U+FFFD


def test_a_byte_level_tokenizers_ids_count_each_character_once(hf_dir):
    """Bits per character divide by the characters each id adds: a byte-level id holding a
    piece of a character counts it once (by its first byte), not as a U+FFFD of its own, so the
    ids of any text count its characters exactly (Llama's and Qwen's, as GPT-2's do)."""
    tok = load_tokenizer(hf_dir)
    if hf_dir.name == "wordlevel":  # words joined by spaces: no bytes of its own to give
        return
    for text in ["Zürich, Köln, café, 日本語 and 🙂", "火星上的企鹅 🐧"]:
        ids = tok.encode_templated(text)
        assert int(tok.char_counts()[ids].sum()) == len(text), text


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_perplexity_scores_every_token_once_from_the_tokenizers_own_start(tmp_path, family):
    """``gptkiln perplexity`` on a Hugging Face model equals the mean of transformers' own
    next-token losses over the text as its tokenizer encodes it (Llama 3's BOS first, so the
    first word is scored too), every target once: whole context windows, then the tail with
    a full window of context, as lm-eval's rolling windows score it."""
    from gptkiln.api import perplexity_of_run

    directory = (write_llama3_dir if family == "llama3" else write_qwen3_dir)(tmp_path / "m")
    hf_tok = auto(directory)
    shape = dict(vocab_size=len(hf_tok), hidden_size=32, intermediate_size=64,
                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                 max_position_embeddings=16, tie_word_embeddings=False)  # fmt: skip
    ids = json.loads((directory / "config.json").read_text())
    kind = transformers.LlamaConfig if family == "llama3" else transformers.Qwen3Config
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(kind(**shape, **ids)).eval()
    hf.save_pretrained(directory)
    text = "Hello, world! How are you today? Zürich, Köln, café, 日本語のテキスト, 🙂 " * 3
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    tokens = torch.tensor(hf_tok(text)["input_ids"])  # (N,): with BOS where it adds one
    assert (tokens[0] == hf_tok.bos_token_id) == (family == "llama3")
    with torch.no_grad():
        logp = torch.cat([  # every target once: windows of 16, then the last 16 for the tail
            torch.log_softmax(hf(tokens[s : s + 16][None]).logits[0], -1)
            for s in range(0, len(tokens) - 16, 16)
        ])  # fmt: skip
        tail = len(tokens) - 1 - len(logp)
        last = torch.log_softmax(hf(tokens[-17:-1][None]).logits[0], -1)[16 - tail :]
    logp = torch.cat([logp, last])  # (N - 1, V)
    want = -logp.gather(-1, tokens[1:, None]).mean().item()
    result = perplexity_of_run(directory, tmp_path / "text.txt", progress=False)
    assert result.tokens == len(tokens) - 1 and len(tokens) > 40 and tail > 0
    assert result.loss == pytest.approx(want, rel=1e-5)
    unscored = "" if family == "llama3" else hf_tok.decode(tokens[:1])  # the first word's
    assert result.characters == len(text) - len(unscored)
    import warnings

    from gptkiln.data.prepare import prepare

    prepare(tmp_path / "text.txt", tmp_path / "prepared", directory, 0.5, progress=False)
    with warnings.catch_warnings():  # its split is a read-only memmap: the tail is a copy
        warnings.simplefilter("error")
        prepared = perplexity_of_run(directory, tmp_path / "prepared", progress=False)
    assert prepared.tokens > 16 and prepared.tokens % 16  # whole windows and a tail


def test_data_prepared_with_a_models_tokenizer_keeps_its_ids_not_its_sampling(tmp_path):
    """A model trained from scratch on a Qwen3 tokenizer is not Qwen3: the prepared data (and
    so the run) keeps its generation_config.json's token ids, not Qwen3's temperature 0.6."""
    from hf_tokenizer_dirs import write_qwen3_dir

    from gptkiln.config.sample import model_sampling
    from gptkiln.data import prepare

    directory = write_qwen3_dir(tmp_path / "qwen")
    config = json.loads((directory / "generation_config.json").read_text())
    sampled = {**config, "do_sample": True, "temperature": 0.6, "top_k": 20}
    (directory / "generation_config.json").write_text(json.dumps(sampled))
    assert model_sampling(directory) == {"temperature": 0.6, "top_k": 20}
    (tmp_path / "t.txt").write_text("some text to prepare, and some more\n" * 40)
    prepare(tmp_path / "t.txt", tmp_path / "data", tokenizer=str(directory), progress=False)
    kept = json.loads((tmp_path / "data" / "generation_config.json").read_text())
    assert kept == config and model_sampling(tmp_path / "data") == {}
    assert load_tokenizer(tmp_path / "data").stop_ids == load_tokenizer(directory).stop_ids
