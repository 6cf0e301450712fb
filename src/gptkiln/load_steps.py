"""Steps the features above `gptkiln.loading` add to every load of a run, by config.json entry.

A run's config.json can hold an entry written by a feature that changes the model its weights
build: a LoRA run (``"finetune": {"lora": {...}}``, `gptkiln.finetune.lora`) stores its frozen
base in model.safetensors and its adapters beside it, to be merged in. Loading sits below every
feature and imports none of them, so a feature's step is registered here under the entry it
reads, and `gptkiln.loading.load_model` runs each registered step whose entry a run's
config.json holds, on the model built from the run's weights (on the CPU, in the stored dtype),
before moving it to its device.

The package's ``__init__`` (`gptkiln`) registers the steps. Python runs it before any module of
the package, so no code can load a run before its steps are registered: a LoRA run never loads
without its adapters. This module imports nothing of gptkiln's (``import gptkiln`` reads it and
must not import torch).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gptkiln.model import GPT

# (model built from the run's weights, the run's config.json entry, the run directory) -> model
LoadStep = Callable[["GPT", Any, Path], "GPT"]

_STEPS: dict[str, LoadStep] = {}


def register(entry: str, step: LoadStep) -> None:
    """Run ``step(model, config_json[entry], run_dir)`` in every load of a run whose config.json
    holds ``entry`` (and not null), its result the loaded model. One step an entry: another
    function for an entry that has one is refused (registering the same one again is not)."""
    known = _STEPS.get(entry)
    if known is not None and _name(known) != _name(step):
        raise ValueError(f"config.json entry {entry!r} has a load step already: {_name(known)}")
    _STEPS[entry] = step


def steps_for(run_config: Mapping[str, Any]) -> list[tuple[str, LoadStep]]:
    """(entry, step) for each registered step whose entry ``run_config`` (a run's parsed
    config.json) holds, in the order they were registered."""
    return [(entry, step) for entry, step in _STEPS.items() if run_config.get(entry) is not None]


def registered() -> dict[str, LoadStep]:
    """Entry -> step, every one registered (a copy)."""
    return dict(_STEPS)


def _name(step: LoadStep) -> str:
    return f"{getattr(step, '__module__', '?')}.{getattr(step, '__qualname__', repr(step))}"
