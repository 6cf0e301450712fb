"""The entry points: which format a model directory is (`format_of`, one table), and the one
load over all of them (`load_model`, `load_run`), with what a look without loading needs
(`describe_weights`, `tokenizer_name`).

A format is a module with the functions of `Format`: `gptkiln.loading.run` (a gptkiln run) and
one module per Hugging Face model family (`gptkiln.loading.hf_gpt2`, `gptkiln.loading.hf_llama`
for Llama and Qwen3). Every format reads into a `StoredModel` (a `GPTConfig` and a state dict
with gptkiln's names) and `build_model` builds any of them, so a new family is a module beside
them and a row in `HF_FAMILIES`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from gptkiln import load_steps
from gptkiln.config import GPTConfig
from gptkiln.errors import GptkilnError
from gptkiln.loading import base, hf_gpt2, hf_llama, run
from gptkiln.loading.book import read_book
from gptkiln.loading.build import StoredModel, build_model, quantized_on_load
from gptkiln.loading.checks import check_state_dict
from gptkiln.loading.files import CONFIG_FILE, read_config
from gptkiln.model import GPT
from gptkiln.quantize import check_quantize


class Format(Protocol):
    """What a format's module provides (the module itself is the format)."""

    def read(
        self,
        directory: Path,
        cfg: dict[str, Any],
        weights: Path | None = None,
        *,
        headers_only: bool = False,
    ) -> StoredModel:
        """Config and weights (gptkiln names) of the directory whose parsed config.json is
        ``cfg``: memory-mapped, or meta tensors from the files' headers with headers_only."""
        ...

    def tokenizer_name(self, directory: Path, cfg: dict[str, Any]) -> str | None:
        """The kind of tokenizer ("gpt2", "char", "bpe"), None when the directory has none."""
        ...

    def tokenizer_source(self, directory: Path, cfg: dict[str, Any]) -> str:
        """What `gptkiln.tokenizers.load_tokenizer` loads the directory's tokenizer from."""
        ...


# Hugging Face directories, by their config.json's "model_type": the module that reads each.
# (Llama's and Qwen3's checkpoints share their names: one module reads both.)
HF_FAMILIES: dict[str, Format] = {"gpt2": hf_gpt2, "llama": hf_llama, "qwen3": hf_llama}


def format_of(cfg: Mapping[str, Any], directory: str | os.PathLike) -> Format:
    """The format of the directory whose parsed config.json is ``cfg``: a Hugging Face one by
    its ``"model_type"``, anything else a gptkiln run (whose reader refuses what is not one)."""
    if "model_type" not in cfg:
        return run
    family = HF_FAMILIES.get(cfg["model_type"])
    if family is None:
        raise GptkilnError(
            f"{Path(directory) / CONFIG_FILE}: model_type is {cfg['model_type']!r}, not one "
            f"gptkiln reads ({', '.join(map(repr, HF_FAMILIES))}: GPT-2, Llama and Qwen3 "
            "checkpoints); only those Hugging Face models can be loaded or converted"
        )
    return family


def read_stored(
    directory: Path, cfg: dict[str, Any], weights: Path | None = None, *, headers_only=False
) -> StoredModel:
    """What the directory's format reads (`format_of`); for a run that keeps its weights by
    reference (config.json's ``"base_weights"``, a LoRA run), its base's read this way too,
    completed by the run's own tensors (`gptkiln.loading.base`)."""
    if weights is None and "model_type" not in cfg and cfg.get(base.BASE_ENTRY) is not None:
        return base.read_with_base(directory, cfg, headers_only, read_stored)
    return format_of(cfg, directory).read(directory, cfg, weights, headers_only=headers_only)


def load_run(
    run_dir: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    quantize: str | None = None,
) -> tuple[GPT, Any, dict[str, Any]]:
    """(model, tokenizer, parsed config.json) of a run directory or a Hugging Face one;
    ``quantize`` as `load_model`."""
    check_quantize(quantize)
    run_dir = Path(run_dir)
    cfg = read_config(run_dir)
    model = load_model(run_dir, device=device, dtype=dtype, quantize=quantize)
    return model, load_run_tokenizer(run_dir, cfg), cfg


def load_run_tokenizer(run_dir: str | os.PathLike, cfg: dict[str, Any] | None = None):
    """The tokenizer of a run directory (its files), gpt2 for a Hugging Face GPT-2 one, a Llama
    or Qwen3 directory's own (its tokenizer.json)."""
    from gptkiln.tokenizers import load_tokenizer

    cfg = read_config(run_dir) if cfg is None else cfg
    return load_tokenizer(format_of(cfg, run_dir).tokenizer_source(Path(run_dir), cfg))


