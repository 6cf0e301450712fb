"""Settings that would do nothing, refused rather than ignored: one that acts only under another
choice of the run's (`ONLY_WITH`), and one that prepared data already fixed (its tokenizer, its
split, the field its text came from).

A `TrainConfig` cannot tell a value someone set from its default, so from Python a setting is
taken as set when it differs from its default; a default that clashes with prepared data takes
the data's value, so that config.json records what the run used. The CLI, which knows which
settings came from a flag, refuses the flags with their names first, and gives a recipe's clashes
a note and the data's values (`gptkiln.cli.train`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from gptkiln.config import TrainConfig
from gptkiln.errors import GptkilnError

# Settings that act only under one choice of another: (setting, the choice's setting, value).
ONLY_WITH = [
    ("muon_momentum", "optimizer", "muon"),
    ("adamw_lr", "optimizer", "muon"),
    ("embedding_lr", "optimizer", "muon"),
    ("cooldown", "schedule", "wsd"),
    ("cooldown", "decay_lr", True),
    ("stride", "sampling", "windows"),
]
# More, refused as flags (`gptkiln.cli.train`) but not from Python, where a value off
# `TrainConfig`'s default is taken as set: fine-tuning's own defaults (a constant rate with
# min_lr 0, epochs 2 that a max_steps overrides) would read as set.
FLAG_ONLY_WITH = [
    ("min_lr", "decay_lr", True),
    ("epochs", "max_steps", 0),
]


def default_of(name: str) -> Any:
    """The default of a `TrainConfig` setting."""
    return next(f.default for f in dataclasses.fields(TrainConfig) if f.name == name)


def idle_settings(cfg: TrainConfig) -> list[tuple[str, str, str]]:
    """The `ONLY_WITH` entries whose setting ``cfg`` has off its default while its choice is
    another: settings that would do nothing."""
    return [
        (name, choice, value)
        for name, choice, value in ONLY_WITH
        if getattr(cfg, choice) != value and getattr(cfg, name) != default_of(name)
    ]


def check_settings_act(cfg: TrainConfig) -> None:
    """Refuse a setting that would do nothing under the run's other choices (an ``adamw_lr``
    with ``optimizer="adamw"``, a ``cooldown`` with ``schedule="cosine"``)."""
    for name, choice, value in idle_settings(cfg):
        raise GptkilnError(
            f"{name}={getattr(cfg, name)!r} acts only with {choice}={value!r}, and this run has "
            f"{choice}={getattr(cfg, choice)!r}; leave {name} at its default "
            f"({default_of(name)!r}), or train with {choice}={value!r}"
        )


def prepared_clashes(cfg: TrainConfig, meta: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """The settings of ``cfg`` that prepared data (its ``meta.json``) contradicts, each as
    (setting, how the data was made, the data's own value). ``bpe`` alone agrees with a BPE of
    any size; ``bpe:N`` with one prepared as ``bpe:N`` (a small corpus can give fewer ids than
    N) or of N ids. A mixture records each member's field, so its field is no clash."""
    clashes = []
    if has := _tokenizer_clash(cfg.tokenizer, meta):
        clashes.append(("tokenizer", has, _spec_of(meta)))
    fraction = meta.get("val_fraction")
    if isinstance(fraction, (int, float)) and not math.isclose(
        cfg.val_fraction, fraction, rel_tol=1e-9
    ):
        clashes.append(("val_fraction", f"split with val_fraction {fraction}", fraction))
    field = meta.get("text_field", "text")  # prepare records it when not "text"
    if cfg.text_field != field and "mix" not in meta:
        clashes.append(("text_field", f"read from the field {field!r}", field))
    return clashes


def keep_prepared_settings(cfg: TrainConfig, meta: dict[str, Any]) -> None:
    """Training keeps prepared data as it was made: a setting of ``cfg`` left at its default
    that disagrees takes the data's value (config.json then records what the run used); one set
    to something else is refused."""
    clashes = prepared_clashes(cfg, meta)
    chosen = [c for c in clashes if getattr(cfg, c[0]) != default_of(c[0])]
    if chosen:
        asked = ", ".join(f"{name}={getattr(cfg, name)!r}" for name, _, _ in chosen)
        raise GptkilnError(
            f"{asked}: data {cfg.data} was {' and '.join(has for _, has, _ in chosen)}, which "
            "training keeps; leave those settings at their defaults to train on it as it is, "
            "or prepare the text again with them (gptkiln.data.prepare)"
        )
    for name, _, value in clashes:
        if value is not None:
            setattr(cfg, name, value)


def _spec_of(meta: dict[str, Any]) -> str | None:
    """The tokenizer setting that says how prepared data was tokenized, as a `TrainConfig`
    takes it (``gpt2``, ``char``, ``bpe:N``; a BPE made from a folder's tokenizer by its size);
    None for a kind no setting names (a Hugging Face tokenizer)."""
    from gptkiln.tokenizers import parse_tokenizer_spec

    made, spec = meta.get("tokenizer"), meta.get("tokenizer_spec")
    if made in ("gpt2", "char"):
        return made
    if made != "bpe":
        return None
    for candidate in (spec, f"bpe:{meta.get('vocab_size')}"):
        try:
            if isinstance(candidate, str) and parse_tokenizer_spec(candidate)[0] == "bpe":
                return candidate
        except GptkilnError:  # a folder's tokenizer: its spec is the folder
            continue
    return None


def _tokenizer_clash(asked: str, meta: dict[str, Any]) -> str | None:
    """How prepared data (its ``meta``) was tokenized, when a tokenizer spec disagrees; None
    when it agrees or the data does not say."""
    from gptkiln.tokenizers import parse_tokenizer_spec

    made, spec = meta.get("tokenizer"), meta.get("tokenizer_spec")
    if not isinstance(made, str):
        return None
    kind, size = parse_tokenizer_spec(asked)
    if made == "bpe":
        sizes = {meta.get("vocab_size")}
        try:
            sizes.add(parse_tokenizer_spec(spec)[1])  # the N asked for when prepared
        except GptkilnError:  # prepared with a run's tokenizer: the spec is its folder
            pass
        agrees = kind == "bpe" and (":" not in asked or size in sizes)
        made = f"a BPE tokenizer of {meta.get('vocab_size')} ids"
    else:
        agrees = kind == made
        made = f"the {made} tokenizer"
    return None if agrees else f"prepared with {made}"
