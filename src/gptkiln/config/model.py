"""The model's configuration: `GPTConfig` (shape and architecture choices), the choices each family
makes (`FAMILIES`) and the named presets (`PRESETS`).

No torch import here, so the CLI can parse and validate flags before torch loads.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any, Literal

from gptkiln.config.checks import _check_types, _from_dict
from gptkiln.errors import GptkilnError

GPT2_VOCAB_SIZE = 50257


@dataclass
class GPTConfig:
    """Shape and options of a decoder-only transformer: GPT-2, Llama 3 or Qwen3.

    One model (`gptkiln.model.GPT`) is built from these choices; a family is a named set of
    them (see ``FAMILIES`` and the presets), not a class of its own. The defaults are GPT-2's,
    so a config.json written before the family fields existed still means GPT-2.

    Attributes:
        vocab_size: number of token ids (GPT-2 BPE: 50257).
        padded_vocab_size: None, or the rows of the token embedding and the output head when
            more than ``vocab_size`` (nanoGPT's 50,304 for GPT-2's 50,257): the head's matmul
            runs at a size the hardware tiles well, while the model still predicts
            ``vocab_size`` ids: the logits are cut to them and the loss is over them, so the
            extra rows are never a token and no gradient reaches them (the head still computes
            them, and weight decay shrinks them); exports leave them out.
        context_length: longest sequence the model sees (GPT-2's ``n_positions``; nanoGPT's
            ``block_size``).
        n_layer: transformer blocks.
        n_head: attention heads per block.
        n_embd: width of the residual stream.
        dropout: dropout on embeddings, attention weights and residual branches (0 at inference).
        qkv_bias: bias in the fused query/key/value projection (GPT-2: yes, the book: no).
        tie_embeddings: share the token embedding with the output head (GPT-2: yes, the book: no).
        attention: ``"sdpa"`` uses ``F.scaled_dot_product_attention``; ``"math"`` spells out
            softmax(QK^T / sqrt(hs)) V with an explicit causal mask. Both give the same numbers.
        gelu: the MLP's activation: ``"tanh"``, GPT-2's tanh approximation (HF's ``gelu_new``),
            or ``"exact"``, the erf form (``nn.GELU()``, as nanoGPT; HF's ``gelu``).
        init: how a fresh model's weights are drawn: ``"gpt2"`` (N(0, 0.02), residual
            projections scaled by 1/sqrt(2 n_layer)) or ``"pytorch"`` (each layer's PyTorch
            default, e.g. N(0, 1) embeddings: what the book's ``GPTModel`` gets, and why its
            chapter-5 run memorises its small corpus as fast as it does).
        num_classes: None for a language model (the head predicts the next of ``vocab_size``
            tokens); N for a classifier: the head is ``score``, a linear layer (with a bias) from
            the last position's hidden state to N classes (the book's chapter 6; untied).
        family: the architecture the choices below make, recorded so that an export knows
            its Hugging Face class: ``"gpt2"`` (``GPT2LMHeadModel``), ``"llama3"``
            (``LlamaForCausalLM``) or ``"qwen3"`` (``Qwen3ForCausalLM``); checked against
            them (`FAMILIES`). It also names the parameters: GPT-2's (``attn.c_attn``,
            ``mlp.c_fc``, ...) or Hugging Face Llama's roles (``attn.q_proj``, ``k_proj``,
            ``v_proj``, ``o_proj``, ``q_norm``, ``k_norm``; ``mlp.gate_proj``, ``up_proj``,
            ``down_proj``).
        norm: ``"layernorm"`` (GPT-2; with a bias) or ``"rmsnorm"`` (Llama, Qwen; no bias, no
            mean subtracted).
        norm_eps: the epsilon of every norm (GPT-2 and Llama 3: 1e-5; Qwen3: 1e-6).
        positions: ``"learned"``, a position embedding added to the token embedding
            (``wpe``, GPT-2), or ``"rope"``, rotary embeddings applied to each head's queries
            and keys (no ``wpe``).
        rope_theta: RoPE's base (Llama 3: 500,000; Qwen3: 1,000,000); unused without rope.
        rope_scaling: None, or Llama 3.1's frequency scaling for long contexts, the book's
            ``freq_config``: ``{"factor", "low_freq_factor", "high_freq_factor",
            "original_context_length"}`` (Hugging Face calls the last
            ``original_max_position_embeddings``).
        mlp: ``"gelu"`` (GPT-2: expand, GELU, project) or ``"swiglu"`` (Llama, Qwen:
            ``down(silu(gate(x)) * up(x))``).
        intermediate_size: the MLP's hidden width; None: 4 x n_embd (gelu only; swiglu
            needs it set, e.g. about 8/3 x n_embd).
        n_kv_head: key/value heads; None: n_head (multi-head attention). Fewer is
            grouped-query attention (GQA, each key/value head serves n_head / n_kv_head query
            heads; 1 is multi-query attention), which divides the KV cache by as much.
        head_dim: the size of each head; None: n_embd // n_head (Qwen3 uses 128 whatever its
            width, so n_head x head_dim may differ from n_embd).
        qk_norm: an RMSNorm over each head's queries and keys before RoPE (Qwen3).
        bias: biases in the other linear layers (attention output, MLP): GPT-2 has them,
            Llama and Qwen do not. The query/key/value projections follow ``qkv_bias``.

    Choices from the public speedruns (modded-nanogpt), off by default and in every
    published model's config (no Hugging Face class has them, so a model with one does not
    export to transformers):

    Attributes:
        relu2: the gate of a swiglu MLP is ReLU squared (``relu(x)**2``; So et al. 2021,
            "Primer", https://arxiv.org/abs/2109.08668) in place of SiLU.
        logit_softcap: None, or c: the logits are ``c * tanh(logits / c)``, bounded in
            (-c, c) (Gemma 2's ``final_logit_softcapping``; modded-nanogpt's record 12).
        zero_init_out: a fresh model's residual projections (``c_proj``, ``o_proj``,
            ``down_proj``) start at zero, so each block starts as the identity (modded-nanogpt's
            record 5); with ``init`` "gpt2" only.
        value_embeds: N extra token embeddings (each ``kv_heads x head_size`` wide) added into
            the attention values: block i < N takes embedding i, and the last N blocks take the
            same N again (modded-nanogpt's value embeddings, U-shaped); each block mixes them in
            as ``a v + b e`` with its own learned ``a`` and ``b`` (both 0.5 at the start). 0:
            none; at most ``n_layer // 2``.
        attention_windows: None, or one number a block: how many positions (itself included)
            each query of that block attends to, 0 for all of them (sliding-window attention
            by layer, modded-nanogpt's long and short windows). The KV cache still holds the
            whole context.
    """

    vocab_size: int = GPT2_VOCAB_SIZE
    padded_vocab_size: int | None = None
    context_length: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    qkv_bias: bool = True
    tie_embeddings: bool = True
    attention: Literal["sdpa", "math"] = "sdpa"
    gelu: Literal["tanh", "exact"] = "tanh"
    init: Literal["gpt2", "pytorch"] = "gpt2"
    num_classes: int | None = None
    family: Literal["gpt2", "llama3", "qwen3"] = "gpt2"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_eps: float = 1e-5
    positions: Literal["learned", "rope"] = "learned"
    rope_theta: float = 10_000.0
    rope_scaling: dict[str, float] | None = None
    mlp: Literal["gelu", "swiglu"] = "gelu"
    intermediate_size: int | None = None
    n_kv_head: int | None = None
    head_dim: int | None = None
    qk_norm: bool = False
    bias: bool = True
    relu2: bool = False
    logit_softcap: float | None = None
    zero_init_out: bool = False
    value_embeds: int = 0
    attention_windows: list[int] | None = None

    def __post_init__(self) -> None:
        _check_types(self, "model config")  # kinds first; the ranges below
        for name in ("vocab_size", "context_length", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if value < 1:
                raise GptkilnError(
                    f"model config: {name} must be a positive integer, got {value!r}"
                )
        if self.padded_vocab_size is not None and self.padded_vocab_size < self.vocab_size:
            raise GptkilnError(
                f"model config: padded_vocab_size ({self.padded_vocab_size}) must be at least "
                f"vocab_size ({self.vocab_size}), or null for no padding"
            )
        if self.head_dim is None and self.n_embd % self.n_head:
            raise GptkilnError(
                f"model config: n_embd ({self.n_embd}) must be divisible by n_head "
                f"({self.n_head})" + (", or set head_dim" if self.family != "gpt2" else "")
            )
        if not 0.0 <= self.dropout < 1.0:
            raise GptkilnError(f"model config: dropout must be in [0, 1), got {self.dropout!r}")
        if self.init not in ("gpt2", "pytorch"):
            raise GptkilnError(f"model config: init must be 'gpt2' or 'pytorch', got {self.init!r}")
        if self.gelu not in ("tanh", "exact"):
            raise GptkilnError(f"model config: gelu must be 'tanh' or 'exact', got {self.gelu!r}")
        if self.attention not in ("sdpa", "math"):
            raise GptkilnError(
                f"model config: attention must be 'sdpa' or 'math', got {self.attention!r}"
            )
        if self.num_classes is not None and self.num_classes < 2:
            raise GptkilnError(
                f"model config: num_classes must be >= 2 (or null for a language model), "
                f"got {self.num_classes!r}"
            )
        if self.num_classes is not None and self.tie_embeddings:
            raise GptkilnError(
                "model config: a classifier (num_classes set) has its own head; set "
                "tie_embeddings to false"
            )
        self._check_architecture()

    def _check_architecture(self) -> None:
        """One GptkilnError for the first choice of norm, positions, MLP, heads or family that
        cannot be built (or that the family named does not have)."""
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise GptkilnError(
                    f"model config: {name} must be one of {', '.join(map(repr, choices))}, "
                    f"got {getattr(self, name)!r}"
                )
        for name in ("norm_eps", "rope_theta"):
            if not 0 < getattr(self, name) < math.inf:
                raise GptkilnError(
                    f"model config: {name} must be a number > 0, got {getattr(self, name)!r}"
                )
        for name in ("intermediate_size", "n_kv_head", "head_dim"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise GptkilnError(
                    f"model config: {name} must be a positive integer (or null), got {value!r}"
                )
        if self.n_head % self.kv_heads:
            raise GptkilnError(
                f"model config: n_head ({self.n_head}) must be a multiple of n_kv_head "
                f"({self.n_kv_head}): each key/value head serves the same number of query heads"
            )
        if self.positions == "rope" and self.head_size % 2:
            raise GptkilnError(
                f"model config: RoPE rotates pairs of dimensions, so the head size must be even, "
                f"got {self.head_size}; change n_embd / n_head or head_dim"
            )
        if self.mlp == "swiglu" and self.intermediate_size is None:
            raise GptkilnError(
                "model config: a swiglu MLP needs intermediate_size (its hidden width, e.g. "
                f"{_swiglu_width(self.n_embd)} for n_embd {self.n_embd}: about 8/3 x n_embd)"
            )
        if self.mlp == "swiglu" and self.gelu != "tanh":
            raise GptkilnError(
                f"model config: gelu {self.gelu!r} is the activation of a gelu MLP; this model's "
                "MLP is swiglu (SiLU-gated): leave gelu out"
            )
        self._check_recipe_choices()
        if self.rope_scaling is not None:
            if self.positions != "rope":
                raise GptkilnError(
                    "model config: rope_scaling scales RoPE's frequencies, but positions is "
                    f"{self.positions!r}; set positions to 'rope' or rope_scaling to null"
                )
            self.rope_scaling = _checked_rope_scaling(self.rope_scaling)
        wrong = [
            f"{name} {getattr(self, name)!r} (expected {want!r})"
            for name, want in FAMILIES[self.family].items()
            if getattr(self, name) != want
        ]
        if self.family == "gpt2" and self.kv_heads != self.n_head:
            wrong.append(
                f"n_kv_head {self.n_kv_head} (GPT-2 has one key/value head per query head)"
            )
        if self.family == "gpt2" and self.head_size * self.n_head != self.n_embd:
            wrong.append(f"head_dim {self.head_dim} (GPT-2's is n_embd / n_head)")
        if wrong:
            raise GptkilnError(
                f"model config: family {self.family!r} does not have {', '.join(wrong)}; change "
                "them, or set family to the architecture these choices make "
                f"({', '.join(FAMILIES)})"
            )

    def _check_recipe_choices(self) -> None:
        """The speedruns' choices (``relu2``, ``logit_softcap``, ``zero_init_out``,
        ``value_embeds``, ``attention_windows``): each where this model has what it changes."""
        if self.relu2 and self.mlp != "swiglu":
            raise GptkilnError(
                "model config: relu2 replaces the SiLU gate of a swiglu MLP; this model's MLP "
                f"is {self.mlp!r} (GPT-2's GELU); use a llama3 or qwen3 model, or leave relu2 out"
            )
        cap = self.logit_softcap
        if cap is not None and not 0 < cap < math.inf:
            raise GptkilnError(
                f"model config: logit_softcap must be a number > 0 (or null: no cap), got {cap!r}"
            )
        if not 0 <= self.value_embeds <= self.n_layer // 2:
            raise GptkilnError(
                f"model config: value_embeds must be in [0, n_layer // 2 = {self.n_layer // 2}] "
                f"(the first and the last that many blocks take them), got {self.value_embeds!r}"
            )
        windows = self.attention_windows
        if windows is not None and (
            not isinstance(windows, list)
            or len(windows) != self.n_layer
            or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in windows)
        ):
            raise GptkilnError(
                f"model config: attention_windows must be a list of {self.n_layer} whole numbers "
                f">= 0 (one a block; 0: the whole context), got {windows!r}"
            )
        if windows is not None and not any(windows):
            self.attention_windows = None  # no block windowed: the plain model
        if self.zero_init_out and self.init != "gpt2":
            raise GptkilnError(
                "model config: zero_init_out starts the residual projections at zero under "
                f"init 'gpt2'; this model's init is {self.init!r}: leave zero_init_out out"
            )

    def recipe_choices(self) -> list[str]:
        """The speedruns' choices this config makes (``relu2``, ...), which no Hugging Face
        class has: empty for every published model."""
        return [name for name in _RECIPE_CHOICES if getattr(self, name) not in (None, False, 0)]

    @property
    def vocab_rows(self) -> int:
        """Rows of the token embedding and the output head: ``padded_vocab_size``, or
        ``vocab_size``."""
        return self.padded_vocab_size or self.vocab_size

    def unpadded(self) -> GPTConfig:
        """This config without the padding rows (what an export describes: its weights are cut
        to ``vocab_size`` rows)."""
        return dataclasses.replace(self, padded_vocab_size=None)

    @property
    def head_size(self) -> int:
        """The size of each attention head: ``head_dim``, or n_embd // n_head."""
        return self.head_dim or self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``n_kv_head``, or n_head (one per query head)."""
        return self.n_kv_head or self.n_head

    @property
    def mlp_size(self) -> int:
        """The MLP's hidden width: ``intermediate_size``, or 4 x n_embd (GPT-2)."""
        return self.intermediate_size or 4 * self.n_embd

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> GPTConfig:
        """A named preset (see ``PRESETS``), with any field overridden by keyword."""
        if name not in PRESETS:
            raise GptkilnError(
                f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}"
            )
        return cls(**{**PRESETS[name], **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GPTConfig:
        return _from_dict(cls, values, "model config")


def rounded_vocab(vocab_size: int, multiple: int | None) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple`` (None or 1: as it is): the rows
    ``--pad-vocab`` gives a model's embedding and head."""
    return vocab_size if not multiple else -(-vocab_size // multiple) * multiple


_RECIPE_CHOICES = ("relu2", "logit_softcap", "zero_init_out", "value_embeds", "attention_windows")

_CHOICES: dict[str, tuple[str, ...]] = {
    "family": ("gpt2", "llama3", "qwen3"),
    "norm": ("layernorm", "rmsnorm"),
    "positions": ("learned", "rope"),
    "mlp": ("gelu", "swiglu"),
}

FAMILIES: dict[str, dict[str, Any]] = {
    # The choices each family makes; the rest (sizes, n_kv_head, head_dim, tying, qkv_bias,
    # rope_theta and rope_scaling, norm_eps; Llama's and Qwen's other biases) vary between a
    # family's models. GPT-2's n_kv_head and head_dim are its n_head and n_embd / n_head.
    "gpt2": dict(norm="layernorm", positions="learned", mlp="gelu", qk_norm=False, bias=True),
    "llama3": dict(norm="rmsnorm", positions="rope", mlp="swiglu", qk_norm=False),
    "qwen3": dict(norm="rmsnorm", positions="rope", mlp="swiglu", qk_norm=True),
}

ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_context_length")


def _checked_rope_scaling(values: Any) -> dict[str, float]:
    """Llama 3.1's RoPE scaling (the book's ``freq_config``), checked: its four keys, numbers
    > 0, high_freq_factor > low_freq_factor (the smoothing divides by their difference)."""
    expected = ", ".join(ROPE_SCALING_KEYS)
    if not isinstance(values, dict) or set(values) != set(ROPE_SCALING_KEYS):
        got = sorted(values) if isinstance(values, dict) else repr(values)
        raise GptkilnError(
            f"model config: rope_scaling must have exactly the keys {expected} (Llama 3's; "
            f"Hugging Face's original_max_position_embeddings is original_context_length), "
            f"got {got}"
        )
    out = {}
    for key in ROPE_SCALING_KEYS:
        value = values[key]
        if (
            isinstance(value, bool)
            or not isinstance(value, numbers.Real)
            or not 0 < value < math.inf
        ):
            raise GptkilnError(
                f"model config: rope_scaling {key} must be a number > 0, got {value!r}"
            )
        out[key] = float(value)
    if not float(values["original_context_length"]).is_integer():
        raise GptkilnError(
            "model config: rope_scaling original_context_length must be a whole number of "
            f"tokens, got {values['original_context_length']!r}"
        )
    out["original_context_length"] = int(values["original_context_length"])
    if out["high_freq_factor"] <= out["low_freq_factor"]:
        raise GptkilnError(
            f"model config: rope_scaling high_freq_factor ({out['high_freq_factor']}) must be "
            f"greater than low_freq_factor ({out['low_freq_factor']})"
        )
    return out


def _swiglu_width(n_embd: int) -> int:
    """About 8/3 x n_embd, rounded up to a multiple of 32: a SwiGLU MLP's three matrices then
    hold about what GPT-2's two 4x ones do."""
    return -(-8 * n_embd // (3 * 32)) * 32


_GPT2 = dict(vocab_size=GPT2_VOCAB_SIZE, context_length=1024, qkv_bias=True, tie_embeddings=True)

# Llama 3 and Qwen3: RMSNorm, RoPE, SwiGLU, GQA, no biases, tied embeddings (as Llama 3.2 1B
# and 3B and Qwen3 0.6B and 1.7B), each family's own norm epsilon and RoPE base.
_LLAMA3 = dict(
    family="llama3",
    norm="rmsnorm",
    norm_eps=1e-5,
    positions="rope",
    rope_theta=500_000.0,
    mlp="swiglu",
    qkv_bias=False,
    bias=False,
    tie_embeddings=True,
)
_QWEN3 = dict(_LLAMA3, family="qwen3", norm_eps=1e-6, rope_theta=1_000_000.0, qk_norm=True)
# Llama 3.1 and 3.2 were trained at 8,192 tokens and stretched to 131,072.
_LLAMA31_ROPE_SCALING = dict(
    factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context_length=8192
)

PRESETS: dict[str, dict[str, Any]] = {
    # OpenAI's GPT-2 family (Hugging Face names). gpt2 has 124,439,808 parameters.
    "gpt2": dict(_GPT2, n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(_GPT2, n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(_GPT2, n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(_GPT2, n_layer=48, n_head=25, n_embd=1600),
    # The book's GPT_CONFIG_124M: no qkv bias, untied head, dropout 0.1, PyTorch's default
    # initialisation: 163,009,536 parameters.
    "book-124m": dict(
        vocab_size=GPT2_VOCAB_SIZE,
        context_length=1024,
        n_layer=12,
        n_head=12,
        n_embd=768,
        dropout=0.1,
        qkv_bias=False,
        tie_embeddings=False,
        init="pytorch",
    ),
    # Small presets that train on a 2-core CPU. vocab_size follows the tokenizer at train time.
    # (family is written out so that a Llama or Qwen model of the same sizes is not taken for
    # one of these.)
    "tiny": dict(family="gpt2", context_length=64, n_layer=2, n_head=2, n_embd=32),
    "baby": dict(family="gpt2", context_length=64, n_layer=4, n_head=4, n_embd=128),
    "mini": dict(family="gpt2", context_length=128, n_layer=4, n_head=4, n_embd=192),
    # The same budgets for the other families: baby's shape with 2 key/value heads of 4, and
    # GPT-2 124M's with 4 of 12 and the MLP widened to about its parameter count (124,730,880
    # and 124,732,416 parameters with GPT-2's vocabulary, against gpt2's 124,439,808).
    "llama3-baby": dict(
        _LLAMA3, context_length=64, n_layer=4, n_head=4, n_kv_head=2, n_embd=128,
        intermediate_size=352,
    ),
    "llama3-124m": dict(
        _LLAMA3, vocab_size=GPT2_VOCAB_SIZE, context_length=1024, n_layer=12, n_head=12,
        n_kv_head=4, n_embd=768, intermediate_size=2432,
    ),
    "qwen3-baby": dict(
        _QWEN3, context_length=64, n_layer=4, n_head=4, n_kv_head=2, n_embd=128,
        intermediate_size=352,
    ),
    # qwen3-baby with its head apart from the token embedding: the default run's model (issue
    # 47: with Muon, 0.0075 bits/char below the tied one at the same steps)
    "qwen3-baby-untied": dict(
        _QWEN3, context_length=64, n_layer=4, n_head=4, n_kv_head=2, n_embd=128,
        intermediate_size=352, tie_embeddings=False,
    ),
    "qwen3-124m": dict(
        _QWEN3, vocab_size=GPT2_VOCAB_SIZE, context_length=1024, n_layer=12, n_head=12,
        n_kv_head=4, n_embd=768, intermediate_size=2432,
    ),
    # The published shapes (the book's LLAMA32_CONFIG_1B / _3B, QWEN_CONFIG_06_B /
    # QWEN3_CONFIG_1_7B, and Hugging Face's config.json of each): 1,235,814,400,
    # 3,212,749,824, 596,049,920 and 1,720,574,976 parameters (embeddings tied).
    "llama3.2-1b": dict(
        _LLAMA3, vocab_size=128_256, context_length=131_072, n_layer=16, n_head=32,
        n_kv_head=8, n_embd=2048, intermediate_size=8192, rope_scaling=_LLAMA31_ROPE_SCALING,
    ),
    "llama3.2-3b": dict(
        _LLAMA3, vocab_size=128_256, context_length=131_072, n_layer=28, n_head=24,
        n_kv_head=8, n_embd=3072, intermediate_size=8192, rope_scaling=_LLAMA31_ROPE_SCALING,
    ),
    "qwen3-0.6b": dict(
        _QWEN3, vocab_size=151_936, context_length=40_960, n_layer=28, n_head=16,
        n_kv_head=8, n_embd=1024, head_dim=128, intermediate_size=3072,
    ),
    "qwen3-1.7b": dict(
        _QWEN3, vocab_size=151_936, context_length=40_960, n_layer=28, n_head=16,
        n_kv_head=8, n_embd=2048, head_dim=128, intermediate_size=6144,
    ),
}  # fmt: skip
