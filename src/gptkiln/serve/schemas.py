"""The OpenAI request and response shapes the server speaks (pydantic), and its errors.

Requests are validated strictly: a field of the wrong JSON type, out of range or unknown is a
400 whose message names the field (OpenAI's ``param``), never a guess (``"5"`` is not 5).
Responses follow OpenAI's legacy completions API (``text_completion`` objects, server-sent
``data:`` chunks) and its chat completions API (``chat.completion`` objects and
``chat.completion.chunk`` deltas), so its official clients read them unchanged.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_LOGPROBS = 20
MAX_N = 16
MAX_SEED = 2**63 - 1  # what torch's generators take
MAX_INSPECT_TOKENS = 64  # a heat-map's rows and columns: every layer and head is sent at once
MAX_INSPECT_CHARS = 10_000  # the prompt /v1/inspect encodes (only its first tokens are kept)

TokenIds = list[int]


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

    Args:
        status: the HTTP status (400 a bad value, 401 a missing key, 404 an unknown model, 413
            a body over the limit, 429 a full queue, 500 the server's own failure).
        message: what was wrong and what to do, naming the field.
        param: the request field at fault, or None.
        code: OpenAI's machine-readable code (``invalid_api_key``, ``model_not_found`` ...).
    """

    TYPES = {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error"}

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = self.TYPES.get(self.status, "server_error" if self.status >= 500 else None)
        return {
            "error": {
                "message": self.message,
                "type": kind or "invalid_request_error",
                "param": self.param,
                "code": self.code,
            }
        }


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


def _finite(default: float, low: float, high: float, *, gt: bool = False) -> Any:
    bounds = {"gt": low} if gt else {"ge": low}
    return Field(default, le=high, allow_inf_nan=False, **bounds)


class CompletionRequest(BaseModel):
    """``POST /v1/completions``: OpenAI's fields, their defaults and ranges; ``top_k`` added."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: Union[str, list[str], TokenIds, list[TokenIds]]  # noqa: UP007 (pydantic's order)
    model: str | None = None
    max_tokens: int | None = Field(16, ge=0)
    temperature: float = _finite(1.0, 0.0, 2.0)
    top_p: float = _finite(1.0, 0.0, 1.0, gt=True)
    top_k: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    presence_penalty: float = _finite(0.0, -2.0, 2.0)
    frequency_penalty: float = _finite(0.0, -2.0, 2.0)
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class ChatMessage(BaseModel):
    """One of a chat request's ``messages``; its role and order are checked by
    `finetune.templates.format_messages`. ``name`` (OpenAI's participant name) is not used."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: str
    content: str
    name: str | None = None


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions``: OpenAI's fields for text chat, ``top_k`` added. Without
    ``max_tokens`` (or its newer name ``max_completion_tokens``) the answer may fill the
    context, as OpenAI's does."""

    model_config = ConfigDict(extra="forbid", strict=True)

    messages: list[ChatMessage]
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    temperature: float = _finite(1.0, 0.0, 2.0)
    top_p: float = _finite(1.0, 0.0, 1.0, gt=True)
    top_k: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    presence_penalty: float = _finite(0.0, -2.0, 2.0)
    frequency_penalty: float = _finite(0.0, -2.0, 2.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class InspectRequest(BaseModel):
    """``POST /v1/inspect`` (gptkiln's own): a prompt seen through the model (`gptkiln.inspect`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(max_length=MAX_INSPECT_CHARS)
    model: str | None = None
    top_k: int = Field(5, ge=1, le=MAX_LOGPROBS)
    max_tokens: int = Field(32, ge=1, le=MAX_INSPECT_TOKENS)


class TokenizeRequest(BaseModel):
    """``POST /v1/tokenize`` (gptkiln's own, answered in the shape of vLLM's ``/tokenize``): how
    many tokens a prompt, or chat messages in the run's template, take of the context. The page
    sizes and checks its fields by it before it sends a request."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    model: str | None = None


# What each field holds, for a type error's message (pydantic's own lists every union member).
FIELD_KINDS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of such lists",
    "model": "a string",
    "max_tokens": "a whole number >= 0",
    "temperature": "a number in [0, 2]",
    "top_p": "a number in (0, 1]",
    "top_k": "a whole number >= 1",
    "seed": f"a whole number in [0, {MAX_SEED}]",
    "stop": f"a string or a list of up to {MAX_STOP_STRINGS} strings",
    "presence_penalty": "a number in [-2, 2]",
    "frequency_penalty": "a number in [-2, 2]",
    "n": f"a whole number in [1, {MAX_N}]",
    "best_of": f"a whole number in [1, {MAX_N}] equal to n",
    "echo": "true or false",
    "logprobs": f"a whole number in [0, {MAX_LOGPROBS}]",
    "stream": "true or false",
    "stream_options": 'an object such as {"include_usage": true}',
    "suffix": "null (not supported)",
    "logit_bias": "null (not supported)",
    "user": "a string",
}
CHAT_FIELD_KINDS = {
    "messages": "a list of objects {role, content}",
    "messages.role": "one of system, user, assistant",
    "messages.content": "text (a string)",
    "messages.name": "a string",
    "model": "a string",
    "max_tokens": "a whole number >= 0",
    "max_completion_tokens": "a whole number >= 0",
    **{
        name: FIELD_KINDS[name]
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "seed",
            "stop",
            "presence_penalty",
            "frequency_penalty",
            "n",
            "stream",
            "stream_options",
            "user",
        )
    },
}
INSPECT_FIELD_KINDS = {
    "prompt": f"a string of at most {MAX_INSPECT_CHARS:,} characters",
    "model": "a string",
    "top_k": f"a whole number in [1, {MAX_LOGPROBS}]",
    "max_tokens": f"a whole number in [1, {MAX_INSPECT_TOKENS}] (the tokens inspected)",
}

TOKENIZE_FIELD_KINDS = {
    "prompt": "a string",
    "messages": CHAT_FIELD_KINDS["messages"],
    "messages.role": CHAT_FIELD_KINDS["messages.role"],
    "messages.content": CHAT_FIELD_KINDS["messages.content"],
    "messages.name": "a string",
    "model": "a string",
}


def parse_request(model: type[BaseModel], body: bytes) -> Any:
    """Validate a JSON body as ``model``; any problem is a 400 naming the first bad field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        kinds = {
            InspectRequest: INSPECT_FIELD_KINDS,
            ChatCompletionRequest: CHAT_FIELD_KINDS,
            TokenizeRequest: TOKENIZE_FIELD_KINDS,
        }
        raise validation_error(e, kinds.get(model, FIELD_KINDS)) from None


def validation_error(error: ValidationError, kinds: dict[str, str] = FIELD_KINDS) -> OpenAIError:
    """One 400 for pydantic's first error: which field, what it must be (``kinds``), what it
    got."""
    first = error.errors(include_url=False)[0]
    loc = [str(part) for part in first["loc"]]
    kind = first["type"]
    if kind == "json_invalid":
        return OpenAIError(
            400,
            f"the body is not valid JSON ({first['msg'].removeprefix('Invalid JSON: ')}); send a "
            "JSON object in UTF-8",
            code="invalid_json",
        )
    if not loc:
        return OpenAIError(400, f"the body must be a JSON object ({first['msg']})")
    field, where, kind_of = loc[0], loc[0], loc[0]
    if len(loc) >= 3 and loc[1].isdigit():  # a field of a list's object: messages[1].content
        where = f"{field}[{loc[1]}].{'.'.join(loc[2:])}"
        kind_of = f"{field}.{loc[2]}"
    if kind == "extra_forbidden":
        path = ".".join(loc) if where == field else where
        known = [k for k in kinds if "." not in k]
        if where != field:
            known = [k.split(".", 1)[1] for k in kinds if k.startswith(f"{field}.")]
        return OpenAIError(
            400,
            f"unknown field {path!r}; the fields are: {', '.join(known)}",
            param=path,
            code="unknown_field",
        )
    if kind == "missing":
        return OpenAIError(400, f"{where} is required", param=where, code="missing_field")
    got = first.get("input")
    shown = json.dumps(got)[:80] if _jsonable(got) else type(got).__name__
    what = kinds.get(kind_of, kinds.get(field, "a valid value"))
    return OpenAIError(
        400, f"{where} must be {what}, got {shown}", param=where, code="invalid_value"
    )


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


# -- responses -------------------------------------------------------------------------------
class Logprobs(BaseModel):
    """OpenAI's legacy logprobs, with each token's id and its alternatives' ids added."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    token_ids: list[int] = []
    top_token_ids: list[list[int] | None] = []


class Choice(BaseModel):
    text: str
    index: int
    logprobs: Logprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Completion(BaseModel):
    """A ``text_completion``: the whole answer, or one chunk of a stream (no usage)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None


class ChatReply(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatReply
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    """A ``chat.completion``: the whole answer to a chat request."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatChunkChoice(BaseModel):
    """One choice's piece of a stream: ``delta`` is ``{"role": "assistant"}`` first, then
    ``{"content": text}`` pieces, then ``{}`` with the finish_reason."""

    index: int
    delta: dict[str, str]
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    """A ``chat.completion.chunk``: one server-sent event of a streamed chat answer (the last,
    when asked for, has no choices and the usage)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "gptkiln"
    context_length: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
