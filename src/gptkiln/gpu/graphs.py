"""CUDA-graph decoding: `gptkiln.gpu.step.graph_step` compiled once per bucket and replayed.

A decoding of B rows runs in the bucket of `bucket_rows` (B) rows (B padded up to a power of
two) and `bucket_length` slots (the positions it needs, rounded up to a power of two, at most
the context): a handful of graphs serve every batch size and length, each compiled at its first
use and kept with the model (`GraphDecoder`, the model's ``graph_decoder``). On CUDA the step is
compiled with ``mode="reduce-overhead", fullgraph=True`` (inductor's kernels, captured as a CUDA
graph); elsewhere (the CPU tests) with ``fullgraph=True`` and ``backend="aot_eager"`` by default
(the same trace, the same functionalised graph, ATen's kernels; inductor gives the same tokens
but compiles a graph in ~30 s on a 2-core CPU).

`prepare_graphs` is a `gptkiln.sampling.Prepare`: its plan offers ``sampling_steps``, so
`sampling.generate_stream` hands every later step to the bucket's graph (prefill and the first
token stay eager). ``GPTKILN_CUDA_GRAPHS=0`` turns it off (the model decodes eagerly).
"""

from __future__ import annotations

import collections
import os
import types
from collections.abc import Callable, Sequence

import torch

from gptkiln.config import SampleConfig
from gptkiln.gpu.step import DeviceSampling, StaticState, decode_static, graph_step
from gptkiln.model import GPT
from gptkiln.quantize import quantization_of

MIN_LENGTH = 256
"""The fewest slots a bucket's cache has (shorter decodings share its graph)."""

GRAPHS_FROM = 16
"""The fewest decode steps a CUDA decoding compiles for: a shorter one costs less eager than
the compile of its graph (each bucket's first use; later ones replay)."""

KEPT_SETTINGS = 16
"""The most sampling settings a bucket keeps a compiled step for; the least recently used one
goes first (compiled again if it comes back)."""


