"""Tool calls: how each template family writes them, read back into OpenAI's ``tool_calls``, and
the grammar that makes a call the model must make (``tool_choice`` ``required`` or a named
function) always parse with arguments valid against the tool's parameters.

The families gptkiln runs write a call as:

- ``hermes`` (Qwen2.5, Qwen3 and the Hermes models): ``<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>``, one block a call, after any text;
- ``llama3_json`` (Llama 3.1, 3.2, 3.3): the whole answer one JSON object ``{"name": ...,
  "parameters": {...}}`` (optionally after ``<|python_tag|>``), calls separated by ``;``.

The family is read from the template's own text (the tags its tool section writes).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from typing import Any

from gptkiln.chat_template import ChatTemplate
from gptkiln.serve.constrain import JSON_OPTIONS, Grammars, check_finite
from gptkiln.serve.schemas import FunctionCall, Tool, ToolCall
from gptkiln.text_stream import start_at_end

HERMES, LLAMA3_JSON = "hermes", "llama3_json"


def tool_family(template: ChatTemplate) -> str | None:
    """The way the template's model writes tool calls, or None when it has no tool section or
    one gptkiln cannot read back."""
    if not template.renders_tools:
        return None
    if "<tool_call>" in template.source:
        return HERMES
    if "<|python_tag|>" in template.source or '"parameters"' in template.source:
        return LLAMA3_JSON
    return None


def _arguments_key(family: str) -> str:
    return "arguments" if family == HERMES else "parameters"


NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
"""The arguments of a function without ``parameters``: none, ``{}``."""


def call_schema(family: str, tool: Tool, at: str = "#") -> dict[str, Any]:
    """The JSON schema of one call of ``tool`` as the family writes it, placed at ``at`` (a
    JSON pointer) of the whole schema: the parameters' own local ``$ref``s (``#/$defs/X``, as
    pydantic writes a nested model) are rebased to where the parameters now sit."""
    key = _arguments_key(family)
    parameters = tool.function.parameters
    if parameters is None:  # OpenAI: "omitting parameters defines an empty parameter list"
        parameters = NO_PARAMETERS
    elif not parameters:  # {}: any JSON value, of which a call's arguments are an object
        parameters = {"type": "object"}
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.function.name},
            key: _rebased(parameters, f"{at}/properties/{key}"),
        },
        "required": ["name", key],
        "additionalProperties": False,
    }


_VALUES = frozenset({"const", "enum", "default", "examples"})
"""Keywords whose values are JSON values, not schemas: a ``$ref`` key inside them is data."""

_NAMED = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
"""Keywords whose values map names to schemas: a name (``default``, ``enum``) is no keyword."""


def _rebased(schema: Any, base: str) -> Any:
    """``schema`` with every ``$ref`` that is a JSON pointer into it (``#``, ``#/...``) pointing
    under ``base`` instead (an anchor, ``#name``, or another document's is left as it is). A
    schema with its own ``$id`` is a resource of its own, against which its ``#/...`` refs
    resolve wherever it sits (JSON Schema's rule, and llguidance's): it is left whole."""
    if isinstance(schema, list):
        return [_rebased(item, base) for item in schema]
    if not isinstance(schema, dict) or "$id" in schema:
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = base + value[1:]
        elif key in _VALUES:
            out[key] = value
        elif key in _NAMED and isinstance(value, dict):
            out[key] = {name: _rebased(sub, base) for name, sub in value.items()}
        else:
            out[key] = _rebased(value, base)
    return out


def forced_call_grammar(grammars: Grammars, family: str, tools: list[Tool]) -> str:
    """The grammar of one call of any of ``tools`` (one tool: that one), in the family's
    wrapping. A schema that no finite call meets (`gptkiln.serve.constrain.check_finite`) is
    refused."""
    if len(tools) == 1:
        schema = call_schema(family, tools[0])
    else:
        schema = {"anyOf": [call_schema(family, t, f"#/anyOf/{i}") for i, t in enumerate(tools)]}
    if family == LLAMA3_JSON:
        return grammars.json_schema(schema)
    check_finite(schema)
    embedded = json.dumps({**schema, "x-guidance": JSON_OPTIONS})
    start = json.dumps(forced_call_opening(family))
    end = json.dumps("\n" + _HERMES_CLOSE)
    return grammars.lark(f"start: {start} call {end}\ncall: %json {embedded}\n")


def forced_call_opening(family: str) -> str:
    """The text a forced call's grammar writes before the call's JSON (Hermes' opening tag;
    nothing before a Llama 3 call's)."""
    return _HERMES_OPEN + "\n" if family == HERMES else ""


def parse_tool_calls(
    family: str, text: str, names: Collection[str]
) -> tuple[str | None, list[ToolCall]]:
    """(the answer's text outside its calls, or None; its calls). Text that is not a
    well-formed call stays text: a call names one of the request's tools (``names``), and a
    Llama 3 call has its ``parameters`` (or ``arguments``), as vLLM's ``llama3_json`` parser
    reads them, so an answer that is a JSON object with a ``"name"`` key is content, not a
    call of a function nobody offered. Each call's JSON is read whole
    (`json.JSONDecoder.raw_decode`), so a ``;`` or a ``</tool_call>`` inside an argument's
    string is part of that string."""
    names = frozenset(names)
    if family == HERMES:
        calls, outside = _hermes_calls(text, names)
        return (outside.strip() or None, calls) if calls else (text, [])
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    calls = _json_calls(family, body, ";", names) if body.startswith("{") else None
    return (None, calls) if calls else (content_text(family, text), [])


_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def content_text(family: str, text: str) -> str:
    """The content an answer's text, or a settled piece of it (`settled_content`), shows: a
    Llama 3 answer's ``<|python_tag|>`` left out. The tag is a control token of its template,
    which opens a call: an answer without tools never shows it (its text is decoded with the
    special tokens skipped, as vLLM's by default; llama.cpp's renders it as nothing unless a
    built-in tool needs it), so an answer with tools that makes no call shows it no more."""
    return text.replace(_PYTHON_TAG, "") if family == LLAMA3_JSON else text


def settled_content(family: str, text: str) -> int:
    """How many characters of an answer's text so far (``text``) are its content whatever the
    model writes next: ``content_text(family, text[:k])`` begins the content `parse_tool_calls`
    reads from the whole answer, calls or not, so a stream may send it before the answer ends
    (vLLM's and llama.cpp's servers stream so). Held back: from a call's marker on (Hermes'
    ``<tool_call>``), an end that may be the start of one (``<tool``), and the white space
    before it (the content of an answer with calls is stripped); a Hermes answer that begins
    with white space, all of it (that space is content only if no call follows); a Llama 3
    answer while it may still be a call (nothing yet but white space, ``<|python_tag|>`` or a
    beginning of it, or a ``{`` first), all of it, and once it is none, an end that may be the
    start of a ``<|python_tag|>`` (``<|pyt``), which `content_text` leaves out whole."""
    if family == HERMES:
        if text[:1].isspace():
            return 0
        start = text.find(_HERMES_OPEN)
        if start < 0:
            start = len(text) - start_at_end(text, [_HERMES_OPEN])
        return len(text[:start].rstrip())
    body = text.lstrip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG) :].lstrip()
    elif _PYTHON_TAG.startswith(body):  # nothing yet, or the tag may be starting
        return 0
    if not body or body.startswith("{"):
        return 0
    return len(text) - start_at_end(text, [_PYTHON_TAG])


def _hermes_calls(text: str, names: frozenset[str]) -> tuple[list[ToolCall] | None, str]:
    """Hermes' ``<tool_call> {...} </tool_call>`` blocks (the last may be left open: cut by
    max_tokens) and the text outside them; None if any block is not a call."""
    calls, outside, i = [], [], 0
    while (start := text.find(_HERMES_OPEN, i)) >= 0:
        outside.append(text[i:start])
        call, i = _one_call(HERMES, text, start + len(_HERMES_OPEN), names)
        if call is None:
            return None, text
        calls.append(call)
        i = _skip_space(text, i)
        if text.startswith(_HERMES_CLOSE, i):
            i += len(_HERMES_CLOSE)
        elif i < len(text):
            return None, text
    outside.append(text[i:])
    return calls, "".join(outside)


def _json_calls(
    family: str, body: str, separator: str, names: frozenset[str]
) -> list[ToolCall] | None:
    """Calls written as JSON objects one after another, ``separator`` between them (Llama 3's
    ``;``); None if any is not a call."""
    calls, i = [], 0
    while i < len(body):
        call, i = _one_call(family, body, i, names)
        if call is None:
            return None
        calls.append(call)
        i = _skip_space(body, i)
        if body.startswith(separator, i):
            i = _skip_space(body, i + len(separator))
        elif i < len(body):
            return None
    return calls


def _skip_space(text: str, i: int) -> int:
    return len(text) - len(text[i:].lstrip())


def _one_call(family: str, text: str, i: int, names: frozenset[str]) -> tuple[ToolCall | None, int]:
    """The call whose JSON starts at ``text[i:]`` (after white space), and where it ends; None
    where it is no call of one of ``names``."""
    try:
        call, end = _DECODER.raw_decode(text, _skip_space(text, i))
    except ValueError:
        return None, i
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None, end
    if call["name"] not in names:
        return None, end  # an answer with a "name" key: no call of a function not offered
    if family == LLAMA3_JSON and not {"parameters", "arguments"} & call.keys():
        return None, end  # as vLLM's llama3_json parser: a bare object's call names its arguments
    arguments = call.get(_arguments_key(family), call.get("arguments", {}))
    if not isinstance(arguments, dict):
        return None, end
    tool_call = ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}",
        function=FunctionCall(name=call["name"], arguments=json.dumps(arguments)),
    )
    return tool_call, end


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as a template reads them: an assistant's tool call's ``arguments`` as an
    object (OpenAI sends them as JSON text; Llama 3.1's template writes them with ``tojson``,
    as vLLM hands them over), keys left out where OpenAI's client sent null, except an
    assistant's null content, which is "" (as vLLM hands it over: Qwen3's own template reads
    ``message.content`` of every assistant turn, a tool call's too)."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        if message.get("role") == "assistant":
            message.setdefault("content", "")
        if "tool_calls" in message:
            calls = []
            for call in message["tool_calls"]:
                function = dict(call["function"])
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except ValueError:
                    pass
                calls.append({**call, "function": function})
            message["tool_calls"] = calls
        out.append(message)
    return out
