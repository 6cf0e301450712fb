"""A model's own chat template: ``tokenizer_config.json``'s ``chat_template`` (or a
``chat_template.jinja`` beside it), rendered with jinja2 the way Hugging Face ``transformers``
renders it in ``apply_chat_template``.

What makes the text equal to ``transformers``' (its ``utils/chat_template_utils.py``):

- an ``ImmutableSandboxedEnvironment`` (templates from the Hub are untrusted code) with
  ``trim_blocks`` and ``lstrip_blocks`` and the ``loopcontrols`` extension;
- ``tojson`` replaced by a plain ``json.dumps`` (jinja2's own escapes ``<``, ``>``, ``&``, ``'``
  for HTML, which would change the prompt), ``raise_exception(message)``, ``strftime_now(fmt)``;
- the variables: ``messages``, ``add_generation_prompt``, ``tools`` (OpenAI's tool objects,
  ``{"type": "function", "function": {...}}``, as ``apply_chat_template(tools=...)`` passes
  them; None without) and ``documents`` (None here), and the named special tokens
  (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``, ...) as strings.

A `ChatTemplate` stands where a fine-tuned run's `finetune.templates.PromptTemplate` stands
(``gptkiln chat``, ``generate`` on an instruction-tuned run, serve's ``/v1/chat/completions``):
the ``format_*`` functions of `finetune.templates` hand it the messages. Its text carries its
own special tokens (``<|begin_of_text|>``, ``<|im_start|>``), so it is encoded without the
tokenizer adding any (`gptkiln.tokenizers.encode_prompt` with ``templated=True``), as
``apply_chat_template(tokenize=True)`` encodes it; generation ends at the tokenizer's stop ids.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from gptkiln.errors import GptkilnError

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""The named special tokens a template sees as variables (``transformers``' own list)."""


def token_content(value: Any) -> str | None:
    """A special token of a tokenizer_config.json: a string, or an ``AddedToken`` dict
    (``{"content": ..., "__type": "AddedToken"}``); None when it is neither."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, or one line saying why it is not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise GptkilnError(
            f"{path}: not readable JSON ({e}); restore it from the model's original directory"
        ) from None
    if not isinstance(data, dict):
        raise GptkilnError(f"{path}: holds a {type(data).__name__}, not a JSON object")
    return data


def special_tokens(directory: Path, tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens (``bos_token`` ...) as ``transformers`` reads them:
    tokenizer_config.json's, completed by special_tokens_map.json's."""
    tokens: dict[str, str] = {}
    extra = directory / SPECIAL_TOKENS_MAP_FILE
    for source in (read_json(extra) if extra.is_file() else {}, tokenizer_config):
        for name in SPECIAL_TOKEN_NAMES:
            if (content := token_content(source.get(name))) is not None:
                tokens[name] = content
    return tokens


@functools.lru_cache(maxsize=8)
def compile_template(source: str, where: str = "chat_template"):
    """The jinja2 template of ``source`` in ``transformers``' sandboxed environment; a syntax
    error is one line naming ``where``."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        # jinja2's own tojson escapes HTML characters; a prompt wants the JSON as it is.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)  # Llama 3's templates print today's date

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``, which some templates (SmolLM3's) put
        around the assistant's turns for training masks: rendered as its body, as
        ``transformers`` renders it."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body", [])
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, Generation]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise GptkilnError(
            f"{where}: the chat template is not valid jinja2 (line {e.lineno}: {e.message}); "
            "fix it or restore the model's original tokenizer_config.json"
        ) from None


@dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template and the special tokens it is rendered with.

    Attributes:
        source: the jinja2 text.
        special_tokens: ``{"bos_token": "<|begin_of_text|>", ...}``, the template's variables.
        where: the file it came from, for messages.
    """

    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)
    where: str = "chat_template"

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The text of ``messages`` (``[{"role": ..., "content": ...}, ...]``), ending with the
        assistant's header when ``add_generation_prompt``: what ``transformers``'
        ``apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=...)``
        returns. ``tools`` (JSON-schema tool objects) reach the template's tool section."""
        import jinja2

        template = compile_template(self.source, self.where)
        try:
            return template.render(
                messages=[dict(m) for m in messages],
                tools=None if tools is None else [dict(t) for t in tools],
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as e:  # raise_exception(...) or an error while rendering
            raise GptkilnError(
                f"{self.where}: the chat template refused the messages: {e}"
            ) from None

    @property
    def renders_tools(self) -> bool:
        """Whether the template has a tool section (it reads the ``tools`` variable)."""
        import jinja2.meta

        env = compile_template(self.source, self.where).environment
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(self.source))

    def stop_strings(self) -> tuple[str, ...]:
        """None: a chat model ends its turn with a stop id (the tokenizer's), not a header."""
        return ()


def is_chat_template(template: Any) -> bool:
    """Whether ``template`` is a model's own chat template (whose text is encoded without
    added special tokens), not a fine-tuned run's `PromptTemplate` or None."""
    return isinstance(template, ChatTemplate)


def render_instruction(template: ChatTemplate, instruction: str, input: str = "") -> str:
    """One user message (the instruction, then its input after a blank line) ready for the
    assistant's answer: how ``generate`` sends a prompt to a chat model."""
    content = f"{instruction}\n\n{input}" if input else instruction
    return template.render([{"role": "user", "content": content}])


def load_chat_template(directory: str | os.PathLike) -> ChatTemplate | None:
    """The chat template of a model or run directory: ``chat_template.jinja``, else
    tokenizer_config.json's ``chat_template`` (a string, or ``transformers``' list of named
    templates, whose ``"default"`` is taken); None when it has none."""
    directory = Path(directory)
    config_path = directory / TOKENIZER_CONFIG_FILE
    config = read_json(config_path) if config_path.is_file() else {}
    jinja_path = directory / CHAT_TEMPLATE_FILE
    if jinja_path.is_file():
        source, where = jinja_path.read_text(encoding="utf-8"), str(jinja_path)
    else:
        source, where = config.get("chat_template"), f"{config_path} chat_template"
        if isinstance(
            source, list
        ):  # [{"name": "default", "template": ...}, {"name": "tool_use"...
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, Mapping)}
            source = named.get("default")
    if source is None:
        return None
    if not isinstance(source, str):
        raise GptkilnError(
            f"{where}: is a {type(source).__name__}, not the text of a jinja2 template; "
            "restore the model's original tokenizer_config.json"
        )
    template = ChatTemplate(source, special_tokens(directory, config), where)
    compile_template(source, where)  # a broken template is refused when it is loaded
    return template
