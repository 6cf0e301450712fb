"""The files of a Hugging Face model directory, whatever the model family: its weights,
model.safetensors (memory-mapped), its sharded form (model.safetensors.index.json and the shards
it names) or pytorch_model.bin (``torch.load(weights_only=True, mmap=True)``); and the names of
the tokenizer's files a conversion carries along. Each family's names, layouts and config are
its own module's (`gptkiln.loading.hf_gpt2`, `gptkiln.loading.hf_llama`)."""

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
from gptkiln.tokenizers import BPE_FILE, HF_CONFIG_FILE, HF_EXTRA_FILES

HF_BIN_FILE = "pytorch_model.bin"
HF_INDEX_FILE = "model.safetensors.index.json"
# A Hugging Face model's tokenizer and what it says about generation (BOS/EOS, stop ids, the chat
# template): the files a conversion keeps as they are, into a run and back out of it.
HF_TOKENIZER_FILES = (BPE_FILE, HF_CONFIG_FILE, *HF_EXTRA_FILES)  # tokenizers.py names them


def hf_weights_files(hf_dir: Path) -> list[Path]:
    """The weights files of an HF checkpoint: model.safetensors, the shards its index names, or
    pytorch_model.bin, in that order of preference."""
    if (hf_dir / WEIGHTS_FILE).is_file():
        return [hf_dir / WEIGHTS_FILE]
    if (hf_dir / HF_INDEX_FILE).is_file():
        return _shards(hf_dir)
    if (hf_dir / HF_BIN_FILE).is_file():
        return [hf_dir / HF_BIN_FILE]
    if (hf_dir / f"{HF_BIN_FILE}.index.json").is_file():
        raise GptkilnError(
            f"{hf_dir} holds {HF_BIN_FILE} shards (pickles), which gptkiln does not read; save "
            "the model as safetensors with transformers (AutoModelForCausalLM.from_pretrained("
            "DIR).save_pretrained(NEW_DIR)), or download the repository's safetensors files"
        )
    raise GptkilnError(
        f"{hf_dir} has a config.json but no {WEIGHTS_FILE}, {HF_INDEX_FILE} (with its "
        f"shards) or {HF_BIN_FILE}; copy the weights files into it"
    )


def _shards(hf_dir: Path) -> list[Path]:
    """The shards model.safetensors.index.json names (its ``weight_map``: tensor -> file), each
    of which must be in the directory."""
    path = hf_dir / HF_INDEX_FILE
    try:
        weight_map = json.loads(path.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
        if not names or not all(isinstance(n, str) and "/" not in n for n in names):
            raise ValueError("no shard file names")
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GptkilnError(
            f"{path} is not a safetensors index (a weight_map of tensor names to shard files: "
            f"{reason}); restore it from the model's repository"
        ) from None
    missing = [name for name in names if not (hf_dir / name).is_file()]
    if missing:
        raise GptkilnError(
            f"{path} names {len(names)} shards, but {', '.join(missing[:3])}"
            f"{' and more' if len(missing) > 3 else ''} {'is' if len(missing) == 1 else 'are'} "
            "not in the directory; download the missing shards beside it"
        )
    return [hf_dir / name for name in names]


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