def load_model(
    run_dir_or_file: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    adapters: bool = True,
    quantize: str | None = None,
) -> GPT:
    """Rebuild the model of a run directory, or of a Hugging Face directory.

    The directory's format reads its config and memory-maps its weights (`format_of`); the
    model is built on the meta device (no memory, no initialisation) and the tensors are
    assigned to it (`build_model`), so loading needs about one copy of the weights. A tied head
    is re-tied. The load steps registered for the run's config.json entries run next
    (`gptkiln.load_steps`), then it is moved to ``device`` / ``dtype``.

    Args:
        run_dir_or_file: a run directory, its config.json or a .safetensors file inside one;
            or a Hugging Face directory (config.json with a ``"model_type"`` of `HF_FAMILIES`).
        device: where the weights end up.
        dtype: floating-point dtype for the weights; None keeps the stored one.
        adapters: run the load steps the features registered for the run's config.json
            entries (a LoRA run's adapters merged into the weights, `gptkiln.finetune.lora`);
            False gives the weights of its model.safetensors alone (a LoRA run's frozen base).
        quantize: "int8" quantizes a float model's weights as it loads (`gptkiln.quantize`);
            None keeps them as stored. A quantized run loads quantized either way.

    Returns:
        The GPT in eval mode.
    """
    check_quantize(quantize)
    directory, weights = _resolve(run_dir_or_file)
    cfg = read_config(directory)
    stored = read_stored(directory, cfg, weights)
    return _build(stored, directory, device=device, dtype=dtype, steps=adapters, quantize=quantize)


def load_hf(
    hf_dir: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    quantize: str | None = None,
) -> GPT:
    """A GPT with the weights of a Hugging Face directory (config.json with a ``"model_type"``
    of `HF_FAMILIES`, and its weights files); ``quantize`` as `load_model`."""
    check_quantize(quantize)
    hf_dir = Path(hf_dir)
    cfg = read_config(hf_dir)
    if "model_type" not in cfg:
        raise GptkilnError(
            f"{hf_dir / CONFIG_FILE} has no model_type: it is not a Hugging Face model directory "
            "(a gptkiln run is used as it is, without converting)"
        )
    stored = format_of(cfg, hf_dir).read(hf_dir, cfg)
    return _build(stored, hf_dir, device=device, dtype=dtype, steps=False, quantize=quantize)


def load_book(path: str | os.PathLike, n_head: int | None = None) -> GPT:
    """A GPT with the weights of a ``model.pth`` saved from the book's ``GPTModel``
    (``torch.save(model.state_dict())``, or the book's ``{"model_state_dict": ...,
    "optimizer_state_dict": ...}``), read with ``torch.load(weights_only=True)``.

    ``n_head``: attention heads, which shapes cannot tell; None: GPT-2's for the model's width,
    and an error for another width (see `book_state_dict_to_gptkiln`).
    """
    stored = read_book(path, n_head)
    return build_model(stored.config, stored.state_dict, stored.source)


def _build(
    stored: StoredModel,
    directory: Path,
    *,
    device: str | torch.device,
    dtype: torch.dtype | None,
    steps: bool,
    quantize: str | None,
) -> GPT:
    """The GPT of ``stored``: built (on the CPU, as stored), completed by the load steps of its
    run's config.json entries when ``steps``, moved, and quantized on load when asked."""
    model = build_model(
        stored.config, stored.state_dict, stored.source, quantization=stored.quantization
    )
    run_config = stored.run_config if steps and stored.run_config is not None else {}
    for entry, step in load_steps.steps_for(run_config):
        model = step(model, run_config[entry], directory)
    return quantized_on_load(model.to(device=device, dtype=dtype).eval(), quantize)


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


def tokenizer_name(run_dir: str | os.PathLike) -> str | None:
    """The kind of tokenizer a run uses ("gpt2", "char", "bpe"), None when it records none."""
    run_dir = Path(run_dir)
    cfg = read_config(run_dir)
    return format_of(cfg, run_dir).tokenizer_name(run_dir, cfg)


def describe_weights(
    run_dir: str | os.PathLike,
) -> tuple[GPTConfig, dict[str, torch.Tensor], list[Path]]:
    """What a run or Hugging Face directory holds, without reading its weights: the model
    config, the weights as meta tensors (gptkiln names; a tied head once; a quantized run's int8
    weights and their scales) checked against the config as a load checks them, and the weights
    files. Only the files' headers are read (a pytorch_model.bin is memory-mapped)."""
    run_dir = Path(run_dir)
    cfg = read_config(run_dir)
    stored = read_stored(run_dir, cfg, headers_only=True)
    check_state_dict(stored.state_dict, stored.config, stored.source, stored.quantization)
    return stored.config, stored.state_dict, stored.files
