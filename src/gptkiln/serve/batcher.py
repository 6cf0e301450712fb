"""Continuous batching: concurrent requests share one model, each in a row (a slot) of one
static KV cache.

One decode loop, an asyncio task, owns the model. Request handlers only `submit` sequences and
read their events from an `asyncio.Queue`; the loop runs every forward pass in one worker thread
(so the event loop keeps answering), and no other code touches the model or its cache, except
through `Batcher.call`, which runs a function (an inspection) on that same thread, between two
decode steps.

Each iteration of the loop:

1. drops the sequences whose client went away (their slots are free again);
2. admits waiting sequences into free slots, oldest first, while the prompts to prefill stay
   within ``prefill_tokens`` (at least one a step, so a long prompt is never starved);
3. in the worker: prefills the admitted prompts into their own cache rows (the other rows keep
   what they hold): a prompt whose beginning the `PrefixCache` holds gets those keys and values
   copied in and prefills only the rest; the others go by similar length together in one
   forward (padded on the right: the padding's keys sit past each row's end, where its later
   tokens overwrite them before anything attends to them); each one's first token is sampled
   and handed out at once;
4. in the worker: keeps the new prompts' blocks in the prefix cache, then one decode step
   feeds every active row its last token at its own position (`GPT.forward` with a (B,)
   ``start_pos``; on CUDA the bucket's CUDA graph of the same forward, `gptkiln.gpu.RowGraphs`)
   and samples each row's next token;
5. hands each sequence its events: a token (the text it made final, its log-probabilities),
   and at the end the reason (``stop`` or ``length``).

A row's next token comes from `gptkiln.sampling`'s functions (`apply_penalties`,
`sample_rows`) on that row's logits with that row's own generator, and its text from a
`TextStream`, exactly as `generate_stream` does for a batch of one: what a request gets does not
depend on what else is in the batch, and equals what ``gptkiln generate`` prints. A row with a
grammar (`constrain.Constraint`: a JSON schema, a tool call it must make) has its logits masked
to what the grammar allows first; the mask is the row's own, so the other rows are untouched.
The rows that sample alike (one temperature, top-k and top-p) are drawn in one call, each from
its own logits so prepared and a seeded one with its own generator's uniform
(`Batcher._sampled_together`): the same tokens, one read of them a group.
"""

from __future__ import annotations

import asyncio
import collections
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from gptkiln.config import SampleConfig
from gptkiln.cpu import prepare_for_decoding
from gptkiln.errors import GptkilnError
from gptkiln.gpu import row_graphs_for
from gptkiln.model import GPT
from gptkiln.sampling import (
    TextStream,
    apply_penalties,
    apply_token_bitmask,
    sample_rows,
    stop_ids_of,
)
from gptkiln.serve.constrain import Constraint, fill_masks
from gptkiln.serve.prefix_cache import DEFAULT_MAX_BYTES, PrefixCache


class QueueFull(Exception):
    """The waiting queue has no room for a request's sequences (the server answers 429)."""


# -- what a sequence hears back ----------------------------------------------------------------
@dataclass
class TokenLogprobs:
    """The log-probability of a chosen token and its ``k`` most likely alternatives."""

    logprob: float
    top: list[tuple[int, float]]  # (id, log-probability), most likely first


@dataclass
class Token:
    """A new token of choice ``index``; ``text`` is the text it made final ("" while a
    character or a possible stop string is incomplete)."""

    index: int
    id: int
    text: str
    logprobs: TokenLogprobs | None = None


@dataclass
class PromptLogprobs:
    """The prompt's tokens scored (echo with logprobs): None for the first, which has no
    context."""

    index: int
    entries: list[TokenLogprobs | None]


@dataclass
class Done:
    """Choice ``index`` ended: ``text`` is what was still held back, ``tokens`` how many it
    generated, ``reason`` ``"stop"`` (end-of-text or a stop string) or ``"length"``."""

    index: int
    reason: str
    text: str
    tokens: int


@dataclass
class Failed:
    """Choice ``index`` could not be finished (the model failed, or the server is closing)."""

    index: int
    message: str


Event = Token | PromptLogprobs | Done | Failed


