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
from gptkiln.serve.constrain import GrammarError, Grammars, check_schema
from gptkiln.serve.schemas import (
    MAX_SEED,
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    OpenAIError,
    ResponseFormat,
    TokenizeRequest,
    Tool,
)
from gptkiln.serve.tools import (
    forced_call_grammar,
    forced_call_opening,
    template_messages,
    tool_family,
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


UNUSED_MESSAGE_FIELDS = {"refusal", "annotations", "audio", "function_call"}
"""A message's fields that the openai client sends back in an answer and no template reads."""


def chat_prompt(
    template: PromptTemplate | ChatTemplate,
    messages: list[ChatMessage],
    tokenizer: Any,
    tools: list[Tool] | None = None,
) -> list[tuple[str, list[int]]]:
    """The one prompt of a chat request, as (its text, its ids): the messages in the run's
    template (`finetune.templates.format_messages`, as ``gptkiln chat`` formats them); with
    ``tools``, or tool calls and results in the messages, the model's own template renders
    them all (as ``apply_chat_template(messages, tools=...)`` does)."""
    dumped = [m.model_dump(exclude=UNUSED_MESSAGE_FIELDS) for m in messages]
    try:
        if tools or any(m.role == "tool" or m.tool_calls for m in messages):
            if not isinstance(template, ChatTemplate):  # `check_tools` says so first
                raise _no_tool_section("tools" if tools else "messages")
            shown = None if not tools else [t.model_dump(exclude_none=True) for t in tools]
            text = template.render(template_messages(dumped), tools=shown)
        else:
            text = format_messages(template, dumped)
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


def refuse_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    """A 400 for the fields this server does not honour, rather than ignoring them: what
    would change the answer (a suffix, a predicted output, web search, audio)."""
    unsupported: list[tuple[str, Any]] = []
    if isinstance(req, CompletionRequest):
        unsupported += [
            ("suffix", req.suffix or None),
            ("best_of", req.best_of if req.best_of not in (None, req.n) else None),
        ]
    else:
        audio = req.modalities is not None and set(req.modalities) - {"text"}
        unsupported += [
            ("modalities", req.modalities if audio else None),
            ("prediction", req.prediction),
            ("web_search_options", req.web_search_options),
        ]
    for name, value in unsupported:
        if value is not None:
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
    defaults: dict[str, Any] | None = None,
    vocab: int | None = None,
) -> SampleConfig:
    """The request's `SampleConfig`, once every prompt and its new tokens fit the context.

    Args:
        req: the parsed request (its ``max_tokens``, sampling fields and ``stop``).
        prompts: the ids of each prompt.
        context: the model's context length.
        extra_stop: stop strings added to the request's own (a template's headers).
        source: the request field the prompts came from, named in a too-long error.
        defaults: the model's sampling (`config.sample.model_sampling`) for the fields of
            `MODEL_SAMPLING` the request leaves out (vLLM's ``--generation-config auto``).
        vocab: the ids the model and its tokenizer share (a ``logit_bias`` id past them: 400).
    """
    if req.stream_options is not None and not req.stream:  # as OpenAI answers it
        raise OpenAIError(
            400, "stream_options is only for a streamed answer: send stream: true too, or "
            "leave stream_options out", "stream_options"
        )  # fmt: skip
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
    room = context - longest
    if room == 0 and req.max_tokens != 0:  # no token could follow: refused, as OpenAI and vLLM do
        raise OpenAIError(
            400,
            f"the prompt has {longest} tokens, the whole of the model's context of {context}, "
            f"which leaves no room for an answer: shorten the {source}",
            source,
            code="context_length_exceeded",
        )
    new = room if req.max_tokens is None else req.max_tokens
    if new > room:
        raise OpenAIError(
            400,
            f"the prompt's {longest} tokens plus max_tokens {new} exceed the model's context of "
            f"{context}; lower max_tokens to at most {room} or shorten the {source}",
            "max_tokens",
            code="context_length_exceeded",
        )
    sampling = {
        "temperature": req.temperature,
        "top_k": None if req.top_k is not None and req.top_k <= 0 else req.top_k,
        "top_p": req.top_p,
        "min_p": req.min_p or None,
        "repetition_penalty": req.repetition_penalty,
    }
    for name, value in (defaults or {}).items():
        left_out = name not in req.model_fields_set or getattr(req, name) is None
        if name in sampling and left_out:  # left out (or null, as vLLM reads it): the model's
            sampling[name] = value
    bias = logit_bias(req.logit_bias, vocab)
    try:
        return SampleConfig(
            max_new_tokens=new,
            seed=req.seed,
            stop=tuple(dict.fromkeys([*stop, *extra_stop])),
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            stop_at_eos=not req.ignore_eos,
            logit_bias=bias,
            **sampling,
        )
    except GptkilnError as e:
        raise OpenAIError(400, str(e)) from None


