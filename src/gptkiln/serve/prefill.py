"""The batcher's prefill: the prompts admitted in one step, each into its own row of the static
KV cache, to the logits that choose their first tokens.

A prompt whose beginning the `PrefixCache` holds gets those keys and values copied in and
prefills only the rest; a scored prompt (echo + logprobs) needs every position's logits and
goes alone; a prompt admitted again (a request's n samples) is prefilled once (its cached
prefix loaded once) and its keys and values copied to the other rows, so the batcher's budget
counts it once (`prefill_cost`); the others go by similar length together in one forward
(`prefill_groups`), padded on the right: the padding's keys sit past each row's end, where its
later tokens overwrite them before anything attends to them. What comes out is each prompt's
last logits row (1, V), for `choosing.Chooser` to choose all of their first tokens together,
and the events of the prompts that were scored or failed.

Runs on the batcher's worker thread, the only code that touches the model.
"""

from __future__ import annotations

import torch

from gptkiln.model import GPT
from gptkiln.serve.choosing import Chosen, Slot, failed, logprobs_of
from gptkiln.serve.events import PromptLogprobs, Sequence, TokenLogprobs
from gptkiln.serve.prefix_cache import PrefixCache

Ready = list[tuple[Slot, torch.Tensor]]
"""Prefilled prompts, each with its last logits row (1, V)."""

PREFILL_PADDING = 1.25
"""Prompts are prefilled together while the padded batch is at most this many times their own
tokens (`prefill_groups`)."""


@torch.inference_mode()
def prefill(model: GPT, prefix_cache: PrefixCache, admitted: list[Slot]) -> tuple[Chosen, Ready]:
    """Prefill the admitted prompts, each once (its other rows copied), a cached prefix copied
    in first and the rest prefilled, the others grouped by length: the events of the prompts
    scored or failed, and the last logits of every prompt prefilled."""
    events: Chosen = []
    ready: Ready = []
    scored = [s for s in admitted if s.seq.prompt_logprobs]  # need every position's logits
    firsts, copies = _firsts_and_copies([s for s in admitted if not s.seq.prompt_logprobs])
    fresh = []
    for slot in firsts:  # a prompt whose prefix is cached prefills only the rest
        cached = slot.seq.cached = _cached_prefix(prefix_cache, slot)
        if cached:
            _alone(model, slot, events, ready, cached)
        else:
            fresh.append(slot)
    for group in prefill_groups(fresh):
        _together(model, group, events, ready)
    logits_of = {id(slot): logits for slot, logits in ready}
    for first, slot in copies:
        if id(first) in logits_of:  # (a first that failed: its copy goes alone, and fails)
            _copy_row(model, first, slot)
            ready.append((slot, logits_of[id(first)].clone()))
        else:
            _alone(model, slot, events, ready)
    for slot in scored:
        _alone(model, slot, events, ready)
    return events, ready


def prefill_cost(seq: Sequence, prompts: set[tuple[int, ...]]) -> int:
    """The prompt tokens `prefill` runs for ``seq`` in a step that prefills ``prompts``
    already: none for a prompt among them (its keys and values copied, `_copy_row`), unless it
    is scored (every position's logits: prefilled alone each time)."""
    if not seq.prompt_logprobs and tuple(seq.prompt) in prompts:
        return 0
    return len(seq.prompt)


def _firsts_and_copies(slots: list[Slot]) -> tuple[list[Slot], list[tuple[Slot, Slot]]]:
    """The slots whose prompt is prefilled (the first of each prompt), and each other slot of
    the same prompt beside the first it is copied from (a request's n samples)."""
    firsts: dict[tuple[int, ...], Slot] = {}
    copies = []
    for slot in slots:
        first = firsts.setdefault(tuple(slot.seq.prompt), slot)
        if first is not slot:
            copies.append((first, slot))
    return list(firsts.values()), copies


def keep_prefixes(prefix_cache: PrefixCache, admitted: list[Slot]) -> None:
    """Keep the blocks of the prompts just prefilled in the prefix cache (after their first
    tokens went out: a copy must not delay them)."""
    for slot in admitted:
        if slot.pos:
            try:
                prefix_cache.store(slot.row, slot.seq.prompt)
            except Exception:  # not kept: a later prompt like it prefills it all
                pass


