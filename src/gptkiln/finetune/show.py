"""``gptkiln finetune ... --show-examples N``: the first N training examples of a task as the
trainer sees them, the learnt tokens marked, without training: the way to check a template and
a loss mask before spending hours.

As text, the learnt parts are between « and » (chat: the template's own text, piece by piece;
instruct and dpo: the tokens decoded, run by run); with ``as_json``, one JSON object a line,
``{"ids": [...], "trained": [true, false, ...]}``, ``trained[i]`` saying whether ``ids[i]`` is a
target of the loss. A DPO pair is two examples, its chosen then its rejected answer (each with
the prompt, only the answer learnt), and its JSON lines carry ``"answer": "chosen"`` or
``"rejected"`` besides.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from gptkiln.config import FinetuneConfig
from gptkiln.errors import GptkilnError

MARK_START, MARK_END = "«", "»"  # around the learnt text


def show_examples(ft: FinetuneConfig, n: int, as_json: bool = False) -> Iterator[str]:
    """The first ``n`` training examples of ``ft`` (instruct, chat or dpo), each as text with
    the learnt parts between « and », or with ``as_json`` one JSON object a line."""
    from gptkiln.loading import load_run_tokenizer, read_config

    if ft.task not in SHOWN:
        raise GptkilnError(
            f"--show-examples shows token sequences (--task instruct, chat or dpo); "
            f"--task {ft.task} trains on texts and labels"
        )
    base = Path(ft.base)
    base_cfg = read_config(base)
    tokenizer = load_run_tokenizer(base, base_cfg)
    shown, wanted = 0, n * (2 if ft.task == "dpo" else 1)  # a pair is two rows
    said = unsaid = 0  # rows the trainer drops: said (as many as are shown at most), counted
    for number, (label, text, ids, trained) in enumerate(SHOWN[ft.task](ft, base_cfg, tokenizer)):
        if shown == wanted:
            break
        what = f"pair {number // 2 + 1}, {label}" if label else f"example {number + 1}"
        if ids is None:  # the trainer drops it (too long): said, not counted among the N
            if said == wanted:
                unsaid += 1
            elif not as_json:
                yield f"--- {what}: dropped, {text} ---"
            said += said < wanted
            continue
        shown += 1
        if as_json:
            answer = {} if label is None else {"answer": label}
            yield json.dumps({**answer, "ids": ids, "trained": trained})
            continue
        text = text if text is not None else marked(tokenizer, ids, trained)
        yield f"--- {what}: {len(ids)} tokens, {sum(trained)} trained ---\n{text}"
    unit = "pair" if ft.task == "dpo" else "example"
    if unsaid and not as_json:
        yield f"--- {unsaid // (2 if ft.task == 'dpo' else 1)} more {unit}s dropped, not shown ---"
    if not shown and said:  # as training refuses it
        raise GptkilnError(
            f"--data {ft.data}: no {unit} fits: the trainer drops every one (too long); raise "
            "--max-length or shorten them"
        )


def marked(tokenizer, ids: Sequence[int], trained: Sequence[bool]) -> str:
    """The ids decoded run by run, each learnt run between « and »."""
    out, start = [], 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or trained[end] != trained[start]:
            text = tokenizer.decode(list(ids[start:end]))
            out.append(f"{MARK_START}{text}{MARK_END}" if trained[start] else text)
            start = end
    return "".join(out)


def _context(ft: FinetuneConfig, base_cfg: dict) -> int:
    """The base's context length, from its config and the weights' headers alone (any base: a
    run, a Hugging Face directory)."""
    from gptkiln.loading.load import read_stored

    return read_stored(Path(ft.base), base_cfg, headers_only=True).config.context_length


def _limit(ft: FinetuneConfig, base_cfg: dict) -> int:
    """The most ids an example may hold in training (`chat.example_limit`)."""
    from gptkiln.finetune.chat import example_limit

    return example_limit(ft, _context(ft, base_cfg))


def _chat(ft: FinetuneConfig, base_cfg: dict, tokenizer):
    """Each conversation as training sees it: cut at the last turn that fits the limit
    (`chat.fit_length`; then shown as its ids), or dropped where its first answer does not."""
    from gptkiln.finetune.chat import fit_length, read_chat_examples

    encoder, conversations, examples, _ = read_chat_examples(ft, Path(ft.base), base_cfg, tokenizer)
    limit = _limit(ft, base_cfg)
    for messages, example in zip(conversations, examples, strict=True):
        fitted = fit_length(example, limit)
        if fitted is None:
            yield None, f"its first answer ends past {limit - 1} tokens", None, None
        elif fitted is not example:  # cut: the ids decoded, not the template's pieces
            yield None, None, fitted.ids, fitted.trained
        else:
            pieces = encoder.pieces(messages)
            text = "".join(f"{MARK_START}{t}{MARK_END}" if learnt else t for t, learnt in pieces)
            yield None, text, example.ids, example.trained


def _instruct(ft: FinetuneConfig, base_cfg: dict, tokenizer):
    """Each entry as training sees it: cut to the context, or dropped where (with
    ``--mask-prompt``) its prompt fills it (`instruct.fitted_example`)."""
    from gptkiln.finetune.data import read_instructions
    from gptkiln.finetune.instruct import encode_entries, fitted_example
    from gptkiln.finetune.templates import load_template

    if tokenizer.eot_id is None:
        raise GptkilnError(f"{ft.base}'s tokenizer has no end-of-text token to end examples with")
    template = load_template(ft.template)
    ids, prompt_lengths = encode_entries(ft, tokenizer, template, read_instructions(ft.data))
    context = _context(ft, base_cfg)
    for i, example in enumerate(ids):
        prompt_len = None if prompt_lengths is None else prompt_lengths[i]
        fitted = fitted_example(example, prompt_len, tokenizer.eot_id, context)
        if fitted is None:
            yield None, f"its prompt fills the context of {context} tokens", None, None
        else:
            yield None, None, fitted.ids, fitted.trained


def _dpo(ft: FinetuneConfig, base_cfg: dict, tokenizer):
    from gptkiln.finetune.chat import ConversationEncoder, conversation_template
    from gptkiln.finetune.data import encoded_records, read_preferences
    from gptkiln.finetune.dpo import encode_pair

    template = conversation_template(ft, Path(ft.base), base_cfg, tokenizer)
    encoder = ConversationEncoder(template, tokenizer)
    limit = _limit(ft, base_cfg)
    pairs = read_preferences(ft.data)
    for i, pair in enumerate(pairs):
        (examples,) = encoded_records(  # (named by its line where the template fails)
            ft.data, "preference pairs", [pair], lambda p: encode_pair(encoder, p), first=i
        )
        longest = max(len(e.ids) for e in examples)
        for label, example in zip(("chosen", "rejected"), examples, strict=True):
            if longest > limit:  # the trainer drops the pair whole
                yield (
                    label,
                    f"the pair's longer conversation (prompt and answer) is {longest - 1} "
                    f"tokens, past {limit - 1}",
                    None,
                    None,
                )
            else:
                yield label, None, example.ids, example.trained


SHOWN = {"chat": _chat, "instruct": _instruct, "dpo": _dpo}
