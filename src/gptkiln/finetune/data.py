"""Fine-tuning data: instruction entries and labelled texts, read and checked entry by entry,
split into train / validation / test.

- **Instructions** (`read_instructions`): a ``.json`` file holding a list of entries, or a
  ``.jsonl`` file with one entry a line; an entry is an object with text fields
  ``"instruction"`` and ``"output"`` (not empty) and ``"input"`` (may be empty or left out),
  the Alpaca format of the book's chapter 7. Other keys are ignored.
- **Labelled texts** (`read_labelled`): a ``.csv`` or ``.tsv`` file with a header row, or a
  ``.jsonl`` file of objects; one column holds the text, another the label (any text; the
  classes are the distinct labels, in sorted order, or the numbers 0..K-1 when every label is
  one of them), as in the book's chapter 6.

A bad entry is refused with one line that names the file, the entry (or line) and the fix.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptkiln.errors import GptkilnError

INSTRUCTION_SUFFIXES = (".json", ".jsonl")
LABELLED_SUFFIXES = (".csv", ".tsv", ".jsonl")
_ENTRY_HELP = 'each entry is {"instruction": "...", "input": "...", "output": "..."}'


def _readable(path: str | Path, suffixes: tuple[str, ...], what: str) -> Path:
    path = Path(path)
    if not path.is_file():
        state = "is a folder" if path.is_dir() else "does not exist"
        raise GptkilnError(f"--data {path} {state}; give a {' or '.join(suffixes)} file of {what}")
    if path.suffix.lower() not in suffixes:
        raise GptkilnError(
            f"--data {path}: unsupported file type {path.suffix or '(no suffix)'!r}; give a "
            f"{' or '.join(suffixes)} file of {what}"
        )
    return path


def file_sha256(path: str | Path) -> str:
    """A digest of a data file, so that a resumed run can tell it is reading the same data."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _json_records(path: Path, what: str) -> list[tuple[str, Any]]:
    """(where, value) for each entry of a .json list or each non-blank line of a .jsonl file."""
    from gptkiln.data.sources import read_utf8

    text = read_utf8(path)
    if path.suffix.lower() == ".json":
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise GptkilnError(
                f"{path}: not valid JSON ({e.msg}, line {e.lineno} column {e.colno}); fix the "
                f"file (a .json file holds one list of {what}; use .jsonl for one a line)"
            ) from None
        if not isinstance(values, list):
            raise GptkilnError(
                f"{path}: holds a JSON {type(values).__name__}, not a list of {what}; write "
                f"[{{...}}, {{...}}] (or one entry a line in a .jsonl file)"
            )
        count = len(values)
        return [(f"{path} entry {i} of {count:,}", v) for i, v in enumerate(values, start=1)]
    records = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            records.append((f"{path} line {number}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise GptkilnError(
                f"{path} line {number}: not valid JSON ({e.msg}, column {e.colno}); fix or "
                "remove that line"
            ) from None
    return records


def read_instructions(path: str | Path) -> list[dict[str, str]]:
    """The checked entries of an instruction file, each ``{"instruction", "input", "output"}``
    (a missing ``"input"`` becomes ``""``)."""
    path = _readable(path, INSTRUCTION_SUFFIXES, "instruction entries")
    entries = []
    for where, value in _json_records(path, "entries"):
        if not isinstance(value, dict):
            raise GptkilnError(
                f"{where}: a JSON {type(value).__name__}, not an object; {_ENTRY_HELP}"
            )
        fields = ("instruction", "input", "output")
        entry = {"input": ""} | {k: value[k] for k in fields if k in value}
        for key in fields:
            if key not in entry:
                keys = ", ".join(value) or "none"
                raise GptkilnError(f'{where}: no "{key}" (keys: {keys}); {_ENTRY_HELP}')
            if not isinstance(entry[key], str):
                raise GptkilnError(
                    f'{where}: "{key}" is a JSON {type(entry[key]).__name__}, not text; '
                    f"{_ENTRY_HELP}"
                )
            if key != "input" and not entry[key].strip():
                raise GptkilnError(f'{where}: "{key}" is empty; give it text, or remove the entry')
        entries.append(entry)
    if not entries:
        raise GptkilnError(f"{path} holds no entries; {_ENTRY_HELP}")
    return entries


@dataclass
class Labelled:
    """Texts with class ids, and the class names the ids stand for."""

    texts: list[str]
    labels: list[int]
    classes: list[str]


def read_labelled(path: str | Path, text_column: str = "text", label_column: str = "label"):
    """The checked texts and labels of a .csv, .tsv or .jsonl file, as `Labelled`."""
    path = _readable(path, LABELLED_SUFFIXES, "labelled texts")
    if path.suffix.lower() == ".jsonl":
        rows = _json_records(path, "rows")
    else:
        rows = _table_rows(path, text_column, label_column)
    texts, names = [], []
    for where, row in rows:
        if not isinstance(row, dict):
            raise GptkilnError(
                f"{where}: a JSON {type(row).__name__}, not an object; write each line as "
                f'{{"{text_column}": "...", "{label_column}": "..."}}'
            )
        for column in (text_column, label_column):
            if column not in row or row[column] is None:
                keys = ", ".join(row) or "none"
                raise GptkilnError(
                    f"{where}: no {column!r} (has: {keys}); name the columns with --text-column "
                    "and --label-column"
                )
        text, label = row[text_column], row[label_column]
        if not isinstance(text, str) or not text.strip():
            raise GptkilnError(
                f"{where}: the text ({text_column!r}) is empty or not text; give it text, or "
                "remove the row"
            )
        if isinstance(label, bool) or not isinstance(label, (str, int)) or not str(label).strip():
            raise GptkilnError(
                f"{where}: the label ({label_column!r}) is {label!r}; give a class name or number"
            )
        texts.append(text)
        names.append(str(label).strip())
    if not texts:
        raise GptkilnError(f"{path} holds no rows of text and label")
    classes = _classes(names)
    if len(classes) < 2:
        raise GptkilnError(
            f"{path}: every label is {classes[0]!r}; a classifier needs two classes at least"
        )
    index = {name: i for i, name in enumerate(classes)}
    return Labelled(texts, [index[n] for n in names], classes)


def _classes(names: list[str]) -> list[str]:
    """Class names by id: ``0..K-1`` when the labels are exactly those numbers, else sorted."""
    distinct = sorted(set(names))
    numbers = [str(i) for i in range(len(distinct))]
    if sorted(distinct, key=lambda n: (len(n), n)) == numbers:
        return numbers
    return distinct


def _table_rows(path: Path, text_column: str, label_column: str) -> list[tuple[str, dict]]:
    """(where, row) of a .csv / .tsv file with a header row."""
    from gptkiln.data.sources import read_utf8

    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    reader = csv.DictReader(io.StringIO(read_utf8(path), newline=""), delimiter=delimiter)
    header = reader.fieldnames or []
    missing = [c for c in (text_column, label_column) if c not in header]
    if missing:
        raise GptkilnError(
            f"{path}: no column {' or '.join(map(repr, missing))} in the header row "
            f"({', '.join(map(repr, header)) or 'empty'}); name the columns with --text-column "
            "and --label-column (the first row must name the columns)"
        )
    rows = []
    try:
        for row in reader:
            where = f"{path} line {reader.line_num}"
            if None in row:  # more fields than the header names
                sign = "tab" if delimiter == "\t" else "comma"
                raise GptkilnError(
                    f"{where}: {len(header) + len(row[None])} fields, the header has "
                    f"{len(header)}; quote a field that holds a {sign}"
                )
            if not any((v or "").strip() for v in row.values()):
                continue  # a blank line
            rows.append((where, row))
    except csv.Error as e:
        raise GptkilnError(f"{path} line {reader.line_num}: {e}; fix that line") from None
    return rows


def split_sizes(n: int, val_fraction: float, test_fraction: float) -> tuple[int, int, int]:
    """(train, val, test) sizes of ``n`` entries: ``int(n x fraction)`` for val and test (the
    book's ``int(len(data) * 0.1)``), the rest for training."""
    val, test = int(n * val_fraction), int(n * test_fraction)
    return n - val - test, val, test


def check_splits(path: str | Path, n: int, sizes: tuple[int, int, int], val_fraction: float):
    """Refuse a split with no validation entry (evaluation needs one) or no training entry."""
    train, val, _ = sizes
    if val == 0:
        raise GptkilnError(
            f"--data {path}: {n} entries x --val-fraction {val_fraction:g} leaves no validation "
            f"entry; raise --val-fraction to 1/{n} = {1 / n:.3g} or more, or give more data"
        )
    if train == 0:
        raise GptkilnError(
            f"--data {path}: --val-fraction and --test-fraction leave no training entry of {n}; "
            "lower them, or give more data"
        )
