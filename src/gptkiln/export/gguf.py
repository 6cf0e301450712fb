"""Runs out to GGUF, the one-file format of llama.cpp, Ollama and LM Studio, written with the
``gguf`` package (ggml's own reader and writer); no llama.cpp source tree is needed.

A GGUF holds the model's metadata as llama.cpp reads it (``{arch}.context_length``, heads, KV
heads, RoPE base and dimensions, the norms' eps), its tokenizer (`gptkiln.export.gguf_vocab`),
the chat template (jinja, `gptkiln.export.templates`) and the stop ids, and its tensors under
llama.cpp's names. Architectures: ``gpt2`` (GPT-2), ``llama`` (Llama 3), ``qwen3`` (Qwen3).
The names go through Hugging Face's (`gptkiln.interop`), so one table (`HF_TO_GGUF`) serves both
directions; the import is `gptkiln.export.gguf_import`.

Layouts as llama.cpp's own converter writes them: GPT-2's Conv1D weights as (out, in); Llama's
q and k projections permuted from Hugging Face's rotate-half RoPE to the interleaved pairs
llama.cpp's ``llama`` applies (Qwen3 uses the rotate-half ``neox`` RoPE: as they are); Llama 3's
frequency scaling as the ``rope_freqs`` tensor (one factor per frequency).

Types: ``f32``, ``f16``, ``bf16`` and ``q8_0`` (llama.cpp's blocks of 32 int8 values and one f16
scale, by ``gguf.quants``) for the 2-D weights; norms, biases and ``rope_freqs`` stay f32, as
llama.cpp keeps them (so does a weight whose rows are not a whole number of q8_0 blocks).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptkiln.checkpoint import atomic_write
from gptkiln.config import GPTConfig
from gptkiln.errors import GptkilnError
from gptkiln.export.gguf_vocab import GGUFVocab, gguf_vocab
from gptkiln.export.hf import check_language_model, float_state_dict
from gptkiln.export.templates import run_chat_jinja
from gptkiln.interop import gptkiln_state_dict_to_hf
from gptkiln.loading import load_model, load_run_tokenizer, read_config, tokenizer_name
from gptkiln.loading.hf_gpt2 import CONV1D
from gptkiln.run_guard import check_not_a_run_file, check_writable

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
ARCHITECTURES = {"gpt2": "gpt2", "llama3": "llama", "qwen3": "qwen3"}  # family -> GGUF arch
FAMILY_OF_ARCH = {arch: family for family, arch in ARCHITECTURES.items()}
Q8_0_BLOCK = 32

# Hugging Face's tensor names -> llama.cpp's, per architecture ({} is a block's index).
HF_TO_GGUF = {
    "gpt2": {
        "transformer.wte.weight": "token_embd.weight",
        "transformer.wpe.weight": "position_embd.weight",
        "transformer.ln_f.{}": "output_norm.{}",
        "lm_head.weight": "output.weight",
        "transformer.h.{}.ln_1.{}": "blk.{}.attn_norm.{}",
        "transformer.h.{}.attn.c_attn.{}": "blk.{}.attn_qkv.{}",
        "transformer.h.{}.attn.c_proj.{}": "blk.{}.attn_output.{}",
        "transformer.h.{}.ln_2.{}": "blk.{}.ffn_norm.{}",
        "transformer.h.{}.mlp.c_fc.{}": "blk.{}.ffn_up.{}",
        "transformer.h.{}.mlp.c_proj.{}": "blk.{}.ffn_down.{}",
    },
    "llama": {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
        "model.layers.{}.input_layernorm.weight": "blk.{}.attn_norm.weight",
        "model.layers.{}.self_attn.q_proj.{}": "blk.{}.attn_q.{}",
        "model.layers.{}.self_attn.k_proj.{}": "blk.{}.attn_k.{}",
        "model.layers.{}.self_attn.v_proj.{}": "blk.{}.attn_v.{}",
        "model.layers.{}.self_attn.o_proj.{}": "blk.{}.attn_output.{}",
        "model.layers.{}.self_attn.q_norm.weight": "blk.{}.attn_q_norm.weight",
        "model.layers.{}.self_attn.k_norm.weight": "blk.{}.attn_k_norm.weight",
        "model.layers.{}.post_attention_layernorm.weight": "blk.{}.ffn_norm.weight",
        "model.layers.{}.mlp.gate_proj.{}": "blk.{}.ffn_gate.{}",
        "model.layers.{}.mlp.up_proj.{}": "blk.{}.ffn_up.{}",
        "model.layers.{}.mlp.down_proj.{}": "blk.{}.ffn_down.{}",
    },
}
HF_TO_GGUF["qwen3"] = HF_TO_GGUF["llama"]
ROPE_FREQS = "rope_freqs.weight"


def _as_regex(pattern: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(pattern).replace(r"\{\}", r"(\w+)") + "$")


def rename(name: str, table: dict[str, str]) -> str | None:
    """``name`` through one direction of a name table (None when no row matches)."""
    for src, dst in table.items():
        if m := _as_regex(src).match(name):
            return dst.format(*m.groups())
    return None


def permute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Hugging Face's rotate-half q/k rows (each head: dims i and i + hs/2 a pair) -> the
    interleaved pairs (2i, 2i + 1) of llama.cpp's ``llama`` RoPE: (n_head * hs, C) either way."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of `permute_rope`."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def rope_factors(config: GPTConfig) -> torch.Tensor:
    """Llama 3's frequency scaling as llama.cpp's ``rope_freqs``: for each of the head's
    frequencies, what the base one is divided by (`gptkiln.positions.rope_tables`'s scaling)."""
    from gptkiln.positions import _llama3_scaled

    i = torch.arange(0, config.head_size, 2, dtype=torch.float32)
    inv_freq = 1.0 / config.rope_theta ** (i / config.head_size)  # (hs/2,)
    return inv_freq / _llama3_scaled(inv_freq, **config.rope_scaling)


def gguf_tensors(
    sd: dict[str, torch.Tensor], config: GPTConfig, source: str
) -> dict[str, torch.Tensor]:
    """gptkiln's float weights under llama.cpp's names and in its layouts (f32)."""
    arch = ARCHITECTURES[config.family]
    if arch == "qwen3" and (config.qkv_bias or config.bias):
        raise GptkilnError(
            f"{source}: a qwen3 model with biases, which llama.cpp's qwen3 has no tensors for; "
            "export it to Hugging Face instead (convert to-hf)"
        )
    hf_sd = gptkiln_state_dict_to_hf(sd, config)
    out = {}
    for name, tensor in hf_sd.items():
        gguf_name = rename(name, HF_TO_GGUF[arch])
        if gguf_name is None:  # a name the table lacks: a bug, not the user's
            raise AssertionError(f"no GGUF name for {name}")
        tensor = tensor.detach().to(torch.float32)
        if arch == "gpt2" and CONV1D.match(name.removeprefix("transformer.")):
            tensor = tensor.t()  # Conv1D's (in, out) -> (out, in)
        elif arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = permute_rope(tensor, config.n_head)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = permute_rope(tensor, config.kv_heads)
        out[gguf_name] = tensor.contiguous()
    if arch == "gpt2":  # llama.cpp's GPT-2 has every bias: the ones the model lacks are zeros
        for name in [
            n for n in out if n.endswith(".weight") and n.startswith(("blk.", "output_n"))
        ]:
            bias = name.removesuffix(".weight") + ".bias"
            out.setdefault(bias, torch.zeros(out[name].shape[0]))
    if config.rope_scaling:
        out[ROPE_FREQS] = rope_factors(config)
    return out


def export_gguf(
    run_dir: str | os.PathLike,
    out_file: str | os.PathLike,
    *,
    type: str = "f32",
    overwrite: bool = False,
    on_note: Callable[[str], None] | None = None,
) -> Path:
    """Write a run as one GGUF file that llama.cpp runs, and an Ollama Modelfile beside it
    (`gptkiln.export.ollama`); see the module docstring.

    Args:
        run_dir: a run (any family; a gpt2, bpe:N, char or model's own byte-level tokenizer;
            LoRA adapters merged; a quantized run dequantized first) or a Hugging Face directory.
        out_file: the .gguf to write, all at once (a temporary name, then renamed).
        type: ``f32``, ``f16``, ``bf16`` or ``q8_0``.
        overwrite: replace an existing file.
        on_note: called with a line to tell the user.

    Raises:
        GptkilnError: a type, tokenizer or model GGUF cannot hold, or a file already there.
    """
    from gptkiln.export.ollama import write_modelfile

    run_dir, out_file = Path(run_dir), Path(out_file)
    if type not in GGUF_TYPES:
        raise GptkilnError(f"--type {type!r}: choose one of {', '.join(GGUF_TYPES)}")
    check_gguf_out(out_file, overwrite)
    cfg = read_config(run_dir)
    check_language_model(cfg, run_dir, "GGUF export")
    if tokenizer_name(run_dir) is None:
        raise GptkilnError(
            f"{run_dir} has no tokenizer, which a GGUF must hold; export a run trained or "
            "converted with one"
        )
    model = load_model(run_dir)
    computed = [c for c in model.config.recipe_choices() if c != "zero_init_out"]
    if computed:  # the speedruns' choices: llama.cpp's graphs compute neither
        raise GptkilnError(
            f"{run_dir} uses {', '.join(computed)}, which llama.cpp's models do not compute; it "
            "cannot be exported to GGUF (train with the choice off to export)"
        )
    sd, dequantized = float_state_dict(model)
    if dequantized and on_note:
        on_note(
            f"{run_dir} is quantized (int8): its weights are dequantized, then written as {type}"
        )
    if model.config.mlp == "gelu" and model.config.gelu == "exact" and on_note:
        on_note(
            f"{run_dir} was trained with the exact (erf) GELU; llama.cpp's GPT-2 computes GPT-2's "
            "tanh approximation, so its outputs differ slightly from gptkiln's (a Hugging Face "
            "export, `convert to-hf`, keeps the exact one)"
        )
    tokenizer = load_run_tokenizer(run_dir, cfg)
    config = model.config.unpadded()  # float_state_dict cut a padded vocabulary's rows
    vocab = gguf_vocab(tokenizer, config.vocab_size, str(run_dir))
    pad = cfg.get("pad_token_id")
    if isinstance(pad, int) and not isinstance(pad, bool) and 0 <= pad < len(vocab.tokens):
        vocab.pad_id = pad
    tensors = gguf_tensors(sd, config, str(run_dir))
    chat = run_chat_jinja(cfg, run_dir, tokenizer)
    name = run_dir.resolve().name
    atomic_write(out_file, lambda tmp: _write(tmp, config, tensors, vocab, chat, type, name))
    write_modelfile(out_file, vocab, chat, cfg, run_dir)
    return out_file


def check_gguf_out(out_file: Path, overwrite: bool) -> None:
    """Refuse, before anything is written, an output that would not be a new .gguf beside a new
    Modelfile: a directory, a Modelfile's own name (the GGUF would be replaced by it), a file or
    Modelfile already there without ``overwrite``."""
    from gptkiln.export.ollama import modelfile_path

    modelfile = modelfile_path(out_file)
    if modelfile == out_file:
        raise GptkilnError(
            f"--out {out_file}: its Ollama Modelfile would be written over it; name the GGUF "
            f"file {out_file.with_suffix('.gguf').name}"
        )
    check_writable(out_file, "--out")  # a file on its way, a folder no file can be made in
    for path in (out_file, modelfile):
        check_not_a_run_file(path, "--out")  # a run's or prepared data's file, even --overwrite
        if path.is_dir():
            raise GptkilnError(
                f"--out {out_file}: {path} is a directory; name a file to write, e.g. "
                f"{path / 'model.gguf'}" if path == out_file else
                f"--out {out_file}: {path}, where its Ollama Modelfile goes, is a directory; "
                "move it or name the GGUF otherwise"
            )  # fmt: skip
        if path.exists() and not overwrite:
            raise GptkilnError(f"{path} already exists; pass --overwrite to replace it")


def _write(
    path: str,
    config: GPTConfig,
    tensors: dict[str, torch.Tensor],
    vocab: GGUFVocab,
    chat: str | None,
    type: str,
    name: str,
) -> None:
    import gguf

    arch = ARCHITECTURES[config.family]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(name)
    _add_model_metadata(writer, config, arch)
    file_type = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "bf16": gguf.LlamaFileType.MOSTLY_BF16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }[type]
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_vocab(writer, vocab, chat)
    for tensor_name, tensor in tensors.items():
        data, raw = _encode(tensor.numpy(), type, tensor_name)
        writer.add_tensor(tensor_name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _encode(array: np.ndarray, type: str, name: str) -> tuple[np.ndarray, Any]:
    """A tensor's data in the file's type: 1-D ones (norms, biases, rope_freqs) and the
    position embedding in f32; q8_0 only for rows of whole 32-value blocks, else f32."""
    import gguf

    if type == "f32" or array.ndim < 2 or name == "position_embd.weight":
        return array.astype(np.float32), None
    if type == "f16":
        return array.astype(np.float16), None
    if type == "bf16":
        return gguf.quants.quantize(
            array, gguf.GGMLQuantizationType.BF16
        ), gguf.GGMLQuantizationType.BF16
    if array.shape[-1] % Q8_0_BLOCK:
        return array.astype(np.float32), None
    return gguf.quants.quantize(
        array, gguf.GGMLQuantizationType.Q8_0
    ), gguf.GGMLQuantizationType.Q8_0


def _add_model_metadata(writer: Any, config: GPTConfig, arch: str) -> None:
    writer.add_context_length(config.context_length)
    writer.add_embedding_length(config.n_embd)
    writer.add_block_count(config.n_layer)
    writer.add_head_count(config.n_head)
    writer.add_vocab_size(config.vocab_size)
    if arch == "gpt2":
        writer.add_feed_forward_length(config.mlp_size)
        writer.add_layer_norm_eps(config.norm_eps)
        return
    writer.add_feed_forward_length(config.mlp_size)
    writer.add_head_count_kv(config.kv_heads)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_rope_dimension_count(config.head_size)
    writer.add_key_length(config.head_size)
    writer.add_value_length(config.head_size)


def _add_vocab(writer: Any, vocab: GGUFVocab, chat: str | None) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    if vocab.bos_id is not None:
        writer.add_bos_token_id(vocab.bos_id)
    if vocab.eos_id is not None:
        writer.add_eos_token_id(vocab.eos_id)
    eot, eom = vocab.turn_ends()  # the others llama.cpp ends at by their text
    if eot is not None:
        writer.add_eot_token_id(eot)
    if eom is not None:
        writer.add_eom_token_id(eom)
    if vocab.pad_id is not None:
        writer.add_pad_token_id(vocab.pad_id)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(False)
    if chat is not None:
        writer.add_chat_template(chat)
