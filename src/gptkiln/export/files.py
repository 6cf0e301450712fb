"""Files an export or import writes: copied atomically, written as JSON or text atomically, and
the stale ones of what they replace dropped (the writes themselves: `gptkiln.checkpoint`)."""

from __future__ import annotations

import shutil
from pathlib import Path

from gptkiln.checkpoint import atomic_write


def copy_files(src_dir: Path, out_dir: Path, names: tuple[str, ...]) -> list[str]:
    """Copy the files of ``names`` that ``src_dir`` holds into ``out_dir``, byte for byte and
    each atomically; the names copied."""
    copied = [name for name in names if (src_dir / name).is_file()]
    for name in copied:
        src = src_dir / name
        if src.resolve() != (out_dir / name).resolve():  # (a file is never copied onto itself)
            atomic_write(out_dir / name, lambda tmp, src=src: shutil.copyfile(src, tmp))
    return copied


def write_text(path: Path, text: str) -> None:
    """``text`` into ``path`` as UTF-8, atomically."""
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def drop_files(stale: list[Path]) -> None:
    """Remove the files of ``stale`` (a replaced model's, written over), those present."""
    for path in stale:
        path.unlink(missing_ok=True)
