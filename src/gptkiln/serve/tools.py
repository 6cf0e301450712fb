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
import re
import uuid
from typing import Any

from gptkiln.chat_template import ChatTemplate
from gptkiln.serve.constrain import JSON_OPTIONS, Grammars
from gptkiln.serve.schemas import FunctionCall, Tool, ToolCall

HERMES, LLAMA3_JSON = "hermes", "llama3_json"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


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


def call_schema(family: str, tool: Tool) -> dict[str, Any]:
    """The JSON schema of one call of ``tool`` as the family writes it."""
    parameters = tool.function.parameters or {"type": "object"}
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.function.name},
            _arguments_key(family): parameters,
        },
        "required": ["name", _arguments_key(family)],
        "additionalProperties": False,
    }


def forced_call_grammar(grammars: Grammars, family: str, tools: list[Tool]) -> str:
    """The grammar of one call of any of ``tools`` (one tool: that one), in the family's
    wrapping."""
    schemas = [call_schema(family, tool) for tool in tools]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if family == LLAMA3_JSON:
        return grammars.json_schema(schema)
    embedded = json.dumps({**schema, "x-guidance": JSON_OPTIONS})
    start = json.dumps("<tool_call>\n")
    end = json.dumps("\n</tool_call>")
    return grammars.lark(f"start: {start} call {end}\ncall: %json {embedded}\n")


def parse_tool_calls(family: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(the answer's text outside its calls, or None; its calls). Text that is not a
    well-formed call stays text."""
    if family == HERMES:
        calls = [_call(family, body) for body in _HERMES_CALL.findall(text)]
        if not calls or None in calls:
            return text, []
        content = text[: text.index("<tool_call>")].strip()
        return content or None, calls
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = [_call(family, part) for part in body.split(";") if part.strip()]
    if not calls or None in calls:
        return text, []
    return None, calls


def _call(family: str, body: str) -> ToolCall | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get(_arguments_key(family), call.get("arguments", {}))
    if not isinstance(arguments, dict):
        return None
    return ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}",
        function=FunctionCall(name=call["name"], arguments=json.dumps(arguments)),
    )


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
