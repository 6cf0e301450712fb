"""A Hugging Face GPT-2 directory (config.json with ``"model_type": "gpt2"``, and its weights
files, `gptkiln.loading.hf`): its ``GPT2Config`` as a `GPTConfig`, its names and layouts as
gptkiln's.

Hugging Face's GPT-2 and gptkiln use the same parameter names, with three differences: HF
prefixes the body with ``transformer.``; HF's projections are ``Conv1D`` layers whose weights are
stored (in, out), the transpose of ``nn.Linear``'s (out, in); HF may omit ``lm_head.weight``
(tied to ``wte``) and may carry the causal-mask buffers ``attn.bias`` / ``attn.masked_bias``.
Writing this format is `gptkiln.interop`'s job.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gptkiln.config import GPT2_VOCAB_SIZE, GPTConfig
from gptkiln.errors import GptkilnError
from gptkiln.loading.build import StoredModel
from gptkiln.loading.checks import check_config_fits, check_shapes, expected_shapes
from gptkiln.loading.files import CONFIG_FILE
from gptkiln.loading.hf import hf_weights_files, read_hf_files

# Weights HF stores as Conv1D, (in, out); gptkiln's nn.Linear holds (out, in).
CONV1D = re.compile(r"^h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")
# The causal-mask buffers some HF checkpoints carry; not weights.
_HF_BUFFER = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")

# GPT2Config's defaults: transformers' save_pretrained leaves out values equal to them.
_HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": GPT2_VOCAB_SIZE,
    "n_positions": 1024,
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "n_inner": None,
    "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-5,
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "add_cross_attention": False,
    "tie_word_embeddings": True,
}

# HF activation names gptkiln computes, and GPTConfig.gelu for each.
_HF_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "exact"}


def read(
    hf_dir: Path, cfg: dict[str, Any], weights: Path | None = None, *, headers_only: bool = False
) -> StoredModel:
    """The config and weights (gptkiln's names and layouts, shapes checked) of a Hugging Face
    GPT-2 directory (``cfg``: its parsed config.json), memory-mapped, or as meta tensors from
    the files' headers with ``headers_only``. ``weights`` is not used: the directory's files
    are (`gptkiln.loading.hf.hf_weights_files`)."""
    config = config_from_hf(cfg, str(hf_dir / CONFIG_FILE))
    files = hf_weights_files(hf_dir)
    hf_sd = read_hf_files(files, headers_only=headers_only)
    sd = hf_state_dict_to_gptkiln(hf_sd, config, str(hf_dir))
    return StoredModel(config, sd, str(hf_dir), files)


def tokenizer_name(hf_dir: Path, cfg: dict[str, Any]) -> str | None:
    """``"gpt2"``: OpenAI's BPE, which GPT-2's checkpoints and their fine-tunes use; ``"hf"``
    for a GPT-2 trained on a tokenizer of its own (its tokenizer.json, of another size, or one
    that does not read: loading it says why); None for a model smaller than GPT-2's
    vocabulary with no tokenizer.json."""
    own = hf_dir / "tokenizer.json"
    if own.is_file():
        return "gpt2" if _tokenizer_size(own) == GPT2_VOCAB_SIZE else "hf"
    return "gpt2" if cfg.get("vocab_size", GPT2_VOCAB_SIZE) >= GPT2_VOCAB_SIZE else None


def tokenizer_source(hf_dir: Path, cfg: dict[str, Any]) -> str:
    """``"gpt2"`` (`gptkiln.tokenizers.load_tokenizer`'s own GPT-2 BPE, tiktoken), or the
    directory itself for a GPT-2 of a tokenizer of its own."""
    return "gpt2" if tokenizer_name(hf_dir, cfg) == "gpt2" else str(hf_dir)


def _tokenizer_size(path: Path) -> int | None:
    """The ids of a tokenizer.json (its model's vocabulary and the added tokens past it); None
    when it does not read as one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        ids = set(data["model"]["vocab"].values())
        ids.update(token["id"] for token in data.get("added_tokens") or [])
        return len(ids)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def config_from_hf(hf_config: Mapping[str, Any], source: str = "Hugging Face config") -> GPTConfig:
    """The GPTConfig of a Hugging Face GPT-2 ``config.json`` (as a dict).

    Dropout is set to 0 (an imported model is usually run, not trained; a fine-tuning run
    sets its own). Configs whose model gptkiln does not compute the same way are refused:
    another activation than GELU (tanh or exact), another LayerNorm epsilon than 1e-5, an MLP
    width other than 4 x n_embd, unscaled or layer-scaled attention, cross-attention.
    """
    hf = {**_HF_DEFAULTS, **hf_config}
    if hf.get("model_type") != "gpt2":
        raise GptkilnError(
            f"{source}: model_type is {hf.get('model_type')!r}, not 'gpt2'; only "
            f"GPT-2 checkpoints can be converted"
        )
    n_embd = hf["n_embd"]
    if isinstance(n_embd, bool) or not isinstance(n_embd, int):
        raise GptkilnError(f"{source}: n_embd is {n_embd!r}, not a whole number")
    eps = hf["layer_norm_epsilon"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise GptkilnError(f"{source}: layer_norm_epsilon is {eps!r}, not a number")
    if not isinstance(hf["activation_function"], str):
        raise GptkilnError(
            f"{source}: activation_function is {hf['activation_function']!r}, not a name"
        )
    unsupported = {
        "activation_function": hf["activation_function"] not in _HF_GELU,
        "layer_norm_epsilon": not math.isclose(eps, 1e-5),
        "n_inner": hf["n_inner"] not in (None, 4 * n_embd),
        "scale_attn_weights": not hf["scale_attn_weights"],
        "scale_attn_by_inverse_layer_idx": bool(hf["scale_attn_by_inverse_layer_idx"]),
        "add_cross_attention": bool(hf["add_cross_attention"]),
    }
    bad = [f"{k}={hf[k]!r}" for k, is_bad in unsupported.items() if is_bad]
    if bad:
        raise GptkilnError(
            f"{source}: {', '.join(bad)} is not what gptkiln's GPT-2 computes "
            f"(GELU, eps 1e-5, 4x MLP, 1/sqrt(hs) attention); it cannot be "
            f"converted"
        )
    try:
        return GPTConfig(
            vocab_size=hf["vocab_size"],
            context_length=hf["n_positions"],
            n_layer=hf["n_layer"],
            n_head=hf["n_head"],
            n_embd=n_embd,
            dropout=0.0,
            qkv_bias=True,
            tie_embeddings=hf["tie_word_embeddings"],  # true or false: GPTConfig checks
            gelu=_HF_GELU[hf["activation_function"]],
        )
    except GptkilnError as e:  # the config's own checks, in gptkiln's names: say which file
        raise GptkilnError(f"{source}: {e}") from None


def hf_state_dict_to_gptkiln(
    sd: Mapping[str, torch.Tensor], config: GPTConfig, source: str = "Hugging Face state dict"
) -> dict[str, torch.Tensor]:
    """Hugging Face GPT-2 names and layouts -> gptkiln's.

    Strips ``transformer.``, drops the mask buffers and a tied ``lm_head.weight``, checks every
    name and shape (in HF's layout, so an error names the shapes as the file has them), then
    transposes the Conv1D weights (in, out) -> (out, in).

    Raises:
        GptkilnError: naming missing, unexpected and wrongly shaped parameters.
    """
    out = {}
    for key, value in sd.items():
        name = key.removeprefix("transformer.")
        if _HF_BUFFER.match(name) or (name == "lm_head.weight" and config.tie_embeddings):
            continue
        out[name] = value
    check_config_fits(config, out, source)  # before listing the shapes of n_layer blocks
    hf_shapes = {k: s[::-1] if CONV1D.match(k) else s for k, s in expected_shapes(config).items()}
    check_shapes(out, hf_shapes, source)
    return {k: v.t().contiguous() if CONV1D.match(k) else v for k, v in out.items()}
