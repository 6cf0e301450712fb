"""gptkiln -> other formats: Hugging Face GPT-2's config and state dict.

The reverse direction (reading Hugging Face and book checkpoints) is `gptkiln.loading`'s, the
one way in; the names and layouts differ as its docstring says. Writing an exported directory
and importing into a run directory are the ``convert`` commands (`gptkiln.convert`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gptkiln.config import GPT2_VOCAB_SIZE, GPTConfig
from gptkiln.loading import CONV1D, check_state_dict

EOT = "<|endoftext|>"
EOT_ID = GPT2_VOCAB_SIZE - 1


# -- configs ---------------------------------------------------------------------------------
def config_to_hf(config: GPTConfig) -> dict[str, Any]:
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


# -- state dicts ---------------------------------------------------------------------------
def gptkiln_state_dict_to_hf(
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
