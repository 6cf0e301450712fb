"""From what a format's reader gives (`StoredModel`: a config and a state dict with gptkiln's
names) to the GPT: every name, shape and dtype checked, the GPT built on the meta device and the
tensors assigned to it.

Building on the meta device costs no memory and no initialisation, and assigning the
memory-mapped tensors copies nothing, so a load needs about one copy of the weights. A quantized
run is built the same way: the meta model is quantized first (still no memory) and the int8
tensors are assigned, so its load holds the int8 bytes and never a float copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gptkiln.config import GPTConfig
from gptkiln.loading.checks import check_finite, check_state_dict
from gptkiln.model import GPT
from gptkiln.quantize import (
    check_scales,
    float32_rest,
    quantization_of,
    quantize_model,
    tie_quantized_head,
)


@dataclass
class StoredModel:
    """A model as a format stores it, read but not built.

    Attributes:
        config: the model's config.
        state_dict: its tensors with gptkiln's names and layouts (a tied head once, as
            ``wte.weight``): memory-mapped when read, meta tensors when only headers were.
        source: where the tensors came from, for error messages.
        files: the weights files read.
        quantization: what a quantized run's config.json records (None: float weights).
        run_config: a gptkiln run's config.json, whose entries the features' load steps read
            (`gptkiln.load_steps`); None for a format whose config.json no feature writes.
    """

    config: GPTConfig
    state_dict: dict[str, torch.Tensor]
    source: str
    files: list[Path] = field(default_factory=list)
    quantization: dict[str, Any] | None = None
    run_config: dict[str, Any] | None = None


def build_model(
    config: GPTConfig,
    sd: dict[str, torch.Tensor],
    source: str,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    quantization: dict[str, Any] | None = None,
) -> GPT:
    """A GPT with the weights of ``sd`` (gptkiln names), built on meta and assigned, not copied.

    ``source`` names where the weights came from, for error messages. ``quantization`` (what a
    quantized run's config.json records) builds the quantized model and assigns ``sd``'s int8
    weights and scales to it; every name, shape and dtype is checked first, and every float
    weight is finite (`check_finite`).
    """
    check_state_dict(sd, config, source, quantization)
    check_finite(sd, source)
    model = _meta_model(config, quantization)
    sd = dict(sd)
    if config.tie_embeddings:
        sd["lm_head.weight"] = sd["wte.weight"]
        if "wte.scale" in sd:
            sd["lm_head.scale"] = sd["wte.scale"]
    model.load_state_dict(sd, strict=True, assign=True)
    model.tie_weights()
    if quantization is not None:
        tie_quantized_head(model)
        check_scales(model, source)
        float32_rest(model)  # a bf16 checkpoint's norms, assigned as stored
    model.init_buffers()  # RoPE's tables, which no checkpoint stores, off the meta device
    model.to(device=device, dtype=dtype)
    return model.eval()


def _meta_model(config: GPTConfig, quantization: dict[str, Any] | None) -> GPT:
    """The GPT of ``config`` on the meta device, quantized as recorded (no memory either way)."""
    with torch.device("meta"):
        model = GPT(config)
        if quantization is not None:
            quantize_model(
                model, quantization["method"], embedding_and_head=quantization["embedding_and_head"]
            )
    return model


def quantized_on_load(model: GPT, quantize: str | None) -> GPT:
    """``model`` quantized on load when asked (a quantized one as it is). The float tensors that
    stay float are copied out of the memory-mapped file, so its pages (every float weight was
    read to be quantized) are let go with the mapping instead of staying in the process."""
    if quantize is None or quantization_of(model) is not None:
        return model
    quantize_model(model, quantize)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_floating_point():
                tensor.data = tensor.data.clone()
    return model
