"""Tokenize a source to disk, streaming: ``train.bin``, ``val.bin``, ``meta.json``, tokenizer.

The layout is nanoGPT's: each ``.bin`` is a flat array of token ids (``uint16`` when the
vocabulary fits, else ``uint32``) that training reads through ``np.memmap``. Documents are
joined with the end-of-text id (between documents, not after the last).

The train/validation split follows the book: the first ``1 - val_fraction`` of the characters
are train, the rest validation, and the document that straddles the boundary is cut there. For
one document this is exactly the book's ``text[:split_idx]`` / ``text[split_idx:]`` with
``split_idx = int(train_ratio * len(text))``, each tokenized on its own.

Memory stays flat on any corpus size: the source is read in pieces (one pass to count
characters, plus one to train a ``char``/``bpe`` tokenizer; a BPE learns from the first
`BPE_SAMPLE_BYTES` of the text, as sentencepiece's ``input_sentence_size`` and nanochat's
``max_chars`` bound their trainers' input), pieces are encoded in batches of
about :data:`BATCH_CHARS` characters by the tokenizer's parallel batch encoder, and the ids are
appended to the files as they come. Everything is written to a hidden staging folder and moved
into place at the end, ``meta.json`` last, so a failed run never leaves a half dataset under the
final names.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gptkiln.config.train import BPE_SAMPLE_BYTES, DEFAULT_TOKENIZER
from gptkiln.data.encoding import encoded_batches
from gptkiln.data.mixture import (
    Mixture,
    check_source,
    load_mixture,
    member_pieces,
    mixed_text,
    source_checksums,
    write_mixture,
)
from gptkiln.data.records import DEFAULT_TEXT_FIELD
from gptkiln.data.sources import (
    DEFAULT_SOURCE,
    PIECE_CHARS,
    is_mixture,
    iter_pieces,
)
from gptkiln.errors import GptkilnError, out_of_space
from gptkiln.tokenizers import (
    TOKENIZER_FILES,
    TOKENIZER_KINDS,
    CharTokenizer,
    GPT2Tokenizer,
    Tokenizer,
    collect_chars,
    load_tokenizer,
    parse_tokenizer_spec,
    train_bpe_tokenizer,
)

FORMAT = 1
BATCH_CHARS = 8 << 20
"""Characters encoded per batch (8 Mi): enough pieces to keep every core busy, while the ids of
one batch (a few tens of MB as Python ints) bound the memory."""
FILES = ("meta.json", "train.bin", "val.bin")
STAGING_PREFIX = ".prepare-"  # then the preparing process's id: a hidden folder in --out
_SPLITS = ("train", "val")


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (``vocab_size <= 65536``), else ``uint32``."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


@dataclass
class _Survey:
    """What the first, cheap pass over a source learns."""

    documents: int = 0
    chars: int = 0
    utf8_bytes: int = 0
    code_points: dict[int, None] = field(default_factory=dict)  # characters, if asked for


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    # delay: a prepare that fails (or finishes) at once never draws a bar
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not enabled, delay=0.5)


def _survey(pieces: Iterable[tuple[bool, str]], *, want_charset: bool, progress: bool) -> _Survey:
    survey = _Survey()
    for _ in _surveyed(pieces, survey, want_charset=want_charset, progress=progress):
        pass
    return survey


def _surveyed(
    pieces: Iterable[tuple[bool, str]], survey: _Survey, *, want_charset: bool, progress: bool
) -> Iterator[str]:
    """The pieces' texts, counted into ``survey`` as they pass (so a BPE can be trained on the
    same pass that counts the characters)."""
    with _progress(None, "reading", progress) as bar:
        for starts_document, text in pieces:
            survey.documents += starts_document
            survey.chars += len(text)
            size = _utf8_len(text)
            survey.utf8_bytes += size
            if want_charset:
                collect_chars(text, survey.code_points)
            bar.update(size)
            yield text


def _kind_to_build(spec) -> str | None:
    """The kind of tokenizer ``spec`` asks to build (checked before any reading), else ``None``."""
    ready = isinstance(spec, Tokenizer) or not isinstance(spec, str)
    if ready or (spec not in TOKENIZER_KINDS and Path(spec).is_dir()):
        return None
    return parse_tokenizer_spec(spec)[0]


def _make_tokenizer(
    spec,
    texts: Callable[[], Iterable[str]],
    survey: _Survey | None,
    sample: _Sample | None = None,
) -> Tokenizer:
    """The tokenizer named by ``spec``: given, loaded from a folder, or built from the text
    (``texts()``, read again to train a BPE on the first of it: ``sample``, which counts what
    it took; ``survey``, the characters, for ``char``)."""
    if isinstance(spec, Tokenizer):
        return spec
    if _kind_to_build(spec) is None:
        return load_tokenizer(spec)
    kind, vocab_size = parse_tokenizer_spec(spec)
    if kind == "gpt2":
        return GPT2Tokenizer()
    if kind == "char":
        return CharTokenizer(sorted(map(chr, survey.code_points)), with_eot=survey.documents > 1)
    sample = sample or _Sample(None)
    return train_bpe_tokenizer(sample.first(texts()), vocab_size)


@dataclass
class _Sample:
    """The text a BPE is trained on: the first ``limit`` UTF-8 bytes of a stream of texts (None:
    all of it), the last text cut at a character; ``taken`` counts the bytes given out."""

    limit: int | None
    taken: int = 0
    full: bool = False  # whether the limit cut the text short

    def first(self, texts: Iterable[str]) -> Iterator[str]:
        for text in texts:
            size = _utf8_len(text)
            if self.limit is not None and self.taken + size > self.limit:
                text = text.encode("utf-8")[: self.limit - self.taken].decode("utf-8", "ignore")
                size, self.full = _utf8_len(text), True
            self.taken += size
            if text:
                yield text
            if self.full:
                return


def _assign_splits(pieces: Iterable[tuple[bool, str]], split_at: int) -> Iterator[tuple]:
    """Tag pieces ``(split, starts_document, text)``; cut the piece that crosses ``split_at``."""
    offset = 0
    for starts_document, text in pieces:
        end = offset + len(text)
        if end <= split_at:
            yield 0, starts_document, text
        elif offset >= split_at:
            yield 1, starts_document, text
        else:  # offset < split_at < end: both halves are non-empty
            cut = split_at - offset
            yield 0, starts_document, text[:cut]
            yield 1, False, text[cut:]
        offset = end


def _write_tokens(
    staging: Path, pieces, tokenizer: Tokenizer, dtype, batch_chars, bar, threads=None
) -> tuple[list[int], list[int]]:
    """Encode tagged pieces batch by batch and append them to ``train.bin`` / ``val.bin``;
    ``([train ids, val ids], [train characters, val characters])``."""
    counts, chars = [0, 0], [0, 0]
    files = [open(staging / f"{name}.bin", "wb") for name in _SPLITS]
    try:
        for encoded in encoded_batches(pieces, tokenizer, batch_chars, threads):
            _append(encoded, tokenizer.eot_id, dtype, files, counts, chars, bar)
    finally:
        for f in files:
            f.close()
    return counts, chars


def _append(encoded, eot_id, dtype, files, counts, chars, bar) -> None:
    """Write a batch's ids to its splits' files; count the ids and characters of each split (a
    document separator is one character, as `Tokenizer.char_counts` counts it). A batch of many
    small documents is joined first and written once per split."""
    batch, arrays = encoded
    parts: list[list[np.ndarray]] = [[], []]
    eot = np.array([0 if eot_id is None else eot_id], dtype=dtype)
    size = 0
    for (split, starts_document, text), ids in zip(batch, arrays, strict=True):
        if starts_document and counts[split]:
            parts[split].append(eot)
            counts[split] += 1
            chars[split] += 1
        parts[split].append(ids.astype(dtype, copy=False))
        counts[split] += len(ids)
        chars[split] += len(text)
        size += _utf8_len(text)
    for split, arrays_of_split in enumerate(parts):
        if arrays_of_split:
            np.concatenate(arrays_of_split).tofile(files[split])
    bar.update(size)


# A model's files (the names gptkiln.checkpoint writes; not imported here: it needs torch).
_MODEL_FILES = ("model.safetensors", "trainer_state.pt", "trainer_state.prev.pt")


def _check_out_dir(out_dir: Path, source=None) -> None:
    """Prepared data replaces earlier prepared data, never a model, a file, or the folder of
    the text it is prepared from."""
    if out_dir.exists() and not out_dir.is_dir():
        raise GptkilnError(f"--out {out_dir} is a file; give the path of a directory to write")
    folder = Path(source) if isinstance(source, (str, os.PathLike)) else None
    if folder is not None and folder.is_dir():
        inside = (
            out_dir.resolve() == folder.resolve() or folder.resolve() in out_dir.resolve().parents
        )
        if inside:
            raise GptkilnError(
                f"--out {out_dir} is inside the folder it reads ({folder}): its files would be "
                "read as text next time; prepare into a folder outside it"
            )
    elif folder is not None and folder.is_file() and out_dir.resolve() == folder.resolve().parent:
        from gptkiln.data.sources import _is_usable

        own = {*FILES, *TOKENIZER_FILES}  # an earlier prepare's own files here
        others = sorted(
            p.name for p in out_dir.iterdir() if p.is_file() and p.name != folder.name
            and p.name not in own and _is_usable(p)
        )  # fmt: skip
        if others:  # (the text alone in a run's data/ is a layout of its own: prepared beside)
            raise GptkilnError(
                f"--out {out_dir} is the folder {folder.name} is in, beside other texts "
                f"({', '.join(others[:3])}): the folder would then read as prepared data of "
                f"{folder.name} alone, the others unseen; prepare into a folder of its own"
            )
    model_files = [n for n in _MODEL_FILES if (out_dir / n).exists()]
    if model_files:
        raise GptkilnError(
            f"--out {out_dir} holds a model ({', '.join(model_files)}), and preparing there "
            f"would replace its tokenizer; prepare into another directory, e.g. {out_dir / 'data'}"
        )


def prepare(
    source: str | os.PathLike | None,
    out_dir: str | os.PathLike,
    tokenizer: str | os.PathLike | Tokenizer = DEFAULT_TOKENIZER,
    val_fraction: float = 0.1,
    *,
    text_field: str = DEFAULT_TEXT_FIELD,
    mix: str | os.PathLike | Sequence | Mixture | None = None,
    seed: int = 0,
    progress: bool = True,
    batch_chars: int = BATCH_CHARS,
    threads: int | None = None,
    tokenizer_spec: str | None = None,
    bpe_sample_bytes: int | None = BPE_SAMPLE_BYTES,
) -> dict:
    """Tokenize ``source`` into ``out_dir``: ``train.bin``, ``val.bin``, ``meta.json``, tokenizer.

    Args:
        source: a file, folder, ``hf:`` dataset, or ``None`` / ``"shakespeare"`` (see
            :mod:`gptkiln.data.sources`); a ``.yaml`` file is a mixture (as ``mix``). ``None``
            when ``mix`` is given.
        out_dir: folder to write (created; files of an earlier prepare there are replaced).
        tokenizer: ``"gpt2"``, ``"char"``, ``"bpe"`` (``bpe:N`` for N ids; default
            :data:`~gptkiln.tokenizers.DEFAULT_BPE_VOCAB_SIZE`), a folder holding a saved tokenizer
            (e.g. earlier prepared data, to share its vocabulary), or a :class:`Tokenizer`;
            unsaid, ``bpe:16384``, as ``gptkiln prepare`` and ``train`` (`DEFAULT_TOKENIZER`).
            ``char`` and ``bpe`` are built from the whole source (train and validation).
        val_fraction: share of the characters, taken from the end, that becomes ``val.bin``.
        text_field: the JSON key or column that holds the text (JSON, Parquet, datasets).
        mix: several sources drawn by weight (see :mod:`gptkiln.data.mixture`): a YAML file, or
            a list of ``"SOURCE:WEIGHT"`` strings, ``(source, weight)`` pairs or mappings.
        seed: seeds a mixture's draw (the same seed, sources and tokenizer give the same data).
        progress: show tqdm progress bars (in bytes of text) on stderr.
        batch_chars: characters per encoding batch; lower it to save memory (memory use is a
            few times this, whatever the corpus size).
        threads: encoding threads of the ``gpt2`` tokenizer (default: every core).
        tokenizer_spec: what ``meta.json`` records as asked for (a later run reuses data of
            its spec); default ``tokenizer`` when it is a name. For a :class:`Tokenizer`, the
            spec it was made from (a resumed run's own tokenizer: its ``bpe:N``).
        bpe_sample_bytes: a ``bpe`` tokenizer learns from the first this many UTF-8 bytes of
            the text (`BPE_SAMPLE_BYTES`; None: all of it), which bounds the trainer's memory;
            ``meta.json`` records what it took (``bpe_sample_bytes``), and a note on stderr
            says so where that was not the whole text.

    Returns:
        The contents of ``meta.json``.
    """
    _check_settings(val_fraction, batch_chars, threads, seed, text_field, bpe_sample_bytes)
    mixture = _mixture_of(source, mix, text_field)
    if mixture is not None:
        mixture.check()
    else:
        check_source(source, text_field=text_field)
    _check_out_dir(Path(out_dir), source)
    _kind_to_build(tokenizer)  # an unknown tokenizer name fails before any reading
    run = _Run(source, mixture, text_field, seed, min(PIECE_CHARS, batch_chars))
    run.sample = _Sample(bpe_sample_bytes)
    tok = run.tokenizer(tokenizer, progress)
    out_dir = Path(out_dir)
    made = [d for d in (out_dir, *out_dir.parents) if not d.exists()]  # the folders made here
    out_dir.mkdir(parents=True, exist_ok=True)
    _clear_stale_staging(out_dir)
    staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=out_dir))
    try:
        spec = tokenizer_spec
        if spec is None and isinstance(tokenizer, (str, os.PathLike)):
            spec = str(tokenizer)
        meta = _write_dataset(staging, run, tok, spec, val_fraction, batch_chars, progress, threads)
        _move_into_place(staging, out_dir)
    except BaseException as e:
        full = out_of_space(e, staging)  # asked before the partial files go
        shutil.rmtree(staging, ignore_errors=True)
        for folder in made:  # innermost first; a folder something else wrote into stays
            if any(folder.iterdir()):
                break
            folder.rmdir()
        if full:
            raise GptkilnError(
                f"no space left on the device writing {out_dir}; nothing was kept there: free "
                "some space, then prepare again"
            ) from None
        raise
    shutil.rmtree(staging, ignore_errors=True)
    if _kind_to_build(tokenizer) == "bpe":  # said once the data is written, not before an error
        _note_fewer_ids(tokenizer, tok, run.sample)
    return meta


def _check_settings(
    val_fraction: float,
    batch_chars: int,
    threads: int | None,
    seed: int,
    text_field: str,
    bpe_sample_bytes: int | None,
) -> None:
    """`prepare`'s settings, each refused in one line before anything is read."""
    if not 0.0 < val_fraction < 1.0:
        raise GptkilnError(f"val_fraction {val_fraction!r}: must be between 0 and 1, e.g. 0.1")
    if batch_chars < 1:
        raise GptkilnError(f"batch_chars {batch_chars!r}: must be a positive number of characters")
    if threads is not None and threads < 1:
        raise GptkilnError(f"threads {threads!r}: must be at least 1")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise GptkilnError(f"seed {seed!r}: a mixture's seed is a whole number in [0, 2**63)")
    if not isinstance(text_field, str) or not text_field:
        raise GptkilnError(f"text_field {text_field!r}: name the field that holds the text")
    if bpe_sample_bytes is not None and (
        isinstance(bpe_sample_bytes, bool) or not isinstance(bpe_sample_bytes, int)
        or bpe_sample_bytes < 1
    ):  # fmt: skip
        raise GptkilnError(
            f"bpe_sample_bytes {bpe_sample_bytes!r}: the bytes of text a BPE learns from, a "
            "whole number >= 1 (None: all of it)"
        )


def _clear_stale_staging(out_dir: Path) -> None:
    """Remove the staging folders that prepares killed halfway (SIGTERM, SIGKILL) left in
    ``out_dir``; one whose prepare is still running (its process id is in the name) stays."""
    for stale in out_dir.glob(f"{STAGING_PREFIX}*"):
        pid = stale.name[len(STAGING_PREFIX) :].partition("-")[0]
        if not (pid.isdigit() and _running(int(pid))):
            shutil.rmtree(stale, ignore_errors=True)


def _running(pid: int) -> bool:
    """Whether process ``pid`` is alive on this machine (assumed so where that can't be asked
    without harm: on Windows ``os.kill`` would end it)."""
    if os.name != "posix":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # alive, another user's
        return True
    return True


def _mixture_of(source, mix, text_field: str) -> Mixture | None:
    """The mixture to prepare (``mix``, or a ``.yaml`` source), else None."""
    if mix is not None:
        if source is not None:
            raise GptkilnError(
                f"both a source ({source}) and a mix were given; give one: a mix lists every "
                "source it draws from"
            )
        return load_mixture(mix, text_field=text_field)
    return load_mixture(source, text_field=text_field) if is_mixture(source) else None


@dataclass
class _Run:
    """What one prepare reads: a source or a mixture, and how to read it."""

    source: str | os.PathLike | None
    mixture: Mixture | None
    text_field: str
    seed: int
    piece_chars: int
    survey: _Survey | None = None
    sample: _Sample | None = None  # what a BPE is trained on (`_Sample`)

    def pieces(self) -> Iterator[tuple[bool, str]]:
        """A single source's pieces."""
        return iter_pieces(self.source, piece_chars=self.piece_chars, text_field=self.text_field)

    def texts(self) -> Iterator[str]:
        """The text a tokenizer is built from: the source, or the mixture drawn by characters."""
        if self.mixture is not None:
            return mixed_text(self.mixture, self.seed, self.piece_chars)
        return (text for _, text in self.pieces())

    def _every_members_text(self) -> Iterator[tuple[bool, str]]:
        for pieces in member_pieces(self.mixture, self.piece_chars):
            yield from ((True, text) for _, text in pieces)

    def tokenizer(self, spec, progress: bool) -> Tokenizer:
        """Survey what needs surveying (a single source's characters, for its split; a char
        alphabet), then build or load the tokenizer; refuse one that cannot join documents."""
        kind = _kind_to_build(spec)
        want_charset = kind == "char"
        texts = self.texts
        if self.mixture is None and kind == "bpe":  # one pass counts and trains: one read less
            self.survey = _Survey()
            counted = _surveyed(self.pieces(), self.survey, want_charset=False, progress=progress)
            texts = lambda: counted  # noqa: E731
        elif self.mixture is None or want_charset:
            # a mixture's alphabet: every member read whole, not only what the draw takes, since
            # each member's next documents are encoded ahead of the draw (`write_mixture`)
            pieces = self.pieces() if self.mixture is None else self._every_members_text()
            self.survey = _survey(pieces, want_charset=want_charset, progress=progress)
        tok = _make_tokenizer(spec, texts, self.survey, self.sample)
        if self.mixture is None and kind == "bpe":
            for _ in counted:  # the split needs every character, past what the trainer read
                pass
        if kind == "bpe" and self.sample is not None and self.sample.full:
            whole = "" if self.survey is None else f" of {self.survey.utf8_bytes:,}"
            print(
                f"note: the BPE learned from the first {self.sample.taken:,} bytes{whole} of "
                f"{self.name}'s text (a sample bounds the trainer's memory); --bpe-sample-mb N "
                "takes more (0: all)",
                file=sys.stderr,
            )
        documents = 2 if self.mixture is not None else self.survey.documents
        if documents > 1 and tok.eot_id is None:
            what = f"has {documents} documents" if self.mixture is None else "is a mixture"
            raise GptkilnError(
                f"{self.name}: {what} but tokenizer {tok.kind!r} has no <|endoftext|> id to join "
                "them; use a tokenizer with one (gpt2, bpe, or char built from this source)"
            )
        return tok

    @property
    def name(self) -> str:
        if self.mixture is not None:
            return str(self.mixture)
        return DEFAULT_SOURCE if self.source is None else str(self.source)


def _note_fewer_ids(spec: str, tok: Tokenizer, sample: _Sample | None) -> None:
    """A note on stderr where a BPE trained here has fewer ids than ``bpe:N`` asked: its text
    ran out of pairs to merge (each word, up to a space or punctuation mark, is one id at most),
    so the model's vocabulary, and the size of its embedding and head, are not the ones asked."""
    asked = parse_tokenizer_spec(spec)[1]
    if tok.vocab_size >= asked:
        return
    learned = "its text"
    if sample is not None and sample.taken:
        learned = f"the {sample.taken:,} bytes it learned from"
    more = " (more with --bpe-sample-mb)" if sample is not None and sample.full else ""
    print(
        f"note: bpe:{asked} gave {tok.vocab_size:,} ids: {learned} hold no more pairs to merge "
        f"(a word, up to a space or punctuation mark, becomes one id at most); give it more "
        f"text{more}, or ask for bpe:{tok.vocab_size}",
        file=sys.stderr,
    )


def _write_dataset(
    staging, run: _Run, tok, tokenizer_spec, val_fraction, batch_chars, progress, threads
) -> dict:
    """Write every file of a prepared dataset into ``staging``; return the meta dict
    (``tokenizer_spec``: what was asked for, e.g. ``bpe:8000``, so a later run can reuse it)."""
    dtype = token_dtype(tok.vocab_size)
    extra: dict = {}
    if run.mixture is None:
        survey = run.survey
        split_at = int((1.0 - val_fraction) * survey.chars)  # the book's split_idx
        pieces = _assign_splits(run.pieces(), split_at)
        with _progress(survey.utf8_bytes, f"tokenizing ({tok.kind})", progress) as bar:
            tokens, chars = _write_tokens(staging, pieces, tok, dtype, batch_chars, bar, threads)
        documents, characters = survey.documents, survey.chars
        checksums = source_checksums(run.source)
        if run.text_field != DEFAULT_TEXT_FIELD:
            extra["text_field"] = run.text_field
    else:
        with _progress(None, f"mixing and tokenizing ({tok.kind})", progress) as bar:
            mixed = write_mixture(
                staging, run.mixture, tok, dtype, val_fraction, run.seed,
                batch_chars=batch_chars, piece_chars=run.piece_chars, threads=threads, bar=bar,
            )  # fmt: skip
        tokens, chars, documents = mixed.tokens, mixed.characters, mixed.documents
        characters = sum(mixed.member_characters) + documents - 1
        checksums = run.mixture.checksums()
        extra = {"mix": _mix_meta(run.mixture, mixed), "seed": run.seed, "split": "documents"}
    train_tokens, val_tokens = tokens
    if min(train_tokens, val_tokens) < 2:
        raise GptkilnError(
            f"{run.name}: corpus too small for val_fraction={val_fraction}: train has "
            f"{train_tokens} tokens and val {val_tokens}, at least 2 each are needed; use "
            "more text or another val_fraction"
        )
    meta = {
        "format": FORMAT,
        "tokenizer": tok.kind,
        "tokenizer_spec": tokenizer_spec,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "dtype": dtype.name,
        "train_tokens": train_tokens,
        "val_tokens": val_tokens,
        # the characters of the text that became each split, a document separator counted as
        # one: what the split's ids add up to in Tokenizer.char_counts (bits per character)
        "train_characters": chars[0],
        "val_characters": chars[1],
        "val_fraction": val_fraction,
        "source": run.name,
        "checksums": checksums,
        "documents": documents,
        "characters": characters,
        **extra,
    }
    if run.sample is not None and run.sample.taken:  # a BPE trained here: on what
        meta["bpe_sample_bytes"] = run.sample.taken
        meta["bpe_sample_limit"] = run.sample.limit  # what it was asked to take (None: all)
    # a model trained on this data is not the tokenizer's own: none of its sampling settings
    getattr(tok, "for_new_model", lambda: tok)().save(staging)
    (staging / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta


def _mix_meta(mixture: Mixture, mixed) -> list[dict]:
    """Per member: its source, weight, text field, what it gave the mixture, and checksums."""
    total = sum(mixed.member_tokens) or 1
    return [
        {
            "source": m.source,
            "weight": m.weight,
            "text_field": m.text_field,
            "documents": mixed.member_documents[i],
            "tokens": mixed.member_tokens[i],
            "characters": mixed.member_characters[i],
            "share": round(mixed.member_tokens[i] / total, 6),
            "checksums": mixture.member_checksums(m),
        }
        for i, m in enumerate(mixture.members)
    ]


def _move_into_place(staging: Path, out_dir: Path) -> None:
    """Rename staged files over the final names, ``meta.json`` last; drop stale tokenizer files.
    The old ``meta.json`` goes first: a stop halfway leaves a folder that is no prepared data
    (`is_prepared`), never one whose meta.json describes files partly replaced."""
    (out_dir / "meta.json").unlink(missing_ok=True)
    for name in TOKENIZER_FILES:
        if not (staging / name).exists():
            (out_dir / name).unlink(missing_ok=True)
    names = sorted(p.name for p in staging.iterdir() if p.name != "meta.json")
    for name in [*names, "meta.json"]:
        os.replace(staging / name, out_dir / name)


@dataclass
class PreparedData:
    """Tokenized data on disk, opened read-only.

    Attributes:
        path: the folder.
        train: token ids of the training split, ``(train_tokens,)`` read-only ``np.memmap``.
        val: token ids of the validation split, ``(val_tokens,)`` read-only ``np.memmap``.
        meta: the contents of ``meta.json``.
        tokenizer: the tokenizer the ids were made with.
    """

    path: Path
    train: np.memmap
    val: np.memmap
    meta: dict
    tokenizer: Tokenizer


def is_prepared(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` is a folder written by `prepare` (rather than text still to prepare)."""
    return path is not None and (Path(path) / "meta.json").is_file()


def read_meta(data_dir: str | os.PathLike) -> dict | None:
    """The ``meta.json`` of a prepared folder as a dict, or None when it is missing or unreadable
    (for callers that only compare; `load_prepared` says what is wrong with it)."""
    try:
        meta = json.loads((Path(data_dir) / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
        return None
    return meta if isinstance(meta, dict) else None


def load_prepared(data_dir: str | os.PathLike) -> PreparedData:
    """Open a folder written by :func:`prepare` (memory-mapped, so any size loads instantly)."""
    data_dir = Path(data_dir)
    hint = "make it with `gptkiln prepare` (or gptkiln.data.prepare)"
    if not data_dir.is_dir():
        raise GptkilnError(f"{data_dir}: no such folder of prepared data; {hint}")
    for name in FILES:
        if not (data_dir / name).is_file():
            raise GptkilnError(f"{data_dir}: missing {name}, so not prepared data; {hint}")
    meta_path = data_dir / "meta.json"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        fmt, dtype = meta["format"], np.dtype(meta["dtype"])
        counts = [int(meta[f"{split}_tokens"]) for split in _SPLITS]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise GptkilnError(f"{meta_path}: unreadable ({e}); {hint} again") from None
    if fmt != FORMAT:
        raise GptkilnError(
            f"{meta_path}: format {fmt!r}, this gptkiln reads {FORMAT}; {hint} again"
        )
    arrays = []
    for split, count in zip(_SPLITS, counts, strict=True):
        path = data_dir / f"{split}.bin"
        if path.stat().st_size != count * dtype.itemsize:
            raise GptkilnError(
                f"{path}: {path.stat().st_size} bytes, but meta.json says {count} {dtype.name} "
                f"tokens; the folder is damaged, {hint} again"
            )
        arrays.append(np.memmap(path, dtype=dtype, mode="r", shape=(count,)))
    tokenizer = load_tokenizer(data_dir)
    if tokenizer.vocab_size != meta.get("vocab_size"):
        raise GptkilnError(
            f"{meta_path}: vocab_size {meta.get('vocab_size')} but the saved tokenizer has "
            f"{tokenizer.vocab_size}; the folder mixes two runs, {hint} again"
        )
    return PreparedData(data_dir, arrays[0], arrays[1], meta, tokenizer)
