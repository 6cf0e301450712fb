"""Prefix caching: the keys and values of prompt prefixes kept after their prefill, so a later
prompt that starts the same way (a chat resent whole each turn, an agent's long system prompt)
copies them into its row and prefills only the rest.

As vLLM's automatic prefix caching: a prompt is cut into blocks of ``block_tokens``; a block is
known by its tokens and the block before it (a chain, so a block's key stands for the whole
prefix up to its end, compared exactly, with no hash that could collide). A block holds every
layer's keys and values at its positions, (L, nkv, block, hs) each. What a prompt may reuse is
its longest chain of known blocks that leaves at least one token to prefill (the first token's
logits come from that prefill). The blocks live within ``max_bytes``; past it the least recently
used go first, a prefix's later blocks before its earlier ones (using a chain touches it
backwards), so a kept block's parent is always kept.

Reuse is invisible in the text: a token's keys and values depend only on the tokens up to it, so
a row's cache holds the same values whether its prefix came from here or from its own prefill
(up to float rounding of differently shaped matrix products, as between a batched and a lone
prefill).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

DEFAULT_BLOCK_TOKENS = 32
DEFAULT_MAX_BYTES = 256 << 20


@dataclass(eq=False)
class _Block:
    id: int
    k: torch.Tensor  # (L, nkv, block, hs)
    v: torch.Tensor

    @property
    def bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class PrefixCache:
    """Blocks of prompt keys and values over a model's static KV cache (`GPT.setup_cache`),
    owned by the batcher (only its worker thread calls these).

    Args:
        model: the GPT whose layers' ``kv_cache`` rows are read and written.
        block_tokens: tokens a block; smaller finds more of a prefix, larger copies in fewer
            pieces.
        max_bytes: the most the blocks hold; 0 turns caching off.
    """

    def __init__(
        self,
        model,
        *,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self.model, self.block_tokens, self.max_bytes = model, block_tokens, max_bytes
        self._blocks: collections.OrderedDict[tuple[int, tuple[int, ...]], _Block] = (
            collections.OrderedDict()
        )
        self._next_id = 1  # 0 is the chain's start
        self.bytes = 0
        self.hits = 0  # prompts that reused a prefix
        self.hit_tokens = 0  # prompt tokens not prefilled thanks to it
        self.lookups = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def _caches(self):
        return [block.attn.kv_cache for block in self.model.h]

    def _chain(self, prompt: list[int]) -> list[tuple[tuple[int, tuple[int, ...]], _Block]]:
        """The known blocks of ``prompt``'s longest cached prefix that leaves a token over."""
        found = []
        parent, n = 0, self.block_tokens
        for start in range(0, len(prompt) - 1 - n + 1, n):  # a block ends before the last token
            key = (parent, tuple(prompt[start : start + n]))
            block = self._blocks.get(key)
            if block is None:
                break
            found.append((key, block))
            parent = block.id
        return found

    def load(self, row: int, prompt: list[int]) -> int:
        """Copy the keys and values of ``prompt``'s longest cached prefix into cache row
        ``row`` at positions 0.. ; returns how many tokens they cover (0: none)."""
        if not self.enabled:
            return 0
        self.lookups += 1
        chain = self._chain(prompt)
        if not chain:
            return 0
        for key, _ in reversed(chain):  # the parents end up the most recent
            self._blocks.move_to_end(key)
        n = self.block_tokens
        for layer, cache in enumerate(self._caches()):
            for i, (_, block) in enumerate(chain):  # straight into the row: one copy
                cache.k[row, :, i * n : (i + 1) * n] = block.k[layer]
                cache.v[row, :, i * n : (i + 1) * n] = block.v[layer]
        length = len(chain) * n
        self.hits += 1
        self.hit_tokens += length
        return length

    def store(self, row: int, prompt: list[int]) -> None:
        """Keep the blocks of ``prompt`` (prefilled into row ``row``) not kept yet."""
        if not self.enabled:
            return
        caches = self._caches()
        parent, n, keys = 0, self.block_tokens, []
        for start in range(0, len(prompt) - n + 1, n):
            key = (parent, tuple(prompt[start : start + n]))
            block = self._blocks.get(key)
            if block is None:
                k = torch.stack([c.k[row, :, start : start + n] for c in caches])  # (L,nkv,n,hs)
                v = torch.stack([c.v[row, :, start : start + n] for c in caches])
                block = _Block(self._next_id, k, v)
                if block.bytes > self.max_bytes:
                    break
                self._next_id += 1
                self._blocks[key] = block
                self.bytes += block.bytes
            keys.append(key)
            parent = block.id
        for key in reversed(keys):
            self._blocks.move_to_end(key)
        while self.bytes > self.max_bytes and self._blocks:
            _, old = self._blocks.popitem(last=False)
            self.bytes -= old.bytes

    def clear(self) -> None:
        self._blocks.clear()
        self.bytes = 0
