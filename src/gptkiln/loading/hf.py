"""The weights files of a Hugging Face model directory, whatever the model family:
model.safetensors (memory-mapped), its sharded form (model.safetensors.index.json and the shards
it names) or pytorch_model.bin (``torch.load(weights_only=True, mmap=True)``). Each family's
names, layouts and config are its own module's (`gptkiln.loading.hf_gpt2`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gptkiln.errors import GptkilnError
from gptkiln.loading.files import (
    WEIGHTS_FILE,
    load_torch_file,
    read_safetensors,
    read_safetensors_header,
)

HF_BIN_FILE = "pytorch_model.bin"
HF_INDEX_FILE = "model.safetensors.index.json"


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


def read_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors of an HF checkpoint (HF's names and layouts), memory-mapped."""
    return read_hf_files(hf_weights_files(hf_dir))


def read_hf_files(files: list[Path], *, headers_only: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of an HF checkpoint's weights ``files`` (`hf_weights_files`), memory-mapped;
    or, with ``headers_only``, as meta tensors from the safetensors headers (a
    pytorch_model.bin is memory-mapped to read its names, shapes and dtypes)."""
    sd: dict[str, torch.Tensor] = {}
    for path in files:
        if path.name == HF_BIN_FILE:
            tensors = load_torch_file(path)
            sd.update({k: v.to("meta") for k, v in tensors.items()} if headers_only else tensors)
        else:
            sd.update(read_safetensors_header(path) if headers_only else read_safetensors(path))
    return sd
