"""Weighted mixtures: members parsed and checked, documents drawn by tokens in proportion to the
weights (within one document at every point), deterministic for a seed, written exactly (each
document's ids are its own ids), recorded in meta.json, and bad weights refused in one line."""

import json
import re

import numpy as np
import pytest

from gptkiln.data import load_prepared, prepare, source_checksums
from gptkiln.data.mixture import Member, interleave, load_mixture, parse_member
from gptkiln.errors import GptkilnError
from gptkiln.tokenizers import load_tokenizer


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer("gpt2")


def corpus(tag: str, n: int) -> list[str]:
    """``n`` documents of varied length, each naming its corpus and number."""
    return [f"{tag} document {i}: " + f"{tag} words {i % 5} " * (1 + i * 7 % 11) for i in range(n)]


def write_jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({field: d}) + "\n" for d in docs), encoding="utf-8")
    return path


@pytest.fixture
def sources(tmp_path):
    """Three corpora in three formats: web (text field "content"), books, news."""
    web, books, news = corpus("web", 300), corpus("books", 120), corpus("news", 200)
    write_jsonl(tmp_path / "web.jsonl", web, field="content")
    write_jsonl(tmp_path / "books.jsonl", books)
    (tmp_path / "news").mkdir()
    write_jsonl(tmp_path / "news" / "a.jsonl", news[:100])
    write_jsonl(tmp_path / "news" / "b.jsonl", news[100:])
    return tmp_path, {"web": web, "books": books, "news": news}


# ------------------------------------------------------------------------------------ parsing


def test_entries_parse_from_strings_pairs_and_mappings():
    assert parse_member("data/web.jsonl:3") == Member("data/web.jsonl", 3.0)
    assert parse_member("hf:wikimedia/wikipedia:20231101.en@train:0.5") == Member(
        "hf:wikimedia/wikipedia:20231101.en@train", 0.5
    )
    mixture = load_mixture(
        ["a.jsonl:1", ("b.parquet", 2), {"source": "c", "weight": 1, "text_field": "body"}],
        text_field="content",
    )
    assert mixture.members == [
        Member("a.jsonl", 1.0, "content"),
        Member("b.parquet", 2.0, "content"),
        Member("c", 1.0, "body"),
    ]
    assert mixture.shares.tolist() == [0.25, 0.5, 0.25]


@pytest.mark.parametrize(
    "entry, message",
    [
        ("a.jsonl:0", "weight '0' for a.jsonl: must be above 0"),
        ("a.jsonl:-2", "weight '-2' for a.jsonl: must be above 0"),
        ("a.jsonl:nan", "weight 'nan' for a.jsonl: must be above 0"),
        ("a.jsonl:inf", "weight 'inf' for a.jsonl: must be above 0"),
        ("a.jsonl:heavy", "weight 'heavy' is not a number"),
        ("a.jsonl", "no weight"),
        ({"source": "a.jsonl"}, "expected the keys source, weight"),
        (("a.jsonl", 0), "weight 0 for a.jsonl: must be above 0"),
        (3, "not a source with a weight"),
    ],
)
def test_bad_entries_are_refused_in_one_line(entry, message):
    with pytest.raises(GptkilnError, match=re.escape(message)) as e:
        load_mixture([entry, "b.jsonl:1"])
    assert "\n" not in str(e.value) and ("SOURCE:WEIGHT" in str(e.value) or "keys" in message)


def test_a_yaml_mixture_resolves_paths_beside_it_and_refuses_what_it_cannot_read(tmp_path):
    (tmp_path / "mixes").mkdir()
    path = tmp_path / "mixes" / "mix.yaml"
    path.write_text("- ../web.jsonl:3\n- {source: hf:roneneldan/TinyStories, weight: 1}\n")
    mixture = load_mixture(path)
    assert [m.source for m in mixture.members] == [
        str(tmp_path / "mixes" / "../web.jsonl"),
        "hf:roneneldan/TinyStories",
    ]
    assert str(mixture) == str(path)
    for text, message in [
        ("{a: 1}", "a mixture is a YAML list"),
        ("[]", "a mixture is a YAML list"),
        ("- a.jsonl: 3\n  b: [", "not valid YAML"),
        ("- a.jsonl:1\n- a.jsonl:2\n", "is listed twice"),
        ("- other.yaml:1\n", "is a mixture itself"),
    ]:
        path.write_text(text)
        with pytest.raises(GptkilnError, match=re.escape(message)):
            load_mixture(path)
    with pytest.raises(GptkilnError, match="give a list of sources"):
        load_mixture([])


