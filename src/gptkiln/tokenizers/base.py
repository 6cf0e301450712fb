"""What every tokenizer kind shares: the `Tokenizer` interface, the names of the files a tokenizer
saves, and the byte-level alphabet of GPT-2's scheme (used by ``gpt2`` and ``bpe``)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

import numpy as np

EOT = "<|endoftext|>"
META_FILE = "tokenizer_meta.json"
CHAR_VOCAB_FILE = "char_vocab.json"
BPE_FILE = "tokenizer.json"
HF_CONFIG_FILE = "tokenizer_config.json"
HF_EXTRA_FILES = ("special_tokens_map.json", "generation_config.json", "chat_template.jinja")
"""A Hugging Face tokenizer's files beside tokenizer.json and tokenizer_config.json."""
TOKENIZER_KINDS = ("gpt2", "char", "bpe", "hf")
TOKENIZER_FILES = (META_FILE, CHAR_VOCAB_FILE, BPE_FILE, HF_CONFIG_FILE, *HF_EXTRA_FILES)


def restore_hint(path: Path) -> str:
    """How to get a tokenizer's file ``path`` back: in a run directory (a config.json beside
    it), from the copy its prepared data holds (``RUN/data``, which training saved it from) or
    its source; in a prepared-data folder, by preparing it again."""
    directory = path.parent
    if not (directory / "config.json").is_file():
        return "re-run `gptkiln prepare`"
    copy = directory / "data" / path.name
    if copy.is_file():
        return f"restore it: the run's prepared data holds the copy training saved it from, {copy}"
    return "restore it from the data the run was prepared from, or the model it was tuned from"


def byte_level_decoder(tokenizer_json: str) -> bool:
    """Whether a Hugging Face tokenizer.json decodes by its ``ByteLevel`` decoder alone (its
    text the UTF-8 of its tokens' bytes, nothing joined or stripped across tokens)."""
    decoder = json.loads(tokenizer_json).get("decoder") or {}
    return decoder.get("type") == "ByteLevel"


