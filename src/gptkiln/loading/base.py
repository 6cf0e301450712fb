"""A run that keeps its weights by reference: a LoRA run (`gptkiln.finetune.lora`) stores its
adapters and, instead of a copy of the frozen base, a reference to the base's directory (a run or
a Hugging Face one) in config.json::

    "base_weights": {"path": "/abs/path/to/base", "relative": "../base",
                     "files": [{"name": "model.safetensors", "size": N, "mtime_ns": T,
                                "sha256": "..."}, ...]}

Its own model.safetensors, when it has one, holds only what the base lacks (a classifier's new
head). Reading the run reads the base as its own format reads it, checks that its weights files
are the ones recorded (size and modification time, else their SHA-256), keeps the tensors the
run's model has, and adds the run's own; the load steps then merge the adapters as before. A
base that moved (``relative`` is tried when ``path`` is gone) or changed is one line.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gptkiln.errors import GptkilnError
from gptkiln.loading.build import StoredModel
from gptkiln.loading.files import CONFIG_FILE, WEIGHTS_FILE, read_safetensors
from gptkiln.loading.files import read_config as read_config_file

BASE_ENTRY = "base_weights"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _file_record(path: Path, directory: Path) -> dict[str, Any]:
    stat = path.stat()
    return {
        "name": Path(os.path.relpath(path, directory)).as_posix(),  # a base's base: ../
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "sha256": file_sha256(path),
    }


def base_reference(
    base_dir: str | os.PathLike, files: list[Path], run_dir: str | os.PathLike
) -> dict[str, Any]:
    """The ``"base_weights"`` entry of a run in ``run_dir`` whose weights are those of
    ``base_dir``, stored in ``files`` (`gptkiln.loading.describe_weights`'s)."""
    base_dir = Path(base_dir).resolve()
    relative = os.path.relpath(base_dir, Path(run_dir).resolve())
    return {
        "path": str(base_dir),
        "relative": Path(relative).as_posix(),
        "files": [_file_record(Path(f).resolve(), base_dir) for f in files],
    }


def base_directory(run_dir: Path, ref: Any) -> Path:
    """Where the base of a run (its ``"base_weights"`` entry ``ref``) is now."""
    where = f"{run_dir / CONFIG_FILE}: {BASE_ENTRY}"
    if not isinstance(ref, dict) or not isinstance(ref.get("path"), str):
        raise GptkilnError(f"{where} is {ref!r}, not a reference to a base; restore the file")
    candidates = [Path(ref["path"])]
    if isinstance(ref.get("relative"), str):
        candidates.append(run_dir / ref["relative"])  # the run and its base moved together
    for candidate in candidates:
        if (candidate / CONFIG_FILE).is_file():
            return candidate
    raise GptkilnError(
        f"{run_dir} keeps its adapters and a reference to its base model, {ref['path']}, which is "
        f"gone (moved or deleted); put the base back there, or write its new place into "
        f"{CONFIG_FILE}'s {BASE_ENTRY}.path"
    )


def matches_record(path: Path, record: dict[str, Any]) -> bool:
    """Whether the file ``path`` is the one `_file_record` recorded: the same size and time (no
    read needed), or else the same size and SHA-256."""
    stat = path.stat()
    if stat.st_size != record.get("size"):
        return False
    return stat.st_mtime_ns == record.get("mtime_ns") or file_sha256(path) == record.get("sha256")


def check_base_files(run_dir: Path, base_dir: Path, ref: dict[str, Any]) -> None:
    """The base's weights files are those the run was trained on: the same size and time (no
    read needed), or else the same SHA-256."""
    for record in ref.get("files") or []:
        path = base_dir / record["name"]
        if not path.is_file():
            raise GptkilnError(
                f"{run_dir}'s base {base_dir} has no {record['name']} any more; restore the base "
                "the run was trained on"
            )
        if not matches_record(path, record):
            raise GptkilnError(
                f"{run_dir}'s base {path} has changed since the run was trained on it (its "
                "checksum differs); restore that base, or train the run again on this one"
            )


def read_with_base(
    run_dir: Path, cfg: dict[str, Any], headers_only: bool, read: Callable[..., StoredModel]
) -> StoredModel:
    """What a run whose config.json has ``"base_weights"`` stores: the tensors of its base
    (read by ``read``, `gptkiln.loading.load.read_stored`) that the run's model has, and the
    run's own (its model.safetensors, if any)."""
    from gptkiln.loading.files import read_safetensors_header
    from gptkiln.loading.run import run_model_config
    from gptkiln.model import GPT

    config = run_model_config(cfg, run_dir / CONFIG_FILE)
    ref = cfg[BASE_ENTRY]
    base_dir = base_directory(run_dir, ref)
    check_base_files(run_dir, base_dir, ref)
    base = read(base_dir, read_config_file(base_dir), headers_only=headers_only)
    with torch.device("meta"):
        names = set(GPT(config).state_dict())
    if config.tie_embeddings:
        names.discard("lm_head.weight")  # stored once, as wte.weight
    sd = {k: v for k, v in base.state_dict.items() if k in names}
    files = list(base.files)
    own = run_dir / WEIGHTS_FILE
    if own.is_file():
        sd.update(read_safetensors_header(own) if headers_only else read_safetensors(own))
        files.append(own)
    return StoredModel(config, sd, str(run_dir), files, None, run_config=cfg)
