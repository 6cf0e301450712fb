"""Int8 weight-only quantization, applied to a built GPT from outside (model.py stays pure).

Decoding one token reads every weight once, so at batch 1 its speed is bounded by memory
bandwidth; int8 weights are a quarter of fp32's bytes. Only the weights are quantized: the
activations, and so every sum, are fp32 (a bf16 or fp16 checkpoint's float tensors that stay,
its norms and biases, become fp32 with it: `float32_rest`).

**The scheme.** Symmetric, one scale per output channel (per row of an (out, in) weight)::

    scale[o] = max_i |W[o, i]| / 127          (1 / 127 for a row of zeros)
    q[o, i]  = round(W[o, i] / scale[o])      in [-127, 127], int8

and the layer computes ``y = (x @ qᵀ) · scale + bias`` (`Int8Linear`; its kernels, tuned for
decoding as the float ones are, live in `gptkiln.cpu.products`, chosen by `gptkiln.cpu`).

**What becomes int8.** Every linear layer of the blocks (GPT-2's ``attn.c_attn``, ``attn.c_proj``,
``mlp.c_fc``, ``mlp.c_proj``; Llama's and Qwen's ``attn.q_proj``, ``k_proj``, ``v_proj``,
``o_proj``, ``mlp.gate_proj``, ``up_proj``, ``down_proj``: `gptkiln.model.block_linears`)
and, unless ``embedding_and_head=False``, the output head and the
token embedding: GPT-2's head *is* its embedding (tied), and one int8 matrix with one scale per
token serves both (`Int8Embedding` scales each looked-up row by its token's scale). The head is
the largest single weight (50257 x 768: 31% of GPT-2 124M's bytes), so keeping it in fp32 would
leave 239 of the 497 MB a token reads in place of 124. What stays float: the position embedding
(``wpe``, 3 MB at 124M), the norms (LayerNorm, RMSNorm, q/k norms), the biases, the scales and
RoPE's cos/sin tables. The figures behind the
choice (speed and perplexity with the head int8 or float) are in ``bench/README.md``.

**The format on disk** (`gptkiln convert quantize`). A quantized run directory is a run
directory whose config.json records ``"quantization": {"method": "int8", "scheme":
"per-channel-symmetric", "embedding_and_head": true}`` and whose model.safetensors holds, for
each quantized module ``NAME``, ``NAME.weight`` as int8 (out, in) and ``NAME.scale`` as float32
(out,), beside the float tensors of the rest under their usual names (a tied head is stored
once, as ``wte.weight`` and ``wte.scale``). It loads the way a float run does: the model is
built on the meta device, quantized there (no memory), and the memory-mapped int8 tensors are
assigned, so no float copy of those weights is ever made.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptkiln.config import GPTConfig
from gptkiln.cpu.products import dequantize_linear, int8_rows_linear
from gptkiln.errors import GptkilnError
from gptkiln.model import GPT, block_linears

METHODS = ("int8",)
"""The values ``quantize=`` accepts (besides None: keep the weights as they are)."""

SCHEME = "per-channel-symmetric"


def check_quantize(value: str | None, flag: str = "quantize") -> str | None:
    """``value`` when it names a method gptkiln has (None passes: no quantization); otherwise a
    GptkilnError naming the flag, the value and the choices."""
    if value is None or value in METHODS:
        return value
    raise GptkilnError(
        f"{flag} {value!r} is not a quantization gptkiln has; choose one of: "
        f"{', '.join(METHODS)} (or leave it out to keep the weights as stored)"
    )


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of a float weight (out, in): q int8 (out, in), scale float32 (out,), with
    ``q * scale[:, None]`` the nearest int8 grid point per channel (see the module docstring).

    Works on the meta device too (shapes and dtypes only), which is how a quantized model is
    built before its int8 weights are assigned.
    """
    if weight.is_meta:  # no arithmetic: meta's reductions import torch._dynamo (1.8 s)
        out_features = weight.size(0)
        return torch.empty(weight.shape, dtype=torch.int8, device="meta"), torch.empty(
            out_features, dtype=torch.float32, device="meta"
        )
    w = weight.detach().float()
    low, high = w.aminmax(dim=1)  # (out,) each: |w|'s largest without a full-size |w| tensor
    absmax = torch.maximum(-low, high)
    scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax)) / 127
    # one full-size float tensor, rounded and clamped in place (124M's 49: 0.47 s -> 0.31)
    q = (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)  # (out, in)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float weight (out, in) an int8 one stands for: ``q * scale[:, None]``."""
    return q.to(scale.dtype) * scale[:, None]


