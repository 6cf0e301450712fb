"""``bpe``: a byte-level BPE trained on your corpus with Hugging Face ``tokenizers`` (works for any
script, e.g. Chinese, because it starts from the 256 bytes)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from gptkiln.errors import GptkilnError
from gptkiln.tokenizers.base import (
    BPE_FILE,
    EOT,
    Tokenizer,
    _lead_bytes_per_piece,
    _unicode_to_bytes,
    byte_level_decoder,
    restore_hint,
)

DEFAULT_BPE_VOCAB_SIZE = 8192
"""Vocabulary size of ``bpe`` without ``:N``: small enough to train in seconds on a few MB, and a
multiple of 64 so the embedding and output matmuls stay on fast GPU tile sizes."""

MAX_BPE_VOCAB_SIZE = 1 << 20
"""The largest ``bpe:N`` (1 Mi ids, five times GPT-4o's 200k); the trainer allocates per id."""

BPE_SLICE_CHARS = 2 << 20
"""Characters a BPE encodes per call of Hugging Face's batch encoder (see
`BPETokenizer.encode_ordinary_batch_arrays`)."""


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
        self.decodes_in_pieces = byte_level_decoder(hf_tokenizer.to_str())

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
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < self.vocab_size:  # Hugging Face's decode would drop it unsaid
                raise GptkilnError(
                    f"bpe tokenizer: id {i} is outside its vocabulary of {self.vocab_size}; "
                    "were these ids made by another tokenizer?"
                )
        return self._hf.decode(ids, skip_special_tokens=False)

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

    def hf_json(self) -> str:
        """Its own tokenizer.json: a ``bpe`` tokenizer is a Hugging Face one already."""
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
                f"{path}: not a readable tokenizers file ({e}); {restore_hint(path)}"
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


def train_bpe_tokenizer(texts: Iterable[str] | str, vocab_size: int) -> BPETokenizer:
    """Train a byte-level BPE with ``vocab_size`` ids (including ``<|endoftext|>``, id 0).

    The pre-tokenizer splits like GPT-2 (same regex) and maps bytes to printable characters, so any
    UTF-8 text round-trips exactly. A corpus too small for ``vocab_size`` gives fewer ids.
    ``texts``: the documents, or one str (one document).
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    check_bpe_vocab_size(vocab_size)
    if isinstance(texts, str):  # one text, not an iterable of one-character documents
        texts = [texts]
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
