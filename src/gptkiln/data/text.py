"""Plain text files, compressed or not: opening them as text, and refusing bad bytes in one line.

A text file is read like Python's ``open(path).read()``: UTF-8, universal newlines, a leading
byte-order mark dropped. A NUL byte means a binary file (as git decides: within the first
8 KiB, or wherever the reader meets one); invalid UTF-8 is named with its byte offset, counted
in the decompressed bytes for a ``.gz`` or ``.zst`` file.
"""

from __future__ import annotations

import codecs
import io
from pathlib import Path
from typing import TextIO

from gptkiln.data.compressed import compression_of, open_bytes
from gptkiln.errors import GptkilnError

SNIFF_BYTES = 8192  # like git: a NUL in the first 8 KiB means binary


def open_text(path: Path) -> TextIO:
    """``path`` as UTF-8 text with universal newlines (a leading BOM dropped), decompressed
    when its name says so."""
    if compression_of(path) is None:
        return open(path, encoding="utf-8-sig", errors="strict")
    return io.TextIOWrapper(open_bytes(path), encoding="utf-8-sig", errors="strict")


def read_utf8(path: Path) -> str:
    """All of a small text file (a fine-tuning data set, a template), as `open(path).read()`
    reads it; a binary or non-UTF-8 file is refused in one line, as a corpus is."""
    data = path.read_bytes()
    if b"\x00" in data:
        raise bad_bytes_error(path)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise bad_bytes_error(path) from None
    return text.replace("\r\n", "\n").replace("\r", "\n")  # universal newlines


def check_not_binary(path: Path) -> None:
    """Refuse a file whose first 8 KiB (decompressed) hold a NUL byte."""
    with open_bytes(path) as f:
        if b"\x00" in f.read(SNIFF_BYTES):
            raise bad_bytes_error(path)


def bad_bytes_error(path: Path) -> GptkilnError:
    """Find the first NUL byte or invalid UTF-8 in a file and describe it (slow path)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # offset of the first byte not yet handed to the decoder
    with open_bytes(path) as f:
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
