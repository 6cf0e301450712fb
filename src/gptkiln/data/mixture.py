"""Weighted mixtures of sources: documents drawn from several corpora in proportion to weights.

A mixture is a list of members, each a source (anything :mod:`gptkiln.data.sources` reads) with
a weight > 0 and its own text field: ``SOURCE:WEIGHT`` strings (``data/web:3``,
``hf:roneneldan/TinyStories@train:1``), or a YAML file holding such a list, each item either
that string or a mapping::

    - source: data/fineweb-edu      # a path is relative to the YAML file
      weight: 3
    - source: hf:wikimedia/wikipedia:20231101.en
      weight: 1
      text_field: text

How documents are drawn (:func:`interleave`): the weights, divided by their sum, are each
member's share of the mixture's *tokens*. Before every document, the members whose tokens so far
are at or below their share are "behind" (one always is); one of them is drawn at random, in
proportion to its weight, from a generator seeded with ``seed``, and its next whole document goes
in. So at every point no member is ahead of its share by a whole document of its own, nor
behind it by more than the others are ahead together (one document each: with two members,
within one document either way); the order is the same for the same seed, sources and
tokenizer, and another seed shuffles which member comes next. The mixture ends when the member
drawn has no document left: no document is repeated, and the other members are read only as far
as their share needs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gptkiln.data.records import DEFAULT_TEXT_FIELD
from gptkiln.errors import GptkilnError

_ENTRY_HELP = "write each as SOURCE:WEIGHT with a weight above 0, e.g. data/web.jsonl:3"


@dataclass(frozen=True)
class Member:
    """One source of a mixture: what to read, its weight, and which field holds its text."""

    source: str
    weight: float
    text_field: str = DEFAULT_TEXT_FIELD

    def __str__(self) -> str:
        return f"{self.source}:{self.weight:g}"


@dataclass
class Mixture:
    """Sources with weights (see the module docstring).

    Attributes:
        members: the sources, in the order given (which breaks no tie: draws are random).
        name: the YAML file the mixture came from, or None for a list given directly.
    """

    members: list[Member]
    name: str | None = None
    _checksums: dict[str, dict[str, str]] = field(default_factory=dict, repr=False)

    @property
    def shares(self) -> np.ndarray:
        """Each member's share of the tokens: the weights over their sum, ``(n,)`` float64."""
        weights = np.array([m.weight for m in self.members], dtype=np.float64)
        return weights / weights.sum()

    def __str__(self) -> str:
        return self.name or "mix " + " ".join(map(str, self.members))

    def check(self) -> None:
        """Each member's `check_source` (a missing file, a missing column, ... in one line)."""
        from gptkiln.data.sources import check_single_source

        for member in self.members:
            check_single_source(member.source, text_field=member.text_field)

    def member_checksums(self, member: Member) -> dict[str, str]:
        """`source_checksums` of one member (computed once per mixture)."""
        from gptkiln.data.sources import single_source_checksums

        if member.source not in self._checksums:
            self._checksums[member.source] = single_source_checksums(member.source)
        return self._checksums[member.source]

    def checksums(self) -> dict[str, str]:
        """The YAML file's SHA-256 (when there is one) and every member's files, keyed
        ``SOURCE/FILE``: equal exactly when the mixture would read the same data."""
        from gptkiln.data.sources import file_sha256

        sums = {} if self.name is None else {Path(self.name).name: file_sha256(Path(self.name))}
        for member in self.members:
            for key, digest in self.member_checksums(member).items():
                sums[f"{member.source}/{key}"] = digest
        return sums


# ------------------------------------------------------------------------------------- parsing


def load_mixture(
    spec: str | os.PathLike | Sequence[Any] | Mixture, *, text_field: str = DEFAULT_TEXT_FIELD
) -> Mixture:
    """A `Mixture` from a YAML file's path, or from a list of ``"SOURCE:WEIGHT"`` strings,
    ``(source, weight)`` pairs or ``{"source", "weight", "text_field"}`` mappings.
    ``text_field`` is the field of members that do not name their own."""
    if isinstance(spec, Mixture):
        return spec
    if isinstance(spec, (str, os.PathLike)):
        path = Path(spec)
        entries = _read_yaml(path)
        members = [_member(e, text_field, f"{path} item {i}", path.parent) for i, e in entries]
        mixture = Mixture(members, name=str(path))
    else:
        if isinstance(spec, Iterable):
            spec = list(spec)
        if not isinstance(spec, list) or not spec:
            raise GptkilnError(f"mix {spec!r}: give a list of sources with weights; {_ENTRY_HELP}")
        members = [_member(e, text_field, f"mix entry {e!r}", None) for e in spec]
        mixture = Mixture(members)
    seen = set()
    for member in mixture.members:
        if member.source in seen:
            raise GptkilnError(
                f"{mixture}: source {member.source} is listed twice; give it once, with the sum "
                "of the weights"
            )
        seen.add(member.source)
    return mixture


