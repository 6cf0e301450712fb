"""The model's attention equals the book's multi-head attention, on both kernels, and is causal."""

import pytest
import torch

from gptkiln.config import GPTConfig
from gptkiln.model import GPT, CausalSelfAttention
from gptkiln.teaching import MultiHeadAttention


def copy_teaching_weights(teach: MultiHeadAttention, attn: CausalSelfAttention) -> None:
    """W_query, W_key, W_value stacked row-wise are GPT-2's fused c_attn."""
    with torch.no_grad():
        attn.c_attn.weight.copy_(
            torch.cat([teach.W_query.weight, teach.W_key.weight, teach.W_value.weight])
        )
        attn.c_attn.bias.copy_(
            torch.cat([teach.W_query.bias, teach.W_key.bias, teach.W_value.bias])
        )
        attn.c_proj.weight.copy_(teach.out_proj.weight)
        attn.c_proj.bias.copy_(teach.out_proj.bias)


@pytest.mark.parametrize("kernel", ["sdpa", "math"])
def test_model_attention_equals_teaching_multihead(kernel):
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=10, context_length=8, n_layer=1, n_head=4, n_embd=16, attention=kernel
    )
    teach = MultiHeadAttention(16, 16, 8, 0.0, num_heads=4, qkv_bias=True).eval()
    attn = CausalSelfAttention(cfg).eval()
    copy_teaching_weights(teach, attn)
    x = torch.randn(3, 8, 16)
    torch.testing.assert_close(attn(x), teach(x), atol=1e-6, rtol=1e-5)
    # and on a sequence shorter than the context (the mask is cut to T x T)
    torch.testing.assert_close(attn(x[:, :5]), teach(x[:, :5]), atol=1e-6, rtol=1e-5)


def test_sdpa_and_math_paths_agree_on_the_whole_model():
    torch.manual_seed(0)
    a = GPT(GPTConfig.from_name("tiny", vocab_size=50, context_length=16)).eval()
    b = GPT(GPTConfig.from_name("tiny", vocab_size=50, context_length=16, attention="math")).eval()
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 50, (2, 16))
    torch.testing.assert_close(a(idx), b(idx), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["sdpa", "math"])
def test_changing_a_later_token_never_changes_earlier_positions(kernel):
    torch.manual_seed(0)
    model = GPT(
        GPTConfig.from_name("tiny", vocab_size=50, context_length=16, attention=kernel)
    ).eval()
    idx = torch.randint(0, 50, (1, 12))
    base = model(idx)
    for j in (0, 5, 11):
        changed = idx.clone()
        changed[0, j] = (changed[0, j] + 1) % 50
        out = model(changed)
        torch.testing.assert_close(out[:, :j], base[:, :j])  # the past is untouched
        assert not torch.allclose(out[:, j], base[:, j])  # the token itself matters


def test_attention_weights_rows_sum_to_one_and_scale_before_softmax():
    # The explicit path must scale scores by 1/sqrt(hs) before softmax (seed 002 scaled after).
    from gptkiln.model import explicit_attention

    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    v = torch.eye(4).view(1, 1, 4, 4)  # identity values: the output IS the weight matrix
    weights = explicit_attention(q, k, v, None, 0.0)[0, 0]
    expected = torch.softmax(
        (q @ k.transpose(-2, -1))[0, 0] / 8**0.5 + torch.full((4, 4), float("-inf")).triu(1), -1
    )
    torch.testing.assert_close(weights, expected)
    torch.testing.assert_close(weights.sum(-1), torch.ones(4))
    assert torch.all(weights.triu(1) == 0)
