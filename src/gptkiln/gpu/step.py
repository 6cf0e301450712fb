"""The decode step with static shapes: one token a row, its position a device tensor, the KV
cache its full length, attention over every slot under a mask of those written; then the next
token chosen on the device. Nothing in it reads a value back to the host or makes a shape from
one, so ``torch.compile(..., fullgraph=True)`` traces it once for every position, and CUDA graphs
(``mode="reduce-overhead"``) replay it (`gptkiln.gpu.graphs`).

It runs the model's own code: `GPT.embed`, `GPT.run_blocks` (every family's blocks, grouped
heads, sliding windows) and `GPT.logits`, over `KVCache`\\ s made ``static``; what it adds is the
graph-friendly form of `GPT._positions_and_mask` for one token a row, each row at its own slot
and with its own left padding.

Shapes as `gptkiln.model`'s legend; b the rows of a bucket, S the cache's slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from gptkiln.logits_processors import apply_logit_bias, apply_penalties
from gptkiln.model import GPT, KVCache
from gptkiln.sampling import logits_to_probs

# -- sampling on the device: no host sync, no generator objects -------------------------------
# `sample_rows` draws (`draw`) from a torch.Generator a row: a compiled graph cannot hold one
# (dynamo breaks the graph at a generator).
# `sample_on_device` draws by the exponential race instead (gpt-fast's: argmax of p / q, q
# exponential, picks token i with probability p_i), its uniforms a hash of (the row's seed,
# the draw's number, the token id): pure integer ops that give the same numbers on any device,
# in any batch, eager or compiled. A seeded row's tokens are therefore reproducible, but not
# those `sample_rows` gives for the same seed (the same distribution, other draws); greedy
# (temperature 0) is the same argmax on both paths.
_MASK32 = 0xFFFFFFFF
# odd multipliers below 2**31, so that no product of a 32-bit value overflows int64
_HASH_MULTIPLIERS = (0x7FEB352D, 0x5BD1E995, 0x27D4EB2D)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of every element of x (int64 in [0, 2**32)), same shape:
    xor-shift and multiply rounds, each output bit depending on every input bit."""
    for multiplier in _HASH_MULTIPLIERS:
        x = x ^ (x >> 16)
        x = (x * multiplier) & _MASK32
    return x ^ (x >> 15)


