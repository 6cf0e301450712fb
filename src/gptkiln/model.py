"""One decoder-only transformer for GPT-2, Llama 3 and Qwen3, its blocks composed from the
config's choices (`GPTConfig`: norm, positions, MLP, key/value heads, head size, q/k norm).

A family is a named set of those choices (``config.FAMILIES``), not a class of its own:

============  ===========  ==========  =========  ==================  ===============
family        norm         positions   MLP        attention           q/k norm
============  ===========  ==========  =========  ==================  ===============
gpt2          LayerNorm    learned     GELU       multi-head, fused   no
llama3        RMSNorm      RoPE        SwiGLU     grouped-query       no
qwen3         RMSNorm      RoPE        SwiGLU     grouped-query       RMSNorm per head
============  ===========  ==========  =========  ==================  ===============

GPT-2's parameter names are OpenAI's / Hugging Face's (``wte``, ``wpe``, ``h.N.ln_1``,
``attn.c_attn``, ``attn.c_proj``, ``ln_2``, ``mlp.c_fc``, ``mlp.c_proj``, ``ln_f``,
``lm_head``; a classifier's head is ``score``, as in ``GPT2ForSequenceClassification``) so
checkpoints map one to one. Llama and Qwen keep the same top level (``wte``, ``h.N.ln_1``,
``h.N.ln_2``, ``ln_f``, ``lm_head``; no ``wpe``) and use Hugging Face's role names inside a
block (``attn.q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``, ``k_norm``;
``mlp.gate_proj``, ``up_proj``, ``down_proj``), so that LoRA targets and weight mapping read
the same as theirs. Every choice is made when the model is built: a GPT-2 forward runs exactly
the code it ran before the other families existed.

This file imports only torch and the config: devices, dtypes, compilation, parallelism and
decoding kernels are applied to a built model from outside (a graph that ``torch.compile``
traces for the CPU only spells GELU and short attention out: see `_fuse_on_cpu`; an eager
bf16 training step on the CPU spells short attention out too: `_explicit_for_grad`).

Shape legend: B batch, T time (new tokens), S keys attended (cache length), C channels
(``n_embd``), nh heads, nkv key/value heads (nh for GPT-2), hs head size (C // nh unless the
config sets ``head_dim``), V vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptkiln.config import GPTConfig
from gptkiln.losses import cross_entropy
from gptkiln.positions import (
    apply_rope,
    packed_positions_and_mask,
    rope_tables,
    value_index,
    window_mask,
)


class Linear(nn.Linear):
    """``nn.Linear`` under the model's own name (same parameters, same state dict): the products
    of the blocks and the head, which a decode backend may run by other kernels from outside
    (`gptkiln.cpu.prepare_for_decoding`); a classifier's ``score`` stays a plain ``nn.Linear``."""


class KVCache(nn.Module):
    """Pre-allocated keys and values of one attention layer, written in place as tokens arrive.

    Static shapes (as in gpt-fast): nothing is concatenated or re-allocated per decode step.
    It holds the key/value heads, nkv: with grouped-query attention fewer than the query heads,
    which divides the cache by n_head / n_kv_head (the heads are expanded only to attend).

    ``static``: a step with per-row positions gets every slot back (S = S_max) instead of those
    up to the furthest row's end, so its shapes never depend on the positions' values and one
    compiled graph serves them all (`gptkiln.gpu`); its caller masks the slots not written.
    """

    def __init__(
        self,
        batch_size: int,
        max_seq_len: int,
        n_head: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        static: bool = False,
    ):
        super().__init__()
        shape = (batch_size, n_head, max_seq_len, head_size)  # (B, nkv, S_max, hs)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.static = static

    def update(
        self,
        start: int | torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rows: slice | torch.Tensor | None = None,
    ):
        """Store k, v (B, nkv, T, hs) at positions start..start+T; return all keys/values so far.

        ``start`` is one position for every row, or a (B,) tensor of each row's own (continuous
        batching: rows hold sequences of different lengths); then S is the furthest row's end.
        ``rows`` (a slice or index tensor) picks the cache rows that k and v belong to; None: the
        first B.
        """
        rows = slice(0, k.size(0)) if rows is None else rows
        if not isinstance(start, torch.Tensor):
            end = start + k.size(2)
            self.k[rows, :, start:end] = k
            self.v[rows, :, start:end] = v
            return self.k[rows, :, :end], self.v[rows, :, :end]  # (B, nkv, S, hs) with S = end
        start = start.to(k.device)
        at = start[:, None] + torch.arange(k.size(2), device=k.device)  # (B, T) positions
        row = torch.arange(self.k.size(0), device=k.device)[rows][:, None]  # (B, 1)
        self.k[row, :, at] = k.transpose(1, 2)  # (B, T, nkv, hs) written at (row, :, position)
        self.v[row, :, at] = v.transpose(1, 2)
        if self.static:  # no read of the positions' values: the graph-friendly form
            return self.k[rows], self.v[rows]  # (B, nkv, S_max, hs)
        end = int(at.max()) + 1
        return self.k[rows, :, :end], self.v[rows, :, :end]  # (B, nkv, S, hs)


