"""Tokenizers: GPT-2 golden ids, char vocabularies, trained byte BPE, save/load, specs."""

import json
import re

import pytest
from conftest import plays_text

from gptkiln.errors import GptkilnError
from gptkiln.tokenizers import (
    DEFAULT_BPE_VOCAB_SIZE,
    GPT2_EOT_ID,
    BPETokenizer,
    CharTokenizer,
    build_char_tokenizer,
    gpt2_mergeable_ranks,
    load_tokenizer,
    parse_tokenizer_spec,
    train_bpe_tokenizer,
)

GOLDEN_TEXT = "Hello, do you like tea? <|endoftext|> In the sunlit terracesof someunknownPlace."
GOLDEN_IDS = [15496, 11, 466, 345, 588, 8887, 30, 220, 50256, 554, 262, 4252, 18250, 8812, 2114]
GOLDEN_IDS += [1659, 617, 34680, 27271, 13]

CHINESE_SENTENCES = [
    "今天天气很好，我们去公园散步吧。",
    "他每天早上六点起床，然后跑步半个小时。",
    "这本书讲的是一个小村庄的故事，非常有意思。",
    "学习语言需要耐心，也需要每天练习。",
    "我的朋友住在北京，她喜欢喝茶和画画。",
    "春天来了，花儿都开了，孩子们在草地上玩耍。",
    "机器学习模型可以从大量的文本中学习规律。",
    "晚饭以后，我们一起看电影，聊天到很晚。",
]


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer("gpt2")


@pytest.fixture(scope="module")
def chinese_bpe():
    corpus = [
        f"{i}. {s}{CHINESE_SENTENCES[(i * 3) % 8]}" for i in range(60) for s in CHINESE_SENTENCES
    ]
    return train_bpe_tokenizer(corpus, 600)


def test_gpt2_golden_ids_and_round_trip(gpt2):
    assert gpt2.kind == "gpt2" and gpt2.vocab_size == 50257 and gpt2.eot_id == GPT2_EOT_ID
    ids = gpt2.encode(GOLDEN_TEXT)
    assert ids == GOLDEN_IDS
    assert gpt2.decode(ids) == GOLDEN_TEXT


def test_gpt2_whole_verdict_round_trips(gpt2, verdict_text):
    # the book's chapter 2: its text is 5,145 tokens, and these are the first five
    ids = gpt2.encode(verdict_text)
    assert len(ids) == 5145
    assert ids[:5] == [40, 367, 2885, 1464, 1807]
    assert gpt2.decode(ids) == verdict_text


def test_gpt2_round_trips_a_whole_play(gpt2):
    text = plays_text(90_000)  # A Midsummer Night's Dream, all but its last lines
    ids = gpt2.encode(text)
    assert gpt2.decode(ids) == text
    assert len(ids) < len(text) / 3  # merged: English verse is about 3.3 characters a token
    assert gpt2.encode_ordinary_batch([text]) == [ids]  # no special token in it


def test_gpt2_ordinary_batch_treats_endoftext_as_text(gpt2):
    plain, golden = gpt2.encode_ordinary_batch([GOLDEN_TEXT, "Hello, world"])
    assert GPT2_EOT_ID not in plain
    assert gpt2.decode(plain) == GOLDEN_TEXT
    assert golden == gpt2.encode("Hello, world")


@pytest.mark.parametrize("kind", ["gpt2", "char", "bpe"])
def test_batch_arrays_equal_batch_lists(kind, gpt2):
    texts = [GOLDEN_TEXT, "", "tea and more tea? " * 50]
    if kind == "gpt2":
        tok = gpt2
    elif kind == "char":
        tok = build_char_tokenizer(texts, with_eot=True)
    else:
        tok = train_bpe_tokenizer(texts, 300)
    arrays = tok.encode_ordinary_batch_arrays(texts)
    assert [a.tolist() for a in arrays] == tok.encode_ordinary_batch(texts)
    assert tok.eot_id not in arrays[0].tolist()


def test_gpt2_batch_encodes_runs_of_texts_on_its_threads_not_a_task_a_text(gpt2, monkeypatch):
    # A jsonl of many short records: a thread-pool task for each cost as much as encoding them.
    import concurrent.futures

    import gptkiln.tokenizers.gpt2

    tasks = []

    class Counted(concurrent.futures.ThreadPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):
            tasks.append(fn)
            return super().submit(fn, *args, **kwargs)

    monkeypatch.setattr(gptkiln.tokenizers.gpt2, "ThreadPoolExecutor", Counted)
    texts = [f"Record {i}: to be, or not to be." * (1 + i % 7) for i in range(1000)] + [""]
    arrays = gpt2.encode_ordinary_batch_arrays(texts, num_threads=2)
    assert [a.tolist() for a in arrays] == [gpt2.encode(t) for t in texts]
    assert 2 <= len(tasks) <= 8  # a few runs of texts a thread
    assert gpt2.encode_ordinary_batch_arrays([], num_threads=2) == []


