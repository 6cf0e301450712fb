"""The checks every format's weights pass before a model is built from them, and the checks of a
built model against what it is asked to do: one readable GptkilnError each, naming the file,
the tensors and the fix.

The shapes a checkpoint must hold are worked out from the config alone (`expected_shapes`), so
a format's reader checks its tensors (memory-mapped, or meta tensors from a header) without
building anything.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import torch

from gptkiln.config import GPTConfig
from gptkiln.errors import GptkilnError
from gptkiln.model import GPT
from gptkiln.positions import value_index
from gptkiln.quantize import int8_modules

_MAX_NAMES = 6  # parameter names listed in one error line before "and N more"
_BLOCK_KEY = re.compile(r"^h\.(\d+)\.")


def expected_shapes(
    config: GPTConfig, quantization: dict[str, Any] | None = None
) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a checkpoint of this config stores (tied head excluded), in
    the order of ``GPT(config).state_dict()``; worked out from the config, no model built. A
    quantized checkpoint (``quantization`` as its config.json records it) also stores a
    ``NAME.scale`` (out,) after each int8 ``NAME.weight`` (`gptkiln.quantize.int8_modules`)."""
    C, V, rows = config.n_embd, config.vocab_size, config.vocab_rows
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (rows, C)}
    if config.positions == "learned":
        shapes["wpe.weight"] = (config.context_length, C)
    block = _block_shapes(config)
    for i in range(config.n_layer):
        mixes = value_index(i, config.value_embeds, config.n_layer) is not None
        held = {name: shape for name, shape in block.items() if mixes or name != "attn.value_mix"}
        shapes.update({f"h.{i}.{name}": shape for name, shape in held.items()})
    KV = config.kv_heads * config.head_size
    shapes.update({f"value_embeds.{i}.weight": (V, KV) for i in range(config.value_embeds)})
    shapes.update(_norm_shapes("ln_f", config))
    if config.num_classes:
        shapes.update(
            {"score.weight": (config.num_classes, C), "score.bias": (config.num_classes,)}
        )
    elif not config.tie_embeddings:
        shapes["lm_head.weight"] = (rows, C)
    if quantization is None:
        return shapes
    int8 = {f"{m}.weight" for m in int8_modules(config, quantization["embedding_and_head"])}
    with_scales: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        with_scales[name] = shape
        if name in int8:
            with_scales[name.removesuffix("weight") + "scale"] = shape[:1]
    return with_scales


