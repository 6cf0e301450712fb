"""Files an export or import writes: copied atomically, written as JSON or text atomically, the
stale ones of what they replace dropped (the writes themselves: `gptkiln.checkpoint`), and a
directory of them written aside and moved into place whole (`staged`)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from gptkiln.checkpoint import CONFIG_FILE, atomic_write


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


STAGE_SUFFIX = ".writing"
"""``OUT`` is written as ``.OUT.writing`` beside it first (`staged`)."""
INNER_STAGE = ".gptkiln-writing"
"""Where the files for an existing ``OUT`` are written first, inside it (`staged`)."""


@contextlib.contextmanager
def staged(out_dir: Path, last: str) -> Iterator[Path]:
    """A directory to write ``out_dir``'s files in, moved into place when the block ends: for a
    new ``out_dir`` one beside it (``.NAME.writing``), renamed to it; inside an existing one
    (`INNER_STAGE`), its files renamed into it one by one (``last`` the last of them, each keeping
    the mode of the file it replaces). Every move is a rename within one directory, so none
    crosses a filesystem or a mount (a link's target, a bind-mounted volume) as a copy that a full
    disk could cut short over the file it replaces. A block that raises, a full disk or Ctrl-C,
    removes what it wrote and leaves ``out_dir`` as it was, or absent; a stage a killed run left
    is removed by the next."""
    out_dir = Path(os.path.realpath(out_dir))
    if out_dir.is_dir():
        stage = out_dir / INNER_STAGE
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir()
    else:
        stage = out_dir.with_name(f".{out_dir.name}{STAGE_SUFFIX}")
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir(parents=True)
    try:
        yield stage
        if not out_dir.exists():
            os.replace(stage, out_dir)
            return
        names = sorted((p.name for p in stage.iterdir()), key=lambda name: name == last)
        for name in names:
            with contextlib.suppress(OSError):
                shutil.copymode(out_dir / name, stage / name)
            os.replace(stage / name, out_dir / name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


@contextlib.contextmanager
def staged_run(out_dir: str | os.PathLike, stale: list[Path]) -> Iterator[Path]:
    """A run directory written whole (an import, a merge, a quantized copy): `staged`, with
    config.json moved in last, then the ``stale`` files of the run it replaces
    (`run_guard.check_out_dir`) and, where a run was there, the files of its tokenizer the new
    run did not write dropped (a folder that held no model keeps its files). A write that fails
    or is cut short leaves the run that was there as it was."""
    from gptkiln.checkpoint import has_checkpoint
    from gptkiln.tokenizers import TOKENIZER_FILES

    out_dir = Path(out_dir)
    replacing = has_checkpoint(out_dir)
    with staged(out_dir, last=CONFIG_FILE) as stage:
        yield stage
        written = {p.name for p in stage.iterdir()}
    others = [out_dir / n for n in TOKENIZER_FILES if n not in written] if replacing else []
    drop_files(stale + others)
