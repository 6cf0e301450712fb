"""The tuner: which product each layer runs for a number of rows, chosen among the kernels of the
decode precision (`gptkiln.cpu.specs.offered`), once per shape and machine.

At ``fp32`` (and for an int8 layer kept ``exact``) every kernel on offer gives the reference's
numbers up to rounding, and the fastest over the model's own weights wins: each candidate is
timed running over every layer of a shape (its best of ``repeats`` passes; the check against
the reference on the first layer warms it up), so the weights stream from memory as they do
while decoding; the reference wins a near tie, and a kernel that compiles (inductor: seconds in
every process) must win clearly. At ``bf16`` and ``int8`` the precision has one kernel of its
own (a bf16 copy of the weights; q8_0's 8-bit activations), taken wherever it agrees with the
reference within `ACTIVATION_TOLERANCE`: no timing, so the tokens depend on the precision a
person chose, never on a race between two timings.

At one row on a CPU where the library runs its AVX-512 loops, the exact precisions take the
library's loop without timing (`DEFAULTS`, checked against the reference on a slice of the first
layer): a first use decodes at once instead of timing seconds of candidates.

An exact precision's choice is kept in this process (`_CHOSEN`) and on disk (`gptkiln.cache`:
``decode-kernels.json``, keyed by torch version, CPU and its flags, weight dtype and shape, rows,
threads and the candidates' names); a later process takes it without timing once it still
equals the reference on the first layer's first rows. The clock is a parameter (``clock``:
`time.perf_counter` unless a test gives another).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.nn as nn

from gptkiln.cpu import specs
from gptkiln.cpu.blocks import FAMILIES, block_products, in_one_call, use_native_blocks
from gptkiln.cpu.library import library
from gptkiln.cpu.planned import ANY_ROWS, few_row_kernels, give_kernel, is_product
from gptkiln.cpu.products import _BF16, _BF16_ROWS, _PACKED, FEW_ROWS

Clock = Callable[[], float]

ACTIVATION_TOLERANCE = 0.03
"""The largest relative error (norm of the difference over the reference's norm) a kernel that
rounds on purpose may show against its weight kind's reference and still run. q8_0's blocks of
32 (`q8_rows_linear`) measured ~1% at GPT-2's shapes, bf16 weights (`bf16_rows_linear`) ~0.1%."""

INDUCTOR_MARGIN = 0.8
"""A kernel that compiles (inductor) is chosen only in at most this fraction of the time of the
fastest one that does not: every process that uses it pays ~6.5 s of inductor (bench/README.md)."""

CHOICE_RULES = "rules=5"
"""Part of every choice's key on disk: a change to the rules bumps it, so that choices made by
the old rules are made again."""

CHECK_ROWS = 256
"""How many of a layer's outputs `_still_equal` checks a choice read from the disk cache on."""

_CHOSEN: dict[tuple | str, str] = {}
"""(out, in, rows, threads, weight dtype, the candidates' names) -> the kernel tuned in this
process, so it is timed once; and a decode step's entry (`_tune_step`) -> "native" or "layers"."""


def tune_decoding(
    model: nn.Module,
    rows: int,
    repeats: int = 2,
    *,
    precision: str = "fp32",
    one_call: bool = True,
    clock: Clock = time.perf_counter,
) -> dict[tuple[int, int], str]:
    """Give every eligible layer of ``model`` (a `gptkiln.model.Linear`, or a
    `gptkiln.quantize.Int8Linear`) its kernel for ``rows`` rows at ``precision`` (see the
    module's docstring). Eligible: a CPU, contiguous, plain (not sharded) weight, fp32, or int8
    with fp32 scales, and ``rows <= FEW_ROWS``. ``one_call``: whether the caller's steps put
    every row at one position, so that a model's blocks may run in one call (`_tune_step`); a
    server's rows, each at its own position, run the layers. The global random state is left
    alone. Returns {(out, in): kernel name}."""
    if rows > FEW_ROWS:
        return {}
    from gptkiln.cache import decode_kernel_choices, use_for_inductor

    use_for_inductor()  # `fused_int8`'s compiled loops, kept beside the choices
    stored = decode_kernel_choices()
    known = stored.entries()
    groups = _groups(model)
    threads = torch.get_num_threads()
    picked = {}
    with torch.no_grad():
        for (family, shape), layers in groups.items():
            kernels = specs.offered(family, precision)
            names = ",".join(kernels)
            if any(name in specs.inexact() for name in kernels):
                # a precision that rounds on purpose: its own kernel, checked on a slice of
                # these weights each time (no timing: nothing worth keeping); never kept, where
                # a fallback to the reference made for one model stayed for every other
                name = _own(kernels, layers)
            else:
                key = (*shape, rows, threads, family, names)
                if key not in _CHOSEN:
                    entry = f"{family} {shape[0]}x{shape[1]} rows={rows} threads={threads} {names}"
                    _CHOSEN[key] = _exact_choice(
                        kernels,
                        family,
                        f"{entry} {CHOICE_RULES}",
                        layers,
                        rows,
                        stored,
                        known,
                        repeats,
                        clock,
                    )
                name = _CHOSEN[key]
            picked[shape] = name
            for layer in layers:
                give_kernel(layer, rows, kernels[name])
                drop_unused_copies(layer)
        if one_call:
            _tune_step(model, rows, repeats, stored, known, precision, clock)
    for (family, shape), layers in groups.items():  # as the step's choice left them
        names = {kernel: name for name, kernel in specs.offered(family, precision).items()}
        picked[shape] = names.get(few_row_kernels(layers[0]).get(rows), picked[shape])
    return picked


def round_at_any_rows(model: nn.Module, precision: str) -> None:
    """Give every eligible layer (as `tune_decoding`'s) that ``precision`` rounds on purpose (bf16
    weights; q8_0's activations) its precision's kernel for every row count without a tuned one
    (`gptkiln.cpu.planned.ANY_ROWS`: a prefill's many rows, the window's re-prefill), where it
    takes that kernel at any row count (`_own`); take it off the others. A forward's numbers are
    then the precision's whichever row counts were tuned before it (a server's buckets, an
    earlier batch in the same process), up to the order of the sums."""
    with torch.no_grad():
        for (family, _), layers in _groups(model).items():
            kernels = specs.offered(family, precision)
            rounds = any(name in specs.inexact() for name in kernels)
            name = _own(kernels, layers) if rounds else None
            for layer in layers:
                if name in specs.inexact():
                    give_kernel(layer, ANY_ROWS, kernels[name])
                elif few_row_kernels(layer).pop(ANY_ROWS, None) is not None:
                    drop_unused_copies(layer)


def _groups(model: nn.Module) -> dict[tuple[str, tuple[int, int]], list[nn.Module]]:
    """The eligible layers of ``model`` (`_family`) by weight kind and shape."""
    groups: dict[tuple[str, tuple[int, int]], list[nn.Module]] = {}
    for module in model.modules():
        family = _family(module)
        if family is not None:
            groups.setdefault((family, tuple(module.weight.shape)), []).append(module)
    return groups


def _exact_choice(kernels, family, entry: str, layers, rows, stored, known, repeats, clock) -> str:
    """An exact precision's kernel for a shape (its key on disk ``entry``): the one on disk
    where it still equals the reference, else `DEFAULTS`' or the `_fastest`, then put on
    disk."""
    name = known.get(entry)
    reference = next(iter(kernels))  # needs no check against itself
    if name not in kernels or (
        name != reference and not _still_equal(kernels, name, layers[0], rows)
    ):
        name = _default(kernels, family, layers[0], rows)
        name = name or _fastest(kernels, layers, rows, repeats, clock)
        stored.put(entry, name)
    return name


DEFAULTS = {("avx512", "float32"): "few_rows", ("avx512", "int8"): "int8_rows"}
"""(the library's feature set, weight kind) -> the exact kernel a product of one row takes
without timing: the library's own loop where it runs its AVX-512 version. Timing GPT-2 124M's
fp32 candidates took 4.6 s of a first `generate` on a busy 2-core EPYC (5 s of CPU), and
where the tuner ran on a quiet machine it chose these for every block product at one row (and
at eight) on the Xeon and the EPYC (``bench/results-2026-11-28-*``); elsewhere (the generic
build, more rows, a kernel that refuses a shape) the kernels are timed as before."""


def _default(kernels: dict[str, Callable], family: str, layer: nn.Module, rows: int) -> str | None:
    """`DEFAULTS`' kernel for this product of an exact precision where it is on offer, the
    row count is one and it gives the reference's result on ``layer`` (`_still_equal`); else
    None."""
    if rows != 1:
        return None
    name = DEFAULTS.get((features(), family))
    if name not in kernels or not _still_equal(kernels, name, layer, rows):
        return None
    return name


def features() -> str:
    """The library's feature set at run time: ``avx512`` where it runs its AVX-512 loops,
    ``generic`` where it runs the plain C, ``none`` without a library."""
    lib = library()
    if lib is None:
        return "none"
    return "avx512" if lib.gk_avx512() else "generic"


OWN_CHECK_ROWS = 8
"""Random input rows `_own` checks a rounding kernel on: the same for every row count, so that a
layer takes one kernel at every batch size (one row's error alone is noisy: 3.9% against 0.8% at
eight for a 16384x128 int8 head, whose kernel then differed between a sample alone and in a
batch of two)."""


def _own(kernels: dict[str, Callable], layers: list[nn.Module]) -> str:
    """The precision's own kernel (the first after the reference) where it agrees with the
    reference within `ACTIVATION_TOLERANCE` on `OWN_CHECK_ROWS` rows of the first layer's first
    `CHECK_ROWS` outputs (the reference converts the whole weight it is given: a first use should
    not pay that for GPT-2's int8 head); else the reference."""
    first = layers[0]
    x = torch.randn(
        OWN_CHECK_ROWS, first.weight.size(1), generator=torch.Generator().manual_seed(0)
    )
    operands = tuple(None if t is None else t[:CHECK_ROWS] for t in _operands(first))
    reference = next(iter(kernels))
    try:
        expected = kernels[reference](x, *operands)
        for name, kernel in kernels.items():
            if name == reference:
                continue
            try:
                if _agrees(name, kernel(x, *operands), expected):
                    return name
            except (RuntimeError, NotImplementedError):
                continue
        return reference
    finally:
        for cache in (_BF16, _BF16_ROWS, _PACKED):  # the slice's copy, if one was made
            cache.pop(id(operands[0]), None)


def _fastest(
    kernels: dict[str, Callable],
    layers: list[nn.Module],
    rows: int,
    repeats: int,
    clock: Clock = time.perf_counter,
) -> str:
    """The name of the kernel with the least time over ``layers``; the reference (the first
    kernel) on a near tie (within 5%). A kernel whose result differs from the reference's beyond
    float rounding, or that raises, is never chosen; one that compiles (inductor) must be
    `INDUCTOR_MARGIN` of the fastest other's time."""
    first = layers[0]
    x = torch.randn(rows, first.weight.size(1), generator=torch.Generator().manual_seed(0))
    reference = next(iter(kernels))
    expected = kernels[reference](x, *_operands(first))
    times: dict[str, float] = {}
    for name, kernel in kernels.items():
        try:
            same = _agrees(name, kernel(x, *_operands(first)), expected)
        except (RuntimeError, NotImplementedError):  # a kernel this build, CPU or shape lacks
            continue
        if not same:
            continue

        def run(kernel=kernel):
            for layer in layers:
                kernel(x, *_operands(layer))

        times[name] = min(_seconds(run, clock) for _ in range(repeats))
    best_name, best_time = reference, times.get(reference, math.inf)
    for name, seconds in times.items():
        if _inductor(name):
            continue
        margin = 0.95 if best_name == reference else 1.0  # no choice flips on noise alone
        if seconds < best_time * margin:
            best_name, best_time = name, seconds
    for name, seconds in times.items():
        if _inductor(name) and seconds <= best_time * INDUCTOR_MARGIN:
            best_name, best_time = name, seconds
    return best_name


def _inductor(name: str) -> bool:
    spec = specs.BY_NAME.get(name)
    return spec is not None and spec.inductor


def _still_equal(kernels: dict[str, Callable], name: str, layer: nn.Module, rows: int) -> bool:
    """Whether ``kernels[name]`` (a choice read from the disk cache) still gives the reference's
    result on ``layer`` for ``rows`` rows (`_agrees`), on its first `CHECK_ROWS` outputs (the
    reference converts the whole weight: 60 ms for GPT-2's int8 head); a kernel that compiles on
    the whole layer (its shape is what it compiles for: the check warms it up)."""
    x = torch.randn(rows, layer.weight.size(1), generator=torch.Generator().manual_seed(0))
    operands = _operands(layer)
    spec = specs.BY_NAME.get(name)
    if spec is None or not spec.inductor:
        operands = tuple(None if t is None else t[:CHECK_ROWS] for t in operands)
    expected = next(iter(kernels.values()))(x, *operands)
    try:
        return _agrees(name, kernels[name](x, *operands), expected)
    except RuntimeError:
        return False
    finally:
        for cache in (_BF16, _BF16_ROWS, _PACKED):  # the slice's copy, if one was made
            cache.pop(id(operands[0]), None)


def _agrees(name: str, y: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether kernel ``name``'s result may stand for the reference's: equal up to float
    rounding, or, for a kernel that rounds on purpose, within `ACTIVATION_TOLERANCE`."""
    if name in specs.inexact():
        error = (y - expected).norm() / expected.norm().clamp_min(1e-30)
        return bool(torch.isfinite(y).all()) and float(error) <= ACTIVATION_TOLERANCE
    return torch.allclose(y, expected, rtol=1e-4, atol=1e-5)


def _seconds(fn: Callable[[], object], clock: Clock = time.perf_counter) -> float:
    start = clock()
    fn()
    return clock() - start


COPIES = {"bf16_rows": _BF16_ROWS, "bf16": _BF16, "dynamic": _PACKED}
"""The kernels that keep a copy of each weight (`gptkiln.cpu.specs`' ``copies``), by name: the
cache of their copies."""
assert set(COPIES) == {s.name for s in specs.SPECS if s.copies}


def drop_unused_copies(layer: nn.Module) -> None:
    """Free the copies of ``layer``'s weight (a bf16 one, a packed int8 one: as many bytes again
    as the weight, or half) where none of the kernels the layer now uses reads them; a later
    call of such a kernel makes its copy again."""
    used = set(few_row_kernels(layer).values())
    for name, cache in COPIES.items():
        if specs.BY_NAME[name].kernel not in used:
            cache.pop(id(layer.weight), None)


def keep_exact(model: nn.Module) -> None:
    """Take the kernels that round on purpose (`gptkiln.cpu.specs.inexact`) off every layer of
    ``model`` (and free their weight copies): the row counts they served go back to the
    reference product. A model tuned before (a trainer's, which samples text between
    evaluations) keeps what it was given until this."""
    rounding = {specs.BY_NAME[name].kernel for name in specs.inexact()}
    for module in model.modules():
        kernels = few_row_kernels(module)
        if kernels and rounding & set(kernels.values()):
            for rows in [r for r, k in kernels.items() if k in rounding]:
                del kernels[rows]
            drop_unused_copies(module)
    blocks = getattr(model, "decode_blocks", None)
    if blocks is not None:
        for rows in list(blocks.rows):
            use_native_blocks(model, rows)


def chosen() -> dict[tuple[int, int, int, int, str], str]:
    """Every product's choice made in this process: {(out, in, rows, threads, weight dtype):
    kernel name} (the latest, where several precisions were tuned)."""
    return {key[:5]: choice for key, choice in _CHOSEN.items() if isinstance(key, tuple)}


def _family(module: nn.Module) -> str | None:
    """ "float32" or "int8": the candidates a layer takes; None when it is not tuned."""
    w = getattr(module, "weight", None)
    if not (
        is_product(module)
        and type(w) in (nn.Parameter, torch.Tensor)  # not a DTensor shard (FSDP)
        and w.device.type == "cpu"
        and w.is_contiguous()
    ):
        return None
    if w.dtype == torch.float32:
        return "float32"
    scale = getattr(module, "scale", None)
    if w.dtype == torch.int8 and scale is not None and scale.dtype == torch.float32:
        return "int8"
    return None


def _operands(layer: nn.Module) -> tuple:
    """What a kernel takes after x: (weight, bias), or (qweight, scale, bias) for int8."""
    scale = getattr(layer, "scale", None)
    if layer.weight.dtype == torch.int8 and scale is not None:
        return layer.weight, scale, layer.bias
    return layer.weight, layer.bias


_LOOPS = {"float32": "few_rows", "int8": "int8_rows"}
"""The project's own exact loop for each weight kind."""


def _tune_step(model, rows: int, repeats: int, stored, known: dict, precision, clock) -> None:
    """`use_native_blocks` where every block product has one of the library's loops; where the
    tuner chose other kernels for some, and the model (one of `FAMILIES`) has a KV cache of ``rows``
    rows, time a whole decode step both ways and keep the faster: the layers with their tuned
    kernels, against the loops for every block product in one call (which saves the time
    between the products, ~0.2 ms a block, that timing the products alone does not see). The
    step is timed at the cache's last position (written before it is read). The choice is kept
    as the products' are (in this process, and on disk)."""
    family = getattr(getattr(model, "config", None), "family", None)
    if family not in FAMILIES:
        return
    if use_native_blocks(model, rows) or library() is None:
        return
    cache = model.h[0].attn.kv_cache
    if cache is None or cache.k.size(0) != rows:
        return
    products = block_products(model)
    families = [_family(layer) for layer in products]
    if None in families:
        return
    names = {k: n for f in set(families) for n, k in specs.offered(f, precision).items()}
    had = sorted({names.get(few_row_kernels(layer).get(rows), "?") for layer in products})
    c = model.config
    entry = (
        f"{family} step {c.n_layer}x{c.n_embd} heads={c.n_head} mlp={c.mlp_size} rows={rows} "
        f"threads={torch.get_num_threads()} layers={','.join(had)} {CHOICE_RULES}"
    )
    if entry not in _CHOSEN:
        choice = known.get(entry)
        if choice not in ("native", "layers"):
            choice = _time_step(model, products, families, rows, repeats, clock)
            stored.put(entry, choice)
        _CHOSEN[entry] = choice
    if _CHOSEN[entry] == "native":
        for layer, family in zip(products, families):
            give_kernel(layer, rows, _loop_for(layer, rows, family))
            drop_unused_copies(layer)
        use_native_blocks(model, rows)


def _loop_for(layer: nn.Module, rows: int, family: str) -> Callable:
    """The loop a block product runs in the one-call step: its kernel where the step runs it,
    else its weight kind's exact loop."""
    kernel = few_row_kernels(layer).get(rows)
    return kernel if in_one_call(layer, kernel) else specs.BY_NAME[_LOOPS[family]].kernel


def _time_step(model, products, families, rows: int, repeats: int, clock: Clock) -> str:
    """Which decode step of ``model`` ran faster, "native" or "layers" (best of ``repeats``
    after one to warm up): the one call with the loops on every block product, or the layers
    with the kernels they have; the layers' kernels are left as they were."""
    token = torch.zeros(rows, 1, dtype=torch.long, device=model.wte.weight.device)
    pos = model.cache_len - 1

    def step():
        model(token, start_pos=pos, last_only=True)

    def best():
        return min(_seconds(step, clock) for _ in range(repeats + 1))

    kept = [few_row_kernels(layer).get(rows) for layer in products]
    layers_time = best()
    for layer, family in zip(products, families):
        give_kernel(layer, rows, _loop_for(layer, rows, family))
    native = use_native_blocks(model, rows)
    native_time = best() if native else math.inf
    for layer, kernel in zip(products, kept):
        give_kernel(layer, rows, kernel)
    use_native_blocks(model, rows)  # taken away again: the layers have other kernels
    return "native" if native_time < layers_time else "layers"