class Tokenizer(ABC):
    """What every tokenizer offers: text to ids and back, and saving to a directory.

    Attributes:
        kind: ``"gpt2"``, ``"char"``, ``"bpe"`` or ``"hf"``.
        vocab_size: number of ids; every id is in ``range(vocab_size)``.
        eot_id: id of ``<|endoftext|>`` (a Hugging Face tokenizer's EOS), or ``None`` when this
            tokenizer has no such token.
        decodes_in_pieces: ``decode(a + b) == decode(a) + decode(b)`` wherever ``decode(a)``
            ends in a whole character: true of characters and of byte-level BPE (its text is
            its tokens' bytes), not of a decoder that strips, joins or cleans up across
            tokens. `text_stream.TextStream` then decodes only the ids after the text it settled.
    """

    kind: str
    vocab_size: int
    eot_id: int | None
    decodes_in_pieces: bool = False

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Encode text; a literal ``<|endoftext|>`` in it becomes ``eot_id``."""

    @abstractmethod
    def encode_ordinary_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many plain texts at once (in parallel where the library can).

        ``<|endoftext|>`` in these texts is ordinary text, never ``eot_id``: documents cannot
        smuggle in a separator; the data pipeline inserts ``eot_id`` itself.
        """

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Turn ids back into text."""

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end a generated sequence: ``(eot_id,)`` (none without one); a Hugging
        Face tokenizer's every EOS id (Llama 3 Instruct ends a turn with ``<|eot_id|>`` and a
        text with ``<|end_of_text|>``)."""
        return () if self.eot_id is None else (self.eot_id,)

    @property
    def special_ids(self) -> frozenset[int]:
        """The ids that are markers, not text: the end-of-text id here; a Hugging Face
        tokenizer's every added token marked special (a chat template's ``<|im_start|>``...).
        A text decoded with ``skip_special_tokens`` leaves them out."""
        return frozenset(() if self.eot_id is None else (self.eot_id,))

    def encode_templated(self, text: str) -> list[int]:
        """The ids of a prompt rendered by a model's chat template, which holds its own special
        tokens; ``encode`` for kinds that add none of their own."""
        return self.encode(text)

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes one id stands for. A byte-level BPE id may hold part of a character
        (which ``decode([token_id])`` shows as U+FFFD); the ids of a text give back its bytes."""
        return self.decode([token_id]).encode("utf-8")

    def encode_ordinary_batch_arrays(
        self, texts: list[str], num_threads: int | None = None
    ) -> list[np.ndarray]:
        """:meth:`encode_ordinary_batch` as integer arrays, for writing ids to disk.

        Kinds whose library can return arrays directly override this to skip building Python
        ints: that is most of the cost of a pipeline that streams gigabytes. ``num_threads``
        (default: every core) bounds the threads of kinds that encode on a thread pool of their
        own (``gpt2``); the others ignore it.
        """
        return [np.asarray(ids, dtype=np.int64) for ids in self.encode_ordinary_batch(texts)]

    def char_counts(self) -> np.ndarray:
        """Characters each id adds to decoded text, ``(vocab_size,)`` int64; computed once.

        An id counts the characters whose first UTF-8 byte it holds, so over any run of ids that
        starts and ends between characters the counts add up to the characters of the decoded
        text, even where byte-level ids split a character. ``<|endoftext|>`` counts as one
        character: the separator between two documents, as a newline is between two lines.
        This is what bits per character divide by (`gptkiln.train.evaluate`).
        """
        if getattr(self, "_char_counts", None) is None:
            counts = self._count_chars()
            if self.eot_id is not None:
                counts[self.eot_id] = 1
            counts.setflags(write=False)
            self._char_counts = counts
        return self._char_counts

    def _count_chars(self) -> np.ndarray:
        """Characters of each id, ``(vocab_size,)`` int64 (the eot id is set afterwards); here
        each id decoded alone, right for kinds whose ids are whole characters."""
        return np.array([len(self.decode([i])) for i in range(self.vocab_size)], dtype=np.int64)

    def fingerprint(self) -> str:
        """A digest of what maps text to ids: equal exactly when two tokenizers give the same
        ids (a kind and size alone do not tell two BPEs or two char alphabets apart)."""
        return hashlib.sha256(f"{self.kind}\n{self._identity()}".encode()).hexdigest()

    def _identity(self) -> str:
        """The text a fingerprint is made of; every kind with state of its own extends it."""
        return f"{self.vocab_size} {self.eot_id}"

    def hf_json(self) -> str:
        """This tokenizer as a Hugging Face ``tokenizers`` file (the text of a tokenizer.json):
        the same ids for every text this tokenizer encodes, and the same text back; what an
        export writes for ``transformers`` (and what `gptkiln.tokenizers.HFTokenizer` reads).
        ``<|endoftext|>`` is a special added token."""
        raise NotImplementedError(f"the {self.kind} tokenizer has no Hugging Face form")

    def save(self, directory: str | os.PathLike) -> None:
        """Write ``tokenizer_meta.json`` and this kind's files into ``directory`` (created)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._save_files(directory)
        meta = {"kind": self.kind, "vocab_size": self.vocab_size, "eot_id": self.eot_id}
        (directory / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")

    def _save_files(self, directory: Path) -> None:  # noqa: B027 - optional hook
        """Write the files beyond the meta file (none by default)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eot_id={self.eot_id})"


def _lead_bytes_per_piece(pieces: Sequence[bytes]) -> np.ndarray:
    """For each byte string, how many of its bytes start a UTF-8 character (not ``0b10xxxxxx``):
    ``(len(pieces),)`` int64."""
    lengths = np.array([len(p) for p in pieces], dtype=np.int64)
    flat = np.frombuffer(b"".join(pieces), dtype=np.uint8)
    leads = np.concatenate([[0], np.cumsum((flat & 0xC0) != 0x80)])  # [k]: in the first k bytes
    ends = np.cumsum(lengths)
    return leads[ends] - leads[ends - lengths]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (from OpenAI's ``encoder.py``).

    Printable Latin-1 bytes map to themselves; the other 68 bytes (controls, space, ...) map to
    ``chr(256 + n)`` in byte order, so every vocab entry is a printable string.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + n)
            n += 1
    return mapping


@functools.lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {ch: b for b, ch in _bytes_to_unicode().items()}