def bucket_rows(rows: int) -> int:
    """The rows of the bucket a decoding of ``rows`` rows runs in: the next power of two."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    return 1 << (rows - 1).bit_length()


def bucket_length(needed: int, context_length: int) -> int:
    """The cache slots of the bucket for a decoding that writes ``needed`` slots: the next
    power of two from `MIN_LENGTH`, at most ``context_length``."""
    return min(context_length, max(MIN_LENGTH, 1 << (needed - 1).bit_length()))


def compile_options(device_type: str, backend: str | None = None) -> dict:
    """``torch.compile``'s arguments for a step on ``device_type``: CUDA graphs on CUDA, the
    trace alone elsewhere (``backend``: another of torch's backends, e.g. ``"inductor"``)."""
    options = dict(fullgraph=True, dynamic=False)
    if backend is not None:
        return {**options, "backend": backend}
    if device_type == "cuda":
        return {**options, "mode": "reduce-overhead"}
    return {**options, "backend": "aot_eager"}


class GraphDecoder:
    """A model's buckets (`StaticState` each, at fixed addresses) and the compiled steps that
    replay them, one for each sampling setting a bucket decodes with (at most `KEPT_SETTINGS`
    a bucket); one per model (its ``graph_decoder``), kept across decodings.

    A setting (`DeviceSampling`: temperature, top-k, top-p, penalties) is a constant of its
    graph, so each gets a compiled copy of `graph_step` with a code object of its own: dynamo
    counts a code object's graphs against its ``recompile_limit`` (8), past which a
    ``fullgraph`` compile fails, so one copy shared by the settings would fail at the ninth."""

    def __init__(self, model: GPT, backend: str | None = None):
        self.model = model
        self.device = device = model.ln_f.weight.device
        self.cuda = device.type == "cuda"
        self.options = compile_options(device.type, backend)
        self.states: dict[tuple[int, int], StaticState] = {}
        self.steps: dict[tuple[int, int], collections.OrderedDict[DeviceSampling, Callable]] = {}

    def state(self, rows: int, cache_len: int) -> StaticState:
        """The bucket of ``rows`` x ``cache_len`` (made at its first use), in the dtype and on
        the device of the model's own cache (made again for another dtype)."""
        key = (rows, cache_len)
        own = self.model.h[0].attn.kv_cache.k
        state = self.states.get(key)
        if state is None or state.dtype != own.dtype:
            state = StaticState(self.model, rows, cache_len, own.dtype, own.device)
            self.states[key] = state
            self.steps[key] = collections.OrderedDict()
        return state

    def compiled(self, key: tuple[int, int], sampling: DeviceSampling) -> Callable:
        """The bucket ``key``'s step compiled for ``sampling`` (made at its first use; the
        least recently used setting's dropped past `KEPT_SETTINGS`)."""
        steps = self.steps[key]
        step = steps.get(sampling)
        if step is None:
            step = torch.compile(_own_copy(graph_step), **self.options)
            steps[sampling] = step
            while len(steps) > KEPT_SETTINGS:
                steps.popitem(last=False)
        steps.move_to_end(sampling)
        return step

    def start(
        self,
        sampling: DeviceSampling,
        pos: int,
        steps: int,
        seeds: Sequence[int | None],
        counts: torch.Tensor | None,
        in_prompt: torch.Tensor | None = None,
    ) -> Callable[[torch.Tensor, int], torch.Tensor]:
        """Take over the model's prefilled decoding of ``len(seeds)`` rows, the next token
        going to slot ``pos``, for at most ``steps`` steps: ``step(token, pos)`` feeds token (B,)
        and returns the next (B,), chosen on the device. Unseeded rows get a seed from torch's
        global generator."""
        B = len(seeds)
        needed = pos + steps
        key = bucket_rows(B), bucket_length(needed, self.model.config.context_length)
        state = self.state(*key)
        compiled = self.compiled(key, sampling)
        fresh = [int(torch.randint(0, 2**62, ())) if s is None else s for s in seeds]
        state.load(self.model, pos, fresh, counts, in_prompt)
        expected = pos

        def step(token: torch.Tensor, at: int) -> torch.Tensor:
            nonlocal expected
            if at != expected or at >= state.cache_len:
                raise ValueError(f"a graph step at position {at}; this decoding is at {expected}")
            expected += 1
            state.token[:B].copy_(token)
            if self.cuda:  # the last replay's outputs may be overwritten from here on
                torch.compiler.cudagraph_mark_step_begin()
            return compiled(self.model, state, sampling)[:B].clone()

        return step


def _own_copy(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` with a code object of its own: dynamo keeps its compiled graphs (and counts them
    against ``recompile_limit``, 8) per code object, so each bucket's step for each sampling
    setting gets its own count, whatever else the process compiles."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)


class GraphPlan:
    """What `prepare_graphs` returns: its ``sampling_steps`` starts the bucket's graph
    (`sampling.Prepare`), or declines (None) a decoding too short to be worth a compile."""

    def __init__(self, decoder: GraphDecoder, rows: int, steps: int, min_steps: int):
        self.decoder, self.rows, self.steps, self.min_steps = decoder, rows, steps, min_steps

    def sampling_steps(
        self,
        cfg: SampleConfig,
        seeds: Sequence[int | None],
        counts: torch.Tensor | None,
        pos: int,
        in_prompt: torch.Tensor | None = None,
    ) -> Callable[[torch.Tensor, int], torch.Tensor] | None:
        if self.steps < self.min_steps:
            return None
        sampling = DeviceSampling.of(cfg)
        return self.decoder.start(sampling, pos, self.steps, seeds, counts, in_prompt)


def graphs_for(model: GPT) -> Callable[..., GraphPlan | None] | None:
    """`prepare_graphs` where it applies, a float model on CUDA with ``GPTKILN_CUDA_GRAPHS``
    not 0; else None (an int8 model's products are not traced: it decodes eagerly)."""
    if model.ln_f.weight.device.type != "cuda" or quantization_of(model) is not None:
        return None
    return None if _switched_off() else prepare_graphs


def _switched_off() -> bool:
    return os.environ.get("GPTKILN_CUDA_GRAPHS", "1") == "0"


def prepare_graphs(
    model: GPT,
    rows: int,
    steps: int,
    *,
    backend: str | None = None,
    min_steps: int = GRAPHS_FROM,
) -> GraphPlan | None:
    """Ready ``model`` to decode ``rows`` rows for ``steps`` steps by compiled, replayed steps
    (`sampling.Prepare`); None where ``GPTKILN_CUDA_GRAPHS=0``. ``backend``: a compile
    backend other than `compile_options`' (the decoder keeps the first one it was made with);
    ``min_steps``: the fewest steps worth a graph (`GRAPHS_FROM`). The decoder is kept as the
    model's ``graph_decoder`` (made again when the model moves to another device)."""
    if _switched_off():
        return None
    decoder = getattr(model, "graph_decoder", None)
    if decoder is None or decoder.device != model.ln_f.weight.device:  # new, or moved
        decoder = GraphDecoder(model, backend)
        model.graph_decoder = decoder
    return GraphPlan(decoder, rows, steps, min_steps)


class RowGraphs:
    """The decode forward of a continuous batch (serve's batcher) as CUDA graphs: the model's
    own cache (``rows`` x the context, set up once by the batcher) made static, and
    `decode_static` compiled once per row count of ``buckets``; rows join and leave between
    steps, each step runs in the bucket of its highest active row. Sampling stays the batcher's
    (each row's own settings, grammar and text), on the logits this returns.

    Args:
        model: a model whose cache the batcher set up (no left padding: a row's position is its
            slot).
        buckets: the row counts a step may run at.
        backend: as `compile_options`'.
    """

    def __init__(self, model: GPT, buckets: Sequence[int], backend: str | None = None):
        self.model = model
        for block in model.h:
            block.attn.kv_cache.static = True
        device = model.ln_f.weight.device
        self.cuda = device.type == "cuda"
        options = compile_options(device.type, backend)
        self.inputs = {n: RowInputs(n, device) for n in buckets}
        self.steps = {n: torch.compile(_own_copy(_row_logits), **options) for n in buckets}

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits (n, 1, V) for tokens (n, 1) fed at positions (n,), n one of the buckets: what
        ``model(tokens, start_pos=positions, last_only=True)`` gives, at static shapes."""
        n = tokens.size(0)
        inputs = self.inputs[n]
        inputs.token.copy_(tokens[:, 0])
        inputs.slots.copy_(positions)
        if self.cuda:
            torch.compiler.cudagraph_mark_step_begin()
        return self.steps[n](self.model, inputs).clone()[:, None, :]


class RowInputs(torch.nn.Module):
    """A batch bucket's inputs at fixed addresses: each row's token, slot and (zero) padding."""

    def __init__(self, rows: int, device: torch.device):
        super().__init__()
        for name in ("token", "slots", "pads"):
            self.register_buffer(name, torch.zeros(rows, dtype=torch.int64, device=device), False)
            torch._dynamo.mark_static_address(getattr(self, name))


def _row_logits(model: GPT, inputs: RowInputs) -> torch.Tensor:
    """What `RowGraphs` compiles: `decode_static` over the batch's rows, logits (n, V)."""
    return decode_static(model, inputs.token, inputs.slots, inputs.pads)


def row_graphs_for(model: GPT, buckets: Sequence[int]) -> RowGraphs | None:
    """`RowGraphs` where `graphs_for` decodes by graphs (a float model on CUDA, the switch on);
    else None (the batcher's forward stays eager)."""
    if graphs_for(model) is None:
        return None
    return RowGraphs(model, buckets)
