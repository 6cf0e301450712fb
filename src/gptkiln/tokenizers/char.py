"""``char``: one id per distinct character of a corpus, sorted by code point (nanoGPT's
``shakespeare_char``), plus ``<|endoftext|>`` as the last id when asked for."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from gptkiln.errors import GptkilnError
from gptkiln.tokenizers.base import CHAR_VOCAB_FILE, EOT, Tokenizer, restore_hint


class CharTokenizer(Tokenizer):
    """One id per character, in code-point order; ``<|endoftext|>`` is the last id if present.

    Args:
        chars: the vocabulary; id ``i`` is ``chars[i]``. Sorted and distinct.
        with_eot: add ``<|endoftext|>`` as id ``len(chars)``.
    """

    kind = "char"
    decodes_in_pieces = True

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

    def hf_json(self) -> str:
        """A BPE with one token per character and no merges (``tokenizers`` splits a word into
        its characters and merges none), no pre-tokenizer, and a decoder that joins the tokens
        as they are (``Fuse``); ``<|endoftext|>`` a special added token. A character outside the
        vocabulary is dropped where gptkiln refuses it."""
        from tokenizers import AddedToken, decoders, models
        from tokenizers import Tokenizer as HFTokenizer

        vocab = {c: i for i, c in enumerate(self.chars)}
        hf = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
        hf.decoder = decoders.Fuse()
        if self.eot_id is not None:
            hf.add_special_tokens([AddedToken(EOT, special=True, normalized=False)])
        return hf.to_str()

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
                f"{path}: not a readable char vocabulary ({e}); {restore_hint(path)}"
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
