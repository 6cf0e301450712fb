"""The OpenAI request and response shapes the server speaks (pydantic), and its errors.

Requests are validated strictly: a field of the wrong JSON type, out of range or unknown is a
400 whose message names the field (OpenAI's ``param``), never a guess (``"5"`` is not 5).
Responses follow OpenAI's legacy completions API (``text_completion`` objects, server-sent
``data:`` chunks) and its chat completions API (``chat.completion`` objects and
``chat.completion.chunk`` deltas), so its official clients read them unchanged.
"""

from __future__ import annotations

import json
import typing
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

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
        headers: HTTP headers to answer with (a 429's ``Retry-After``).
    """

    TYPES = {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error"}

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

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


class Request(BaseModel):
    """A request's shape: a ``null`` given for a field that cannot hold one, but has a
    default, means the default, as OpenAI's spec makes such fields nullable (hand-written
    clients and agent frameworks send ``"temperature": null``). A field that can be null keeps
    its null (completions' ``max_tokens``: the rest of the context); a required one stays
    required."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if v is not None
            or k not in fields
            or fields[k].is_required()
            or _takes_null(fields[k].annotation)
        }


def _takes_null(annotation: Any) -> bool:
    return annotation is None or type(None) in typing.get_args(annotation)


class StreamOptions(Request):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


def _finite(default: float, low: float, high: float, *, gt: bool = False) -> Any:
    bounds = {"gt": low} if gt else {"ge": low}
    return Field(default, le=high, allow_inf_nan=False, **bounds)


