"""Llama's and Qwen's components, one at a time, against the book's package on the same inputs:
RoPE (`rope_tables` / `apply_rope` = the book's ``compute_rope_params`` / ``apply_rope``),
`RMSNorm`, `SwiGLU` (the book's ``FeedForward``) and `GroupedQueryAttention`; and the properties
that make each what it is (RoPE sees only distances, GQA with as many key/value heads as query
heads is GPT-2's attention)."""

from __future__ import annotations

import pytest
import torch

llama3 = pytest.importorskip("llms_from_scratch.llama3", reason="the book's package")
qwen3 = pytest.importorskip("llms_from_scratch.qwen3", reason="the book's package")

from gptkiln.config import GPTConfig  # noqa: E402
from gptkiln.model import (  # noqa: E402
    CausalSelfAttention,
    GroupedQueryAttention,
    RMSNorm,
    SwiGLU,
    apply_rope,
    rope_tables,
)

SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context_length=32)
"""Llama 3.1's scaling at a size where a 64-token context has all three kinds of frequency:
kept (wavelength < 8 positions: the first pair's, 2 pi), blended (8 to 32) and divided by
the factor (> 32)."""


def config(family: str = "llama3", **kw) -> GPTConfig:
    """A small model config of ``family`` (llama3 or qwen3), sizes overridable."""
    values = dict(vocab_size=50, context_length=64, n_layer=1, n_head=4, n_kv_head=2, n_embd=64)
    values.update(intermediate_size=96, qkv_bias=False, bias=False)
    return GPTConfig.from_name(f"{family}-baby", **{**values, **kw})


@pytest.mark.parametrize("head_size, theta", [(16, 10_000.0), (64, 500_000.0), (128, 1e6)])
@pytest.mark.parametrize("scaling", [None, SCALING])
def test_rope_tables_are_the_books_compute_rope_params(head_size, theta, scaling):
    cos, sin = rope_tables(head_size, 64, theta, scaling)
    book_cos, book_sin = llama3.compute_rope_params(head_size, theta, 64, freq_config=scaling)
    assert cos.shape == sin.shape == (64, head_size) and cos.dtype == torch.float32
    torch.testing.assert_close(cos, book_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, book_sin, rtol=0, atol=1e-6)
    if scaling is None:  # Qwen3's copy of the function, which has no scaling
        torch.testing.assert_close(cos, qwen3.compute_rope_params(head_size, theta, 64)[0])
    else:  # the scaling changes the slow frequencies and leaves the fastest ones alone
        plain_cos, plain_sin = rope_tables(head_size, 64, theta)
        assert torch.equal(cos[:, 0], plain_cos[:, 0])
        slowest = head_size // 2 - 1  # its angles (sin ~ angle) divided by the factor
        torch.testing.assert_close(sin[:, slowest], plain_sin[:, slowest] / 8, rtol=1e-4, atol=0)


def test_apply_rope_is_the_books_and_rotates_each_position_by_its_own_angle():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 10, 16)  # (B, nh, T, hs)
    cos, sin = rope_tables(16, 64, 10_000.0)
    ours = apply_rope(x, cos[:10], sin[:10])
    torch.testing.assert_close(ours, llama3.apply_rope(x, cos, sin), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours, qwen3.apply_rope(x, cos, sin), rtol=0, atol=1e-6)
    # rows at positions of their own (left padding, per-row decoding): (B, 1, T, hs) tables
    pos = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [0, 0, 0, 1, 2, 3, 4, 5, 6, 7]])
    per_row = apply_rope(x, cos[pos][:, None], sin[pos][:, None])
    shifted = llama3.apply_rope(x[:1], cos[5:], sin[5:])  # the book's: positions from 5
    torch.testing.assert_close(per_row[:1], shifted, rtol=0, atol=1e-6)
    padded = llama3.apply_rope(x[1:, :, 3:], cos[1:], sin[1:])  # after 3 slots: from 1
    torch.testing.assert_close(per_row[1:, :, 3:], padded, rtol=0, atol=1e-6)
    # a rotation: each pair keeps its length
    torch.testing.assert_close(ours.norm(dim=-1), x.norm(dim=-1))