@dataclass(eq=False)
class Sequence:
    """One choice to generate.

    Attributes:
        prompt: its token ids (prompt plus ``cfg.max_new_tokens`` must fit the context).
        cfg: how its tokens are chosen and when it ends (seed, stop strings, penalties).
        events: where its `Token`, `PromptLogprobs`, `Done` or `Failed` events go (a request's
            choices may share one queue).
        index: the choice's index in its request.
        logprobs: how many alternatives to report with each token (None: no log-probabilities).
        prompt_logprobs: also score the prompt's tokens.
        constraint: the grammar its tokens must follow (`constrain.Constraint`), a mask on its
            row's logits at each step; None: free text. It ends (``stop``) when the grammar is
            complete.
        cancelled: set by the handler when its client went away; the slot is freed at the next
            step.
    """

    prompt: list[int]
    cfg: SampleConfig
    events: asyncio.Queue
    index: int = 0
    logprobs: int | None = None
    prompt_logprobs: bool = False
    constraint: Constraint | None = None
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)


@dataclass(eq=False)
class _Slot:
    """A sequence in a cache row: its position, its generator, its counts and its text."""

    row: int
    seq: Sequence
    stream: TextStream
    generator: torch.Generator | None
    counts: torch.Tensor | None  # (1, V) tokens generated so far, for the penalties
    pos: int = 0  # tokens in the cache
    token: int = 0  # the last token chosen, fed at the next decode step
    generated: int = 0
    done: bool = False