class JsonSchemaFormat(Request):
    """``response_format.json_schema``: the schema an answer must follow. ``strict`` is taken
    and the schema is always enforced (a keyword the engine cannot enforce is a 400)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Request):
    """``response_format``: ``text`` (free), ``json_object`` (any JSON object) or
    ``json_schema`` (JSON valid against ``json_schema.schema``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class CompletionRequest(Request):
    """``POST /v1/completions``: OpenAI's fields, their defaults and ranges; vLLM's ``top_k``,
    ``min_p`` and ``repetition_penalty`` added."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: Union[str, list[str], TokenIds, list[TokenIds]]  # noqa: UP007 (pydantic's order)
    model: str | None = None
    max_tokens: int | None = Field(16, ge=0)
    temperature: float = _finite(1.0, 0.0, 2.0)
    top_p: float = _finite(1.0, 0.0, 1.0, gt=True)
    top_k: int | None = Field(None, ge=-1)  # 0 or -1: off (vLLM's)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    presence_penalty: float = _finite(0.0, -2.0, 2.0)
    frequency_penalty: float = _finite(0.0, -2.0, 2.0)
    min_p: float = _finite(0.0, 0.0, 1.0)
    repetition_penalty: float = _finite(1.0, 0.0, 100.0, gt=True)
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None  # gptkiln's: OpenAI's chat field, here too
    ignore_eos: bool = False  # vLLM's: go on past the end-of-text id


class FunctionCall(BaseModel):
    """A tool call's function: its name and its arguments, a JSON object as text."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(BaseModel):
    """A text part of a message's content, OpenAI's ``{"type": "text", "text": ...}``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One of a chat request's ``messages``; its role and order are checked by
    `finetune.templates.format_messages` (a fine-tuned run's template) or by the model's own
    template. ``name`` (OpenAI's participant name) is not used. An assistant message may hold
    ``tool_calls`` (and no content); a ``tool`` message answers the call ``tool_call_id``.

    ``content`` may come as a list of text parts, as agent frameworks send it: their texts
    joined by newlines (as vLLM joins them). An answer sent back as the ``openai`` client dumps
    it is taken too: its ``refusal`` and ``annotations`` are not used, and ``audio`` and
    ``function_call`` are null. A ``developer`` message is a ``system`` one, as OpenAI now
    names it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _joined_text(self) -> ChatMessage:
        if isinstance(self.content, list):
            self.content = "\n".join(part.text for part in self.content)
        if self.role == "developer":  # OpenAI's newer name for the system message
            self.role = "system"
        return self


class FunctionDef(BaseModel):
    """A tool's function: its name, what it does, its parameters' JSON schema."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming the one function the answer must call."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(Request):
    """``POST /v1/chat/completions``: OpenAI's fields for text chat, vLLM's ``top_k``,
    ``min_p``, ``repetition_penalty`` and ``ignore_eos`` added. Without
    ``max_tokens`` (or its newer name ``max_completion_tokens``) the answer may fill the
    context, as OpenAI's does.

    The fields agent SDKs send that mean nothing to a local server are taken and ignored
    (``store`` ... ``verbosity`` below); those that would change the answer (a
    ``prediction``, ``web_search_options``, an ``audio`` modality) are refused as not supported
    (`parsing.refuse_unsupported`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    messages: list[ChatMessage]
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    temperature: float = _finite(1.0, 0.0, 2.0)
    top_p: float = _finite(1.0, 0.0, 1.0, gt=True)
    top_k: int | None = Field(None, ge=-1)  # 0 or -1: off (vLLM's)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    presence_penalty: float = _finite(0.0, -2.0, 2.0)
    frequency_penalty: float = _finite(0.0, -2.0, 2.0)
    min_p: float = _finite(0.0, 0.0, 1.0)
    repetition_penalty: float = _finite(1.0, 0.0, 100.0, gt=True)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    # taken and ignored, with ``user``: no-ops for a local server (nothing is stored, tiered or
    # kept by key: its prefix cache matches prompts by their tokens; no reasoning effort or
    # verbosity to set)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None


class InspectRequest(Request):
    """``POST /v1/inspect`` (gptkiln's own): a prompt seen through the model (`gptkiln.inspect`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(max_length=MAX_INSPECT_CHARS)
    model: str | None = None
    top_k: int = Field(5, ge=1, le=MAX_LOGPROBS)
    max_tokens: int = Field(32, ge=1, le=MAX_INSPECT_TOKENS)


class TokenizeRequest(Request):
    """``POST /v1/tokenize`` (gptkiln's own, answered in the shape of vLLM's ``/tokenize``): how
    many tokens a prompt, or chat messages in the run's template (with the ``tools`` a chat
    request would show the model), take of the context. The page sizes and checks its fields by
    it before it sends a request."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    model: str | None = None


# What each field holds, for a type error's message (pydantic's own lists every union member).
FIELD_KINDS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of such lists",
    "model": "a string",
    "max_tokens": "a whole number >= 0",
    "temperature": "a number in [0, 2]",
    "top_p": "a number in (0, 1]",
    "top_k": "a whole number >= 1 (0 or -1: off)",
    "seed": f"a whole number in [0, {MAX_SEED}]",
    "stop": f"a string or a list of up to {MAX_STOP_STRINGS} strings",
    "presence_penalty": "a number in [-2, 2]",
    "frequency_penalty": "a number in [-2, 2]",
    "min_p": "a number in [0, 1] (0 = off)",
    "repetition_penalty": "a number in (0, 100] (1 = off)",
    "n": f"a whole number in [1, {MAX_N}]",
    "best_of": f"a whole number in [1, {MAX_N}] equal to n",
    "echo": "true or false",
    "logprobs": f"a whole number in [0, {MAX_LOGPROBS}]",
    "stream": "true or false",
    "stream_options": 'an object such as {"include_usage": true}',
    "suffix": "null (not supported)",
    "logit_bias": "an object of token ids (as strings) to numbers in [-100, 100]",
    "user": "a string",
    "ignore_eos": "true or false",
    "response_format": 'an object {"type": "text" | "json_object" | "json_schema", '
    '"json_schema": {"name", "schema", "strict"}}',
    "response_format.json_schema.schema": "a JSON schema (an object)",
    "response_format.type": '"text", "json_object" or "json_schema"',
    "response_format.json_schema": 'an object {"name", "schema", "strict"}',
    "response_format.json_schema.name": "a name of 1 to 64 letters, digits, _ or -",
    "response_format.json_schema.description": "a string",
    "response_format.json_schema.strict": "true, false or null",
    "stream_options.include_usage": "true or false",
}
CHAT_FIELD_KINDS = {
    **{
        k: v
        for k, v in FIELD_KINDS.items()
        if k.startswith(("response_format.", "stream_options."))
    },
    "tools.function.parameters": "a JSON schema (an object) or null",
    "tools.type": '"function"',
    "tools.function": 'an object {"name", "description", "parameters"}',
    "tools.function.name": "a name of 1 to 64 letters, digits, _ or -",
    "tools.function.description": "a string",
    "tools.function.strict": "true, false or null",
    "tool_choice.function.name": "a string",
    "messages": "a list of objects {role, content}",
    "messages[]": "an object {role, content}",
    "messages.role": "one of system (or developer), user, assistant, tool",
    "messages.content": 'text (a string), a list of {"type": "text", "text": ...} parts, or null',
    "messages.name": "a string",
    "messages.tool_calls": 'a list of {"id", "type": "function", "function": {"name", '
    '"arguments"}}',
    "messages.tool_calls.id": "a string",
    "messages.tool_calls.type": '"function"',
    "messages.tool_calls.function": 'an object {"name", "arguments"}',
    "messages.tool_calls.function.name": "a string",
    "messages.tool_calls.function.arguments": "a JSON object as a string (json.dumps of it)",
    "messages.tool_call_id": "the id of the tool call this message answers",
    "messages.refusal": "a string or null",
    "messages.annotations": "a list or null",
    "messages.audio": "null (this server reads text)",
    "messages.function_call": "null (send tool_calls)",
    "tools": 'a list of {"type": "function", "function": {"name", "description", "parameters"}}',
    "tools[]": '{"type": "function", "function": {"name", "description", "parameters"}}',
    "tool_choice": '"none", "auto", "required" or {"type": "function", "function": {"name"}}',
    "parallel_tool_calls": "true or false",
    "logprobs": "true or false",
    "top_logprobs": f"a whole number in [0, {MAX_LOGPROBS}]",
    "model": "a string",
    "max_tokens": "a whole number >= 0",
    "max_completion_tokens": "a whole number >= 0",
    "logit_bias": "an object of token ids (as strings) to numbers in [-100, 100]",
    "modalities": '["text"] or null',
    "prediction": "null (not supported)",
    "web_search_options": "null (not supported)",
    "store": "true, false or null (ignored)",
    "metadata": "an object of strings, or null (ignored)",
    "service_tier": "a string or null (ignored)",
    "prompt_cache_key": "a string or null (ignored)",
    "safety_identifier": "a string or null (ignored)",
    "reasoning_effort": "a string or null (ignored)",
    "verbosity": "a string or null (ignored)",
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
            "min_p",
            "repetition_penalty",
            "n",
            "stream",
            "stream_options",
            "user",
            "ignore_eos",
            "response_format",
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
    **{
        k: v
        for k, v in CHAT_FIELD_KINDS.items()
        if k.split(".")[0] in ("messages", "tools", "tools[]", "tool_choice")
    },
    "model": "a string",
}


def parse_request(model: type[BaseModel], body: bytes) -> Any:
    """Validate a JSON body as ``model``; any problem is a 400 naming the first bad field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        if e.errors()[0]["type"] == "json_invalid" and (where := _lone_surrogate(body)):
            raise OpenAIError(
                400,
                f"{where} is not valid Unicode text (a lone surrogate: a \\ud800-\\udfff escape "
                "without its pair); send text that is",
                param=None if where == "the body" else where,
                code="invalid_value",
            ) from None
        kinds = {
            InspectRequest: INSPECT_FIELD_KINDS,
            ChatCompletionRequest: CHAT_FIELD_KINDS,
            TokenizeRequest: TOKENIZE_FIELD_KINDS,
        }
        raise validation_error(e, kinds.get(model, FIELD_KINDS)) from None


def _lone_surrogate(body: bytes) -> str | None:
    """Where a body that pydantic's parser refused holds a lone surrogate (``"\\ud800"``: JSON
    that Python's parser takes and UTF-8 cannot encode), as a field path
    (``messages[0].content``, or "the body"); None when the body is not that."""
    try:
        found = [("", json.loads(body))]
    except (ValueError, RecursionError):
        return None
    while found:  # breadth first: the first bad string's path
        path, value = found.pop(0)
        if isinstance(value, list):
            found += [(f"{path}[{i}]", item) for i, item in enumerate(value)]
        elif isinstance(value, dict):
            if any(_has_surrogate(key) for key in value):
                return path or "the body"
            found += [(f"{path}.{key}".lstrip("."), item) for key, item in value.items()]
        elif isinstance(value, str) and _has_surrogate(value):
            return path or "the body"
    return None


def _has_surrogate(text: str) -> bool:
    return any("\ud800" <= c <= "\udfff" for c in text)


def validation_error(error: ValidationError, kinds: dict[str, str] = FIELD_KINDS) -> OpenAIError:
    """One 400 for pydantic's first error: which field, what it must be (``kinds``), what it
    got."""
    first = error.errors(include_url=False)[0]
    # a union's member names the branch it tried (``str``, ``list[TextPart]``): not a field
    loc = [str(p) for i, p in enumerate(first["loc"]) if not (i and _union_member(str(p)))]
    kind = first["type"]
    if kind == "json_invalid" and "recursion limit" in first["msg"]:  # valid JSON, too deep
        where = first["msg"].rpartition(" exceeded ")[2]
        return OpenAIError(
            400,
            f"the body nests arrays and objects too deep for the parser ({where}, past "
            "about 200 levels); send a flatter one",
            code="invalid_json",
        )
    if kind == "json_invalid":
        return OpenAIError(
            400,
            f"the body is not valid JSON ({first['msg'].removeprefix('Invalid JSON: ')}); send a "
            "JSON object in UTF-8",
            code="invalid_json",
        )
    if not loc:
        return OpenAIError(400, f"the body must be a JSON object ({first['msg']})")
    field = loc[0]
    where = (
        field
        + "".join(  # messages[1].tool_calls[0].function.arguments
            f"[{part}]" if part.isdigit() else f".{part.replace('schema_', 'schema')}"
            for part in loc[1:]
        )
    )
    dotted = ".".join(part.replace("schema_", "schema") for part in loc if not part.isdigit())
    if len(loc) == 2 and loc[1].isdigit():  # an item of a list: described as one
        dotted = f"{field}[]"
    if kind == "extra_forbidden":  # the fields of the object it is in: its siblings in kinds
        parent = dotted.rpartition(".")[0]
        prefix = f"{parent}." if parent else ""
        known = [
            k.removeprefix(prefix)
            for k in kinds
            if k.startswith(prefix) and "." not in k.removeprefix(prefix) and "[]" not in k
        ]
        return OpenAIError(
            400,
            f"unknown field {where!r}; the fields are: {', '.join(known)}",
            param=where,
            code="unknown_field",
        )
    if kind == "missing":
        return OpenAIError(400, f"{where} is required", param=where, code="missing_field")
    got = first.get("input")
    shown = json.dumps(got)[:80] if _jsonable(got) else type(got).__name__
    what = kinds.get(dotted)
    if what is None:  # a field inside one whose description would mislead: pydantic's words
        what = _said(first["msg"])
    return OpenAIError(
        400, f"{where} must be {what}, got {shown}", param=where, code="invalid_value"
    )


def _said(message: str) -> str:
    """pydantic's "Input should be a valid dictionary" as "a valid dictionary"."""
    return message.removeprefix("Input should be ").removeprefix("Value error, ")


def _union_member(part: str) -> bool:
    return "[" in part or part in ("str", "int", "float", "bool", "none", "any")


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


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # the prompt's tokens whose keys and values the prefix cache held


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class Completion(BaseModel):
    """A ``text_completion``: the whole answer, or one chunk of a stream (no usage)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(BaseModel):
    """A chat answer's token: its text, its log-probability, its bytes, its alternatives."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatReply(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


ChatFinish = Literal["stop", "length", "tool_calls"]


class ChatChoice(BaseModel):
    index: int
    message: ChatReply
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinish


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
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinish | None = None


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
