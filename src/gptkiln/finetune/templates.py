"""Prompt templates: how an instruction (and its input) becomes a prompt the response follows.

The default is the book's (chapter 7), the Alpaca format::

    Below is an instruction that describes a task. Write a response that appropriately
    completes the request.

    ### Instruction:
    {instruction}

    ### Input:            <- only when the input is not empty
    {input}

    ### Response:
    {output}

A fine-tuned run stores its template in its config.json, and every way of prompting it
(`gptkiln generate`, `gptkiln chat`, the server) formats prompts with `format_prompt`,
`format_conversation` or `format_messages` from here, so they cannot disagree with what training
saw. `format_messages` takes OpenAI's chat ``messages`` (``[{"role": ..., "content": ...}]``):
what ``POST /v1/chat/completions`` will hand it once ``gptkiln serve`` exists.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptkiln.chat_template import ChatTemplate, render_instruction
from gptkiln.errors import GptkilnError


@dataclass(frozen=True)
class PromptTemplate:
    """The pieces of a prompt, in order: ``system``, then ``instruction`` with the instruction
    at ``{instruction}``, then ``input`` with the input at ``{input}`` (left out when the input
    is empty), then ``response``, after which the response follows.

    A conversation (`format_conversation`) writes ``system`` once and then, for each turn, the
    instruction part, the response part and that turn's response.
    """

    system: str
    instruction: str
    input: str
    response: str

    def __post_init__(self) -> None:
        for name, placeholder in (("instruction", "{instruction}"), ("input", "{input}")):
            text = getattr(self, name)
            if not isinstance(text, str) or text.count(placeholder) != 1:
                raise GptkilnError(
                    f"prompt template: {name!r} must be text with {placeholder} once, got {text!r}"
                )
        for name in ("system", "response"):
            if not isinstance(getattr(self, name), str):
                raise GptkilnError(
                    f"prompt template: {name!r} must be text, got {getattr(self, name)!r}"
                )

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Any, source: str = "prompt template") -> PromptTemplate:
        """A template from a mapping with exactly the four keys (a run's config.json or a file)."""
        names = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(values, dict) or sorted(values) != sorted(names):
            got = sorted(values) if isinstance(values, dict) else type(values).__name__
            raise GptkilnError(
                f"{source}: a template is a JSON object with the keys {', '.join(names)}; got {got}"
            )
        try:
            return cls(**values)
        except GptkilnError as e:
            raise GptkilnError(f"{source}: {e}") from None

    def stop_strings(self) -> tuple[str, ...]:
        """The headers of the template's parts (``### Instruction:``, ...): a response that goes
        on to write one has ended, so generation stops there."""
        parts = (
            self.instruction.split("{instruction}")[0],
            self.input.split("{input}")[0],
            self.response,
        )
        return tuple(dict.fromkeys(s for p in parts if (s := p.strip())))


ALPACA = PromptTemplate(
    system=(
        "Below is an instruction that describes a task. "
        "Write a response that appropriately completes the request."
    ),
    instruction="\n\n### Instruction:\n{instruction}",
    input="\n\n### Input:\n{input}",
    response="\n\n### Response:\n",
)
"""The book's template (chapter 7's ``format_input`` and its ``### Response:`` line)."""

TEMPLATES = {"alpaca": ALPACA}


def load_template(name_or_path: str) -> PromptTemplate:
    """A bundled template by name (``alpaca``) or a JSON file with the keys of `PromptTemplate`."""
    if name_or_path in TEMPLATES:
        return TEMPLATES[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise GptkilnError(
            f"--template {name_or_path}: no such file or bundled template; bundled: "
            f"{', '.join(TEMPLATES)}, or a JSON file with the keys system, instruction, "
            "input, response"
        )
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise GptkilnError(f"{path}: not valid JSON ({e}); fix the template file") from None
    return PromptTemplate.from_dict(values, str(path))


def _instruction_part(template: PromptTemplate, instruction: str, input: str = "") -> str:
    # Pieces filled one by one: a brace in the user's text is never taken for a placeholder.
    text = template.instruction.replace("{instruction}", instruction)
    if input:
        text += template.input.replace("{input}", input)
    return text


def format_prompt(
    template: PromptTemplate | ChatTemplate, instruction: str, input: str = ""
) -> str:
    """The prompt a response follows: system, instruction, input (when not empty), response
    header. For the book's template: ``format_input(entry) + "\\n\\n### Response:\\n"``.
    A model's chat template gets one user message (`chat_template.render_instruction`)."""
    if isinstance(template, ChatTemplate):
        return render_instruction(template, instruction, input)
    return template.system + _instruction_part(template, instruction, input) + template.response


def format_example(template: PromptTemplate, entry: dict[str, str]) -> str:
    """A training example: the prompt of ``entry`` followed by its ``output``."""
    return format_prompt(template, entry["instruction"], entry.get("input", "")) + entry["output"]


def format_conversation(
    template: PromptTemplate | ChatTemplate, turns: Sequence[tuple[str, str]], message: str
) -> str:
    """The prompt for the next response in a conversation: the system text once, then each
    earlier turn's (message, response), then ``message`` and the response header. With no
    earlier turns it is ``format_prompt(template, message)``. A model's chat template renders
    the turns as user and assistant messages."""
    if isinstance(template, ChatTemplate):
        messages = []
        for said, answered in turns:
            messages += [
                {"role": "user", "content": said},
                {"role": "assistant", "content": answered},
            ]
        return template.render([*messages, {"role": "user", "content": message}])
    parts = [template.system]
    for said, answered in turns:
        parts += [_instruction_part(template, said), template.response, answered]
    parts += [_instruction_part(template, message), template.response]
    return "".join(parts)


ROLES = ("system", "user", "assistant")


def format_messages(
    template: PromptTemplate | ChatTemplate, messages: Sequence[Mapping[str, Any]]
) -> str:
    """The prompt for the next response to OpenAI-style chat ``messages``, each
    ``{"role": "system" | "user" | "assistant", "content": text}``.

    A leading ``system`` message takes the place of the template's system text; then user and
    assistant messages alternate, starting and ending with a user message (the one to answer).
    It is `format_conversation` over the (user, assistant) pairs, so a server and ``gptkiln
    chat`` send the model the same text for the same conversation.
    """
    turns = [_checked_message(i, m) for i, m in enumerate(messages)]
    if isinstance(template, ChatTemplate):  # the model's template decides what it accepts
        if not turns:
            raise GptkilnError("messages: none; send at least one user message")
        return template.render([{"role": r, "content": c} for r, c in turns])
    if turns and turns[0][0] == "system":
        template = dataclasses.replace(template, system=turns.pop(0)[1])
    roles = [role for role, _ in turns]
    expected = ["user" if i % 2 == 0 else "assistant" for i in range(len(roles))]
    if not roles or roles != expected or roles[-1] != "user":
        raise GptkilnError(
            f"messages: roles {', '.join(roles) or '(none)'} (after an optional first system "
            "message); send user and assistant messages in turn, starting and ending with user"
        )
    said = [text for role, text in turns if role == "user"]
    answered = [text for role, text in turns if role == "assistant"]
    return format_conversation(template, list(zip(said, answered, strict=False)), said[-1])


def _checked_message(index: int, message: Any) -> tuple[str, str]:
    if not isinstance(message, Mapping):
        raise GptkilnError(
            f"messages[{index}] is a {type(message).__name__}; send an object with role and content"
        )
    role, content = message.get("role"), message.get("content")
    if role not in ROLES or not isinstance(content, str):
        raise GptkilnError(
            f"messages[{index}]: role {role!r} and content of type {type(content).__name__}; "
            f"role is one of {', '.join(ROLES)} and content is text"
        )
    return role, content


# -- conversations for training ----------------------------------------------------------------
CHATML_SOURCE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + END_OF_TURN + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``) for a model without a chat template, each
turn ended by ``END_OF_TURN``: the tokenizer's own end-of-text token (`chatml_template`), so that
generation stops where a turn ends."""


def chatml_template(end_of_turn: str) -> ChatTemplate:
    """The ChatML template gptkiln gives a model without one; a turn ends with ``end_of_turn``
    (the tokenizer's end-of-text token, e.g. GPT-2's ``<|endoftext|>``)."""
    source = CHATML_SOURCE.replace("END_OF_TURN", json.dumps(end_of_turn).replace('"', "'"))
    return ChatTemplate(source, {"eos_token": end_of_turn}, "gptkiln's ChatML template")


Piece = tuple[str, bool]  # (text, trained)


def conversation_pieces(
    template: PromptTemplate | ChatTemplate, messages: Sequence[Mapping[str, Any]], end: str
) -> list[Piece]:
    """A conversation as its template writes it, in pieces of text that alternate between the
    template's and the assistant's: each assistant turn's text, from the end of its header to its
    end-of-turn token ``end`` included, is a trained piece.

    A chat template is rendered whole, once, and each assistant turn is found by rendering the
    messages before it with ``add_generation_prompt`` (the prompt a server would send): the turn
    starts where that prompt ends, which must be a prefix of the whole, and ends after the first
    ``end`` that follows (TRL's assistant-only loss for templates without generation markers
    finds its spans the same way). A `PromptTemplate` (the book's Alpaca) writes the turns with
    `format_messages`; its last response is followed by ``end``.
    """
    if isinstance(template, ChatTemplate):
        return _chat_pieces(template, messages, end)
    messages = [dict(m) for m in messages]
    pieces: list[Piece] = []
    done = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = format_messages(template, messages[:i])
        pieces += [(prompt[done:], False), (message["content"], True)]
        done = len(prompt) + len(message["content"])
    if not pieces:
        return [(format_messages(template, messages), False)]
    pieces[-1] = (pieces[-1][0] + end, True)
    return [p for p in pieces if p[0]]


def _chat_pieces(
    template: ChatTemplate, messages: Sequence[Mapping[str, Any]], end: str
) -> list[Piece]:
    whole = template.render(messages, add_generation_prompt=False)
    pieces: list[Piece] = []
    done = 0
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt = template.render(messages[:i], add_generation_prompt=True) if i else ""
        if not whole.startswith(prompt) or len(prompt) < done:
            raise GptkilnError(
                f"{template.where}: the template writes the conversation before assistant turn "
                f"{i} (message {i + 1}) otherwise than inside the whole conversation, so the "
                "turn's text cannot be found; give a template (--template FILE.jinja) whose "
                "prompt for each turn is the start of the conversation"
            )
        stop = whole.find(end, len(prompt))
        if stop < 0:
            raise GptkilnError(
                f"{template.where}: assistant turn at message {i + 1} does not end with the "
                f"end-of-turn token {end!r}; give a template (--template FILE.jinja) that ends "
                "each turn with the tokenizer's end-of-turn token"
            )
        pieces += [(whole[done : len(prompt)], False), (whole[len(prompt) : stop + len(end)], True)]
        done = stop + len(end)
    pieces.append((whole[done:], False))
    return [p for p in pieces if p[0]]
