"""Streams of text pieces to streams of token ids, batch by batch, every core busy.

Pieces are grouped into batches of about ``batch_chars`` characters and each batch goes to the
tokenizer's parallel batch encoder (``encode_ordinary_batch_arrays``: tiktoken's threads for
``gpt2``, Rust threads for ``bpe``). The next batch is encoded on a helper thread (the encoders
release the GIL) while the caller writes the last one, so reading, encoding and writing overlap.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from gptkiln.tokenizers import Tokenizer


def batches(items: Iterable[Any], batch_chars: int, text=lambda item: item[-1]) -> Iterator[list]:
    """Lists of items whose texts (``text(item)``) add up to about ``batch_chars`` characters."""
    batch, size = [], 0
    for item in items:
        batch.append(item)
        size += len(text(item))
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def encoded_batches(
    items: Iterable[Any],
    tokenizer: Tokenizer,
    batch_chars: int,
    threads: int | None = None,
    text=lambda item: item[-1],
) -> Iterator[tuple[list, list[np.ndarray]]]:
    """``(batch, ids of each item)`` for batches of ``items``, the next one encoded ahead.

    ``text(item)`` is the text to encode (the last element of a tuple by default). ``threads``
    bounds the encoder's threads where the tokenizer takes it (``gpt2``).
    """
    # num_threads only when asked for: a Tokenizer subclass of its own may not take it
    options = {} if threads is None else {"num_threads": threads}

    def encode(batch: list) -> tuple[list, list[np.ndarray]]:
        return batch, tokenizer.encode_ordinary_batch_arrays([text(i) for i in batch], **options)

    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = None
        try:
            for batch in batches(items, batch_chars, text):
                future = pool.submit(encode, batch)
                if pending is not None:
                    yield pending.result()
                pending = future
            if pending is not None:
                yield pending.result()
                pending = None
        finally:
            if pending is not None:  # closed early: let the batch in flight finish, unread
                pending.cancel() or pending.exception()


def encoded_pieces(
    pieces: Iterable[tuple[bool, str]],
    tokenizer: Tokenizer,
    batch_chars: int,
    threads: int | None = None,
) -> Iterator[tuple[bool, np.ndarray, str]]:
    """``(starts_document, ids, text)`` for each ``(starts_document, text)`` piece, in order."""
    for batch, arrays in encoded_batches(pieces, tokenizer, batch_chars, threads):
        for (starts_document, text), ids in zip(batch, arrays, strict=True):
            yield starts_document, ids, text