def prefill_groups(slots: list[Slot]) -> list[list[Slot]]:
    """The admitted slots in groups to prefill together: by prompt length, a group growing while
    its padded size (members x the longest prompt) stays within `PREFILL_PADDING` times its
    tokens, so prompts of one length share a forward and a short prompt never pays for a
    much longer one's width."""
    groups: list[list[Slot]] = []
    tokens = 0
    for slot in sorted(slots, key=lambda s: len(s.seq.prompt)):
        n = len(slot.seq.prompt)
        group = groups[-1] if groups else None
        if group is not None and (len(group) + 1) * n <= PREFILL_PADDING * (tokens + n):
            group.append(slot)
            tokens += n
        else:
            groups.append([slot])
            tokens = n
    return groups


def _cached_prefix(prefix_cache: PrefixCache, slot: Slot) -> int:
    """The prompt tokens whose keys and values the prefix cache put in the slot's row."""
    try:
        return prefix_cache.load(slot.row, slot.seq.prompt)
    except Exception:  # a failed copy only costs the prefill it would have saved
        return 0


def _alone(model: GPT, slot: Slot, events: Chosen, ready: Ready, cached: int = 0) -> None:
    """Prefill one prompt into its row from position ``cached`` on (the positions before hold
    its prefix's keys and values already, `PrefixCache.load`): its last logits to ``ready``, its
    prompt's scores to ``events``, or, where it fails, its `Failed`."""
    seq = slot.seq
    rows = slice(slot.row, slot.row + 1)
    try:
        idx = torch.tensor([seq.prompt[cached:]], device=model.wte.weight.device)  # (1, T - c)
        logits = model(
            idx, start_pos=cached, last_only=not seq.prompt_logprobs, rows=rows
        )  # (1, T - cached or 1, V)
        slot.pos = len(seq.prompt)
        if seq.prompt_logprobs:
            events.append((seq, PromptLogprobs(seq.index, score_prompt(seq, logits))))
            logits = logits[:, -1:].clone()  # the last row kept, not every position's
    except Exception as e:
        events += failed(slot, e)
        return
    ready.append((slot, logits[:, -1, :]))


def _together(model: GPT, slots: list[Slot], events: Chosen, ready: Ready) -> None:
    """Prefill several prompts in one forward, right-padded to the longest, each into its own
    cache row; each row's logits are read at its own last prompt position. If that forward
    fails, each prompt is prefilled alone, so only one at fault fails."""
    if len(slots) == 1:
        _alone(model, slots[0], events, ready)
        return
    device = model.wte.weight.device
    longest = max(len(s.seq.prompt) for s in slots)
    idx = torch.zeros(len(slots), longest, dtype=torch.long)  # (G, T), padded with id 0
    for i, slot in enumerate(slots):
        idx[i, : len(slot.seq.prompt)] = torch.tensor(slot.seq.prompt)
    last = torch.tensor([len(s.seq.prompt) - 1 for s in slots], device=device)  # (G,)
    rows = torch.tensor([s.row for s in slots], device=device)  # (G,)
    try:
        logits = model(idx.to(device), start_pos=0, last_only=last, rows=rows)
    except Exception:
        for slot in slots:
            _alone(model, slot, events, ready)
        return
    for i, slot in enumerate(slots):
        slot.pos = len(slot.seq.prompt)
        ready.append((slot, logits[i : i + 1, -1]))


def _copy_row(model: GPT, first: Slot, slot: Slot) -> None:
    """Give ``slot`` the keys and values ``first`` prefilled for the same prompt: the n samples
    of a request start from one prefill, exactly what each gets alone (a forward of several
    rows may round otherwise than one of one)."""
    n = len(first.seq.prompt)
    for block in model.h:
        cache = block.attn.kv_cache
        cache.k[slot.row, :, :n] = cache.k[first.row, :, :n]
        cache.v[slot.row, :, :n] = cache.v[first.row, :, :n]
    slot.pos = n
    slot.seq.cached = first.seq.cached  # what the prefix cache held for the prompt


def score_prompt(seq: Sequence, logits: torch.Tensor) -> list[TokenLogprobs | None]:
    """Each prompt token's log-probability given the tokens before it; logits (1, T, V)."""
    k = seq.logprobs or 0
    entries: list[TokenLogprobs | None] = [None]
    for t, token in enumerate(seq.prompt[1:]):
        entries.append(logprobs_of(logits[0, t], token, k))
    return entries
