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
   within ``prefill_tokens`` (at least one a step, so a long prompt is never starved; a prompt
   counted once however many of a request's samples share it, as it is prefilled once);
3. in the worker: prefills the admitted prompts into their own cache rows (the other rows keep
   what they hold): a prompt whose beginning the `PrefixCache` holds gets those keys and values
   copied in and prefills only the rest; the others go by similar length together in one
   forward (padded on the right: the padding's keys sit past each row's end, where its later
   tokens overwrite them before anything attends to them); then the first tokens of all of
   them are chosen together and handed out at once;
4. in the worker: keeps the new prompts' blocks in the prefix cache, then one decode step
   feeds every active row its last token at its own position (`GPT.forward` with a (B,)
   ``start_pos``; on CUDA the bucket's CUDA graph of the same forward, `gptkiln.gpu.RowGraphs`)
   and chooses each row's next token;
5. hands each sequence its events (`events`): a token (the text it made final, its
   log-probabilities), and at the end the reason (``stop`` or ``length``).

Each row's token is chosen by `choosing.Chooser` exactly as `generate_stream` chooses it for a
batch of one (its own penalties, grammar mask and generator; the rows that sample alike drawn
in one call): what a request gets does not depend on what else is in the batch, and equals
what ``gptkiln generate`` prints.
"""

from __future__ import annotations

import asyncio
import collections
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from gptkiln.cpu import prepare_for_decoding
from gptkiln.errors import GptkilnError
from gptkiln.gpu import row_graphs_for
from gptkiln.logits_processors import prompt_tokens
from gptkiln.model import GPT
from gptkiln.sampling import decoding
from gptkiln.serve.choosing import Chooser, Chosen, Slot
from gptkiln.serve.events import Done, Failed, Sequence, Token
from gptkiln.serve.prefill import Ready, keep_prefixes, prefill, prefill_cost
from gptkiln.serve.prefix_cache import DEFAULT_MAX_BYTES, PrefixCache
from gptkiln.text_stream import TextStream, hidden_ids, stop_ids_of


class QueueFull(Exception):
    """The waiting queue has no room for a request's sequences (the server answers 429)."""


class Batcher:
    """Slots of ``max_batch`` rows over one static KV cache, filled from a bounded queue.

    Args:
        model: the GPT (eval mode); the batcher owns it from `start` on.
        tokenizer: gives ``decode`` and ``stop_ids`` (each ends a sequence).
        max_batch: cache rows: how many sequences decode together.
        max_queue: sequences that may wait for a slot; `submit` refuses more (`QueueFull`).
        prefill_tokens: prompt tokens prefilled per step (at least one prompt a step; a prompt
            admitted again in a step, a request's n samples, counts once).
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
        self.chooser = Chooser(self.device, tokenizer)
        self.prefix_cache = PrefixCache(model, max_bytes=prefix_cache_bytes)
        self.steps = 0  # decode steps run, for tests and metrics
        self.graphs = None  # the decode forward's CUDA graphs, set by `_prepare` on CUDA
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._slots: dict[int, Slot] = {}  # row -> slot
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
        if any(seq.cancelled for seq in self._waiting):
            self._waiting = collections.deque(s for s in self._waiting if not s.cancelled)

    def _admit(self) -> list[Slot]:
        """Move waiting sequences into free rows (lowest first) within the prefill budget, which
        counts what the step prefills (`prefill_cost`): a prompt admitted again in the step (a
        request's n samples) costs nothing, its keys and values copied."""
        admitted: list[Slot] = []
        budget = self.prefill_tokens
        free = sorted(set(range(self.max_batch)) - set(self._slots))
        prompts: set[tuple[int, ...]] = set()  # the prompts this step prefills already
        while self._waiting and free:
            cost = prefill_cost(self._waiting[0], prompts)
            if admitted and cost > budget:
                break
            seq = self._waiting.popleft()
            budget -= cost
            if not seq.prompt_logprobs:  # a scored prompt is prefilled alone: never copied
                prompts.add(tuple(seq.prompt))
            slot = self._new_slot(free.pop(0), seq)
            self._slots[slot.row] = slot
            admitted.append(slot)
        return admitted

    def _new_slot(self, row: int, seq: Sequence) -> Slot:
        cfg = seq.cfg
        end = stop_ids_of(self.tokenizer) if cfg.stop_at_eos else None  # any of them ends a turn
        generator = None
        if cfg.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        counts = in_prompt = None
        vocab = self.model.config.vocab_size
        if cfg.penalised:
            counts = torch.zeros(1, vocab, device=self.device)
        if cfg.repetition_penalty != 1:
            in_prompt = prompt_tokens([seq.prompt], vocab, self.device)
        hidden = hidden_ids(self.tokenizer, cfg.skip_special_tokens)
        stream = TextStream(self.tokenizer.decode, cfg.stop, end, hidden)
        return Slot(row, seq, stream, generator, counts, in_prompt)

    def _deliver(self, events: Chosen) -> None:
        now = time.perf_counter()
        for seq, event in events:
            if isinstance(event, Token):
                last = seq.last_token_at
                if self.on_token is not None:
                    self.on_token(last is None, now - (seq.submitted if last is None else last))
                seq.first_token_at = now if last is None else seq.first_token_at
                seq.last_token_at = now
            seq.events.put_nowait(event)
        for row, slot in list(self._slots.items()):
            if slot.done:
                del self._slots[row]

    def _fail(self, seq: Sequence, message: str) -> None:
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
    def _prefill_step(self, admitted: list[Slot]) -> Chosen:
        """Prefill the admitted prompts (`prefill.prefill`), then choose their first tokens
        together."""
        with decoding():  # a decoding's forwards: the precision's rounding, if any
            events, ready = prefill(self.model, self.prefix_cache, admitted)
        return events + self._first_tokens(ready)

    @torch.inference_mode()
    def _decode_step(self, admitted: list[Slot]) -> Chosen:
        """Keep the blocks of the prompts just prefilled (after their first tokens went out),
        then one decode step for every active row."""
        keep_prefixes(self.prefix_cache, admitted)
        events: Chosen = []
        going = [s for s in self._slots.values() if not s.done]
        if going:
            with decoding():
                events += self._decode(going)
        self.steps += 1
        return events

    def _first_tokens(self, ready: Ready) -> Chosen:
        """After their prefill: the prompts' first tokens from their last logits (1, V), chosen
        together; a sequence asking for none ends there."""
        events: Chosen = []
        going = []
        for slot, logits in ready:
            if slot.seq.cfg.max_new_tokens == 0:
                slot.done = True
                events.append((slot.seq, Done(slot.seq.index, "length", "", 0)))
            else:
                going.append((slot, logits))
        return events + self.chooser.next_tokens(going)

    def _decode(self, slots: list[Slot]) -> Chosen:
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
        for slot in slots:
            slot.pos += 1
        return self.chooser.next_tokens([(s, logits[s.row : s.row + 1, -1]) for s in slots])
