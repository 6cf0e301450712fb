"""What a sequence is and what it hears back: a `Sequence` (one choice to generate) goes to
the `batcher.Batcher`, and its tokens, its prompt's scores and its end come back to the request
handler as events on its queue (`Token`, `PromptLogprobs`, `Done`, `Failed`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from gptkiln.config import SampleConfig
from gptkiln.serve.constrain import Constraint


@dataclass
class TokenLogprobs:
    """The log-probability of a chosen token and its ``k`` most likely alternatives."""

    logprob: float
    top: list[tuple[int, float]]  # (id, log-probability), most likely first


@dataclass
class Token:
    """A new token of choice ``index``; ``text`` is the text it made final ("" while a
    character or a possible stop string is incomplete)."""

    index: int
    id: int
    text: str
    logprobs: TokenLogprobs | None = None


@dataclass
class PromptLogprobs:
    """The prompt's tokens scored (echo with logprobs): None for the first, which has no
    context."""

    index: int
    entries: list[TokenLogprobs | None]


@dataclass
class Done:
    """Choice ``index`` ended: ``text`` is what was still held back, ``tokens`` how many it
    generated, ``reason`` ``"stop"`` (end-of-text or a stop string) or ``"length"``."""

    index: int
    reason: str
    text: str
    tokens: int


@dataclass
class Failed:
    """Choice ``index`` could not be finished (the model failed, or the server is closing)."""

    index: int
    message: str


Event = Token | PromptLogprobs | Done | Failed


@dataclass(eq=False)
class Sequence:
    """One choice to generate.

    Attributes:
        prompt: its token ids (prompt plus ``cfg.max_new_tokens`` must fit the context).
        cfg: how its tokens are chosen and when it ends (seed, stop strings, penalties).
        events: where its `Token`, `PromptLogprobs`, `Done` or `Failed` events go (a request's
            choices may share one queue).
        index: the choice's index in its request.
        logprobs: how many alternatives to report with each token (None: no log-probabilities).
        prompt_logprobs: also score the prompt's tokens.
        constraint: the grammar its tokens must follow (`constrain.Constraint`), a mask on its
            row's logits at each step; None: free text. It ends (``stop``) when the grammar is
            complete.
        cancelled: set by the handler when its client went away; the slot is freed at the next
            step.
        cached: the prompt's tokens the prefix cache held (set at its prefill, for ``usage``).
        submitted, first_token_at, last_token_at: when it was submitted and its first and
            latest tokens were handed out (`time.perf_counter`; for metrics and ``timings``).
    """

    prompt: list[int]
    cfg: SampleConfig
    events: asyncio.Queue
    index: int = 0
    logprobs: int | None = None
    prompt_logprobs: bool = False
    constraint: Constraint | None = None
    cancelled: bool = False
    cached: int = 0
    submitted: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
