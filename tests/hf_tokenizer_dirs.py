# ruff: noqa: E501 - the templates keep the long lines of the real ones they copy the shape of
"""Hugging Face tokenizer directories for the tests, written offline: a tiny byte-level BPE
trained with ``tokenizers`` plus added special tokens shaped like Llama 3's and Qwen3's, and a
tokenizer_config.json holding chat templates written in the shape of theirs."""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Don't stop; it's fine!",
    "Hello, world! How are you today? I'm well, thanks.",
    "Rotary embeddings rotate queries and keys by their position.",
    "日本語のテキストも、バイトから始まるので大丈夫です。",
    "system user assistant think answer question 12345 67890",
] * 20

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" if date_string is defined else "" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('Only user and assistant roles follow the system message') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN3_TEMPLATE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
]
QWEN3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN3_NON_SPECIAL = ["<think>", "</think>"]  # added, but normal tokens (special=False) as in Qwen3


def _tokenizer_json(specials: list[str], plain_added: list[str], bos: str | None) -> str:
    """A byte-level BPE of ~400 ids trained on CORPUS, the added tokens after it; with ``bos``
    a post-processor that puts it first (Llama 3's ``TemplateProcessing``)."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain_added])
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, tok.token_to_id(bos))],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok.to_str()


def write_llama3_dir(
    directory: Path, *, template: str = LLAMA3_TEMPLATE, more_specials: tuple[str, ...] = ()
) -> Path:
    """A Llama 3 Instruct-shaped tokenizer: BOS from the post-processor, EOS ``<|eot_id|>``,
    and the generation config's several stop ids (end_of_text, eom, eot); ``more_specials``
    (Llama 3.1's ``<|python_tag|>``) added as special tokens after them."""
    from tokenizers import Tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    text = _tokenizer_json([*LLAMA3_SPECIALS, *more_specials], [], "<|begin_of_text|>")
    (directory / "tokenizer.json").write_text(text, encoding="utf-8")
    ids = {t: Tokenizer.from_str(text).token_to_id(t) for t in LLAMA3_SPECIALS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "clean_up_tokenization_spaces": True,
        "model_max_length": 131072,
        "chat_template": template,
    }
    _write(directory / "tokenizer_config.json", config)
    stops = [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]]
    _write(
        directory / "generation_config.json",
        {"bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": stops},
    )
    _write(
        directory / "config.json",
        {"model_type": "llama", "bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": stops},
    )
    return directory


def write_qwen3_dir(directory: Path, *, template: str = QWEN3_TEMPLATE) -> Path:
    """A Qwen3-shaped tokenizer: no BOS, EOS ``<|im_end|>``, ``<|endoftext|>`` as pad and a
    second stop id, ``<think>`` / ``</think>`` as added non-special tokens."""
    from tokenizers import Tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    text = _tokenizer_json(QWEN3_SPECIALS, QWEN3_NON_SPECIAL, None)
    (directory / "tokenizer.json").write_text(text, encoding="utf-8")
    ids = {t: Tokenizer.from_str(text).token_to_id(t) for t in QWEN3_SPECIALS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "chat_template": template,
    }
    _write(directory / "tokenizer_config.json", config)
    stops = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    _write(directory / "generation_config.json", {"eos_token_id": stops})
    _write(directory / "config.json", {"model_type": "qwen3", "eos_token_id": ids["<|im_end|>"]})
    return directory


def _write(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
