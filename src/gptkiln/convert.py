"""The ``convert`` and ``download`` commands: models into run directories and out to Hugging Face,
and LoRA runs merged into plain ones, and float runs into quantized ones.

Each reads with `gptkiln.loading` (the one way in), converts names with `gptkiln.interop` where
the format asks for it, and writes the run aside and moves it in whole (`export.files.staged_run`),
so one that fails leaves the run it would replace as it was. None writes over a model without
``overwrite`` (`run_guard.check_out_dir`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from gptkiln.checkpoint import save_model
from gptkiln.errors import GptkilnError
from gptkiln.export.files import copy_files, staged_run
from gptkiln.export.hf import (  # (`gptkiln.export` writes the formats out; named here as before)
    DEFAULT_MAX_SHARD_SIZE as DEFAULT_MAX_SHARD_SIZE,
)
from gptkiln.export.hf import TOKEN_IDS
from gptkiln.export.hf import export_hf as export_hf
from gptkiln.export.hf import parse_size as parse_size
from gptkiln.loading import (
    CONFIG_FILE,
    HF_INDEX_FILE,
    HF_TOKENIZER_FILES,
    WEIGHTS_FILE,
    format_of,
    load_book,
    load_hf,
    load_model,
    read_config,
    tokenizer_name,
)
from gptkiln.model import GPT
from gptkiln.quantize import check_quantize
from gptkiln.run_guard import check_out_dir

HUB_MODELS = {
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
    # the published Llama 3.2 and Qwen3 presets (`gptkiln.config.PRESETS`); Meta's are gated:
    # accept the licence on the model's page and log in (`hf auth login`) first
    "llama3.2-1b": "meta-llama/Llama-3.2-1B",
    "llama3.2-3b": "meta-llama/Llama-3.2-3B",
    "qwen3-0.6b": "Qwen/Qwen3-0.6B",
    "qwen3-1.7b": "Qwen/Qwen3-1.7B",
}
# What a download fetches: the config, the weights (one file, or an index and its shards), and
# the tokenizer's files (GPT-2's vocab.json and merges.txt; the others' tokenizer.json, ...).
HUB_FILES = [
    CONFIG_FILE,
    WEIGHTS_FILE,
    HF_INDEX_FILE,
    "model-*-of-*.safetensors",
    "vocab.json",
    "merges.txt",
    *HF_TOKENIZER_FILES,
]


# -- Hugging Face directories ----------------------------------------------------------------
def import_hf(
    hf_dir: str | os.PathLike,
    out_run_dir: str | os.PathLike | None = None,
    *,
    overwrite: bool = False,
    on_note: Callable[[str], None] | None = None,
) -> GPT | None:
    """Read a Hugging Face GPT-2, Llama or Qwen3 checkpoint directory (`gptkiln.loading`).

    Args:
        hf_dir: a directory with config.json and model.safetensors (or its shards and
            model.safetensors.index.json, or pytorch_model.bin).
        out_run_dir: where to write a gptkiln run directory; None returns the model instead. A
            GPT-2 run of GPT-2's BPE gets the gpt2 tokenizer; a Llama or Qwen3 run, or a GPT-2
            trained on a tokenizer of its own (a ``bpe:N`` run through ``to-hf``), keeps the
            directory's tokenizer files as they are (`HF_TOKENIZER_FILES`: tokenizer.json,
            tokenizer_config.json, special_tokens_map.json, generation_config.json,
            chat_template.jinja, those present) and records ``"tokenizer": "hf"`` and
            config.json's bos/eos/pad ids, which `export_hf` writes back.
        overwrite: replace a model already in out_run_dir (see `run_guard.check_out_dir`).
        on_note: told, in one line, that the directory has no tokenizer.json (the run then
            holds the weights alone, which generation cannot read until it gets one).

    Returns:
        The GPT (on CPU, in the checkpoint's dtype) when out_run_dir is None, else None.
    """
    stale = [] if out_run_dir is None else check_out_dir(out_run_dir, overwrite=overwrite)
    model = load_hf(hf_dir)
    if out_run_dir is None:
        return model
    if tokenizer_name(hf_dir) == "gpt2":
        _save_with_gpt2_tokenizer(model, out_run_dir, stale)
        return None
    _save_with_hf_tokenizer(model, Path(hf_dir), Path(out_run_dir), stale)
    if on_note is not None and not (Path(hf_dir) / "tokenizer.json").is_file():
        on_note(
            f"{hf_dir} has no tokenizer.json: {out_run_dir} holds the weights alone, which "
            "generate, chat and serve cannot read; copy tokenizer.json and "
            f"tokenizer_config.json from the model's repository into {hf_dir} and convert it "
            "again (with --overwrite)"
        )
    return None


def _save_with_gpt2_tokenizer(model: GPT, out_run_dir, stale: list[Path]) -> None:
    """Write the run whole (`staged_run`: the ``stale`` files of the run it replaced dropped)."""
    from gptkiln.tokenizers import load_tokenizer

    with staged_run(out_run_dir, stale) as stage:
        save_model(model, stage, tokenizer=load_tokenizer("gpt2"))


def _save_with_hf_tokenizer(model: GPT, hf_dir: Path, out_dir: Path, stale: list[Path]) -> None:
    """Write the run of a Llama / Qwen3 directory, or of a GPT-2 of a tokenizer of its own: its
    tokenizer's files copied as they are (first, so that the config.json written last finds
    them), what config.json says of BOS, EOS and padding recorded beside the model (where a
    tokenizer reading the run's config.json finds them, as in a Hugging Face one), the whole
    run moved into place at once and the ``stale`` files of the run it replaced dropped. A
    tokenizer.json or chat template that cannot be read is refused now, not at the first use."""
    from gptkiln.chat_template import load_chat_template
    from gptkiln.tokenizers import HFTokenizer

    if (hf_dir / "tokenizer.json").is_file():
        HFTokenizer.load(hf_dir)
    load_chat_template(hf_dir)
    with staged_run(out_dir, stale) as stage:
        save_model(model, stage, extra=_carry_hf_tokenizer(hf_dir, read_config(hf_dir), stage))


def _carry_hf_tokenizer(src_dir: Path, cfg: dict, stage: Path) -> dict:
    """Copy the Hugging Face tokenizer's files of ``src_dir`` (a Hugging Face directory, or a
    run that keeps them; ``cfg``: its config.json) into ``stage`` (a `staged_run`'s, which drops
    any other tokenizer's files); the entries for the run's config.json: ``"tokenizer"``
    (``"hf"``, None without a tokenizer.json) and the bos/eos/pad ids."""
    copied = copy_files(src_dir, stage, HF_TOKENIZER_FILES)
    extra = {key: cfg[key] for key in TOKEN_IDS if key in cfg}
    extra["tokenizer"] = "hf" if "tokenizer.json" in copied else None
    return extra


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
    with staged_run(out_dir, stale) as stage:
        save_model(model, stage, train_config=cfg.get("train"), tokenizer=tokenizer,
                   extra={"finetune": merged})  # fmt: skip
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
    """Write a quantized copy of a float run (or of a Hugging Face directory) to
    ``out_dir``: config.json recording the quantization, model.safetensors with the int8
    weights and their scales (the format: `gptkiln.quantize`), the tokenizer's files (a
    Hugging Face tokenizer's as they are, with its bos/eos/pad ids). It loads
    directly, with no float copy of the quantized weights in memory.

    Args:
        method: "int8" (`gptkiln.quantize.METHODS`).
        embedding_and_head: also the output head and the token embedding (the default); False
            keeps them float (``--float-head``), recorded in config.json.
        overwrite: replace a model already in out_dir (see `run_guard.check_out_dir`).
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
    kind = tokenizer_name(run_dir)
    if kind not in (None, "hf"):
        from gptkiln.tokenizers import load_tokenizer

        tokenizer = load_tokenizer("gpt2" if "model_type" in cfg else str(run_dir))
    train = None if "model_type" in cfg else cfg.get("train")
    finetune = cfg.get("finetune")  # an instruction-tuned run keeps its template (LoRA: merged)
    extra = {"finetune": {k: v for k, v in finetune.items() if k != "lora"}} if finetune else {}
    with staged_run(out_dir, stale) as stage:
        if kind == "hf":  # a Hugging Face tokenizer (a Llama / Qwen3 model's) is carried as is
            extra.update(_carry_hf_tokenizer(Path(run_dir), cfg, stage))
        save_model(model, stage, train_config=train, tokenizer=tokenizer, extra=extra or None)
    return out_dir


# -- the book's GPTModel ---------------------------------------------------------------------
def import_book(
    path: str | os.PathLike,
    out_run_dir: str | os.PathLike | None = None,
    n_head: int | None = None,
    *,
    overwrite: bool = False,
) -> GPT | None:
    """Read a ``model.pth`` saved from the book's ``GPTModel`` (``torch.save(model.state_dict())``,
    or the book's ``{"model_state_dict": ..., "optimizer_state_dict": ...}``).

    Args:
        path: the .pth file (read with ``torch.load(weights_only=True)``).
        out_run_dir: where to write a gptkiln run directory (with the gpt2 tokenizer, which the
            book uses); None returns the model instead.
        n_head: attention heads, which shapes cannot tell; None: GPT-2's for the width (see
            `loading.book_state_dict_to_gptkiln`).

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
    """Download a GPT-2, Llama or Qwen3 model from the Hugging Face Hub and write a run
    directory (`import_hf`).

    Args:
        name: a short name of `HUB_MODELS` (``gpt2`` (124M), ``gpt2-medium`` (355M),
            ``gpt2-large`` (774M), ``gpt2-xl`` (1.5B), ``llama3.2-1b``, ``llama3.2-3b``,
            ``qwen3-0.6b``, ``qwen3-1.7b``), or a Hub repository id (``owner/name``) of a
            ``GPT2LMHeadModel``, ``LlamaForCausalLM`` or ``Qwen3ForCausalLM``.
        out_dir: the run directory to write.
        overwrite: replace a model already in out_dir (see `run_guard.check_out_dir`).

    A repository id's config.json is fetched first, so that a model gptkiln does not read is
    refused before its weights are downloaded. With ``HF_HUB_OFFLINE`` set only an already
    cached copy is used and the network is never tried. Without internet (or a cache) the error
    says how to convert a local copy instead; a gated repository (Meta's Llama) says to log in.
    """
    repo_id = HUB_MODELS.get(name, name)
    if name not in HUB_MODELS and not re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        raise GptkilnError(
            f"unknown model {name!r}; choose one of: {', '.join(HUB_MODELS)}, or give a Hugging "
            "Face repository id (owner/name) of a GPT-2, Llama or Qwen3 model"
        )
    check_out_dir(out_dir, overwrite=overwrite)  # before a download of gigabytes
    if name not in HUB_MODELS:  # a family gptkiln reads, or one line before the weights come
        config_dir = _hub_snapshot(name, repo_id, out_dir, [CONFIG_FILE])
        format_of(read_config(config_dir), config_dir)
    path = _hub_snapshot(name, repo_id, out_dir, HUB_FILES)
    import_hf(path, out_dir, overwrite=overwrite)
    return Path(out_dir)


def _hub_snapshot(name: str, repo_id: str, out_dir, patterns: list[str]) -> str:
    """The local directory of ``repo_id``'s files matching ``patterns`` (downloaded, or the
    cached copy), or one line saying why not and what to do instead."""
    from huggingface_hub import snapshot_download

    offline = _hub_offline()
    try:
        return snapshot_download(repo_id, allow_patterns=patterns, local_files_only=offline)
    except Exception as e:  # no connection, DNS, timeouts, offline mode without a cached copy
        why = "HF_HUB_OFFLINE is set and no copy is cached" if offline else type(e).__name__
        if type(e).__name__ == "GatedRepoError":
            why = "a gated repository: accept its licence on the Hub and log in, `hf auth login`"
        raise GptkilnError(
            f"downloading {name} from the Hugging Face Hub failed ({why}): it needs internet; "
            f"with a local copy of {repo_id} (config.json + model.safetensors) run "
            f"`gptkiln convert hf DIR --out {out_dir}`"
        ) from None
