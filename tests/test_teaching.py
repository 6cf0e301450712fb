"""The book's chapter-3 attention progression: its printed numbers, and the properties behind them.

Golden values are copied from the book's notebook output (seed text 001, torch 2.4.0) and from a
blog post that re-derives them with other shapes (seed text 004); all are printed to 4 decimals,
so each is compared after rounding, to within one unit in the last place.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from gptkiln.errors import GptkilnError
from gptkiln.teaching import (
    JOURNEY_EMBEDDINGS,
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttentionLinear,
    SelfAttentionParams,
    journey_matrices,
    plot_journey_attention,
    simple_attention,
    simple_attention_weights,
)

# "Your journey starts with one step", one 3-d embedding per word (book section 3.3).
INPUTS = torch.tensor(
    [
        [0.43, 0.15, 0.89],  # Your
        [0.55, 0.87, 0.66],  # journey
        [0.57, 0.85, 0.64],  # starts
        [0.22, 0.58, 0.33],  # with
        [0.77, 0.25, 0.10],  # one
        [0.05, 0.80, 0.55],  # step
    ]
)
BATCH = torch.stack((INPUTS, INPUTS), dim=0)  # (2, 6, 3)

# CausalAttention(3, 2, 6, 0.0) under torch.manual_seed(123), for each of the two batch rows.
CAUSAL_CONTEXT = [
    [-0.4519, 0.2216],
    [-0.5874, 0.0058],
    [-0.6300, -0.0632],
    [-0.5675, -0.0843],
    [-0.5526, -0.0981],
    [-0.5299, -0.1081],
]


def assert_matches_book(actual: torch.Tensor, expected) -> None:
    """``actual`` rounded to 4 decimals equals the book's printed ``expected`` (+- 1e-4)."""
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual.detach().round(decimals=4), expected, atol=1e-4, rtol=0)


def tokens(batch_size: int = 2, num_tokens: int = 6, d_in: int = 3, scale: float = 2.0):
    """Random inputs (B, T, d_in), scaled up so that sqrt(d_k) visibly changes the softmax."""
    generator = torch.Generator().manual_seed(0)
    return scale * torch.randn(batch_size, num_tokens, d_in, generator=generator)


# --- Golden values: section 3.3, attention without trainable weights ---------------------------


def test_simple_attention_weights_match_book():
    attn_weights = simple_attention_weights(INPUTS)

    assert_matches_book(
        attn_weights,
        [
            [0.2098, 0.2006, 0.1981, 0.1242, 0.1220, 0.1452],
            [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581],
            [0.1390, 0.2369, 0.2326, 0.1242, 0.1108, 0.1565],
            [0.1435, 0.2074, 0.2046, 0.1462, 0.1263, 0.1720],
            [0.1526, 0.1958, 0.1975, 0.1367, 0.1879, 0.1295],
            [0.1385, 0.2184, 0.2128, 0.1420, 0.0988, 0.1896],
        ],
    )
    # Query 2's weights are the softmax of the book's dot-product scores for query 2.
    attn_scores_2 = torch.tensor([0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865])
    assert_matches_book(attn_weights[1], torch.softmax(attn_scores_2, dim=0).round(decimals=4))
    assert_matches_book(attn_weights.sum(dim=-1), [1.0] * 6)


def test_simple_attention_context_vectors_match_book():
    context_vecs = simple_attention(INPUTS)

    assert context_vecs.shape == (6, 3)
    assert_matches_book(context_vecs[1], [0.4419, 0.6515, 0.5683])  # z^(2), worked by hand
    assert_matches_book(
        context_vecs,
        [
            [0.4421, 0.5931, 0.5790],
            [0.4419, 0.6515, 0.5683],
            [0.4431, 0.6496, 0.5671],
            [0.4304, 0.6298, 0.5510],
            [0.4671, 0.5910, 0.5266],
            [0.4177, 0.6503, 0.5645],
        ],
    )


# --- Golden values: section 3.4, trainable weights ---------------------------------------------