class Attention(nn.Module):
    """What every attention layer shares: the KV cache slot, dropout, and `attend`, which picks
    the kernel (SDPA, or the explicit softmax when weights are asked for or a CPU graph is
    compiled). `CausalSelfAttention` (GPT-2) and `GroupedQueryAttention` (Llama, Qwen) add
    their projections."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.kv_heads
        self.head_size = config.head_size
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.use_sdpa = config.attention == "sdpa"
        self.grouped = self.n_kv_head != self.n_head  # SDPA's enable_gqa
        self.resid_dropout = nn.Dropout(config.dropout)
        # value embeddings (config.value_embeds): v = a v + b e, a and b learned, per block
        self.value_mix = nn.Parameter(torch.full((2,), 0.5)) if config.value_embeds else None
        # A submodule slot from the start, so that setting and clearing the cache leaves the
        # module's structure as it was: a compiled training step is not recompiled after a sample.
        self.kv_cache: KVCache | None
        self.register_module("kv_cache", None)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        start_pos: int | torch.Tensor | None,
        mask: torch.Tensor | None,
        attentions: list[torch.Tensor] | None,
    ) -> torch.Tensor:
        """softmax(q k^T / sqrt(hs)) v: q (B, nh, T, hs), k and v (B, nkv, S, hs) ->
        (B, nh, T, hs); arguments as `CausalSelfAttention.forward`'s.

        With fewer key/value heads than query heads SDPA expands them itself (``enable_gqa``):
        measured on the 2-core CPU at a decode step (12 query and 4 key/value heads of 64,
        batch 1), 15 against 31 us with the keys repeated first at S = 64, 34 against 78 at 256,
        91 against 1,200 at 1,024.
        """
        T = q.size(2)
        dropout_p = self.dropout if self.training else 0.0
        # A short full-sequence forward compiled for the CPU spells attention out (see
        # _fuse_on_cpu): inductor fuses its scale, mask and softmax; SDPA stays one opaque call.
        # So does a short bf16 one on the CPU that wants a gradient (see _explicit_for_grad).
        spelled_out = _fuse_on_cpu(q, T) or _explicit_for_grad(q, T)
        if (
            self.use_sdpa
            and attentions is None
            and not (mask is None and start_pos is None and spelled_out)
        ):
            # a plain bool: under dynamic shapes `T > 1` is symbolic, which SDPA refuses
            is_causal = True if mask is None and T > 1 else False
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                enable_gqa=self.grouped,
            )
        return explicit_attention(q, k, v, mask, dropout_p, attentions)

    def mix_values(self, v: torch.Tensor, value_embed: torch.Tensor | None) -> torch.Tensor:
        """v (B, nkv, T, hs), with a value embedding (B, T, nkv * hs) mixed in where this block
        takes one (`GPTConfig.value_embeds`)."""
        if value_embed is None:
            return v
        B, _, T, hs = v.shape
        e = value_embed.view(B, T, self.n_kv_head, hs).transpose(1, 2)
        return self.value_mix[0] * v + self.value_mix[1] * e.to(v.dtype)


class CausalSelfAttention(Attention):
    """GPT-2's multi-head causal self-attention, with one fused query/key/value projection
    (``c_attn``) and the output projection ``c_proj``.

    The book's ``MultiHeadAttention`` computes the same thing with three separate projections
    (``W_query``, ``W_key``, ``W_value``); ``c_attn`` holds them stacked, which is one matmul.
    """

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd, bias=config.qkv_bias)
        self.c_proj = Linear(config.n_embd, config.n_embd)

    def forward(
        self,
        x: torch.Tensor,
        start_pos: int | torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        rows: slice | torch.Tensor | None = None,
        attentions: list[torch.Tensor] | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        value_embed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C).

        Args:
            start_pos: position of x's first token when the KV cache is in use (an int, or a
                (B,) tensor of each row's own), else None.
            mask: boolean (B or 1, 1, T, S), True where a query may attend a key; None means
                plain causal attention over the T keys (or, for T = 1, attend to every key).
            rows: the cache rows x's rows are (`KVCache.update`); None: the first B.
            attentions: a list to append this layer's attention weights (B, nh, T, S) to; given,
                the explicit path runs (SDPA never forms the weights).
            rope: unused: GPT-2's positions are learned embeddings, added at the input (the
                argument is there so that every block calls its attention alike).
            value_embed: this block's value embedding of x's tokens (`mix_values`), or None.
        """
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = self.mix_values(v, value_embed)
        if self.kv_cache is not None and start_pos is not None:
            k, v = self.kv_cache.update(start_pos, k, v, rows)  # (B, nh, S, hs)
        y = self.attend(q, k, v, start_pos, mask, attentions)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, nh, hs) -> (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class GroupedQueryAttention(Attention):
    """Llama's and Qwen's attention: separate query, key and value projections (``q_proj``,
    ``k_proj``, ``v_proj``) to ``n_head`` query heads and ``n_kv_head`` key/value heads of
    ``head_size`` each, RoPE on queries and keys, and ``o_proj`` back to C.

    Grouped-query attention (Ainslie et al. 2023, https://arxiv.org/abs/2305.13245): each
    key/value head serves n_head / n_kv_head consecutive query heads (key head j the query
    heads j*g .. j*g + g-1, g the group size: the book's ``repeat_interleave``), so the KV
    cache holds n_kv_head heads; n_kv_head = n_head is multi-head attention, 1 multi-query.
    With ``qk_norm`` (Qwen3) each head's queries and keys go through an RMSNorm of their own
    (``q_norm``, ``k_norm``, weights shared by the heads) before RoPE, which keeps the
    attention logits from growing large. The book's ``GroupedQueryAttention`` (``W_query``,
    ``W_key``, ``W_value``, ``out_proj``, ``num_kv_groups`` = n_kv_head).
    """

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        C, hs = config.n_embd, self.head_size
        self.q_proj = Linear(C, self.n_head * hs, bias=config.qkv_bias)
        self.k_proj = Linear(C, self.n_kv_head * hs, bias=config.qkv_bias)
        self.v_proj = Linear(C, self.n_kv_head * hs, bias=config.qkv_bias)
        self.o_proj = Linear(self.n_head * hs, C, bias=config.bias)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(hs, eps=config.norm_eps)
            self.k_norm = RMSNorm(hs, eps=config.norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        start_pos: int | torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        rows: slice | torch.Tensor | None = None,
        attentions: list[torch.Tensor] | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        value_embed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C); arguments as `CausalSelfAttention.forward`'s, and
        ``rope``: the cos and sin of x's positions, (1 or B, 1, T, hs) each (`GPT.rope_at`);
        None: no rotation. ``attentions`` gets per-query-head weights (B, nh, T, S)."""
        B, T, _ = x.shape
        hs = self.head_size
        q = self.q_proj(x).view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, self.n_kv_head, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, self.n_kv_head, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.mix_values(v, value_embed)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.kv_cache is not None and start_pos is not None:
            k, v = self.kv_cache.update(start_pos, k, v, rows)  # (B, nkv, S, hs)
        y = self.attend(q, k, v, start_pos, mask, attentions)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * hs)  # (B, T, nh * hs)
        return self.resid_dropout(self.o_proj(y))


def explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    dropout_p: float,
    weights_out: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(hs)) v, spelled out: the math that SDPA fuses.

    q (B, nh, T, hs), k and v (B, nkv, S, hs) -> (B, nh, T, hs). Scale *before* softmax
    (scaling the probabilities afterwards is a classic bug: rows would no longer sum to 1).
    With fewer key/value heads than query heads (grouped-query attention) each is repeated
    for its group of nh / nkv query heads first, as the book's ``repeat_interleave``.
    ``weights_out``, if a list, gets the attention weights (B, nh, T, S), before dropout.
    """
    if k.size(-3) != q.size(-3):
        group = q.size(-3) // k.size(-3)
        k = k.repeat_interleave(group, dim=-3)  # (B, nh, S, hs): [K1, K1, K2, K2] for group 2
        v = v.repeat_interleave(group, dim=-3)  # (B, nh, S, hs)
    T, S = q.size(-2), k.size(-2)
    attn_scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, nh, T, S)
    given_mask = mask is not None
    if mask is None and T > 1:  # causal: every query sees at least its own key
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
    if mask is not None:
        attn_scores = attn_scores.masked_fill(~mask, float("-inf"))
    attn_weights = torch.softmax(attn_scores, dim=-1)
    if given_mask and T > 1:
        # A left-padded slot's query may see no key at all: its row is all -inf and softmax
        # gives NaN, which the next layer would spread to the row's real tokens through V
        # (0 x NaN). Such a row attends to nothing instead, as SDPA does.
        attn_weights = attn_weights.masked_fill(~mask.any(-1, keepdim=True), 0.0)
    if weights_out is not None:
        weights_out.append(attn_weights)
    # a branch, not F.dropout(training=dropout_p > 0): under dynamic shapes that is symbolic
    if dropout_p > 0:
        attn_weights = F.dropout(attn_weights, p=dropout_p)
    return attn_weights @ v  # (B, nh, T, hs)