def parse_member(text: str, text_field: str = DEFAULT_TEXT_FIELD) -> Member:
    """``"SOURCE:WEIGHT"`` as a `Member` (the weight is after the last colon)."""
    return _member(text, text_field, f"mix entry {text!r}", None)


def _read_yaml(path: Path) -> list[tuple[int, Any]]:
    import yaml

    if not path.is_file():
        raise GptkilnError(f"{path}: no such mixture file; write a YAML list of SOURCE:WEIGHT")
    try:
        entries = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        problem = str(e).replace("\n", " ")
        raise GptkilnError(f"{path}: not valid YAML ({problem}); fix the file") from None
    if not isinstance(entries, list) or not entries:
        raise GptkilnError(
            f"{path}: a mixture is a YAML list of sources with weights (- data/web.jsonl:3, or "
            "- {source: data/web.jsonl, weight: 3}); fix the file"
        )
    return list(enumerate(entries, start=1))


def _member(entry: Any, text_field: str, where: str, base: Path | None) -> Member:
    """One entry (a string, a pair or a mapping) as a `Member`, its weight checked."""
    from gptkiln.data.sources import is_mixture

    own_field = text_field
    if isinstance(entry, str):
        source, colon, weight = entry.rpartition(":")
        if not colon or not source:
            raise GptkilnError(f"{where}: no weight; {_ENTRY_HELP}")
    elif isinstance(entry, (tuple, list)) and len(entry) == 2:
        source, weight = entry
    elif isinstance(entry, dict) and "source" in entry:
        unknown = set(entry) - {"source", "weight", "text_field"}
        if unknown or "weight" not in entry:
            raise GptkilnError(
                f"{where}: expected the keys source, weight and optionally text_field "
                f"(got {', '.join(map(str, entry))}); fix that entry"
            )
        source, weight = entry["source"], entry["weight"]
        own_field = str(entry.get("text_field") or text_field)
    else:
        raise GptkilnError(f"{where}: not a source with a weight; {_ENTRY_HELP}")
    source = str(source)
    weight = _weight(weight, source, where)
    if base is not None and not source.startswith("hf:") and source != "shakespeare":
        if not Path(source).is_absolute():
            source = str(base / source)
    if is_mixture(source):
        raise GptkilnError(f"{where}: {source} is a mixture itself; list its sources instead")
    return Member(source, weight, own_field)


def _weight(value: Any, source: str, where: str) -> float:
    try:
        weight = float(value)
    except (TypeError, ValueError):
        raise GptkilnError(f"{where}: weight {value!r} is not a number; {_ENTRY_HELP}") from None
    if not math.isfinite(weight) or weight <= 0:
        raise GptkilnError(
            f"{where}: weight {value!r} for {source}: must be above 0 (leave a source out "
            "rather than weigh it 0); " + _ENTRY_HELP
        )
    return weight


# ------------------------------------------------------------------------------------- drawing


def interleave(
    streams: Sequence[Iterator[tuple[bool, Any, int]]], shares: Sequence[float], seed: int
) -> Iterator[tuple[int, bool, Any, int]]:
    """Whole documents from several streams of pieces, in proportion to ``shares`` by size.

    Args:
        streams: per member, ``(starts_document, payload, size)`` pieces in order (``size``:
            what the shares count, e.g. the piece's tokens).
        shares: each member's share of the total size (summing to 1).
        seed: seeds the draw among the members that are behind their share.

    Yields:
        ``(member, starts_document, payload, size)`` for each piece taken, a document's pieces
        together; ends when the member drawn has run out (see the module docstring).
    """
    rng = np.random.default_rng(seed)
    draws = iter(())
    taken = [0] * len(streams)
    total = 0
    heads = [None] * len(streams)  # the first piece of each member's next document
    started = [False] * len(streams)
    while True:
        behind = [i for i, share in enumerate(shares) if taken[i] <= share * total]
        try:
            draw = next(draws)
        except StopIteration:  # random numbers a block at a time: one call per 4096 documents
            draws = iter(rng.random(4096).tolist())
            draw = next(draws)
        member = _pick(behind, shares, draw)
        if not started[member]:
            heads[member] = next(streams[member], None)
            started[member] = True
        head = heads[member]
        if head is None:
            return
        starts_document, payload, size = head
        yield member, True, payload, size
        taken[member] += size
        total += size
        heads[member] = None
        for starts_document, payload, size in streams[member]:
            if starts_document:
                heads[member] = (starts_document, payload, size)
                break
            yield member, False, payload, size
            taken[member] += size
            total += size


