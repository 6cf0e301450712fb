"""Reading the files every format is made of: config.json, safetensors (memory-mapped, or only
its header) and PyTorch's own files (``torch.load(weights_only=True)``), each with errors a
person can act on."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import SafetensorError, safe_open

from gptkiln.errors import GptkilnError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
REPLACED_DIR = ".replaced"
"""Where ``train --overwrite`` keeps the run it replaces until the new run's first checkpoint
(`gptkiln.run_guard`); reading a directory whose run waits there says so."""
TORCH_SUFFIXES = (".pth", ".pt")
"""What the book's ``torch.save(model.state_dict(), "model.pth")`` and its kin are called."""


def openai_checkpoint(path: Path) -> Path | None:
    """The folder of OpenAI's TensorFlow GPT-2 checkpoint that ``path`` is or lies in
    (``hparams.json`` beside ``model.ckpt.*``, as the book's ``gpt_download.py`` leaves it in
    ``gpt2/124M``), or None."""
    folder = path if path.is_dir() else path.parent
    if (folder / "hparams.json").is_file() and any(folder.glob("model.ckpt*")):
        return folder
    return None


def openai_checkpoint_fix(folder: Path) -> str:
    """What to do with OpenAI's TensorFlow checkpoint in ``folder``, which gptkiln does not
    read: the book's own route from it to a PyTorch state dict, then `convert book`."""
    return (
        f"{folder} holds OpenAI's TensorFlow GPT-2 checkpoint (hparams.json, model.ckpt.*: what "
        "the book's gpt_download.py fetches), which gptkiln does not read; load it into the "
        "book's GPTModel with its load_weights_into_gpt, save that with "
        'torch.save(model.state_dict(), "model.pth") and make a run of it with `gptkiln convert '
        "book model.pth --out DIR` (or, with internet, `gptkiln download gpt2 --out DIR`)"
    )


def read_config(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The parsed config.json of a run (or Hugging Face) directory, with readable errors."""
    run_dir = Path(run_dir)
    path = run_dir / CONFIG_FILE
    if not run_dir.exists():
        raise GptkilnError(
            f"{run_dir} does not exist; give a run directory made by "
            f"`gptkiln train --out DIR` or `gptkiln convert`"
        )
    if (folder := openai_checkpoint(run_dir)) is not None and not path.is_file():
        raise GptkilnError(openai_checkpoint_fix(folder))
    if run_dir.is_file():
        suffix = run_dir.suffix.lower()
        kind = ""
        if suffix == ".gguf":
            kind = " (a GGUF file: `gptkiln convert gguf` makes a run of it)"
        elif suffix in TORCH_SUFFIXES:
            kind = (
                " (a PyTorch file: the book's model.pth, a state dict of its GPTModel, becomes a "
                f"run with `gptkiln convert book {run_dir} --out DIR`)"
            )
        raise GptkilnError(
            f"{run_dir} is a file, not a run directory{kind}; give the directory that holds "
            f"{CONFIG_FILE} (made by `gptkiln train --out DIR` or `gptkiln convert`)"
        )
    if not path.is_file() and (run_dir / "meta.json").is_file():
        raise GptkilnError(
            f"{run_dir} is prepared data, not a run; train a model on it with "
            f"`gptkiln train --data {run_dir} --out RUN`"
        )
    aside = run_dir / REPLACED_DIR
    if not path.is_file() and (aside / CONFIG_FILE).is_file():
        raise GptkilnError(
            f"{run_dir} holds no {CONFIG_FILE}: its run waits in {aside}, set aside by a "
            "`gptkiln train --overwrite` that stopped before its first checkpoint; move the "
            f"files in {aside} back into {run_dir} to keep that run (--resume then continues "
            "it), or train there again with --overwrite"
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


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Memory-map a safetensors file (tensors are read lazily, page by page)."""
    try:
        return safetensors.torch.load_file(path, device="cpu")
    except (SafetensorError, OSError) as e:
        raise _corrupt(path, e) from None


def safetensors_metadata(path: Path) -> dict[str, str]:
    """The metadata of a safetensors file; {} when it cannot be read (errors come on loading)."""
    try:
        with safe_open(path, framework="pt") as f:
            return f.metadata() or {}
    except (SafetensorError, OSError):
        return {}


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
        raise _corrupt(path, e) from None


def _corrupt(path: Path, e: Exception) -> GptkilnError:
    """Why a weights file did not read: one this user may not read (safetensors says "No such
    file" for that), else its bytes."""
    if path.is_file() and not os.access(path, os.R_OK):
        return GptkilnError(
            f"{path}: this user may not read it (permission denied); ask its owner to make it "
            f"readable (chmod a+r {path}), or copy the run"
        )
    reason = str(e).splitlines()[0] if str(e) else type(e).__name__
    return GptkilnError(f"{path} is truncated or corrupt ({reason}); restore it or re-run training")


def unpickler_said(message: str, holder: str) -> str:
    """What torch's safe unpickler found, from its "Weights only load failed" message, without
    its advice to load the file unsafely (which would run any code a pickle holds): not a
    pickle at all, or one that names objects no ``holder`` (a state dict, a trainer state)
    holds."""
    found = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\. |\n|$)", message) or re.search(
        r"^(Trying to load unsupported GLOBAL \S+)", message, re.M
    )
    what = found.group(1).strip() if found else "not plain data"
    if what.startswith(("Unsupported global", "Trying to load unsupported GLOBAL")):
        return f"it names objects that no {holder} holds ({what})"
    return f"not a {holder}: {what}"


def load_torch_file(path: Path) -> dict[str, Any]:
    """``torch.load`` of plain data only (weights_only), memory-mapped where the format allows."""
    if (folder := openai_checkpoint(path)) is not None:
        raise GptkilnError(openai_checkpoint_fix(folder))
    if path.is_dir():
        raise GptkilnError(
            f"{path} is a directory; give the checkpoint file in it (the book saves one with "
            'torch.save(model.state_dict(), "model.pth"))'
        )
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
        if "Weights only load failed" in str(e):
            reason = unpickler_said(str(e), "state dict")
        raise GptkilnError(
            f"{path} cannot be read as a PyTorch state dict ({reason}); is it "
            f"truncated, or not a plain state dict?"
        ) from None
