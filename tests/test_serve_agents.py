# ruff: noqa: E501 - the templates keep the long lines of the real ones they copy the shape of
"""Serve for agents and apps, through the official openai client: JSON-schema output
(``chat.completions.parse`` with a Pydantic model, ``json_object``, completions'
``response_format``), tool calls (a round trip: call → ``tool`` message → answer; ``tool_choice``
``required`` and a named function), chat logprobs equal to the completions endpoint's, eight
concurrent requests mixing constrained and free rows, and bad input as 400s naming the field.

The models are tiny and random: their free text is noise, so only the constraint can make an
answer parse. Their tokenizers are the Qwen3- and Llama 3.1-shaped ones of `hf_tokenizer_dirs`
with templates that have a tool section, written in the shape of theirs.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import warnings
from pathlib import Path

import httpx
import openai
import pydantic
import pytest
import torch
import uvicorn
from hf_tokenizer_dirs import write_llama3_dir, write_qwen3_dir
from serving import ServerThread

from gptkiln.chat_template import load_chat_template
from gptkiln.checkpoint import save_model
from gptkiln.cli import main
from gptkiln.config import GPTConfig
from gptkiln.model import GPT
from gptkiln.serve import serve
from gptkiln.serve.tools import (
    HERMES,
    LLAMA3_JSON,
    content_text,
    parse_tool_calls,
    settled_content,
    tool_family,
)
from gptkiln.tokenizers import load_tokenizer

pytest.importorskip("llguidance")

QWEN3_TOOLS_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- set call = tool_call.function if tool_call.function else tool_call %}
            {{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
            {%- if call.arguments is string %}
                {{- call.arguments }}
            {%- else %}
                {{- call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA31_TOOLS_TEMPLATE = """{{- bos_token }}
{%- if messages[0].role == 'system' %}
    {%- set system_message = messages[0].content | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools is not none %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
    {{- 'Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\\n\\n' }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.\\n\\n' }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- "<|eot_id|>" }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role in ['user', 'system'] or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}
    {%- elif message.role == 'assistant' %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {{- '{"name": "' + call.name + '", "parameters": ' }}
        {{- call.arguments | tojson }}
        {{- "}<|eot_id|>" }}
    {%- elif message.role == 'tool' %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {{- message.content }}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

BAD_TYPE = {"type": "object", "properties": {"city": {"type": "strin"}}}
NO_LIST = {"type": "object", "required": "city"}
DEEP_NOT: dict = {"type": "object"}
for _ in range(150):  # inside the JSON parser's depth, past what a check may recurse
    DEEP_NOT = {"not": DEEP_NOT}
ENDLESS = [
    {"$ref": "#"},
    {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time now.",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
NAME = "agent-run"
FG = ("f", "g")  # the tools a parse_tool_calls test offers


class Person(pydantic.BaseModel):
    """A schema whose every value is bounded, so noise must close it within max_tokens."""

    name: str = pydantic.Field(max_length=6)
    age: int = pydantic.Field(ge=0, le=120)
    admin: bool


def make_run(directory, write, template):
    hf_dir = write(directory / "tokenizer", template=template)
    tokenizer = load_tokenizer(hf_dir)
    torch.manual_seed(0)
    config = GPTConfig.from_name("tiny", vocab_size=tokenizer.vocab_size, context_length=1024)
    return save_model(GPT(config), directory / NAME, tokenizer=tokenizer), hf_dir


def served(run_dir):
    got = {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(uvicorn, "run", lambda app, **kw: got.setdefault("app", app))
        monkeypatch.setattr("gptkiln.serve.check_can_listen", lambda host, port: None)
        serve(run_dir, model_name=NAME, max_batch=8, max_queue=16, log_level="warning")
    return got["app"]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    run, hf_dir = make_run(tmp_path_factory.mktemp("qwen"), write_qwen3_dir, QWEN3_TOOLS_TEMPLATE)
    with ServerThread(served(run)) as url:
        yield url, hf_dir


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    run, hf_dir = make_run(
        tmp_path_factory.mktemp("llama"), write_llama3_dir, LLAMA31_TOOLS_TEMPLATE
    )
    with ServerThread(served(run)) as url:
        yield url, hf_dir


@pytest.fixture(scope="module")
def client(qwen):
    return openai.OpenAI(base_url=f"{qwen[0]}/v1", api_key="unused", max_retries=0)


def ask(**kw):
    return {"model": NAME, "temperature": 0, "max_tokens": 60, **kw}


USER = [{"role": "user", "content": "Who is it?"}]


# -- structured output -------------------------------------------------------------------------
def test_parse_with_a_pydantic_model_gives_a_valid_object(client):
    r = client.chat.completions.parse(**ask(messages=USER, response_format=Person))
    person = r.choices[0].message.parsed
    assert isinstance(person, Person), r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    free = client.chat.completions.create(**ask(messages=USER))  # the same model, unconstrained
    with pytest.raises(ValueError):
        Person.model_validate_json(free.choices[0].message.content)


def test_json_object_and_a_stream_parse(client):
    r = client.chat.completions.create(
        **ask(messages=USER, response_format={"type": "json_object"}, temperature=1, seed=3)
    )
    if r.choices[0].finish_reason == "stop":  # noise may fill max_tokens inside a string
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    schema = {"name": "p", "schema": Person.model_json_schema(), "strict": True}
    stream = client.chat.completions.create(
        **ask(messages=USER, response_format={"type": "json_schema", "json_schema": schema}),
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    Person.model_validate_json(text)


def test_the_schema_true_is_any_json_value(client):
    """``true`` is a JSON schema (any value), as ``{}`` is: both constrain the answer to JSON."""
    for schema in (True, {}):
        r = client.chat.completions.create(
            **ask(messages=USER, seed=5, temperature=1),
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
        if r.choices[0].finish_reason == "stop":
            json.loads(r.choices[0].message.content)


def test_a_cut_answer_says_length(client):
    schema = {"name": "p", "schema": Person.model_json_schema()}
    r = client.chat.completions.create(
        **{**ask(messages=USER), "max_tokens": 3},
        response_format={"type": "json_schema", "json_schema": schema},
    )
    assert r.choices[0].finish_reason == "length"


def test_a_schema_of_words_beyond_ascii_is_followed_byte_by_byte(client):
    """The grammar reads each id's own bytes (Qwen3's byte-level pieces of a character), so a
    schema naming 日本 or Zürich is followed and its text is whole characters."""
    words = ["日本", "café", "Zürich", "🙂 ok"]
    schema = {"name": "w", "schema": {"type": "object", "properties": {"w": {"enum": words}},
                                      "required": ["w"], "additionalProperties": False}}  # fmt: skip
    for seed in range(4):
        r = client.chat.completions.create(
            **ask(messages=USER, temperature=1, seed=seed),
            response_format={"type": "json_schema", "json_schema": schema},
        )
        assert json.loads(r.choices[0].message.content)["w"] in words


def test_a_stop_string_applies_to_a_constrained_answer_as_openais_do(client):
    """The request's own stop strings cut a constrained answer too (OpenAI's and vLLM's
    behaviour): a schema with two properties must write a comma, where ``stop`` ends it."""
    schema = {"name": "two", "schema": {
        "type": "object", "properties": {"a": {"enum": [1, 2]}, "b": {"enum": [3, 4]}},
        "required": ["a", "b"], "additionalProperties": False}}  # fmt: skip
    r = client.chat.completions.create(
        **ask(messages=USER, stop=[","]),
        response_format={"type": "json_schema", "json_schema": schema},
    )
    content = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and content.startswith("{") and "," not in content


def test_completions_take_a_response_format_too(qwen):
    body = {
        "model": NAME,
        "prompt": "A person:",
        "max_tokens": 60,
        "temperature": 0,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "p", "schema": Person.model_json_schema()},
        },
    }
    r = httpx.post(f"{qwen[0]}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    Person.model_validate_json(r.json()["choices"][0]["text"])


def test_eight_concurrent_requests_mix_constrained_and_free_rows(client):
    schema = {"name": "p", "schema": Person.model_json_schema()}

    def one(i):
        if i % 2:
            return client.chat.completions.create(**ask(messages=USER))
        return client.chat.completions.create(
            **ask(messages=USER, response_format={"type": "json_schema", "json_schema": schema})
        )

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(8)))
    alone = client.chat.completions.create(**ask(messages=USER)).choices[0].message.content
    for i, r in enumerate(answers):
        if i % 2:
            assert r.choices[0].message.content == alone  # a free row is what it is alone
        else:
            Person.model_validate_json(r.choices[0].message.content)


# -- tools -------------------------------------------------------------------------------------
def test_a_tool_round_trip_with_required_and_a_named_function(client):
    r = client.chat.completions.create(
        **ask(messages=USER, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=200)
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name in ("get_weather", "get_time") and call.id.startswith("call_")
    if call.function.name == "get_weather":
        args = json.loads(call.function.arguments)
        assert set(args) == {"city", "days"} and 1 <= args["days"] <= 7

    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        **ask(messages=USER, tools=[WEATHER, CLOCK], tool_choice=named, max_tokens=200)
    )
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    json.loads(call.function.arguments)

    history = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "blue"}'},
    ]
    r = client.chat.completions.create(**ask(messages=history, tools=[WEATHER]))
    assert r.choices[0].message.role == "assistant"  # auto: noise, read as text or a call
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_schema_shown_to_the_model_may_use_what_no_grammar_enforces(client):
    """Under ``auto`` a tool's parameters are only shown to the model: a format, a look-ahead
    pattern or a remote $ref no grammar enforces is taken (OpenAI's non-strict tools), what is
    not a schema by JSON Schema's meta-schema is not."""
    strong = {"type": "string", "pattern": "^(?=.*[A-Z])(?=.*\\d).{8,}$"}
    loose = {
        "type": "object",
        "properties": {"when": {"type": "string", "format": "my-date"}, "pw": strong},
        "$defs": {"far": {"$ref": "https://example.com/s.json"}},
    }
    tool = {"type": "function", "function": {"name": "plan", "parameters": loose}}
    r = client.chat.completions.create(**ask(messages=USER, tools=[tool], max_tokens=4))
    assert r.choices[0].message.role == "assistant"
    with pytest.raises(openai.BadRequestError, match="'city' is not of type 'array'"):
        bad = {**tool["function"], "parameters": NO_LIST}
        client.chat.completions.create(
            **ask(messages=USER, tools=[{"type": "function", "function": bad}], max_tokens=4)
        )


def test_a_forced_call_follows_parameters_that_refer_to_their_own_defs(client, qwen):
    """Pydantic writes a nested model as ``$defs`` and a ``$ref`` from the parameters' own root:
    the call's grammar puts the parameters inside a call object (one of several tools: inside
    an ``anyOf``) and still finds them."""
    import jsonschema

    trip = {
        "type": "object",
        "$defs": {
            "City": {
                "type": "object",
                "properties": {"name": {"enum": ["Oslo", "Rome"]}},
                "required": ["name"],
                "additionalProperties": False,
            }
        },
        "properties": {"start": {"$ref": "#/$defs/City"}, "end": {"$ref": "#/$defs/City"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    }
    tool = {"type": "function", "function": {"name": "trip", "parameters": trip}}
    for tools, choice in (([tool], "required"), ([CLOCK, tool], "required")):
        r = client.chat.completions.create(
            **ask(messages=USER, tools=tools, tool_choice=choice, max_tokens=200)
        )
        call = r.choices[0].message.tool_calls[0]
        if call.function.name == "trip":
            jsonschema.validate(json.loads(call.function.arguments), trip)
    named = {"type": "function", "function": {"name": "trip"}}
    r = client.chat.completions.create(
        **ask(messages=USER, tools=[CLOCK, tool], tool_choice=named, max_tokens=200)
    )
    jsonschema.validate(json.loads(r.choices[0].message.tool_calls[0].function.arguments), trip)
    # a schema with its own $id is a resource of its own: its #/... refs resolve against it
    # (pointed at the whole schema they would name nothing, and the request was refused)
    for where in ("root", "nested"):
        own = {**trip, "$id": "https://example.com/trip.json"}
        if where == "nested":
            own = {"type": "object", "properties": {"trip": own}, "required": ["trip"],
                   "additionalProperties": False}  # fmt: skip
        tool = {"type": "function", "function": {"name": "trip", "parameters": own}}
        r = client.chat.completions.create(
            **ask(messages=USER, tools=[tool], tool_choice=named, max_tokens=150)
        )
        arguments = json.loads(r.choices[0].message.tool_calls[0].function.arguments)
        jsonschema.validate(arguments, own)


def test_a_forced_call_of_a_function_without_parameters_takes_none(client):
    """No ``parameters`` is an empty parameter list, as OpenAI defines it: the grammar writes
    ``{}`` (before, any object: noise ran to max_tokens inside it)."""
    bare = {"type": "function", "function": {"name": "noparams"}}
    named = {"type": "function", "function": {"name": "noparams"}}
    for choice in (named, "required"):
        r = client.chat.completions.create(
            **ask(messages=USER, tools=[bare], tool_choice=choice, temperature=1, seed=0)
        )
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls"
        assert (call.function.name, json.loads(call.function.arguments)) == ("noparams", {})


def test_stop_strings_apply_inside_a_forced_call_as_vllms_do(client, qwen):
    """The request's stop strings apply inside a forced call, as vLLM applies them under guided
    decoding: one in the call's JSON cuts it (finish "stop", the cut text as content, no call);
    one after the JSON leaves the call whole; one in the ``<tool_call>\\n`` written before every
    call would cut them all: a 400 naming ``stop``."""
    forced = ask(messages=USER, tools=[WEATHER], tool_choice="required", max_tokens=200)
    cut = client.chat.completions.create(**forced, stop=["city"]).choices[0]
    assert cut.finish_reason == "stop" and cut.message.tool_calls is None
    assert cut.message.content.startswith("<tool_call>") and "city" not in cut.message.content
    after = client.chat.completions.create(**forced, stop=["</tool_call>"]).choices[0]
    assert after.finish_reason == "tool_calls"
    assert set(json.loads(after.message.tool_calls[0].function.arguments)) == {"city", "days"}
    for stop in ("\n", ["x", "<tool"]):
        r = httpx.post(f"{qwen[0]}/v1/chat/completions", json={**forced, "stop": stop}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text


def test_tokenize_counts_the_tools_a_chat_request_shows(client, qwen):
    url = qwen[0]
    plain = httpx.post(f"{url}/v1/tokenize", json={"messages": USER}).json()["count"]
    body = {"messages": USER, "tools": [WEATHER]}
    counted = httpx.post(f"{url}/v1/tokenize", json=body).json()["count"]
    r = client.chat.completions.create(**ask(**body, max_tokens=1))
    assert counted == r.usage.prompt_tokens > plain + 20  # the tool section is in the count
    none = httpx.post(f"{url}/v1/tokenize", json={**body, "tool_choice": "none"}).json()
    assert none["count"] == plain  # as chat: tool_choice none shows no tools
    r = httpx.post(f"{url}/v1/tokenize", json={"prompt": "Hi", "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_a_streamed_tool_call_reads_as_openais(client):
    stream = client.chat.completions.create(
        **ask(messages=USER, tools=[WEATHER], tool_choice="required", max_tokens=200), stream=True
    )
    chunks = [c for c in stream if c.choices]
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert set(json.loads(arguments)) == {"city", "days"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objekt"}},
                }
            },
            "response_format",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}},
                }
            },
            "response_format",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": False},
                }
            },
            "response_format",
        ),
        (
            {"tools": [{"type": "function", "function": {"parameters": {}}}]},
            "tools[0].function.name",
        ),
        (  # not a schema, the call not forced: refused all the same, as OpenAI's
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_TYPE}}]},
            "tools",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": NO_LIST}}],
                "tool_choice": "auto",
            },
            "tools",
        ),
        *(
            (
                {"tools": [{"type": "function", "function": {"name": "f", "parameters": bad}}]},
                "tools",
            )
            for bad in ({"type": "object", "$schema": 5}, {"$schema": ["x"]}, DEEP_NOT)
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        *(  # no finite value meets them: the grammar would let the end through, or never end
            (
                {
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "x", "schema": endless},
                    }
                },
                "response_format",
            )
            for endless in ENDLESS
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": ENDLESS[-1]}}
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        (  # a call's arguments are an object, as OpenAI's
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"messages": [*USER, {"role": "tool", "content": "1"}]}, "messages[1].tool_call_id"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(qwen, body, param):
    r = httpx.post(
        f"{qwen[0]}/v1/chat/completions", json={**ask(messages=USER), **body}, timeout=60
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_an_answer_sent_back_as_the_client_dumps_it_and_text_parts_are_taken(client, qwen):
    """An agent loop appends ``message.model_dump()`` (with ``refusal``, ``annotations``,
    ``audio``, ``function_call``) and may send content as text parts: the prompt is the one the
    plain strings make."""
    first = client.chat.completions.create(**ask(messages=USER, max_tokens=5))
    dumped = first.choices[0].message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= set(dumped)
    parts = [{"type": "text", "text": "Go"}, {"type": "text", "text": "on."}]
    history = [*USER, dumped, {"role": "user", "content": parts}]
    said = first.choices[0].message.content
    plain = [*USER, {"role": "assistant", "content": said}, {"role": "user", "content": "Go\non."}]
    a = client.chat.completions.create(**ask(messages=history, max_tokens=8))
    b = client.chat.completions.create(**ask(messages=plain, max_tokens=8))
    assert a.usage.prompt_tokens == b.usage.prompt_tokens > 10
    assert a.choices[0].message.content == b.choices[0].message.content
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    r = httpx.post(
        f"{qwen[0]}/v1/chat/completions",
        json=ask(messages=[{"role": "user", "content": [image]}]),
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages[0].content")


# -- chat logprobs -----------------------------------------------------------------------------
def test_chat_logprobs_equal_the_completions_figures(client, qwen):
    r = client.chat.completions.create(
        **ask(messages=USER, max_tokens=6, logprobs=True, top_logprobs=3)
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and len(content[0].top_logprobs) == 3
    prompt = load_chat_template(qwen[1]).render(USER)
    ids = load_tokenizer(qwen[1]).encode_templated(prompt)
    c = httpx.post(
        f"{qwen[0]}/v1/completions",
        json={"model": NAME, "prompt": ids, "max_tokens": 6, "temperature": 0, "logprobs": 3},
        timeout=60,
    ).json()["choices"][0]["logprobs"]
    assert [t.logprob for t in content] == pytest.approx(c["token_logprobs"], abs=1e-6)
    assert [t.token for t in content] == c["tokens"]
    assert bytes(content[0].bytes).decode("utf-8", "replace") == content[0].token
    assert [a.logprob for a in content[0].top_logprobs] == pytest.approx(
        sorted(c["top_logprobs"][0].values(), reverse=True), abs=1e-6
    )


# -- the template's tools, and reading calls back ----------------------------------------------
@pytest.mark.parametrize("parallel, calls", [(None, 2), (True, 2), (False, 1)])
def test_parallel_tool_calls_false_gives_one_call_a_turn(parallel, calls):
    from gptkiln.serve.answers import ChatAnswer
    from gptkiln.serve.schemas import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate(
        {"messages": USER, "tools": [WEATHER, CLOCK], "parallel_tool_calls": parallel}
    )
    answer = ChatAnswer(req, [], None, NAME, tool_family=HERMES)
    two = (
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    content, got, reason = answer._read_calls(two, "stop")
    assert [c.function.name for c in got] == ["get_time", "get_weather"][:calls]
    assert content is None and reason == "tool_calls"


TOOL_CONVERSATION = [
    {"role": "system", "content": "You help."},
    *USER,
    {
        "role": "assistant",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "blue"}'},
]


@pytest.mark.parametrize(
    "write, template",
    [(write_qwen3_dir, QWEN3_TOOLS_TEMPLATE), (write_llama3_dir, LLAMA31_TOOLS_TEMPLATE)],
)
def test_tools_render_as_apply_chat_template_renders_them(tmp_path, write, template):
    transformers = pytest.importorskip("transformers")
    hf_dir = write(tmp_path / "tok", template=template)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoTokenizer.from_pretrained(hf_dir)
    ours = load_chat_template(hf_dir)
    for messages in (USER, TOOL_CONVERSATION):
        want = hf.apply_chat_template(
            messages, tools=[WEATHER, CLOCK], tokenize=False, add_generation_prompt=True
        )
        got = ours.render(messages, tools=[WEATHER, CLOCK])
        assert got == want and "get_weather" in got
    assert ours.render(USER) == hf.apply_chat_template(
        USER, tokenize=False, add_generation_prompt=True
    )


def test_each_family_reads_its_calls_back(tmp_path):
    assert (
        tool_family(
            load_chat_template(write_qwen3_dir(tmp_path / "q", template=QWEN3_TOOLS_TEMPLATE))
        )
        == HERMES
    )
    assert (
        tool_family(
            load_chat_template(write_llama3_dir(tmp_path / "l", template=LLAMA31_TOOLS_TEMPLATE))
        )
        == LLAMA3_JSON
    )
    assert tool_family(load_chat_template(write_qwen3_dir(tmp_path / "plain"))) is None
    content, calls = parse_tool_calls(
        HERMES,
        'Let me see.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
        FG,
    )
    assert content == "Let me see." and [c.function.name for c in calls] == ["f", "g"]
    assert json.loads(calls[0].function.arguments) == {"a": 1}
    content, calls = parse_tool_calls(
        LLAMA3_JSON, '<|python_tag|>{"name": "f", "parameters": {"a": 1}}', FG
    )
    assert content is None and json.loads(calls[0].function.arguments) == {"a": 1}
    assert parse_tool_calls(LLAMA3_JSON, "Just text.", FG) == ("Just text.", [])
    assert parse_tool_calls(HERMES, "<tool_call>\n{broken", FG) == ("<tool_call>\n{broken", [])


GET_TIME = '{"name": "get_time", "arguments": {}}'
SAID = {  # answers a model may give with tools in play: calls, text, text that is nearly a call
    HERMES: [
        f"Let me see.\n<tool_call>\n{GET_TIME}\n</tool_call>",
        f"<tool_call>\n{GET_TIME}\n</tool_call>\nDone.",
        "It is 3 < 4, and <tool_ca is no tag.",
        'A <tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',  # no tool of ours
        "  Space first, no call.",
        f"  Space first.\n<tool_call>\n{GET_TIME}\n</tool_call>",
        "Plain text.\n",
    ],
    LLAMA3_JSON: [
        '{"name": "get_time", "parameters": {}}',
        '<|python_tag|>{"name": "get_time", "parameters": {}}',
        "The sky is blue.",
        '{"a": 1}',  # JSON, no call: content, sent at the end
        "<|python_tag|> no call",
        "  <b>bold</b> text ",
        "<|python_ta",
        "<|python_tag|>",  # max_tokens cut it after the tag
        'I will look.<|python_tag|>{"name": "get_time", "parameters": {}}',  # text first: no call
        '<|python_tag|>brave_search.call(query="time")',  # a built-in tool's: no call we read
    ],
}


@pytest.mark.parametrize("family", [HERMES, LLAMA3_JSON])
def test_a_streams_settled_content_begins_the_content_whatever_follows(family):
    """`settled_content` of every beginning of an answer begins the content parse_tool_calls
    reads from the whole answer, and only grows; it holds back a Hermes answer's tail that
    may open a call, and a Llama 3 answer while it may be a call."""
    for text in SAID[family]:
        content = parse_tool_calls(family, text, ["get_time"])[0] or ""
        settled = [settled_content(family, text[:k]) for k in range(len(text) + 1)]
        for k, n in enumerate(settled):
            assert n <= k and content.startswith(content_text(family, text[:n])), (text, k)
        assert settled == sorted(settled), text
    assert settled_content(HERMES, SAID[HERMES][0]) == len("Let me see.")
    assert settled_content(HERMES, "It is 3 < 4, and <tool_ca") == len("It is 3 < 4, and")
    assert settled_content(HERMES, "Plain text.\n") == len("Plain text.")  # may precede a call
    assert settled_content(LLAMA3_JSON, "The sky is blue.") == len("The sky is blue.")
    for text in ("  ", "<|pyth", '  <|python_tag|> {"na', '{"name"'):
        assert settled_content(LLAMA3_JSON, text) == 0
    assert settled_content(LLAMA3_JSON, "I will look.<|pyth") == len("I will look.")


def test_a_llama_3_answer_that_is_no_call_shows_no_python_tag():
    """``<|python_tag|>`` is a control token of Llama 3.1's template (it opens a call), which an
    answer without tools never shows (special tokens are skipped): an answer with tools that
    makes no call leaves it out too (before, its content began with the tag)."""
    names = ["get_time"]
    assert parse_tool_calls(LLAMA3_JSON, "<|python_tag|> no call", names) == (" no call", [])
    assert parse_tool_calls(LLAMA3_JSON, "<|python_tag|>", names) == ("", [])
    content, calls = parse_tool_calls(LLAMA3_JSON, SAID[LLAMA3_JSON][8], names)
    assert (content, calls) == ('I will look.{"name": "get_time", "parameters": {}}', [])
    content, calls = parse_tool_calls(LLAMA3_JSON, SAID[LLAMA3_JSON][9], names)
    assert (content, calls) == ('brave_search.call(query="time")', [])
    # Hermes has no such tag: its text is its own
    assert parse_tool_calls(HERMES, "<|python_tag|> no call", names) == (
        "<|python_tag|> no call",
        [],
    )


def says(monkeypatch, text: str) -> None:
    """The server's model says ``text``: a grammar of that text alone stands for the chat
    request's (the tiny random model follows it token by token, then ends)."""
    from gptkiln.serve import app

    def grammar(req, family, grammars):
        return grammars.lark(f"start: {json.dumps(text)}\n")

    monkeypatch.setattr(app, "chat_grammar", grammar)


@pytest.mark.parametrize("family, server", [(HERMES, "qwen"), (LLAMA3_JSON, "llama")])
def test_a_stream_with_tools_sends_content_until_a_call_may_begin(
    family, server, request, monkeypatch
):
    """With tools in play a stream sends its content as it comes, until a call may begin (the
    rest at the end, parsed as now): its pieces add up to the whole answer's content, its calls
    and logprobs are the whole answer's, for answers with calls and without (before, every
    stream with tools sent its content in one piece at the end)."""
    url = request.getfixturevalue(server)[0]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    body = ask(messages=USER, tools=[CLOCK], max_tokens=200, n=2, logprobs=True)
    for text in SAID[family]:
        says(monkeypatch, text)
        whole = client.chat.completions.create(**body)
        want_content, want_calls = parse_tool_calls(family, text, ["get_time"])
        chunks = [c for c in client.chat.completions.create(**body, stream=True) if c.choices]
        for i, choice in enumerate(whole.choices):
            message = choice.message
            assert message.content == want_content, text  # the model said the text
            assert "<|python_tag|>" not in (message.content or "") or family == HERMES
            calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
            assert calls == [(c.function.name, c.function.arguments) for c in want_calls]
            mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
            pieces = [c.delta.content for c in mine if c.delta.content]
            assert "".join(pieces) == (message.content or ""), text
            assert (len(pieces) > 1) == (settled_content(family, text) > 0), (text, pieces)
            deltas = [d for c in mine for d in c.delta.tool_calls or []]
            names = [d.function.name for d in deltas if d.function.name]
            arguments = "".join(d.function.arguments or "" for d in deltas)
            assert names == [name for name, _ in calls]
            assert arguments == "".join(args for _, args in calls)
            assert mine[-1].finish_reason == choice.finish_reason
            scored = [t.token for c in mine if c.logprobs for t in c.logprobs.content]
            assert scored == [t.token for t in choice.logprobs.content]


def test_a_special_python_tag_is_left_out_with_tools_as_without(tmp_path, monkeypatch):
    """With Llama 3.1's tokenizer ``<|python_tag|>`` is one special token: an answer without
    tools skips it (skip_special_tokens), and one with tools that makes no call, whose text
    keeps the special tokens for its parser, now leaves it out as well, whole or streamed (its
    content began with the tag)."""
    write = functools.partial(write_llama3_dir, more_specials=("<|python_tag|>",))
    run, hf_dir = make_run(tmp_path, write, LLAMA31_TOOLS_TEMPLATE)
    tag = load_tokenizer(hf_dir).encode_templated("<|python_tag|>")
    assert len(tag) == 1  # one token: it comes in one piece
    from gptkiln.serve import app

    def grammar(req, family, grammars):  # the model says the tag, then text
        return grammars.lark(f'start: <[{tag[0]}]> " no call"\n')

    monkeypatch.setattr(app, "chat_grammar", grammar)
    with ServerThread(served(run)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        for tools in ({}, {"tools": [CLOCK]}):
            body = ask(messages=USER, max_tokens=20, **tools)
            whole = client.chat.completions.create(**body).choices[0].message
            chunks = client.chat.completions.create(**body, stream=True)
            pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
            assert (whole.content, whole.tool_calls) == (" no call", None), tools
            assert "".join(pieces) == " no call", tools


def test_a_call_is_read_as_json_whole_so_its_strings_may_hold_the_separators():
    """A ``;`` in a Llama 3 call's argument, or ``</tool_call>`` in a Hermes one's, belongs to
    its string: the call still reads back (before, the text was split on them first)."""
    content, calls = parse_tool_calls(
        LLAMA3_JSON,
        '{"name": "f", "parameters": {"q": "a; b"}}; {"name": "g", "parameters": {}}',
        FG,
    )
    assert content is None and [c.function.name for c in calls] == ["f", "g"]
    assert json.loads(calls[0].function.arguments) == {"q": "a; b"}
    text = '<tool_call>\n{"name": "f", "arguments": {"q": "</tool_call> x"}}\n</tool_call>\nDone.'
    content, calls = parse_tool_calls(HERMES, text, FG)
    assert json.loads(calls[0].function.arguments) == {"q": "</tool_call> x"}
    assert content == "Done."  # text after the last call is the answer's text too
    cut = '<tool_call>\n{"name": "f", "arguments": {}}'  # max_tokens before the closing tag
    assert [c.function.name for c in parse_tool_calls(HERMES, cut, FG)[1]] == ["f"]
    assert parse_tool_calls(LLAMA3_JSON, '{"name": "f", "parameters": {}} and more', FG)[1] == []


def test_only_a_call_of_an_offered_tool_with_its_arguments_is_a_call():
    """An answer that is a JSON object with a ``"name"`` key (a schema's, a person's) is
    content: a call names one of the request's tools, and a Llama 3 call has its
    ``parameters`` or ``arguments`` (vLLM's llama3_json rule). Before, ``{"name": "Ann"}`` was a
    call of a function ``Ann`` with ``{}`` arguments."""
    for text in ('{"name": "Ann"}', '{"name": "John", "age": 3}', '{"name": "f"}'):
        assert parse_tool_calls(LLAMA3_JSON, text, FG) == (text, [])
    assert parse_tool_calls(LLAMA3_JSON, '{"name": "Ann", "parameters": {}}', FG)[1] == []
    assert parse_tool_calls(LLAMA3_JSON, '{"name": ["f"], "parameters": {}}', FG)[1] == []
    assert [
        c.function.name
        for c in parse_tool_calls(LLAMA3_JSON, '{"name": "f", "arguments": {}}', FG)[1]
    ] == ["f"]
    unknown = '<tool_call>\n{"name": "zz", "arguments": {"a": 1}}\n</tool_call>'
    assert parse_tool_calls(HERMES, unknown, FG) == (unknown, [])
    # inside Hermes' tags a call of an offered tool without arguments takes none
    calls = parse_tool_calls(HERMES, '<tool_call>\n{"name": "g"}\n</tool_call>', FG)[1]
    assert [(c.function.name, c.function.arguments) for c in calls] == [("g", "{}")]


@pytest.mark.parametrize("family", [HERMES, LLAMA3_JSON])
def test_a_chat_answer_reads_calls_of_its_own_tools_only(family):
    from gptkiln.serve.answers import ChatAnswer
    from gptkiln.serve.schemas import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate({"messages": USER, "tools": [WEATHER, CLOCK]})
    answer = ChatAnswer(req, [], None, NAME, tool_family=family)
    key = "arguments" if family == HERMES else "parameters"
    call = json.dumps({"name": "get_time", key: {}})
    stray = json.dumps({"name": "Ann", key: {}})
    if family == HERMES:
        call, stray = (f"<tool_call>\n{c}\n</tool_call>" for c in (call, stray))
    assert answer._read_calls(stray, "stop") == (stray, [], "stop")
    content, calls, reason = answer._read_calls(call, "stop")
    assert [c.function.name for c in calls] == ["get_time"] and reason == "tool_calls"


def test_a_template_without_tools_refuses_them(tmp_path, capsys):
    run, _ = make_run(tmp_path, write_qwen3_dir, None or _plain_qwen())
    app = served(run)
    assert "(chat too: its own chat template)" in capsys.readouterr().err  # not fine-tuned
    with ServerThread(app) as url:
        r = httpx.post(
            f"{url}/v1/chat/completions", json=ask(messages=USER, tools=[WEATHER]), timeout=60
        )
        history = [  # counted as chat reads them: refused in words, not a failed assert
            *USER,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ]},
            {"role": "tool", "tool_call_id": "c1", "content": "r"},
        ]  # fmt: skip
        counted = httpx.post(f"{url}/v1/tokenize", json={"messages": history}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "no tool section" in r.json()["error"]["message"]
    assert counted.status_code == 400 and counted.json()["error"]["param"] == "messages"
    assert counted.json()["error"]["code"] == "tools_not_supported"


def _plain_qwen():
    from hf_tokenizer_dirs import QWEN3_TEMPLATE

    return QWEN3_TEMPLATE


def test_a_llama_template_call_is_read_back_from_its_json(tmp_path):
    run, _ = make_run(tmp_path, write_llama3_dir, LLAMA31_TOOLS_TEMPLATE)
    with ServerThread(served(run)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(
            **ask(messages=USER, tools=[WEATHER], tool_choice="required", max_tokens=170)
        )
        named = {"type": "object", "properties": {"name": {"enum": ["Ann", "Bob"]}},
                 "required": ["name"], "additionalProperties": False}  # fmt: skip
        answer = client.chat.completions.create(  # an answer with a "name" key is no call
            **ask(messages=USER, tools=[WEATHER], tool_choice="auto"),
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": named}},
        ).choices[0]
    assert answer.finish_reason == "stop" and answer.message.tool_calls is None
    assert json.loads(answer.message.content)["name"] in ("Ann", "Bob")
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city", "days"}


# -- a trained run -----------------------------------------------------------------------------
TEMPLATES = Path(__file__).parent / "chat_templates"
QWEN3_REAL = (TEMPLATES / "qwen3-0.6b.jinja").read_text(encoding="utf-8")


class WeatherArgs(pydantic.BaseModel):
    """WEATHER's parameters schema as a strict model: no other keys, no coercion."""

    model_config = pydantic.ConfigDict(extra="forbid", strict=True)
    city: str = pydantic.Field(max_length=6)
    days: int = pydantic.Field(ge=1, le=7)


def test_a_tool_round_trip_on_a_chat_fine_tuned_run_with_the_real_qwen3_template(tmp_path, capsys):
    """`gptkiln finetune --task chat --template qwen3-0.6b.jinja` on a tiny base whose own
    template has no tool section: the run keeps the real Qwen3 template, and serve uses its tool
    section for the whole round trip (required call → ``tool`` message → answer)."""
    base, _ = make_run(tmp_path, write_qwen3_dir, _plain_qwen())
    data = tmp_path / "chat.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": f"What is {i} plus 1?"},
                      {"role": "assistant", "content": f"It is {i + 1}."}]}
        for i in range(24)
    ]  # fmt: skip
    data.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    run = tmp_path / "trained"
    argv = ["finetune", base, "--task", "chat", "--template", TEMPLATES / "qwen3-0.6b.jinja"]
    argv += ["--data", data, "--out", run, "--max-steps", 3, "--batch-size", 4, "--lr", 3e-3]
    argv += ["--val-fraction", 0.25, "--eval-interval", 3, "--eval-batches", 1]
    assert main([str(a) for a in [*argv, "--no-progress", "--precision", "fp32"]]) in (0, None)
    capsys.readouterr()
    template = load_chat_template(run)  # the run's own: what serve renders with
    assert template.source == QWEN3_REAL and tool_family(template) == HERMES
    with ServerThread(served(run)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(
            **ask(messages=USER, tools=[WEATHER], tool_choice="required", max_tokens=200)
        )
        prompt = template.render(USER, tools=[WEATHER])  # the tool section the model was shown
        assert r.usage.prompt_tokens == len(load_tokenizer(run).encode_templated(prompt))
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message.content
        call = choice.message.tool_calls[0]
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        WeatherArgs.model_validate_json(call.function.arguments)
        asked = r.usage.prompt_tokens
        history = [
            *USER,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "blue"}'},
        ]
        r = client.chat.completions.create(**ask(messages=history, tools=[WEATHER]))
    assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens > asked
    assert r.choices[0].finish_reason in ("stop", "length"), r.choices[0].message


def test_a_chat_answer_leaves_the_templates_markers_out_of_its_text(tmp_path):
    """A model that writes nothing but ``<|im_start|>``: the chat answer's text (the server's,
    and ``gptkiln chat``'s) leaves the marker out, as vLLM's does (skip_special_tokens), and
    counts its tokens; a completion, raw text as ``gptkiln generate`` gives it, shows them."""
    from gptkiln.chat import Chat
    from gptkiln.config import SampleConfig

    hf_dir = write_qwen3_dir(tmp_path / "tokenizer", template=QWEN3_TOOLS_TEMPLATE)
    tokenizer = load_tokenizer(hf_dir)
    marker = tokenizer.encode_templated("<|im_start|>")[0]
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny", vocab_size=tokenizer.vocab_size, context_length=256))
    with torch.no_grad():  # every logit 0 but the marker's: the final norm's bias summed
        model.ln_f.bias.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[marker] = 1.0
    run = save_model(model, tmp_path / NAME, tokenizer=tokenizer)
    chat = Chat(run, SampleConfig(max_new_tokens=5, temperature=0))
    assert "".join(chat.reply("Who is it?")) == ""
    with ServerThread(served(run)) as url:
        body = ask(messages=USER, max_tokens=5)
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        assert r["choices"][0]["message"]["content"] == "" and r["usage"]["completion_tokens"] == 5
        prompt = load_chat_template(hf_dir).render(USER)
        body = {"model": NAME, "prompt": prompt, "max_tokens": 5, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert r["choices"][0]["text"] == "<|im_start|>" * 5


def test_chat_logprobs_go_on_past_a_special_token_the_text_leaves_out(tmp_path):
    """A chat answer's text leaves ``<|im_start|>`` out, so its logprobs count it no characters:
    the tokens after it are still listed (they were dropped, placed past the text's end)."""
    from gptkiln.serve.answers import Scores
    from gptkiln.text_stream import hidden_ids

    tokenizer = load_tokenizer(write_qwen3_dir(tmp_path / "tokenizer"))
    a, b = tokenizer.encode("a")[0], tokenizer.encode("b")[0]
    marker = tokenizer.encode_templated("<|im_start|>")[0]
    scores = Scores(tokenizer, hidden_ids(tokenizer, True))
    for token in (a, marker, b):
        scores.add(token, None)
    assert [t for t, _, _ in scores.release("ab", done=True)] == [a, marker, b]
    shown = Scores(tokenizer)  # a completion's text keeps the marker: it takes its characters
    for token in (a, marker, b):
        shown.add(token, None)
    assert [t for t, _, _ in shown.release("a<|im_start|>b", done=True)] == [a, marker, b]
