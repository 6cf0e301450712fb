"""Chat fine-tuning: conversations (``messages``, or ShareGPT's ``conversations``) rendered by the
model's own chat template, next-token loss on the assistant's turns only.

Each conversation is written by the template (`templates.conversation_pieces`) into pieces that
are the template's (headers, the system and user turns) or the assistant's (each answer with its
end-of-turn token), encoded piece by piece (an answer's first token is the one the model writes
after the prompt a server sends it), and learnt where the assistant speaks. A model without a
chat template gets gptkiln's ChatML one, which the run keeps (``chat_template.jinja``), so that
``chat``, ``serve`` and the export speak to it as it was trained.

A conversation longer than ``max_length`` tokens (default: the context) is cut after its last
assistant turn that fits, or dropped when its first answer does not fit; both are counted in
the lines the run starts with.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from gptkiln.chat_template import CHAT_TEMPLATE_FILE, ChatTemplate
from gptkiln.config import FinetuneConfig, SampleConfig
from gptkiln.errors import GptkilnError
from gptkiln.finetune.task import IGNORE_INDEX, Example, FineTuning
from gptkiln.finetune.templates import (
    Piece,
    PromptTemplate,
    chatml_template,
    conversation_pieces,
    format_messages,
)
from gptkiln.tokenizers import leading_ids
from gptkiln.train.task import RunContext


def conversation_template(ft: FinetuneConfig, base: Path, base_cfg: dict, tokenizer):
    """The template a chat (or DPO) run renders with: ``--template FILE.jinja``; else the base's
    (the prompt template of an instruction-tuned run, or the model's chat template); else
    gptkiln's ChatML, each turn ended by the tokenizer's end-of-text token."""
    from gptkiln.finetune.runs import run_template

    if ft.template.endswith(".jinja"):
        path = Path(ft.template)
        if not path.is_file():
            raise GptkilnError(f"--template {path}: no such file; give a jinja2 chat template")
        template = ChatTemplate(
            path.read_text(encoding="utf-8"), dict(tokenizer_special_tokens(tokenizer)), str(path)
        )
    elif ft.template != "alpaca":
        raise GptkilnError(
            f"--template {ft.template}: --task {ft.task} renders with the model's chat template; "
            "give a .jinja file to use another"
        )
    else:
        template = run_template(base_cfg, base)
        if isinstance(template, ChatTemplate):  # a chat-tuned run keeps no tokenizer_config.json
            named = {**tokenizer_special_tokens(tokenizer), **template.special_tokens}
            template = dataclasses.replace(template, special_tokens=named)
    if template is None:
        if tokenizer.eot_id is None:
            raise GptkilnError(
                f"{base} has no chat template and its {tokenizer.kind} tokenizer no end-of-text "
                "token to end turns with; give one with --template FILE.jinja"
            )
        template = chatml_template(tokenizer.decode([tokenizer.eot_id]))
    return template


def tokenizer_special_tokens(tokenizer) -> dict[str, str]:
    """The named special tokens (``eos_token`` ...) a template sees, from a Hugging Face
    tokenizer; for another kind, its end-of-text token as ``eos_token``."""
    named = dict(getattr(tokenizer, "special_tokens", {}) or {})
    if "eos_token" not in named and tokenizer.eot_id is not None:
        named["eos_token"] = tokenizer.decode([tokenizer.eot_id])
    return named


def turn_end(template: ChatTemplate, tokenizer) -> str | None:
    """The special token ``template`` writes right after an assistant's words (Qwen3's
    ``<|im_end|>``, Llama 3's ``<|eot_id|>``), or None where it writes none there. A base
    model's tokenizer may name another EOS (Qwen3-Base's ``<|endoftext|>``) than its
    template's end of turn, which is what a chat-tuned model must learn to write."""
    words = "gptkiln-turn-end"
    turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": words}]
    try:
        whole = template.render(turn, add_generation_prompt=False)
    except GptkilnError:
        return None
    after = whole[whole.rfind(words) + len(words) :] if words in whole else ""
    specials = sorted({tokenizer.decode([i]) for i in tokenizer.special_ids}, key=len)
    return next((t for t in reversed(specials) if t and after.startswith(t)), None)