class MLP(nn.Module):
    """GPT-2's position-wise feed-forward: expand 4x (``config.mlp_size``), GELU, project back;
    the book's ``FeedForward`` (its ``layers[0]`` is ``c_fc``, ``layers[2]`` ``c_proj``; the
    dropout after it is the book's ``drop_shortcut`` on this branch).

    GELU is GPT-2's tanh approximation, the book's ``GELU`` class, unless ``config.gelu`` is
    ``"exact"`` (the erf form, nanoGPT's ``nn.GELU()``; in this CPU build ~45% less time than
    the tanh one, forward and backward).
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = Linear(config.n_embd, config.mlp_size)
        self.c_proj = Linear(config.mlp_size, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)
        self.approximate = "tanh" if config.gelu == "tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        if self.approximate == "tanh" and _fuse_on_cpu(h):
            h = gelu_tanh_by_sigmoid(h)
        else:
            h = F.gelu(h, approximate=self.approximate)
        return self.dropout(self.c_proj(h))


RESIDUAL_PROJECTIONS = ("c_proj", "o_proj", "down_proj")
"""The layers that write into the residual stream (attention output, MLP output), whose
initial weights ``init="gpt2"`` scales down by 1/sqrt(2 n_layer)."""


def block_linears(config: GPTConfig) -> tuple[str, ...]:
    """The names of a block's linear layers for this config, in the order of the block's
    state dict: GPT-2's four or Llama's / Qwen's seven (for quantization and LoRA targets)."""
    if config.family == "gpt2":
        return ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    attn = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj")
    return (*attn, "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


# The longest context for which a compiled CPU graph spells attention out. Measured on a 2-core
# Zen 4 EPYC, compiled training steps with only the attention switched (explicit against SDPA):
# +11% at T = 64 (the baby preset), +1% at T = 128 (mini), -10% at T = 256 (4 x 128 wide),
# -3% at 124M, T = 256.
FUSED_ATTENTION_MAX_T = 128


# The longest context for which an eager bf16 forward on the CPU that wants a gradient (training)
# spells attention out: SDPA's CPU kernel (flash) computes bf16's backward several times slower
# than the matmuls and softmax do at short contexts. Measured on the 2-core Zen 4 EPYC, one
# thread, causal attention of 4 query and 2 key/value heads of 32 in bf16, forward and backward
# (bench/README.md, "The speedrun recipe, fourth round"): 7.9 against 3.0 ms at T = 64 (batch
# 12), 9.2 against 7.2 at 256 (batch 3), 18.1 against 18.7 at 512, 22.4 against 33.2 at 1,024;
# in fp32, and without a gradient, SDPA is the faster at every T measured, and stays.
EXPLICIT_GRAD_MAX_T = 256


def _explicit_for_grad(q: torch.Tensor, T: int) -> bool:
    """Whether this eager attention runs on the CPU in bf16 with a gradient to compute, over at
    most `EXPLICIT_GRAD_MAX_T` positions: then the explicit softmax is faster than SDPA."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.bfloat16
        and q.requires_grad
        and T <= EXPLICIT_GRAD_MAX_T
        and not torch.compiler.is_compiling()
    )


def _fuse_on_cpu(x: torch.Tensor, T: int = 0) -> bool:
    """Whether this forward is being traced by ``torch.compile`` (dynamo; any backend, not
    ``torch.export``) for the CPU, and, for attention, T is short enough: then the model writes
    the tanh GELU and attention in elementwise ops that inductor fuses into a few loops, instead
    of calling ATen kernels it cannot fuse. Eager runs, exports and GPU graphs keep the ATen
    kernels. Under dynamic shapes the T bound is a guard: crossing it recompiles once."""
    return (
        torch.compiler.is_compiling()
        and not torch.compiler.is_exporting()
        and x.device.type == "cpu"
        and T <= FUSED_ATTENTION_MAX_T
    )


def gelu_tanh_by_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh GELU, 0.5 x (1 + tanh(u)), written as x sigmoid(2u), the same function
    (1 + tanh(u) = 2 sigmoid(2u)), u = sqrt(2/pi) (x + 0.044715 x^3).

    For compiled CPU graphs: this build's vectorised tanh is ~6x slower than its sigmoid, so a
    fused loop with the sigmoid is faster; in eager, seven ATen passes are slower than
    ``F.gelu``'s one, so eager keeps ``F.gelu``.
    """
    return x * torch.sigmoid(_TWO_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x))


