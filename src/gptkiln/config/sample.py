"""Sampling settings (`SampleConfig`) and the checks a request's or a model's sampling passes
(`check_sampling`, `check_stop`, `check_logit_bias`); `model_sampling`, what a model directory's
generation_config.json asks for.

No torch import here, so the CLI can parse and validate flags before torch loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptkiln.config.checks import _check_seed, _check_types
from gptkiln.errors import GptkilnError


@dataclass
class SampleConfig:
    """How to pick each next token, and when a sequence ends.

    temperature 0 means greedy (argmax); top_k keeps the k most likely tokens; top_p keeps the
    smallest set whose probability reaches p (nucleus sampling). ``stop_at_eos`` ends a sequence
    at the tokenizer's end-of-text id; ``stop`` ends it where one of these strings appears in the
    generated text (the text returned stops right before it). ``presence_penalty`` and
    ``frequency_penalty`` are OpenAI's: each logit is lowered by ``frequency_penalty`` times the
    number of times its token was generated so far, and by ``presence_penalty`` once if it was
    generated at all (in [-2, 2]; negative values favour repeats). ``min_p`` drops the tokens
    less likely than ``min_p`` times the likeliest (after temperature, top-k and top-p: Nguyen
    et al. 2024, https://arxiv.org/abs/2407.01082; transformers' ``min_p`` and order; llama.cpp
    applies its temperature last, so its min-p keeps another set at a temperature other than 1).
    ``repetition_penalty`` is CTRL's (Keskar et al. 2019), as transformers and vLLM apply it:
    the logit of every token in the prompt or generated so far divided by it where positive,
    multiplied where negative (> 0; 1 = off; above 1 discourages repeats), before the presence
    and frequency penalties (llama.cpp's ``repeat_penalty`` counts the last 64 tokens only).
    ``skip_special_tokens``: the text leaves out the
    tokenizer's special tokens (a chat template's markers), as vLLM's ``skip_special_tokens``
    and transformers' ``decode(..., skip_special_tokens=True)``; the ids keep them (chat and
    the server's chat answers set it; ``generate`` shows every token, as the book's does).
    ``logit_bias``: OpenAI's, ``(token id, bias)`` pairs (or a dict of them), each bias in
    [-100, 100] added to its token's logit before the draw (-100 all but forbids it).
    """

    max_new_tokens: int = 100
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_at_eos: bool = True
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        _check_types(self, "sampling config")
        if self.top_k == 0:  # off, as transformers reads 0 (a model's own top-k set aside)
            self.top_k = None
        check_sampling(self.temperature, self.top_k, self.top_p, self.min_p)
        if self.seed is not None:
            _check_seed(self.seed)
        if self.max_new_tokens < 0:
            raise GptkilnError(
                f"max_new_tokens must be >= 0, got {self.max_new_tokens}; pass e.g. 100"
            )
        self.stop = check_stop(self.stop)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise GptkilnError(
                    f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}"
                )
        if not 0 < self.repetition_penalty < math.inf:
            raise GptkilnError(
                "repetition_penalty must be a finite number > 0 (1 = off; e.g. 1.1 discourages "
                f"repeats), got {self.repetition_penalty}"
            )

        self.logit_bias = check_logit_bias(self.logit_bias)

    @property
    def penalised(self) -> bool:
        """Whether a token's logit depends on the tokens before it (a penalty is set)."""
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1


MODEL_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
"""The `SampleConfig` fields a model's ``generation_config.json`` may set for it."""


def model_sampling(directory: str | Path) -> dict[str, Any]:
    """The sampling a model directory's ``generation_config.json`` asks for, as transformers
    reads it and vLLM takes it for the requests that do not say (Qwen3: temperature 0.6, top-k
    20, top-p 0.95): ``do_sample`` false is greedy (its repetition penalty still applies, as
    transformers applies it; vLLM reads no ``do_sample``); a setting that changes nothing (top-k 0,
    top-p 1, min-p 0, a repetition penalty of 1) or is no valid value is left out. {} where it
    has no such file."""
    import json

    try:
        config = json.loads((Path(directory) / "generation_config.json").read_text("utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    valid = {
        "temperature": lambda v: 0 <= v,
        "top_k": lambda v: v >= 1 and v == int(v),
        "top_p": lambda v: 0 < v < 1,
        "min_p": lambda v: 0 < v <= 1,
        "repetition_penalty": lambda v: 0 < v < math.inf and v != 1,
    }
    out: dict[str, Any] = {}
    for name, ok in valid.items():
        value = config.get(name)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and math.isfinite(value) and ok(value):
            out[name] = int(value) if name == "top_k" else float(value)
    if config.get("do_sample") is False:  # greedy, as transformers reads it: no draw to shape
        out = {"temperature": 0.0, **{k: v for k, v in out.items() if k == "repetition_penalty"}}
    elif config.get("do_sample") is True:  # sampled: at transformers' temperature 1 if unsaid
        out = {"temperature": 1.0, **out}
    return out


def sampling_said(settings: dict[str, Any], name=lambda field: field) -> str:
    """`model_sampling`'s settings in words, each field written as ``name`` gives it: a
    temperature of 0 is "greedy (do_sample false)", the others "FIELD VALUE"."""
    return ", ".join(
        "greedy (do_sample false)" if (k, v) == ("temperature", 0.0) else f"{name(k)} {v}"
        for k, v in settings.items()
    )


def check_logit_bias(bias: Any) -> tuple[tuple[int, float], ...]:
    """``(token id, bias)`` pairs, sorted by id, from pairs or a dict: ids whole numbers >= 0,
    biases finite numbers in [-100, 100] (OpenAI's range)."""
    pairs = bias.items() if isinstance(bias, dict) else bias
    try:
        pairs = [(i, b) for i, b in pairs]
    except (TypeError, ValueError):
        raise GptkilnError(
            f"logit_bias must map token ids to numbers, e.g. {{50256: -100}}, got {bias!r}"
        ) from None
    out = {}
    for i, b in pairs:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise GptkilnError(f"logit_bias: token id {i!r} is not a whole number >= 0")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise GptkilnError(
                f"logit_bias: the bias of token {i} must be in [-100, 100], got {b!r}"
            )
        out[i] = float(b)
    return tuple(sorted(out.items()))


def check_stop(stop: Any) -> tuple[str, ...]:
    """Stop strings as a tuple: one string or a list of them, each non-empty."""
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise GptkilnError(f"stop must be a list of non-empty strings, got {stop!r}")
    return tuple(stop)


def check_sampling(
    temperature: float, top_k: int | None, top_p: float | None, min_p: float | None = None
) -> None:
    """Raise `GptkilnError` for sampling settings that have no meaning."""
    if not 0 <= temperature < math.inf:
        raise GptkilnError(
            f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}"
        )
    if top_k is not None and top_k < 1:
        raise GptkilnError(f"top_k must be >= 1 (or 0 to keep all tokens), got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise GptkilnError(f"top_p must be in (0, 1] (1 keeps all tokens), got {top_p}")
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        raise GptkilnError(f"min_p must be in [0, 1] (0 keeps all tokens; e.g. 0.05), got {min_p}")