def logit_bias(bias: dict[str, float] | None, vocab: int | None) -> tuple:
    """OpenAI's ``logit_bias`` (token ids as strings: numbers) as `SampleConfig` pairs; a key
    that is no token id of the model, or a bias outside [-100, 100], is a 400."""
    pairs = []
    for key, value in (bias or {}).items():
        if not key.strip().isdigit() or (vocab is not None and int(key) >= vocab):
            top = "" if vocab is None else f" below {vocab}"
            raise OpenAIError(
                400,
                f"logit_bias key {key!r} is not a token id of this model; give ids{top} "
                "(POST /v1/tokenize gives a text's ids)",
                "logit_bias",
            )
        if not -100 <= value <= 100:
            raise OpenAIError(
                400, f"logit_bias of token {key} must be in [-100, 100], got {value}", "logit_bias"
            )
        pairs.append((int(key), value))
    return tuple(pairs)


def nth_sample(cfg: SampleConfig, j: int) -> SampleConfig:
    """The j-th sample of a prompt draws with seed + j: sample 0 is the prompt run alone."""
    if cfg.seed is None or j == 0:
        return cfg
    return SampleConfig(**{**cfg.__dict__, "seed": (cfg.seed + j) % (MAX_SEED + 1)})


# -- structured output and tools -----------------------------------------------------------------
def check_messages(messages: list[ChatMessage]) -> None:
    """Each message's content and tool fields fit its role: a ``tool`` message answers a call
    an earlier assistant message made (``tool_call_id``), only an assistant message may hold
    ``tool_calls`` and then may have no content."""
    called: set[str] = set()
    for i, m in enumerate(messages):
        if m.tool_calls and m.role != "assistant":
            raise OpenAIError(
                400,
                f"messages[{i}]: only an assistant message holds tool_calls, not a {m.role!r} one",
                f"messages[{i}].tool_calls",
            )
        called |= {call.id for call in m.tool_calls or []}
        if m.role == "tool" and m.tool_call_id is None:
            raise OpenAIError(
                400,
                f"messages[{i}] is a tool result without tool_call_id; give the id of the "
                "assistant's tool call it answers",
                f"messages[{i}].tool_call_id",
            )
        if m.role == "tool" and m.tool_call_id not in called:
            raise OpenAIError(
                400,
                f"messages[{i}].tool_call_id {m.tool_call_id!r} answers no tool call of an "
                f"earlier assistant message (their ids: {', '.join(sorted(called)) or 'none'})",
                f"messages[{i}].tool_call_id",
            )
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise OpenAIError(
                400,
                f"messages[{i}].content is required: give text (only an assistant message "
                "with tool_calls may have none)",
                f"messages[{i}].content",
            )


def check_tools(
    req: ChatCompletionRequest | TokenizeRequest, template: PromptTemplate | ChatTemplate
) -> str | None:
    """The tool-call family the answer is read with (None: no tools in play), once ``tools``,
    ``tool_choice`` and the template agree; each disagreement a 400 naming the field (a chat
    request's, or the count of one)."""
    tools, choice = req.tools or [], req.tool_choice
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        raise OpenAIError(400, f"tools: two tools share a name ({names}); name each once", "tools")
    if choice is not None and not tools and choice != "none":
        raise OpenAIError(
            400,
            "tool_choice is set but tools is empty; give the tools to choose from",
            "tool_choice",
        )
    if not isinstance(choice, str) and choice is not None and choice.function.name not in names:
        raise OpenAIError(
            400,
            f"tool_choice names the function {choice.function.name!r}, which is not in tools "
            f"({', '.join(names)})",
            "tool_choice",
        )
    history = any(m.role == "tool" or m.tool_calls for m in req.messages)
    if not tools and not history:
        return None
    family = tool_family(template) if isinstance(template, ChatTemplate) else None
    if family is None:
        raise _no_tool_section("tools" if tools else "messages")
    return None if choice == "none" or not tools else family