def counter_uniform(seeds: torch.Tensor, draws: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform numbers in (0, 1), (B, V) float32, a function of each row's seed (B,) int64
    (>= 0), its draw number (B,) int64 (the position the token will take) and the token id:
    the same on every device and in every batch, with no generator state."""
    hi = mix32((seeds >> 32) & _MASK32)
    key = mix32(mix32((seeds & _MASK32) ^ hi) ^ (draws & _MASK32))  # (B,)
    ids = mix32(torch.arange(vocab, device=seeds.device, dtype=torch.int64))  # (V,)
    bits = mix32(ids[None, :] ^ key[:, None])  # (B, V) 32 random bits each
    return ((bits >> 8).float() + 0.5) * 2.0**-24  # 24 of them: exact in float32, never 0 or 1


def sample_on_device(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    seeds: torch.Tensor,
    draws: torch.Tensor,
    min_p: float | None = None,
) -> torch.Tensor:
    """`sample` without a host sync, for a compiled step: logits (B, V) -> (B,), argmax at
    temperature 0, else the exponential race over `logits_to_probs`' probabilities with
    `counter_uniform`'s numbers for each row's ``seeds`` and ``draws`` (B,)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = logits_to_probs(logits, temperature, top_k, top_p, min_p)  # (B, V)
    race = -torch.log(counter_uniform(seeds, draws, probs.size(-1)))  # (B, V) exponential(1)
    return (probs / race).argmax(dim=-1)  # a filtered token (p = 0) never wins


def static_positions_and_mask(
    slots: torch.Tensor, pads: torch.Tensor, cache_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (b, 1) and attention mask (b, 1, 1, S) of one new token a row written at cache
    slot ``slots`` (b,) of a row whose first ``pads`` (b,) slots are left padding: the token's
    position counts from the row's first real slot, and it attends the slots from there to its
    own, inclusive (`GPT._positions_and_mask`'s, with S the whole cache)."""
    key = torch.arange(cache_len, device=slots.device)  # (S,)
    mask = (key[None, :] <= slots[:, None]) & (key[None, :] >= pads[:, None])  # (b, S)
    return (slots - pads).clamp(min=0)[:, None], mask[:, None, None, :]


def decode_static(
    model: GPT, token: torch.Tensor, slots: torch.Tensor, pads: torch.Tensor
) -> torch.Tensor:
    """Logits (b, V) for the next token after ``token`` (b,), fed at cache slots ``slots`` (b,)
    of rows left-padded by ``pads`` (b,), through the model's static caches (`StaticState`
    installed). The same logits as `sampling.decode_one_token` on the model's own cache."""
    cache_len = model.h[0].attn.kv_cache.k.size(2)
    pos, mask = static_positions_and_mask(slots, pads, cache_len)
    idx = token[:, None]  # (b, 1)
    x, rope, values = model.embed(idx, pos)  # (b, 1, C)
    x = model.run_blocks(x, slots, mask, None, None, rope, values)  # (b, 1, C)
    return model.logits(x)[:, -1, :]  # (b, V)


@dataclass(frozen=True)
class DeviceSampling:
    """How a compiled step samples (`SampleConfig`'s fields; constants of its graph)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @classmethod
    def of(cls, cfg) -> DeviceSampling:
        """The settings of a `SampleConfig`."""
        return cls(**{f: getattr(cfg, f) for f in cls.__dataclass_fields__})

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1
        )


class StaticState(nn.Module):
    """Everything a compiled step of one bucket reads and writes, at fixed addresses (a CUDA
    graph replays on the same memory): ``rows`` x ``cache_len`` static `KVCache`\\ s, one a
    layer, and each row's token to feed, cache slot, left padding, seed, token counts and
    prompt's tokens (for penalties). Rows past a decoding's own are filler: every op of the
    step is row by row, so they never reach the real rows."""

    def __init__(self, model: GPT, rows: int, cache_len: int, dtype: torch.dtype, device):
        super().__init__()
        c = model.config
        self.caches = nn.ModuleList(
            KVCache(rows, cache_len, c.kv_heads, c.head_size, dtype, device, static=True)
            for _ in model.h
        )
        for name, shape, kind in (
            ("token", (rows,), torch.int64),
            ("slots", (rows,), torch.int64),
            ("pads", (rows,), torch.int64),
            ("seeds", (rows,), torch.int64),
            ("counts", (rows, c.vocab_size), torch.float32),
            ("in_prompt", (rows, c.vocab_size), torch.bool),
        ):
            self.register_buffer(name, torch.zeros(shape, dtype=kind, device=device), False)
        for tensor in self.buffers():  # a graph may keep their addresses (no copy a replay)
            torch._dynamo.mark_static_address(tensor)

    @property
    def rows(self) -> int:
        return self.token.size(0)

    @property
    def cache_len(self) -> int:
        return self.caches[0].k.size(2)

    @property
    def dtype(self) -> torch.dtype:
        return self.caches[0].k.dtype

    @property
    def device(self) -> torch.device:
        return self.caches[0].k.device

    @torch.no_grad()
    def load(
        self,
        model: GPT,
        pos: int,
        seeds: list[int],
        counts: torch.Tensor | None,
        in_prompt: torch.Tensor | None = None,
    ) -> None:
        """Take over a decoding whose prompt the model prefilled into its own cache (B rows, the
        first ``pos`` slots), the next token going to slot ``pos``: its keys and values copied
        into rows 0..B-1, its padding, ``seeds`` (B ints), ``counts`` (B, V) and ``in_prompt``
        (B, V) or zeros; then the model's attention layers use these caches (until
        `GPT.clear_cache`)."""
        own = model.h[0].attn.kv_cache
        B = own.k.size(0)
        for block, cache in zip(model.h, self.caches):
            cache.k[:B, :, :pos].copy_(block.attn.kv_cache.k[:, :, :pos])
            cache.v[:B, :, :pos].copy_(block.attn.kv_cache.v[:, :, :pos])
            block.attn.kv_cache = cache
        self.token.zero_()
        self.slots.fill_(pos)
        self.pads.zero_()
        if model.pad_lens is not None:
            self.pads[:B].copy_(model.pad_lens)
        self.seeds.zero_()
        self.seeds[:B].copy_(torch.tensor(seeds, dtype=torch.int64))
        self.counts.zero_()
        if counts is not None:
            self.counts[:B].copy_(counts)
        self.in_prompt.zero_()
        if in_prompt is not None:
            self.in_prompt[:B].copy_(in_prompt)


def graph_step(model: GPT, state: StaticState, sampling: DeviceSampling) -> torch.Tensor:
    """One decode step of a bucket, what is compiled: feed ``state.token`` at ``state.slots``,
    choose each row's next token (b,) on the device, and move the slots (and the counts) on."""
    logits = decode_static(model, state.token, state.slots, state.pads)  # (b, V)
    if sampling.penalised:
        logits = apply_penalties(
            logits,
            state.counts,
            sampling.presence_penalty,
            sampling.frequency_penalty,
            sampling.repetition_penalty,
            state.in_prompt,
        )
    logits = apply_logit_bias(logits, sampling.logit_bias)
    draws = state.slots - state.pads + 1  # the new token's position: the same in any batch
    token = sample_on_device(
        logits,
        sampling.temperature,
        sampling.top_k,
        sampling.top_p,
        state.seeds,
        draws,
        sampling.min_p,
    )
    state.slots.add_(1)
    if sampling.penalised:
        state.counts.scatter_add_(1, token[:, None], torch.ones_like(state.counts[:, :1]))
    return token
