"""`prepare_for_decoding`: the one entry point of the CPU decode backend, and the `DecodePlan` it
returns to whoever owns the decoding (`gptkiln.api`'s generate and chat, serve's batcher, the
evaluation harness): the kernels chosen for each number of rows at the chosen precision, the
weight copies they read, the one-call step; `DecodePlan.drop_inexact` takes off what rounds
on purpose, `DecodePlan.release` gives the model back as it was.

The plan applies its speed from outside: it swaps the classes of the layers it runs otherwise
for planned subclasses (`gptkiln.cpu.planned`: the same objects, parameters and state dict)
and swaps them back when released, or when the model is prepared at another precision; the
model itself holds no slot for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from gptkiln.cpu import specs
from gptkiln.cpu.memory import move_to_huge_pages
from gptkiln.cpu.planned import few_row_kernels, plan_model, unplan, use_compiled_loops
from gptkiln.cpu.threads import DecodeThreads
from gptkiln.cpu.tuner import (
    Clock,
    drop_unused_copies,
    keep_exact,
    round_at_any_rows,
    tune_decoding,
)
from gptkiln.sampling import decoding

HUGE_PAGES_FROM = 128
"""Decodes of at least this many steps (and a server's, of no end) read their weights through
2 MB pages (`gptkiln.cpu.memory`), where the moves run at memory speed. A move costs a copy
(0.085 s for GPT-2 124M's 500 MB where the process reuses pages it freed) for ~8 ms less CPU a
step at one thread (GPT-2 124M fp32 on the 2-core EPYC): it pays back within tens of steps, and
``generate``'s default 100 tokens keep ordinary pages."""


def default_precision(model: nn.Module) -> str:
    """The precision a model decodes at unless another is asked: its weights' own. ``int8`` for
    a quantized model (int8 weights), ``bf16`` where its products' weights are bf16 (a Hugging
    Face checkpoint converted as it ships), else ``fp32``."""
    kinds = set()
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor) and module.__class__.__name__.endswith("Linear"):
            kinds.add(w.dtype)
    if torch.int8 in kinds:
        return "int8"
    return "bf16" if torch.bfloat16 in kinds else "fp32"


def ready_for_decoding(
    model: nn.Module, precision: str | None, device: str, source: object = "the model"
) -> str:
    """Check ``precision`` (None: `default_precision`) against ``model`` and ready the model for
    it: on the CPU a bf16 model is taken to fp32 (fp32 activations, as llama.cpp decodes a bf16
    file; at ``bf16`` the tuner's bf16 copies are then its own weights exactly); on a GPU a float
    model is cast to ``bf16`` or ``fp32`` where one is asked (weights and activations both; RoPE's
    tables kept fp32), as the GPU decodes at its weights' dtype. Returns the precision. A
    quantized model decodes at int8 only (one line says how to get the others)."""
    from gptkiln.errors import GptkilnError

    if precision is not None and precision not in specs.PRECISIONS:
        raise GptkilnError(f"--precision {precision}: choose one of {', '.join(specs.PRECISIONS)}")
    own = default_precision(model)
    if own == "int8" and precision not in (None, "int8"):
        raise GptkilnError(
            f"{source} has int8 weights, so it decodes at int8; for {precision}, give the float "
            "run it was quantized from"
        )
    if device == "cpu" and own == "bf16":
        model.float()
    elif device != "cpu" and own != "int8" and precision in ("bf16", "fp32"):
        model.to(torch.bfloat16 if precision == "bf16" else torch.float32)
        model.init_buffers()  # RoPE's cos and sin in fp32, as they were built
    return precision or own


def loading_quantize(quantize: str | None, precision: str | None) -> str | None:
    """What a run is quantized to as it loads: ``int8`` where asked by ``quantize`` or by
    ``precision``, else None (as stored). ``--quantize int8`` beside a float precision is one
    line: int8 weights decode at int8 only."""
    from gptkiln.errors import GptkilnError

    if quantize == "int8" and precision not in (None, "int8"):
        raise GptkilnError(
            f"--quantize int8 makes the weights int8, which decode at int8 only; drop --quantize "
            f"to decode at {precision}, or drop --precision {precision} to decode at int8"
        )
    return "int8" if precision == "int8" else quantize


@dataclass
class DecodePlan:
    """What `prepare_for_decoding` gave a model: for each number of rows, each layer shape's
    kernel (``kernels``), at ``precision``. The model is planned (`gptkiln.cpu.planned`) while
    it decodes, the plan its ``decode_plan``; `release` takes it all off again."""

    model: nn.Module
    precision: str
    kernels: dict[int, dict[tuple[int, int], str]] = field(default_factory=dict)
    threads: DecodeThreads = field(default_factory=DecodeThreads)
    """The thread count of its decode steps: all asked for, fewer while the machine does not
    run them all (`gptkiln.cpu.threads`)."""

    def add(
        self, rows: int, *, one_call: bool = True, clock: Clock = time.perf_counter
    ) -> dict[tuple[int, int], str]:
        """Choose (or take from the cache) the kernels for ``rows`` more rows (timed on the full
        thread count, whatever the decode steps run on now)."""
        self.threads.other_forward()
        with decoding():  # the step timed as a decoding runs it
            picked = tune_decoding(
                self.model, rows, precision=self.precision, one_call=one_call, clock=clock
            )
        self.kernels[rows] = picked
        return picked

    @property
    def one_call_rows(self) -> set[int]:
        """The row counts whose steps run a GPT-2's blocks in one call."""
        blocks = getattr(self.model, "decode_blocks", None)
        return set() if blocks is None else set(blocks.rows)

    def drop_inexact(self) -> None:
        """Take off the kernels that round on purpose (bf16 copies, 8-bit activations), and
        their weight copies: what evaluation scores with (`gptkiln.cpu.specs.exact_kernels`)."""
        keep_exact(self.model)
        for rows in self.kernels:
            self.kernels[rows] = {
                shape: name
                for shape, name in self.kernels[rows].items()
                if name not in specs.inexact()
            }

    def release(self) -> None:
        """Give the model back as it was: every layer its own class again (no kernels, no
        one-call step, no compiled GELU or attention) and the weight copies freed."""
        products = [m for m in self.model.modules() if few_row_kernels(m)]
        self.threads.release()
        unplan(self.model)
        for layer in products:
            drop_unused_copies(layer)
        self.kernels.clear()

    def describe(self) -> str:
        """One line: the precision and each row count's kernels."""
        parts = []
        for rows, picked in sorted(self.kernels.items()):
            names = ",".join(sorted(set(picked.values()))) or "torch"
            one = " one call" if rows in self.one_call_rows else ""
            parts.append(f"{rows} rows: {names}{one}")
        return f"{self.precision} decode ({'; '.join(parts) or 'untuned'})"


def prepare_for_decoding(
    model: nn.Module,
    rows: int | list[int] = 1,
    steps: int | None = None,
    *,
    precision: str | None = None,
    one_call: bool = True,
    clock: Clock = time.perf_counter,
) -> DecodePlan:
    """Prepare ``model`` to decode ``rows`` rows a step (several counts: a server's buckets) at
    ``precision`` (``fp32``, ``bf16``, ``int8``; None: `default_precision`): the library's GELU
    and decode attention given to its layers, each layer's product chosen for each row count
    (`gptkiln.cpu.tuner`), and for a GPT-2 whose products all run the library's loops the
    one-call step. ``steps``: how many decode steps the caller will run at most (None: as many
    as come, a server's); a caller of one step needs no kernels; from `HUGE_PAGES_FROM` steps
    (or None) the weights move onto 2 MB pages (`gptkiln.cpu.memory`). ``one_call``: whether every
    row of a step is at one position (False for a server's rows, each at its own). At a
    precision that rounds on purpose every layer that takes its kernel rounds at every row count
    from this call on, prefills too (`gptkiln.cpu.tuner.round_at_any_rows`): a caller prepares
    (``steps=0`` where it tunes later) before its first prefill. Returns the
    plan; the model decodes through it until `DecodePlan.release`. A model prepared before at
    the same precision keeps its plan (its row counts too); at another, that plan is released
    first."""
    if precision is not None and precision not in specs.PRECISIONS:
        raise ValueError(f"precision {precision!r}: one of {', '.join(specs.PRECISIONS)}")
    precision = precision or default_precision(model)
    plan = getattr(model, "decode_plan", None)
    if plan is None or plan.precision != precision:
        if plan is not None:
            plan.release()
        plan = DecodePlan(model, precision)
        plan_model(model).decode_plan = plan
    use_compiled_loops(model)
    if specs.exact_only():  # what an earlier tuning gave that rounds goes (an evaluation's)
        plan.drop_inexact()
    round_at_any_rows(model, precision)  # before the first prefill: it rounds as the steps do
    if steps is not None and steps < 1:
        return plan
    if steps is None or steps >= HUGE_PAGES_FROM:  # a long decode: its weights on 2 MB pages
        move_to_huge_pages(model)  # once: a weight moved before stays
    for count in [rows] if isinstance(rows, int) else rows:
        plan.add(count, one_call=one_call, clock=clock)
    return plan