def test_gpt2_ranks_are_single_bytes_then_merges():
    ranks = gpt2_mergeable_ranks()
    assert len(ranks) == 50256
    assert ranks[b"!"] == 0 and ranks[b" the"] == 262 and ranks[bytes([0])] == 188


def test_char_vocab_of_a_play_is_its_characters_in_code_point_order(play_text):
    tok = build_char_tokenizer([play_text], with_eot=False)
    assert tok.vocab_size == len(set(play_text)) and tok.eot_id is None
    assert tok.chars == sorted(set(play_text)) and tok.chars[:2] == ["\n", " "]
    assert tok.encode("\n T") == [0, 1, tok.chars.index("T")]
    sample = play_text[:500]
    assert tok.decode(tok.encode(sample)) == sample


def test_char_eot_is_last_id_only_when_asked():
    tok = build_char_tokenizer(["abc", "cab d"], with_eot=True)
    assert tok.chars == [" ", "a", "b", "c", "d"]
    assert (tok.vocab_size, tok.eot_id) == (6, 5)
    assert tok.encode("ab<|endoftext|>d") == [1, 2, 5, 4]
    assert tok.decode([1, 5, 4]) == "a<|endoftext|>d"
    with pytest.raises(GptkilnError, match="'<'"):
        tok.encode_ordinary_batch(["a<|endoftext|>"])  # ordinary: '<' is just an unknown char


def test_char_unknown_character_names_it():
    tok = build_char_tokenizer(["hello"], with_eot=False)
    with pytest.raises(GptkilnError, match=r"'z'.*characters the corpus had not"):
        tok.encode("hez")  # past the largest known code point
    with pytest.raises(GptkilnError, match=r"'b' \(U\+0062\)"):
        tok.encode("heb")  # between known code points
    with pytest.raises(GptkilnError, match="U\\+1F600"):
        tok.encode_ordinary_batch(["hello", "h\U0001f600"])
    assert tok.encode("") == []


def test_bpe_trains_saves_and_reloads_identically(tmp_path, play_text):
    tok = train_bpe_tokenizer([play_text], 400)
    assert isinstance(tok, BPETokenizer)
    assert tok.vocab_size == 400 and tok.eot_id == 0
    sample = "THESEUS: Now, fair Hippolyta, our nuptial hour<|endoftext|>Bonjour, ça va?"
    ids = tok.encode(sample)
    assert 0 in ids and tok.decode(ids) == sample
    tok.save(tmp_path)
    assert json.loads((tmp_path / "tokenizer_meta.json").read_text()) == {
        "kind": "bpe",
        "vocab_size": 400,
        "eot_id": 0,
    }
    assert (tmp_path / "tokenizer.json").is_file()
    again = load_tokenizer(tmp_path)
    assert isinstance(again, BPETokenizer)
    assert again.encode(sample) == ids
    assert again.encode_ordinary_batch([sample]) == tok.encode_ordinary_batch([sample])
    assert 0 not in again.encode_ordinary_batch([sample])[0]


def test_bpe_round_trips_chinese(chinese_bpe):
    sentence = "今天我们在公园里学习语言，孩子们喜欢喝茶。"
    ids = chinese_bpe.encode(sentence)
    assert chinese_bpe.decode(ids) == sentence
    # Merges learned on Chinese: far fewer ids than the sentence's UTF-8 bytes.
    assert len(ids) < len(sentence.encode("utf-8")) / 2
    unseen = "火星上的企鹅 🐧"  # characters never seen in training still round-trip (bytes)
    assert chinese_bpe.decode(chinese_bpe.encode(unseen)) == unseen


MIXED_TEXT = "Naïve café — 日本語 is 🐧 and 🙂,\nsaid Ægir. <|endoftext|> Ünïcödé ok"


def _counted(tok, ids) -> int:
    return int(tok.char_counts()[ids].sum())


