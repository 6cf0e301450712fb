"""LoRA with the `peft` library: low-rank adapters on a GPT's linear layers, the base frozen.

Each adapted layer ``W`` (out x in) computes ``W x + (alpha / r) B A x`` with ``A`` (r x in) and
``B`` (out x r), A drawn as nn.Linear draws weights and B zero, so training starts from the
base model exactly (Hu et al. 2021, https://arxiv.org/abs/2106.09685; the book's appendix E).
The adapters go on every block's attention and MLP projections, named per family by
`gptkiln.model.block_linears` (GPT-2's ``attn.c_attn``, ``attn.c_proj``, ``mlp.c_fc``,
``mlp.c_proj``; Llama's and Qwen's ``attn.q_proj/k_proj/v_proj/o_proj`` and
``mlp.gate_proj/up_proj/down_proj``) and, when asked, on the head.

Llama and Qwen already have a layer per query, key and value projection: there an adapter on
each is the book's placement (``qkv="split"``), and ``"fused"`` has nothing to fuse, so it is
refused.

gptkiln's query, key and value projections are one fused layer, ``c_attn`` (3C x C), where the
book has three (``W_query``, ``W_key``, ``W_value``). Two placements:

- ``qkv="split"`` (the book's): one rank-r adapter per query, key and value block. That is a
  rank-3r adapter on ``c_attn`` whose ``B`` is block-diagonal, ``B = diag(B_q, B_k, B_v)``, so
  that block i of the output sees only its own r ranks of ``A x``: peft's BD-LoRA
  (``BdLoraConfig``, LoRA-B block-diagonal, 3 blocks) with rank 3r and alpha 3 x alpha on
  ``c_attn``, which keeps each block's scale at alpha / r. Parameters a layer:
  3r x C (A) + 3C x r (B) = 6rC, what three separate adapters have.
- ``qkv="fused"`` (Hugging Face's, whose GPT-2 fuses them too): one rank-r adapter on
  ``c_attn``: r x C + 3C x r = 4rC.

Counts for the whole model (`lora_parameter_count`), L blocks of width C, rank r, H head
outputs (vocabulary or classes) when the head is adapted:
split: L x (6rC + 2rC + 5rC + 5rC) = 18 r C L (+ r (C + H));
fused: L x (4rC + 2rC + 5rC + 5rC) = 16 r C L (+ r (C + H)).
GPT-2 124M (C 768, L 12), r 16, a 2-class head: 2,654,208 + 12,320 = 2,666,528 split (the
book's figure), 2,359,296 + 12,320 = 2,371,616 fused.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from gptkiln.checkpoint import ADAPTER_FILE
from gptkiln.config import GPTConfig
from gptkiln.errors import GptkilnError
from gptkiln.loading import CONFIG_FILE, read_safetensors
from gptkiln.model import GPT, block_linears
from gptkiln.quantize import quantization_of

__all__ = [
    "ADAPTER_FILE",
    "LoraSpec",
    "add_lora",
    "load_adapters",
    "lora_parameter_count",
    "merge_run_adapters",
]
QKV = 3  # query, key and value: the row blocks of c_attn


@dataclass(frozen=True)
class LoraSpec:
    """Where the adapters go and how large they are.

    Attributes:
        rank: r, the rank of each adapter (of each query / key / value block with ``"split"``).
        alpha: the adapters' output is scaled by alpha / r (peft's convention; the book's
            appendix E multiplies by alpha alone, so its alpha 16 at rank 16 is alpha 256 here).
        qkv: ``"split"``, an adapter per query, key and value block of ``c_attn`` (the book's
            placement), or ``"fused"``, one on ``c_attn`` (Hugging Face's).
        head: also adapt the output head (``lm_head``, or a classifier's ``score``).
    """

    rank: int
    alpha: float
    qkv: Literal["split", "fused"] = "split"
    head: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise GptkilnError(f"lora rank must be a whole number >= 1, got {self.rank!r}")
        if not 0 < self.alpha < float("inf"):
            raise GptkilnError(f"lora alpha must be a number > 0, got {self.alpha!r}")
        if self.qkv not in ("split", "fused"):
            raise GptkilnError(f"lora qkv placement must be 'split' or 'fused', got {self.qkv!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> LoraSpec:
        return cls(**values)


def import_peft():
    """``import peft``, without the lines its optional dependencies log on import (torchao's
    unloadable CUDA kernels, torch's pytree notices): they are no news to a person fine-tuning."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        import peft
    finally:
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)
    return peft


def head_name(config: GPTConfig) -> str:
    return "score" if config.num_classes else "lm_head"


def peft_config(spec: LoraSpec, config: GPTConfig):
    """The ``peft.LoraConfig`` of ``spec`` for a GPT of ``config``."""
    peft = import_peft()
    check_family(spec, config)
    names = "|".join(name.replace(".", r"\.") for name in block_linears(config))
    target = rf"h\.\d+\.({names})"
    if spec.head:
        target += f"|{head_name(config)}"
    options: dict[str, Any] = {}
    if spec.qkv == "split" and config.family == "gpt2":  # q, k, v fused in c_attn
        qkv = r"h\.\d+\.attn\.c_attn"
        options = dict(
            rank_pattern={qkv: QKV * spec.rank},
            alpha_pattern={qkv: QKV * spec.alpha},
            use_bdlora=peft.tuners.lora.BdLoraConfig(
                target_modules_bd_b=["attn.c_attn"], nblocks=QKV, match_strict=False
            ),
        )
    return peft.LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=target,
        lora_dropout=0.0,
        bias="none",
        **options,
    )


def check_family(spec: LoraSpec, config: GPTConfig) -> None:
    """Refuse ``qkv="fused"`` for a family whose query, key and value are separate layers."""
    if spec.qkv == "fused" and config.family != "gpt2":
        raise GptkilnError(
            f"--lora-qkv fused: a {config.family} model has separate q_proj, k_proj and v_proj "
            "layers, nothing to fuse; use --lora-qkv split (an adapter on each)"
        )


def add_lora(model: GPT, spec: LoraSpec):
    """Put adapters into ``model`` in place (it stays a `GPT`) and freeze everything else.

    Returns:
        peft's ``LoraModel`` around it (``.model`` is the same GPT): keep it to merge.
    """
    if spec.head and model.config.tie_embeddings:
        raise GptkilnError(
            "--lora-head: this model's head shares its weights with the token embedding "
            "(tie_embeddings), so an adapter merged into it would change the embedding too; "
            "drop --lora-head"
        )
    peft = import_peft()
    return peft.tuners.lora.LoraModel(model, peft_config(spec, model.config), "default")


def merge_lora(tuner) -> GPT:
    """The GPT with its adapters added into the weights and the LoRA layers taken out."""
    return tuner.merge_and_unload()


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that train, by their names in the model: a LoRA run's adapter file."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def lora_parameter_count(config: GPTConfig, spec: LoraSpec) -> int:
    """Adapter parameters for a GPT of ``config``, by the formulas of this module's docstring."""
    C, L, r = config.n_embd, config.n_layer, spec.rank
    head_out = config.num_classes or config.vocab_rows  # a padded head's rows too
    head = r * (C + head_out) if spec.head else 0
    if config.family != "gpt2":  # an adapter of r x (in + out) on each of the seven layers
        check_family(spec, config)
        Q, KV, hidden = (
            config.n_head * config.head_size,
            config.kv_heads * config.head_size,
            config.mlp_size,
        )
        attn = r * (C + Q) + 2 * r * (C + KV) + r * (Q + C)  # q, k, v, o
        return L * (attn + 2 * r * (C + hidden) + r * (hidden + C)) + head  # + gate, up, down
    qkv = (QKV * r * C + QKV * C * r) if spec.qkv == "split" else (r * C + QKV * C * r)
    per_block = qkv + 2 * r * C + 5 * r * C + 5 * r * C  # c_attn, c_proj, c_fc, mlp.c_proj
    return L * per_block + head


def load_adapters(model: GPT, spec: LoraSpec, adapters: dict[str, torch.Tensor], source: str):
    """``model`` with adapters of ``spec`` holding the tensors ``adapters`` (a LoRA run's file),
    merged into its weights: a plain GPT again."""
    tuner = add_lora(model, spec)
    expected = {n for n, p in model.named_parameters() if "lora_" in n}
    given = set(adapters)
    missing, unexpected = sorted(expected - given), sorted(given - set(model.state_dict()))
    if missing or unexpected:
        what = "; ".join(
            f"{label} {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
            for label, names in (("missing", missing), ("unexpected", unexpected))
            if names
        )
        raise GptkilnError(
            f"{source} does not hold this run's adapters ({what}); restore the file from the run"
        )
    model.load_state_dict(adapters, strict=False)
    return merge_lora(tuner)


def merge_run_adapters(model: GPT, finetune: Any, run_dir: Path) -> GPT:
    """The model of a fine-tuned run as it was trained, from ``model``, the one its
    model.safetensors holds: for a LoRA run (a ``"lora"`` setting in ``finetune``, its
    config.json's ``"finetune"`` entry) that frozen base with the run's adapters
    (adapter.safetensors) merged into its weights; any other fine-tuned run's as it is.

    This is the load step of the ``"finetune"`` entry (`gptkiln.load_steps`), which every
    `gptkiln.loading.load_model` of a fine-tuned run runs, so each command that loads a LoRA
    run gets its adapters merged.
    """
    if not finetune:
        return model
    if not isinstance(finetune, dict):
        raise GptkilnError(f"{run_dir / CONFIG_FILE}: 'finetune' is {finetune!r}; restore it")
    lora = finetune.get("lora")
    if not lora:
        return model
    path = run_dir / ADAPTER_FILE
    if not path.is_file():
        raise GptkilnError(
            f"{run_dir} is a LoRA run without its {ADAPTER_FILE}; restore the file, or train "
            "the run again"
        )
    if not isinstance(lora, dict):
        raise GptkilnError(f"{run_dir / CONFIG_FILE}: 'finetune.lora' is {lora!r}; restore it")
    try:
        spec = LoraSpec.from_dict(lora)
    except TypeError:
        raise GptkilnError(
            f"{run_dir / CONFIG_FILE}: 'finetune.lora' is not a LoRA setting ({lora!r}); "
            "restore the file"
        ) from None
    if quantization_of(model) is not None:
        raise GptkilnError(
            f"{run_dir / CONFIG_FILE} records quantization, but a LoRA run's base is float "
            "(convert quantize merges the adapters first); restore the file"
        )
    return load_adapters(model, spec, read_safetensors(path), str(path))
