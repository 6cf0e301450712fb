"""Compressed files read as the bytes they hold: ``.gz`` (gzip, stdlib) and ``.zst`` (Zstandard).

A compressed file is named by the format inside and the compression after it
(``shard.jsonl.zst``, ``book.txt.gz``). :func:`open_bytes` opens any file as a stream of its
(decompressed) bytes, so every text and JSON reader reads compressed files as it reads plain
ones, in bounded memory. A file cut short, corrupt, or not compressed at all is refused in one
line, naming the file, when the reader reaches the damage; nothing read before it is kept as if
it were the whole file, since the error ends the prepare.
"""

from __future__ import annotations

import gzip
import io
import zlib
from pathlib import Path
from typing import BinaryIO

from gptkiln.errors import GptkilnError

COMPRESSIONS = (".gz", ".zst")
_READ_BYTES = 1 << 20  # compressed bytes read at a time
_REFETCH = "download or compress it again"


def compression_of(path: Path) -> str | None:
    """``".gz"`` or ``".zst"`` when ``path`` is compressed (by its name), else ``None``."""
    suffix = path.suffix.lower()
    return suffix if suffix in COMPRESSIONS else None


def format_suffix(path: Path) -> str:
    """The suffix of the format inside: ``.jsonl`` for ``a.jsonl.zst`` and for ``a.jsonl``."""
    if compression_of(path):
        path = path.with_suffix("")
    return path.suffix.lower()


def open_bytes(path: Path) -> BinaryIO:
    """``path``'s bytes, decompressed when its name ends in ``.gz`` or ``.zst``; a buffered
    binary stream (``read``, ``readline``, iteration by lines). Decompression errors come out of
    its reads as one-line `GptkilnError`s."""
    compression = compression_of(path)
    if compression is None:
        return open(path, "rb")
    raw = _GzipReader(path) if compression == ".gz" else _ZstdReader(path)
    return io.BufferedReader(raw, buffer_size=_READ_BYTES)


class _DecompressingReader(io.RawIOBase):
    """A raw stream over a decompressor: `readinto` fills from `_more`, refusing damage."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._pending = b""  # decompressed bytes not yet handed out

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._pending:
            chunk = self._more()
            if chunk is None:
                return 0  # the end of the last frame, at the end of the file
            self._pending = chunk
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def _more(self) -> bytes | None:
        """The next decompressed bytes (may be empty), or ``None`` at a clean end."""
        raise NotImplementedError

    def _error(self, what: str) -> GptkilnError:
        return GptkilnError(f"{self.path}: {what}; {_REFETCH}")


class _GzipReader(_DecompressingReader):
    """gzip, every member of a multi-member file (as ``zcat`` reads it)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._file = gzip.GzipFile(path, "rb")

    def _more(self) -> bytes | None:
        try:
            chunk = self._file.read(_READ_BYTES)
        except EOFError:
            raise self._error("gzip data cut short (the file ends inside it)") from None
        except gzip.BadGzipFile as e:
            raise self._error(f"not valid gzip data ({e})") from None
        except zlib.error as e:
            raise self._error(f"corrupt gzip data ({e})") from None
        return chunk or None

    def close(self) -> None:
        self._file.close()
        super().close()


class _ZstdReader(_DecompressingReader):
    """Zstandard, frame after frame; a file that ends inside a frame is refused (the library's
    own stream reader returns what it has, silently)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        try:
            import zstandard
        except ImportError:
            raise GptkilnError(
                f"{path}: reading .zst files needs the zstandard package; "
                "pip install 'gptkiln[corpora]' (or pip install zstandard)"
            ) from None
        self._zstd = zstandard
        self._file = open(path, "rb")
        self._decompressor = zstandard.ZstdDecompressor().decompressobj()
        self._in_frame = False  # bytes of a frame seen, its end not yet

    def _more(self) -> bytes | None:
        data = self._file.read(_READ_BYTES)
        if not data:
            if self._in_frame:
                raise self._error("Zstandard data cut short (the file ends inside a frame)")
            return None
        out = []
        try:
            while data:
                self._in_frame = True
                out.append(self._decompressor.decompress(data))
                if not self._decompressor.eof:
                    break
                # a frame ended: what follows it starts the next frame
                data = self._decompressor.unused_data
                self._decompressor = self._zstd.ZstdDecompressor().decompressobj()
                self._in_frame = False
        except self._zstd.ZstdError as e:
            raise self._error(f"not valid Zstandard data ({e})") from None
        return b"".join(out)

    def close(self) -> None:
        self._file.close()
        super().close()
