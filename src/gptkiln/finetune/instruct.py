"""Instruction fine-tuning (the book's chapter 7): entries in a prompt template, batches padded
with end-of-text, next-token loss on the example (or, with ``mask_prompt``, on its response).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from gptkiln.config import FinetuneConfig, SampleConfig
from gptkiln.errors import GptkilnError
from gptkiln.finetune.task import IGNORE_INDEX, Example, FineTuning
from gptkiln.finetune.templates import format_example, format_prompt, load_template
from gptkiln.tokenizers import leading_ids
from gptkiln.train.task import RunContext


def collate_instructions(
    batch: Sequence[Sequence[int]],
    pad_id: int,
    max_length: int | None = None,
    prompt_lengths: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (B, T), for examples of token ids, as the book's chapter 7
    builds them (its ``custom_collate_fn``).

    Every example is followed by one end-of-text token (``pad_id``), which is its last target,
    so the model learns to stop; the batch is padded to the longest with ``pad_id``, whose
    further targets are ``-100`` (ignored by the loss). T is the longest example's length, cut
    to ``max_length`` (the model's context). With ``prompt_lengths`` (one per example) the
    targets of the prompt's tokens are ``-100`` too, so only the response is learnt.
    """
    longest = max(len(ids) for ids in batch)  # + its end-of-text, - the shift of the targets
    inputs = torch.full((len(batch), longest), pad_id, dtype=torch.long)
    targets = torch.full((len(batch), longest), IGNORE_INDEX, dtype=torch.long)
    for row, ids in enumerate(batch):
        n = len(ids)
        inputs[row, :n] = torch.as_tensor(ids, dtype=torch.long)
        targets[row, : n - 1] = inputs[row, 1:n]
        targets[row, n - 1] = pad_id  # end of text: the first padding token is a target
        if prompt_lengths is not None:
            targets[row, : prompt_lengths[row] - 1] = IGNORE_INDEX
    return inputs[:, :max_length], targets[:, :max_length]


def prompt_length(prompt_ids: Sequence[int], example_ids: Sequence[int]) -> int:
    """How many of an example's ids are its prompt's: the ids the two encodings share, and one
    more when a token of the example straddles the end of the prompt."""
    n = 0
    for x, y in zip(prompt_ids, example_ids, strict=False):
        if x != y:
            break
        n += 1
    return n + (n < len(prompt_ids))


def encode_entries(
    ft: FinetuneConfig, tokenizer, template, entries: list[dict]
) -> tuple[list[list[int]], list[int] | None]:
    """Each entry's ids (prompt and output encoded together, as the book does, after the ids
    the tokenizer begins every text with: Llama 3's BOS, as a prompt is encoded to generate)
    and, with ``ft.mask_prompt``, how many of them are the prompt's."""
    lead = leading_ids(tokenizer)
    texts = [format_example(template, e) for e in entries]
    try:
        ids = [lead + x for x in tokenizer.encode_ordinary_batch(texts)]
    except GptkilnError as e:
        raise GptkilnError(f"--data {ft.data}: {e}") from None
    if not ft.mask_prompt:
        return ids, None
    prompts = [format_prompt(template, e["instruction"], e["input"]) for e in entries]
    prompt_ids = [lead + x for x in tokenizer.encode_ordinary_batch(prompts)]
    return ids, [prompt_length(p, i) for p, i in zip(prompt_ids, ids, strict=True)]


def learnt_ids(
    ids: Sequence[int], prompt_len: int | None, end_id: int
) -> tuple[list[int], list[bool]]:
    """(an example's ids with its end-of-text, whether each is learnt) as
    `collate_instructions` makes its targets: all but the first; with ``prompt_len``, the
    response's only."""
    first = 1 if prompt_len is None else prompt_len
    return [*ids, end_id], [j >= first for j in range(len(ids) + 1)]


def fitted_example(
    ids: Sequence[int], prompt_len: int | None, end_id: int, ctx_len: int
) -> Example | None:
    """An example as training sees it (`learnt_ids`, cut to the context: ``ctx_len`` inputs
    and their targets); None when nothing of it is left to learn, a ``--mask-prompt`` prompt
    that fills the context (its batch's loss would be 0 / 0)."""
    shown, trained = learnt_ids(ids, prompt_len, end_id)
    example = Example(shown[: ctx_len + 1], trained[: ctx_len + 1])
    return example if any(example.trained) else None


