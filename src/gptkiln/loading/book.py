"""The book's ``model.pth``: a state dict of its ``GPTModel`` (``torch.save(model.state_dict())``,
or its ``{"model_state_dict": ..., "optimizer_state_dict": ...}``).

The book's ``GPTModel`` names everything differently from gptkiln (``tok_emb``,
``trf_blocks.N.att.W_query``, ``norm1.scale`` ...) and keeps query, key and value as three
matrices that gptkiln stacks into ``c_attn``; its config is read off the shapes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from gptkiln.config import GPTConfig
from gptkiln.errors import GptkilnError
from gptkiln.loading.build import StoredModel
from gptkiln.loading.checks import check_state_dict
from gptkiln.loading.files import load_torch_file

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
_GPT2_HEADS = {768: 12, 1024: 16, 1280: 20, 1600: 25}  # GPT-2's heads at each width (124M-1558M)
_BOOK_STACKED = re.compile(r"^att\.(mask|(W_query|W_key|W_value)\.(weight|bias))$")  # handled apart


def read_book(path: str | os.PathLike, n_head: int | None = None) -> StoredModel:
    """The config and gptkiln weights of a ``model.pth`` saved from the book's ``GPTModel``,
    read with ``torch.load(weights_only=True)``; ``n_head`` as `book_state_dict_to_gptkiln`."""
    path = Path(path)
    sd = load_torch_file(path)
    if isinstance(sd, dict) and isinstance(sd.get("model_state_dict"), dict):
        sd = sd["model_state_dict"]
    if not isinstance(sd, dict):
        raise GptkilnError(
            f"{path} holds a {type(sd).__name__}, not a state dict; save the "
            f"book's model with torch.save(model.state_dict(), path)"
        )
    config, sd = book_state_dict_to_gptkiln(sd, n_head=n_head, source=str(path))
    return StoredModel(config, sd, str(path), [path])


def _tied(sd: Mapping[str, torch.Tensor]) -> bool:
    """Whether the head is the token embedding itself (one tensor, or one storage)."""
    head, embedding = sd.get("out_head.weight"), sd["tok_emb.weight"]
    if head is None or head.shape != embedding.shape:
        return False
    return head is embedding or (
        head.untyped_storage().data_ptr() == embedding.untyped_storage().data_ptr()
        and head.stride() == embedding.stride()
        and head.storage_offset() == embedding.storage_offset()
    )


def book_state_dict_to_gptkiln(
    sd: Mapping[str, torch.Tensor], n_head: int | None = None, source: str = "book state dict"
) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """Config and gptkiln weights from a state dict of the book's ``GPTModel``.

    The config is read off the shapes: vocab_size and n_embd from ``tok_emb``, context_length
    from ``pos_emb``, n_layer from the ``trf_blocks.N`` keys, qkv_bias from whether
    ``W_query.bias`` exists; the head is untied (``out_head`` is its own matrix), or tied where
    ``out_head.weight`` is ``tok_emb.weight`` itself (the book's weight-tying exercise). The
    number of heads leaves no trace in the shapes (heads are a reshape of the same matrices), so
    it is an argument: what the model was built with. None takes GPT-2's for the width (12 heads
    at 768, the book's GPT_CONFIG_124M; 16 at 1024, 20 at 1280, 25 at 1600) and refuses another
    width, whose heads cannot be guessed.
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
    if n_head is None:
        n_head = _GPT2_HEADS.get(n_embd)
        if n_head is None:
            raise GptkilnError(
                f"{source}: a model {n_embd} wide is none of GPT-2's sizes, and its file does not "
                "record its attention heads; pass the number it was built with (n_head=..., "
                "--n-head N; the book's cfg['n_heads'])"
            )
    if isinstance(n_head, bool) or not isinstance(n_head, int) or n_head < 1:
        raise GptkilnError(f"--n-head {n_head}: the attention heads, a whole number >= 1")
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
        tie_embeddings=_tied(sd),
    )
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if key == "out_head.weight" and config.tie_embeddings:
            continue  # the head is the embedding (the book's weight-tying exercise): kept once
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