def _pick(behind: list[int], shares: Sequence[float], draw: float) -> int:
    """The member of ``behind`` that ``draw`` (uniform in [0, 1)) lands on, by share."""
    if len(behind) == 1:
        return behind[0]
    weights = [shares[i] for i in behind]
    point = draw * sum(weights)
    for i, weight in zip(behind, weights):
        point -= weight
        if point < 0:
            return i
    return behind[-1]


# ------------------------------------------------------------------------------------- writing


def member_pieces(mixture: Mixture, piece_chars: int) -> list[Iterator[tuple[bool, str]]]:
    """Each member's ``(starts_document, text)`` pieces (`iter_pieces` with its text field)."""
    from gptkiln.data.sources import iter_pieces

    return [
        iter_pieces(m.source, piece_chars=piece_chars, text_field=m.text_field)
        for m in mixture.members
    ]


def mixed_text(mixture: Mixture, seed: int, piece_chars: int) -> Iterator[str]:
    """The mixture's text drawn by *characters* (the pieces, in order): what a ``bpe``
    tokenizer is built from, before there are tokens to count. (A ``char`` one takes every
    member's characters: `write_mixture` encodes each member's next documents ahead of the
    draw.)"""
    streams = [
        ((s, t, len(t)) for s, t in pieces) for pieces in member_pieces(mixture, piece_chars)
    ]
    try:
        for _, _, text, _ in interleave(streams, mixture.shares, seed):
            yield text
    finally:
        for stream in streams:
            stream.close()


@dataclass
class MixedTokens:
    """What :func:`write_mixture` wrote: per split ``[train, val]`` ids and characters (a
    document separator counted as one character), and per member its documents, tokens and
    characters in the mixture."""

    tokens: list[int]
    characters: list[int]
    documents: int
    member_documents: list[int]
    member_tokens: list[int]
    member_characters: list[int]


