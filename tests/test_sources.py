"""Sources beyond plain text: compressed files, JSON arrays, Parquet, Hugging Face datasets, and
the text field; each read as exactly the documents it holds, each damage refused in one line.

The reference for every format is the same documents in a plain ``.jsonl`` file (tested since the
first prepare): each format must give the same documents, and the same prepared ids.
No test touches the network: sockets are closed to these tests, and the Hub is offline.
"""

import gzip
import json
import re
import socket
import sys
from pathlib import Path

import pytest
from test_cli import cli

from gptkiln.data import check_source, iter_documents, iter_pieces, prepare, source_checksums
from gptkiln.data.hub import DatasetSpec, parse_hf_spec
from gptkiln.errors import GptkilnError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")

# Documents with what breaks readers: an empty one (skipped), non-ASCII, a newline, a quote, a
# long one (several pieces at piece_chars=64), a lone "<|endoftext|>" that stays text.
DOCS = [
    "To be, or not to be: that is the question.",
    "",
    'Ünïcödé — 天气很好, emoji 🙂 and a "quote"\nover two lines',
    "word " * 60 + "end",
    "a literal <|endoftext|> is ordinary text",
    *[f"Document {i}: the quick brown fox {i % 7} jumps." for i in range(40)],
]
KEPT = [d for d in DOCS if d]


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Every connection attempt fails at once, as on a machine without network."""

    def refuse(*args, **kwargs):
        raise OSError("network is disabled in the tests")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def jsonl_bytes(docs, field="text"):
    return "".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)).encode()


def write_parquet(path, docs, field="text", row_group_size=8, **columns):
    table = pa.table({field: docs, "id": list(range(len(docs))), **columns})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def save_dataset(path, docs, field="text", splits=None):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    dataset = datasets.Dataset.from_dict({field: docs, "n": list(range(len(docs)))})
    if splits:
        datasets.DatasetDict({s: dataset.select(range(k)) for s, k in splits.items()}).save_to_disk(
            str(path)
        )
    else:
        dataset.save_to_disk(str(path))
    return path


def make(tmp_path: Path, kind: str) -> str:
    """The documents `DOCS` as a source of format ``kind``; returns the source."""
    if kind == "jsonl":
        (tmp_path / "d.jsonl").write_bytes(jsonl_bytes(DOCS))
    elif kind == "jsonl.gz":
        (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(DOCS)))
    elif kind == "jsonl.zst":
        data = zstandard.ZstdCompressor().compress(jsonl_bytes(DOCS))
        (tmp_path / "d.jsonl.zst").write_bytes(data)
    elif kind == "json":
        (tmp_path / "d.json").write_text(json.dumps([{"text": d} for d in DOCS], indent=1))
    elif kind == "json.gz (JSON lines, as C4)":
        (tmp_path / "d.json.gz").write_bytes(gzip.compress(jsonl_bytes(DOCS)))
        return str(tmp_path / "d.json.gz")
    elif kind == "parquet":
        write_parquet(tmp_path / "d.parquet", DOCS)
    elif kind == "parquet shards":
        (tmp_path / "shards").mkdir()
        for i in range(3):  # sorted by name: 00000, 00001, 00002
            part = DOCS[i * 16 : (i + 1) * 16]
            write_parquet(tmp_path / "shards" / f"train-{i:05d}-of-00003.parquet", part)
        return str(tmp_path / "shards")
    elif kind == "save_to_disk":
        return str(save_dataset(tmp_path / "saved", DOCS))
    elif kind == "save_to_disk split":
        return (
            f"hf:{save_dataset(tmp_path / 'dd', DOCS, splits={'train': 3, 'test': len(DOCS)})}@test"
        )
    elif kind == "hf: local folder":
        pytest.importorskip("datasets")
        (tmp_path / "ds" / "data").mkdir(parents=True)
        (tmp_path / "ds" / "data" / "train-00000.jsonl").write_bytes(jsonl_bytes(DOCS))
        (tmp_path / "ds" / "data" / "test-00000.jsonl").write_bytes(jsonl_bytes(["other"]))
        return f"hf:{tmp_path / 'ds'}"
    else:
        raise AssertionError(kind)
    return str(tmp_path / f"d.{kind}")


KINDS = [
    "jsonl",
    "jsonl.gz",
    "jsonl.zst",
    "json",
    "json.gz (JSON lines, as C4)",
    "parquet",
    "parquet shards",
    "save_to_disk",
    "save_to_disk split",
    "hf: local folder",
]


@pytest.mark.parametrize("kind", KINDS)
def test_every_format_gives_the_documents_it_holds(tmp_path, kind):
    source = make(tmp_path, kind)
    assert list(iter_documents(source)) == KEPT
    pieces = list(iter_pieces(source, piece_chars=64))
    assert [starts for starts, _ in pieces].count(True) == len(KEPT)
    assert max(len(t) for _, t in pieces) <= 64


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "jsonl"])
def test_every_format_prepares_the_ids_of_the_same_jsonl(tmp_path, kind):
    reference = prepare(make(tmp_path, "jsonl"), tmp_path / "ref", "gpt2", progress=False)
    source = make(tmp_path, kind)
    meta = prepare(source, tmp_path / "out", "gpt2", progress=False)
    for split in ("train", "val"):
        assert (tmp_path / "out" / f"{split}.bin").read_bytes() == (
            tmp_path / "ref" / f"{split}.bin"
        ).read_bytes()
    assert meta["documents"] == reference["documents"] == len(KEPT)
    assert meta["checksums"] == source_checksums(source)  # what train compares to reuse it


def test_text_files_compressed_read_like_open(tmp_path):
    raw = b"\xef\xbb\xbfline one\r\nline two\r\n" + b"word " * 50_000
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "b.md.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    (tmp_path / "c.txt").write_bytes(raw)
    with open(tmp_path / "c.txt", encoding="utf-8-sig") as f:
        expected = f.read()
    for name in ("a.txt.gz", "b.md.zst"):
        assert list(iter_documents(tmp_path / name)) == [expected]
        assert len(list(iter_pieces(tmp_path / name, piece_chars=4096))) > 10


def test_a_multi_frame_zstd_file_reads_every_frame(tmp_path):
    frames = [zstandard.ZstdCompressor().compress(jsonl_bytes(DOCS[i::2])) for i in (0, 1)]
    (tmp_path / "d.jsonl.zst").write_bytes(b"".join(frames))
    assert list(iter_documents(tmp_path / "d.jsonl.zst")) == [
        d for d in DOCS[0::2] + DOCS[1::2] if d
    ]


def test_a_large_json_array_streams_through_a_small_buffer(tmp_path, monkeypatch):
    import gptkiln.data.records

    monkeypatch.setattr(gptkiln.data.records, "_READ_CHARS", 16)  # elements span many reads
    (tmp_path / "d.json").write_text(json.dumps([{"text": d} for d in DOCS]))
    assert list(iter_documents(tmp_path / "d.json")) == KEPT
    (tmp_path / "empty.json").write_text(" [ ] ")
    with pytest.raises(GptkilnError, match="source has no text at all"):
        list(iter_documents(tmp_path / "empty.json"))


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"text": "a"} {"text": "b"}', "line 1: not valid JSON"),
        ('{\n  "text": "a"\n}\n', "holds one JSON object, not records"),  # pretty-printed
        (
            '[{"text": "a"}, {"text": 3}]',
            'element 2: no string "text" field (keys: text); "text" holds a number',
        ),
        ('[{"text": "a"} {"text": "b"}]', "element 1: expected ',' or ']' after it"),
        ('[{"text": "a"}, {"text": ', "element 2: not valid JSON"),
        ('[{"text": "a"}] extra', "text after the JSON array's closing ']'"),
        ('"just a string"', "expected a JSON array of records"),
        ('["a string"]', 'element 1: expected a JSON object with a string "text" field, got a str'),
    ],
)
def test_json_file_errors_name_the_element(tmp_path, content, message):
    path = tmp_path / "d.json"
    path.write_text(content)
    with pytest.raises(GptkilnError, match=re.escape(f"{path}") + ".*" + re.escape(message)):
        list(iter_documents(path))


def test_text_field_reads_another_key_or_column_and_names_the_ones_there_are(tmp_path):
    (tmp_path / "d.jsonl").write_bytes(jsonl_bytes(DOCS, field="content"))
    write_parquet(tmp_path / "d.parquet", DOCS, field="content")
    for name in ("d.jsonl", "d.parquet"):
        assert list(iter_documents(tmp_path / name, text_field="content")) == KEPT
    with pytest.raises(GptkilnError, match=r'line 1: no string "text" field \(keys: content, id\)'):
        list(iter_documents(tmp_path / "d.jsonl"))
    with pytest.raises(GptkilnError, match="--text-field"):
        list(iter_documents(tmp_path / "d.jsonl"))
    with pytest.raises(GptkilnError, match=r'no column "text" \(columns: content, id\)'):
        check_source(tmp_path / "d.parquet")  # before any reading
    write_parquet(tmp_path / "n.parquet", DOCS, score=[0.5] * len(DOCS))
    with pytest.raises(GptkilnError, match=r'n.parquet: column "score" holds double, not text'):
        check_source(tmp_path / "n.parquet", text_field="score")
    with pytest.raises(GptkilnError, match=r'column "id" holds int64, not text'):
        prepare(tmp_path / "n.parquet", tmp_path / "out", "gpt2", text_field="id", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_saved_dataset_refuses_a_missing_split_or_column(tmp_path):
    saved = save_dataset(tmp_path / "dd", DOCS, splits={"train": 5, "validation": 2})
    assert list(iter_documents(saved)) == KEPT[:4]  # train by default (DOCS[1] is empty)
    assert list(iter_documents(f"hf:{saved}@validation")) == KEPT[:1]
    with pytest.raises(GptkilnError, match=r"no split 'test' in .*\(splits: train, validation\)"):
        check_source(f"hf:{saved}@test")
    with pytest.raises(GptkilnError, match=r'no column "body" \(columns: text, n\)'):
        check_source(saved, text_field="body")
    with pytest.raises(GptkilnError, match=r'column "n" holds int64, not text'):
        list(iter_documents(saved, text_field="n"))


def test_folders_read_every_format_in_name_order_and_checksum_each_file(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(["one"])))
    write_parquet(tmp_path / "b" / "c.parquet", ["two", "three"])
    (tmp_path / "b" / "d.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(b"four"))
    (tmp_path / "e.parquet.gz").write_bytes(b"not read: Parquet compresses itself")
    assert list(iter_documents(tmp_path)) == ["one", "two", "three", "four"]
    assert list(source_checksums(tmp_path)) == ["a.jsonl.gz", "b/c.parquet", "b/d.txt.zst"]
    with pytest.raises(GptkilnError, match=r"unsupported file type '.parquet.gz'"):
        check_source(tmp_path / "e.parquet.gz")


def test_a_bpe_prepare_counts_and_trains_in_one_read(tmp_path, monkeypatch):
    module = sys.modules["gptkiln.data.prepare"]  # gptkiln.data.prepare is also the function
    reads = []
    real = module.iter_pieces

    def counted(*args, **kwargs):
        reads.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "iter_pieces", counted)
    source = write_parquet(tmp_path / "d.parquet", DOCS)
    meta = prepare(source, tmp_path / "out", "bpe:300", 0.3, progress=False)
    assert len(reads) == 2  # count and train the BPE, then encode (a hub dataset: two downloads)
    text = "\n".join(KEPT)  # documents joined by one separator each, counted as one character
    assert meta["characters"] == len(text) - (len(KEPT) - 1)
    assert meta["train_characters"] + meta["val_characters"] == len(text)


def test_a_bpe_learns_from_the_first_bytes_of_the_text_and_says_so(tmp_path, capsys):
    """`prepare`'s BPE sample: the trainer reads only the first ``bpe_sample_bytes`` (a word
    that is only past them gets no merge), while the split and the encoding read everything;
    meta.json records what the BPE took, and a note says where that was not all."""
    from gptkiln.data import load_prepared

    first = "".join(f"alpha beta gamma {i}\n" for i in range(300))
    later = "zyxwvuts qponmlk " * 400
    source = tmp_path / "t.txt"
    source.write_text(first + later)
    meta = prepare(source, tmp_path / "cut", "bpe:400", progress=False, bpe_sample_bytes=3000)
    assert meta["bpe_sample_bytes"] == 3000 and meta["characters"] == len(first + later)
    assert "learned from the first 3,000 bytes of" in capsys.readouterr().err
    cut = load_prepared(tmp_path / "cut").tokenizer
    whole = prepare(source, tmp_path / "whole", "bpe:400", progress=False, bpe_sample_bytes=None)
    assert whole["bpe_sample_bytes"] == len(first + later) and capsys.readouterr().err == ""
    tok = load_prepared(tmp_path / "whole").tokenizer
    assert len(tok.encode(" zyxwvuts")) == 1 and len(cut.encode(" zyxwvuts")) > 3
    assert len(cut.encode(" gamma")) == 1  # learned from what it read
    with pytest.raises(GptkilnError, match="bpe_sample_bytes 0"):
        prepare(source, tmp_path / "x", "bpe:400", progress=False, bpe_sample_bytes=0)


def test_a_bpe_that_runs_out_of_pairs_before_its_size_says_so(tmp_path, capsys):
    """Ten Chinese sentences repeated: each sentence up to its punctuation mark is one word,
    so the BPE stops merging long before bpe:2000; the note says what it gave, and why."""
    sentences = ["今天天气很好，我们去公园散步吧。", "机器学习是人工智能的一个分支。"] * 5
    source = tmp_path / "zh.txt"
    source.write_text("".join(sentences * 40), encoding="utf-8")
    meta = prepare(source, tmp_path / "out", "bpe:2000", progress=False)
    err = capsys.readouterr().err
    assert meta["vocab_size"] < 2000
    assert f"note: bpe:2000 gave {meta['vocab_size']:,} ids" in err
    assert f"ask for bpe:{meta['vocab_size']}" in err
    prepare(source, tmp_path / "again", f"bpe:{meta['vocab_size']}", progress=False)
    assert "gave" not in capsys.readouterr().err  # as many as asked: no note


# -------------------------------------------------------------------------------- bad input


def test_a_truncated_parquet_file_is_refused_before_reading(tmp_path):
    whole = write_parquet(tmp_path / "whole.parquet", DOCS).read_bytes()
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(
        GptkilnError, match=r"cut.parquet: not a readable Parquet file .* truncated"
    ):
        check_source(cut)
    with pytest.raises(GptkilnError, match="not a readable Parquet file"):
        prepare(cut, tmp_path / "out", "gpt2", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("compression", ["gz", "zst"])
def test_a_compressed_file_cut_short_fails_and_leaves_nothing(tmp_path, compression):
    data = jsonl_bytes(DOCS * 200)
    packed = gzip.compress(data) if compression == "gz" else zstandard.compress(data)
    path = tmp_path / f"d.jsonl.{compression}"
    path.write_bytes(packed[: len(packed) * 3 // 4])
    out = tmp_path / "out"
    prepare(make(tmp_path, "jsonl"), out, "gpt2", progress=False)  # earlier data stays intact
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(GptkilnError, match=rf"d.jsonl.{compression}: .* cut short.*again"):
        prepare(path, out, "gpt2", progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_not_compressed_data_under_a_compressed_name(tmp_path):
    (tmp_path / "a.txt.gz").write_bytes(b"plain text, not gzip")
    (tmp_path / "b.txt.zst").write_bytes(b"plain text, not zstd")
    with pytest.raises(GptkilnError, match="a.txt.gz: not valid gzip data"):
        check_source(tmp_path / "a.txt.gz")
    with pytest.raises(GptkilnError, match="b.txt.zst: not valid Zstandard data"):
        check_source(tmp_path / "b.txt.zst")


def test_bad_bytes_inside_a_compressed_file_are_found_at_their_offset(tmp_path):
    (tmp_path / "l.txt.gz").write_bytes(gzip.compress("é".encode() * 300_000 + b"\xff"))
    with pytest.raises(GptkilnError, match=r"not UTF-8 \(invalid byte at offset 600000\)"):
        list(iter_documents(tmp_path / "l.txt.gz"))
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.compress(b'{"text": "a"}\n\x00\x01'))
    with pytest.raises(GptkilnError, match=r"binary file \(NUL byte at offset 14\)"):
        list(iter_documents(tmp_path / "b.jsonl.zst"))


def test_optional_libraries_missing_each_give_one_line(tmp_path, monkeypatch):
    write_parquet(tmp_path / "d.parquet", DOCS)
    saved = save_dataset(tmp_path / "saved", DOCS)
    (tmp_path / "d.jsonl.zst").write_bytes(zstandard.compress(jsonl_bytes(DOCS)))
    for name in ("datasets", "pyarrow", "pyarrow.parquet", "pyarrow.ipc", "zstandard"):
        monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ImportError
    cases = [
        ("hf:roneneldan/TinyStories", "needs the datasets package; pip install 'gptkiln[corpora]'"),
        (f"hf:{tmp_path}", "needs the datasets package"),
        (tmp_path / "d.parquet", "needs the pyarrow package"),
        (saved, "needs the pyarrow package"),
        (tmp_path / "d.jsonl.zst", "needs the zstandard package"),
    ]
    for source, message in cases:
        with pytest.raises(GptkilnError, match=re.escape(message)):
            check_source(source)
            list(iter_documents(source))


def test_a_hub_dataset_without_network_is_one_line(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    import huggingface_hub.constants

    from gptkiln.data import hub

    hub.hub_revision.cache_clear()
    for offline in (True, False):  # offline mode, and a machine whose connections all fail
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)
        with pytest.raises(
            GptkilnError, match=r"hf:someone/corpus: cannot reach it on the Hugging Face Hub"
        ) as e:
            prepare("hf:someone/corpus:en@train", tmp_path / "out", "gpt2", progress=False)
        assert "\n" not in str(e.value)
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "spec, parsed",
    [
        ("hf:roneneldan/TinyStories", DatasetSpec("roneneldan/TinyStories")),
        (
            "hf:HuggingFaceFW/fineweb-edu:sample-10BT",
            DatasetSpec("HuggingFaceFW/fineweb-edu", "sample-10BT"),
        ),
        (
            "hf:wikimedia/wikipedia:20231101.en@train",
            DatasetSpec("wikimedia/wikipedia", "20231101.en", "train"),
        ),
        ("hf:/data/my corpus@validation", DatasetSpec("/data/my corpus", None, "validation")),
        ("hf:./local:plain", DatasetSpec("./local", "plain")),
    ],
)
def test_hf_names_parse_into_name_config_and_split(spec, parsed):
    assert parse_hf_spec(spec) == parsed
    assert str(parsed) == spec


@pytest.mark.parametrize("spec", ["hf:", "hf:name@", "hf:name:", "hf:@train"])
def test_malformed_hf_names_are_refused(spec):
    with pytest.raises(GptkilnError, match="not a dataset name; write hf:NAME"):
        parse_hf_spec(spec)


def test_a_large_parquet_file_streams_in_bounded_memory(tmp_path):
    import tracemalloc

    doc = "The quick brown fox jumps over the lazy dog; ALL: amen! " * 40
    rows = 20_000_000 // len(doc)  # 20 MB of text in row groups of 1,000 rows
    group = pa.table({"text": [doc] * 1000})
    with pq.ParquetWriter(tmp_path / "big.parquet", group.schema) as writer:
        for _ in range(rows // 1000):
            writer.write_table(group)
    rows = rows // 1000 * 1000
    pool = pa.proxy_memory_pool(pa.default_memory_pool())  # counts this prepare's Arrow memory
    previous = pa.default_memory_pool()
    pa.set_memory_pool(pool)
    tracemalloc.start()
    try:
        meta = prepare(tmp_path / "big.parquet", tmp_path / "out", "char", 0.1234,
                       progress=False, batch_chars=1 << 18)  # fmt: skip
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        pa.set_memory_pool(previous)
    assert meta["documents"] == rows  # the split cuts a document: every separator is kept
    assert meta["train_tokens"] + meta["val_tokens"] == rows * (len(doc) + 1) - 1
    assert peak < 12_000_000, f"Python peak {peak / 1e6:.1f} MB while preparing 20 MB"
    assert 0 < pool.max_memory() < 12_000_000, f"Arrow peak {pool.max_memory() / 1e6:.1f} MB"


# ---------------------------------------------------------------------------------- the CLI


def test_bad_corpora_through_prepare_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    whole = write_parquet(tmp_path / "whole.parquet", DOCS).read_bytes()
    (tmp_path / "cut.parquet").write_bytes(whole[:-100])
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(DOCS * 50))[:-40])
    write_parquet(tmp_path / "ok.parquet", DOCS)
    monkeypatch.setitem(sys.modules, "datasets", None)
    cases = [
        ("cut.parquet", "not a readable Parquet file"),
        ("cut.jsonl.gz", "gzip data cut short"),
        ("hf:roneneldan/TinyStories", "needs the datasets package"),
    ]
    out = tmp_path / "out"
    for source, needle in cases:
        source = source if source.startswith("hf:") else tmp_path / source
        code, stdout, err = cli("prepare", source, "--out", out, "--quiet", capsys=capsys)
        assert code == 2, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert needle in err
        assert not (out / "train.bin").exists()
    code, stdout, err = cli("prepare", tmp_path / "ok.parquet", "--out", out, "--tokenizer",
                            "gpt2", "--quiet", capsys=capsys)  # fmt: skip
    assert code == 0, err
    assert "wrote" in stdout and (out / "meta.json").is_file()


def test_the_text_field_flag_through_prepare(tmp_path, capsys):
    (tmp_path / "d.jsonl").write_bytes(jsonl_bytes(DOCS, field="content"))
    write_parquet(tmp_path / "d.parquet", DOCS, field="content")
    for name in ("d.jsonl", "d.parquet"):
        out = tmp_path / f"out-{name}"
        code, _, err = cli("prepare", tmp_path / name, "--text-field", "content", "--tokenizer",
                           "gpt2", "--out", out, "--quiet", capsys=capsys)  # fmt: skip
        assert code == 0, err
        assert json.loads((out / "meta.json").read_text())["text_field"] == "content"
        code, _, err = cli("prepare", tmp_path / name, "--out", tmp_path / "no", capsys=capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "content, id" in err and "--text-field" in err
        assert not (tmp_path / "no").exists()


def test_a_hub_dataset_is_streamed_at_its_pinned_revision(monkeypatch):
    datasets = pytest.importorskip("datasets")
    from gptkiln.data import hub

    calls = []

    class Stream:
        def __init__(self, fail_after=None):
            self.fail_after = fail_after

        def iter(self, batch_size):
            yield {"text": KEPT[:3], "id": [0, 1, 2]}
            if self.fail_after:
                raise ConnectionError("Read timed out.\nsecond line")
            yield {"text": [None, *KEPT[3:]], "id": list(range(3, len(KEPT) + 1))}

    def load_dataset(name, config, **kwargs):
        calls.append((name, config, kwargs))
        return Stream(fail_after="cut" in name)

    monkeypatch.setattr(hub, "hub_revision", lambda name: "0123abc")
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    spec = "hf:org/corpus:en@validation"
    assert list(iter_documents(spec)) == KEPT
    assert calls == [
        ("org/corpus", "en", {"split": "validation", "streaming": True, "revision": "0123abc"})
    ]
    assert source_checksums(spec) == {spec: "revision 0123abc"}
    with pytest.raises(GptkilnError, match=r"hf:org/cut: cannot load it with datasets "
                       r"\(ConnectionError: Read timed out.\); .* and the network$"):  # fmt: skip
        list(iter_documents("hf:org/cut"))
    with pytest.raises(GptkilnError, match=r'no column "body" \(columns: text, id\)'):
        list(iter_documents(spec, text_field="body"))


def test_train_reads_its_text_field_and_prepares_again_when_it_changes(tmp_path, capsys):
    (tmp_path / "d.parquet").unlink(missing_ok=True)
    write_parquet(tmp_path / "d.parquet", DOCS * 20, field="content")
    run = tmp_path / "run"
    common = ("train", "--data", tmp_path / "d.parquet", "--out", run, "--model", "tiny",
              "--tokenizer", "gpt2", "--max-steps", 1, "--batch-size", 2, "--context-length", 16,
              "--eval-interval", 1, "--eval-batches", 1, "--no-progress")  # fmt: skip
    code, _, err = cli(*common, capsys=capsys)  # the default field, "text", is not there
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "content" in err and "--text-field" in err
    code, _, err = cli(*common, "--text-field", "content", capsys=capsys)
    assert code == 0, err
    meta = json.loads((run / "data" / "meta.json").read_text())
    assert meta["text_field"] == "content"
    from gptkiln.train import _prepared_matches

    assert _prepared_matches(run / "data", tmp_path / "d.parquet", "gpt2", 0.1, "content")
    assert not _prepared_matches(run / "data", tmp_path / "d.parquet", "gpt2", 0.1, "text")


def test_a_folder_gptkiln_wrote_is_not_read_as_text(tmp_path):
    """Prepared data, a damaged one, or a run: their JSON and tokenizer files were read as
    documents ("char_vocab.json line 1: no text field"); each is now named for what it is."""
    from gptkiln.data import prepare
    from gptkiln.errors import GptkilnError

    text = tmp_path / "a.txt"
    text.write_text("to be or not to be\n" * 40)
    prepare(text, tmp_path / "data", "char", progress=False)
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "train.bin").write_bytes((tmp_path / "data" / "train.bin").read_bytes())
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "model.safetensors").write_bytes(b"")
    (run / "char_vocab.json").write_text('{"chars": ["a"]}')
    for folder, needle in (
        (tmp_path / "data", "is prepared data, not text"),
        (damaged, r"but no meta.json \(damaged\)"),
        (run, "is a model's folder, not text"),
    ):
        with pytest.raises(GptkilnError, match=needle):
            list(iter_documents(folder))
        with pytest.raises(GptkilnError, match=needle):
            prepare(folder, tmp_path / "out", "char", progress=False)
    assert not (tmp_path / "out").exists()
