"""Positions and masks: RoPE's tables and rotation (Llama 3 and Qwen3), the positions and
block-diagonal mask of sequences packed end to end in a row (fine-tuning's ``--pack``), and the
sliding windows a block may attend in (`GPTConfig.attention_windows`).

Used by `gptkiln.model` (whose namespace has the five it uses); plain functions of
tensors, with the shapes of `gptkiln.model`'s legend (B batch, T new tokens, S keys, hs head
size).
"""

from __future__ import annotations

import math

import torch


def rope_tables(
    head_size: int,
    context_length: int,
    theta: float = 10_000.0,
    scaling: dict[str, float] | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin of RoPE's angles for every position, (context_length, head_size) each,
    computed in float32.

    Rotary position embeddings (Su et al. 2021, https://arxiv.org/abs/2104.09864) turn pair i
    of a head's dimensions (dims i and i + hs/2, the "rotate half" layout of Llama, Qwen and
    the book) at position p by the angle p * theta^(-2i / hs): fast rotations for the first
    pairs, slow ones for the last. ``scaling`` (Llama 3.1's, keys as
    `gptkiln.config.ROPE_SCALING_KEYS`) slows the slowest frequencies down by ``factor`` and
    blends in between, to stretch a model trained on ``original_context_length`` tokens.
    The book's ``compute_rope_params`` (``theta_base``, ``freq_config``).
    """
    i = torch.arange(0, head_size, 2, device=device, dtype=torch.float32)  # (hs/2,): 2i
    inv_freq = 1.0 / theta ** (i / head_size)  # (hs/2,) radians per position
    if scaling is not None:
        inv_freq = _llama3_scaled(inv_freq, **scaling)
    positions = torch.arange(context_length, device=device, dtype=torch.float32)  # (T,)
    angles = positions[:, None] * inv_freq[None, :]  # (T, hs/2)
    angles = torch.cat([angles, angles], dim=1)  # (T, hs): pair i is dims i and i + hs/2
    return torch.cos(angles), torch.sin(angles)


def _llama3_scaled(
    inv_freq: torch.Tensor,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_context_length: int,
) -> torch.Tensor:
    """Llama 3.1's frequency scaling: wavelengths longer than original_context_length /
    low_freq_factor are divided by ``factor``, those shorter than original_context_length /
    high_freq_factor kept, those between blended linearly (Hugging Face's ``rope_type
    "llama3"``; the book's ``freq_config``)."""
    low_freq_wavelen = original_context_length / low_freq_factor
    high_freq_wavelen = original_context_length / high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # (hs/2,) positions per full turn
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_context_length / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth) * (inv_freq / factor) + smooth * inv_freq
    medium = (wavelen <= low_freq_wavelen) & (wavelen >= high_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, nh, T, hs) rotated by its positions' angles: cos and sin broadcast to it, e.g.
    (T, hs) or (B, 1, T, hs) (`rope_tables` rows picked by position).

    Each pair (x_i, x_{i+hs/2}) turns by its angle a: (x_i cos a - x_{i+hs/2} sin a,
    x_{i+hs/2} cos a + x_i sin a). A query at position m and a key at n then have the dot
    product of their unrotated forms turned by (m - n) * frequency: attention sees only how
    far apart they are. The book's ``apply_rope``; the result is in x's dtype.
    """
    x1, x2 = x.chunk(2, dim=-1)  # (B, nh, T, hs/2) each: the first and second halves
    rotated = torch.cat((-x2, x1), dim=-1)  # (B, nh, T, hs)
    return (x * cos + rotated * sin).to(x.dtype)


def packed_positions_and_mask(segments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (B, T) and attention mask (B, 1, T, T) of rows that hold several sequences end
    to end, ``segments`` (B, T) saying which one each token is of (equal ids adjacent): each
    sequence's positions start at 0, and a token attends the earlier tokens of its own sequence
    only, so each is computed as if alone (a block-diagonal causal mask)."""
    B, T = segments.shape
    at = torch.arange(T, device=segments.device)  # (T,)
    starts = torch.ones_like(segments, dtype=torch.bool)  # (B, T): a sequence's first token
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = torch.where(starts, at, 0).cummax(dim=1).values  # (B, T) its sequence's start
    same = segments[:, :, None] == segments[:, None, :]  # (B, T, T)
    causal = at[None, :] <= at[:, None]  # (T, T)
    return at - first, (same & causal)[:, None]  # (B, T), (B, 1, T, T)


def value_index(i: int, n: int, n_layer: int) -> int | None:
    """Which of ``n`` value embeddings block ``i`` takes: embedding i in the first n blocks,
    the same again in the last n (`GPTConfig.value_embeds`), none in between."""
    if i < n:
        return i
    return i - (n_layer - n) if i >= n_layer - n else None


def window_mask(
    mask: torch.Tensor | None,
    T: int,
    start_pos: int | torch.Tensor | None,
    window: int,
    device: torch.device,
) -> torch.Tensor | None:
    """``mask`` (None: causal) narrowed to the last ``window`` positions of each query, itself
    included (0: unchanged): True where the key's cache slot is within ``window`` of the
    query's. (B or 1, 1, T, S) like `GPT._positions_and_mask`'s."""
    if not window:
        return mask
    if isinstance(start_pos, torch.Tensor):
        slots = start_pos.to(device)[:, None, None] + torch.arange(T, device=device)[:, None]
    else:
        slots = (start_pos or 0) + torch.arange(T, device=device)[:, None]  # (T, 1)
    S = mask.size(-1) if mask is not None else (start_pos or 0) + T
    key = torch.arange(S, device=device)
    near = key > slots - window  # (T, S) or (B, T, S)
    if mask is None:
        near = near & (key <= slots)  # causal
    near = near.unsqueeze(-3)  # (1 or B, 1, T, S) after the batch dimension
    if near.dim() == 3:
        near = near[None]
    return near if mask is None else mask & near
