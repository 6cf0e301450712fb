"""Run directories: the model's config, its weights, its tokenizer and the trainer's state.

A run directory holds::

    config.json          {"format": 1, "model": GPTConfig.to_dict(), "train": {...} or null,
                          "tokenizer": "gpt2" | "char" | ... or null,
                          "finetune": {...} (a fine-tuned run only: task, template, classes...)};
                          a quantized run has "format": 2 and "quantization": {...}
                          (see `gptkiln.quantize`)
    model.safetensors    the weights; a tied head is stored once, as ``wte.weight`` (and, when
                         quantized, ``wte.scale``)
    adapter.safetensors  a LoRA run only: the parameters that train (adapters, a head trained
                         in full); the frozen base is not copied: config.json's "base_weights"
                         refers to the base's directory (path and checksums, see
                         `gptkiln.loading.base`), and model.safetensors holds only what the
                         base lacks (a classifier's new head), written once
    <tokenizer files>    written by the tokenizer's own ``save(dir)``
    trainer_state.pt     optimizer / scheduler / RNG / step (the trainer's; no model weights),
                         read with ``torch.load(weights_only=True)``; a LoRA run's optimizer
                         state is packed losslessly (`pack_tensors`: its bytes grouped into
                         planes, each compressed with zlib), a third smaller

Every file is written atomically (temp file, fsync, rename, fsync of the directory), so a run
killed mid-save keeps its previous checkpoint. Reading a run for inference is
`gptkiln.loading`'s job (``load_run``, ``load_model``); this module reads only what resuming
needs (`read_checkpoint`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import tempfile
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from gptkiln.config import GPTConfig
from gptkiln.errors import GptkilnError, out_of_space
from gptkiln.loading import (
    CONFIG_FILE,
    FLOAT_FORMAT,
    QUANTIZED_FORMAT,
    WEIGHTS_FILE,
    check_state_dict,
    read_config,
    read_safetensors,
    run_model_config,
    safetensors_metadata,
)
from gptkiln.loading.files import unpickler_said
from gptkiln.model import GPT
from gptkiln.quantize import quantization_of

ADAPTER_FILE = "adapter.safetensors"  # a LoRA run's adapters (`gptkiln.finetune.lora`)
TRAINER_STATE_FILE = "trainer_state.pt"
PREVIOUS_STATE_FILE = "trainer_state.prev.pt"  # kept only while a save is under way
TENSORBOARD_DIR = "tensorboard"  # train --tensorboard's event files
PACKED = "zlib_byte_planes"  # the key of a tensor packed by `pack_tensors`


# -- writing ---------------------------------------------------------------------------------
def atomic_write(
    path: str | os.PathLike, write_fn: Callable[[str], Any], kept: str | None = None
) -> None:
    """Write ``path`` all at once or not at all.

    ``write_fn(tmp_path)`` writes a temporary file in the same directory; it is fsynced, renamed
    onto ``path`` with ``os.replace`` (atomic on POSIX and Windows) and the directory is fsynced,
    so a crash leaves either the old file or the new one, never half of either. When
    ``write_fn`` raises, the temporary file is removed and the old file is untouched; the
    message says so, or says ``kept`` where the caller knows better what stays (a checkpoint's
    previous trainer state).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    existed = path.exists()
    try:
        tmp = _new_temporary(path)
    except OSError as e:  # a folder it may not write in: named, not the temporary file's name
        raise OSError(e.errno, e.strerror, str(path.parent)) from None
    try:
        mode = os.stat(tmp).st_mode & 0o777  # the umask's, for a new file
        write_fn(tmp)
        if path.is_file():  # the mode of the file it replaces
            mode = path.stat().st_mode & 0o777
        with contextlib.suppress(OSError):  # where the filesystem allows; safetensors' 0600 too
            os.chmod(tmp, mode)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        full = out_of_space(e, path.parent)  # asked before the partial file goes
        Path(tmp).unlink(missing_ok=True)
        kept = kept or (
            "the file there before is kept as it was" if existed else "nothing was written"
        )
        again = "run the command again (a run that saved a checkpoint: with --resume)"
        if full:  # safetensors and torch.save say so in their own words, or not at all
            raise GptkilnError(
                f"no space left on the device writing {path}; {kept}: free some space, then {again}"
            ) from None
        if isinstance(e, RuntimeError) and _WRITER_FAILED.search(str(e)):  # torch.save's
            said = str(e).splitlines()[0]
            raise GptkilnError(
                f"could not write {path} ({said}); {kept}: check the disk's space, your quota "
                f"and file size limit (ulimit -f), then {again}"
            ) from None
        if isinstance(e, OSError) and e.filename == tmp:  # named by the file it was to be
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise
    _fsync_dir(path.parent)