class Int8Linear(nn.Module):
    """A linear layer with an int8 weight (out, in) and one scale per output channel:
    ``y = (x @ weightᵀ) · scale + bias``.

    State dict: ``weight`` (int8), ``scale`` (float) and ``bias``, under the float layer's
    names. Like `gptkiln.model.Linear`, the CPU backend may run it by another kernel from
    outside (`gptkiln.cpu.prepare_for_decoding`; ``(x, weight, scale, bias) -> y``), without
    autograd, on the CPU, in fp32. An untuned product without autograd
    (outside ``torch.compile``, which cannot trace a ctypes call) goes to
    `gptkiln.cpu.products.int8_rows_linear`, which multiplies up to ``FEW_ROWS`` fp32 rows on
    the CPU without converting the weight (a prompt's first token comes before any tuning) and
    hands everything else to `gptkiln.cpu.products.dequantize_linear`, the product every other
    case takes.
    """

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = _frozen(weight)
        self.register_buffer("scale", scale)
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias)

    @classmethod
    def from_float(cls, linear: nn.Linear) -> Int8Linear:
        q, scale = quantize_per_channel(linear.weight)
        return cls(q, scale, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() and not torch.compiler.is_compiling():
            return int8_rows_linear(x, self.weight, self.scale, self.bias)  # few rows: no copy
        return dequantize_linear(x, self.weight, self.scale, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, int8 per-channel"
        )


class Int8Embedding(nn.Module):
    """A token embedding with int8 rows (V, C) and one scale per token (V,): a lookup returns
    ``weight[idx] * scale[idx]`` in the scales' dtype. Tied to an `Int8Linear` head, the same
    two tensors are that head's weight and per-output-channel scales."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.weight = _frozen(weight)
        self.register_buffer("scale", scale)

    @classmethod
    def from_float(cls, embedding: nn.Embedding) -> Int8Embedding:
        return cls(*quantize_per_channel(embedding.weight))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(idx, self.weight).to(self.scale.dtype)  # (..., C)
        return rows * self.scale[idx].unsqueeze(-1)  # (..., C)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 per-row"


def _frozen(t: torch.Tensor) -> nn.Parameter:
    """An int8 tensor as a parameter (so it moves, ties and counts as the float one did) that
    autograd never touches."""
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)


def quantize_model(model: GPT, method: str = "int8", *, embedding_and_head: bool = True) -> GPT:
    """Quantize ``model``'s weights in place (see the module docstring) and return it.

    Args:
        method: "int8" (the only one so far).
        embedding_and_head: also the output head and the token embedding (in a tied model one
            int8 matrix serves both); False keeps them in float.

    A model already quantized is returned as it is. On the meta device this builds the
    quantized model's structure without memory (loading a quantized run starts there).
    """
    check_quantize(method)
    if quantization_of(model) is not None:
        return model
    if getattr(model.config, "num_classes", None):
        raise GptkilnError(
            f"this run is a classifier ({model.config.num_classes} classes); int8 quantization "
            "is for language models (generate, perplexity, inspect): use the float run"
        )
    for name in int8_modules(model.config, embedding_and_head=False):
        parent, _, attr = name.rpartition(".")
        module = model.get_submodule(parent)
        setattr(module, attr, Int8Linear.from_float(getattr(module, attr)))
    if embedding_and_head:
        head = model.lm_head
        tied = head.weight is model.wte.weight
        model.wte = Int8Embedding.from_float(model.wte)
        if tied:
            model.lm_head = Int8Linear(model.wte.weight, model.wte.scale, None)
        else:
            model.lm_head = Int8Linear.from_float(head)
    float32_rest(model)
    return model


def float32_rest(model: nn.Module) -> None:
    """The tensors of a quantized model that stay float (norms, biases, the position embedding,
    the scales) made fp32, as its int8 products and embedding give: a bf16 or fp16 checkpoint's
    norms would otherwise meet fp32 activations (and its KV cache take their dtype). Exact: every
    bf16 and fp16 value is an fp32 one. On the meta device it changes dtypes only."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_floating_point() and tensor.dtype != torch.float32:
                tensor.data = tensor.data.float()


def int8_modules(config: GPTConfig, embedding_and_head: bool) -> list[str]:
    """The modules of a GPT of ``config`` whose weight `quantize_model` makes int8, by name, in
    the order of the model's state dict. A quantized checkpoint stores ``NAME.weight`` (int8)
    and ``NAME.scale`` for each; a tied head is the embedding (``wte``) and is not listed."""
    names = ["wte"] if embedding_and_head else []
    layers = block_linears(config)
    names += [f"h.{i}.{layer}" for i in range(config.n_layer) for layer in layers]
    if embedding_and_head and not config.tie_embeddings:
        names.append("lm_head")
    return names


def quantization_of(model: nn.Module) -> dict[str, Any] | None:
    """What config.json records for a quantized model (see the module docstring), None for a
    float one."""
    if not any(isinstance(m, Int8Linear) for m in model.modules()):
        return None
    return {
        "method": "int8",
        "scheme": SCHEME,
        "embedding_and_head": isinstance(getattr(model, "wte", None), Int8Embedding),
    }


def tie_quantized_head(model: GPT) -> None:
    """Share the int8 embedding's weight and scales with the head when the config ties them
    (after ``load_state_dict(assign=True)``, which assigns each name its own tensor)."""
    if model.config.tie_embeddings and isinstance(model.wte, Int8Embedding):
        model.lm_head.weight = model.wte.weight
        model.lm_head.scale = model.wte.scale


def check_scales(model: nn.Module, source: str) -> None:
    """Refuse a quantized model whose scales are not all finite and positive (as
    `quantize_per_channel` makes them): a file corrupted inside its data, which the
    safetensors header cannot show. Reads only the scales (one float per channel)."""
    for name, module in model.named_modules():
        scale = getattr(module, "scale", None)
        if isinstance(module, (Int8Linear, Int8Embedding)) and not bool(
            (torch.isfinite(scale) & (scale > 0)).all()
        ):
            raise GptkilnError(
                f"{source}: {name}.scale holds values that are not finite and positive; the "
                "file is corrupt: restore it, or quantize the float run again"
            )


def read_quantization(recorded: Any, source: str) -> dict[str, Any] | None:
    """The quantization a config.json records (None: a float run), checked; ``source`` names
    the file for the error."""
    if recorded is None:
        return None
    if (
        not isinstance(recorded, dict)
        or recorded.get("method") not in METHODS
        or recorded.get("scheme") != SCHEME
        or not isinstance(recorded.get("embedding_and_head"), bool)
    ):
        raise GptkilnError(
            f"{source} records a quantization gptkiln does not read ({recorded!r}); expected "
            f'{{"method": "int8", "scheme": "{SCHEME}", "embedding_and_head": true or false}}: '
            "restore the file, or quantize the float run again (gptkiln convert quantize)"
        )
    return recorded
