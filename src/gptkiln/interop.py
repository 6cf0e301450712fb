"""gptkiln -> other formats: the config and state dict of Hugging Face's class for each family
(GPT-2: ``GPT2LMHeadModel``; Llama 3: ``LlamaForCausalLM``; Qwen3: ``Qwen3ForCausalLM``).

The reverse direction (reading Hugging Face and book checkpoints) is `gptkiln.loading`'s, the
one way in; the names and layouts differ as its modules say (`gptkiln.loading.hf_gpt2`,
`gptkiln.loading.hf_llama`, whose name table both directions use). Writing an exported directory
is `gptkiln.export.hf`'s; GGUF's names go through these (`gptkiln.export.gguf`); importing into a
run directory is the ``convert`` commands' (`gptkiln.convert`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gptkiln.config import GPT2_VOCAB_SIZE, GPTConfig
from gptkiln.errors import GptkilnError
from gptkiln.loading import CONV1D, check_state_dict
from gptkiln.loading.hf_llama import ARCHITECTURE, MODEL_TYPE_OF_FAMILY, to_hf_name
from gptkiln.model import block_linears

EOT = "<|endoftext|>"
EOT_ID = GPT2_VOCAB_SIZE - 1


# -- configs ---------------------------------------------------------------------------------
def config_to_hf(config: GPTConfig) -> dict[str, Any]:
    """The Hugging Face config.json (a dict) of ``config``'s family: `gpt2_config_to_hf` or
    `llama_config_to_hf` (Llama 3 and Qwen3); `GptkilnError` for a model with a speedrun
    choice (``relu2``, ``logit_softcap``, ``value_embeds``, ``attention_windows``;
    ``zero_init_out``'s trained weights are fine), which no Hugging Face class computes."""
    computed = [c for c in config.recipe_choices() if c != "zero_init_out"]
    if computed:
        raise GptkilnError(
            f"this model uses {', '.join(computed)}, which Hugging Face's classes do not "
            "compute; it cannot be exported (train with the choice off to export)"
        )
    if config.family == "gpt2":
        return gpt2_config_to_hf(config)
    return llama_config_to_hf(config)


def gpt2_config_to_hf(config: GPTConfig) -> dict[str, Any]:
    """A Hugging Face ``GPT2Config`` dict for ``config``.

    Every GPTConfig can be expressed: HF's GPT-2 always has query/key/value biases, so a model
    without them (``qkv_bias=False``, as the book's) is exported with zero biases, which computes
    the same thing; an untied head gives ``tie_word_embeddings: false``; the one dropout goes to
    all three of HF's (``embd_pdrop``, ``attn_pdrop``, ``resid_pdrop``). bos/eos are GPT-2's
    ``<|endoftext|>`` (50256) when the vocabulary has it.
    """
    eot = EOT_ID if config.vocab_size > EOT_ID else None
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.context_length,
        "n_ctx": config.context_length,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,
        "activation_function": "gelu_new" if config.gelu == "tanh" else "gelu",
        "layer_norm_epsilon": 1e-5,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "resid_pdrop": config.dropout,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "use_cache": True,
    }


def llama_config_to_hf(config: GPTConfig) -> dict[str, Any]:
    """A Hugging Face ``LlamaConfig`` (family llama3) or ``Qwen3Config`` (qwen3) dict for
    ``config``, which ``AutoModelForCausalLM`` loads as ``LlamaForCausalLM`` /
    ``Qwen3ForCausalLM``.

    RoPE is written as ``rope_theta`` beside ``rope_scaling`` (null, or Llama 3's
    ``{"rope_type": "llama3", ...}``), the keys transformers 4, llama.cpp's converter and the
    Hub's checkpoints use; transformers 5 reads them into its ``rope_parameters``. Biases:
    Hugging Face's ``attention_bias`` puts one on q/k/v and o_proj, ``mlp_bias`` on the MLP
    (Qwen3's MLP has none), so a model with any bias is written with both, and the biases it
    lacks are written as zeros (`gptkiln_state_dict_to_hf`), which computes the same. bos/eos
    ids are left null: a run that came from Hugging Face keeps its own (`gptkiln.convert`).

    Raises:
        GptkilnError: a Qwen3 model with MLP biases, which Qwen3's class cannot hold.
    """
    any_bias = config.qkv_bias or config.bias
    if config.family == "qwen3" and config.bias:
        raise GptkilnError(
            "this qwen3 model has biases in its MLP (bias true), which Hugging Face's "
            "Qwen3ForCausalLM cannot hold; it cannot be exported"
        )
    rope_scaling = None
    if config.rope_scaling:
        s = config.rope_scaling
        rope_scaling = {
            "rope_type": "llama3",
            "factor": s["factor"],
            "low_freq_factor": s["low_freq_factor"],
            "high_freq_factor": s["high_freq_factor"],
            "original_max_position_embeddings": s["original_context_length"],
        }
    hf = {
        "architectures": [ARCHITECTURE[config.family]],
        "model_type": MODEL_TYPE_OF_FAMILY[config.family],
        "vocab_size": config.vocab_size,
        "hidden_size": config.n_embd,
        "intermediate_size": config.mlp_size,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_size,
        "hidden_act": "silu",
        "max_position_embeddings": config.context_length,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": rope_scaling,
        "attention_bias": any_bias,
        "attention_dropout": config.dropout,
        "initializer_range": 0.02,
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "use_cache": True,
    }
    if config.family == "llama3":
        hf["mlp_bias"] = any_bias
    else:
        hf["use_sliding_window"] = False
    return hf


