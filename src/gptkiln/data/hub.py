"""Hugging Face datasets: from the Hub (streamed), a local dataset folder, or a `save_to_disk` one.

- ``hf:NAME[:CONFIG][@SPLIT]`` with a Hub name (``HuggingFaceFW/fineweb-edu:sample-10BT@train``):
  ``datasets.load_dataset(NAME, CONFIG, split=SPLIT, streaming=True)`` at the revision the Hub
  has now, which is pinned (and recorded among the source's checksums) so that every pass of one
  prepare, and a later check of it, reads the same data. Each pass streams the data again:
  prepare reads a source twice (three times to train a ``bpe`` tokenizer).
- ``hf:PATH[:CONFIG][@SPLIT]`` with a local folder of data files (``data/train-*.parquet``, a
  ``README.md`` naming configs, ...): the same call, on the folder, offline.
- a folder written by ``Dataset.save_to_disk`` (``state.json``) or ``DatasetDict.save_to_disk``
  (``dataset_dict.json``), as a plain path or ``hf:PATH[@SPLIT]``: its Arrow files, read record
  batch by record batch with ``pyarrow`` (not memory-mapped, so memory stays bounded whatever the
  size).

``SPLIT`` defaults to ``train``. Documents are the non-empty strings of the text column
(``"text"`` unless told otherwise). ``datasets`` and ``pyarrow`` are optional dependencies
(``pip install 'gptkiln[corpora]'``); every failure to load is one line that says what to do.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gptkiln.errors import GptkilnError

HF_PREFIX = "hf:"
DEFAULT_SPLIT = "train"
BATCH_ROWS = 1024
_INSTALL = "pip install 'gptkiln[corpora]' (or pip install datasets)"


@dataclass(frozen=True)
class DatasetSpec:
    """A parsed ``hf:`` source (or a saved dataset given by its path)."""

    name: str
    config: str | None = None
    split: str | None = None  # None: the default, train

    def __str__(self) -> str:
        config = f":{self.config}" if self.config else ""
        split = f"@{self.split}" if self.split else ""
        return f"{HF_PREFIX}{self.name}{config}{split}"

    @property
    def path(self) -> Path | None:
        """The local folder, or None for a Hub name."""
        path = Path(self.name).expanduser()
        return path if path.exists() else None


def is_hf_spec(source) -> bool:
    return isinstance(source, str) and source.startswith(HF_PREFIX)


def parse_hf_spec(source: str) -> DatasetSpec:
    """Split ``hf:NAME[:CONFIG][@SPLIT]``; a config or split never holds ``/``."""
    rest = source[len(HF_PREFIX) :]
    name, at, split = rest.rpartition("@")
    if not at or "/" in split:
        name, split = rest, ""
    base, colon, config = name.rpartition(":")
    if colon and "/" not in config and base:
        name = base
    else:
        config = ""
    if not name.strip() or (at and not split) or (colon and not config and base):
        raise GptkilnError(
            f"{source!r}: not a dataset name; write hf:NAME[:CONFIG][@SPLIT], e.g. "
            "hf:roneneldan/TinyStories@train or hf:HuggingFaceFW/fineweb-edu:sample-10BT"
        )
    return DatasetSpec(name, config or None, split or None)


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder written by ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return path.is_dir() and (
        (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()
    )


# ------------------------------------------------------------------------------------ checking


def check_dataset(spec: DatasetSpec, text_field: str) -> None:
    """What can be refused before any text is read: ``datasets`` missing, a split or text column
    that a saved dataset does not have, a Hub name that cannot be reached."""
    path = spec.path
    if path is not None and is_saved_dataset(path):
        _check_saved(_saved_split_dir(path, spec), text_field, spec)
        return
    _datasets(spec)
    if path is None:
        hub_revision(spec.name)


def _check_saved(split_dir: Path, text_field: str, spec) -> None:
    pa = _pyarrow(spec)
    for file in _saved_files(split_dir):
        try:
            with pa.OSFile(str(file)) as f:
                schema = pa.ipc.open_stream(f).schema
        except (pa.ArrowException, OSError) as e:
            raise GptkilnError(
                f"{file}: not a readable Arrow file ({_first_line(e)}); save the dataset again"
            ) from None
        _check_column(schema.names, text_field, spec)
        kind = schema.field(text_field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise GptkilnError(
                f'{spec}: column "{text_field}" holds {kind}, not text; name the column that '
                "holds the text with --text-field"
            )


def _check_column(names, text_field: str, spec) -> None:
    if text_field not in names:
        raise GptkilnError(
            f'{spec}: no column "{text_field}" (columns: {", ".join(names) or "none"}); name the '
            "column that holds the text with --text-field"
        )


# ------------------------------------------------------------------------------------- reading


def dataset_texts(spec: DatasetSpec, text_field: str) -> Iterator[str]:
    """The non-empty strings of the text column, row by row."""
    path = spec.path
    if path is not None and is_saved_dataset(path):
        yield from _saved_texts(_saved_split_dir(path, spec), text_field, spec)
    else:
        yield from _streamed_texts(spec, text_field)


def _saved_split_dir(path: Path, spec: DatasetSpec) -> Path:
    """The folder of the split to read: the dataset itself, or one split of a DatasetDict."""
    if (path / "state.json").is_file():
        if spec.split and spec.split != DEFAULT_SPLIT:
            raise GptkilnError(f"{spec}: {path} holds one dataset, not splits; drop @{spec.split}")
        return path
    try:
        splits = json.loads((path / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise GptkilnError(f"{path}/dataset_dict.json: unreadable ({e}); save it again") from None
    split = spec.split or DEFAULT_SPLIT
    if split not in splits:
        raise GptkilnError(
            f"{spec}: no split {split!r} in {path} (splits: {', '.join(splits)}); pick one with "
            f"hf:{path}@SPLIT"
        )
    return path / split


def _saved_files(split_dir: Path) -> list[Path]:
    try:
        state = json.loads((split_dir / "state.json").read_text(encoding="utf-8"))
        return [split_dir / f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise GptkilnError(f"{split_dir}/state.json: unreadable ({e}); save it again") from None


def _saved_texts(split_dir: Path, text_field: str, spec) -> Iterator[str]:
    pa = _pyarrow(spec)
    _check_saved(split_dir, text_field, spec)
    for file in _saved_files(split_dir):
        with pa.OSFile(str(file)) as f:
            reader = pa.ipc.open_stream(f)
            index = reader.schema.get_field_index(text_field)
            while True:
                try:
                    batch = reader.read_next_batch()
                except StopIteration:
                    break
                except (pa.ArrowException, OSError) as e:
                    raise GptkilnError(
                        f"{file}: damaged Arrow data ({_first_line(e)}); save the dataset again"
                    ) from None
                for text in batch.column(index).to_pylist():
                    if text:
                        yield text


def _streamed_texts(spec: DatasetSpec, text_field: str) -> Iterator[str]:
    datasets = _datasets(spec)
    revision = None if spec.path is not None else hub_revision(spec.name)
    name = str(spec.path) if spec.path is not None else spec.name
    try:
        stream = datasets.load_dataset(
            name, spec.config, split=spec.split or DEFAULT_SPLIT, streaming=True, revision=revision
        )
        batches = iter(stream.iter(batch_size=BATCH_ROWS))
    except Exception as e:  # datasets raises many kinds (ValueError, ConnectionError, ...)
        raise _load_error(spec, e) from None
    checked = False
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as e:
            raise _load_error(spec, e) from None
        if not checked:
            _check_column(list(batch), text_field, spec)
            checked = True
        for text in batch[text_field]:
            if text is not None and not isinstance(text, str):
                raise GptkilnError(
                    f'{spec}: column "{text_field}" holds {type(text).__name__} values, not '
                    "text; name the column that holds the text with --text-field"
                )
            if text:
                yield text


# ------------------------------------------------------------------------- Hub and libraries


@functools.lru_cache(maxsize=32)
def hub_revision(name: str) -> str:
    """The commit the Hub holds now for dataset ``name`` (so every pass reads the same data)."""
    try:
        from huggingface_hub import HfApi

        return HfApi().dataset_info(name).sha
    except Exception as e:  # offline, no network, no such dataset, no access: one line each
        raise GptkilnError(
            f"hf:{name}: cannot reach it on the Hugging Face Hub ({type(e).__name__}: "
            f"{_first_line(e)}); check the name and the network (HF_HUB_OFFLINE must be unset), "
            "or download the dataset and give its folder"
        ) from None


def dataset_checksums(spec: DatasetSpec) -> dict[str, str]:
    """What identifies the data: SHA-256 of every file of a local dataset (by relative path), or
    the Hub revision of a Hub name."""
    import hashlib

    path = spec.path
    if path is None:
        return {str(spec): f"revision {hub_revision(spec.name)}"}
    if path.is_file():
        raise GptkilnError(f"{spec}: {path} is a file; give a dataset folder or a Hub name")
    sums = {}
    files = sorted(p for p in path.rglob("*") if p.is_file() and ".cache" not in p.parts)
    for file in files:
        digest = hashlib.sha256()
        with open(file, "rb") as f:
            for block in iter(lambda f=f: f.read(1 << 20), b""):
                digest.update(block)
        sums[file.relative_to(path).as_posix()] = digest.hexdigest()
    return sums


def _datasets(spec):
    try:
        import datasets
    except ImportError:
        raise GptkilnError(
            f"{spec}: reading Hugging Face datasets needs the datasets package; {_INSTALL}"
        ) from None
    datasets.disable_progress_bars()  # prepare draws its own
    return datasets


def _pyarrow(spec):
    try:
        import pyarrow as pa
        import pyarrow.ipc  # noqa: F401
    except ImportError:
        raise GptkilnError(
            f"{spec}: reading a saved dataset needs the pyarrow package; {_INSTALL}"
        ) from None
    return pa


def _load_error(spec: DatasetSpec, error: Exception) -> GptkilnError:
    where = "check the name, config and split" + (
        "" if spec.path is not None else ", and the network"
    )
    return GptkilnError(
        f"{spec}: cannot load it with datasets ({type(error).__name__}: {_first_line(error)}); "
        f"{where}"
    )


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
