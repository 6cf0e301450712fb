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
from collections.abc import Callable, Sequence
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
        labelled = path.suffix.lower() in (".csv", ".tsv") and ".csv" not in suffixes
        raise GptkilnError(
            f"--data {path}: unsupported file type {path.suffix or '(no suffix)'!r}; give a "
            f"{' or '.join(suffixes)} file of {what}"
            + ("; for labelled texts pass --task classify" if labelled else "")
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
                f"{path}: not valid JSON ({_said(e)}, line {e.lineno} column {e.colno}); fix the "
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
                f"{path} line {number}: not valid JSON ({_said(e)}, column {e.colno}); fix or "
                "remove that line"
            ) from None
    return records


def _said(error: json.JSONDecodeError) -> str:
    """The JSON parser's words, whole: "Invalid control character at" is a raw tab or line
    break inside a string (an unclosed one, or one that should be written \\n)."""
    if error.msg == "Invalid control character at":
        return "a raw line break or tab inside a string: close the string, or write it \\n"
    return error.msg.removesuffix(" at")  # "Unterminated string starting at" ... column N


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
    if n < 2:
        raise GptkilnError(
            f"--data {path}: {n} {'entry' if n == 1 else 'entries'}: fine-tuning needs 2 at "
            "least, one to train on and one to validate with; give more data"
        )
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


# -- conversations and preference pairs -----------------------------------------------------------
RECORD_SUFFIXES = (".json", ".jsonl", ".parquet")
MESSAGE_ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant"}
SHAREGPT_ROLES["assistant"] = "assistant"
_CHAT_HELP = (
    'each record is {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, '
    '...]} or ShareGPT\'s {"conversations": [{"from": "human" | "gpt" | "system", "value": '
    '"..."}, ...]}'
)
_JSON_KINDS = {dict: "object", int: "number", float: "number", bool: "boolean"}
_PAIR_HELP = (
    'each record is {"prompt": "...", "chosen": "...", "rejected": "..."} (or messages lists '
    "for each; or chosen and rejected whole conversations that share their start)"
)


def data_digest(source: str | Path) -> str:
    """A digest of a data file, or of an ``hf:`` dataset's files (or Hub revision)."""
    from gptkiln.data import hub

    if hub.is_hf_spec(str(source)):
        sums = hub.dataset_checksums(hub.parse_hf_spec(str(source)))
        return hashlib.sha256(json.dumps(sums, sort_keys=True).encode()).hexdigest()
    return file_sha256(source)


def read_records(source: str | Path, what: str) -> list[tuple[str, Any]]:
    """(where, record) for each record of a .json / .jsonl / .parquet file or an ``hf:``
    dataset (``hf:NAME[:CONFIG][@SPLIT]``, loaded with ``datasets``: a local folder, or the Hub's
    cache)."""
    from gptkiln.data import hub

    if hub.is_hf_spec(str(source)):
        spec = hub.parse_hf_spec(str(source))
        datasets = hub._datasets(spec)
        name = str(spec.path) if spec.path is not None else spec.name
        try:
            rows = datasets.load_dataset(name, spec.config, split=spec.split or hub.DEFAULT_SPLIT)
        except Exception as e:  # datasets raises many kinds
            raise hub._load_error(spec, e) from None
        return [(f"{spec} row {i}", row) for i, row in enumerate(rows, start=1)]
    path = _readable(source, RECORD_SUFFIXES, what)
    if path.suffix.lower() != ".parquet":
        return _json_records(path, what)
    from gptkiln.data.parquet import _open

    rows = _open(path).read().to_pylist()
    return [(f"{path} row {i}", row) for i, row in enumerate(rows, start=1)]


def conversation_of(where: str, record: Any) -> tuple[list[dict[str, str]], str]:
    """A record's messages (``[{"role", "content"}, ...]``) and its format, ``"messages"`` or
    ``"sharegpt"``; one line naming the record for anything else."""
    if not isinstance(record, dict):
        raise GptkilnError(f"{where}: a {type(record).__name__}, not an object; {_CHAT_HELP}")
    if "messages" in record:
        return checked_messages(where, record["messages"], "messages"), "messages"
    if "conversations" in record:
        turns = record["conversations"]
        if not isinstance(turns, list):
            raise GptkilnError(f'{where}: "conversations" is not a list; {_CHAT_HELP}')
        messages = []
        for i, turn in enumerate(turns):
            if not isinstance(turn, dict) or turn.get("from") not in SHAREGPT_ROLES:
                got = turn.get("from") if isinstance(turn, dict) else turn
                raise GptkilnError(
                    f"{where}: conversations[{i}] is from {got!r}; ShareGPT turns are from "
                    f"{', '.join(SHAREGPT_ROLES)}"
                )
            messages.append({"role": SHAREGPT_ROLES[turn["from"]], "content": turn.get("value")})
        return checked_messages(where, messages, "conversations"), "sharegpt"
    keys = ", ".join(record) or "none"
    raise GptkilnError(f"{where}: no messages or conversations (keys: {keys}); {_CHAT_HELP}")