# torch.save's stream writer failing to write (a file size limit, a quota, an I/O error): it
# keeps no errno, only "unexpected pos N vs M" or "failed writing file"
_WRITER_FAILED = re.compile(r"unexpected pos|failed writing|file write failed")


def _new_temporary(path: Path) -> str:
    """A new empty file beside ``path`` under a name no one else has, made with the mode the
    user's umask gives any new file (``mkstemp``'s 0600 would leave a run or an export that
    another user or a container reads unreadable)."""
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            return str(tmp)
        except FileExistsError:
            continue


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable: fsync the directory entry (POSIX only; Windows has no dir fds)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Atomically write ``obj`` as indented JSON."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")

    atomic_write(path, write)


def write_safetensors(
    path: str | os.PathLike, sd: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Atomically write tensors as safetensors, made contiguous on CPU first."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}

    def write(tmp: str) -> None:
        save_file(tensors, tmp, metadata=metadata)
        _sort_metadata(tmp)

    atomic_write(path, write)


def _sort_metadata(path: str) -> None:
    """The header's ``__metadata__`` in sorted order, in place: safetensors writes it in a hash
    map's order, new in each process, so that two identical runs' files would differ."""
    import struct

    with open(path, "r+b") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        raw = f.read(size)
        header = json.loads(raw)
        if not header.get("__metadata__"):
            return
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        again = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(again) <= size and json.loads(again) == json.loads(raw):  # the same, reordered
            f.seek(8)
            f.write(again.ljust(size))  # safetensors pads its header with spaces too


def unwrap(model: torch.nn.Module) -> GPT:
    """The plain GPT inside a DDP (``.module``) or ``torch.compile`` (``._orig_mod``) wrapper."""
    while not isinstance(model, GPT):
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            raise GptkilnError(f"save_model needs a gptkiln GPT, got {type(model).__name__}")
        model = inner
    return model


def save_model(
    model: torch.nn.Module,
    run_dir: str | os.PathLike,
    *,
    train_config: dict | None = None,
    tokenizer: Any = None,
    extra: dict | None = None,
) -> Path:
    """Write config.json, model.safetensors and the tokenizer files into ``run_dir``.

    Each file is written atomically; config.json is written last, so a directory with a
    config.json always has the weights it describes.

    Args:
        model: a GPT (or a DDP / compiled wrapper of one); a quantized one is written in the
            quantized format (`gptkiln.quantize`).
        run_dir: the run directory (created if needed).
        train_config: the training settings to record (``TrainConfig.to_dict()``), or None.
        tokenizer: a gptkiln tokenizer; its ``save(dir)`` writes its files. None writes none.
        extra: more entries for config.json (a fine-tuned run's ``"finetune"``).

    Returns:
        The run directory as a Path.
    """
    model = unwrap(model)
    sd = model.state_dict()
    return _write_run(
        Path(run_dir),
        model.config,
        sd,
        train_config,
        tokenizer,
        extra=extra,
        quantization=quantization_of(model),
    )


def write_checkpoint(
    run_dir: str | os.PathLike,
    model_config: GPTConfig,
    model_sd: Mapping[str, torch.Tensor],
    state: dict[str, Any],
    *,
    train_config: dict | None = None,
    tokenizer: Any = None,
    extra: dict | None = None,
    adapter_sd: Mapping[str, torch.Tensor] | None = None,
    base_ref: dict[str, Any] | None = None,
) -> Path:
    """A training checkpoint: what `save_model` writes, plus ``trainer_state.pt``.

    Args:
        model_sd: the full model state dict (gptkiln names; a tied ``lm_head.weight`` may be
            included, it is stored once). With ``adapter_sd``, the frozen base, or None when
            it is in ``run_dir`` already.
        state: the trainer's state (optimizer, RNG, step, ...): tensors, numbers, strings,
            lists and dicts only, so it loads with ``torch.load(weights_only=True)``.
        extra: more entries for config.json (a fine-tuned run's ``"finetune"``).
        adapter_sd: a LoRA run's trained parameters, written to ``adapter.safetensors``,
            which is then the checkpoint's weights file.
        base_ref: with ``adapter_sd``, the reference to the base whose weights the run uses
            (`gptkiln.loading.base.base_reference`, config.json's ``"base_weights"``): then
            ``model_sd`` holds only the tensors the base lacks (none: no model.safetensors).

    A save is several files, and no rename covers them all, so a crash midway must leave a
    resumable pair. The step (``state["step"]``) is recorded in both the trainer state and the
    weights' metadata, and the previous trainer state is kept (renamed to
    ``trainer_state.prev.pt``) until the new weights are in place: `read_checkpoint` takes
    whichever trainer state matches the weights' step.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    current, previous = run_dir / TRAINER_STATE_FILE, run_dir / PREVIOUS_STATE_FILE
    weights = run_dir / (WEIGHTS_FILE if adapter_sd is None else ADAPTER_FILE)
    if current.is_file() and weights.is_file():
        # Keep the state that belongs with the weights still on disk. After a save that was cut
        # short, that is `previous`, not `current` (rare: only then is a state file read here).
        stale = previous.is_file() and str(
            _load_trainer_state(current).get("step")
        ) != safetensors_metadata(weights).get("step")
        if not stale:
            os.replace(current, previous)
    if adapter_sd is not None:  # small: worth packing at each save
        state = {**state, "optimizer": pack_tensors(state["optimizer"])}
    kept = None
    if previous.is_file() and weights.is_file():  # what a resume would read now
        step = safetensors_metadata(weights).get("step")
        kept = f"the checkpoint of step {step} is kept ({previous.name} beside its weights)"
    atomic_write(current, lambda tmp: torch.save(state, tmp), kept)
    if adapter_sd is None:
        step = state.get("step")
        _write_run(run_dir, model_config, model_sd, train_config, tokenizer, step, extra)
    else:
        if model_sd is not None and base_ref is not None:  # the base by reference: once
            _write_referencing_run(
                run_dir, model_config, model_sd, train_config, tokenizer, extra, base_ref
            )
        elif model_sd is not None:  # the frozen base: once
            _write_run(run_dir, model_config, model_sd, train_config, tokenizer, extra=extra)
        metadata = {"format": "pt", "step": str(state.get("step"))}
        write_safetensors(weights, adapter_sd, metadata)
    previous.unlink(missing_ok=True)
    _fsync_dir(run_dir)
    return run_dir


def _write_run(
    run_dir: Path,
    config: GPTConfig,
    sd: Mapping[str, torch.Tensor],
    train_config: dict | None,
    tokenizer: Any,
    step: int | None = None,
    extra: dict | None = None,
    quantization: dict[str, Any] | None = None,
) -> Path:
    from gptkiln.version import __version__

    run_dir.mkdir(parents=True, exist_ok=True)
    sd = dict(sd)
    if config.tie_embeddings:
        sd.pop("lm_head.weight", None)  # the same tensor as wte.weight; safetensors stores it once
        sd.pop("lm_head.scale", None)  # quantized: wte.scale, likewise
    check_state_dict(sd, config, "the model being saved", quantization)
    metadata = {"format": "pt", "gptkiln_version": __version__}
    if step is not None:
        metadata["step"] = str(step)
    write_safetensors(run_dir / WEIGHTS_FILE, sd, metadata)
    if tokenizer is not None:
        save_tokenizer(tokenizer, run_dir)
    recorded = {
        "format": FLOAT_FORMAT if quantization is None else QUANTIZED_FORMAT,
        "model": config.to_dict(),
        "train": train_config,
        "tokenizer": getattr(tokenizer, "kind", None),
        **(extra or {}),
    }
    if quantization is not None:
        recorded["quantization"] = quantization
    write_json(run_dir / CONFIG_FILE, recorded)
    return run_dir


def _write_referencing_run(
    run_dir: Path,
    config: GPTConfig,
    own_sd: Mapping[str, torch.Tensor],
    train_config: dict | None,
    tokenizer: Any,
    extra: dict | None,
    base_ref: dict[str, Any],
) -> None:
    """A run whose weights are its base's (``base_ref``) plus ``own_sd``: model.safetensors
    holds ``own_sd`` alone (and is absent when it is empty); config.json records the base."""
    from gptkiln.loading.base import BASE_ENTRY
    from gptkiln.version import __version__

    run_dir.mkdir(parents=True, exist_ok=True)
    if own_sd:
        metadata = {"format": "pt", "gptkiln_version": __version__}
        write_safetensors(run_dir / WEIGHTS_FILE, own_sd, metadata)
    else:
        (run_dir / WEIGHTS_FILE).unlink(missing_ok=True)  # a replaced run's full weights
    if tokenizer is not None:
        save_tokenizer(tokenizer, run_dir)
    recorded = {
        "format": FLOAT_FORMAT,
        "model": config.to_dict(),
        "train": train_config,
        "tokenizer": getattr(tokenizer, "kind", None),
        **(extra or {}),
        BASE_ENTRY: base_ref,
    }
    write_json(run_dir / CONFIG_FILE, recorded)


def save_tokenizer(tokenizer: Any, run_dir: Path) -> None:
    """Let the tokenizer write its files into a scratch directory, then move each atomically."""
    with tempfile.TemporaryDirectory(prefix="gptkiln-tokenizer-") as scratch:
        tokenizer.save(scratch)
        for src in sorted(Path(scratch).iterdir()):
            if src.is_file():
                atomic_write(run_dir / src.name, lambda tmp, src=src: shutil.copyfile(src, tmp))


# -- training checkpoints --------------------------------------------------------------------
def has_checkpoint(run_dir: str | os.PathLike) -> bool:
    """Whether run_dir holds any file of a checkpoint."""
    run_dir = Path(run_dir)
    names = (CONFIG_FILE, WEIGHTS_FILE, ADAPTER_FILE, TRAINER_STATE_FILE, PREVIOUS_STATE_FILE)
    return any((run_dir / name).exists() for name in names)


def has_whole_checkpoint(run_dir: str | os.PathLike) -> bool:
    """Whether run_dir holds a checkpoint a resume can take: config.json, the weights (a LoRA
    run's adapters) and the trainer state saved with them (`matching_trainer_state`, its
    tensors memory-mapped, not read). A save cut short before its last file holds none."""
    run_dir = Path(run_dir)
    weights = next((run_dir / n for n in (ADAPTER_FILE, WEIGHTS_FILE) if (run_dir / n).is_file()),
                   None)  # fmt: skip
    if weights is None or not (run_dir / CONFIG_FILE).is_file():
        return False
    try:
        return matching_trainer_state(run_dir, _weights_step(weights), mmap=True)[0] is not None
    except GptkilnError:  # a damaged file: resuming says what is wrong with it
        return False


def first_save_cut_short(run_dir: str | os.PathLike) -> bool:
    """Whether run_dir holds what a first training save leaves when it is stopped before its
    last file: a trainer state (which only training writes), and no whole checkpoint, since
    config.json or the weights it was to go with (a LoRA run's adapters) never came."""
    run_dir = Path(run_dir)
    states = (TRAINER_STATE_FILE, PREVIOUS_STATE_FILE)
    has_state = any((run_dir / n).is_file() for n in states)
    return has_state and not has_whole_checkpoint(run_dir) and _weights_missing(run_dir)


def _weights_missing(run_dir: Path) -> bool:
    """Whether config.json, or the weights file it names the run by, is missing: the
    adapters of a LoRA run (its config.json records ``"lora"``, or a base by reference), else
    model.safetensors."""
    if not (run_dir / CONFIG_FILE).is_file():
        return True
    from gptkiln.loading.base import BASE_ENTRY

    try:
        cfg = read_config(run_dir)
    except GptkilnError:
        return False
    finetune = cfg.get("finetune")
    lora = isinstance(finetune, dict) and bool(finetune.get("lora"))
    adapters = lora or cfg.get(BASE_ENTRY) is not None
    return not (run_dir / (ADAPTER_FILE if adapters else WEIGHTS_FILE)).is_file()


def _weights_step(weights: Path) -> str | None:
    """The training step a weights file records (None: none, or a file safetensors cannot
    read)."""
    try:
        return safetensors_metadata(weights).get("step")
    except GptkilnError:
        return None


def check_same_model_config(run_dir: str | os.PathLike, model_config: GPTConfig) -> None:
    """Refuse to resume a run with a model config other than the one it was saved with; first,
    one whose config.json does not fit its own weights (edited by hand, or another run's): the
    flags are not what is wrong then, and --overwrite would lose the weights."""
    from gptkiln.loading import check_state_dict
    from gptkiln.loading.load import read_stored

    run_dir = Path(run_dir)
    stored = read_stored(run_dir, read_config(run_dir), headers_only=True)  # damage: its line
    try:
        check_state_dict(stored.state_dict, stored.config, stored.source, stored.quantization)
    except GptkilnError as e:
        raise GptkilnError(
            f"cannot resume {run_dir}: its {CONFIG_FILE} does not belong to its weights ({e}); "
            f"restore the {CONFIG_FILE} saved with them"
        ) from None
    saved = run_model_config(read_config(run_dir), run_dir / CONFIG_FILE).to_dict()
    diffs = [
        f"{k} {saved[k]!r} in the checkpoint, {v!r} now"
        for k, v in model_config.to_dict().items()
        if saved[k] != v
    ]
    if diffs:
        raise GptkilnError(
            f"cannot resume {run_dir}: its model differs ({'; '.join(diffs)}); "
            "resume with the same model settings, or start again with --overwrite in place of "
            "--resume"
        )


def read_checkpoint(run_dir: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(model state dict, trainer state) of a training checkpoint, to resume from.

    The state dict has every key of ``GPT.state_dict()`` (a tied ``lm_head.weight`` is the same
    tensor as ``wte.weight``); its tensors are memory-mapped from model.safetensors.
    """
    run_dir = Path(run_dir)
    cfg = read_config(run_dir)
    config = run_model_config(cfg, run_dir / CONFIG_FILE)
    weights = run_dir / WEIGHTS_FILE
    if not weights.is_file():
        raise GptkilnError(
            f"cannot resume {run_dir}: {WEIGHTS_FILE} is missing; drop --resume to start a new run"
        )
    sd = read_safetensors(weights)
    check_state_dict(sd, config, str(weights))
    if config.tie_embeddings:
        sd["lm_head.weight"] = sd["wte.weight"]
    return sd, _matching_trainer_state(run_dir, safetensors_metadata(weights).get("step"))


def read_adapter_checkpoint(
    run_dir: str | os.PathLike,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(adapter state dict, trainer state) of a LoRA run's checkpoint, to resume from."""
    run_dir = Path(run_dir)
    path = run_dir / ADAPTER_FILE
    if not path.is_file():
        raise GptkilnError(
            f"cannot resume {run_dir}: {ADAPTER_FILE} is missing; restore it, or start a new "
            "run there with --overwrite"
        )
    sd = read_safetensors(path)
    state = _matching_trainer_state(run_dir, safetensors_metadata(path).get("step"), path)
    return sd, {**state, "optimizer": unpack_tensors(state["optimizer"])}


def pack_tensors(tree: Any, min_bytes: int = 256) -> Any:
    """``tree`` (dicts and lists of tensors and plain values) with each tensor of at least
    ``min_bytes`` replaced by a lossless packing that `unpack_tensors` reverses bit for bit.

    The k-th byte of every number goes into plane k, and each plane is compressed with zlib
    where that helps (the byte grouping of ZipNN, https://arxiv.org/abs/2411.05239): the planes
    of sign and exponent, nearly constant across an optimizer's moments, shrink severalfold; the
    mantissa's are kept as they are. A LoRA run's Adam moments pack to about two thirds.
    """
    if isinstance(tree, dict):
        return {k: pack_tensors(v, min_bytes) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(pack_tensors(v, min_bytes) for v in tree)
    if not isinstance(tree, torch.Tensor) or tree.numel() * tree.element_size() < min_bytes:
        return tree
    t = tree.detach().cpu().contiguous()
    numbers = t.reshape(-1).view(torch.uint8).reshape(-1, t.element_size())  # (N, bytes)
    planes, compressed = [], []
    for k in range(t.element_size()):
        raw = numbers[:, k].numpy().tobytes()
        packed = zlib.compress(raw, 6)
        small = len(packed) < 0.97 * len(raw)
        planes.append(torch.frombuffer(bytearray(packed if small else raw), dtype=torch.uint8))
        compressed.append(small)
    dtype = str(t.dtype).removeprefix("torch.")
    return {PACKED: planes, "compressed": compressed, "dtype": dtype, "shape": list(t.shape)}


def unpack_tensors(tree: Any) -> Any:
    """The tensors `pack_tensors` packed, restored exactly."""
    if isinstance(tree, dict) and PACKED in tree:
        planes = [
            torch.frombuffer(bytearray(zlib.decompress(p.numpy().tobytes())), dtype=torch.uint8)
            if small
            else p
            for p, small in zip(tree[PACKED], tree["compressed"], strict=True)
        ]
        numbers = torch.stack(planes, dim=1).contiguous()  # (N, bytes)
        dtype = getattr(torch, tree["dtype"])
        return numbers.reshape(-1).view(dtype).reshape(tree["shape"]).clone()
    if isinstance(tree, dict):
        return {k: unpack_tensors(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(unpack_tensors(v) for v in tree)
    return tree


def _matching_trainer_state(
    run_dir: Path, weights_step: str | None, weights: Path | None = None
) -> dict[str, Any]:
    """The trainer state saved with the weights of step ``weights_step``."""
    state, why = matching_trainer_state(run_dir, weights_step, weights=weights)
    if state is not None:
        return state
    if why.endswith("is missing"):
        raise GptkilnError(f"cannot resume {run_dir}: {why}; drop --resume to start a new run")
    raise GptkilnError(
        f"{run_dir}: {why}; restore the files of one save, or start afresh with --overwrite"
    )


def matching_trainer_state(
    run_dir: str | os.PathLike,
    weights_step: str | None,
    *,
    mmap: bool = False,
    weights: str | os.PathLike | None = None,
) -> tuple[dict[str, Any] | None, str]:
    """(the trainer state saved with the weights of step ``weights_step``; or None and why
    there is none: also where the weights record no step, as no training wrote them). This is
    what resuming takes; `gptkiln info` asks it whether a run can be resumed (``mmap``: its
    tensors are not read until used; ``weights``: the weights file the step is of, for the
    message: model.safetensors unless given)."""
    run_dir = Path(run_dir)
    paths = [
        p for p in (run_dir / TRAINER_STATE_FILE, run_dir / PREVIOUS_STATE_FILE) if p.is_file()
    ]
    if not paths:
        return None, f"{TRAINER_STATE_FILE} is missing"
    weights_name = (Path(weights) if weights else run_dir / WEIGHTS_FILE).name
    if weights_step is None:  # weights no training wrote: a trainer state there is another's
        return None, (
            f"{weights_name} records no training step (written by a conversion or save_model, "
            f"not by training), so the {paths[0].name} beside it is not its"
        )
    steps = []
    for path in paths:
        state = _load_trainer_state(path, mmap=mmap)
        if str(state.get("step")) == weights_step:
            return state, f"{path.name} matches the weights (step {state.get('step')})"
        steps.append(f"{path.name} from step {state.get('step')}")
    return None, f"{weights_name} is from step {weights_step} but {', '.join(steps)}"


def _load_trainer_state(path: Path, *, mmap: bool = False) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # a truncated zip, or a pickle that is not plain data
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        if reason.startswith("Weights only load failed"):  # torch's advice is not for this file
            reason = unpickler_said(str(e), "trainer state")
        raise GptkilnError(
            f"{path} is truncated or corrupt ({reason}); restore it, or start a new run there "
            "with --overwrite"
        ) from None
