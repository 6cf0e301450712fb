"""A run's chat template as the formats outside gptkiln write it: jinja for Hugging Face
(``tokenizer_config.json``'s ``chat_template``) and GGUF (``tokenizer.chat_template``).

A model's own chat template (`gptkiln.chat_template.ChatTemplate`) is jinja already and goes out
as it came. An instruction-tuned run's `gptkiln.finetune.templates.PromptTemplate` (the book's
Alpaca format, or a template file) is written as the jinja that renders what
`gptkiln.finetune.templates.format_messages` renders: the system text (a leading system message
in its place), each user message as the instruction part followed by the response header, each
assistant message as it is; ``add_generation_prompt`` is where the last response header goes.
Where the run's tokenizer begins every text with a BOS (Llama 3's), the jinja begins with it too:
gptkiln trained and prompts the run with it, and ``transformers``' ``apply_chat_template``
encodes the text it renders without adding one (llama.cpp drops a rendered BOS its tokenizer
adds anyway).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gptkiln.chat_template import ChatTemplate
from gptkiln.finetune.runs import run_template
from gptkiln.finetune.templates import PromptTemplate


def jinja_literal(text: str) -> str:
    """``text`` as a jinja string literal (a JSON string is one: jinja reads Python's escapes)."""
    return json.dumps(text)


def prompt_template_jinja(template: PromptTemplate, *, bos: str = "") -> str:
    """The jinja chat template of a `PromptTemplate` (see the module docstring); ``bos``: the
    text of the ids the tokenizer begins every text with, rendered first."""
    before, after = template.instruction.split("{instruction}")
    lit = jinja_literal
    return (
        (f"{{{{- {lit(bos)} }}}}" if bos else "")
        + "{%- if messages and messages[0]['role'] == 'system' -%}"
        "{{ messages[0]['content'] }}{%- set turns = messages[1:] -%}"
        f"{{%- else -%}}{{{{ {lit(template.system)} }}}}{{%- set turns = messages -%}}"
        "{%- endif -%}"
        "{%- for m in turns -%}"
        "{%- if m['role'] == 'user' -%}"
        f"{{{{ {lit(before)} + m['content'] + {lit(after)} }}}}"
        f"{{%- if not loop.last or add_generation_prompt -%}}{{{{ {lit(template.response)} }}}}"
        "{%- endif -%}"
        "{%- else -%}{{ m['content'] }}{%- endif -%}"
        "{%- endfor -%}"
    )


def run_chat_jinja(
    run_cfg: dict[str, Any], run_dir: str | os.PathLike, tokenizer: Any = None
) -> str | None:
    """The jinja chat template of a run: its fine-tuning template converted (after the BOS
    ``tokenizer``, the run's, begins a text with), else the model's own chat template's source;
    None for a run with neither (a base model)."""
    from gptkiln.tokenizers import leading_ids

    template = run_template(run_cfg, Path(run_dir))
    if isinstance(template, PromptTemplate):
        lead = leading_ids(tokenizer) if tokenizer is not None else []
        return prompt_template_jinja(template, bos=tokenizer.decode(lead) if lead else "")
    if isinstance(template, ChatTemplate):
        return template.source
    return None
