"""The attention progression of chapter 3 of Raschka's *Build a Large Language Model From Scratch*.

Each step adds one idea to the one before, and under the book's seeds each reproduces the numbers
the book prints (see ``tests/test_teaching.py``):

1. ``simple_attention``: attention without trainable weights (book section 3.3).
2. ``SelfAttentionParams``: trainable query/key/value matrices, scaled dot-product (3.4).
3. ``SelfAttentionLinear``: the same with ``nn.Linear`` layers and their better initialisation.
4. ``CausalAttention``: a causal mask and dropout on the attention weights, batched input (3.5).
5. ``MultiHeadAttentionWrapper``: several causal heads side by side, concatenated (3.6.1).
6. ``MultiHeadAttention``: one projection split into heads, plus an output projection (3.6.2).

The names here say what each step is; each docstring gives the name the book uses. Parameter
names (``W_query``, ``W_key``, ``W_value``, ``out_proj``) and the order in which they are created
are the book's, so ``torch.manual_seed`` gives the book's weights and its state dicts load as is.
The production attention is ``gptkiln.model.CausalSelfAttention``; this module is for reading.

``journey_matrices`` computes the 6 x 6 matrices the chapter prints for its sentence "Your journey
starts with one step" and ``plot_journey_attention`` draws them (``python -m gptkiln.teaching
OUT.png``); ``gptkiln inspect`` draws the same kind of map for a trained model.

Shape legend: B batch, T tokens, d_in input embedding size, d_out output size, nh heads,
hs head size (d_out // nh).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn as nn

from gptkiln.errors import GptkilnError

# "Your journey starts with one step", one 3-d embedding per word (the book's section 3.3).
JOURNEY_WORDS = ("Your", "journey", "starts", "with", "one", "step")
JOURNEY_EMBEDDINGS = torch.tensor(
    [
        [0.43, 0.15, 0.89],  # Your     (x^1)
        [0.55, 0.87, 0.66],  # journey  (x^2)
        [0.57, 0.85, 0.64],  # starts   (x^3)
        [0.22, 0.58, 0.33],  # with     (x^4)
        [0.77, 0.25, 0.10],  # one      (x^5)
        [0.05, 0.80, 0.55],  # step     (x^6)
    ]
)


def simple_attention_weights(inputs: torch.Tensor) -> torch.Tensor:
    """Attention weights without trainable weights: softmax of every pairwise dot product.

    Steps 1 and 2 of the book's section 3.3 ("A simple self-attention mechanism without
    trainable weights"), where the book computes ``attn_scores`` and ``attn_weights``.

    Args:
        inputs: token embeddings, shape (T, d_in).

    Returns:
        Attention weights, shape (T, T); row i is how much query i attends to each token and
        sums to 1.
    """
    attn_scores = inputs @ inputs.T  # (T, d_in) @ (d_in, T) -> (T, T)
    return torch.softmax(attn_scores, dim=-1)  # normalise each query's row to sum to 1


def simple_attention(inputs: torch.Tensor) -> torch.Tensor:
    """Context vectors from attention without trainable weights.

    The book's section 3.3 (``all_context_vecs = attn_weights @ inputs``): each context vector
    is the average of all inputs, weighted by the query's attention weights.

    Args:
        inputs: token embeddings, shape (T, d_in).

    Returns:
        Context vectors, shape (T, d_in).
    """
    attn_weights = simple_attention_weights(inputs)  # (T, T)
    return attn_weights @ inputs  # (T, T) @ (T, d_in) -> (T, d_in)


class SelfAttentionParams(nn.Module):
    """Self-attention with raw trainable matrices. Called SelfAttention_v1 in the book.

    Scaled dot-product attention: softmax(Q K^T / sqrt(d_k)) V, with no mask.

    The three projections are plain ``nn.Parameter(torch.rand(d_in, d_out))`` matrices (uniform
    in [0, 1)), used as ``x @ W``. Created in the order query, key, value, as in the book.

    Args:
        d_in: input embedding size.
        d_out: size of queries, keys, values and the output.
    """

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))

    def attention_weights(self, x: torch.Tensor) -> torch.Tensor:
        """Softmax of the query-key scores divided by sqrt(d_k).

        Args:
            x: inputs, shape (T, d_in) or (B, T, d_in).

        Returns:
            Attention weights, shape (T, T) or (B, T, T); each row sums to 1.
        """
        queries = x @ self.W_query  # (..., T, d_out)
        keys = x @ self.W_key  # (..., T, d_out)
        attn_scores = queries @ keys.transpose(-2, -1)  # (..., T, T), the book's omega
        # Divide by sqrt(d_k) *before* the softmax: it keeps the scores from growing with the
        # head size, which would push the softmax towards one-hot and its gradients towards 0.
        return torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Context vectors for every token.

        Args:
            x: inputs, shape (T, d_in) or (B, T, d_in).

        Returns:
            Context vectors, shape (T, d_out) or (B, T, d_out).
        """
        values = x @ self.W_value  # (..., T, d_out)
        attn_weights = self.attention_weights(x)  # (..., T, T)
        context_vec = attn_weights @ values  # (..., T, d_out)
        return context_vec