_TWO_SQRT_2_OVER_PI = 2 * math.sqrt(2 / math.pi)


class SwiGLU(nn.Module):
    """Llama's and Qwen's feed-forward: ``down_proj(silu(gate_proj(x)) * up_proj(x))``.

    A gated linear unit with the SiLU (x sigmoid(x)) as its gate (Shazeer 2020,
    https://arxiv.org/abs/2002.05202): one projection, passed through SiLU, decides how much of
    the other goes through. It has three matrices to GELU's two, so its hidden width
    (``intermediate_size``) is usually about 8/3 x C where GELU's is 4 x C. The book's
    ``FeedForward`` of its Llama and Qwen models: ``fc1`` is ``gate_proj``, ``fc2``
    ``up_proj``, ``fc3`` ``down_proj``.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        C, H = config.n_embd, config.mlp_size
        self.gate_proj = Linear(C, H, bias=config.bias)
        self.up_proj = Linear(C, H, bias=config.bias)
        self.down_proj = Linear(H, C, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.relu2 = config.relu2  # the gate: relu(x)**2 in place of SiLU (a speedrun choice)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C), through (B, T, intermediate_size)."""
        gate = self.gate_proj(x)  # (B, T, H)
        gate = F.relu(gate).square() if self.relu2 else F.silu(gate)
        return self.dropout(self.down_proj(gate * self.up_proj(x)))