class Batcher:
    """Slots of ``max_batch`` rows over one static KV cache, filled from a bounded queue.

    Args:
        model: the GPT (eval mode); the batcher owns it from `start` on.
        tokenizer: gives ``decode`` and ``stop_ids`` (each ends a sequence).
        max_batch: cache rows: how many sequences decode together.
        max_queue: sequences that may wait for a slot; `submit` refuses more (`QueueFull`).
        prefill_tokens: prompt tokens prefilled per step (at least one prompt a step).
        prefix_cache_bytes: the most the prefix cache (`PrefixCache`) holds; 0 turns it off.
        on_token: called on the event loop for each token handed out, with (whether it is its
            sequence's first, seconds since the previous one or since the sequence was
            submitted), for metrics.
    """

    def __init__(
        self,
        model: GPT,
        tokenizer: Any,
        *,
        max_batch: int = 8,
        max_queue: int = 64,
        prefill_tokens: int = 512,
        prefix_cache_bytes: int = DEFAULT_MAX_BYTES,
        on_token=None,
    ) -> None:
        if max_batch < 1 or max_queue < 0 or prefill_tokens < 1:
            raise GptkilnError(
                f"max_batch must be >= 1, max_queue >= 0 and prefill_tokens >= 1; got "
                f"{max_batch}, {max_queue} and {prefill_tokens}"
            )
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.max_queue, self.prefill_tokens = max_batch, max_queue, prefill_tokens
        self.context_length = model.config.context_length
        self.device = model.wte.weight.device
        self.on_token = on_token
        self.prefix_cache = PrefixCache(model, max_bytes=prefix_cache_bytes)
        self.steps = 0  # decode steps run, for tests and metrics
        self.graphs = None  # the decode forward's CUDA graphs, set by `_prepare` on CUDA
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._slots: dict[int, _Slot] = {}  # row -> slot
        self._last_token_at: dict[Sequence, float] = {}
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="gptkiln-decode")
        self._task: asyncio.Task | None = None
        self._closing = False
        self._buckets = sorted({min(2**i, max_batch) for i in range(max_batch.bit_length() + 1)})

    # -- the handlers' side (event loop) -------------------------------------------------------
    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> int:
        return len(self._slots)

    def submit(self, seqs: list[Sequence]) -> None:
        """Queue a request's sequences together, or refuse them all when the queue is full."""
        if self._closing:
            raise QueueFull("the server is shutting down")
        for seq in seqs:
            if len(seq.prompt) + seq.cfg.max_new_tokens > self.context_length or not seq.prompt:
                raise GptkilnError(
                    f"a sequence needs 1 to {self.context_length} positions, prompt and new "
                    f"tokens; got {len(seq.prompt)} + {seq.cfg.max_new_tokens}"
                )
        if len(self._waiting) + len(seqs) > self.max_queue + self._free_rows():
            raise QueueFull(
                f"{len(self._waiting)} sequences are waiting (at most {self.max_queue})"
            )
        self._waiting.extend(seqs)
        self._wake.set()

    async def call(self, fn, *args):
        """``fn(*args)`` on the model's thread, between two decode steps (never during one), for
        work that reads the model without its cache (`gptkiln.inspect.inspect_prompt`)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def start(self) -> None:
        """Allocate the cache, time the decoding kernels for every batch size it will use, and
        start the decode loop."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._prepare)
        self._task = asyncio.create_task(self._run(), name="gptkiln-decode-loop")

    async def stop(self) -> None:
        """End the loop; sequences still queued or decoding get `Failed`."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task
        for slot in list(self._slots.values()):
            self._fail(slot.seq, "the server is shutting down")
        while self._waiting:
            self._fail(self._waiting.popleft(), "the server is shutting down")
        self._slots.clear()
        self._executor.shutdown(wait=True)
        self.prefix_cache.clear()
        self.model.clear_cache()

    # -- the decode loop (event loop) ------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closing:
            self._drop_cancelled()
            if not self._slots and not self._waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                admitted = self._admit()
                if admitted:  # their first tokens go out before the next decode step
                    events = await loop.run_in_executor(
                        self._executor, self._prefill_step, admitted
                    )
                    self._deliver(events)
                events = await loop.run_in_executor(self._executor, self._decode_step, admitted)
                self._deliver(events)
            except Exception as e:  # a failed step ends the sequences in it, not the server
                for slot in self._slots.values():
                    self._fail(slot.seq, f"generation failed: {type(e).__name__}: {e}")
                self._slots.clear()

    def _free_rows(self) -> int:
        return self.max_batch - len(self._slots)

    def _drop_cancelled(self) -> None:
        for row, slot in list(self._slots.items()):
            if slot.seq.cancelled:
                del self._slots[row]
                self._last_token_at.pop(slot.seq, None)
        if any(seq.cancelled for seq in self._waiting):
            self._waiting = collections.deque(s for s in self._waiting if not s.cancelled)

    def _admit(self) -> list[_Slot]:
        """Move waiting sequences into free rows (lowest first) within the prefill budget."""
        admitted: list[_Slot] = []
        budget = self.prefill_tokens
        free = sorted(set(range(self.max_batch)) - set(self._slots))
        while self._waiting and free and (not admitted or len(self._waiting[0].prompt) <= budget):
            seq = self._waiting.popleft()
            budget -= len(seq.prompt)
            slot = self._new_slot(free.pop(0), seq)
            self._slots[slot.row] = slot
            admitted.append(slot)
        return admitted

    def _new_slot(self, row: int, seq: Sequence) -> _Slot:
        cfg = seq.cfg
        end = stop_ids_of(self.tokenizer) if cfg.stop_at_eos else None  # any of them ends a turn
        generator = None
        if cfg.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        counts = None
        if cfg.presence_penalty or cfg.frequency_penalty:
            counts = torch.zeros(1, self.model.config.vocab_size, device=self.device)
        return _Slot(row, seq, TextStream(self.tokenizer.decode, cfg.stop, end), generator, counts)

    def _deliver(self, events: list[tuple[Sequence, Event]]) -> None:
        now = time.perf_counter()
        for seq, event in events:
            if isinstance(event, Token) and self.on_token is not None:
                last = self._last_token_at.get(seq)
                self.on_token(last is None, now - (seq.submitted if last is None else last))
                self._last_token_at[seq] = now
            if isinstance(event, (Done, Failed)):
                self._last_token_at.pop(seq, None)
            seq.events.put_nowait(event)
        for row, slot in list(self._slots.items()):
            if slot.done:
                del self._slots[row]

    def _fail(self, seq: Sequence, message: str) -> None:
        self._last_token_at.pop(seq, None)
        seq.events.put_nowait(Failed(seq.index, message))

    # -- the worker thread: the only code that runs the model ----------------------------------
    precision: str | None = None
    """The decode precision (``fp32``, ``bf16``, ``int8``; None: the model's own), read once by
    `_prepare`."""

    def _prepare(self) -> None:
        self.model.setup_cache(self.max_batch, self.context_length)
        # the batcher owns this model's decoding: its plan lives as long as the server; the CPU
        # backend's (kernels timed on this machine's cores, weights on 2 MB pages) on a CPU only
        self.plan = None
        if self.device.type == "cpu":
            self.plan = prepare_for_decoding(
                self.model, self._buckets, precision=self.precision, one_call=False
            )  # one_call=False: rows at their own positions
        # on CUDA, each bucket's decode forward a CUDA graph (`gptkiln.gpu.RowGraphs`)
        self.graphs = row_graphs_for(self.model, self._buckets)

    @torch.inference_mode()
    def _prefill_step(self, admitted: list[_Slot]) -> list[tuple[Sequence, Event]]:
        """Prefill the admitted prompts (a cached prefix copied in first, the rest prefilled;
        the others grouped by length) and choose each one's first token."""
        events: list[tuple[Sequence, Event]] = []
        scored = [s for s in admitted if s.seq.prompt_logprobs]  # need every position's logits
        fresh = []
        for slot in admitted:  # a prompt whose prefix is cached prefills only the rest
            if not slot.seq.prompt_logprobs:
                cached = self._cached_prefix(slot)
                if cached:
                    events += self._isolated(slot, self._prefill, slot, cached)
                else:
                    fresh.append(slot)
        for group in prefill_groups(fresh):
            events += self._prefill_together(group)
        for slot in scored:
            events += self._isolated(slot, self._prefill, slot)
        return events

    @torch.inference_mode()
    def _decode_step(self, admitted: list[_Slot]) -> list[tuple[Sequence, Event]]:
        """Keep the blocks of the prompts just prefilled (after their first tokens went out),
        then one decode step for every active row."""
        for slot in admitted:
            if slot.pos:
                try:
                    self.prefix_cache.store(slot.row, slot.seq.prompt)
                except Exception:  # not kept: a later prompt like it prefills it all
                    pass
        events: list[tuple[Sequence, Event]] = []
        going = [s for s in self._slots.values() if not s.done]
        if going:
            events += self._decode(going)
        self.steps += 1
        return events

    def _cached_prefix(self, slot: _Slot) -> int:
        """The prompt tokens whose keys and values the prefix cache put in the slot's row."""
        try:
            return self.prefix_cache.load(slot.row, slot.seq.prompt)
        except Exception:  # a failed copy only costs the prefill it would have saved
            return 0

    def _prefill(self, slot: _Slot, cached: int = 0) -> list[tuple[Sequence, Event]]:
        """Prefill one prompt into its row from position ``cached`` on (the positions before
        hold its prefix's keys and values already, `PrefixCache.load`)."""
        seq = slot.seq
        idx = torch.tensor([seq.prompt[cached:]], device=self.device)  # (1, T - cached)
        rows = slice(slot.row, slot.row + 1)
        logits = self.model(idx, start_pos=cached, last_only=not seq.prompt_logprobs, rows=rows)
        slot.pos = len(seq.prompt)
        events: list[tuple[Sequence, Event]] = []
        if seq.prompt_logprobs:
            events.append((seq, PromptLogprobs(seq.index, self._score_prompt(seq, logits))))
        return events + self._first_token(slot, logits[:, -1, :])

    def _prefill_together(self, slots: list[_Slot]) -> list[tuple[Sequence, Event]]:
        """Prefill several prompts in one forward, right-padded to the longest, each into its
        own cache row; each row's logits are read at its own last prompt position. If that
        forward fails, each prompt is prefilled alone, so only one at fault fails."""
        if len(slots) == 1:
            return self._isolated(slots[0], self._prefill, slots[0])
        longest = max(len(s.seq.prompt) for s in slots)
        idx = torch.zeros(len(slots), longest, dtype=torch.long)  # (G, T), padded with id 0
        for i, slot in enumerate(slots):
            idx[i, : len(slot.seq.prompt)] = torch.tensor(slot.seq.prompt)
        last = torch.tensor([len(s.seq.prompt) - 1 for s in slots], device=self.device)  # (G,)
        rows = torch.tensor([s.row for s in slots], device=self.device)  # (G,)
        try:
            logits = self.model(idx.to(self.device), start_pos=0, last_only=last, rows=rows)
        except Exception:
            return [e for slot in slots for e in self._isolated(slot, self._prefill, slot)]
        events: list[tuple[Sequence, Event]] = []
        for i, slot in enumerate(slots):
            slot.pos = len(slot.seq.prompt)
            events += self._isolated(slot, self._first_token, slot, logits[i : i + 1, -1])
        return events

    def _first_token(self, slot: _Slot, logits: torch.Tensor) -> list[tuple[Sequence, Event]]:
        """After its prefill: a sequence's first token from its last prompt logits (1, V)."""
        if slot.seq.cfg.max_new_tokens == 0:
            slot.done = True
            return [(slot.seq, Done(slot.seq.index, "length", "", 0))]
        return self._choose(slot, logits)

    def _decode(self, slots: list[_Slot]) -> list[tuple[Sequence, Event]]:
        """One token for every active row, each at its own position; empty rows below the
        highest active one (and up to the tuned batch size) compute a throwaway token."""
        n = next(b for b in self._buckets if b > max(s.row for s in slots))
        tokens = torch.zeros(n, 1, dtype=torch.long)
        positions = torch.zeros(n, dtype=torch.long)
        for slot in slots:
            tokens[slot.row, 0] = slot.token
            positions[slot.row] = slot.pos
        if self.graphs is not None:
            logits = self.graphs(tokens.to(self.device), positions.to(self.device))
        else:
            logits = self.model(tokens.to(self.device), start_pos=positions, last_only=True)
        masks = self._masks([s for s in slots if s.seq.constraint is not None])
        chosen = self._sampled_together(slots, logits, masks)
        events: list[tuple[Sequence, Event]] = []
        for slot in slots:
            slot.pos += 1
            row = logits[slot.row : slot.row + 1, -1]
            picked = chosen.get(slot.row)
            events += self._isolated(slot, self._choose, slot, row, masks.get(slot.row), picked)
        return events

    def _sampled_together(
        self, slots: list[_Slot], logits: torch.Tensor, masks: dict[int, torch.Tensor]
    ) -> dict[int, int]:
        """The next tokens of the rows that sample alike, by row: the rows grouped by their
        temperature, top-k and top-p, each group drawn in one `sample_rows` call and read once,
        where `draws_together` says so (one wait for the device a group, not one a row). Each
        row draws from its own logits' distribution, as alone: its penalties and its grammar's
        mask (``masks``, filled by `_masks`) applied to its own row, a seeded row's uniform from
        its own generator (`sampling.row_uniforms`).
        A row stays alone, in `_choose`, where its grammar's mask is not filled yet (a lone
        constrained row, or one whose grammar failed), in a group of one, or in a group whose
        draw fails (each of its rows then samples, and fails, alone, its generator put back
        where it was)."""
        groups: dict[tuple, list[_Slot]] = {}
        for slot in slots:
            cfg = slot.seq.cfg
            if slot.seq.constraint is None or slot.row in masks:
                groups.setdefault((cfg.temperature, cfg.top_k, cfg.top_p), []).append(slot)
        chosen: dict[int, int] = {}
        for (temperature, top_k, top_p), group in groups.items():
            if len(group) < 2 or not draws_together(self.device, temperature):
                continue
            sampled = temperature > 0 and any(s.generator is not None for s in group)
            generators = [s.generator for s in group] if sampled else None
            seeded = [g for g in generators or () if g is not None]
            states = [g.get_state() for g in seeded]
            try:
                rows = self._chosen_logits(group, logits, masks)
                tokens = sample_rows(rows, temperature, top_k, top_p, generators).tolist()
            except Exception:  # each row alone, its generator where it was
                for g, state in zip(seeded, states):
                    g.set_state(state)
                continue
            chosen.update(zip((s.row for s in group), tokens))
        return chosen

    def _chosen_logits(
        self,
        group: list[_Slot],
        logits: torch.Tensor,
        masks: dict[int, torch.Tensor],
    ) -> torch.Tensor:
        """The logits a group's rows draw from, (G, V) fp32: each row's own after its penalties
        and its grammar's mask (``masks``), by `_row_logits`, as `_choose` makes them alone."""
        # fp32, as the sampler reads it and as the penalties (fp32 counts) make a row
        rows = logits[[s.row for s in group], -1].float()  # (G, V), a copy
        for i, slot in enumerate(group):
            if slot.counts is not None or slot.seq.constraint is not None:
                own = logits[slot.row, -1:]  # in the model's dtype, as alone
                rows[i : i + 1] = self._row_logits(slot, own, masks.get(slot.row))
        return rows

    def _row_logits(
        self, slot: _Slot, logits: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """What one row draws from: its logits (1, V) after its penalties and its grammar's
        mask (``mask``; None: filled here), a new tensor where either applies."""
        cfg, seq = slot.seq.cfg, slot.seq
        if slot.counts is not None:
            presence, frequency = cfg.presence_penalty, cfg.frequency_penalty
            logits = apply_penalties(logits, slot.counts, presence, frequency)
        if seq.constraint is not None:
            if mask is None:
                mask = torch.full((1, self._mask_words()), -1, dtype=torch.int32)
                seq.constraint.fill(mask[0])
            logits = apply_token_bitmask(logits.clone(), mask.to(logits.device))
        return logits

    def _masks(self, slots: list[_Slot]) -> dict[int, torch.Tensor]:
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

    def _mask_words(self) -> int:
        return (self.tokenizer.vocab_size + 31) // 32

    def _isolated(self, slot: _Slot, work, *args) -> list[tuple[Sequence, Event]]:
        """A row's own work (its prefill; its sampling and text): if it fails, that row ends
        with `Failed` and the others go on."""
        try:
            return work(*args)
        except Exception as e:
            slot.done = True
            return [
                (slot.seq, Failed(slot.seq.index, f"generation failed: {type(e).__name__}: {e}"))
            ]

    def _choose(
        self,
        slot: _Slot,
        logits: torch.Tensor,
        mask: torch.Tensor | None = None,
        picked: int | None = None,
    ) -> list[tuple[Sequence, Event]]:
        """The next token of one row from its logits (1, V), as `generate_stream` picks it;
        a constrained row's logits first masked to what its grammar allows (``mask``, when
        `_masks` filled it with the batch's others); ``picked``: the token already drawn with
        the row's group (`_sampled_together`)."""
        cfg, seq = slot.seq.cfg, slot.seq
        token = picked
        if token is None:
            chosen = self._row_logits(slot, logits, mask)
            generators = None if slot.generator is None else [slot.generator]
            sampled = sample_rows(chosen, cfg.temperature, cfg.top_k, cfg.top_p, generators)
            token = int(sampled[0])
        if slot.counts is not None:
            slot.counts[0, token] += 1
        if seq.constraint is not None:
            seq.constraint.consume(token)
        slot.token = token
        slot.generated += 1
        scored = _logprobs(logits[0], token, seq.logprobs) if seq.logprobs is not None else None
        events: list[tuple[Sequence, Event]] = [
            (seq, Token(seq.index, token, slot.stream.push(token), scored))
        ]
        complete = seq.constraint is not None and seq.constraint.finished
        if slot.stream.done or complete or slot.generated == cfg.max_new_tokens:
            slot.done = True
            tail = slot.stream.flush()
            reason = "stop" if complete else slot.stream.finish_reason
            events.append((seq, Done(seq.index, reason, tail, slot.generated)))
        return events

    def _score_prompt(self, seq: Sequence, logits: torch.Tensor) -> list[TokenLogprobs | None]:
        """Each prompt token's log-probability given the tokens before it; logits (1, T, V)."""
        k = seq.logprobs or 0
        entries: list[TokenLogprobs | None] = [None]
        for t, token in enumerate(seq.prompt[1:]):
            entries.append(_logprobs(logits[0, t], token, k))
        return entries


def draws_together(device: torch.device, temperature: float) -> bool:
    """Whether the batcher draws a group of rows that sample alike together
    (`Batcher._sampled_together`): on a GPU always, where reading each row's token waits for
    the device; on the CPU a sampled group (temperature above 0), not a greedy one, whose
    argmax of each row's own view is quicker than of the rows gathered into a copy. 16 rows of
    GPT-2's vocabulary on a 2-core EPYC, a step: greedy 167 us one by one against 519
    together; temperature 1, 3.42 ms against 2.58."""
    return device.type != "cpu" or temperature > 0


PREFILL_PADDING = 1.25
"""Prompts are prefilled together while the padded batch is at most this many times their own
tokens (`prefill_groups`)."""


def prefill_groups(slots: list[_Slot]) -> list[list[_Slot]]:
    """The admitted slots in groups to prefill together: by prompt length, a group growing while
    its padded size (members x the longest prompt) stays within `PREFILL_PADDING` times its
    tokens, so prompts of one length share a forward and a short prompt never pays for a
    much longer one's width."""
    groups: list[list[_Slot]] = []
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


def _logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """The model's own log-probabilities (before temperature, penalties and filters) of
    ``token`` and of the ``k`` most likely tokens, from one row of logits (V,)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logp, k) if k else None
    pairs = [] if top is None else list(zip(top.indices.tolist(), top.values.tolist()))
    return TokenLogprobs(float(logp[token]), pairs)
