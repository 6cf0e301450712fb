"""The one way in: read a model directory of any format and build the GPT it holds.

Three formats are read, each into the same two things, a `GPTConfig` and a state dict with
gptkiln's names and layouts:

- a **gptkiln run** (``config.json`` with ``"format"`` and ``"model"``, ``model.safetensors``,
  the tokenizer's files), written by `gptkiln.checkpoint`;
- a **Hugging Face GPT-2** directory (``config.json`` with ``"model_type": "gpt2"``, and
  ``model.safetensors``, its sharded form or ``pytorch_model.bin``);
- the **book's** ``model.pth`` (a state dict of its ``GPTModel``).

A load then reads top to bottom::

    load_run(path)                       model, tokenizer, config.json
      └─ load_model(path)                which format is it?
           ├─ read_config                config.json, with errors a person can act on
           ├─ run_model_config           a run:  GPTConfig from its "model" entry
           │    └─ read_safetensors      weights memory-mapped, read page by page
           └─ load_hf                    HF:     GPTConfig from its GPT2Config
                ├─ config_from_hf
                ├─ read_hf_weights       safetensors (memory-mapped), shards, or a torch file
                └─ hf_state_dict_to_gptkiln   names and Conv1D transposes, shapes checked
           └─ build_model                every name and shape checked against the config, the
                                         GPT built on the meta device and the tensors assigned

Building on the meta device costs no memory and no initialisation, and assigning the
memory-mapped tensors copies nothing, so a load needs about one copy of the weights. A
**quantized run** (config.json records ``"quantization"``, `gptkiln.quantize`) is built the same
way: the meta model is quantized first (still no memory) and the int8 tensors are assigned, so
its load holds the int8 bytes and never a float copy. ``quantize="int8"`` quantizes a float
model as it is loaded, for any command that loads one.

Hugging Face's GPT-2 and gptkiln use the same parameter names, with three differences: HF
prefixes the body with ``transformer.``; HF's projections are ``Conv1D`` layers whose weights are
stored (in, out), the transpose of ``nn.Linear``'s (out, in); HF may omit ``lm_head.weight``
(tied to ``wte``) and may carry the causal-mask buffers ``attn.bias`` / ``attn.masked_bias``. The
book's ``GPTModel`` names everything differently (``tok_emb``, ``trf_blocks.N.att.W_query``,
``norm1.scale`` ...) and keeps query, key and value as three matrices that gptkiln stacks into
``c_attn``. Writing runs is `gptkiln.checkpoint`'s job; writing other formats, `gptkiln.interop`'s.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from gptkiln import load_steps
from gptkiln.config import GPT2_VOCAB_SIZE, GPTConfig
from gptkiln.errors import GptkilnError
from gptkiln.model import GPT
from gptkiln.quantize import (
    check_quantize,
    check_scales,
    int8_modules,
    quantization_of,
    quantize_model,
    read_quantization,
    tie_quantized_head,
)

FORMAT = 2  # the newest config.json format gptkiln reads
FLOAT_FORMAT = 1  # what a run of float weights is written as (any gptkiln reads it)
QUANTIZED_FORMAT = 2  # a quantized run: a gptkiln older than quantization refuses it in one line
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
HF_BIN_FILE = "pytorch_model.bin"
HF_INDEX_FILE = "model.safetensors.index.json"
_MAX_NAMES = 6  # parameter names listed in one error line before "and N more"

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


# -- entry points ----------------------------------------------------------------------------
def load_run(
    run_dir: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    quantize: str | None = None,
) -> tuple[GPT, Any, dict[str, Any]]:
    """(model, tokenizer, parsed config.json) of a run directory or a Hugging Face GPT-2 one;
    ``quantize`` as `load_model`."""
    check_quantize(quantize)
    run_dir = Path(run_dir)
    cfg = read_config(run_dir)
    model = load_model(run_dir, device=device, dtype=dtype, quantize=quantize)
    return model, load_run_tokenizer(run_dir, cfg), cfg


def load_run_tokenizer(run_dir: str | os.PathLike, cfg: dict[str, Any] | None = None):
    """The tokenizer of a run directory (its files), or gpt2 for a Hugging Face GPT-2 one."""
    from gptkiln.tokenizers import load_tokenizer

    cfg = read_config(run_dir) if cfg is None else cfg
    return load_tokenizer("gpt2" if "model_type" in cfg else str(run_dir))


def load_model(
    run_dir_or_file: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    adapters: bool = True,
    quantize: str | None = None,
) -> GPT:
    """Rebuild the model of a run directory, or of a Hugging Face GPT-2 directory.

    The model is built on the meta device (no memory, no initialisation) and the tensors of the
    memory-mapped safetensors file are assigned to it, so loading needs about one copy of the
    weights. A tied head is re-tied. Then it is moved to ``device`` / ``dtype``.

    Args:
        run_dir_or_file: a run directory, its config.json or a .safetensors file inside one;
            or a Hugging Face GPT-2 directory (config.json with ``"model_type": "gpt2"``).
        device: where the weights end up.
        dtype: floating-point dtype for the weights; None keeps the stored one.
        adapters: run the load steps the features registered for the run's config.json
            entries (`gptkiln.load_steps`: a LoRA run's adapters merged into the weights);
            False gives the weights of its model.safetensors alone (a LoRA run's frozen base).
        quantize: "int8" quantizes a float model's weights as it loads (`gptkiln.quantize`);
            None keeps them as stored. A quantized run loads quantized either way.

    Returns:
        The GPT in eval mode.
    """
    check_quantize(quantize)
    run_dir, weights = _resolve(run_dir_or_file)
    cfg = read_config(run_dir)
    if "model_type" in cfg:
        return load_hf(run_dir, device=device, dtype=dtype, quantize=quantize)
    config = run_model_config(cfg, run_dir / CONFIG_FILE)
    quantization = read_quantization(cfg.get("quantization"), str(run_dir / CONFIG_FILE))
    weights = _run_weights(run_dir, weights)
    sd = read_safetensors(weights)
    model = build_model(config, sd, str(weights), quantization=quantization)
    for entry, step in load_steps.steps_for(cfg) if adapters else []:
        model = step(model, cfg[entry], run_dir)  # e.g. a LoRA run's adapters merged
    return _quantized(model.to(device=device, dtype=dtype).eval(), quantize)


def load_hf(
    hf_dir: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    quantize: str | None = None,
) -> GPT:
    """A GPT with the weights of a Hugging Face GPT-2 directory (config.json + weights);
    ``quantize`` as `load_model`."""
    check_quantize(quantize)
    hf_dir = Path(hf_dir)
    config = config_from_hf(read_config(hf_dir), str(hf_dir / CONFIG_FILE))
    sd = hf_state_dict_to_gptkiln(read_hf_weights(hf_dir), config, str(hf_dir))
    return _quantized(build_model(config, sd, str(hf_dir), device=device, dtype=dtype), quantize)


def _quantized(model: GPT, quantize: str | None) -> GPT:
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


def load_book(path: str | os.PathLike, n_head: int = 12) -> GPT:
    """A GPT with the weights of a ``model.pth`` saved from the book's ``GPTModel``
    (``torch.save(model.state_dict())``, or the book's ``{"model_state_dict": ...,
    "optimizer_state_dict": ...}``), read with ``torch.load(weights_only=True)``.

    ``n_head``: attention heads; shapes cannot tell (see `book_state_dict_to_gptkiln`).
    """
    path = Path(path)
    sd = load_torch_file(path)
    if isinstance(sd, dict) and isinstance(sd.get("model_state_dict"), dict):
        sd = sd["model_state_dict"]
    if not isinstance(sd, dict):
        raise GptkilnError(
            f"{path} holds a {type(sd).__name__}, not a state dict; save the "
            f"book's model with torch.save(model.state_dict(), path)"
        )
    config, sd = book_state_dict_to_gptkiln(sd, n_head=n_head, source=str(path))
    return build_model(config, sd, str(path))


# -- config.json -----------------------------------------------------------------------------
def read_config(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The parsed config.json of a run (or Hugging Face) directory, with readable errors."""
    run_dir = Path(run_dir)
    path = run_dir / CONFIG_FILE
    if not run_dir.exists():
        raise GptkilnError(
            f"{run_dir} does not exist; give a run directory made by "
            f"`gptkiln train --out DIR` or `gptkiln convert`"
        )
    if run_dir.is_file():
        raise GptkilnError(
            f"{run_dir} is a file, not a run directory; give the directory that holds "
            f"{CONFIG_FILE} (made by `gptkiln train --out DIR` or `gptkiln convert`)"
        )
    if not path.is_file():
        raise GptkilnError(
            f"{run_dir} is not a gptkiln run directory ({CONFIG_FILE} is missing); "
            f"make one with `gptkiln train --out {run_dir}` or `gptkiln convert`"
        )
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GptkilnError(
            f"{path} is not valid JSON ({e}); restore it from a copy or re-run training"
        ) from None
    if not isinstance(cfg, dict):
        raise GptkilnError(f"{path} should hold a JSON object, got {type(cfg).__name__}")
    return cfg


def _run_weights(run_dir: Path, weights: Path | None = None) -> Path:
    """The weights file of a run (``weights`` when one was given), which must exist."""
    weights = weights or run_dir / WEIGHTS_FILE
    if not weights.is_file():
        raise GptkilnError(
            f"{run_dir} is not a complete run directory ({weights.name} is "
            f"missing); re-run `gptkiln train --out {run_dir}` or restore the file"
        )
    return weights


def _resolve(run_dir_or_file: str | os.PathLike) -> tuple[Path, Path | None]:
    """(run directory, weights file given explicitly or None) from a directory or a file."""
    path = Path(run_dir_or_file)
    if path.is_file():
        if path.suffix == ".safetensors":
            return path.parent, path
        if path.name == CONFIG_FILE:
            return path.parent, None
        raise GptkilnError(
            f"{path} is neither a run directory nor a .safetensors file; "
            f"give the run directory (the one holding {CONFIG_FILE})"
        )
    return path, None


def run_model_config(cfg: dict[str, Any], path: Path) -> GPTConfig:
    """The GPTConfig recorded in a gptkiln config.json."""
    fmt = cfg.get("format")
    if not isinstance(cfg.get("model"), dict) or fmt is None:
        raise GptkilnError(
            f"{path} is not a gptkiln config (no 'format'/'model' keys); give a "
            f"run directory from `gptkiln train` or `gptkiln convert`"
        )
    if not isinstance(fmt, int) or isinstance(fmt, bool):
        raise GptkilnError(
            f"{path} has format {fmt!r}, not a format number gptkiln writes; restore the file"
        )
    if fmt > FORMAT:
        raise GptkilnError(
            f"{path} has format {fmt!r}, newer than this gptkiln reads ({FORMAT}); upgrade gptkiln"
        )
    return GPTConfig.from_dict(cfg["model"])


def tokenizer_name(run_dir: str | os.PathLike) -> str | None:
    """The kind of tokenizer a run uses ("gpt2", "char", "bpe"), None when it records none."""
    run_dir = Path(run_dir)
    cfg = read_config(run_dir)
    if "model_type" in cfg:
        return "gpt2"
    name = cfg.get("tokenizer")
    meta = run_dir / "tokenizer_meta.json"
    if not name and meta.is_file():
        try:
            name = json.loads(meta.read_text(encoding="utf-8")).get("kind")
        except (ValueError, AttributeError):
            name = None
    if not name:
        name = (cfg.get("train") or {}).get("tokenizer")
    return name if isinstance(name, str) else None


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
    unsupported = {
        "activation_function": hf["activation_function"] not in _HF_GELU,
        "layer_norm_epsilon": not math.isclose(hf["layer_norm_epsilon"], 1e-5),
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
    return GPTConfig(
        vocab_size=hf["vocab_size"],
        context_length=hf["n_positions"],
        n_layer=hf["n_layer"],
        n_head=hf["n_head"],
        n_embd=n_embd,
        dropout=0.0,
        qkv_bias=True,
        tie_embeddings=bool(hf["tie_word_embeddings"]),
        gelu=_HF_GELU[hf["activation_function"]],
    )


# -- weights files ---------------------------------------------------------------------------
def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Memory-map a safetensors file (tensors are read lazily, page by page)."""
    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GptkilnError(
            f"{path} is truncated or corrupt ({reason}); restore it or re-run training"
        ) from None


def safetensors_metadata(path: Path) -> dict[str, str]:
    """The metadata of a safetensors file; {} when it cannot be read (errors come on loading)."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return f.metadata() or {}
    except (SafetensorError, OSError):
        return {}


def read_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors of an HF checkpoint: model.safetensors (memory-mapped), its sharded form, or
    pytorch_model.bin (``torch.load(weights_only=True, mmap=True)``)."""
    sd: dict[str, torch.Tensor] = {}
    for path in hf_weights_files(hf_dir):
        sd.update(load_torch_file(path) if path.name == HF_BIN_FILE else read_safetensors(path))
    return sd


def hf_weights_files(hf_dir: Path) -> list[Path]:
    """The weights files of an HF checkpoint: model.safetensors, the shards its index names, or
    pytorch_model.bin, in that order of preference."""
    if (hf_dir / WEIGHTS_FILE).is_file():
        return [hf_dir / WEIGHTS_FILE]
    if (hf_dir / HF_INDEX_FILE).is_file():
        index = json.loads((hf_dir / HF_INDEX_FILE).read_text(encoding="utf-8"))
        return [hf_dir / shard for shard in sorted(set(index["weight_map"].values()))]
    if (hf_dir / HF_BIN_FILE).is_file():
        return [hf_dir / HF_BIN_FILE]
    raise GptkilnError(
        f"{hf_dir} has a config.json but no {WEIGHTS_FILE} or {HF_BIN_FILE}; "
        f"copy the weights file into it"
    )


# safetensors' dtype names -> torch's (any other reads as uint8: not a floating-point weight)
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "BOOL": torch.bool,
}


def read_safetensors_header(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as meta tensors: names, shapes and dtypes from its
    header, no data read (any file size answers at once)."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}
            return {
                name: torch.empty(
                    s.get_shape(),
                    dtype=_SAFETENSORS_DTYPES.get(s.get_dtype(), torch.uint8),
                    device="meta",
                )
                for name, s in slices.items()
            }
    except (SafetensorError, OSError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GptkilnError(
            f"{path} is truncated or corrupt ({reason}); restore it or re-run training"
        ) from None


def describe_weights(
    run_dir: str | os.PathLike,
) -> tuple[GPTConfig, dict[str, torch.Tensor], list[Path]]:
    """What a run or Hugging Face GPT-2 directory holds, without reading its weights: the model
    config, the weights as meta tensors (gptkiln names; a tied head once; a quantized run's int8
    weights and their scales) checked against the config as a load checks them, and the weights
    files. Only the files' headers are read (a
    pytorch_model.bin is memory-mapped)."""
    run_dir = Path(run_dir)
    cfg = read_config(run_dir)
    if "model_type" in cfg:
        config = config_from_hf(cfg, str(run_dir / CONFIG_FILE))
        files = hf_weights_files(run_dir)
        sd: dict[str, torch.Tensor] = {}
        for path in files:
            if path.name == HF_BIN_FILE:
                sd.update({k: v.to("meta") for k, v in load_torch_file(path).items()})
            else:
                sd.update(read_safetensors_header(path))
        return config, hf_state_dict_to_gptkiln(sd, config, str(run_dir)), files
    config = run_model_config(cfg, run_dir / CONFIG_FILE)
    quantization = read_quantization(cfg.get("quantization"), str(run_dir / CONFIG_FILE))
    weights = _run_weights(run_dir)
    sd = read_safetensors_header(weights)
    check_state_dict(sd, config, str(weights), quantization)
    return config, sd, [weights]


def load_torch_file(path: Path) -> dict[str, Any]:
    """``torch.load`` of plain data only (weights_only), memory-mapped where the format allows."""
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:  # files from torch < 1.6 (not zip) cannot be memory-mapped
            if "mmap" not in str(e):
                raise
            return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise GptkilnError(f"{path} does not exist; give the path of the checkpoint file") from None
    except Exception as e:  # truncated zip, or a pickle that is more than tensors
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GptkilnError(
            f"{path} cannot be read as a PyTorch state dict ({reason}); is it "
            f"truncated, or not a plain state dict?"
        ) from None


# -- other formats' names --------------------------------------------------------------------
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


_BOOK_TOP = {
    "tok_emb.weight": "wte.weight",
    "pos_emb.weight": "wpe.weight",
    "final_norm.scale": "ln_f.weight",
    "final_norm.shift": "ln_f.bias",
    "out_head.weight": "lm_head.weight",
}
_BOOK_BLOCK = {
    "att.out_proj.weight": "attn.c_proj.weight",
    "att.out_proj.bias": "attn.c_proj.bias",
    "ff.layers.0.weight": "mlp.c_fc.weight",
    "ff.layers.0.bias": "mlp.c_fc.bias",
    "ff.layers.2.weight": "mlp.c_proj.weight",
    "ff.layers.2.bias": "mlp.c_proj.bias",
    "norm1.scale": "ln_1.weight",
    "norm1.shift": "ln_1.bias",
    "norm2.scale": "ln_2.weight",
    "norm2.shift": "ln_2.bias",
}
_BOOK_KEY = re.compile(r"^trf_blocks\.(\d+)\.(.+)$")
_QKV = ("W_query", "W_key", "W_value")
_BOOK_STACKED = re.compile(r"^att\.(mask|(W_query|W_key|W_value)\.(weight|bias))$")  # handled apart


def book_state_dict_to_gptkiln(
    sd: Mapping[str, torch.Tensor], n_head: int = 12, source: str = "book state dict"
) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """Config and gptkiln weights from a state dict of the book's ``GPTModel``.

    The config is read off the shapes: vocab_size and n_embd from ``tok_emb``, context_length
    from ``pos_emb``, n_layer from the ``trf_blocks.N`` keys, qkv_bias from whether
    ``W_query.bias`` exists; the head is untied (``out_head`` is its own matrix). The number of
    heads leaves no trace in the shapes (heads are a reshape of the same matrices), so it is an
    argument: 12 for the book's 124M model (GPT_CONFIG_124M), else what the model was built with.
    Dropout is 0. ``W_query``, ``W_key``, ``W_value`` are stacked, in that order, into ``c_attn``;
    the ``att.mask`` buffers are dropped.
    """
    if "tok_emb.weight" not in sd or "pos_emb.weight" not in sd:
        raise GptkilnError(
            f"{source} is not a state dict of the book's GPTModel (no "
            f"tok_emb.weight / pos_emb.weight); for Hugging Face checkpoints use "
            f"`gptkiln convert hf DIR --out RUN`"
        )
    vocab_size, n_embd = sd["tok_emb.weight"].shape
    layers = {int(m.group(1)) for k in sd if (m := _BOOK_KEY.match(k))}
    if n_embd % n_head:
        raise GptkilnError(
            f"{source}: n_embd {n_embd} is not divisible by n_head {n_head}; pass "
            f"the number of heads the model was built with (n_head=...)"
        )
    config = GPTConfig(
        vocab_size=vocab_size,
        context_length=sd["pos_emb.weight"].shape[0],
        n_layer=max(layers, default=-1) + 1,
        n_head=n_head,
        n_embd=n_embd,
        dropout=0.0,
        qkv_bias="trf_blocks.0.att.W_query.bias" in sd,
        tie_embeddings=False,
    )
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        m = _BOOK_KEY.match(key)
        if key in _BOOK_TOP:
            out[_BOOK_TOP[key]] = value
        elif m and m.group(2) in _BOOK_BLOCK:
            out[f"h.{m.group(1)}.{_BOOK_BLOCK[m.group(2)]}"] = value
        elif not (m and _BOOK_STACKED.match(m.group(2))):
            out[key] = value  # unknown: reported as unexpected below
    for i in sorted(layers):
        for part in ("weight", "bias"):
            qkv = [sd.get(f"trf_blocks.{i}.att.{w}.{part}") for w in _QKV]
            if all(t is not None for t in qkv):
                out[f"h.{i}.attn.c_attn.{part}"] = torch.cat(qkv, dim=0)  # (3C, C) or (3C,)
    check_state_dict(out, config, source)
    return config, out


# -- checking and building -------------------------------------------------------------------
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
    weights and scales to it; every name, shape and dtype is checked first.
    """
    check_state_dict(sd, config, source, quantization)
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


def expected_shapes(
    config: GPTConfig, quantization: dict[str, Any] | None = None
) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a checkpoint of this config stores (tied head excluded), in
    the order of ``GPT(config).state_dict()``; worked out from the config, no model built. A
    quantized checkpoint (``quantization`` as its config.json records it) also stores a
    ``NAME.scale`` (out,) after each int8 ``NAME.weight`` (`gptkiln.quantize.int8_modules`)."""
    C, V = config.n_embd, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "wte.weight": (V, C),
        "wpe.weight": (config.context_length, C),
    }
    for i in range(config.n_layer):
        block = {
            "ln_1.weight": (C,),
            "ln_1.bias": (C,),
            "attn.c_attn.weight": (3 * C, C),
            "attn.c_attn.bias": (3 * C,),
            "attn.c_proj.weight": (C, C),
            "attn.c_proj.bias": (C,),
            "ln_2.weight": (C,),
            "ln_2.bias": (C,),
            "mlp.c_fc.weight": (4 * C, C),
            "mlp.c_fc.bias": (4 * C,),
            "mlp.c_proj.weight": (C, 4 * C),
            "mlp.c_proj.bias": (C,),
        }
        if not config.qkv_bias:
            del block["attn.c_attn.bias"]
        shapes.update({f"h.{i}.{name}": shape for name, shape in block.items()})
    shapes.update({"ln_f.weight": (C,), "ln_f.bias": (C,)})
    if config.num_classes:
        shapes.update(
            {"score.weight": (config.num_classes, C), "score.bias": (config.num_classes,)}
        )
    elif not config.tie_embeddings:
        shapes["lm_head.weight"] = (V, C)
    if quantization is None:
        return shapes
    int8 = {f"{m}.weight" for m in int8_modules(config, quantization["embedding_and_head"])}
    with_scales: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        with_scales[name] = shape
        if name in int8:
            with_scales[name.removesuffix("weight") + "scale"] = shape[:1]
    return with_scales


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


_BLOCK_KEY = re.compile(r"^h\.(\d+)\.")


def weights_dims(sd: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """The model sizes a state dict (gptkiln names) holds: ``n_layer`` from its ``h.N`` blocks,
    ``vocab_size`` and ``n_embd`` from ``wte.weight``, ``context_length`` from ``wpe.weight``.
    Read from names and shapes only (a memory-mapped file is not read)."""
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
    wrong = [name for name, value in held.items() if getattr(config, name) != value]
    if wrong:
        says = ", ".join(f"{name} {getattr(config, name)}" for name in wrong)
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


def check_language_model(model: GPT, run_dir: str | os.PathLike) -> None:
    """Refuse a classifier (`gptkiln finetune --task classify`) where text is read or written
    token by token (generate, eval, inspect): its head scores classes, not next tokens."""
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