class RMSNorm(nn.RMSNorm):
    """Root-mean-square norm (Zhang and Sennrich 2019, https://arxiv.org/abs/1910.07467):
    ``x / sqrt(mean(x**2) + eps) * weight`` over the last dimension.

    LayerNorm without the mean subtracted and without a bias: one statistic instead of two, and
    no shift. Llama's and Qwen's norm, torch's ``nn.RMSNorm`` (one fused kernel) under a name
    of the model's own; the book's ``RMSNorm`` calls the weight ``scale``.

    Input of another dtype than the weight (under bf16 autocast, Qwen3's queries and keys come
    from bf16 products) is normalized in the weight's dtype (float32 there, as Hugging Face's
    ``Qwen3RMSNorm`` computes) and returned in its own; torch's fused kernel takes only
    matching dtypes (otherwise it warns and falls back to separate ops).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype:
            return super().forward(x.to(self.weight.dtype)).to(x.dtype)
        return super().forward(x)


def make_norm(config: GPTConfig, size: int) -> nn.Module:
    """The norm the config chooses over ``size`` features: ``nn.LayerNorm`` (weight and bias:
    the book's ``LayerNorm`` class with its ``scale`` and ``shift``, eps 1e-5) or `RMSNorm`
    (weight), with ``config.norm_eps``."""
    if config.norm == "layernorm":
        return nn.LayerNorm(size, eps=config.norm_eps)
    return RMSNorm(size, eps=config.norm_eps)


class Block(nn.Module):
    """Pre-norm transformer block with two shortcut (residual) connections:
    ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``; norm, attention and MLP as the config
    chooses (GPT-2's `CausalSelfAttention` and `MLP`, or `GroupedQueryAttention` and
    `SwiGLU`). The book's ``TransformerBlock`` (``norm1``/``norm2`` are ``ln_1``/``ln_2``,
    ``att`` is ``attn``, ``ff`` is ``mlp``; its ``drop_shortcut`` is each branch's last
    dropout)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = make_norm(config, config.n_embd)
        if config.family == "gpt2":
            self.attn = CausalSelfAttention(config)
        else:
            self.attn = GroupedQueryAttention(config)
        self.ln_2 = make_norm(config, config.n_embd)
        self.mlp = MLP(config) if config.mlp == "gelu" else SwiGLU(config)

    def forward(
        self,
        x: torch.Tensor,
        start_pos: int | torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        rows: slice | torch.Tensor | None = None,
        attentions: list[torch.Tensor] | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        value_embed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), start_pos, mask, rows, attentions, rope, value_embed)
        return x + self.mlp(self.ln_2(x))