def test_self_attention_params_matches_book():
    torch.manual_seed(123)
    sa = SelfAttentionParams(d_in=3, d_out=2)

    # The step-by-step walk-through for query 2 uses the same three seeded matrices.
    query_2 = INPUTS[1] @ sa.W_query
    keys = INPUTS @ sa.W_key
    assert_matches_book(query_2, [0.4306, 1.4551])
    assert_matches_book(query_2 @ keys.T, [1.2705, 1.8524, 1.8111, 1.0795, 0.5577, 1.5440])
    assert_matches_book(
        sa.attention_weights(INPUTS)[1], [0.1500, 0.2264, 0.2199, 0.1311, 0.0906, 0.1820]
    )
    assert_matches_book(
        sa(INPUTS),
        [
            [0.2996, 0.8053],
            [0.3061, 0.8210],
            [0.3058, 0.8203],
            [0.2948, 0.7939],
            [0.2927, 0.7891],
            [0.2990, 0.8040],
        ],
    )


def test_self_attention_linear_matches_book():
    torch.manual_seed(789)
    sa = SelfAttentionLinear(d_in=3, d_out=2)

    assert_matches_book(
        sa(INPUTS),
        [
            [-0.0739, 0.0713],
            [-0.0748, 0.0703],
            [-0.0749, 0.0702],
            [-0.0760, 0.0685],
            [-0.0763, 0.0679],
            [-0.0754, 0.0693],
        ],
    )
    assert_matches_book(
        sa.attention_weights(INPUTS),
        [
            [0.1921, 0.1646, 0.1652, 0.1550, 0.1721, 0.1510],
            [0.2041, 0.1659, 0.1662, 0.1496, 0.1665, 0.1477],
            [0.2036, 0.1659, 0.1662, 0.1498, 0.1664, 0.1480],
            [0.1869, 0.1667, 0.1668, 0.1571, 0.1661, 0.1564],
            [0.1830, 0.1669, 0.1670, 0.1588, 0.1658, 0.1585],
            [0.1935, 0.1663, 0.1666, 0.1542, 0.1666, 0.1529],
        ],
    )
    # The lower triangle of the raw scores, which the book prints after masking with -inf.
    attn_scores = sa.W_query(INPUTS) @ sa.W_key(INPUTS).T
    rows, cols = torch.tril_indices(6, 6)
    assert_matches_book(
        attn_scores[rows, cols],
        [0.2899, 0.4656, 0.1723, 0.4594, 0.1703, 0.1731, 0.2642, 0.1024, 0.1036, 0.0186]
        + [0.2183, 0.0874, 0.0882, 0.0177, 0.0786, 0.3408, 0.1270, 0.1290, 0.0198, 0.1290]
        + [0.0078],
    )


# --- Golden values: section 3.5, causal attention and dropout ---------------------------------

# The book's causal weights for SelfAttention_v2's seeded projections (seed 789).
CAUSAL_WEIGHTS = [
    [1.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.5517, 0.4483, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.3800, 0.3097, 0.3103, 0.0000, 0.0000, 0.0000],
    [0.2758, 0.2460, 0.2462, 0.2319, 0.0000, 0.0000],
    [0.2175, 0.1983, 0.1984, 0.1888, 0.1971, 0.0000],
    [0.1935, 0.1663, 0.1666, 0.1542, 0.1666, 0.1529],
]


def test_causal_attention_weights_match_book():
    # CausalAttention creates W_query, W_key, W_value like SelfAttention_v2, so seed 789 gives
    # the projections the book masks in section 3.5.1.
    torch.manual_seed(789)
    ca = CausalAttention(d_in=3, d_out=2, context_length=6, dropout=0.0)
    attn_weights = ca.attention_weights(INPUTS[None])[0]  # (6, 6)

    assert_matches_book(attn_weights, CAUSAL_WEIGHTS)
    # The book's first route: softmax everything, zero the future, renormalise. Same weights.
    torch.manual_seed(789)
    unmasked = SelfAttentionLinear(3, 2).attention_weights(INPUTS)
    masked_simple = unmasked * torch.tril(torch.ones(6, 6))
    torch.testing.assert_close(attn_weights, masked_simple / masked_simple.sum(-1, keepdim=True))


