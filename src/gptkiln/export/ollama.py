"""The Ollama Modelfile written beside every GGUF (``NAME.Modelfile`` for ``NAME.gguf``):
``FROM`` the file, the chat template in Ollama's template language (Go's ``text/template``) for
the templates gptkiln knows, a ``PARAMETER stop`` for every stop token and stop string, and the
sampling the run's generation_config.json asks for (Qwen3's temperature 0.6, top-k 20, top-p
0.95) as Ollama's parameters, which `ollama run` and its API then use unless a request says.

The templates: an instruction-tuned run's `PromptTemplate` (the book's Alpaca format or a
template file: the system text, each user message as its instruction part and the response
header, each assistant message as it is), ChatML (Qwen's ``<|im_start|>role``), and Llama 3's
headers; a base model's is the prompt as it is (``{{ .Prompt }}``). Every literal piece of text
is written as a Go string literal, so no text of a template can be read as template code.

Use: ``ollama create NAME -f NAME.Modelfile``, then ``ollama run NAME``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gptkiln.export.files import write_text
from gptkiln.export.gguf_vocab import GGUFVocab


def go(text: str) -> str:
    """``text`` printed by a Go template: a string literal action (JSON's escapes are Go's; any
    other character as it is, since Go reads no surrogate pair); nothing for no text."""
    return "{{ " + json.dumps(text, ensure_ascii=False) + " }}" if text else ""


def chatml(end_of_turn: str = "<|im_end|>") -> str:
    """ChatML in Ollama's template language, each turn ended by ``end_of_turn`` (Qwen's
    ``<|im_end|>``; gptkiln's ChatML for a model without a template of its own ends a turn with
    the tokenizer's end-of-text token, `finetune.templates.chatml_template`)."""
    return (
        "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}"
        f"{go(end_of_turn)}\n{{{{ end }}}}<|im_start|>assistant\n"
    )


CHATML = chatml()
LLAMA3 = (
    "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n"
    "{{ .Content }}<|eot_id|>{{ end }}<|start_header_id|>assistant<|end_header_id|>\n\n"
)
PLAIN = "{{ .Prompt }}"


def prompt_template_go(template: Any) -> str:
    """A `PromptTemplate` in Ollama's template language (see the module docstring)."""
    before, after = template.instruction.split("{instruction}")
    return (
        f"{{{{- if .System }}}}{{{{ .System }}}}{{{{ else }}}}{go(template.system)}{{{{ end }}}}"
        "{{- range .Messages }}"
        f'{{{{- if eq .Role "user" }}}}{go(before)}{{{{ .Content }}}}{go(after)}'
        f"{go(template.response)}"
        '{{- else if eq .Role "assistant" }}{{ .Content }}{{- end }}'
        "{{- end }}"
    )


def ollama_template(chat: str | None, cfg: dict[str, Any], run_dir: Path) -> str | None:
    """The Modelfile's TEMPLATE for a run, None for a chat template gptkiln does not know (Ollama
    then reads the GGUF's own)."""
    from gptkiln.finetune.runs import run_template
    from gptkiln.finetune.templates import PromptTemplate

    template = run_template(cfg, run_dir)
    if isinstance(template, PromptTemplate):
        return prompt_template_go(template)
    if chat is None:
        return PLAIN
    if "<|im_start|>" in chat:
        end = chatml_turn_end(chat)
        return None if end is None else chatml(end)
    if "<|start_header_id|>" in chat:
        return LLAMA3
    return None


def chatml_turn_end(chat: str) -> str | None:
    """What ends a turn in a ChatML template (``<|im_end|>``, or the end-of-text token of
    gptkiln's own ChatML), read from the text it renders; None where it renders no plain ChatML
    turn."""
    from gptkiln.chat_template import ChatTemplate
    from gptkiln.errors import GptkilnError

    probe = "gptkiln-probe"
    try:
        text = ChatTemplate(chat).render([{"role": "user", "content": probe}])
    except GptkilnError:
        return None
    start = text.find(f"<|im_start|>user\n{probe}")
    end = text.find("\n<|im_start|>assistant\n", start)
    if start < 0 or end < 0:
        return None
    return text[start + len(f"<|im_start|>user\n{probe}") : end] or None


def modelfile_value(text: str) -> str | None:
    """``text`` as a Modelfile value: Ollama's parser takes what is between ``"`` or ``\"\"\"``
    as it is (no escapes), so a quote picks the delimiter; None for text that neither holds."""
    if '"' not in text:
        return f'"{text}"'
    if '"""' not in text:
        return f'"""{text}"""'
    return None


OLLAMA_SAMPLING = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repeat_penalty",  # Ollama's looks back 64 tokens (repeat_last_n)
}
"""`config.sample.model_sampling`'s settings by the names of Ollama's Modelfile parameters."""


def sampling_parameters(run_dir: Path) -> list[str]:
    """``PARAMETER`` lines of the sampling a run's generation_config.json asks for (``do_sample``
    false: temperature 0, greedy); none where it asks for none (Ollama's defaults then)."""
    from gptkiln.config.sample import model_sampling

    settings = model_sampling(run_dir)
    if not settings:
        return []
    lines = ["# sampling: as the run's generation_config.json asks"]
    return lines + [f"PARAMETER {OLLAMA_SAMPLING[k]} {v}" for k, v in settings.items()]


def modelfile_text(
    gguf_name: str, vocab: GGUFVocab, chat: str | None, cfg: dict[str, Any], run_dir: Path
) -> str:
    """The Modelfile of ``gguf_name`` (a file beside it)."""
    from gptkiln.finetune.runs import run_template
    from gptkiln.finetune.templates import PromptTemplate

    name = Path(gguf_name).stem
    lines = [
        f"# Ollama: ollama create {name} -f {name}.Modelfile && ollama run {name}",
        f"FROM ./{gguf_name}",
    ]
    template = ollama_template(chat, cfg, run_dir)
    if template is None:
        lines.append("# TEMPLATE: the GGUF's own chat template (tokenizer.chat_template)")
    else:
        lines.append(f'TEMPLATE """{template}"""')
    stops = [vocab.tokens[i] for i in vocab.stop_ids]
    prompt = run_template(cfg, run_dir)
    if isinstance(prompt, PromptTemplate):
        stops += list(prompt.stop_strings())
    for stop in dict.fromkeys(stops):
        value = modelfile_value(stop)
        if value is None:
            lines.append(f"# a stop Ollama's Modelfile cannot hold (its quotes): {stop!r}")
        else:
            lines.append(f"PARAMETER stop {value}")
    return "\n".join(lines + sampling_parameters(run_dir)) + "\n"


def modelfile_path(gguf_file: Path) -> Path:
    return gguf_file.with_name(gguf_file.stem + ".Modelfile")


def write_modelfile(
    gguf_file: Path, vocab: GGUFVocab, chat: str | None, cfg: dict[str, Any], run_dir: Path
) -> Path:
    """Write the Modelfile beside ``gguf_file`` (atomically); its path."""
    path = modelfile_path(gguf_file)
    write_text(path, modelfile_text(gguf_file.name, vocab, chat, cfg, run_dir))
    return path
