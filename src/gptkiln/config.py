"""Typed configuration: model (`GPTConfig`), training (`TrainConfig`), sampling (`SampleConfig`).

No torch import here, so the CLI can parse and validate flags before torch loads.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

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
    """

    vocab_size: int = GPT2_VOCAB_SIZE
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

    def __post_init__(self) -> None:
        _check_types(self, "model config")  # kinds first; the ranges below
        for name in ("vocab_size", "context_length", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if value < 1:
                raise GptkilnError(
                    f"model config: {name} must be a positive integer, got {value!r}"
                )
        if self.head_dim is None and self.n_embd % self.n_head:
            raise GptkilnError(
                f"model config: n_embd ({self.n_embd}) must be divisible by n_head "
                f"({self.n_head}), or set head_dim"
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


@dataclass
class SampleConfig:
    """How to pick each next token, and when a sequence ends.

    temperature 0 means greedy (argmax); top_k keeps the k most likely tokens; top_p keeps the
    smallest set whose probability reaches p (nucleus sampling). ``stop_at_eos`` ends a sequence
    at the tokenizer's end-of-text id; ``stop`` ends it where one of these strings appears in the
    generated text (the text returned stops right before it). ``presence_penalty`` and
    ``frequency_penalty`` are OpenAI's: each logit is lowered by ``frequency_penalty`` times the
    number of times its token was generated so far, and by ``presence_penalty`` once if it was
    generated at all (in [-2, 2]; negative values favour repeats).
    """

    max_new_tokens: int = 100
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_at_eos: bool = True
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        _check_types(self, "sampling config")
        check_sampling(self.temperature, self.top_k, self.top_p)
        if self.seed is not None:
            _check_seed(self.seed)
        if self.max_new_tokens < 0:
            raise GptkilnError(
                f"max_new_tokens must be >= 0, got {self.max_new_tokens}; pass e.g. 100"
            )
        self.stop = check_stop(self.stop)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise GptkilnError(
                    f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}"
                )


def check_stop(stop: Any) -> tuple[str, ...]:
    """Stop strings as a tuple: one string or a list of them, each non-empty."""
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise GptkilnError(f"stop must be a list of non-empty strings, got {stop!r}")
    return tuple(stop)


def _check_seed(seed: int) -> None:
    if not 0 <= seed < 2**63:  # what torch's generators take
        raise GptkilnError(f"seed must be a whole number in [0, 2**63), got {seed!r}")


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise `GptkilnError` for sampling settings that have no meaning."""
    if not 0 <= temperature < math.inf:
        raise GptkilnError(
            f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}"
        )
    if top_k is not None and top_k < 1:
        raise GptkilnError(f"top_k must be >= 1 (or unset to keep all tokens), got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise GptkilnError(f"top_p must be in (0, 1] (1 keeps all tokens), got {top_p}")


# The groups of `TrainConfig`'s settings, in the order `gptkiln train --help` shows them.
TRAIN_GROUPS = (
    "data",
    "model",
    "optimisation",
    "evaluation and samples",
    "checkpoints",
    "hardware",
)


def setting(default: Any, group: str, help: str, *, unset: str | None = None) -> Any:
    """A `TrainConfig` field that carries what ``gptkiln train --help`` says of it.

    Args:
        default: the field's default.
        group: one of `TRAIN_GROUPS`.
        help: one line: what it is, and its range or choices (the default is added).
        unset: what a default of None means (e.g. "the preset's"); required for one.
    """
    return dataclasses.field(
        default=default, metadata={"group": group, "help": help, "unset": unset}
    )


@dataclass
class TrainConfig:
    """Everything about a training run except the model's shape.

    Sampling of training data: ``"windows"`` walks the book's sliding windows (``stride``) in
    seeded-shuffled epochs; ``"random"`` draws windows at seeded random offsets (nanoGPT style,
    for corpora far larger than one pass). The run length is ``max_steps`` optimizer steps, or
    ``epochs`` passes over the windows when ``max_steps`` is 0 (windows sampling only); with
    ``max_time`` (minutes), the run also ends at the first step after that much training wall
    time (steps, evaluations, samples and checkpoints; not data preparation), and the cosine
    schedule decays over whichever of the two ends first.

    Each field carries its group and one line of help (`setting`), which ``gptkiln train
    --help`` shows; every field is also a key of a YAML recipe.
    """

    data: str | None = setting(
        None,
        "data",
        "text to train on: a .txt/.jsonl/.json/.parquet file (.gz, .zst), a folder of them, "
        "hf:NAME, a .yaml mixture (prepared into OUT/data/), or a folder made by `gptkiln prepare`",
        unset="the bundled Shakespeare plays",
    )
    out: str = setting(
        "runs/default",
        "checkpoints",
        "the run directory: weights, tokenizer, trainer state, metrics.csv, loss.png",
    )
    model: str = setting(
        "qwen3-baby",  # learned most in 3 minutes (bench/first_run.py; GPT-2's baby: --model baby)
        "model",
        f"model preset, which names its architecture too (llama3-*, qwen3-*; the others gpt2): "
        f"{' | '.join(PRESETS)}",
    )
    text_field: str = setting(
        "text",
        "data",
        "the JSON key, or Parquet or dataset column, of --data that holds the text",
    )
    tokenizer: str = setting(
        "bpe:16384",  # trained on the corpus; "gpt2" for GPT-2's weights and export
        "data",
        "gpt2 (OpenAI's BPE) | char | bpe:N (a byte-level BPE of N ids trained on the text; "
        "bpe alone: 8192); prepared data keeps its own",
    )
    val_fraction: float = setting(
        0.1, "data", "share of the text, taken from its end, held out for validation, in (0, 1)"
    )
    context_length: int | None = setting(
        None, "model", "tokens the model sees at once (>= 1)", unset="the preset's"
    )
    dropout: float | None = setting(None, "model", "dropout rate, in [0, 1)", unset="the preset's")
    tie_embeddings: bool | None = setting(
        None, "model", "share the token embedding with the output head", unset="the preset's"
    )
    gelu: str | None = setting(
        None,
        "model",
        "the MLP's activation: tanh (GPT-2's approximation) | exact (the erf form)",
        unset="the preset's",
    )
    sampling: Literal["windows", "random"] = setting(
        "random",
        "data",
        "how training windows are drawn: random = at seeded random offsets (nanoGPT); "
        "windows = the book's sliding windows, each epoch in a seeded shuffle",
    )
    stride: int | None = setting(
        None,
        "data",
        "tokens between window starts with --sampling windows (>= 1)",
        unset="the context length",
    )
    batch_size: int = setting(8, "optimisation", "windows per micro-batch, per process (>= 1)")
    grad_accum: int = setting(1, "optimisation", "micro-batches per optimizer step (>= 1)")
    max_steps: int = setting(
        1800, "optimisation", "optimizer steps to train (>= 0; 0: --epochs decides)"
    )
    epochs: int = setting(
        0,
        "optimisation",
        "passes over the windows when --max-steps is 0 (>= 0; needs --sampling windows)",
    )
    max_time: float | None = setting(
        None,
        "optimisation",
        "also end at the first step past this many minutes of training (> 0); the cosine "
        "follows whichever of steps and time is further along",
        unset="no time limit",
    )
    lr: float = setting(1e-3, "optimisation", "peak learning rate, reached after warm-up (> 0)")
    min_lr: float = setting(
        1e-4, "optimisation", "learning rate at the end of the cosine decay, in [0, lr]"
    )
    warmup_steps: int = setting(30, "optimisation", "steps of linear warm-up from 0 to --lr (>= 0)")
    decay_lr: bool = setting(
        True, "optimisation", "decay the learning rate to --min-lr on a cosine after warm-up"
    )
    weight_decay: float = setting(
        0.1, "optimisation", "AdamW's weight decay, on matrices only (>= 0)"
    )
    beta1: float = setting(0.9, "optimisation", "AdamW's first-moment decay, in [0, 1)")
    beta2: float = setting(0.95, "optimisation", "AdamW's second-moment decay, in [0, 1)")
    grad_clip: float = setting(
        1.0, "optimisation", "clip the gradients' norm to this (>= 0; 0: no clipping)"
    )
    eval_interval: int = setting(
        100,
        "evaluation and samples",
        "evaluate every N steps and at the end, one row of OUT/metrics.csv each (>= 1)",
    )
    eval_batches: int = setting(
        10, "evaluation and samples", "batches of each split per evaluation (>= 1)"
    )
    eval_train: bool = setting(
        True,
        "evaluation and samples",
        "evaluate on fixed training batches too (off: the train loss is the last step's)",
    )
    sample_interval: int = setting(
        600, "evaluation and samples", "print a sample every N steps, and one at the end (>= 1)"
    )
    sample_prompt: str = setting("ROMEO:", "evaluation and samples", "the samples' prompt")
    sample_tokens: int = setting(60, "evaluation and samples", "tokens per sample (>= 0)")
    tensorboard: bool = setting(
        False,
        "evaluation and samples",
        "also log every metric and the samples for TensorBoard, into OUT/tensorboard/ "
        "(view: tensorboard --logdir OUT)",
    )
    eval_tasks: str | None = setting(
        None,
        "evaluation and samples",
        "lm-evaluation-harness tasks, comma-separated, run on the final weights: the results "
        "JSON into OUT/eval/, the table printed, the metrics into metrics.csv (needs the eval "
        "extra)",
        unset="none",
    )
    eval_tasks_interval: int | None = setting(
        None,
        "evaluation and samples",
        "also run --eval-tasks every N steps: a metrics.csv column per task metric "
        "(eval/TASK/METRIC), drawn beside the loss in loss.png (>= 1)",
        unset="at the end only",
    )
    eval_tasks_limit: float | None = setting(
        None,
        "evaluation and samples",
        "documents per task at most in each run of --eval-tasks, or a fraction of them below 1",
        unset="all",
    )
    eval_tasks_include_path: str | None = setting(
        None,
        "evaluation and samples",
        "a folder of task YAML files of your own for --eval-tasks",
        unset="the harness's tasks only",
    )
    checkpoint_interval: int = setting(
        100, "checkpoints", "save a checkpoint every N steps, and at the end (>= 1)"
    )
    seed: int = setting(
        1337, "data", "seed of the initial weights, the data order and the samples, in [0, 2**63)"
    )
    device: str = setting(
        "auto", "hardware", "auto (cuda, else mps, else cpu) | cpu | cuda | cuda:N | mps"
    )
    compile: bool = setting(
        False, "hardware", "run the model under torch.compile (the first step compiles it)"
    )
    # On CPUs with AMX (e.g. Xeon Sapphire Rapids) "bf16" makes a 124M step ~1.7x faster; on
    # small models the casts cost more than they save: auto measures (gptkiln.train.precision).
    precision: Literal["auto", "fp32", "bf16"] = setting(
        "auto",
        "hardware",
        "auto = bf16 autocast on CUDA, and on a CPU with AMX or AVX512-BF16 when a short "
        "measurement of this model's step finds it faster (a resume keeps the run's choice), "
        "fp32 elsewhere; bf16 = autocast on any device (weights and optimizer stay fp32); "
        "fp32 = no autocast",
    )
    parallel: Literal["ddp", "fsdp"] = setting(
        "ddp",
        "hardware",
        "with several processes (--nproc, torchrun): ddp = a whole model each; fsdp = each "
        "holds a shard (FSDP2)",
    )
    progress: bool = setting(True, "evaluation and samples", "show a progress bar")

    def __post_init__(self) -> None:
        _check_types(self, "training config")
        # Names first: a wrong preset or tokenizer must fail before any data is prepared.
        from gptkiln.tokenizers import parse_tokenizer_spec

        if self.model not in PRESETS:
            raise GptkilnError(
                f"unknown model preset {self.model!r}; choose one of: {', '.join(PRESETS)}"
            )
        parse_tokenizer_spec(self.tokenizer)
        positive = ["batch_size", "grad_accum", "eval_interval", "eval_batches"]
        positive += ["sample_interval", "checkpoint_interval"]
        for name in positive:
            _positive_int(name, getattr(self, name))
        for name in ("max_steps", "epochs", "warmup_steps", "sample_tokens"):
            value = getattr(self, name)
            if value < 0:
                raise GptkilnError(f"{name} must be a whole number >= 0, got {value!r}")
        for name in ("context_length", "stride"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.max_steps == 0 and self.epochs == 0:
            raise GptkilnError("set max_steps > 0, or epochs > 0 with sampling 'windows'")
        if self.max_steps == 0 and self.sampling != "windows":
            raise GptkilnError("epochs need sampling 'windows'; with 'random' set max_steps")
        if self.sampling not in ("windows", "random"):
            raise GptkilnError(f"sampling must be 'windows' or 'random', got {self.sampling!r}")
        if self.parallel not in ("ddp", "fsdp"):
            raise GptkilnError(f"parallel must be 'ddp' or 'fsdp', got {self.parallel!r}")
        if self.max_time is not None and not 0 < self.max_time < math.inf:
            raise GptkilnError(
                f"max_time must be a number of minutes > 0 (or unset for no time limit), "
                f"got {self.max_time!r}"
            )
        if not 0 < self.lr < math.inf:
            raise GptkilnError(f"lr must be a finite number > 0, got {self.lr!r}")
        _check_seed(self.seed)
        if not 0 <= self.grad_clip < math.inf:
            raise GptkilnError(
                f"grad_clip must be a finite number >= 0 (0 turns clipping off), "
                f"got {self.grad_clip!r}"
            )
        if not 0 <= self.min_lr <= self.lr:
            raise GptkilnError(f"min_lr must be in [0, lr={self.lr}], got {self.min_lr!r}")
        if not 0 <= self.weight_decay < math.inf:
            raise GptkilnError(
                f"weight_decay must be a finite number >= 0, got {self.weight_decay!r}"
            )
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise GptkilnError(
                    f"{name} must be in [0, 1) (Adam's moment decay), got {getattr(self, name)!r}"
                )
        if not 0.0 < self.val_fraction < 1.0:
            raise GptkilnError(f"val_fraction must be in (0, 1), got {self.val_fraction!r}")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise GptkilnError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise GptkilnError(
                f"precision must be 'auto', 'fp32' or 'bf16', got {self.precision!r}"
            )
        self._check_eval_tasks()
        if self.gelu not in (None, "tanh", "exact"):
            raise GptkilnError(f"gelu must be 'tanh' or 'exact', got {self.gelu!r}")

    def _check_eval_tasks(self) -> None:
        """The settings of harness tasks while training: each needs ``eval_tasks``."""
        if self.eval_tasks is not None and not self.eval_tasks.strip(" ,"):
            raise GptkilnError(
                "eval_tasks is empty; name tasks (hellaswag,arc_easy) or leave it out"
            )
        for name in ("eval_tasks_interval", "eval_tasks_limit", "eval_tasks_include_path"):
            if getattr(self, name) is not None and self.eval_tasks is None:
                flag = "--" + name.replace("_", "-")
                raise GptkilnError(f"{flag} needs --eval-tasks, the tasks to run; add it")
        if self.eval_tasks_interval is not None:
            _positive_int("eval_tasks_interval", self.eval_tasks_interval)
        limit = self.eval_tasks_limit
        if limit is not None and not (0 < limit < math.inf and (limit < 1 or limit.is_integer())):
            raise GptkilnError(
                f"eval_tasks_limit must be a whole number of documents >= 1 or a fraction in "
                f"(0, 1), got {limit!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        return _from_dict(cls, values, "training config")


FINETUNE_TASKS = ("instruct", "classify", "chat", "dpo")
# Per task: (val_fraction, test_fraction, train_layers): the book's chapters 7 and 6 (chat and
# DPO split as instruct does).
FINETUNE_DEFAULTS = {
    "instruct": (0.05, 0.1, "all"),
    "classify": (0.1, 0.2, "last-1"),
    "chat": (0.05, 0.1, "all"),
    "dpo": (0.05, 0.1, "all"),
}
DPO_LOSSES = ("sigmoid", "ipo")


@dataclass
class FinetuneConfig:
    """What a fine-tuning run starts from, learns and trains; the loop's own settings (steps,
    learning rate, evaluation, ...) are a `TrainConfig`.

    Tasks: ``"instruct"`` (the book's chapter 7: instruction entries in a prompt template,
    next-token loss on the whole example or, with ``mask_prompt``, on the response alone) and
    ``"classify"`` (chapter 6: texts with labels, a new head on the last position); ``"chat"``
    (conversations in the model's chat template, loss on the assistant's turns) and ``"dpo"``
    (preference pairs, Direct Preference Optimization with ``beta`` and ``dpo_loss``).

    ``train_layers``: ``"all"``; ``"last-N"``, the last N blocks, the final norm and the head
    (the rest frozen); or ``"lora"``, LoRA adapters of ``lora_rank`` on the linear layers (base
    frozen; see `gptkiln.finetune.lora`). ``"default"`` is the task's: all (instruct), last-1
    (classify); a ``lora_rank`` > 0 means ``"lora"``. Fractions left as None are the task's:
    0.05 / 0.1 of the entries for validation / test (instruct, in the book's order: train, test,
    val), 0.1 / 0.2 after a seeded shuffle (classify: train, val, test).
    """

    base: str  # a run directory, or a Hugging Face directory
    data: str  # .json / .jsonl; classify: .csv / .tsv too; chat, dpo: .parquet and hf: too
    task: Literal["instruct", "classify", "chat", "dpo"] = "instruct"
    template: str = "alpaca"  # instruct: a bundled name or a JSON file; chat, dpo: a .jinja file
    mask_prompt: bool = False  # instruct: no loss on the prompt's tokens
    text_column: str = "text"  # classify
    label_column: str = "label"  # classify
    max_length: int | None = None  # classify: tokens a text is cut / padded to; chat, dpo: the
    # longest example in tokens (longer ones are cut at a turn boundary or dropped); None: context
    val_fraction: float | None = None
    test_fraction: float | None = None
    train_layers: str = "default"
    lora_rank: int = 0
    lora_alpha: float | None = None  # None = 2 x lora_rank
    lora_qkv: Literal["split", "fused"] = "split"
    lora_head: bool = False
    beta: float = 0.1  # dpo: the strength of the pull towards the reference model
    dpo_loss: Literal["sigmoid", "ipo"] = "sigmoid"

    def __post_init__(self) -> None:
        _check_types(self, "fine-tuning config")
        if self.task not in FINETUNE_TASKS:
            raise GptkilnError(
                f"task must be one of {', '.join(FINETUNE_TASKS)}, got {self.task!r}"
            )
        val, test, layers = FINETUNE_DEFAULTS[self.task]
        self.val_fraction = val if self.val_fraction is None else self.val_fraction
        self.test_fraction = test if self.test_fraction is None else self.test_fraction
        if not 0 < self.val_fraction < 1 or not 0 <= self.test_fraction < 1:
            raise GptkilnError(
                f"val_fraction must be in (0, 1) and test_fraction in [0, 1), got "
                f"{self.val_fraction!r} and {self.test_fraction!r}"
            )
        if self.val_fraction + self.test_fraction >= 1:
            raise GptkilnError(
                f"val_fraction + test_fraction must leave entries to train on, got "
                f"{self.val_fraction} + {self.test_fraction}"
            )
        if self.lora_rank < 0:
            raise GptkilnError(f"lora_rank must be >= 0 (0: no LoRA), got {self.lora_rank}")
        if self.lora_rank and self.train_layers not in ("default", "lora"):
            raise GptkilnError(
                f"--lora-rank {self.lora_rank} trains LoRA adapters, but --train-layers "
                f"{self.train_layers} asks for other layers; drop one of them"
            )
        if self.train_layers == "default":
            self.train_layers = "lora" if self.lora_rank else layers
        if self.train_layers == "lora" and not self.lora_rank:
            self.lora_rank = 16
        if self.lora_alpha is None and self.train_layers == "lora":
            self.lora_alpha = 2.0 * self.lora_rank
        if self.train_layers not in ("all", "lora") and not re.fullmatch(
            r"last-[1-9]\d*", self.train_layers
        ):
            raise GptkilnError(
                f"train_layers must be all, last-N (N >= 1) or lora, got {self.train_layers!r}"
            )
        if self.lora_alpha is not None and not 0 < self.lora_alpha < math.inf:
            raise GptkilnError(f"lora_alpha must be a number > 0, got {self.lora_alpha!r}")
        if self.lora_qkv not in ("split", "fused"):
            raise GptkilnError(f"lora_qkv must be 'split' or 'fused', got {self.lora_qkv!r}")
        if self.max_length is not None:
            _positive_int("max_length", self.max_length)
        if self.lora_head and self.train_layers != "lora":
            raise GptkilnError("--lora-head puts an adapter on the head: it needs --lora-rank")
        if not 0 < self.beta < math.inf:
            raise GptkilnError(f"beta must be a number > 0, got {self.beta!r}")
        if self.dpo_loss not in DPO_LOSSES:
            raise GptkilnError(
                f"dpo_loss must be one of {', '.join(DPO_LOSSES)}, got {self.dpo_loss!r}"
            )

    @property
    def lora(self) -> bool:
        return self.train_layers == "lora"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> FinetuneConfig:
        return _from_dict(cls, values, "fine-tuning config")


def check_values(cls, values: dict[str, Any], where: str) -> dict[str, Any]:
    """``values`` for the fields of config class ``cls``, each checked against its field's type;
    `GptkilnError` naming ``where`` for an unknown key or a value of the wrong kind.

    A float field takes any number, and a string written as a plain number: YAML 1.1 (PyYAML)
    reads ``lr: 1e-3`` as the string ``"1e-3"``. Int fields take whole numbers, bool fields true or
    false, text fields text; ``None`` only where the field allows it. Ranges are the classes'
    own checks.
    """
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise GptkilnError(
            f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    hints = _type_hints(cls)
    return {name: _checked(hints[name], v, f"{where}: {name}") for name, v in values.items()}


@functools.cache
def _type_hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # evaluates the string annotations: once per class


def _checked(hint: Any, value: Any, label: str) -> Any:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
        args = typing.get_args(hint)
    if typing.get_origin(hint) is Literal:
        hint = type(args[0])
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise GptkilnError(f"{label} must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
        raise GptkilnError(f"{label} must be a whole number, got {value!r}")
    if hint is float:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _YAML_FLOAT.fullmatch(value):
            return float(value)
        raise GptkilnError(f"{label} must be a number, got {value!r}")
    if hint is str and isinstance(value, os.PathLike):  # data=Path(...), out=Path(...)
        return os.fspath(value)
    if hint is str and not isinstance(value, str):
        raise GptkilnError(f"{label} must be text, got {value!r}")
    return value


_YAML_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
"""A number as YAML 1.2 writes it, e.g. ``1e-3``, which PyYAML (YAML 1.1) leaves a string."""


def _check_types(config, what: str) -> None:
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    for name, value in check_values(type(config), values, what).items():
        object.__setattr__(config, name, value)


def _from_dict(cls, values: dict[str, Any], what: str):
    """Build a config dataclass from a mapping (JSON, YAML), naming a key it does not have."""
    return cls(**check_values(cls, values, what))


def _positive_int(name: str, value: int) -> None:
    if value < 1:
        raise GptkilnError(f"{name} must be a whole number >= 1, got {value!r}")