class _SkipInitialisers(torch.overrides.TorchFunctionMode):
    """Skips ``torch.nn.init``'s fills while a model is built on the meta device.

    Every layer's constructor initialises its weights (``nn.Embedding``: ``normal_``,
    ``nn.Linear``: ``kaiming_uniform_``). On meta tensors that is pointless, the weights are
    about to be assigned, and not free: meta ``normal_`` runs through ``torch._refs``, whose
    first call imports ``torch._dynamo`` (1.8 s on a 2-core Xeon, most of a load's start-up).
    A function mode is thread-local and sees exactly the calls made while it is on.
    """

    SKIPPED = frozenset(
        {
            nn.init.normal_,  # these four dispatch through the mode themselves
            nn.init.uniform_,
            nn.init.kaiming_uniform_,
            nn.init.constant_,
            torch.Tensor.normal_,  # what the others (xavier_, trunc_normal_, ...) end in
            torch.Tensor.uniform_,
        }
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.SKIPPED:
            return args[0] if args else kwargs["tensor"]  # in place: the tensor, untouched
        return func(*args, **kwargs)


class GPT(nn.Module):
    """The model: token embedding (+ learned position embedding for GPT-2), ``n_layer``
    blocks, final norm, output head. The book's ``GPTModel`` (``tok_emb``, ``pos_emb``,
    ``drop_emb``, ``trf_blocks``, ``final_norm`` and ``out_head`` are ``wte``, ``wpe``,
    ``drop``, ``h``, ``ln_f`` and ``lm_head``: GPT-2's names, so Hugging Face's weights map
    one to one; `gptkiln.loading.book` reads the book's).

    The head is ``lm_head`` (next-token logits over the vocabulary) or, when
    ``config.num_classes`` is set, ``score`` (class logits; the book's chapter 6 replaces the
    output layer with ``Linear(n_embd, num_classes)`` and reads the last position).

    With RoPE the model holds ``rope_cos`` and ``rope_sin`` (context_length, hs), buffers
    that no checkpoint stores (`init_buffers`); each forward picks the rows of its tokens'
    positions, which are each row's own (left padding, per-row ``start_pos``).
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        if torch.get_default_device().type == "meta":  # a model whose tensors get assigned
            with _SkipInitialisers():
                self._build(config)
        else:
            self._build(config)
            if config.init != "pytorch":  # each layer's constructor drew PyTorch's own already
                self.reset_parameters()

    def _build(self, config: GPTConfig) -> None:
        """The layers of ``config``, as each layer's own constructor initialises them."""
        self.wte = nn.Embedding(config.vocab_rows, config.n_embd)
        if config.positions == "learned":
            self.wpe = nn.Embedding(config.context_length, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        kv_width = config.kv_heads * config.head_size
        self.value_embeds = nn.ModuleList(
            nn.Embedding(config.vocab_size, kv_width) for _ in range(config.value_embeds)
        )
        for i, block in enumerate(self.h):  # the mix only where a block takes an embedding
            if value_index(i, config.value_embeds, config.n_layer) is None:
                block.attn.value_mix = None
        self.ln_f = make_norm(config, config.n_embd)
        if config.num_classes:
            self.score = nn.Linear(config.n_embd, config.num_classes)
        else:
            self.lm_head = Linear(config.n_embd, config.vocab_rows, bias=False)
        self.tie_weights()
        self.pad_lens: torch.Tensor | None = None  # (B,) left-padding per row, set with the cache
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """(Re)compute the buffers no checkpoint stores, on the token embedding's device: RoPE's
        cos and sin tables, in float32 (nothing for GPT-2).

        Called by ``__init__``; a model built on the meta device has them on meta too, so after
        its weights are assigned (``load_state_dict(assign=True)``) call this before using it.
        """
        if self.config.positions != "rope":
            return
        c = self.config
        if self.wte.weight.is_meta:  # shapes only (meta's arange imports torch._dynamo, 1.8 s)
            cos = sin = torch.empty(c.context_length, c.head_size, device="meta")
        else:
            cos, sin = rope_tables(
                c.head_size, c.context_length, c.rope_theta, c.rope_scaling, self.wte.weight.device
            )
        self.register_buffer("rope_cos", cos, persistent=False)  # (context_length, hs)
        self.register_buffer("rope_sin", sin, persistent=False)  # (context_length, hs)

    def rope_at(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of positions ``pos`` (T,) or (B, T): (1 or B, 1, T, hs) each, to
        broadcast over the heads of q and k (B, nh, T, hs)."""
        return self.rope_cos[pos].unsqueeze(-3), self.rope_sin[pos].unsqueeze(-3)

    def tie_weights(self) -> None:
        """Share the token embedding with the output head when the config says so (GPT-2)."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    @property
    def head(self) -> nn.Linear:
        """The output layer: ``lm_head``, or a classifier's ``score``."""
        return self.score if self.config.num_classes else self.lm_head

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Fresh weights as ``config.init`` says.

        ``"gpt2"``: N(0, 0.02) weights, zero biases, unit norms, and residual projections
        (``c_proj``; ``o_proj`` and ``down_proj`` for Llama and Qwen) scaled by
        1/sqrt(2 * n_layer) (GPT-2 paper, section 2.3; 0.02 is also Hugging Face's
        ``initializer_range`` for Llama and Qwen), or zero with ``config.zero_init_out``.
        ``"pytorch"``: every layer's own default (the book's ``GPTModel``).
        """
        if self.config.init == "pytorch":
            for module in self.modules():
                if module is not self and hasattr(module, "reset_parameters"):
                    module.reset_parameters()
            self.tie_weights()
            return
        residual_std = (
            0.0 if self.config.zero_init_out else 0.02 / math.sqrt(2 * self.config.n_layer)
        )
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith(RESIDUAL_PROJECTIONS) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, Attention) and module.value_mix is not None:
                nn.init.constant_(module.value_mix, 0.5)
        self.tie_weights()

    def num_parameters(self, exclude_position_embeddings: bool = False) -> int:
        """Parameter count; a tied embedding/head counts once. A model with RoPE has no
        position embeddings to exclude (its cos/sin tables are buffers, not parameters)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_position_embeddings and self.config.positions == "learned":
            n -= self.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token, forward + backward: 6N + 12 L T nh hs (PaLM paper,
        appendix B), N the parameters that take part in a matmul (all but the position
        embeddings and, when the head is untied, the token embedding: a lookup), the second term
        the attention score/value matmuls of every query head (nh hs = C for GPT-2; grouped
        key/value heads save parameters, not these products)."""
        c = self.config
        n = self.num_parameters(True)
        if not c.tie_embeddings:
            n -= self.wte.weight.numel()
        if not c.num_classes:  # a padded head's extra rows: computed, but no useful work
            n -= (c.vocab_rows - c.vocab_size) * c.n_embd
        return 6 * n + 12 * c.n_layer * seq_len * c.n_head * c.head_size

    # -- the KV cache ------------------------------------------------------------------------
    def setup_cache(
        self, batch_size: int, max_seq_len: int | None = None, pad_lens: torch.Tensor | None = None
    ) -> None:
        """Allocate a static KV cache in every layer (dtype and device of the activations: the
        final norm's, which stays float in a model whose other weights are quantized), of the
        config's key/value heads.

        Args:
            pad_lens: (B,) number of left-padding tokens per row, for prompts of unequal length;
                padded slots are never attended and positions count from each row's first token.
        """
        max_seq_len = min(max_seq_len or self.config.context_length, self.config.context_length)
        weight = self.ln_f.weight
        for block in self.h:
            cache = block.attn.kv_cache
            if (
                cache is None
                or cache.k.shape[0] != batch_size
                or cache.k.shape[2] < max_seq_len
                or cache.k.dtype != weight.dtype
                or cache.k.device != weight.device
            ):
                block.attn.kv_cache = KVCache(
                    batch_size,
                    max_seq_len,
                    self.config.kv_heads,
                    self.config.head_size,
                    weight.dtype,
                    weight.device,
                )
        self.pad_lens = (
            None if pad_lens is None or not pad_lens.any() else pad_lens.to(weight.device)
        )

    def clear_cache(self) -> None:
        for block in self.h:
            block.attn.kv_cache = None
        self.pad_lens = None

    @property
    def cache_len(self) -> int:
        """How many positions the cache holds (0 without one)."""
        cache = self.h[0].attn.kv_cache
        return 0 if cache is None else cache.k.size(2)

    def _positions_and_mask(
        self,
        T: int,
        start_pos: int | torch.Tensor | None,
        device: torch.device,
        rows: slice | torch.Tensor | None = None,
    ):
        """Position ids (T,) or (B, T) and the attention mask for this forward (None = causal)."""
        if isinstance(start_pos, torch.Tensor):  # each row at its own position
            pos = start_pos.to(device)[:, None] + torch.arange(T, device=device)  # (B, T)
            key = torch.arange(int(pos.max()) + 1, device=device)  # (S,)
            return pos, (key[None, None, :] <= pos[:, :, None])[:, None]  # (B, 1, T, S)
        start = start_pos or 0
        pos = torch.arange(start, start + T, device=device)  # (T,)
        if start_pos is None or (self.pad_lens is None and (start == 0 or T == 1)):
            return pos, None
        S = start + T
        key = torch.arange(S, device=device)
        mask = key[None, :] <= pos[:, None]  # (T, S) causal
        if self.pad_lens is None:
            return pos, mask[None, None]  # (1, 1, T, S)
        pad = self.pad_lens[rows if rows is not None else slice(None), None]  # (B, 1)
        mask = mask[None] & (key[None, None, :] >= pad[:, :, None])  # (B, T, S)
        return (pos[None, :] - pad).clamp(min=0), mask[:, None]  # (B, T), (B, 1, T, S)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        start_pos: int | torch.Tensor | None = None,
        last_only: bool | torch.Tensor = False,
        rows: slice | torch.Tensor | None = None,
        attentions: list[torch.Tensor] | None = None,
        segments: torch.Tensor | None = None,
    ):
        """Logits for token ids, and the cross-entropy loss when targets are given.

        Args:
            idx: (B, T) token ids.
            targets: (B, T) next-token ids, positions with -100 ignored; for a classifier,
                (B,) class ids, scored on the last position's logits (the book's chapter 6).
            start_pos: position of idx's first token when decoding with the KV cache
                (``setup_cache`` first); None for an ordinary full-sequence forward. A (B,)
                tensor gives each row its own position (continuous batching: a server's rows
                hold sequences of different lengths; such a cache has no left padding).
            last_only: compute logits for the last position only (generation), (B, 1, V); a
                (B,) tensor of positions: each row's own last one (prompts of different lengths
                padded on the right into one batch), also (B, 1, V).
            rows: the cache rows that idx's rows use (a slice or an index tensor), so a new
                sequence can be prefilled into one row while the others keep theirs; None: the
                first B rows.
            attentions: a list to fill with every layer's attention weights, (B, nh, T, S) each,
                in layer order (for inspection: computed on the explicit path; None, the
                default, changes nothing).
            segments: (B, T) which of the sequences packed end to end in a row each token is
                of (`packed_positions_and_mask`): none attends another, and each one's
                positions start at 0; None: one sequence a row.

        Returns:
            logits (B, T, V) (V: num_classes for a classifier), or (logits, loss) when targets
            are given.
        """
        B = idx.size(0)
        x = self.hidden(
            idx, start_pos=start_pos, rows=rows, attentions=attentions, segments=segments
        )
        if isinstance(last_only, torch.Tensor):
            x = x[torch.arange(B, device=x.device), last_only][:, None]  # (B, 1, C)
        elif last_only:
            x = x[:, -1:, :]  # (B, 1, C)
        if targets is None:
            return self.logits(x)  # (B, T, V)
        if self.config.num_classes:
            logits = self.logits(x)
            loss = F.cross_entropy(logits[:, -1, :].float(), targets)  # (B, V) against (B,)
            return logits, loss
        padded = self.padded_logits(x)  # (B, T, vocab_rows): the loss reads the first V columns
        V = self.config.vocab_size
        loss = cross_entropy(padded.flatten(0, 1), targets.flatten(), ignore_index=-100, vocab=V)
        return padded[..., :V], loss

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The head's output for final-norm states x (..., C) -> (..., V), soft-capped to
        ``c * tanh(logits / c)`` when ``config.logit_softcap`` is c; a padded vocabulary's
        extra columns cut off (a view)."""
        logits = self.padded_logits(x)
        if self.config.num_classes or self.config.padded_vocab_size is None:
            return logits
        return logits[..., : self.config.vocab_size]

    def padded_logits(self, x: torch.Tensor) -> torch.Tensor:
        """`logits` with a padded vocabulary's extra columns kept, (..., vocab_rows): the
        head's matmul at the padded size (the columns past ``vocab_size`` mean no token)."""
        logits = self.head(x)
        cap = self.config.logit_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def hidden(
        self,
        idx: torch.Tensor,
        *,
        start_pos: int | torch.Tensor | None = None,
        rows: slice | torch.Tensor | None = None,
        attentions: list[torch.Tensor] | None = None,
        segments: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final norm's output (B, T, C) for token ids (B, T): what the head turns into
        logits, for a caller that needs them at a few positions only (scoring a continuation:
        ``self.logits(x[rows, positions])``). Arguments as `forward`'s."""
        B, T = idx.shape
        per_row = isinstance(start_pos, torch.Tensor)
        if per_row and self.pad_lens is not None:
            raise ValueError("per-row positions need a cache without left padding")
        end = (int(start_pos.max()) if per_row else start_pos or 0) + T
        limit = self.cache_len if start_pos is not None else self.config.context_length
        if end > limit:
            raise ValueError(f"sequence reaches position {end}, beyond the {limit} available")
        if segments is not None and start_pos is None:
            pos, mask = packed_positions_and_mask(segments)
        elif segments is not None:
            raise ValueError("packed sequences (segments) take a full forward, not the cache")
        else:
            pos, mask = self._positions_and_mask(T, start_pos, idx.device, rows)
        x, rope, values = self.embed(idx, pos)
        return self.run_blocks(x, start_pos, mask, rows, attentions, rope, values)

    def embed(
        self, idx: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None, list[torch.Tensor]]:
        """What the blocks take for token ids idx (B, T) at positions pos (T,) or (B, T): the
        embedded tokens x (B, T, C) (with GPT-2's learned positions added), RoPE's cos and sin
        of the positions (None for GPT-2) and the value embeddings of the tokens."""
        rope = None
        if self.config.positions == "learned":
            x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        else:
            x = self.drop(self.wte(idx))  # (B, T, C); positions enter as rotations of q and k
            rope = self.rope_at(pos)  # 2 x (1 or B, 1, T, hs)
        values = [embed(idx) for embed in self.value_embeds]  # (B, T, nkv * hs) each
        return x, rope, values

    def run_blocks(
        self,
        x: torch.Tensor,
        start_pos: int | torch.Tensor | None,
        mask: torch.Tensor | None,
        rows: slice | torch.Tensor | None,
        attentions: list[torch.Tensor] | None,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        values: list[torch.Tensor],
    ) -> torch.Tensor:
        """The blocks and the final norm over the embedded tokens x (B, T, C) -> (B, T, C);
        the rest as `hidden`'s (``mask`` and ``rope`` of x's positions, ``values`` the value
        embeddings of its tokens, `GPTConfig.value_embeds`)."""
        T = x.size(1)
        windows = self.config.attention_windows or [0] * len(self.h)
        masks = {w: window_mask(mask, T, start_pos, w, x.device) for w in set(windows)}
        for i, block in enumerate(self.h):
            at = value_index(i, len(values), len(self.h))
            value = None if at is None else values[at]
            x = block(x, start_pos, masks[windows[i]], rows, attentions, rope, value)
        return self.ln_f(x)
