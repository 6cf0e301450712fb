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