class SelfAttentionLinear(nn.Module):
    """Self-attention with ``nn.Linear`` projections. Called SelfAttention_v2 in the book.

    ``nn.Linear`` without bias is the same matrix product as ``SelfAttentionParams`` (its weight
    is stored transposed, (d_out, d_in)) but starts from PyTorch's scaled uniform initialisation,
    which trains more stably than ``torch.rand``.

    Args:
        d_in: input embedding size.
        d_out: size of queries, keys, values and the output.
        qkv_bias: whether the query, key and value projections have a bias.
    """

    def __init__(self, d_in: int, d_out: int, qkv_bias: bool = False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def attention_weights(self, x: torch.Tensor) -> torch.Tensor:
        """Softmax of the query-key scores divided by sqrt(d_k).

        Args:
            x: inputs, shape (T, d_in) or (B, T, d_in).

        Returns:
            Attention weights, shape (T, T) or (B, T, T); each row sums to 1.
        """
        queries = self.W_query(x)  # (..., T, d_out)
        keys = self.W_key(x)  # (..., T, d_out)
        attn_scores = queries @ keys.transpose(-2, -1)  # (..., T, T)
        return torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Context vectors for every token.

        Args:
            x: inputs, shape (T, d_in) or (B, T, d_in).

        Returns:
            Context vectors, shape (T, d_out) or (B, T, d_out).
        """
        values = self.W_value(x)  # (..., T, d_out)
        attn_weights = self.attention_weights(x)  # (..., T, T)
        context_vec = attn_weights @ values  # (..., T, d_out)
        return context_vec


def _fits_context(x: torch.Tensor, mask: torch.Tensor) -> int:
    """The number of tokens in ``x`` (B, T, d_in), which the causal mask must cover: a longer
    input is a sentence saying so, not a shape mismatch inside ``masked_fill``; so is one
    without its batch dimension (the 6x3 inputs as the book's self-attention takes them)."""
    if x.dim() != 3:
        shape = tuple(x.shape)
        fix = " (one sequence: x.unsqueeze(0), as the book stacks two: torch.stack((x, x)))"
        raise GptkilnError(
            f"the input has shape {shape}; these layers take a batch, (B, T, d_in)"
            + (fix if x.dim() == 2 else "")
        )
    num_tokens, context_length = x.shape[1], mask.shape[0]
    if num_tokens > context_length:
        raise GptkilnError(
            f"the input has {num_tokens} tokens, more than this layer's context_length "
            f"{context_length} (its causal mask's size); build it with a larger context_length "
            "or pass fewer tokens"
        )
    return num_tokens


class CausalAttention(nn.Module):
    """Single-head causal attention with dropout. Called CausalAttention in the book.

    Each token may attend only to itself and earlier tokens: scores above the diagonal are set to
    -inf before the softmax, so their weights are exactly 0 and each row still sums to 1 (masking
    after the softmax would need a renormalisation). Dropout then zeroes random weights during
    training and scales the rest by 1 / (1 - dropout); in eval mode it does nothing.

    Args:
        d_in: input embedding size.
        d_out: size of queries, keys, values and the output.
        context_length: the longest sequence the mask supports.
        dropout: probability of zeroing each attention weight during training.
        qkv_bias: whether the query, key and value projections have a bias.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        qkv_bias: bool = False,
    ):
        super().__init__()
        self.d_out = d_out
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        # 1 above the diagonal marks the future tokens each query must not see. A buffer moves
        # with the module (.to(device)) but is not trained.
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def attention_weights(self, x: torch.Tensor) -> torch.Tensor:
        """Causal attention weights, after dropout (which is the identity in eval mode).

        Args:
            x: inputs, shape (B, T, d_in) with T <= context_length.

        Returns:
            Attention weights, shape (B, T, T); zero above the diagonal, and (before dropout)
            each row sums to 1.
        """
        num_tokens = _fits_context(x, self.mask)
        queries = self.W_query(x)  # (B, T, d_out)
        keys = self.W_key(x)  # (B, T, d_out)
        attn_scores = queries @ keys.transpose(1, 2)  # (B, T, d_out) @ (B, d_out, T) -> (B, T, T)
        # Slice the mask so that sequences shorter than context_length work too.
        future = self.mask.bool()[:num_tokens, :num_tokens]  # (T, T)
        attn_scores = attn_scores.masked_fill(future, -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)  # (B, T, T)
        return self.dropout(attn_weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Context vectors for every token, each built from that token and the ones before it.

        Args:
            x: inputs, shape (B, T, d_in) with T <= context_length.

        Returns:
            Context vectors, shape (B, T, d_out).
        """
        values = self.W_value(x)  # (B, T, d_out)
        attn_weights = self.attention_weights(x)  # (B, T, T)
        context_vec = attn_weights @ values  # (B, T, T) @ (B, T, d_out) -> (B, T, d_out)
        return context_vec


class MultiHeadAttentionWrapper(nn.Module):
    """Causal heads side by side, concatenated. Called MultiHeadAttentionWrapper in the book.

    Every head is a full ``CausalAttention`` with its own weights and output size d_out, so the
    result has num_heads * d_out features. Easy to read, but the heads run one after another;
    ``MultiHeadAttention`` computes the same kind of thing in one batched pass.

    Args:
        d_in: input embedding size.
        d_out: output size of each head.
        context_length: the longest sequence the mask supports.
        dropout: probability of zeroing each attention weight during training.
        num_heads: number of heads.
        qkv_bias: whether the query, key and value projections have a bias.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
    ):
        super().__init__()
        # Heads are created one after another, so head h gets the seed stream's h-th draw.
        self.heads = nn.ModuleList(
            [
                CausalAttention(d_in, d_out, context_length, dropout, qkv_bias)
                for _ in range(num_heads)
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Each head's context vectors, side by side.

        Args:
            x: inputs, shape (B, T, d_in) with T <= context_length.

        Returns:
            Context vectors, shape (B, T, num_heads * d_out): head 0's features first.
        """
        return torch.cat([head(x) for head in self.heads], dim=-1)  # (B, T, nh * d_out)


class MultiHeadAttention(nn.Module):
    """Multi-head causal attention with weight splits. Called MultiHeadAttention in the book.

    One d_in -> d_out projection each for queries, keys and values, viewed as num_heads heads of
    size hs = d_out // num_heads. Every head attends on its own (scaled by sqrt(hs)); the heads'
    outputs are concatenated back to d_out features and mixed by ``out_proj``. This is the
    attention the book's GPT model uses.

    Args:
        d_in: input embedding size.
        d_out: total size of queries, keys, values and the output; a multiple of num_heads.
        context_length: the longest sequence the mask supports.
        dropout: probability of zeroing each attention weight during training.
        num_heads: number of heads.
        qkv_bias: whether the query, key and value projections have a bias.

    Raises:
        GptkilnError: if d_out is not divisible by num_heads.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
    ):
        super().__init__()
        if d_out % num_heads != 0:
            raise GptkilnError(
                f"MultiHeadAttention: d_out={d_out} is not divisible by num_heads={num_heads}; "
                f"make d_out a multiple of num_heads, e.g. {num_heads * (d_out // num_heads or 1)}"
            )
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        # Created in the book's order (query, key, value, out_proj) so seeds give its weights.
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)  # mixes the concatenated heads
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def _split_heads(self, t: torch.Tensor) -> torch.Tensor:
        """(B, T, d_out) -> (B, nh, T, hs): give every head its own slice of the features."""
        b, num_tokens, _ = t.shape
        t = t.view(b, num_tokens, self.num_heads, self.head_dim)  # (B, T, nh, hs)
        return t.transpose(1, 2)  # (B, nh, T, hs)

    def attention_weights(self, x: torch.Tensor) -> torch.Tensor:
        """Every head's causal attention weights, after dropout (the identity in eval mode).

        Args:
            x: inputs, shape (B, T, d_in) with T <= context_length.

        Returns:
            Attention weights, shape (B, nh, T, T); zero above the diagonal, and (before
            dropout) each row sums to 1.
        """
        num_tokens = _fits_context(x, self.mask)
        queries = self._split_heads(self.W_query(x))  # (B, nh, T, hs)
        keys = self._split_heads(self.W_key(x))  # (B, nh, T, hs)
        # One matmul for all heads: PyTorch batches over the leading (B, nh) dimensions.
        # (B, nh, T, hs) @ (B, nh, hs, T) -> (B, nh, T, T)
        attn_scores = queries @ keys.transpose(2, 3)
        future = self.mask.bool()[:num_tokens, :num_tokens]  # (T, T)
        attn_scores = attn_scores.masked_fill(future, -torch.inf)
        # keys.shape[-1] is the head size hs, not d_out: each head is scaled by its own sqrt(d_k).
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)  # (B, nh, T, T)
        return self.dropout(attn_weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Context vectors for every token, from all heads, mixed by the output projection.

        Args:
            x: inputs, shape (B, T, d_in) with T <= context_length.

        Returns:
            Context vectors, shape (B, T, d_out).
        """
        attn_weights = self.attention_weights(x)  # (B, nh, T, T); checks x's shape first
        b, num_tokens, _ = x.shape
        values = self._split_heads(self.W_value(x))  # (B, nh, T, hs)
        context_vec = attn_weights @ values  # (B, nh, T, hs)
        context_vec = context_vec.transpose(1, 2)  # (B, T, nh, hs)
        # transpose leaves the memory strided; view needs it contiguous.
        context_vec = context_vec.contiguous().view(b, num_tokens, self.d_out)  # (B, T, d_out)
        return self.out_proj(context_vec)  # (B, T, d_out)


# -- the chapter's matrices as pictures ------------------------------------------------------
def journey_matrices() -> dict[str, torch.Tensor]:
    """The 6 x 6 matrices chapter 3 prints for "Your journey starts with one step", in order.

    1. ``attn_scores``: every pair's dot product ``inputs @ inputs.T`` (section 3.3);
    2. ``attn_weights``: their row-wise softmax (3.3);
    3. the weights of ``SelfAttentionLinear`` (``SelfAttention_v2``) under the book's seed 789,
       softmax(Q K^T / sqrt(d_k)) (3.4);
    4. the causal weights of ``CausalAttention`` under the same seed: the future masked before
       the softmax, each row summing to 1 over the past (3.5.1).

    The global random state is left as it was (the seeds are set inside ``fork_rng``).

    Returns:
        Titles (with the book's variable names) to (6, 6) tensors.
    """
    x = JOURNEY_EMBEDDINGS  # (6, 3)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(789)
        trainable = SelfAttentionLinear(3, 2).attention_weights(x)  # (6, 6)
        torch.manual_seed(789)
        causal = CausalAttention(3, 2, 6, 0.0).attention_weights(x[None])[0]  # (6, 6)
    return {
        "attn_scores = inputs @ inputs.T": x @ x.T,
        "attn_weights = softmax(attn_scores)": simple_attention_weights(x),
        "trainable: softmax(Q K^T / sqrt(d_k))": trainable,
        "causal: future masked, then softmax": causal,
    }


def plot_journey_attention(path: str | os.PathLike) -> Path:
    """Draw `journey_matrices` into a PNG at ``path`` (its folder created), each value written in
    its cell, the masked future grey; returns the path."""
    from gptkiln.plots import plot_matrices

    panels = [
        (title, matrix, title.startswith("causal")) for title, matrix in journey_matrices().items()
    ]
    return plot_matrices(
        panels,
        JOURNEY_WORDS,
        path,
        title='Chapter 3: attention over "Your journey starts with one step"\n'
        "each row a query, each column a key; grey: the masked future",
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m gptkiln.teaching [OUT.png]``: chapter 3's matrices as a picture."""
    import argparse
    import sys

    from gptkiln.errors import GptkilnError
    from gptkiln.plots import check_png_path

    parser = argparse.ArgumentParser(
        prog="python -m gptkiln.teaching",
        description="Draw chapter 3's attention matrices over the book's six words as one PNG.",
    )
    parser.add_argument(
        "out", nargs="?", default="journey.png", help="the PNG (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    try:
        print(f"wrote {plot_journey_attention(check_png_path(args.out, 'OUT'))}")
    except GptkilnError as e:
        print(f"python -m gptkiln.teaching: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(
            f"python -m gptkiln.teaching: error: {e.filename or args.out}: {e.strerror or e}",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