def write_mixture(
    staging: Path,
    mixture: Mixture,
    tokenizer,
    dtype: np.dtype,
    val_fraction: float,
    seed: int,
    *,
    batch_chars: int,
    piece_chars: int,
    threads: int | None,
    bar,
) -> MixedTokens:
    """Draw the mixture by tokens into ``staging``'s ``train.bin`` and ``val.bin``.

    Each member's pieces are encoded in batches ahead of the draw (``batch_chars`` shared among
    the members), the documents drawn are appended to one file, joined by ``<|endoftext|>``,
    and the file is split at the document boundary nearest ``1 - val_fraction`` of the
    characters: the tail becomes ``val.bin``, and the file, cut there, ``train.bin``. (A single
    source is cut inside the straddling document, the book's way; a mixture is not, since its
    documents are tokenized before the split is known.)
    """
    from gptkiln.data.encoding import encoded_pieces

    n = len(mixture.members)
    per_member = max(1, batch_chars // n)
    streams = [
        (
            (s, (ids, text), len(ids))
            for s, ids, text in encoded_pieces(p, tokenizer, per_member, threads)
        )
        for p in member_pieces(mixture, piece_chars)
    ]
    written = _Written(staging, dtype, tokenizer.eot_id, n)
    try:
        for member, starts, (ids, text), _ in interleave(streams, mixture.shares, seed):
            written.add(member, starts, ids, text)
            bar.update(len(text) if text.isascii() else len(text.encode("utf-8")))
    finally:
        written.close()
        for stream in streams:
            stream.close()
    return written.split(val_fraction, mixture)


class _Written:
    """The mixture's ids in ``tokens.bin`` and where each document starts, in ids and in
    characters (``doc_tokens.bin``, ``doc_chars.bin``, int64), written a block at a time."""

    _FLUSH = 1 << 14  # pieces held before a write

    def __init__(self, staging: Path, dtype: np.dtype, eot_id: int | None, members: int) -> None:
        self.staging, self.dtype = staging, dtype
        self.eot = np.array([0 if eot_id is None else eot_id], dtype=dtype)
        self.files = {
            n: open(staging / n, "wb") for n in ("tokens.bin", "doc_tokens.bin", "doc_chars.bin")
        }
        self.ids: list[np.ndarray] = []
        self.doc_tokens: list[int] = []
        self.doc_chars: list[int] = []
        self.tokens = self.chars = self.documents = 0
        self.member_documents = [0] * members
        self.member_tokens = [0] * members
        self.member_chars = [0] * members

    def add(self, member: int, starts_document: bool, ids: np.ndarray, text: str) -> None:
        if starts_document:
            if self.documents:
                self.ids.append(self.eot)
                self.tokens += 1
                self.chars += 1
            self.doc_tokens.append(self.tokens)
            self.doc_chars.append(self.chars)
            self.documents += 1
            self.member_documents[member] += 1
        self.ids.append(ids.astype(self.dtype, copy=False))
        self.tokens += len(ids)
        self.chars += len(text)
        self.member_tokens[member] += len(ids)
        self.member_chars[member] += len(text)
        if len(self.ids) >= self._FLUSH:
            self.flush()

    def flush(self) -> None:
        if self.ids:
            np.concatenate(self.ids).tofile(self.files["tokens.bin"])
        np.array(self.doc_tokens, dtype=np.int64).tofile(self.files["doc_tokens.bin"])
        np.array(self.doc_chars, dtype=np.int64).tofile(self.files["doc_chars.bin"])
        self.ids, self.doc_tokens, self.doc_chars = [], [], []

    def close(self) -> None:
        if not all(f.closed for f in self.files.values()):
            self.flush()
        for f in self.files.values():
            f.close()

    def _boundary(self, val_fraction: float) -> tuple[int, int, int]:
        """The first validation document (the document start nearest ``1 - val_fraction`` of the
        characters, leaving one document at least on each side), where its ids start, and the
        characters from there on."""
        doc_chars = np.memmap(self.staging / "doc_chars.bin", dtype=np.int64, mode="r")
        doc_tokens = np.memmap(self.staging / "doc_tokens.bin", dtype=np.int64, mode="r")
        split_at = int((1.0 - val_fraction) * self.chars)
        after = int(np.searchsorted(doc_chars, split_at))
        candidates = {min(max(k, 1), self.documents - 1) for k in (after - 1, after)}
        first = min(candidates, key=lambda k: (abs(int(doc_chars[k]) - split_at), k))
        return first, int(doc_tokens[first]), self.chars - int(doc_chars[first])

    def split(self, val_fraction: float, mixture: Mixture) -> MixedTokens:
        """Cut ``tokens.bin`` into ``train.bin`` and ``val.bin`` between two documents."""
        if self.documents < 2:
            raise GptkilnError(
                f"{mixture}: the mixture drew {self.documents} document(s); splitting it into "
                "train and val takes two at least: give the sources more documents"
            )
        _, starts, val_chars = self._boundary(val_fraction)
        tokens = self.staging / "tokens.bin"
        size = self.dtype.itemsize
        with open(tokens, "rb") as src, open(self.staging / "val.bin", "wb") as dst:
            src.seek(starts * size)
            for block in iter(lambda: src.read(1 << 24), b""):
                dst.write(block)
        with open(tokens, "r+b") as f:
            f.truncate((starts - 1) * size)  # the separator before the first val document goes
        os.replace(tokens, self.staging / "train.bin")
        for name in ("doc_tokens.bin", "doc_chars.bin"):
            (self.staging / name).unlink()
        return MixedTokens(
            tokens=[starts - 1, self.tokens - starts],
            characters=[self.chars - val_chars - 1, val_chars],
            documents=self.documents,
            member_documents=self.member_documents,
            member_tokens=self.member_tokens,
            member_characters=self.member_chars,
        )


def check_source(source: str | os.PathLike | None, *, text_field: str = DEFAULT_TEXT_FIELD) -> None:
    """`check_single_source` of a source, or of each member of a mixture (a ``.yaml`` file),
    whose weights are checked too: what ``prepare`` and ``train`` check before any progress."""
    from gptkiln.data.sources import check_single_source, is_mixture

    if is_mixture(source):
        load_mixture(source, text_field=text_field).check()
    else:
        check_single_source(source, text_field=text_field)


def source_checksums(source: str | os.PathLike | None) -> dict[str, str]:
    """SHA-256 of every file of a source (`single_source_checksums`), or of a mixture: its YAML
    file's name and each member's ``SOURCE/FILE``."""
    from gptkiln.data.sources import is_mixture, single_source_checksums

    if is_mixture(source):
        return load_mixture(source).checksums()
    return single_source_checksums(source)
