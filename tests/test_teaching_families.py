"""The GPT-2 -> Llama 3 -> Qwen3 path of `gptkiln.teaching_families`: each component, built from
the book's arguments, equals the book's own on the same inputs and weights."""

from __future__ import annotations

import pytest
import torch

from gptkiln.config import GPTConfig
from gptkiln.teaching_families import (
    apply_rope,
    attend_with_rope,
    compare_families,
    compute_rope_params,
    feed_forward,
    grouped_query_attention,
    kv_cache_bytes_per_token,
    main,
    rms_norm,
    rope_tables,
)

llama3 = pytest.importorskip("llms_from_scratch.llama3", reason="the book's package")
qwen3 = pytest.importorskip("llms_from_scratch.qwen3", reason="the book's package")


def test_step_1_rms_norm_is_the_books():
    torch.manual_seed(0)
    ours, theirs = rms_norm(32, eps=1e-6), qwen3.RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        theirs.scale.copy_(ours.weight)
        x = torch.randn(3, 5, 32) * 4
        torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-6)
        rms = x.pow(2).mean(-1, keepdim=True).sqrt()
        torch.testing.assert_close(ours(x), x / rms * ours.weight, rtol=1e-4, atol=1e-5)


def test_step_2_feed_forward_is_the_books():
    torch.manual_seed(0)
    ours = feed_forward(32, 80)
    theirs = llama3.FeedForward(dict(emb_dim=32, hidden_dim=80, dtype=torch.float32))
    theirs.fc1.weight, theirs.fc2.weight, theirs.fc3.weight = (
        ours.gate_proj.weight,
        ours.up_proj.weight,
        ours.down_proj.weight,
    )
    assert ours.gate_proj.bias is None and ours.down_proj.weight.shape == (32, 80)
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-6)


def test_step_3_rope_is_the_books():
    torch.manual_seed(0)
    cos, sin = rope_tables(16, 32, 10_000.0)
    book_cos, book_sin = qwen3.compute_rope_params(16, 10_000.0, 32)
    torch.testing.assert_close(cos, book_cos, rtol=0, atol=1e-6)
    x = torch.randn(1, 2, 32, 16)
    torch.testing.assert_close(apply_rope(x, cos, sin), qwen3.apply_rope(x, book_cos, book_sin))


@pytest.mark.parametrize("scaled", [False, True])
def test_step_3_the_books_calls_in_its_argument_order(scaled):
    """``compute_rope_params(head_dim, theta_base, context_length, freq_config)`` positionally,
    as the book calls it, and ``apply_rope`` on fewer tokens than the tables' rows."""
    freq = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_context_length=16) if scaled else None  # fmt: skip
    cos, sin = compute_rope_params(16, 500_000, 64, freq)
    book_cos, book_sin = llama3.compute_rope_params(16, 500_000, 64, freq)
    assert cos.shape == (64, 16)
    torch.testing.assert_close(cos, book_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, book_sin, rtol=0, atol=1e-6)
    x = torch.randn(2, 4, 5, 16)  # 5 tokens, 64 rows
    torch.testing.assert_close(apply_rope(x, cos, sin), llama3.apply_rope(x, book_cos, book_sin))


@pytest.mark.parametrize(
    "book, head_dim, qk_norm, groups",
    [("llama3", None, False, 2), ("llama3", None, False, 1), ("qwen3", 12, True, 2)],
)
def test_steps_4_and_5_grouped_query_attention_is_the_books(book, head_dim, qk_norm, groups):
    torch.manual_seed(0)
    ours = grouped_query_attention(32, 4, groups, head_dim=head_dim, qk_norm=qk_norm).eval()
    if book == "llama3":
        theirs = llama3.GroupedQueryAttention(32, 32, 4, groups, dtype=torch.float32)
    else:
        theirs = qwen3.GroupedQueryAttention(32, 4, groups, head_dim, qk_norm, torch.float32)
    sd = {
        "W_query.weight": ours.q_proj.weight,
        "W_key.weight": ours.k_proj.weight,
        "W_value.weight": ours.v_proj.weight,
        "out_proj.weight": ours.o_proj.weight,
    }
    if qk_norm:
        with torch.no_grad():  # weights other than 1, so that swapped norms would show
            ours.q_norm.weight.uniform_(0.5, 1.5)
            ours.k_norm.weight.uniform_(0.5, 1.5)
        sd |= {"q_norm.scale": ours.q_norm.weight, "k_norm.scale": ours.k_norm.weight}
    theirs.load_state_dict(sd)
    hs = head_dim or 8
    cos, sin = rope_tables(hs, 16, 10_000.0)
    x = torch.randn(2, 10, 32)
    mask = torch.triu(torch.ones(10, 10, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        expected = theirs(x, mask, cos, sin)
        torch.testing.assert_close(attend_with_rope(ours, x, cos, sin), expected, rtol=0, atol=1e-5)
    assert ours.k_proj.weight.shape == (groups * hs, 32)  # the saving: fewer key/value heads


def test_the_kv_cache_shrinks_by_the_group_size():
    gpt2, llama = GPTConfig.from_name("gpt2"), GPTConfig.from_name("llama3-124m")
    assert kv_cache_bytes_per_token(gpt2) == 2 * 12 * 12 * 64 * 4 == 73_728
    assert kv_cache_bytes_per_token(llama) * 3 == kv_cache_bytes_per_token(gpt2)
    assert kv_cache_bytes_per_token(GPTConfig.from_name("qwen3-0.6b"), 2) == 2 * 28 * 8 * 128 * 2


def test_the_three_families_side_by_side(capsys):
    rows = {r["preset"]: r for r in compare_families()}
    assert [rows[p]["family"] for p in rows] == ["gpt2", "llama3", "qwen3"]
    assert rows["gpt2"]["parameters"] == 124_439_808
    assert rows["llama3-124m"]["norm"] == "rmsnorm" and rows["qwen3-124m"]["qk_norm"] is True
    main(["baby", "qwen3-baby"])  # python -m gptkiln.teaching_families baby qwen3-baby
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["preset", "family", "norm"]
    assert out[2].startswith("qwen3-baby") and "7,171,584" in out[2]