class ConversationEncoder:
    """Conversations into `Example`s: rendered by ``template``, each piece encoded on its own.

    A chat template's assistant turns end with its own end-of-turn token (`turn_end`), else
    the tokenizer's EOS; ``end_id`` is its id, which a run of this tokenizer must stop at
    (`with_turn_end`)."""

    def __init__(self, template: PromptTemplate | ChatTemplate, tokenizer):
        self.template, self.tokenizer = template, tokenizer
        self.chat = isinstance(template, ChatTemplate)
        self.end_id = tokenizer.eot_id
        if self.chat:
            self.end = turn_end(template, tokenizer) or template.special_tokens.get("eos_token")
            if not self.end:
                raise GptkilnError(
                    f"{template.where}: the tokenizer names no eos_token, which ends the "
                    "assistant's turns; add it to tokenizer_config.json"
                )
            ids = tokenizer.encode_templated(self.end)
            self.end_id = ids[0] if len(ids) == 1 else tokenizer.eot_id
        elif tokenizer.eot_id is None:
            raise GptkilnError(
                f"the {tokenizer.kind} tokenizer has no end-of-text token to end answers with"
            )
        # a prompt template's text begins as the tokenizer begins any (Llama 3's BOS, as a
        # prompt is encoded to generate); a chat template writes its own
        self.lead = [] if self.chat else leading_ids(tokenizer)

    def with_turn_end(self, tokenizer, run: str | os.PathLike):
        """``tokenizer`` stopping at this template's end of turn too, where it is not among its
        stop ids (a base model's tokenizer: its EOS ends a text, not a turn), with a note."""
        if self.end_id is None or self.end_id in tokenizer.stop_ids:
            return tokenizer
        if not hasattr(tokenizer, "with_stop_id"):
            return tokenizer
        eos = tokenizer.decode([tokenizer.eot_id]) if tokenizer.eot_id is not None else "none"
        print(
            f"note: the chat template ends each turn with {self.end!r}, not the tokenizer's "
            f"EOS {eos!r}: the answers are trained to end with it, and {run} stops there "
            "(it is added to its generation_config.json's eos_token_id, as TRL's eos_token does)",
            file=sys.stderr,
        )
        return tokenizer.with_stop_id(self.end_id)

    def pieces(self, messages: Sequence[dict]) -> list[Piece]:
        return conversation_pieces(self.template, messages, self.end if self.chat else "")

    def encode(self, messages: Sequence[dict]) -> Example:
        ids: list[int] = list(self.lead)
        trained: list[bool] = [False] * len(ids)
        pieces = self.pieces(messages)
        for number, (text, learnt) in enumerate(pieces):
            piece_ids = self._encode(text)
            if not self.chat and learnt and number == len(pieces) - 1:
                piece_ids.append(self.tokenizer.eot_id)  # the answer ends: the model stops
            ids += piece_ids
            trained += [learnt] * len(piece_ids)
        return Example(ids, trained)

    def _encode(self, text: str) -> list[int]:
        if self.chat:
            return self.tokenizer.encode_templated(text)
        return self.tokenizer.encode_ordinary_batch([text])[0]

    def prompt(self, messages: Sequence[dict]) -> str:
        """The text a model answers ``messages`` (ending with a user turn) after."""
        if self.chat:
            return self.template.render(messages, add_generation_prompt=True)
        return format_messages(self.template, messages)


def fit_length(example: Example, max_tokens: int) -> Example | None:
    """``example`` if it holds at most ``max_tokens`` ids; else cut after its last trained run
    that ends within them (a turn boundary), or None when none does."""
    if len(example.ids) <= max_tokens:
        return example
    cut = 0
    for i in range(1, max_tokens + 1):
        if example.trained[i - 1] and (i == len(example.ids) or not example.trained[i]):
            cut = i
    if cut == 0:
        return None
    return Example(example.ids[:cut], example.trained[:cut])


def example_limit(ft: FinetuneConfig, context_length: int) -> int:
    """The most ids an example may hold: ``--max-length`` (default: the context) input tokens,
    plus the last target."""
    if ft.max_length is not None and ft.max_length > context_length:
        raise GptkilnError(
            f"--max-length {ft.max_length}: the model's context is {context_length} tokens; "
            f"pass at most {context_length}"
        )
    return (ft.max_length or context_length) + 1