def _no_tool_section(param: str) -> OpenAIError:
    return OpenAIError(
        400,
        "this model's chat template has no tool section gptkiln can use (a fine-tuned "
        "run's prompt template, or a model template without tools), so it cannot be given "
        "tools, tool calls or tool results: leave them out",
        param,
        code="tools_not_supported",
    )


def chat_grammar(
    req: ChatCompletionRequest, family: str | None, grammars: Grammars | None
) -> str | None:
    """The grammar of a chat answer: its ``response_format`` or the tool call it must make.
    Every tool's parameters must be a JSON schema, a call forced or not (as OpenAI's)."""
    for tool in req.tools or []:
        parameters = tool.function.parameters or {"type": "object"}
        try:
            check_schema(parameters)
            kind = parameters.get("type", "object") if isinstance(parameters, dict) else None
            if kind != "object":  # a call's arguments are one JSON object
                raise GrammarError(f"it must be a schema of type object, not {kind!r}")
        except GrammarError as e:
            raise OpenAIError(
                400, f"tools: the parameters of {tool.function.name!r}: {e}", "tools"
            ) from None
    choice = req.tool_choice
    forced = family is not None and (choice == "required" or not isinstance(choice, str | None))
    if forced and req.response_format is not None and req.response_format.type != "text":
        raise OpenAIError(
            400,
            "response_format and a tool_choice that forces a call both constrain the answer; "
            "send one of them",
            "response_format",
        )
    if not forced:
        return response_grammar(req.response_format, grammars)
    _check_stop_spares_the_call(req, family)  # before a grammar is built
    tools = req.tools or []
    if not isinstance(choice, str):
        tools = [t for t in tools if t.function.name == choice.function.name]
    try:
        return forced_call_grammar(_engine(grammars, "tool_choice"), family, tools)
    except GrammarError as e:
        raise OpenAIError(400, f"tools: a function's parameters: {e}", "tools") from None


def _check_stop_spares_the_call(req: ChatCompletionRequest, family: str) -> None:
    """The request's stop strings apply inside a forced call, as vLLM applies them under guided
    decoding: one inside the call's JSON cuts it (``finish_reason`` "stop", the cut text as
    content, no call), and one after it only ends the answer there (the call is read back). One
    that the text before every call holds (Hermes' ``<tool_call>\n``) would cut each call before
    it began: a 400 naming it."""
    opening = forced_call_opening(family)
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    for stop in stops:
        if stop and stop in opening:
            raise OpenAIError(
                400,
                f"stop string {stop!r} occurs in {opening!r}, which this model writes before "
                "every tool call, so it would cut each call the tool_choice forces: leave it out",
                "stop",
            )


def response_grammar(fmt: ResponseFormat | None, grammars: Grammars | None) -> str | None:
    """The grammar of ``response_format``: None for text, any object for ``json_object``,
    the schema for ``json_schema``."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        schema: Any = {"type": "object"}
    elif fmt.json_schema is None:
        raise OpenAIError(
            400,
            'response_format {"type": "json_schema"} needs "json_schema": {"name", "schema"}',
            "response_format.json_schema",
        )
    else:
        schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {}
    try:
        return _engine(grammars, "response_format").json_schema(schema)
    except GrammarError as e:
        raise OpenAIError(400, f"response_format: {e}", "response_format") from None


def compile_grammar(grammar: str, grammars: Grammars, param: str) -> None:
    """Compile (and cache) a grammar once before its rows are queued: what the engine cannot
    enforce is a 400 naming it (``param``), never a row decoding free text."""
    try:
        grammars.constraint(grammar)
    except GrammarError as e:
        raise OpenAIError(
            400,
            f"{param}: the schema cannot be enforced: {e}; change or leave out that part",
            param,
            code="unsupported_schema",
        ) from None


def _engine(grammars: Grammars | None, param: str) -> Grammars:
    if grammars is None:
        raise OpenAIError(
            400,
            f"{param}: constrained decoding needs the llguidance package, which is not "
            "installed here: pip install llguidance",
            param,
        )
    return grammars