def _norm_shapes(name: str, config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """A norm's tensors: LayerNorm's weight and bias, RMSNorm's weight alone."""
    shapes = {f"{name}.weight": (config.n_embd,)}
    if config.norm == "layernorm":
        shapes[f"{name}.bias"] = (config.n_embd,)
    return shapes


def _block_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of one block's tensors, in the order of the block's state dict."""
    C, M = config.n_embd, config.mlp_size
    Q, KV = config.n_head * config.head_size, config.kv_heads * config.head_size
    if config.family == "gpt2":
        linears = {
            "attn.c_attn": (3 * C, C, config.qkv_bias),
            "attn.c_proj": (C, C, config.bias),
        }
    else:
        linears = {
            "attn.q_proj": (Q, C, config.qkv_bias),
            "attn.k_proj": (KV, C, config.qkv_bias),
            "attn.v_proj": (KV, C, config.qkv_bias),
            "attn.o_proj": (C, Q, config.bias),
        }
    if config.mlp == "gelu":
        linears.update({"mlp.c_fc": (M, C, config.bias), "mlp.c_proj": (C, M, config.bias)})
    else:
        linears.update({
            "mlp.gate_proj": (M, C, config.bias),
            "mlp.up_proj": (M, C, config.bias),
            "mlp.down_proj": (C, M, config.bias),
        })  # fmt: skip
    shapes = _norm_shapes("ln_1", config)
    if config.value_embeds:
        shapes["attn.value_mix"] = (2,)  # how each block mixes its value embedding in
    for name, (out, inp, bias) in linears.items():
        shapes[f"{name}.weight"] = (out, inp)
        if bias:
            shapes[f"{name}.bias"] = (out,)
        if name == "attn.o_proj" and config.qk_norm:
            shapes["attn.q_norm.weight"] = (config.head_size,)
            shapes["attn.k_norm.weight"] = (config.head_size,)
        if name in ("attn.c_proj", "attn.o_proj"):
            shapes.update(_norm_shapes("ln_2", config))
    return shapes


def check_state_dict(
    sd: Mapping[str, torch.Tensor],
    config: GPTConfig,
    source: str,
    quantization: dict[str, Any] | None = None,
) -> None:
    """Raise one readable GptkilnError when ``sd``'s names, shapes or dtypes do not fit ``config``
    (and ``quantization``, what a quantized run's config.json records: which weights are int8).

    The sizes the weights themselves hold are compared first (`check_config_fits`), so that a
    config that was edited to something huge is refused at once, before anything is built.
    """
    check_config_fits(config, sd, source)
    int8 = set()
    if quantization is not None:
        int8 = {f"{m}.weight" for m in int8_modules(config, quantization["embedding_and_head"])}
    check_dtypes(sd, int8, source, quantization)
    check_shapes(sd, expected_shapes(config, quantization), source)


def check_dtypes(
    sd: Mapping[str, torch.Tensor],
    int8: set[str],
    source: str,
    quantization: dict[str, Any] | None,
) -> None:
    """Raise a GptkilnError naming the tensors of ``sd`` stored as int8 where a float is
    expected, as a float where int8 is (``int8``: the names a quantized checkpoint stores as
    int8), or as neither: any float dtype passes for a float."""
    wrong = [
        f"{k} {str(v.dtype).removeprefix('torch.')} (expected {'int8' if k in int8 else 'a float'})"
        for k, v in sd.items()
        if (v.dtype == torch.int8) != (k in int8)
        and (v.dtype == torch.int8 or v.is_floating_point())
    ]
    if wrong:
        recorded = "records no quantization" if quantization is None else "records int8 weights"
        raise GptkilnError(
            f"{source} does not fit its config.json, which {recorded}: wrong dtype "
            f"{_names(wrong)}; restore the config.json that came with these weights, or "
            "convert the run again"
        )
    not_float = [f"{k} ({str(v.dtype).removeprefix('torch.')})" for k, v in sd.items()
                 if not (v.is_floating_point() or v.dtype == torch.int8)]  # fmt: skip
    if not_float:
        raise GptkilnError(
            f"{source} holds tensors that are not floating-point weights: {_names(not_float)}; "
            "it is not a gptkiln or GPT-2 checkpoint: restore the file or convert it again"
        )


def check_finite(sd: Mapping[str, torch.Tensor], source: str) -> None:
    """Raise one GptkilnError naming the float tensors of ``sd`` that hold a NaN or an infinity.

    Training never saves such weights (it stops at the step that made them), so they come from a
    damaged or edited file; a model built from them would write the same token for every prompt.
    One min/max pass per tensor reads the weights once and allocates nothing their size.
    """
    bad = []
    for name, t in sd.items():
        if t.is_floating_point() and t.device.type != "meta" and t.numel():
            try:
                low, high = torch.aminmax(t.detach())
            except (NotImplementedError, RuntimeError):  # float8, which aminmax has no kernel of
                low, high = torch.aminmax(t.detach().float())
            if not (torch.isfinite(low) and torch.isfinite(high)):
                bad.append(name)
    if bad:
        raise GptkilnError(
            f"{source} holds weights that are not finite (NaN or infinity): {_names(bad)}; the "
            "file is damaged or was written by a run that diverged: restore it, or load an "
            "earlier checkpoint"
        )


def weights_dims(sd: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """The model sizes a state dict (gptkiln names) holds: ``n_layer`` from its ``h.N`` blocks,
    ``vocab_size`` and ``n_embd`` from ``wte.weight``, ``context_length`` from ``wpe.weight``
    (learned positions only: RoPE stores none). Read from names and shapes only (a
    memory-mapped file is not read)."""
    blocks = {int(m.group(1)) for k in sd if (m := _BLOCK_KEY.match(k))}
    dims = {"n_layer": max(blocks) + 1 if blocks else 0}
    if "wte.weight" in sd and sd["wte.weight"].dim() == 2:
        dims["vocab_size"], dims["n_embd"] = sd["wte.weight"].shape
    if "wpe.weight" in sd and sd["wpe.weight"].dim() == 2:
        dims["context_length"] = sd["wpe.weight"].shape[0]
    return dims


def check_config_fits(config: GPTConfig, sd: Mapping[str, torch.Tensor], source: str) -> None:
    """Refuse a config whose sizes are not those the weights hold, naming each field and what
    the weights say: a config.json edited by hand (``"n_layer": 1000000000``) or taken from
    another run fails here in one line, instead of building a model that does not fit in memory."""
    held = weights_dims(sd)

    def said(name: str) -> int:  # a padded vocabulary's embedding holds its padded rows
        return config.vocab_rows if name == "vocab_size" else getattr(config, name)

    wrong = [name for name, value in held.items() if said(name) != value]
    if wrong:
        says = ", ".join(f"{name} {said(name)}" for name in wrong)
        holds = ", ".join(f"{name} {held[name]}" for name in wrong)
        raise GptkilnError(
            f"{source}: the config says {says}, but the weights hold {holds}; the config "
            "does not belong to these weights: restore it (or set it to what the weights hold)"
        )


def check_shapes(
    sd: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]], source: str
) -> None:
    """Raise a GptkilnError naming missing, unexpected and wrongly shaped tensors of ``sd``."""
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    wrong = [
        f"{k} {tuple(sd[k].shape)} (expected {tuple(expected[k])})"
        for k in expected
        if k in sd and tuple(sd[k].shape) != tuple(expected[k])
    ]
    problems = [
        f"{what} {_names(items)}"
        for what, items in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("wrong shape", wrong),
        )
        if items
    ]
    if problems:
        raise GptkilnError(
            f"{source} does not fit this model config: {'; '.join(problems)}; "
            f"is it a checkpoint of a different model or format?"
        )


def _names(items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_NAMES])
    more = len(items) - _MAX_NAMES
    return f"{shown} and {more} more" if more > 0 else shown


# -- a built model against its use -----------------------------------------------------------
def check_language_model(model: GPT, run_dir: str | os.PathLike) -> None:
    """Refuse a classifier (`gptkiln finetune --task classify`) where text is read or written
    token by token (generate, perplexity, inspect): its head scores classes, not next tokens."""
    if model.config.num_classes:
        raise GptkilnError(
            f"{run_dir} is a classifier of {model.config.num_classes} classes, which reads no "
            f"next tokens and writes no text; ask it with `gptkiln classify {run_dir} --text TEXT`"
        )


def check_ids_fit(ids_max: int, model: GPT, tokenizer: Any, run_dir: str | os.PathLike) -> None:
    """Refuse token ids the model has no embedding for (a run whose tokenizer files were
    replaced, e.g. by a ``prepare`` into the run directory) with one line, not an IndexError."""
    if ids_max >= model.config.vocab_size:
        raise GptkilnError(
            f"{run_dir}: its tokenizer ({tokenizer.kind}, {tokenizer.vocab_size:,} ids) gave id "
            f"{ids_max:,}, beyond the model's {model.config.vocab_size:,}; the tokenizer files "
            "do not belong to this model: restore them, or train the model again"
        )