def checked_messages(
    where: str, messages: Any, field: str, help: str = _CHAT_HELP
) -> list[dict[str, str]]:
    """``messages`` as ``[{"role", "content"}]`` (other keys dropped), each checked: a role of
    `MESSAGE_ROLES`, text, and an assistant's not empty (it would teach an empty answer)."""
    if not isinstance(messages, list) or not messages:
        raise GptkilnError(f'{where}: "{field}" is not a list of messages; {help}')
    checked = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if role not in MESSAGE_ROLES:
            raise GptkilnError(
                f"{where}: {field}[{i}] has role {role!r}; roles are "
                f"{', '.join(MESSAGE_ROLES)} (fix or remove the record)"
            )
        if not isinstance(content, str):
            raise GptkilnError(
                f"{where}: {field}[{i}] content is a {type(content).__name__}, not text; "
                "give each message its text"
            )
        if role == "assistant" and not content.strip():
            raise GptkilnError(
                f"{where}: {field}[{i}] is an assistant's message with no text; give it its "
                "answer, or remove the record"
            )
        checked.append({"role": role, "content": content})
    return checked


def encoded_records(
    source: str | Path, what: str, records: Sequence, encode: Callable, *, first: int = 0
) -> list:
    """``encode`` of each of ``records`` (read one a record of ``source``, in order, from its
    record ``first``); one that fails is named by where its record is (``chat.jsonl line 18:
    ...``)."""
    out = []
    for i, record in enumerate(records, start=first):
        try:
            out.append(encode(record))
        except GptkilnError as e:
            where = read_records(source, what)[i][0]
            raise GptkilnError(f"{where}: {e}") from None
    return out


def read_conversations(source: str | Path) -> tuple[list[list[dict[str, str]]], str]:
    """The conversations of a chat data source, each with an assistant turn at least, and the
    format found (``"messages"``, ``"sharegpt"``, or both, ``"messages+sharegpt"``)."""
    conversations, formats = [], []
    for where, record in read_records(source, "conversations"):
        messages, fmt = conversation_of(where, record)
        if not any(m["role"] == "assistant" for m in messages):
            raise GptkilnError(
                f"{where}: no assistant message, nothing to learn; give each conversation an "
                "answer, or remove it"
            )
        conversations.append(messages)
        formats.append(fmt)
    if not conversations:
        raise GptkilnError(f"--data {source} holds no conversations; {_CHAT_HELP}")
    return conversations, "+".join(dict.fromkeys(formats))


@dataclass
class Preference:
    """A preference pair: the conversation so far and two answers to it, the better first."""

    prompt: list[dict[str, str]]
    chosen: str
    rejected: str


def read_preferences(source: str | Path) -> list[Preference]:
    """The pairs of a preference source: ``{prompt, chosen, rejected}`` records, each text or
    messages (TRL's conversational form: a messages prompt, one assistant message each); or
    ``{chosen, rejected}`` whole conversations that differ in their last assistant message."""
    pairs = [preference_of(where, r) for where, r in read_records(source, "preference pairs")]
    if not pairs:
        raise GptkilnError(f"--data {source} holds no preference pairs; {_PAIR_HELP}")
    return pairs


def preference_of(where: str, record: Any) -> Preference:
    """The pair of one record of `read_preferences` (``where``: its file and line), checked."""
    if not isinstance(record, dict) or "chosen" not in record or "rejected" not in record:
        keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
        raise GptkilnError(f"{where}: no chosen and rejected (has: {keys}); {_PAIR_HELP}")
    prompt = record.get("prompt")
    if prompt is None and "prompt" in record:
        raise GptkilnError(
            f'{where}: "prompt" is null; give the prompt (text or messages), or leave the '
            f"key out for chosen and rejected whole conversations; {_PAIR_HELP}"
        )
    if prompt is None:
        if isinstance(record["chosen"], str) or isinstance(record["rejected"], str):
            raise GptkilnError(  # text answers need the question they answer
                f'{where}: no "prompt" for the text answers chosen and rejected; give the '
                f"prompt, or whole conversations as chosen and rejected; {_PAIR_HELP}"
            )
        chosen = checked_messages(where, record["chosen"], "chosen", _PAIR_HELP)
        rejected = checked_messages(where, record["rejected"], "rejected", _PAIR_HELP)
        if chosen[:-1] != rejected[:-1] or "assistant" != chosen[-1]["role"]:
            raise GptkilnError(
                f"{where}: chosen and rejected conversations must share all but their last "
                f"message, an assistant's; {_PAIR_HELP}"
            )
        if rejected[-1]["role"] != "assistant":
            raise GptkilnError(f"{where}: the last message must be the assistant's")
        if len(chosen) < 2:
            raise GptkilnError(
                f"{where}: chosen and rejected are an answer alone, with no prompt before "
                f'it; give the messages it answers, or a "prompt"; {_PAIR_HELP}'
            )
        return Preference(chosen[:-1], chosen[-1]["content"], rejected[-1]["content"])
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    elif not isinstance(prompt, list):
        raise GptkilnError(
            f'{where}: "prompt" is a JSON {_JSON_KINDS.get(type(prompt), "value")}, not text '
            f"or a list of messages; {_PAIR_HELP}"
        )
    messages = checked_messages(where, prompt, "prompt", _PAIR_HELP)
    answers = [_answer(where, record[k], k) for k in ("chosen", "rejected")]
    return Preference(messages, *answers)


def _answer(where: str, value: Any, field: str) -> str:
    if isinstance(value, list):
        messages = checked_messages(where, value, field, _PAIR_HELP)
        if len(messages) != 1 or messages[0]["role"] != "assistant":
            raise GptkilnError(f'{where}: "{field}" must be one assistant message; {_PAIR_HELP}')
        value = messages[0]["content"]
    if isinstance(value, dict):
        raise GptkilnError(
            f'{where}: "{field}" is a JSON object; give text, or a list of one assistant '
            f"message; {_PAIR_HELP}"
        )
    if not isinstance(value, str) or not value.strip():
        raise GptkilnError(f'{where}: "{field}" is empty or not text; {_PAIR_HELP}')
    return value
