"""Hugging Face Llama and Qwen3 directories (config.json with ``"model_type": "llama"``, a
``LlamaForCausalLM``, or ``"qwen3"``, a ``Qwen3ForCausalLM``; their weights files,
`gptkiln.loading.hf`): the config as a `GPTConfig` of family ``llama3`` or ``qwen3``, the names
as gptkiln's.

The two classes store the same names, and gptkiln's Llama-family blocks take theirs, so only the
containers differ (no tensor is transposed or permuted: both rotate the halves of each head,
as gptkiln's RoPE does)::

    model.embed_tokens                   wte
    model.layers.N.self_attn.q_proj      h.N.attn.q_proj    (k_proj, v_proj, o_proj; Qwen3's
                                                             q_norm and k_norm likewise)
    model.layers.N.mlp.gate_proj         h.N.mlp.gate_proj  (up_proj, down_proj)
    model.layers.N.input_layernorm       h.N.ln_1
    model.layers.N.post_attention_layernorm  h.N.ln_2
    model.norm                           ln_f
    lm_head                              lm_head            (absent, or dropped, when tied)

config.json is read as both ``transformers`` 5 writes it (``rope_parameters`` holding
``rope_theta`` and the scaling) and as older ones and the Hub's checkpoints do (``rope_theta``
beside ``rope_scaling``). What gptkiln does not compute the same way is refused in one line:
another RoPE than the plain one or Llama 3's scaling (``"linear"``, ``"dynamic"``, ``"yarn"``,
...), another activation than SiLU, Qwen3's sliding-window layers, and biases gptkiln cannot
hold (it has q/k/v biases, ``qkv_bias``, and o_proj and MLP biases, ``bias``; Hugging Face's
``attention_bias`` puts one on q/k/v and o_proj, ``mlp_bias`` on the MLP, so the two must
agree). The tokenizer's files stay in the directory, read from there
(`gptkiln.tokenizers.load_tokenizer`). Writing this format is `gptkiln.interop`'s job.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gptkiln.config import GPTConfig
from gptkiln.errors import GptkilnError
from gptkiln.loading.build import StoredModel
from gptkiln.loading.checks import check_config_fits, check_shapes, expected_shapes
from gptkiln.loading.files import CONFIG_FILE
from gptkiln.loading.hf import hf_weights_files, read_hf_files

# Hugging Face model_type -> gptkiln's family, and back.
FAMILY_OF_MODEL_TYPE = {"llama": "llama3", "qwen3": "qwen3"}
MODEL_TYPE_OF_FAMILY = {family: t for t, family in FAMILY_OF_MODEL_TYPE.items()}
ARCHITECTURE = {"llama3": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# LlamaConfig's and Qwen3Config's defaults (transformers 5), for the keys a config.json leaves
# out. head_dim None: hidden_size / num_attention_heads; num_key_value_heads None: one per head.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "head_dim": None,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "qwen3": {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,  # Qwen3's MLP has no bias and no such key
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "layer_types": None,
    },
}
DEFAULT_ROPE_THETA = 10_000.0  # both classes' rope_theta when config.json gives none
ROPE_TYPES = ("default", "llama3")  # the RoPE variants gptkiln computes (`gptkiln.model`)
# Llama 3's scaling keys: Hugging Face's names -> GPTConfig.rope_scaling's.
LLAMA3_SCALING = {
    "factor": "factor",
    "low_freq_factor": "low_freq_factor",
    "high_freq_factor": "high_freq_factor",
    "original_max_position_embeddings": "original_context_length",
}

# -- names: one table, both ways ---------------------------------------------------------------
_TOP_NAMES = {"model.embed_tokens.": "wte.", "model.norm.": "ln_f.", "lm_head.": "lm_head."}
_BLOCK_PARTS = {
    "self_attn.": "attn.",
    "mlp.": "mlp.",
    "input_layernorm.": "ln_1.",
    "post_attention_layernorm.": "ln_2.",
}
_HF_BLOCK = re.compile(rf"^model\.layers\.(\d+)\.({'|'.join(map(re.escape, _BLOCK_PARTS))})(.+)$")
_BLOCK = re.compile(rf"^h\.(\d+)\.({'|'.join(map(re.escape, _BLOCK_PARTS.values()))})(.+)$")
# RoPE's inverse frequencies, which checkpoints of older transformers carry; not weights.
_HF_BUFFER = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


def to_gptkiln_name(name: str) -> str:
    """A Llama / Qwen3 checkpoint's tensor name as gptkiln's (unknown names as they are, so
    that the shape checks list them as unexpected)."""
    if m := _HF_BLOCK.match(name):
        return f"h.{m[1]}.{_BLOCK_PARTS[m[2]]}{m[3]}"
    for hf, ours in _TOP_NAMES.items():
        if name.startswith(hf):
            return ours + name.removeprefix(hf)
    return name


def to_hf_name(name: str) -> str:
    """gptkiln's tensor name as a ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` checkpoint's."""
    if m := _BLOCK.match(name):
        hf_part = next(hf for hf, ours in _BLOCK_PARTS.items() if ours == m[2])
        return f"model.layers.{m[1]}.{hf_part}{m[3]}"
    for hf, ours in _TOP_NAMES.items():
        if name.startswith(ours):
            return hf + name.removeprefix(ours)
    return name


# -- the format ------------------------------------------------------------------------------
def read(
    hf_dir: Path, cfg: dict[str, Any], weights: Path | None = None, *, headers_only: bool = False
) -> StoredModel:
    """The config and weights (gptkiln's names, shapes checked) of a Hugging Face Llama or Qwen3
    directory (``cfg``: its parsed config.json), memory-mapped, or as meta tensors from the
    files' headers with ``headers_only``. ``weights`` is not used: the directory's files are
    (`gptkiln.loading.hf.hf_weights_files`: one file or the shards of its index)."""
    config = config_from_hf(cfg, str(hf_dir / CONFIG_FILE))
    files = hf_weights_files(hf_dir)
    hf_sd = read_hf_files(files, headers_only=headers_only)
    sd = hf_state_dict_to_gptkiln(hf_sd, config, str(hf_dir))
    return StoredModel(config, sd, str(hf_dir), files)


def tokenizer_name(hf_dir: Path, cfg: dict[str, Any]) -> str | None:
    """``"hf"``: the model's own tokenizer (tokenizer.json); None when the directory has none."""
    return "hf" if (hf_dir / "tokenizer.json").is_file() else None


def tokenizer_source(hf_dir: Path, cfg: dict[str, Any]) -> str:
    """The directory itself: `gptkiln.tokenizers.load_tokenizer` reads its tokenizer.json and
    tokenizer_config.json there."""
    return str(hf_dir)


# -- config ----------------------------------------------------------------------------------
def config_from_hf(hf_config: Mapping[str, Any], source: str = "Hugging Face config") -> GPTConfig:
    """The GPTConfig of a Hugging Face ``LlamaConfig`` / ``Qwen3Config`` config.json (a dict).

    Dropout is 0 (an imported model is run, not trained; fine-tuning sets its own); the context
    length is ``max_position_embeddings``. Refused, in one line naming the keys: another
    activation than SiLU, a RoPE variant other than the plain one and Llama 3's, Qwen3's
    sliding-window layers, ``attention_bias`` and ``mlp_bias`` that differ.
    """
    model_type = hf_config.get("model_type")
    if model_type not in FAMILY_OF_MODEL_TYPE:
        raise GptkilnError(
            f"{source}: model_type is {model_type!r}, not {' or '.join(map(repr, _HF_DEFAULTS))}"
        )
    hf = {**_HF_DEFAULTS[model_type], **hf_config}
    family = FAMILY_OF_MODEL_TYPE[model_type]
    _refuse_what_gptkiln_does_not_compute(hf, family, source)
    rope_theta, rope_scaling = rope_from_hf(hf, source)
    n_head, n_embd, head_dim = hf["num_attention_heads"], hf["hidden_size"], hf["head_dim"]
    whole = all(isinstance(v, int) and not isinstance(v, bool) for v in (n_head, n_embd))
    if whole and n_head > 0 and head_dim == n_embd / n_head:  # else GPTConfig names the key
        head_dim = None  # the usual size, as gptkiln's presets say it
    try:
        return GPTConfig(
            vocab_size=hf["vocab_size"],
            context_length=hf["max_position_embeddings"],
            n_layer=hf["num_hidden_layers"],
            n_head=n_head,
            n_embd=n_embd,
            dropout=0.0,
            qkv_bias=hf["attention_bias"],
            bias=hf["attention_bias"],
            tie_embeddings=hf["tie_word_embeddings"],
            family=family,
            norm="rmsnorm",
            norm_eps=hf["rms_norm_eps"],
            positions="rope",
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            mlp="swiglu",
            intermediate_size=hf["intermediate_size"],
            n_kv_head=hf["num_key_value_heads"] or n_head,
            head_dim=head_dim,
            qk_norm=family == "qwen3",
        )
    except GptkilnError as e:  # the config's own checks, in gptkiln's names: say which file
        raise GptkilnError(f"{source}: {e}") from None


def _refuse_what_gptkiln_does_not_compute(hf: dict[str, Any], family: str, source: str) -> None:
    bad = []
    if hf["hidden_act"] != "silu":
        bad.append(f"hidden_act={hf['hidden_act']!r} (gptkiln's SwiGLU gates with SiLU)")
    if bool(hf["attention_bias"]) != bool(hf["mlp_bias"]):
        bad.append(
            f"attention_bias={hf['attention_bias']!r} with mlp_bias={hf['mlp_bias']!r} "
            "(attention_bias also puts a bias on o_proj, which gptkiln's blocks have only with "
            "biases in the MLP too)"
        )
    if family == "qwen3":
        sliding = hf["sliding_window"] if hf["use_sliding_window"] else None
        layer_types = hf["layer_types"] or [
            "sliding_attention" if sliding is not None and i >= hf["max_window_layers"] else ""
            for i in range(hf["num_hidden_layers"])
        ]
        if "sliding_attention" in layer_types:
            bad.append("sliding-window attention layers (use_sliding_window / layer_types)")
    if bad:
        raise GptkilnError(
            f"{source}: {'; '.join(bad)}: not what gptkiln's {family} computes; this model "
            "cannot be loaded or converted"
        )


def rope_from_hf(hf: Mapping[str, Any], source: str) -> tuple[float, dict[str, float] | None]:
    """(rope_theta, GPTConfig.rope_scaling) of a config.json: transformers 5's
    ``rope_parameters`` ({rope_type, rope_theta, and the scaling's keys}) or the older
    ``rope_theta`` beside ``rope_scaling`` ({rope_type or type, the scaling's keys}, or null).
    A RoPE type other than `ROPE_TYPES` is refused in one line."""
    params = hf.get("rope_parameters")
    if params is None:
        scaling = hf.get("rope_scaling") or {}
        params = {"rope_theta": hf.get("rope_theta", DEFAULT_ROPE_THETA)}
        params = {**params, **scaling} if isinstance(scaling, dict) else scaling
    if not isinstance(params, dict):
        raise GptkilnError(
            f"{source}: rope_parameters / rope_scaling should be a JSON object, got {params!r}; "
            "restore the config.json from the model's repository"
        )
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise GptkilnError(
            f"{source}: RoPE type {rope_type!r} is not one gptkiln computes (it computes "
            f"{' and '.join(map(repr, ROPE_TYPES))}: plain RoPE and Llama 3's frequency "
            "scaling); this model cannot be loaded or converted"
        )
    partial = params.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise GptkilnError(
            f"{source}: partial_rotary_factor {partial!r}: gptkiln rotates every dimension of "
            "a head; this model cannot be loaded or converted"
        )
    theta = params.get("rope_theta", hf.get("rope_theta", DEFAULT_ROPE_THETA))
    if rope_type == "default":
        return theta, None
    missing = [key for key in LLAMA3_SCALING if key not in params]
    if missing:
        raise GptkilnError(
            f"{source}: Llama 3's RoPE scaling needs {', '.join(LLAMA3_SCALING)}; "
            f"{', '.join(missing)} missing: restore the config.json from the model's repository"
        )
    return theta, {ours: params[hf_key] for hf_key, ours in LLAMA3_SCALING.items()}


# -- state dicts -----------------------------------------------------------------------------
def hf_state_dict_to_gptkiln(
    sd: Mapping[str, torch.Tensor], config: GPTConfig, source: str = "Hugging Face state dict"
) -> dict[str, torch.Tensor]:
    """Hugging Face Llama / Qwen3 names -> gptkiln's (no layout changes).

    Drops RoPE's stored inverse frequencies (older checkpoints) and a tied ``lm_head.weight``
    (the head is ``wte``), then checks every name and shape against the config.

    Raises:
        GptkilnError: naming missing, unexpected and wrongly shaped tensors.
    """
    out = {}
    for key, value in sd.items():
        if _HF_BUFFER.match(key) or (key == "lm_head.weight" and config.tie_embeddings):
            continue
        out[to_gptkiln_name(key)] = value
    check_config_fits(config, out, source)  # before listing the shapes of n_layer blocks
    check_shapes(out, expected_shapes(config), source)
    return out
