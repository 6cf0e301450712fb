"""Type checks shared by the config classes: each field's value against its annotation, and a
mapping (JSON, YAML) read into a config class naming the key it does not have.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import os
import re
import types
import typing
from typing import Any, Literal

from gptkiln.errors import GptkilnError


def _check_seed(seed: int) -> None:
    if not 0 <= seed < 2**63:  # what torch's generators take
        raise GptkilnError(f"seed must be a whole number in [0, 2**63), got {seed!r}")


def check_values(cls, values: dict[str, Any], where: str) -> dict[str, Any]:
    """``values`` for the fields of config class ``cls``, each checked against its field's type;
    `GptkilnError` naming ``where`` for an unknown key or a value of the wrong kind.

    A float field takes any number, and a string written as a plain number: YAML 1.1 (PyYAML)
    reads ``lr: 1e-3`` as the string ``"1e-3"``. Int fields take whole numbers, bool fields true or
    false, text fields text; ``None`` only where the field allows it. Ranges are the classes'
    own checks.
    """
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise GptkilnError(
            f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    hints = _type_hints(cls)
    return {name: _checked(hints[name], v, f"{where}: {name}") for name, v in values.items()}


@functools.cache
def _type_hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # evaluates the string annotations: once per class


def _checked(hint: Any, value: Any, label: str) -> Any:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
        args = typing.get_args(hint)
    if typing.get_origin(hint) is Literal:
        hint = type(args[0])
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise GptkilnError(f"{label} must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
        raise GptkilnError(f"{label} must be a whole number, got {value!r}")
    if hint is float:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _YAML_FLOAT.fullmatch(value):
            return float(value)
        raise GptkilnError(f"{label} must be a number, got {value!r}")
    if hint is str and isinstance(value, os.PathLike):  # data=Path(...), out=Path(...)
        return os.fspath(value)
    if hint is str and not isinstance(value, str):
        raise GptkilnError(f"{label} must be text, got {value!r}")
    return value


_YAML_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
"""A number as YAML 1.2 writes it, e.g. ``1e-3``, which PyYAML (YAML 1.1) leaves a string."""


def _check_types(config, what: str) -> None:
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    for name, value in check_values(type(config), values, what).items():
        object.__setattr__(config, name, value)


def _from_dict(cls, values: dict[str, Any], what: str):
    """Build a config dataclass from a mapping (JSON, YAML), naming a key it does not have."""
    return cls(**check_values(cls, values, what))


def _positive_int(name: str, value: int) -> None:
    if value < 1:
        raise GptkilnError(f"{name} must be a whole number >= 1, got {value!r}")