# -- state dicts ---------------------------------------------------------------------------
def without_vocab_padding(
    sd: Mapping[str, torch.Tensor], config: GPTConfig
) -> tuple[dict[str, torch.Tensor], GPTConfig]:
    """A padded vocabulary's state dict and config without the extra rows (``wte`` and
    ``lm_head`` cut to ``vocab_size``, views; the config `GPTConfig.unpadded`): what another
    project's model of the same ids holds. Unpadded: as they are."""
    sd = dict(sd)
    if config.padded_vocab_size is None:
        return sd, config
    for name in ("wte.weight", "lm_head.weight"):
        if name in sd:
            sd[name] = sd[name][: config.vocab_size]
    return sd, config.unpadded()


def gptkiln_state_dict_to_hf(
    sd: Mapping[str, torch.Tensor], config: GPTConfig
) -> dict[str, torch.Tensor]:
    """gptkiln names and layouts -> those of Hugging Face's class for the family
    (`gpt2_state_dict_to_hf`, `llama_state_dict_to_hf`); a padded vocabulary's extra rows
    left out (`without_vocab_padding`), as `config_to_hf` describes the model."""
    sd, config = without_vocab_padding(sd, config)
    if config.family == "gpt2":
        return gpt2_state_dict_to_hf(sd, config)
    return llama_state_dict_to_hf(sd, config)


def llama_state_dict_to_hf(
    sd: Mapping[str, torch.Tensor], config: GPTConfig
) -> dict[str, torch.Tensor]:
    """gptkiln names -> Hugging Face ``LlamaForCausalLM``'s / ``Qwen3ForCausalLM``'s (the same
    tensors, renamed: `gptkiln.loading.hf_llama.to_hf_name`). A tied head is stored only as
    ``model.embed_tokens.weight`` (HF re-ties it); the biases Hugging Face's class has and the
    model lacks are added as zeros (see `llama_config_to_hf`)."""
    sd = dict(sd)
    if config.tie_embeddings:
        sd.pop("lm_head.weight", None)
    check_state_dict(sd, config, "the gptkiln state dict")
    out = {to_hf_name(key): value for key, value in sd.items()}
    if config.qkv_bias or config.bias:  # Hugging Face's classes: biases on all of them or none
        # (Qwen3's MLP never has any, and a Qwen3 model with MLP biases is refused)
        biased = [n for n in block_linears(config) if config.family == "llama3" or "attn." in n]
        for i in range(config.n_layer):
            for name in biased:
                key = to_hf_name(f"h.{i}.{name}.bias")
                if key not in out:
                    weight = sd[f"h.{i}.{name}.weight"]
                    out[key] = weight.new_zeros(weight.shape[0])
    return out


def gpt2_state_dict_to_hf(
    sd: Mapping[str, torch.Tensor], config: GPTConfig
) -> dict[str, torch.Tensor]:
    """gptkiln names and layouts -> Hugging Face ``GPT2LMHeadModel``'s.

    Adds ``transformer.``, transposes the Conv1D weights to (in, out), stores a tied head only as
    ``transformer.wte.weight`` (HF re-ties it) and adds zero query/key/value biases when the
    model has none (see `config_to_hf`).
    """
    sd = dict(sd)
    if config.tie_embeddings:
        sd.pop("lm_head.weight", None)
    check_state_dict(sd, config, "the gptkiln state dict")
    out = {}
    for key, value in sd.items():
        if key == "lm_head.weight":
            out[key] = value
            continue
        out["transformer." + key] = value.t().contiguous() if CONV1D.match(key) else value
    if not config.qkv_bias:
        for i in range(config.n_layer):
            weight = sd[f"h.{i}.attn.c_attn.weight"]
            out[f"transformer.h.{i}.attn.c_attn.bias"] = weight.new_zeros(3 * config.n_embd)
    return out