def test_rope_attention_scores_depend_only_on_the_distance():
    """q at m and k at n give the same score as q at m + s and k at n + s."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 32), torch.randn(1, 1, 1, 32)
    cos, sin = rope_tables(32, 64, 10_000.0)

    def score(m: int, n: int) -> float:
        rq = apply_rope(q, cos[m : m + 1], sin[m : m + 1])
        rk = apply_rope(k, cos[n : n + 1], sin[n : n + 1])
        return float((rq * rk).sum())

    for m, n in [(5, 2), (9, 9), (30, 1)]:
        assert score(m, n) == pytest.approx(score(m + 17, n + 17), abs=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-3)  # the distance does matter


@pytest.mark.parametrize("eps, book", [(1e-5, "llama3"), (1e-6, "qwen3")])
def test_rmsnorm_is_the_books(eps, book):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 64) * 3
    ours = RMSNorm(64, eps=eps)
    theirs = torch.nn.RMSNorm(64, eps=eps) if book == "llama3" else qwen3.RMSNorm(64, eps=eps)
    with torch.no_grad():
        ours.weight.normal_()
        (theirs.weight if book == "llama3" else theirs.scale).copy_(ours.weight)
        torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-6)
        # no mean subtracted, no bias: RMSNorm is LayerNorm only where x has mean 0
        centred = x - x.mean(-1, keepdim=True)
        layer_norm = torch.nn.functional.layer_norm(centred, (64,), ours.weight, eps=eps)
        torch.testing.assert_close(ours(centred), layer_norm, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(ours(x + 1), ours(x), atol=1e-3)


def test_swiglu_is_the_books_feed_forward():
    torch.manual_seed(0)
    mlp = SwiGLU(config())
    book = llama3.FeedForward(dict(emb_dim=64, hidden_dim=96, dtype=torch.float32))
    book.load_state_dict(
        {
            "fc1.weight": mlp.gate_proj.weight,
            "fc2.weight": mlp.up_proj.weight,
            "fc3.weight": mlp.down_proj.weight,
        }
    )
    x = torch.randn(2, 7, 64)
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), book(x), rtol=0, atol=1e-6)
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        by_hand = mlp.down_proj(gate * torch.sigmoid(gate) * up)  # SiLU(g) = g sigmoid(g)
        torch.testing.assert_close(mlp(x), by_hand)


def book_attention_state(att: GroupedQueryAttention) -> dict[str, torch.Tensor]:
    """Our attention's weights under the book's ``GroupedQueryAttention`` names."""
    sd = {
        "W_query.weight": att.q_proj.weight,
        "W_key.weight": att.k_proj.weight,
        "W_value.weight": att.v_proj.weight,
        "out_proj.weight": att.o_proj.weight,
    }
    if att.qk_norm:
        sd.update({"q_norm.scale": att.q_norm.weight, "k_norm.scale": att.k_norm.weight})
    return sd


@pytest.mark.parametrize("n_kv_head", [4, 2, 1])  # multi-head, grouped-query, multi-query
@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_grouped_query_attention_is_the_books_llama_one(n_kv_head, attention):
    torch.manual_seed(0)
    att = GroupedQueryAttention(config(n_kv_head=n_kv_head, attention=attention)).eval()
    book = llama3.GroupedQueryAttention(64, 64, 4, n_kv_head, dtype=torch.float32)
    book.load_state_dict(book_attention_state(att))
    x = torch.randn(2, 12, 64)
    cos, sin = rope_tables(16, 64, 500_000.0)
    mask = torch.triu(torch.ones(12, 12, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        ours = att(x, rope=(cos[:12], sin[:12]))
        torch.testing.assert_close(ours, book(x, mask, cos, sin), rtol=0, atol=1e-5)


@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_qwen3_attention_with_its_own_head_size_and_qk_norm_is_the_books(attention):
    torch.manual_seed(0)
    cfg = config("qwen3", head_dim=24, attention=attention)  # 4 heads x 24 = 96 != 64
    att = GroupedQueryAttention(cfg).eval()
    with torch.no_grad():  # norms other than 1, so that a swapped q/k norm would show
        att.q_norm.weight.uniform_(0.5, 1.5)
        att.k_norm.weight.uniform_(0.5, 1.5)
    assert att.q_proj.weight.shape == (96, 64) and att.k_proj.weight.shape == (48, 64)
    book = qwen3.GroupedQueryAttention(64, 4, 2, head_dim=24, qk_norm=True, dtype=torch.float32)
    book.load_state_dict(book_attention_state(att))
    x = torch.randn(2, 12, 64)
    cos, sin = rope_tables(24, 64, 1e6)
    mask = torch.triu(torch.ones(12, 12, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        ours = att(x, rope=(cos[:12], sin[:12]))
        torch.testing.assert_close(ours, book(x, mask, cos, sin), rtol=0, atol=1e-5)
        att.qk_norm = False  # without the norms it is another function
        assert not torch.allclose(att(x, rope=(cos[:12], sin[:12])), ours, atol=1e-4)


def test_as_many_key_value_heads_as_query_heads_is_gpt2s_attention():
    torch.manual_seed(0)
    cfg = config(n_kv_head=None, qkv_bias=True, bias=True)
    gqa = GroupedQueryAttention(cfg).eval()
    mha = CausalSelfAttention(GPTConfig(n_layer=1, n_head=4, n_embd=64, context_length=64)).eval()
    with torch.no_grad():
        for name in ("weight", "bias"):
            parts = [getattr(getattr(gqa, p), name) for p in ("q_proj", "k_proj", "v_proj")]
            getattr(mha.c_attn, name).copy_(torch.cat(parts))  # (3C, C): c_attn's stacking
            getattr(mha.c_proj, name).copy_(getattr(gqa.o_proj, name))
        x = torch.randn(2, 9, 64)
        torch.testing.assert_close(gqa(x), mha(x))  # without rope: the same function


def test_grouped_heads_are_shared_by_consecutive_query_heads():
    """Key/value head j serves query heads j*g .. j*g + g-1 (repeat_interleave, not repeat):
    with one query head's weights copied to another of the same group, their outputs match."""
    torch.manual_seed(0)
    att = GroupedQueryAttention(config(n_kv_head=2, attention="math")).eval()
    with torch.no_grad():
        q = att.q_proj.weight.view(4, 16, 64)  # (nh, hs, C)
        q[1] = q[0]  # heads 0 and 1 share key/value head 0
        weights: list[torch.Tensor] = []
        att(torch.randn(1, 6, 64), attentions=weights)
    (w,) = weights
    assert w.shape == (1, 4, 6, 6)
    torch.testing.assert_close(w[:, 0], w[:, 1])
    assert not torch.allclose(w[:, 1], w[:, 2])