class InstructionTuning(FineTuning):
    """`Task` of instruction fine-tuning; the split is the book's: the first 1 - val - test of
    the entries train, the next ``test_fraction`` are the test set, the last the validation set.
    """

    columns = ("train_loss", "val_loss")
    plots = ("loss",)

    def __init__(self, ctx: RunContext, ft: FinetuneConfig):
        from gptkiln.finetune.data import check_splits, read_instructions, split_sizes

        super().__init__(ctx, ft)
        self.template = load_template(ft.template)
        entries = read_instructions(ft.data)
        check_splits(
            ft.data,
            len(entries),
            split_sizes(len(entries), ft.val_fraction, ft.test_fraction),
            ft.val_fraction,
        )
        self.pad_id = self.tokenizer.eot_id
        if self.pad_id is None:
            raise GptkilnError(
                f"{ft.base}'s {self.tokenizer.kind} tokenizer has no end-of-text token, which "
                "ends each example (so the model learns to stop); fine-tune a model whose "
                "tokenizer has one (gpt2, bpe, or char prepared from several documents)"
            )
        self.ids, self.prompt_lengths = encode_entries(ft, self.tokenizer, self.template, entries)
        self.build_model(self.ids)
        self.ctx_len = self.model_config.context_length
        entries = self._drop_unlearnable(entries)  # the split is of the entries kept
        sizes = split_sizes(len(entries), ft.val_fraction, ft.test_fraction)
        check_splits(ft.data, len(entries), sizes, ft.val_fraction)
        n_train, n_val, n_test = sizes
        self.split = {"train": n_train, "val": n_val, "test": n_test}
        self.set_example_batches(n_train, n_test, len(entries))
        self.held_out = entries[self.val_ids[0]]
        self.say_what_trains()
        self._note_long_examples(self.ctx_len)

    def collate(self, ids: Sequence[int]):
        lengths = None if self.prompt_lengths is None else [self.prompt_lengths[i] for i in ids]
        batch = [self.ids[i] for i in ids]
        return collate_instructions(batch, self.pad_id, self.ctx_len, lengths)

    def width(self, ids: Sequence[int]) -> int:
        return min(max(len(self.ids[i]) for i in ids), self.ctx_len)

    def _drop_unlearnable(self, entries: list[dict]) -> list[dict]:
        """The entries that leave a token to learn in the context (`fitted_example`); with
        ``--mask-prompt``, those whose prompt fills it are dropped, as chat drops a
        conversation whose first answer does not fit, and counted in a line."""
        self.dropped: list[int] = []
        if self.prompt_lengths is None:
            return entries
        self.dropped = [i for i in range(len(entries)) if self.example(i) is None]
        if not self.dropped:
            return entries
        ft, n = self.ft, len(entries)
        if len(self.dropped) == n:
            raise GptkilnError(
                f"--data {ft.data}: with --mask-prompt no entry's prompt leaves a response token "
                f"inside the model's context of {self.ctx_len} tokens, so there is nothing to "
                "learn; shorten the prompts or the template, or leave out --mask-prompt"
            )
        gone = set(self.dropped)
        keep = [i for i in range(n) if i not in gone]
        self.ids = [self.ids[i] for i in keep]
        self.prompt_lengths = [self.prompt_lengths[i] for i in keep]
        if self.ctx.world.is_main:
            print(
                f"note: {len(gone):,} of {n:,} entries dropped: with --mask-prompt their prompt "
                f"fills the model's context of {self.ctx_len} tokens, leaving no response token "
                "to learn",
                file=sys.stderr,
            )
        return [entries[i] for i in keep]

    def example(self, i: int) -> Example | None:
        """As `collate_instructions` learns it: with its end-of-text, cut to the context (None:
        nothing of it left to learn, `fitted_example`)."""
        prompt_len = None if self.prompt_lengths is None else self.prompt_lengths[i]
        return fitted_example(self.ids[i], prompt_len, self.pad_id, self.ctx_len)

    def pack_width(self) -> int:
        return self.ctx_len

    def _note_long_examples(self, ctx_len: int) -> None:
        long = sum(len(i) + 1 > ctx_len for i in self.ids)
        if long and self.ctx.world.is_main:
            print(
                f"note: {long:,} of {len(self.ids):,} examples are longer than the model's "
                f"context of {ctx_len} tokens (with their end-of-text); they are cut there, so "
                "their ends are not learnt",
                file=sys.stderr,
            )

    def task_info(self) -> dict:
        return {"template": self.template.to_dict(), "pad_id": self.pad_id, "dropped": self.dropped}

    # -- what the loop asks --------------------------------------------------------------------
    def sample(self, model, use_cache: bool) -> str:
        """The greedy response to the first validation entry (held out from training)."""
        from gptkiln.api import stream_from_model

        e = self.held_out
        prompt = format_prompt(self.template, e["instruction"], e["input"])
        cfg = SampleConfig(
            max_new_tokens=self.cfg.sample_tokens, temperature=0, stop=self.template.stop_strings()
        )
        response = "".join(stream_from_model(model, self.tokenizer, prompt, cfg))
        return prompt.removeprefix(self.template.system).lstrip("\n") + response