def test_book_dropout_example():
    # Section 3.5.2: dropout 0.5 on ones zeroes about half and doubles the rest. Pins the RNG
    # stream that the next test relies on (the book notes it differs between platforms).
    torch.manual_seed(123)
    dropout = nn.Dropout(0.5)

    assert_matches_book(
        dropout(torch.ones(6, 6)),
        [
            [2.0, 2.0, 0.0, 2.0, 2.0, 0.0],
            [0.0, 0.0, 0.0, 2.0, 0.0, 2.0],
            [2.0, 2.0, 2.0, 2.0, 0.0, 2.0],
            [0.0, 2.0, 2.0, 0.0, 0.0, 2.0],
            [0.0, 2.0, 0.0, 2.0, 0.0, 2.0],
            [0.0, 2.0, 2.0, 2.0, 2.0, 0.0],
        ],
    )


def test_causal_attention_dropout_on_weights_matches_book():
    torch.manual_seed(789)
    ca = CausalAttention(d_in=3, d_out=2, context_length=6, dropout=0.5).train()
    torch.manual_seed(123)  # the book reseeds before F.dropout(attn_weights)

    assert_matches_book(
        ca.attention_weights(INPUTS[None])[0],
        [
            [2.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
            [0.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
            [0.7599, 0.6194, 0.6206, 0.0000, 0.0000, 0.0000],
            [0.0000, 0.4921, 0.4925, 0.0000, 0.0000, 0.0000],
            [0.0000, 0.3966, 0.0000, 0.3775, 0.0000, 0.0000],
            [0.0000, 0.3327, 0.3331, 0.3084, 0.3331, 0.0000],
        ],
    )


def test_causal_attention_matches_book():
    torch.manual_seed(123)
    ca = CausalAttention(d_in=3, d_out=2, context_length=6, dropout=0.0)
    context_vecs = ca(BATCH)

    assert context_vecs.shape == (2, 6, 2)
    assert_matches_book(context_vecs, [CAUSAL_CONTEXT, CAUSAL_CONTEXT])


# --- Golden values: section 3.6, multi-head attention ------------------------------------------


def test_multi_head_attention_wrapper_matches_book():
    torch.manual_seed(123)
    mha = MultiHeadAttentionWrapper(3, 2, context_length=6, dropout=0.0, num_heads=2)
    context_vecs = mha(BATCH)

    expected = [
        [-0.4519, 0.2216, 0.4772, 0.1063],
        [-0.5874, 0.0058, 0.5891, 0.3257],
        [-0.6300, -0.0632, 0.6202, 0.3860],
        [-0.5675, -0.0843, 0.5478, 0.3589],
        [-0.5526, -0.0981, 0.5321, 0.3428],
        [-0.5299, -0.1081, 0.5077, 0.3493],
    ]
    assert context_vecs.shape == (2, 6, 4)
    assert_matches_book(context_vecs, [expected, expected])


def test_multi_head_attention_matches_book():
    torch.manual_seed(123)
    mha = MultiHeadAttention(3, 2, context_length=6, dropout=0.0, num_heads=2)
    context_vecs = mha(BATCH)

    expected = [
        [0.3190, 0.4858],
        [0.2943, 0.3897],
        [0.2856, 0.3593],
        [0.2693, 0.3873],
        [0.2639, 0.3928],
        [0.2575, 0.4028],
    ]
    assert context_vecs.shape == (2, 6, 2)
    assert_matches_book(context_vecs, [expected, expected])


# --- Golden values from seed 004: the same classes on other shapes ------------------------------


def embedded_once_upon_a_time() -> torch.Tensor:
    """Five tokens through a seeded 4-d embedding, as in seed 004; shape (5, 4)."""
    torch.manual_seed(123)
    embedding = nn.Embedding(num_embeddings=5, embedding_dim=4)
    return embedding(torch.arange(5)).detach()


def test_self_attention_params_and_linear_on_4d_embeddings():
    x = embedded_once_upon_a_time()
    assert_matches_book(x[0], [0.3374, -0.1778, -0.3035, -0.5880])

    torch.manual_seed(123)
    assert_matches_book(
        SelfAttentionParams(4, 4)(x),
        [
            [-1.0221, -1.1318, -1.0966, -1.2475],
            [1.6613, 1.7716, 2.1347, 2.5049],
            [-1.3064, -1.3985, -1.3982, -1.5418],
            [-2.2928, -2.2490, -2.4211, -2.5138],
            [-1.6010, -1.6693, -1.7563, -1.9028],
        ],
    )
    torch.manual_seed(123)
    assert_matches_book(
        SelfAttentionLinear(4, 4)(x),
        [
            [0.1318, -0.1000, -0.4239, -0.0858],
            [-0.0532, 0.2164, -0.8386, -0.1107],
            [0.2318, -0.2270, -0.4083, -0.0919],
            [0.4762, -0.5514, -0.2901, -0.0859],
            [0.0700, -0.0399, -0.3281, -0.0728],
        ],
    )


def test_causal_attention_on_random_batch():
    torch.manual_seed(123)
    batch = torch.randn(2, 5, 4)
    ca = CausalAttention(d_in=4, d_out=4, context_length=5, dropout=0.0)

    assert_matches_book(
        ca(batch),
        [
            [
                [-0.0487, -0.0112, 0.0449, 0.3506],
                [0.0439, 0.1278, 0.1848, 0.1733],
                [-0.2467, -0.1078, 0.2722, 0.5128],
                [-0.1638, 0.0053, 0.3753, 0.3111],
                [0.0264, 0.1455, 0.3622, 0.0182],
            ],
            [
                [0.0960, 0.4257, 1.7419, 0.2045],
                [-0.0967, 0.2774, 1.1946, 0.5023],
                [0.1017, 0.2037, 0.4849, 0.1862],
                [-0.0775, 0.1062, 0.3737, 0.3387],
                [-0.1181, -0.0113, 0.1070, 0.2743],
            ],
        ],
    )


# --- Causality: no token sees the future --------------------------------------------------------

CAUSAL_MODULES = {
    "CausalAttention": lambda: CausalAttention(3, 4, context_length=8, dropout=0.0),
    "MultiHeadAttentionWrapper": lambda: MultiHeadAttentionWrapper(3, 2, 8, 0.0, num_heads=2),
    "MultiHeadAttention": lambda: MultiHeadAttention(3, 4, 8, 0.0, num_heads=2),
}


@pytest.mark.parametrize("name", CAUSAL_MODULES)
def test_changing_a_token_never_changes_earlier_outputs(name):
    torch.manual_seed(0)
    module = CAUSAL_MODULES[name]().eval()
    x = tokens(num_tokens=6)  # shorter than context_length=8: the mask must be sliced
    before = module(x)

    for j in range(6):
        changed = x.clone()
        changed[:, j] += 10.0
        after = module(changed)
        torch.testing.assert_close(after[:, :j], before[:, :j], msg=f"{name}: token {j} leaked")
        assert not torch.allclose(after[:, j], before[:, j]), f"{name}: token {j} was ignored"


def test_unmasked_self_attention_does_see_the_future():
    # The contrast that shows the causality test has teeth: without a mask, token 5 moves token 0.
    torch.manual_seed(0)
    sa = SelfAttentionLinear(3, 4)
    x = tokens(batch_size=1)[0]
    changed = x.clone()
    changed[5] += 10.0

    assert not torch.allclose(sa(changed)[0], sa(x)[0])


@pytest.mark.parametrize("name", ["CausalAttention", "MultiHeadAttention"])
def test_causal_weights_are_zero_above_the_diagonal(name):
    torch.manual_seed(0)
    attn_weights = CAUSAL_MODULES[name]().eval().attention_weights(tokens())  # (B, [nh,] T, T)

    future = torch.triu(torch.ones(6, 6, dtype=torch.bool), diagonal=1)
    assert (attn_weights[..., future] == 0).all()
    assert (attn_weights[..., ~future] > 0).all()


# --- Scaling: softmax(scores / sqrt(d_k)), never softmax(scores) / sqrt(d_k) ---------------------


def hand_attention(queries, keys, values, causal: bool):
    """The textbook formula, written out: softmax(mask(Q K^T) / sqrt(d_k)) V, and the weights."""
    d_k = keys.shape[-1]
    attn_scores = queries @ keys.transpose(-2, -1)  # (..., T, T)
    if causal:
        num_tokens = attn_scores.shape[-1]
        future = torch.triu(torch.ones(num_tokens, num_tokens, dtype=torch.bool), diagonal=1)
        attn_scores = attn_scores.masked_fill(future, float("-inf"))
    attn_weights = torch.softmax(attn_scores / d_k**0.5, dim=-1)
    return attn_weights @ values, attn_weights


def test_self_attention_params_scales_before_softmax():
    torch.manual_seed(0)
    sa = SelfAttentionParams(3, 4)
    x = tokens(batch_size=1)[0]  # (T, d_in)

    expected, expected_weights = hand_attention(
        x @ sa.W_query, x @ sa.W_key, x @ sa.W_value, causal=False
    )
    attn_weights = sa.attention_weights(x)
    torch.testing.assert_close(attn_weights.sum(-1), torch.ones(6))
    torch.testing.assert_close(attn_weights, expected_weights)
    torch.testing.assert_close(sa(x), expected)


@pytest.mark.parametrize("name", ["SelfAttentionLinear", "CausalAttention"])
def test_single_head_scales_before_softmax(name):
    torch.manual_seed(0)
    if name == "SelfAttentionLinear":
        module = SelfAttentionLinear(3, 4)
    else:
        module = CausalAttention(3, 4, context_length=8, dropout=0.0)
    x = tokens()  # (B, T, d_in); d_k = 4

    expected, expected_weights = hand_attention(
        module.W_query(x), module.W_key(x), module.W_value(x), causal=name == "CausalAttention"
    )
    attn_weights = module.attention_weights(x)
    torch.testing.assert_close(attn_weights.sum(-1), torch.ones(2, 6))
    torch.testing.assert_close(attn_weights, expected_weights)
    torch.testing.assert_close(module(x), expected)


def test_multi_head_attention_scales_each_head_by_its_own_size():
    # d_out=4 with 2 heads: d_k is the head size 2, not d_out=4 (nor 1, which would hide it).
    torch.manual_seed(0)
    mha = MultiHeadAttention(3, 4, context_length=8, dropout=0.0, num_heads=2)
    x = tokens()

    def split(t):  # (B, T, 4) -> (B, 2, T, 2)
        return t.view(2, 6, 2, 2).transpose(1, 2)

    queries, keys, values = split(mha.W_query(x)), split(mha.W_key(x)), split(mha.W_value(x))
    heads_out, expected_weights = hand_attention(queries, keys, values, causal=True)
    expected = mha.out_proj(heads_out.transpose(1, 2).reshape(2, 6, 4))

    attn_weights = mha.attention_weights(x)  # (B, nh, T, T)
    torch.testing.assert_close(attn_weights.sum(-1), torch.ones(2, 2, 6))
    torch.testing.assert_close(attn_weights, expected_weights)
    torch.testing.assert_close(mha(x), expected)


# --- Dropout: on in training, off (and deterministic) in eval ------------------------------------

DROPOUT_MODULES = {
    "CausalAttention": lambda p: CausalAttention(3, 4, context_length=8, dropout=p),
    "MultiHeadAttentionWrapper": lambda p: MultiHeadAttentionWrapper(3, 2, 8, p, num_heads=2),
    "MultiHeadAttention": lambda p: MultiHeadAttention(3, 4, 8, p, num_heads=2),
}


@pytest.mark.parametrize("name", DROPOUT_MODULES)
def test_dropout_only_in_training(name):
    torch.manual_seed(0)
    module = DROPOUT_MODULES[name](0.5)
    no_dropout = DROPOUT_MODULES[name](0.0)
    no_dropout.load_state_dict(module.state_dict())
    x = tokens()

    module.eval()
    torch.testing.assert_close(module(x), module(x))  # eval is deterministic...
    torch.testing.assert_close(module(x), no_dropout(x))  # ...and is exactly "no dropout"
    module.train()
    torch.manual_seed(1)
    assert not torch.allclose(module(x), no_dropout(x))


@pytest.mark.parametrize("name", ["CausalAttention", "MultiHeadAttention"])
def test_dropout_acts_on_the_attention_weights(name):
    # Each weight is either dropped (0) or kept and scaled by 1 / (1 - p) = 2.
    torch.manual_seed(0)
    module = DROPOUT_MODULES[name](0.5)
    x = tokens()
    kept = module.eval().attention_weights(x)
    torch.manual_seed(1)
    dropped = module.train().attention_weights(x)

    is_zero = dropped == 0
    torch.testing.assert_close(dropped[~is_zero], 2 * kept[~is_zero])
    assert is_zero[kept > 0].any()


# --- Structure --------------------------------------------------------------------------------


def test_wrapper_concatenates_independent_heads():
    torch.manual_seed(0)
    mha = MultiHeadAttentionWrapper(3, 2, context_length=8, dropout=0.0, num_heads=3)
    x = tokens()

    expected = torch.cat([head(x) for head in mha.heads], dim=-1)
    torch.testing.assert_close(mha(x), expected)
    assert not torch.equal(mha.heads[0].W_query.weight, mha.heads[1].W_query.weight)


def test_multi_head_attention_is_split_heads_plus_projection():
    # MultiHeadAttention == out_proj(wrapper of heads whose weights are row slices of W_*).
    torch.manual_seed(0)
    mha = MultiHeadAttention(3, 4, context_length=8, dropout=0.0, num_heads=2)
    wrapper = MultiHeadAttentionWrapper(3, 2, context_length=8, dropout=0.0, num_heads=2)
    with torch.no_grad():
        for h, head in enumerate(wrapper.heads):
            rows = slice(2 * h, 2 * h + 2)
            head.W_query.weight.copy_(mha.W_query.weight[rows])
            head.W_key.weight.copy_(mha.W_key.weight[rows])
            head.W_value.weight.copy_(mha.W_value.weight[rows])
    x = tokens()

    torch.testing.assert_close(mha(x), mha.out_proj(wrapper(x)))


def test_multi_head_attention_rejects_indivisible_heads():
    with pytest.raises(GptkilnError, match="d_out=5 is not divisible by num_heads=2"):
        MultiHeadAttention(3, 5, context_length=8, dropout=0.0, num_heads=2)


BOOK_PAIRS = [
    ("SelfAttention_v1", lambda: SelfAttentionParams(3, 2), (3, 2), INPUTS),
    ("SelfAttention_v2", lambda: SelfAttentionLinear(3, 2), (3, 2), INPUTS),
    ("CausalAttention", lambda: CausalAttention(3, 2, 6, 0.0), (3, 2, 6, 0.0), BATCH),
    (
        "MultiHeadAttentionWrapper",
        lambda: MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2),
        (3, 2, 6, 0.0, 2),
        BATCH,
    ),
    (
        "MultiHeadAttention",
        lambda: MultiHeadAttention(3, 4, 6, 0.0, num_heads=2),
        (3, 4, 6, 0.0, 2),
        BATCH,
    ),
]


@pytest.mark.parametrize(("book_name", "make", "book_args", "x"), BOOK_PAIRS)
def test_same_parameters_and_outputs_as_the_books_package(book_name, make, book_args, x):
    book = pytest.importorskip("llms_from_scratch.ch03")
    torch.manual_seed(123)
    ours = make()
    torch.manual_seed(123)
    theirs = getattr(book, book_name)(*book_args)

    # Same names in the same order, and the same seeded values: the creation order matches.
    assert list(ours.state_dict()) == list(theirs.state_dict())
    for (name, ours_tensor), theirs_tensor in zip(
        ours.state_dict().items(), theirs.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(ours_tensor, theirs_tensor, msg=name)
    torch.testing.assert_close(ours(x), theirs(x))


# --- The chapter's matrices as a picture (the README's image) ----------------------------------


def test_journey_matrices_are_the_books_and_leave_the_random_state_alone():
    assert torch.equal(JOURNEY_EMBEDDINGS, INPUTS)
    state = torch.random.get_rng_state()
    scores, weights, trainable, causal = journey_matrices().values()
    assert torch.equal(torch.random.get_rng_state(), state)  # seeded inside a fork
    assert_matches_book(scores[1], [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865])
    assert_matches_book(weights[1], [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581])
    assert_matches_book(trainable[0], [0.1921, 0.1646, 0.1652, 0.1550, 0.1721, 0.1510])
    assert_matches_book(causal, CAUSAL_WEIGHTS)


def test_journey_plot_has_four_annotated_panels_with_the_future_grey(tmp_path, monkeypatch):
    import matplotlib.figure

    saved = []
    savefig = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(
        matplotlib.figure.Figure,
        "savefig",
        lambda f, *a, **k: (saved.append(f), savefig(f, *a, **k)),
    )
    path = plot_journey_attention(tmp_path / "docs" / "journey.png")  # the folder is made
    assert path.read_bytes()[:4] == b"\x89PNG"
    (fig,) = saved
    axes = [ax for ax in fig.axes if ax.get_title()]
    assert len(axes) == 4 and axes[3].get_title().startswith("causal")
    assert [t.get_text() for t in axes[0].get_yticklabels()] == [
        "Your",
        "journey",
        "starts",
        "with",
        "one",
        "step",
    ]
    assert [t.get_text() for t in axes[1].texts][6:12] == [
        "0.14",
        "0.24",
        "0.23",
        "0.12",
        "0.11",
        "0.16",
    ]  # row "journey"
    assert len(axes[3].texts) == 21 and axes[3].texts[0].get_text() == "1.00"  # lower triangle
    assert axes[3].images[0].get_array().mask[0, 5] and not axes[2].images[0].get_array().mask.any()


def test_the_journey_command_takes_help_and_refuses_a_path_that_is_no_png(tmp_path, capsys):
    from gptkiln.teaching import main

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0 and "usage: python -m gptkiln.teaching" in capsys.readouterr().out
    assert main([str(tmp_path / "x.txt")]) == 2
    assert "give a path ending in .png" in capsys.readouterr().err
    assert main([str(tmp_path)]) == 2 and "is a directory" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("layer", ["causal", "multihead"])
def test_an_input_longer_than_the_context_is_a_sentence(layer):
    from gptkiln.teaching import CausalAttention, MultiHeadAttention

    built = {
        "causal": lambda: CausalAttention(3, 2, 4, 0.0),
        "multihead": lambda: MultiHeadAttention(3, 4, 4, 0.0, num_heads=2),
    }[layer]()
    with pytest.raises(GptkilnError, match="the input has 6 tokens, more than this layer's"):
        built(torch.rand(2, 6, 3))
    assert built(torch.rand(2, 4, 3)).shape[:2] == (2, 4)  # the context itself still fits


@pytest.mark.parametrize("layer", ["causal", "multihead"])
def test_an_input_without_its_batch_dimension_is_a_sentence(layer):
    """The 6x3 journey inputs as the book's self-attention takes them, given to a layer that
    takes a batch: a sentence naming the shape, not an IndexError, nor its width called
    tokens."""
    from gptkiln.teaching import CausalAttention, MultiHeadAttention

    built = {
        "causal": lambda: CausalAttention(3, 2, 6, 0.0),
        "multihead": lambda: MultiHeadAttention(3, 2, 6, 0.0, num_heads=2),
    }[layer]()
    with pytest.raises(GptkilnError, match=r"shape \(6, 3\); .*\(B, T, d_in\).*unsqueeze\(0\)"):
        built(JOURNEY_EMBEDDINGS)
    assert built(JOURNEY_EMBEDDINGS.unsqueeze(0)).shape == (1, 6, 2)