@pytest.mark.parametrize("kind", ["gpt2", "char", "bpe"])
def test_char_counts_add_up_to_the_decoded_characters(kind, gpt2, chinese_bpe):
    """Each id counts the characters whose first byte it holds, so any run of ids that starts
    and ends between characters counts its decoded text exactly, also where byte-level ids cut
    a character in pieces (the penguin and the smiley are several GPT-2 ids each);
    <|endoftext|> counts one."""
    if kind == "gpt2":
        tok = gpt2
    elif kind == "char":
        tok = build_char_tokenizer([MIXED_TEXT], with_eot=True)
    else:
        tok = chinese_bpe
    counts = tok.char_counts()
    assert counts.shape == (tok.vocab_size,) and counts.dtype.kind == "i"
    assert counts[tok.eot_id] == 1
    ids = tok.encode(MIXED_TEXT)
    eot = "<|endoftext|>"
    assert _counted(tok, ids) == len(MIXED_TEXT) - len(eot) + 1
    for part in MIXED_TEXT.split(eot):
        assert _counted(tok, tok.encode(part)) == len(part)
    cut = [i for i in range(1, len(ids)) if "\ufffd" in tok.decode(ids[:i])]
    if kind == "gpt2":
        assert cut  # some ids end inside a character
    for i in cut:  # the two sides of the cut still add up to every character once
        assert _counted(tok, ids[:i]) + _counted(tok, ids[i:]) == _counted(tok, ids)
    if kind == "char":
        assert set(counts.tolist()) == {1}


def test_char_counts_of_a_bpe_count_its_merged_tokens():
    tok = train_bpe_tokenizer(["the cat sat on the mat, the end " * 20], 300)
    ids = tok.encode("the cat")
    assert len(ids) < len("the cat")  # merged: some ids hold several characters
    assert [int(tok.char_counts()[i]) for i in ids] == [len(tok.decode([i])) for i in ids]
    assert _counted(tok, ids) == len("the cat")


def test_bpe_rejects_too_small_vocab():
    with pytest.raises(GptkilnError, match="at least 257"):
        train_bpe_tokenizer(["abc"], 100)


@pytest.mark.parametrize("kind", ["gpt2", "char"])
def test_save_and_load_gpt2_and_char(tmp_path, kind, gpt2):
    tok = gpt2 if kind == "gpt2" else build_char_tokenizer(["hello world"], with_eot=True)
    tok.save(tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == (
        ["tokenizer_meta.json"] if kind == "gpt2" else ["char_vocab.json", "tokenizer_meta.json"]
    )
    again = load_tokenizer(tmp_path)
    assert type(again) is type(tok)
    assert (again.vocab_size, again.eot_id) == (tok.vocab_size, tok.eot_id)
    assert again.encode("hello<|endoftext|>world") == tok.encode("hello<|endoftext|>world")


def test_load_tokenizer_from_folder_without_files_says_what_is_expected(tmp_path):
    with pytest.raises(GptkilnError, match="tokenizer_meta.json.*char_vocab.json.*tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(GptkilnError, match="not a directory"):
        load_tokenizer(tmp_path / "nope")


def test_load_tokenizer_detects_mixed_files(tmp_path):
    build_char_tokenizer(["abc"], with_eot=False).save(tmp_path)
    meta = json.loads((tmp_path / "tokenizer_meta.json").read_text())
    for wrong in ({"vocab_size": 99}, {"eot_id": 0}):
        (tmp_path / "tokenizer_meta.json").write_text(json.dumps({**meta, **wrong}))
        with pytest.raises(GptkilnError, match="mixes two tokenizers"):
            load_tokenizer(tmp_path)


def test_char_without_eot_saves_and_loads_without_one(tmp_path):
    tok = build_char_tokenizer(["hello world"], with_eot=False)
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.eot_id is None and again.vocab_size == tok.vocab_size == len(set("hello world"))


@pytest.mark.parametrize("bad", [2, 99, -1])
def test_char_decode_refuses_ids_outside_its_vocabulary(bad):
    tok = build_char_tokenizer(["ab"], with_eot=False)
    assert tok.decode([0, 1]) == "ab"
    with pytest.raises(GptkilnError, match="outside its vocabulary"):
        tok.decode([bad])


@pytest.mark.parametrize("past", [0, 5, -2])
def test_bpe_and_gpt2_decode_refuse_ids_outside_their_vocabulary(gpt2, chinese_bpe, past):
    """As the char tokenizer: one line, not tiktoken's KeyError or an id Hugging Face's decode
    drops unsaid."""
    for tok in (gpt2, chinese_bpe):
        bad = past if past < 0 else tok.vocab_size + past
        assert tok.decode([tok.vocab_size - 1]) == tok.decode([tok.vocab_size - 1])  # in range
        said = f"id {bad} is (outside its vocabulary of |not one of its ){tok.vocab_size}"
        with pytest.raises(GptkilnError, match=said):
            tok.decode([1, bad])
    with pytest.raises(GptkilnError, match="id 1.5 is not one of its 50257 ids"):
        gpt2.decode([1, 1.5])


def test_train_bpe_tokenizer_takes_one_text_as_one_document(play_text):
    """A str is one text, not an iterable of one-character documents (257 ids, no merges)."""
    text = play_text[:20_000]
    assert train_bpe_tokenizer(text, 400).vocab_size == train_bpe_tokenizer([text], 400).vocab_size
    assert train_bpe_tokenizer(text, 400).vocab_size > 257


def test_char_tokenizer_rejects_unsorted_vocab():
    with pytest.raises(GptkilnError, match="sorted"):
        CharTokenizer(["b", "a"], with_eot=False)


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("gpt2", ("gpt2", None)),
        ("char", ("char", None)),
        ("bpe", ("bpe", DEFAULT_BPE_VOCAB_SIZE)),
        ("bpe:8000", ("bpe", 8000)),
    ],
)
def test_parse_tokenizer_spec(spec, expected):
    assert parse_tokenizer_spec(spec) == expected


