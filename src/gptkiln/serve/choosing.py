"""Each row's next token in the serve batcher: a `Slot` (a sequence in a cache row, with its
generator, its penalty counts and its text) and the `Chooser`, which picks the next tokens of
some slots from their logits, after a decode step or, the first ones, after a prefill.

A row's token comes from `gptkiln.sampling`'s functions (`apply_penalties`, `sample_rows`) on
that row's logits with that row's own generator, and its text from a `TextStream`, exactly as
`generate_stream` does for a batch of one: what a request gets does not depend on what else is
in the batch. A row with a grammar (`constrain.Constraint`) has its logits masked to what the
grammar allows first; the mask is the row's own. The rows that sample alike (one temperature,
top-k, top-p and min-p) are drawn in one call, each from its own logits so prepared and a seeded one
with its own generator's uniform (`Chooser._sampled_together`): the same tokens, one read of
them a group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gptkiln.logits_processors import apply_logit_bias, apply_penalties, apply_token_bitmask
from gptkiln.sampling import sample_rows
from gptkiln.serve.constrain import fill_masks
from gptkiln.serve.events import Done, Event, Failed, Sequence, Token, TokenLogprobs
from gptkiln.text_stream import TextStream

Chosen = list[tuple[Sequence, Event]]
"""Events for their sequences, in the order they happened."""


@dataclass(eq=False)
class Slot:
    """A sequence in a cache row: its position, its generator, its counts and its text."""

    row: int
    seq: Sequence
    stream: TextStream
    generator: torch.Generator | None
    counts: torch.Tensor | None  # (1, V) tokens generated so far, for the penalties
    in_prompt: torch.Tensor | None = None  # (1, V) the prompt's tokens, for repetition_penalty
    pos: int = 0  # tokens in the cache
    token: int = 0  # the last token chosen, fed at the next decode step
    generated: int = 0
    done: bool = False


def failed(slot: Slot, error: Exception) -> Chosen:
    """A row whose own work (its prefill; its sampling and text) failed: it ends with `Failed`
    and the others go on."""
    slot.done = True
    return [
        (slot.seq, Failed(slot.seq.index, f"generation failed: {type(error).__name__}: {error}"))
    ]


def isolated(slot: Slot, work, *args) -> Chosen:
    """``work(*args)``, a row's own work, or that row's `failed` where it raises."""
    try:
        return work(*args)
    except Exception as e:
        return failed(slot, e)


class Chooser:
    """Picks rows' next tokens: grammar masks filled together, the rows that sample alike
    drawn together where `draws_together` says so, each row's token, text and end handed out
    as events (`Token`, then `Done` at its end).

    Args:
        device: the model's device (where a group's draw is read from).
        tokenizer: its ``vocab_size`` is a grammar mask's width (one bit an id).
    """

    def __init__(self, device: torch.device, tokenizer: Any) -> None:
        self.device, self.tokenizer = device, tokenizer

    def _mask_words(self) -> int:
        return (self.tokenizer.vocab_size + 31) // 32

    def next_tokens(self, rows: list[tuple[Slot, torch.Tensor]]) -> Chosen:
        """Each slot's next token from its logits (1, V), in ``rows``' order; a row whose
        sampling or text fails ends with `Failed` alone."""
        masks = self._masks([slot for slot, _ in rows if slot.seq.constraint is not None])
        chosen = self._sampled_together(rows, masks)
        events: Chosen = []
        for slot, logits in rows:
            mask, picked = masks.get(slot.row), chosen.get(slot.row)
            events += isolated(slot, self._choose, slot, logits, mask, picked)
        return events

    def _sampled_together(
        self, rows: list[tuple[Slot, torch.Tensor]], masks: dict[int, torch.Tensor]
    ) -> dict[int, int]:
        """The next tokens of the rows that sample alike, by row: the rows grouped by their
        temperature, top-k, top-p and min-p, each group drawn in one `sample_rows` call and read
        once, where `draws_together` says so (one wait for the device a group, not one a row). Each
        row draws from its own logits' distribution, as alone: its penalties and its grammar's
        mask (``masks``, filled by `_masks`) applied to its own row, a seeded row's uniform from
        its own generator (`sampling.row_uniforms`).
        A row stays alone, in `_choose`, where its grammar's mask is not filled yet (a lone
        constrained row, or one whose grammar failed), in a group of one, or in a group whose
        draw fails (each of its rows then samples, and fails, alone, its generator put back
        where it was)."""
        groups: dict[tuple, list[tuple[Slot, torch.Tensor]]] = {}
        for slot, logits in rows:
            cfg = slot.seq.cfg
            if slot.seq.constraint is None or slot.row in masks:
                key = (cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p)
                groups.setdefault(key, []).append((slot, logits))
        chosen: dict[int, int] = {}
        for (temperature, top_k, top_p, min_p), group in groups.items():
            if len(group) < 2 or not draws_together(self.device, temperature):
                continue
            slots = [slot for slot, _ in group]
            sampled = temperature > 0 and any(s.generator is not None for s in slots)
            generators = [s.generator for s in slots] if sampled else None
            seeded = [g for g in generators or () if g is not None]
            states = [g.get_state() for g in seeded]
            try:
                logits = self._chosen_logits(group, masks)
                tokens = sample_rows(logits, temperature, top_k, top_p, generators, min_p)
                tokens = tokens.tolist()
            except Exception:  # each row alone, its generator where it was
                for g, state in zip(seeded, states):
                    g.set_state(state)
                continue
            chosen.update(zip((s.row for s in slots), tokens))
        return chosen

    def _chosen_logits(
        self, group: list[tuple[Slot, torch.Tensor]], masks: dict[int, torch.Tensor]
    ) -> torch.Tensor:
        """The logits a group's rows draw from, (G, V) fp32: each row's own after its penalties
        and its grammar's mask (``masks``), by `_row_logits`, as `_choose` makes them alone."""
        # fp32, as the sampler reads it and as the penalties (fp32 counts) make a row
        chosen = torch.cat([logits for _, logits in group]).float()  # (G, V), a new tensor
        for i, (slot, logits) in enumerate(group):
            if (
                slot.counts is not None
                or slot.seq.constraint is not None
                or slot.seq.cfg.logit_bias
            ):
                # from the row in the model's dtype, as alone
                chosen[i : i + 1] = self._row_logits(slot, logits, masks.get(slot.row))
        return chosen

    def _row_logits(
        self, slot: Slot, logits: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """What one row draws from: its logits (1, V) after its penalties and its grammar's
        mask (``mask``; None: filled here), a new tensor where either applies."""
        cfg, seq = slot.seq.cfg, slot.seq
        if slot.counts is not None:
            presence, frequency = cfg.presence_penalty, cfg.frequency_penalty
            repetition = cfg.repetition_penalty
            logits = apply_penalties(
                logits, slot.counts, presence, frequency, repetition, slot.in_prompt
            )
        logits = apply_logit_bias(logits, cfg.logit_bias)
        if seq.constraint is not None:
            if mask is None:
                mask = torch.full((1, self._mask_words()), -1, dtype=torch.int32)
                seq.constraint.fill(mask[0])
            logits = apply_token_bitmask(logits.clone(), mask.to(logits.device))
        return logits

    def _masks(self, slots: list[Slot]) -> dict[int, torch.Tensor]:
        """The grammar masks of the constrained rows, (1, ceil(V/32)) int32 each, filled
        together (llguidance spreads the rows over its threads); a row whose grammar fails
        gets none here and fails alone in `_choose`."""
        if len(slots) < 2:
            return {}  # `_choose` fills a lone row's own
        bitmask = torch.full((len(slots), self._mask_words()), -1, dtype=torch.int32)
        try:
            fill_masks([s.seq.constraint for s in slots], bitmask)
        except Exception:
            return {}
        return {s.row: bitmask[i : i + 1] for i, s in enumerate(slots)}

    def _choose(
        self,
        slot: Slot,
        logits: torch.Tensor,
        mask: torch.Tensor | None = None,
        picked: int | None = None,
    ) -> Chosen:
        """The next token of one row from its logits (1, V), as `generate_stream` picks it;
        a constrained row's logits first masked to what its grammar allows (``mask``, when
        `_masks` filled it with the batch's others); ``picked``: the token already drawn with
        the row's group (`_sampled_together`)."""
        cfg, seq = slot.seq.cfg, slot.seq
        token = picked
        if token is None:
            chosen = self._row_logits(slot, logits, mask)
            generators = None if slot.generator is None else [slot.generator]
            sampled = sample_rows(
                chosen, cfg.temperature, cfg.top_k, cfg.top_p, generators, cfg.min_p
            )
            token = int(sampled[0])
        if slot.counts is not None:
            slot.counts[0, token] += 1
        if seq.constraint is not None:
            seq.constraint.consume(token)
        slot.token = token
        slot.generated += 1
        scored = logprobs_of(logits[0], token, seq.logprobs) if seq.logprobs is not None else None
        events: Chosen = [(seq, Token(seq.index, token, slot.stream.push(token), scored))]
        complete = seq.constraint is not None and seq.constraint.finished
        if slot.stream.done or complete or slot.generated == cfg.max_new_tokens:
            slot.done = True
            tail = slot.stream.flush()
            reason = "stop" if complete else slot.stream.finish_reason
            events.append((seq, Done(seq.index, reason, tail, slot.generated)))
        return events


def draws_together(device: torch.device, temperature: float) -> bool:
    """Whether the chooser draws a group of rows that sample alike together
    (`Chooser._sampled_together`): on a GPU always, where reading each row's token waits for
    the device; on the CPU a sampled group (temperature above 0), not a greedy one, whose
    argmax of each row's own view is quicker than of the rows gathered into a copy. 16 rows of
    GPT-2's vocabulary on a 2-core EPYC, a step: greedy 167 us one by one against 519
    together; temperature 1, 3.42 ms against 2.58."""
    return device.type != "cpu" or temperature > 0


def logprobs_of(logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """The model's own log-probabilities (before temperature, penalties and filters) of
    ``token`` and of the ``k`` most likely tokens, from one row of logits (V,)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logp, k) if k else None
    pairs = [] if top is None else list(zip(top.indices.tolist(), top.values.tolist()))
    return TokenLogprobs(float(logp[token]), pairs)
