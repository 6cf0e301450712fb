"""A request's values, checked: its prompts encoded (or its messages rendered in the run's
template), its sampling fields turned into a `SampleConfig` that fits the model's context, and
the fields this server does not honour refused. Every problem is a 400 naming the field
(`schemas.OpenAIError`)."""

from __future__ import annotations

import json
from typing import Any

from gptkiln.chat_template import ChatTemplate, is_chat_template
from gptkiln.config import SampleConfig
from gptkiln.errors import GptkilnError
from gptkiln.finetune.templates import PromptTemplate, format_messages
from gptkiln.serve.schemas import (
    MAX_SEED,
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    OpenAIError,
)
from gptkiln.tokenizers import encode_prompt


def unknown_model(name: str, served: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"model {name!r} is not served here; this server serves {served!r} (GET /v1/models)",
        param="model",
        code="model_not_found",
    )


def prompt_ids(prompt: Any, tokenizer: Any, vocab_size: int) -> list[tuple[str, list[int]]]:
    """Each prompt as (its text, its ids): a string or a list of strings is encoded (an empty
    string is the end-of-text token), a list of ids (or of lists) is taken as ids."""
    if isinstance(prompt, list) and not prompt:
        raise OpenAIError(400, "prompt is an empty list; give a string or token ids", "prompt")
    many = isinstance(prompt, list) and not isinstance(prompt[0], int)
    out = []
    for i, item in enumerate(prompt if many else [prompt]):
        where = f"prompt[{i}]" if many else "prompt"
        if isinstance(item, str):
            try:
                item.encode("utf-8")
                ids = encode_prompt(tokenizer, item)
            except UnicodeEncodeError:
                raise OpenAIError(
                    400, f"{where} is not valid Unicode text (a lone surrogate)", "prompt"
                ) from None
            except GptkilnError as e:
                raise OpenAIError(400, f"{where}: {e}", "prompt") from None
            out.append((item, ids))
            continue
        if not item:
            raise OpenAIError(400, f"{where} has no token ids; give at least one", "prompt")
        bad = [t for t in item if not 0 <= t < vocab_size]
        if bad:
            raise OpenAIError(
                400,
                f"{where} has token id {bad[0]}, outside the vocabulary 0..{vocab_size - 1}",
                "prompt",
            )
        out.append((tokenizer.decode(item), list(item)))
    return out


def chat_prompt(
    template: PromptTemplate | ChatTemplate, messages: list[ChatMessage], tokenizer: Any
) -> list[tuple[str, list[int]]]:
    """The one prompt of a chat request, as (its text, its ids): the messages in the run's
    template (`finetune.templates.format_messages`, as ``gptkiln chat`` formats them)."""
    try:
        text = format_messages(template, [m.model_dump() for m in messages])
    except GptkilnError as e:
        raise OpenAIError(400, str(e), "messages") from None
    try:
        text.encode("utf-8")
        templated = is_chat_template(template)  # a model's own template holds its specials
        return [(text, encode_prompt(tokenizer, text, templated=templated))]
    except UnicodeEncodeError:
        raise OpenAIError(
            400, "messages: a content is not valid Unicode text (a lone surrogate)", "messages"
        ) from None
    except GptkilnError as e:
        raise OpenAIError(400, f"messages: {e}", "messages") from None


def chat_max_tokens(req: ChatCompletionRequest) -> int | None:
    """``max_completion_tokens`` (OpenAI's newer name) or ``max_tokens``: one budget."""
    new, old = req.max_completion_tokens, req.max_tokens
    if new is not None and old is not None and new != old:
        raise OpenAIError(
            400,
            f"max_completion_tokens {new} and max_tokens {old} disagree; they name the same "
            "budget: send one of them",
            "max_completion_tokens",
        )
    return old if new is None else new


def refuse_unsupported(req: CompletionRequest) -> None:
    """A 400 for the completion fields this server does not honour, rather than ignoring them."""
    for name, value, allowed in (
        ("suffix", req.suffix, None),
        ("logit_bias", req.logit_bias, None),
        ("best_of", req.best_of, req.n),
    ):
        if value and value != allowed:
            raise OpenAIError(
                400,
                f"{name} is not supported by this server (got {json.dumps(value)[:80]}); "
                "leave it out",
                name,
            )


def sample_config(
    req: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    context: int,
    *,
    extra_stop: tuple[str, ...] = (),
    source: str = "prompt",
) -> SampleConfig:
    """The request's `SampleConfig`, once every prompt and its new tokens fit the context.

    Args:
        req: the parsed request (its ``max_tokens``, sampling fields and ``stop``).
        prompts: the ids of each prompt.
        context: the model's context length.
        extra_stop: stop strings added to the request's own (a template's headers).
        source: the request field the prompts came from, named in a too-long error.
    """
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS or not all(stop):
        raise OpenAIError(
            400,
            f"stop takes up to {MAX_STOP_STRINGS} non-empty strings, got {len(stop)}: "
            f"{json.dumps(stop)[:200]}",
            "stop",
        )
    longest = max(len(ids) for ids in prompts)
    if longest > context:
        raise OpenAIError(
            400,
            f"the prompt has {longest} tokens, more than the model's context of {context}; it "
            f"would have to be cropped, which this server does not do: shorten the {source}",
            source,
            code="context_length_exceeded",
        )
    new = context - longest if req.max_tokens is None else req.max_tokens
    if longest + new > context:
        raise OpenAIError(
            400,
            f"the prompt's {longest} tokens plus max_tokens {new} exceed the model's context of "
            f"{context}; lower max_tokens to at most {context - longest} or shorten the {source}",
            "max_tokens",
            code="context_length_exceeded",
        )
    try:
        return SampleConfig(
            max_new_tokens=new,
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            seed=req.seed,
            stop=tuple(dict.fromkeys([*stop, *extra_stop])),
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
        )
    except GptkilnError as e:
        raise OpenAIError(400, str(e)) from None


def nth_sample(cfg: SampleConfig, j: int) -> SampleConfig:
    """The j-th sample of a prompt draws with seed + j: sample 0 is the prompt run alone."""
    if cfg.seed is None or j == 0:
        return cfg
    return SampleConfig(**{**cfg.__dict__, "seed": (cfg.seed + j) % (MAX_SEED + 1)})