@pytest.mark.parametrize("spec", ["gpt3", "bpe:", "bpe:lots", "char:10", ""])
def test_parse_tokenizer_spec_lists_choices(spec):
    with pytest.raises(GptkilnError, match="choose gpt2, char, bpe or bpe:N"):
        parse_tokenizer_spec(spec)


def test_a_fingerprint_tells_apart_what_kind_and_size_do_not(tmp_path):
    abc, xyz = CharTokenizer(list("abc"), with_eot=True), CharTokenizer(list("xyz"), with_eot=True)
    assert abc.vocab_size == xyz.vocab_size and abc.fingerprint() != xyz.fingerprint()
    texts = ["the cat sat on the mat", "a dog ran in the fog", "to be or not to be"] * 20
    one = train_bpe_tokenizer(texts, vocab_size=300)
    two = train_bpe_tokenizer([t[::-1] for t in texts], vocab_size=300)
    assert one.fingerprint() != two.fingerprint()
    for tok in (abc, one, load_tokenizer("gpt2")):  # saved and loaded: the same tokenizer
        tok.save(tmp_path / tok.kind)
        assert load_tokenizer(tmp_path / tok.kind).fingerprint() == tok.fingerprint()


def test_a_bpe_size_is_ascii_digits_within_what_the_trainer_can_hold():
    # '²' passes str.isdigit() and int() refuses it; 2**31 ids made the Rust trainer abort
    # trying to allocate 141 GB.
    with pytest.raises(GptkilnError, match="choose gpt2, char, bpe or bpe:N"):
        parse_tokenizer_spec("bpe:²")
    for size in ("256", "2147483648", "99999999999999999999"):
        with pytest.raises(GptkilnError, match="257 to 1,048,576 ids"):
            parse_tokenizer_spec(f"bpe:{size}")
    assert parse_tokenizer_spec("bpe:257") == ("bpe", 257)
    assert parse_tokenizer_spec("bpe:1048576") == ("bpe", 1 << 20)


def test_bpe_arrays_in_slices_are_the_plain_batch(chinese_bpe, monkeypatch):
    import gptkiln.tokenizers.bpe

    texts = [f"{i}: to be, or not to be. " * 140 for i in range(20)] + ["", "天气很好", "a"]
    plain = chinese_bpe.encode_ordinary_batch(texts)
    calls = []
    real = chinese_bpe._hf_plain.encode_batch_fast
    monkeypatch.setattr(gptkiln.tokenizers.bpe, "BPE_SLICE_CHARS", 10_000)
    monkeypatch.setattr(gptkiln.tokenizers.bpe.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(
        chinese_bpe, "_hf_plain", type("Hf", (), {"encode_batch_fast": lambda self, t, **kw: (
            calls.append(len(t)), real(t, **kw))[1]})(),
    )  # fmt: skip
    arrays = chinese_bpe.encode_ordinary_batch_arrays(texts)
    assert [a.tolist() for a in arrays] == plain
    assert calls == [4, 4, 4, 4, 4, 3]  # 4 x ~3,000 characters pass 10,000; 2 texts a core


@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_a_runs_missing_tokenizer_file_is_told_where_its_copy_is(tmp_path, kind):
    """A run directory keeps its tokenizer's files beside config.json, copied from its
    prepared data: a lost one is restored from there, not by `gptkiln prepare` (the fix a
    prepared-data folder's own lost file gets)."""
    text = "To be, or not to be,\nthat is the question.\n" * 20
    if kind == "bpe":
        tokenizer, name = train_bpe_tokenizer([text], 300), "tokenizer.json"
    else:
        tokenizer, name = build_char_tokenizer([text], with_eot=True), "char_vocab.json"
    run = tmp_path / "run"
    for folder in (run, run / "data"):
        tokenizer.save(folder)
    (run / "config.json").write_text("{}")
    (run / name).unlink()
    copy = re.escape(f"holds the copy training saved it from, {run / 'data' / name}")
    with pytest.raises(GptkilnError, match=copy):
        load_tokenizer(run)
    (run / "data" / name).unlink()
    with pytest.raises(GptkilnError, match=r"re-run `gptkiln prepare`$"):
        load_tokenizer(run / "data")