# ------------------------------------------------------------------------------------ drawing


def document_streams(sizes_per_member):
    """Streams of ``(starts_document, (member, document, piece), size)``, each document in two
    pieces, sizes as given."""
    return [
        iter(
            [
                (piece == 0, (member, doc, piece), size // 2 + (size % 2) * (1 - piece))
                for doc, size in enumerate(sizes)
                for piece in (0, 1)
            ]
        )
        for member, sizes in enumerate(sizes_per_member)
    ]


def test_the_draw_keeps_every_member_near_its_share_by_size():
    rng = np.random.default_rng(5)
    sizes = [rng.integers(1, 400, 2000).tolist() for _ in range(3)]
    shares = [0.5, 0.3, 0.2]
    taken, total, order = [0, 0, 0], 0, []
    largest = max(max(s) for s in sizes)
    for member, starts, payload, size in interleave(document_streams(sizes), shares, seed=1):
        order.append(payload)
        taken[member] += size
        total += size
        if starts:
            continue
        for i, share in enumerate(shares):  # after each whole document: ahead by less than one
            assert -2 * largest <= taken[i] - share * total <= largest, (i, taken, total)
    # each member's documents come whole, once each, in their own order
    for member in range(3):
        mine = [(doc, piece) for m, doc, piece in order if m == member]
        assert mine == [(d, p) for d in range(len(mine) // 2) for p in (0, 1)]
    # it ended when the member drawn ran out: the 30% member, whose corpus is the shortest for
    # its share (all three hold about the same tokens)
    drawn = [len([1 for m, _, p in order if m == i and p == 0]) for i in range(3)]
    assert max(drawn) == 2000 and min(drawn) < 2000


def test_the_draw_is_the_same_for_a_seed_and_another_for_another_seed():
    sizes = [[10] * 500, [10] * 500]

    def order(seed):
        return [p[:2] for _, _, p, _ in interleave(document_streams(sizes), [0.5, 0.5], seed)]

    assert order(3) == order(3)
    assert order(3) != order(4)
    assert sorted(order(3)) == sorted(order(4))  # the same documents, in another order


# ------------------------------------------------------------------------------------ prepare


def documents_of(data, eot_id):
    """The prepared ids as a list of documents' ids (train, then val: the split is between
    documents)."""
    ids = np.concatenate([data.train, [eot_id], data.val]).astype(np.int64)
    cuts = np.flatnonzero(ids == eot_id)
    return [part.tolist() for part in np.split(ids, cuts) if len(part)], cuts


def test_a_mixture_holds_whole_documents_drawn_by_token_weight(tmp_path, sources, gpt2):
    root, docs = sources
    mix = [
        {"source": str(root / "web.jsonl"), "weight": 3, "text_field": "content"},
        f"{root / 'books.jsonl'}:1",
        f"{root / 'news'}:2",
    ]
    meta = prepare(None, tmp_path / "out", "gpt2", mix=mix, seed=7, progress=False)
    data = load_prepared(tmp_path / "out")
    parts, _ = documents_of(data, gpt2.eot_id)
    parts = [p[1:] if p[0] == gpt2.eot_id else p for p in parts]
    texts = [gpt2.decode(p) for p in parts]
    for text, ids in zip(texts, parts):  # exact: each document's ids are its own, whole
        assert ids == gpt2.encode_ordinary_batch([text])[0]
    per_member = {tag: [t for t in texts if t.startswith(tag + " ")] for tag in docs}
    for tag, got in per_member.items():  # each member's documents, once, in order, from the start
        assert got == docs[tag][: len(got)], tag
    assert sum(map(len, per_member.values())) == len(texts) == meta["documents"]
    members = {m["source"].rsplit("/", 1)[-1]: m for m in meta["mix"]}
    total = sum(m["tokens"] for m in meta["mix"])
    longest = max(len(p) for p in parts)
    for name, weight in [("web.jsonl", 0.5), ("books.jsonl", 1 / 6), ("news", 1 / 3)]:
        assert abs(members[name]["tokens"] - weight * total) <= 2 * longest, name
    # it ended when a member drawn had run out: that one gave every document, another did not
    given = [members[name]["documents"] / len(docs[name.split(".")[0]]) for name in members]
    assert max(given) == 1 and min(given) < 1
    assert members["web.jsonl"]["text_field"] == "content"
    assert members["news"]["checksums"] == source_checksums(root / "news")
    assert meta["seed"] == 7 and meta["split"] == "documents"
    # every document's ids, a separator between two, less the one between the splits
    assert meta["train_tokens"] + meta["val_tokens"] == total + meta["documents"] - 2


def test_a_mixture_is_the_same_for_the_same_seed_and_shuffled_by_another(tmp_path, sources):
    root, _ = sources
    mix = [f"{root / 'books.jsonl'}:1", f"{root / 'news'}:1"]
    files = {}
    for name, seed in [("a", 0), ("b", 0), ("c", 1)]:
        prepare(None, tmp_path / name, "gpt2", mix=mix, seed=seed, progress=False)
        files[name] = b"".join((tmp_path / name / f).read_bytes() for f in ("train.bin", "val.bin"))
    assert files["a"] == files["b"]
    assert files["a"] != files["c"]


def test_a_mixture_splits_between_documents_near_the_fraction(tmp_path, sources, gpt2):
    root, _ = sources
    mix = [f"{root / 'books.jsonl'}:1", f"{root / 'news'}:1"]
    meta = prepare(None, tmp_path / "out", "gpt2", 0.25, mix=mix, progress=False)
    data = load_prepared(tmp_path / "out")
    assert gpt2.eot_id not in data.val[:1].tolist() and gpt2.eot_id not in data.train[-1:].tolist()
    first_val = gpt2.decode(data.val[:8].tolist())
    assert re.match(r"(books|news) document \d+: ", first_val)  # a document starts val
    chars = meta["train_characters"] + meta["val_characters"]
    assert chars == meta["characters"] - 1  # the separator between the splits is dropped
    assert abs(meta["val_characters"] / chars - 0.25) < 0.01
    assert meta["val_characters"] == sum(gpt2.char_counts()[data.val])


@pytest.mark.parametrize("kind", ["char", "bpe:400"])
def test_a_mixture_builds_char_and_bpe_tokenizers_from_the_mixed_text(tmp_path, sources, kind):
    root, docs = sources
    mix = [f"{root / 'books.jsonl'}:1", f"{root / 'news'}:1"]
    meta = prepare(None, tmp_path / "out", kind, mix=mix, progress=False)
    data = load_prepared(tmp_path / "out")
    tok = data.tokenizer
    text = tok.decode(np.concatenate([data.train, data.val]).tolist())
    assert text.startswith(("books document 0: ", "news document 0: "))
    assert meta["vocab_size"] == tok.vocab_size and tok.eot_id is not None
    assert meta["train_tokens"] + meta["val_tokens"] == len(data.train) + len(data.val)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_char_mixture_knows_the_characters_of_documents_the_draw_never_takes(tmp_path, seed):
    """Each member's next documents are encoded ahead of the draw: a character only in a
    document never drawn (here the last of b) must still be in the alphabet."""
    (tmp_path / "a.jsonl").write_text('{"text": "aaaa bbbb cccc"}\n')
    (tmp_path / "b.jsonl").write_text(
        '{"text": "xxxx yyyy zzzz"}\n{"text": "xxx"}\n{"text": "Q#!"}\n'
    )
    mix = [f"{tmp_path / 'a.jsonl'}:1", f"{tmp_path / 'b.jsonl'}:1"]
    prepare(None, tmp_path / "out", "char", 0.3, mix=mix, seed=seed, progress=False)
    assert load_prepared(tmp_path / "out").tokenizer.vocab_size > 0


def test_a_yaml_mixture_is_a_source_whose_checksums_follow_its_files(tmp_path, sources):
    root, _ = sources
    yaml_path = root / "mix.yaml"
    yaml_path.write_text("- books.jsonl:1\n- {source: web.jsonl, weight: 2, text_field: content}\n")
    meta = prepare(yaml_path, tmp_path / "out", "gpt2", progress=False)
    assert meta["source"] == str(yaml_path)
    sums = source_checksums(yaml_path)
    assert meta["checksums"] == sums  # what train compares to reuse prepared data
    assert set(sums) == {
        "mix.yaml",
        f"{root}/books.jsonl/books.jsonl",
        f"{root}/web.jsonl/web.jsonl",
    }
    write_jsonl(root / "books.jsonl", corpus("books", 121))  # a member changed: prepare again
    assert source_checksums(yaml_path) != sums
    yaml_path.write_text("- books.jsonl:2\n- {source: web.jsonl, weight: 2, text_field: content}\n")
    assert source_checksums(yaml_path)["mix.yaml"] != sums["mix.yaml"]


def test_bad_mixtures_fail_before_writing_anything(tmp_path, sources):
    root, _ = sources
    out = tmp_path / "out"
    cases = [
        ([f"{root / 'books.jsonl'}:0", f"{root / 'news'}:1"], "must be above 0"),
        ([f"{root / 'books.jsonl'}:1", f"{root / 'missing.jsonl'}:1"], "no such file or folder"),
        ([f"{root / 'books.jsonl'}:1", f"{root / 'web.jsonl'}:1"], 'no string "text" field'),
    ]
    for mix, message in cases:
        with pytest.raises(GptkilnError, match=re.escape(message)):
            prepare(None, out, "gpt2", mix=mix, progress=False)
        assert not out.exists()
    with pytest.raises(GptkilnError, match="both a source .* and a mix were given"):
        prepare(root / "books.jsonl", out, "gpt2", mix=[f"{root / 'news'}:1"], progress=False)
    write_jsonl(root / "one.jsonl", ["just one document"])
    with pytest.raises(GptkilnError, match=r"drew 1 document\(s\); splitting it"):
        prepare(None, out, "gpt2", mix=[f"{root / 'one.jsonl'}:1"], progress=False)
    assert not out.exists()


def test_a_bad_weight_through_the_cli_is_one_line_and_exit_2(tmp_path, sources, capsys):
    from gptkiln.cli import main

    root, _ = sources
    (root / "mix.yaml").write_text("- books.jsonl:1\n- news:0\n")
    code = main(["prepare", str(root / "mix.yaml"), "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "mix.yaml item 2: weight '0'" in err or "mix.yaml item 2: weight 0" in err
    assert not (tmp_path / "out").exists()


def test_train_reuses_a_prepared_mixture_until_a_member_or_weight_changes(tmp_path, sources):
    from gptkiln.train import _prepared_matches  # how `gptkiln train --data mix.yaml` decides

    root, _ = sources
    yaml_path = root / "mix.yaml"
    yaml_path.write_text("- books.jsonl:1\n- news:2\n")
    out = tmp_path / "data"
    prepare(yaml_path, out, "gpt2", progress=False)
    assert _prepared_matches(out, yaml_path, "gpt2", 0.1)
    assert not _prepared_matches(out, yaml_path, "gpt2", 0.2)
    write_jsonl(root / "news" / "b.jsonl", corpus("news", 201)[100:])  # a member's shard edited
    assert not _prepared_matches(out, yaml_path, "gpt2", 0.1)
    prepare(yaml_path, out, "gpt2", progress=False)
    assert _prepared_matches(out, yaml_path, "gpt2", 0.1)
    yaml_path.write_text("- books.jsonl:1\n- news:3\n")  # another weight
    assert not _prepared_matches(out, yaml_path, "gpt2", 0.1)


def test_the_mix_and_seed_flags_through_prepare(tmp_path, sources, capsys):
    from gptkiln.cli import main

    root, _ = sources
    books, news = f"{root / 'books.jsonl'}", f"{root / 'news'}"

    def run(*argv):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code
        return code, capsys.readouterr().err

    code, err = run("prepare", "--mix", f"{books}:1", f"{news}:2", "--seed", 3, "--tokenizer",
                    "gpt2", "--out", tmp_path / "out", "--quiet")  # fmt: skip
    assert code == 0, err
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["seed"] == 3 and [m["weight"] for m in meta["mix"]] == [1.0, 2.0]
    for argv, needle in [
        (["--mix", f"{books}:0", f"{news}:1"], "must be above 0"),
        ([books, "--mix", f"{news}:1"], "both a source"),
        ([], "SOURCE"),  # neither a source nor --mix
    ]:
        code, err = run("prepare", *argv, "--out", tmp_path / "bad", "--quiet")
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert needle in err
        assert not (tmp_path / "bad").exists()
