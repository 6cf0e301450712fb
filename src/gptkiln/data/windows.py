"""Training samples over a token array: sliding windows (the book's) and random-offset windows.

Both datasets keep only the token array (a read-only ``np.memmap`` from
:func:`~gptkiln.data.prepare.load_prepared`, or any 1-D array) and compute each sample in
``__getitem__``, so a dataset over billions of tokens costs no memory. A sample is a pair of
``torch.long`` tensors ``(input_ids, target_ids)``, each ``(max_length,)``, the target shifted
one token to the right.
"""

from __future__ import annotations

import mmap
import os

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from gptkiln.errors import GptkilnError
from gptkiln.tokenizers import Tokenizer, load_tokenizer


def _as_tokens(tokens) -> np.ndarray:
    if isinstance(tokens, str):
        raise GptkilnError(
            "tokens: got text, not token ids; tokenize it first (tokenizer.encode(text)), or "
            "window it with windows_from_text(text, tokenizer, max_length, stride)"
        )
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.numpy()
    array = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens, dtype=np.int64)
    if array.ndim != 1:
        raise GptkilnError(f"tokens: expected a 1-D array of token ids, got shape {array.shape}")
    return array


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
            raise GptkilnError(f"{name}={value!r}: must be a positive integer")


class _TokenWindows(Dataset):
    """Shared parts: the token array, the window size, pickling a memmap by reference."""

    def __init__(self, tokens, max_length: int) -> None:
        _check_positive(max_length=max_length)
        self.tokens = _as_tokens(tokens)
        self.max_length = int(max_length)
        if len(self.tokens) < self.max_length + 1:
            raise GptkilnError(
                f"corpus of {len(self.tokens)} tokens is shorter than one window of "
                f"max_length+1 = {self.max_length + 1} tokens; use a smaller max_length "
                "(context length) or more text"
            )

    def _window(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = torch.from_numpy(self.tokens[start : start + self.max_length + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]  # (max_length,), (max_length,)

    def __getstate__(self) -> dict:
        # DataLoader workers started by spawn pickle the dataset: send an np.memmap as a file
        # reference (not a copy of the data); a view of a memmap is pickled as data.
        state = self.__dict__.copy()
        t = self.tokens
        if isinstance(t, np.memmap) and isinstance(t.base, mmap.mmap) and t.filename:
            state["tokens"] = ("memmap", t.filename, t.dtype.str, t.offset, t.shape)
        return state

    def __setstate__(self, state: dict) -> None:
        t = state["tokens"]
        if isinstance(t, tuple) and t[0] == "memmap":
            _, filename, dtype, offset, shape = t
            state["tokens"] = np.memmap(filename, dtype=dtype, mode="r", offset=offset, shape=shape)
        self.__dict__.update(state)


class SlidingWindowDataset(_TokenWindows):
    """Every window at ``0, stride, 2*stride, ...``; called ``GPTDatasetV1`` in the book.

    Sample ``k`` starts at ``i = k * stride`` for ``i`` in ``range(0, len(tokens) - max_length,
    stride)``: input ``tokens[i : i + max_length]``, target ``tokens[i + 1 : i + max_length + 1]``.

    Args:
        tokens: 1-D token ids (``np.memmap``, array, list or tensor).
        max_length: tokens per sample (the context length).
        stride: step between window starts; ``stride == max_length`` gives non-overlapping windows.
    """

    def __init__(self, tokens, max_length: int, stride: int) -> None:
        super().__init__(tokens, max_length)
        _check_positive(stride=stride)
        self.stride = int(stride)
        self._starts = range(0, len(self.tokens) - self.max_length, self.stride)

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._window(self._starts[index])  # range indexing raises IndexError past the end


class RandomWindowDataset(_TokenWindows):
    """``num_samples`` windows at random offsets (nanoGPT's ``get_batch``), indexable.

    The offset of sample ``k`` comes from ``np.random.default_rng([seed, k])`` alone, so any
    sample can be recomputed from ``(seed, k)``, in any order, in any worker.

    Args:
        tokens: 1-D token ids.
        max_length: tokens per sample.
        num_samples: length of the dataset (e.g. steps x batch size).
        seed: non-negative integer.
    """

    def __init__(self, tokens, max_length: int, num_samples: int, seed: int) -> None:
        super().__init__(tokens, max_length)
        _check_positive(num_samples=num_samples)
        if not isinstance(seed, int | np.integer) or seed < 0:
            raise GptkilnError(f"seed={seed!r}: must be a non-negative integer")
        self.num_samples = int(num_samples)
        self.seed = int(seed)

    def __len__(self) -> int:
        return self.num_samples

    def offset(self, index: int) -> int:
        """Where sample ``index`` starts, in ``[0, len(tokens) - max_length - 1]``."""
        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        index %= self.num_samples
        rng = np.random.default_rng([self.seed, index])
        return int(rng.integers(0, len(self.tokens) - self.max_length))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._window(self.offset(index))


class AlignedWindowDataset(RandomWindowDataset):
    """`RandomWindowDataset`'s windows, aligned to documents (modded-nanogpt's batches that
    start at a document boundary): a window that holds the end of one document (its end of text
    token ``eot_id``, after the window's first token) and the start of the next moves forward to
    start at that token, the boundary marker first, as a document's start is generated. A
    window inside one document stays where it was, and so does one that cannot move (the
    text's last).

    Args:
        tokens, max_length, num_samples, seed: as `RandomWindowDataset`'s.
        eot_id: the token that ends each document (`Tokenizer.eot_id`).
    """

    def __init__(self, tokens, max_length: int, num_samples: int, seed: int, eot_id: int) -> None:
        super().__init__(tokens, max_length, num_samples, seed)
        self.eot_id = eot_id

    def offset(self, index: int) -> int:
        start = super().offset(index)
        # the first end of text after the window's first token: found in the window alone (no
        # index of every document's end, which over billions of tokens would cost gigabytes)
        ends = np.flatnonzero(self.tokens[start + 1 : start + self.max_length] == self.eot_id)
        if len(ends):
            end = start + 1 + int(ends[0])
            if end + self.max_length < len(self.tokens):  # the next document's tokens follow
                return end
        return start


def create_dataloader(
    tokens,
    *,
    batch_size: int = 4,
    max_length: int = 256,
    stride: int = 128,
    shuffle: bool = True,
    drop_last: bool = True,
    seed: int | None = 123,
    num_workers: int = 0,
    tokenizer: Tokenizer | str | os.PathLike = "gpt2",
) -> DataLoader:
    """A DataLoader of ``(input_ids, target_ids)`` batches, each ``(batch_size, max_length)``.

    The book's ``create_dataloader_v1``, with its defaults: ``tokens`` are token ids, or text,
    which ``tokenizer`` (GPT-2's BPE, as the book's) tokenizes first (`windows_from_text`). The
    shuffle order comes from a ``torch.Generator`` seeded with ``seed`` (the book's 123): two
    loaders with the same seed give the same batches, whatever ran before. ``seed=None`` draws
    each pass's order from torch's global generator, as the book's loader does: under the
    book's ``torch.manual_seed`` calls, its batches (chapter 5's, in its own training loop).
    """
    _check_positive(batch_size=batch_size)
    if isinstance(tokens, str):
        dataset = windows_from_text(tokens, tokenizer, max_length, stride)
    else:
        dataset = SlidingWindowDataset(tokens, max_length, stride)
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=drop_last,
        num_workers=num_workers,
        generator=generator,
    )


def windows_from_text(
    text: str, tokenizer: Tokenizer | str | os.PathLike, max_length: int, stride: int
) -> SlidingWindowDataset:
    """Tokenize ``text`` (``<|endoftext|>`` allowed) and window it: the book's ``GPTDatasetV1``.

    ``tokenizer`` is a :class:`Tokenizer` or anything :func:`load_tokenizer` takes (``"gpt2"``).
    """
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = load_tokenizer(tokenizer)
    ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    return SlidingWindowDataset(ids, max_length, stride)
