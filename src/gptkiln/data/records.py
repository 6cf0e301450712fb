"""JSON records: one document per record, its text in a field (``"text"`` unless told otherwise).

- ``.jsonl``: one JSON object a line; blank lines are skipped.
- ``.json``: a JSON array of objects, parsed one element at a time (so a large array streams
  too), or, when the file starts with ``{``, JSON lines under a ``.json`` name (as C4 ships its
  ``.json.gz`` shards).

Either may be compressed (``.jsonl.gz``, ``.json.zst``, ...). A record whose text is empty is
skipped. Every refusal names the file and the line (or array element), and says how to fix it.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from pathlib import Path

from gptkiln.data.compressed import open_bytes
from gptkiln.data.text import bad_bytes_error
from gptkiln.errors import GptkilnError

DEFAULT_TEXT_FIELD = "text"
_READ_CHARS = 1 << 20
_WHITESPACE = " \t\n\r"


def jsonl_texts(path: Path, text_field: str = DEFAULT_TEXT_FIELD) -> Iterator[str]:
    """The non-empty ``text_field`` of each line of a JSON-lines file."""
    with open_bytes(path) as f:
        for line_number, raw in enumerate(f, start=1):
            if b"\x00" in raw:
                raise bad_bytes_error(path)
            try:
                line = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
            except UnicodeDecodeError:
                raise bad_bytes_error(path) from None
            if not line.strip():
                continue
            where = f"{path} line {line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                said = _said(e, f"column {e.colno}")
                raise GptkilnError(
                    f"{where}: not valid JSON ({said}); fix or remove that line"
                ) from None
            text = record_text(record, text_field, where, "\\u" in line)
            if text:
                yield text


def json_texts(path: Path, text_field: str = DEFAULT_TEXT_FIELD) -> Iterator[str]:
    """The non-empty ``text_field`` of each element of a JSON array (or of each line, when the
    file is JSON lines under a ``.json`` name)."""
    with open_bytes(path) as f:
        head = f.peek(64)[:64]
    if head.lstrip(b"\xef\xbb\xbf" + _WHITESPACE.encode())[:1] == b"{":
        try:
            yield from jsonl_texts(path, text_field)
        except GptkilnError as e:  # JSON lines broken at their first line: one object whole?
            if f"{path} line 1:" not in str(e) or not _one_object(path):
                raise
            raise GptkilnError(
                f"{path} holds one JSON object, not records: write them as a JSON array "
                f'([{{"{text_field}": ...}}, ...]) or as JSON lines (one object a line)'
            ) from None
        return
    for number, record in _array_elements(path):
        text = record_text(record, text_field, f"{path} element {number}", True)
        if text:
            yield text


def _one_object(path: Path) -> bool:
    """Whether ``path`` (up to 64 MiB of it) is a single JSON object, laid over several lines."""
    try:
        with open_bytes(path) as f:
            data = f.read(1 << 26)
        return isinstance(json.loads(data.decode("utf-8-sig")), dict)
    except (ValueError, UnicodeDecodeError):
        return False


def record_text(record, text_field: str, where: str, may_hold_escapes: bool) -> str:
    """The text of one parsed record, refused in one line unless it is an object whose
    ``text_field`` is a string of valid Unicode."""
    hint = _format_hint(text_field)
    if not isinstance(record, dict):
        raise GptkilnError(
            f'{where}: expected a JSON object with a string "{text_field}" field, got a '
            f"{type(record).__name__}; {hint}"
        )
    text = record.get(text_field)
    if not isinstance(text, str):
        keys = ", ".join(record) or "none"
        what = "" if text is None else f'; "{text_field}" holds a {_json_type(text)}'
        raise GptkilnError(f'{where}: no string "{text_field}" field (keys: {keys}){what}; {hint}')
    if may_hold_escapes:  # only a \u escape can make a lone surrogate, which no encoder takes
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise GptkilnError(
                f'{where}: "{text_field}" holds {e.object[e.start]!r}, half of a UTF-16 '
                "surrogate pair (a broken \\u escape); fix or remove that record"
            ) from None
    return text


def _format_hint(text_field: str) -> str:
    example = f'{{"{text_field}": "..."}}'
    return f"write each record as {example}, or name the field that holds the text (--text-field)"


def _json_type(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {list: "list", dict: "object"}.get(type(value), type(value).__name__)


def _array_elements(path: Path) -> Iterator[tuple[int, object]]:
    """``(number, value)`` of each element of the JSON array in ``path``, from 1, parsed one at a
    time from a buffer that holds one element (and a read's worth more)."""
    decoder = json.JSONDecoder()
    reader = _Chars(path)
    pos = reader.skip_space(0)
    if reader.buf[pos : pos + 1] != "[":
        raise GptkilnError(
            f"{path}: expected a JSON array of records ([{{...}}, ...]) or JSON lines; "
            "fix the file or give it the name of its format"
        )
    pos = reader.skip_space(pos + 1)
    number = 0
    if reader.buf[pos : pos + 1] == "]":
        pos += 1
    else:
        while True:
            number += 1
            value, pos = reader.decode(decoder, pos, f"{path} element {number}")
            yield number, value
            pos = reader.skip_space(pos)
            mark = reader.buf[pos : pos + 1]
            if mark == "]":
                pos += 1
                break
            if mark != ",":
                raise GptkilnError(
                    f"{path} element {number}: expected ',' or ']' after it, found "
                    f"{mark or 'the end of the file'!r}; fix the file"
                )
            pos = reader.skip_space(pos + 1)
            if pos > len(reader.buf) // 2:  # the elements read: dropped once half the buffer
                reader.drop(pos)  # (after each, the copy of the rest made small ones slow)
                pos = 0
    if reader.buf[reader.skip_space(pos) :].strip(_WHITESPACE):
        raise GptkilnError(f"{path}: text after the JSON array's closing ']'; fix the file")


class _Chars:
    """A growing window of a file's decoded text (UTF-8, BOM dropped), for the array parser."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open_bytes(path)
        self._decoder = codecs.getincrementaldecoder("utf-8-sig")()
        self.buf = ""
        self.done = False

    def more(self, at_least: int = _READ_CHARS) -> bool:
        """Read about ``at_least`` more characters; False at the end of the file."""
        if self.done:
            return False
        block = self._file.read(max(at_least, _READ_CHARS))
        if b"\x00" in block:
            raise bad_bytes_error(self.path)
        try:
            self.buf += self._decoder.decode(block, final=not block)
        except UnicodeDecodeError:
            raise bad_bytes_error(self.path) from None
        if not block:
            self.done = True
            self._file.close()
        return True

    def skip_space(self, pos: int) -> int:
        while True:
            while pos < len(self.buf) and self.buf[pos] in _WHITESPACE:
                pos += 1
            if pos < len(self.buf) or not self.more():
                return pos

    def drop(self, pos: int) -> None:
        self.buf = self.buf[pos:]

    def decode(self, decoder: json.JSONDecoder, pos: int, where: str):
        """The JSON value at ``pos`` and the position after it, reading more while the value
        runs past the buffer (doubling the read, so a long value costs linear time)."""
        while True:
            try:
                return decoder.raw_decode(self.buf, pos)
            except json.JSONDecodeError as e:
                if not self.more(len(self.buf)):
                    raise GptkilnError(
                        f"{where}: not valid JSON ({_said(e, f'line {e.lineno}')}); fix the file"
                    ) from None


def _said(e: json.JSONDecodeError, place: str) -> str:
    """The decoder's words and where: "Expecting ',' delimiter, column 9", "Unterminated string
    starting at column 9" (a message that ends in "at" names the place itself)."""
    return f"{e.msg} {place}" if e.msg.endswith(" at") else f"{e.msg}, {place}"
