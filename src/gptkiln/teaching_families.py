"""From GPT-2 to Llama 3 to Qwen3, one component at a time: the path of the book's bonus
material ("Converting GPT to Llama", "Llama 3.2 from scratch", "Qwen3 from scratch").

Each step swaps one of GPT-2's components for another and keeps the rest of the model:

1. `rms_norm`: RMSNorm replaces LayerNorm: scale by the root mean square, no mean, no bias.
2. `feed_forward`: a SiLU-gated MLP (SwiGLU) replaces expand-GELU-project.
3. `compute_rope_params` / `apply_rope`: rotary position embeddings (`rope_tables` with the
   book's arguments) turn each head's queries and keys
   by angles that grow with the position, instead of adding a learned position vector to the
   token's embedding; attention then sees how far apart two tokens are.
4. `grouped_query_attention`: several query heads share one key/value head, which divides the
   KV cache (`kv_cache_bytes_per_token`) by the group size. With steps 1 to 3 and no biases,
   this is Llama 3.
5. ``qk_norm=True``: an RMSNorm over each head's queries and keys before RoPE, and a head size
   of its own: Qwen3.

The components are the model's own (`gptkiln.model`): one implementation of each idea, so what
is read here is what trains and generates. The functions below build them from the book's
arguments (``emb_dim``, ``hidden_dim``, ``num_heads``, ``num_kv_groups``, ``head_dim``), and
``tests/test_teaching_families.py`` checks each equal to the book's package on the same inputs.
``python -m gptkiln.teaching_families`` prints the three 124M-sized models side by side
(`compare_families`).

Shape legend: B batch, T tokens, C embedding size (``emb_dim``), nh heads, nkv key/value heads
(the book's ``num_kv_groups``), hs head size.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from gptkiln import positions
from gptkiln.config import GPTConfig
from gptkiln.errors import GptkilnError
from gptkiln.model import (
    GPT,
    GroupedQueryAttention,
    RMSNorm,
    SwiGLU,
    rope_tables,
)

__all__ = [
    "RMSNorm",
    "SwiGLU",
    "GroupedQueryAttention",
    "rope_tables",
    "compute_rope_params",
    "apply_rope",
    "rms_norm",
    "feed_forward",
    "grouped_query_attention",
    "attend_with_rope",
    "kv_cache_bytes_per_token",
    "compare_families",
    "main",
]


def rms_norm(emb_dim: int, eps: float = 1e-5) -> RMSNorm:
    """Step 1: the book's ``RMSNorm(emb_dim, eps)`` (Llama 3: eps 1e-5, Qwen3: 1e-6).

    ``y = x / sqrt(mean(x**2) + eps) * weight`` over the last dimension, (..., C) -> (..., C).
    LayerNorm subtracts the mean, divides by the standard deviation and adds a bias; RMSNorm
    keeps only the division, by the root mean square. The book calls the weight ``scale``.
    """
    return RMSNorm(emb_dim, eps=eps)


def feed_forward(emb_dim: int, hidden_dim: int) -> SwiGLU:
    """Step 2: the book's ``FeedForward`` of its Llama and Qwen models (``fc1``, ``fc2``,
    ``fc3`` are ``gate_proj``, ``up_proj``, ``down_proj`` here), without biases.

    (B, T, C) -> (B, T, hidden_dim) twice: one through SiLU, x sigmoid(x), which gates the
    other elementwise; then back to (B, T, C). Three matrices where GPT-2's MLP has two, so
    ``hidden_dim`` is about 8/3 x C where GPT-2's is 4 x C, for the same parameters.
    """
    return SwiGLU(_config(emb_dim, hidden_dim=hidden_dim))


def compute_rope_params(
    head_dim: int,
    theta_base: float = 10_000,
    context_length: int = 4096,
    freq_config: dict[str, float] | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sin, (context_length, head_dim) each: the book's ``compute_rope_params``,
    its arguments in its order (``freq_config``: Llama 3.1's scaling, the keys of
    `gptkiln.config.ROPE_SCALING_KEYS`), computed by the model's own `rope_tables`."""
    cos, sin = rope_tables(head_dim, context_length, theta_base, freq_config)
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The book's ``apply_rope``: x (B, nh, T, hs) rotated by the first T rows of tables as
    `compute_rope_params` gives them (the model's `gptkiln.positions.apply_rope` takes the rows
    of its positions)."""
    T = x.shape[2]
    return positions.apply_rope(x, cos[:T], sin[:T])


def grouped_query_attention(
    d_in: int,
    num_heads: int,
    num_kv_groups: int,
    head_dim: int | None = None,
    qk_norm: bool = False,
    eps: float = 1e-6,
) -> GroupedQueryAttention:
    """Steps 4 and 5: the book's ``GroupedQueryAttention`` (``W_query``, ``W_key``,
    ``W_value``, ``out_proj`` are ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` here), without
    biases; run it as the book does with `attend_with_rope`.

    ``num_heads`` query heads of ``head_dim`` (None: d_in // num_heads) and ``num_kv_groups``
    key/value heads: each key/value head serves num_heads / num_kv_groups consecutive query
    heads. 1 group is multi-query attention; num_heads groups is GPT-2's multi-head attention.
    ``qk_norm``: Qwen3's RMSNorm (``eps``) over each head's queries and keys, before RoPE.
    """
    return GroupedQueryAttention(
        _config(
            d_in,
            n_head=num_heads,
            n_kv_head=num_kv_groups,
            head_dim=head_dim,
            qk_norm=qk_norm,
            eps=eps,
        )
    )


def attend_with_rope(
    attention: GroupedQueryAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Causal attention of x (B, T, C) with its tokens at positions 0 .. T-1 -> (B, T, C): the
    book's ``GroupedQueryAttention.forward(x, mask, cos, sin)`` with its causal mask, ``cos``
    and ``sin`` (at least T, hs) from `rope_tables` (the book's ``compute_rope_params``)."""
    T = x.size(1)
    return attention(x, rope=(cos[:T], sin[:T]))


def _config(
    emb_dim: int,
    hidden_dim: int = 4,
    n_head: int = 1,
    n_kv_head: int | None = None,
    head_dim: int | None = None,
    qk_norm: bool = False,
    eps: float = 1e-5,
) -> GPTConfig:
    """The smallest model config that holds a component of these sizes (the model's
    components are built from a config; one block, a vocabulary of one)."""
    return GPTConfig(
        vocab_size=1,
        n_layer=1,
        n_embd=emb_dim,
        n_head=n_head,
        n_kv_head=n_kv_head,
        head_dim=head_dim,
        family="qwen3" if qk_norm else "llama3",
        norm="rmsnorm",
        norm_eps=eps,
        positions="rope",
        mlp="swiglu",
        intermediate_size=hidden_dim,
        qk_norm=qk_norm,
        qkv_bias=False,
        bias=False,
    )


def kv_cache_bytes_per_token(config: GPTConfig, bytes_per_value: int = 4) -> int:
    """Bytes the KV cache holds for each token of a sequence: a key and a value of every
    key/value head in every layer, 2 x n_layer x nkv x hs values. Grouped-query attention's
    saving: GPT-2 124M (12 heads) needs 73,728 bytes a token in float32, the llama3-124m
    preset (4 key/value heads) a third of that."""
    return 2 * config.n_layer * config.kv_heads * config.head_size * bytes_per_value


def compare_families(
    names: tuple[str, ...] = ("gpt2", "llama3-124m", "qwen3-124m"),
) -> list[dict[str, Any]]:
    """One row per preset: its family's choices, parameters and KV cache per token (models
    built on the meta device: no memory, no initialisation)."""
    rows = []
    for name in names:
        config = GPTConfig.from_name(name)
        with torch.device("meta"):
            parameters = GPT(config).num_parameters()
        rows.append(
            {
                "preset": name,
                "family": config.family,
                "norm": config.norm,
                "positions": config.positions,
                "mlp": f"{config.mlp} {config.mlp_size}",
                "heads": f"{config.n_head} q / {config.kv_heads} kv x {config.head_size}",
                "qk_norm": config.qk_norm,
                "parameters": parameters,
                "kv_cache_bytes_per_token": kv_cache_bytes_per_token(config),
            }
        )
    return rows


def _print_table(rows: list[dict[str, Any]]) -> None:
    columns = list(rows[0])
    cells = [[f"{r[c]:,}" if isinstance(r[c], int) and r[c] > 1 else str(r[c]) for c in columns]
             for r in rows]  # fmt: skip
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    for row in [columns, *cells]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


def main(argv: list[str] | None = None) -> None:
    """``python -m gptkiln.teaching_families [PRESET ...]``: the `compare_families` table of
    those presets (default: gpt2, llama3-124m, qwen3-124m)."""
    names = tuple(sys.argv[1:] if argv is None else argv)
    _print_table(compare_families(names or ("gpt2", "llama3-124m", "qwen3-124m")))


if __name__ == "__main__":
    try:
        main()
    except GptkilnError as e:  # an unknown preset: one line and exit 2, as the CLI does
        print(f"gptkiln.teaching_families: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