def collate_examples(batch: Sequence[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (B, T): T is the longest example's length - 1; a target is the
    next id where that id is learnt, else -100 (padding too)."""
    longest = max(len(e.ids) for e in batch) - 1
    inputs = torch.full((len(batch), longest), pad_id, dtype=torch.long)
    targets = torch.full((len(batch), longest), IGNORE_INDEX, dtype=torch.long)
    for row, e in enumerate(batch):
        ids = torch.as_tensor(e.ids, dtype=torch.long)
        n = len(e.ids) - 1
        inputs[row, :n] = ids[:-1]
        learnt = torch.as_tensor(e.trained[1:], dtype=torch.bool)
        targets[row, :n] = torch.where(learnt, ids[1:], IGNORE_INDEX)
    return inputs, targets


def read_chat_examples(ft: FinetuneConfig, base: Path, base_cfg: dict, tokenizer):
    """(encoder, conversations, their examples, the data's format) of ``ft.data``."""
    from gptkiln.finetune.data import encoded_records, read_conversations

    conversations, fmt = read_conversations(ft.data)
    encoder = ConversationEncoder(conversation_template(ft, base, base_cfg, tokenizer), tokenizer)
    examples = encoded_records(ft.data, "conversations", conversations, encoder.encode)
    return encoder, conversations, examples, fmt


class ChatTuning(FineTuning):
    """`Task` of chat fine-tuning; the split is instruct's (train, test, validation)."""

    columns = ("train_loss", "val_loss")
    plots = ("loss",)

    def __init__(self, ctx: RunContext, ft: FinetuneConfig):
        from gptkiln.finetune.data import check_splits, split_sizes
        from gptkiln.loading import read_config

        super().__init__(ctx, ft)
        base = Path(ft.base)
        self.encoder, conversations, examples, fmt = read_chat_examples(
            ft, base, read_config(base), self.tokenizer
        )
        self.tokenizer = self.encoder.with_turn_end(self.tokenizer, ctx.run_dir)
        self.pad_id = self.tokenizer.eot_id if self.tokenizer.eot_id is not None else 0
        self.build_model(e.ids for e in examples)
        max_tokens = example_limit(ft, self.model_config.context_length)
        fitted = [fit_length(e, max_tokens) for e in examples]
        cut = sum(f is not None and f is not e for f, e in zip(fitted, examples, strict=True))
        kept = [(c, f) for c, f in zip(conversations, fitted, strict=True) if f is not None]
        if not kept:
            raise GptkilnError(
                f"--data {ft.data}: no conversation's first answer fits in {max_tokens - 1} "
                "tokens; raise --max-length (at most the context) or give shorter conversations"
            )
        self.max_tokens = max_tokens
        self.conversations = [c for c, _ in kept]
        self.examples = [f for _, f in kept]
        self.dropped = [i for i, f in enumerate(fitted) if f is None]  # the split is of the rest
        sizes = split_sizes(len(kept), ft.val_fraction, ft.test_fraction)
        check_splits(ft.data, len(kept), sizes, ft.val_fraction)
        n_train, n_val, n_test = sizes
        self.split = {"train": n_train, "val": n_val, "test": n_test}
        self.note = (
            f"chat data: {len(examples):,} conversations ({fmt} format), rendered by "
            f"{self._template_name()}; {cut:,} cut at a turn boundary and "
            f"{len(examples) - len(kept):,} dropped (first answer too long) to fit "
            f"{max_tokens - 1} tokens"
        )
        if ctx.world.is_main:
            print(self.note, file=sys.stderr, flush=True)
        self.set_example_batches(n_train, n_test, len(self.examples))
        self.say_what_trains()

    def _template_name(self) -> str:
        t = self.encoder.template
        return t.where if isinstance(t, ChatTemplate) else "the run's prompt template"

    def collate(self, ids: Sequence[int]):
        return collate_examples([self.examples[i] for i in ids], self.pad_id)

    def width(self, ids: Sequence[int]) -> int:
        return max(len(self.examples[i].ids) - 1 for i in ids)

    def example(self, i: int) -> Example:
        return self.examples[i]

    def pack_width(self) -> int:
        return self.max_tokens - 1

    def task_info(self) -> dict:
        t = self.encoder.template
        template = t.to_dict() if isinstance(t, PromptTemplate) else None
        return {
            "template": template,
            "pad_id": self.pad_id,
            "chat_template": self._jinja(),
            "dropped": self.dropped,
        }

    def _jinja(self) -> str | None:
        """The chat template's file in the run (None: the run keeps a prompt template)."""
        return CHAT_TEMPLATE_FILE if isinstance(self.encoder.template, ChatTemplate) else None

    def save(self, model_sd: dict, state: dict, train_config: dict) -> None:
        save_chat_template(self.run_dir, self.encoder.template)
        super().save(model_sd, state, train_config)

    # -- what the loop asks --------------------------------------------------------------------
    def sample(self, model, use_cache: bool) -> str:
        """The greedy first answer to the first validation conversation (held out)."""
        from gptkiln.api import stream_from_model

        messages = self.conversations[self.val_ids[0]]
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        prompt = self.encoder.prompt(messages[:first])
        cfg = SampleConfig(max_new_tokens=self.cfg.sample_tokens, temperature=0)
        templated = self.encoder.chat
        response = "".join(
            stream_from_model(model, self.tokenizer, prompt, cfg, templated=templated)
        )
        return f"{messages[first - 1]['content']}\n-> {response}"


def save_chat_template(run_dir: Path, template: PromptTemplate | ChatTemplate) -> None:
    """Keep the chat template a run was trained with as its own chat_template.jinja (which
    `chat`, `serve` and the export read first); written before the checkpoint's config.json."""
    from gptkiln import checkpoint

    path = run_dir / CHAT_TEMPLATE_FILE
    if not isinstance(template, ChatTemplate):
        return
    if path.is_file() and path.read_text(encoding="utf-8") == template.source:
        return
    checkpoint.atomic_write(
        path, lambda tmp: Path(tmp).write_text(template.source, encoding="utf-8")
    )
