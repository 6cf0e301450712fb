"""Few-row matrix products for decoding on the CPU: candidate kernels and a tuner.

While decoding, every linear layer multiplies a handful of rows (one per sequence in the batch)
by a weight matrix that is read from main memory once per token: at batch 1 the product is a
matrix-vector product bounded by memory bandwidth, at batch 8 a GEMM with 8 rows. How fast the
CPU's BLAS does either depends on the machine far more than one would guess (measured on three
2-core machines this project has run on, `bench/README.md`):

- ``F.linear`` (MKL's kernels) streamed GPT-2 124M's weights at 12-14 GB/s at batch 1 on an AMD
  EPYC (Zen 4) that reads 33 GB/s (9 GB/s on one thread, so the second thread added little).
  The same product cut into row blocks of the weight, one batched matmul (`weight_rows`), ran
  at 31-41 GB/s (15 on one thread): 33 -> 21 ms a token.
- At 8 rows the same machine's best was oneDNN's linear (`onednn`), 74 -> 40 ms a step. On an
  Intel Xeon with AMX, by contrast, ``F.linear`` ran twice as fast as `input_rows` at batch 1.
- At 4-16 rows no library product reached the memory's speed on the 2-core Xeon: ``F.linear``,
  `weight_rows`, oneDNN and MKL's packed weights all ran at 9-12 GB/s where the machine reads
  19. `few_rows_linear`, the project's own AVX-512 loop (``csrc/few_rows.c``, built once per
  machine by `gptkiln.native` where a C compiler is), ran at 14-18 GB/s at 16 rows and 17-23
  at 8: a 124M decode step of 16 rows 63 -> 47-50 ms.

So nothing is fixed in advance: `tune_decoding` times every candidate over the model's own
weights (all layers of a shape, as decoding reads them, so the weights come from memory and not
from a warm cache) and hands each `gptkiln.model.Linear` the fastest for that number of rows.
Every candidate computes the same sums as ``F.linear`` in another order; a candidate whose result
differs beyond float rounding is never chosen. Untuned layers, layers under autograd and
products of more rows use ``F.linear``.

Layers with int8 weights (`gptkiln.quantize.Int8Linear`: y = (x qᵀ) · scale + bias) are tuned the
same way among the int8 products (`int8_candidates`): the reference `dequantize_linear` (what
``torchao``'s int8 weight-only linear does in eager mode: the weight converted to x's dtype, one
product, the scales after), torch's own ``aten._weight_int8pack_mm``, and `fused_int8`, a loop
that inductor generates from a plain expression and that reads each int8 weight once per step.
Measured on the Zen 4 EPYC at GPT-2 124M's shapes (`bench/int8_kernels.py`), the last is the
only int8 product faster than the fp32 ones there; the others stay candidates because
that ranking is this machine's, not a law. Where a C compiler and AVX-512 are, `int8_rows_linear`
(in ``csrc/few_rows.c``) joins them: the int8 weights widened to fp32 in registers as they stream
from memory, the activations left in fp32.

Four candidates compute other sums on purpose (`QUANTIZING_ACTIVATIONS`). For int8,
`dynamic_int8` quantizes each activation row to 8 bits too and multiplies int8 by int8 (fbgemm's
dynamic quantized linear); on an Intel Xeon with AVX-512 it ran 768x3072 in 53 us against fp32's
214 and `int8pack_mm`'s 992. `q8_rows_linear` (``csrc/q8_rows.c``, on CPUs with AVX-512 VNNI)
rounds the activations to 8 bits in blocks of 32 as llama.cpp's q8_0 does while decoding, and
multiplies in int8 in `int8_rows_linear`'s loop, with no copy of the weights. For fp32, on a CPU
with bf16 instructions, `bf16_linear` multiplies in bf16 (half the bytes of the weight read),
and on any with AVX-512 `bf16_rows_linear` rounds only the weights to bf16 (a copy read by
`few_rows_linear`'s loop, the activations and sums fp32). All four are held to a looser check
(`ACTIVATION_TOLERANCE`) than the others and chosen only when clearly faster
(`QUANTIZING_MARGIN`); ``GPTKILN_EXACT_KERNELS=1`` in the environment, or the
`exact_kernels` block (``gptkiln evaluate`` generates in one, and scores after `keep_exact`),
leaves them out, and what they cost in perplexity is measured in ``bench/README.md``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os
import time
import warnings
import weakref
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

_EXACT = contextvars.ContextVar("gptkiln_exact_kernels", default=False)


@contextlib.contextmanager
def exact_kernels():
    """A block in which `tune_decoding` offers only kernels that give the reference's numbers up
    to float rounding (`QUANTIZING_ACTIVATIONS` left out), as ``GPTKILN_EXACT_KERNELS=1`` does
    for a whole process: for work whose numbers are the point, such as a benchmark's scores."""
    token = _EXACT.set(True)
    try:
        yield
    finally:
        _EXACT.reset(token)


def exact_only() -> bool:
    """Whether the tuner leaves out `QUANTIZING_ACTIVATIONS` here (`exact_kernels`, or
    ``GPTKILN_EXACT_KERNELS=1``)."""
    return _EXACT.get() or os.environ.get("GPTKILN_EXACT_KERNELS") == "1"


Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""A float product ``(x, weight, bias) -> y``; an int8 one takes ``(x, qweight, scale, bias)``."""

FEW_ROWS = 64
"""Products of at most this many rows are tuned; more rows are compute-bound: ``F.linear``."""


def weight_rows(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, blocks: int = 4
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as one batched matmul of ``blocks`` row blocks of the weight
    on the left: (blocks, h, in) @ (blocks, in, M), one block per thread at a time.

    x (..., in), weight (out, in) contiguous, bias (out,) or None -> (..., out). The last
    ``out % blocks`` rows (GPT-2's 50257 tokens are odd) go through ``F.linear``.
    """
    return _by_row_blocks(x, weight, bias, blocks, _weight_on_the_left)


def input_rows(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, blocks: int = 4
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as one batched matmul with the input on the left:
    (blocks, M, in) @ (blocks, in, h), the weight's ``blocks`` row blocks transposed (views).

    Shapes as `weight_rows`; the last ``out % blocks`` rows go through ``F.linear``.
    """
    return _by_row_blocks(x, weight, bias, blocks, _input_on_the_left)


def _by_row_blocks(x, weight, bias, blocks: int, product) -> torch.Tensor:
    """Cut weight (out, in) into ``blocks`` row blocks of h rows (views), multiply them by x's
    M rows with ``product(x2, w, b)`` -> (M, blocks * h), and the last rows with ``F.linear``."""
    n_out, n_in = weight.shape
    h = n_out // blocks
    if h == 0:
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, n_in)  # (M, in)
    w = weight[: blocks * h].view(blocks, h, n_in)  # (blocks, h, in)
    b = None if bias is None else bias[: blocks * h].view(blocks, h)  # (blocks, h)
    y = product(x2, w, b)  # (M, blocks * h)
    if blocks * h < n_out:
        rest = F.linear(x2, weight[blocks * h :], None if bias is None else bias[blocks * h :])
        y = torch.cat([y, rest], dim=1)  # (M, out)
    return y.reshape(*x.shape[:-1], n_out)


def _weight_on_the_left(x2, w, b) -> torch.Tensor:
    blocks, _, n_in = w.shape
    xt = x2.t().expand(blocks, n_in, x2.size(0))  # (blocks, in, M), a view
    y = torch.bmm(w, xt) if b is None else torch.baddbmm(b[:, :, None], w, xt)  # (blocks, h, M)
    # laid out as F.linear's: a transposed view of several rows would send what reads it (SDPA
    # on the heads cut from it: its math path instead of the fused one; the norms) slow ways
    return y.view(-1, x2.size(0)).t().contiguous()  # (M, blocks * h)


def _input_on_the_left(x2, w, b) -> torch.Tensor:
    blocks = w.size(0)
    xb = x2.expand(blocks, *x2.shape)  # (blocks, M, in), a view
    wt = w.transpose(1, 2)  # (blocks, in, h), a view
    y = torch.bmm(xb, wt) if b is None else torch.baddbmm(b[:, None, :], xb, wt)  # (blocks, M, h)
    return y.transpose(0, 1).reshape(x2.size(0), -1)  # (M, blocks * h)


def few_rows_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by the project's own AVX-512 loop (``csrc/few_rows.c``,
    built once per machine by `gptkiln.native`): each thread streams whole 4-row blocks of the
    weight from memory once, multiplies them with every row of x while the next block is
    prefetched, and adds each output's partial sums up once at the end.

    For fp32, 1 to ``FEW_ROWS`` rows, an input width that is a multiple of 16 and contiguous
    tensors; anything else goes to ``F.linear``. Offered by `candidates` only where the library
    loads (`gptkiln.native.few_rows_library`).
    """
    from gptkiln.native import few_rows_library

    lib = few_rows_library()
    y = _by_row_loop(lib and lib.few_rows_linear, x, weight, (), bias, torch.float32)
    return F.linear(x, weight, bias) if y is None else y


def _by_row_loop(loop, x, weight, operands, bias, weight_dtype) -> torch.Tensor | None:
    """``x`` (..., in) times ``weight`` (out, in) by a compiled loop of ``csrc/few_rows.c``,
    ``loop(x, weight, *operands, bias, y, rows, out, in, threads)``; None where there is no
    loop (None) or it does not take these tensors (fp32 x of 1 to ``FEW_ROWS`` rows, an input
    width that is a multiple of 16, a contiguous weight of ``weight_dtype``, an fp32 bias; every
    tensor on the CPU): the caller takes its reference."""
    n_out, n_in = weight.shape
    x2 = x.reshape(-1, n_in)
    if (
        loop is None
        or not 1 <= x2.size(0) <= FEW_ROWS
        or n_in % 16
        or x2.dtype != torch.float32
        or weight.dtype != weight_dtype
        or x2.device.type != "cpu"
        or weight.device.type != "cpu"
        or not weight.is_contiguous()
        or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()))
    ):
        return None
    x2 = x2.contiguous()
    y = torch.empty(x2.size(0), n_out, dtype=torch.float32)
    refused = loop(
        x2.data_ptr(),
        weight.data_ptr(),
        *(t.data_ptr() for t in operands),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        x2.size(0),
        n_out,
        n_in,
        torch.get_num_threads(),
    )
    return None if refused else y.reshape(*x.shape[:-1], n_out)


def int8_rows_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`dequantize_linear` by the project's own AVX-512 loop (the int8 twin in
    ``csrc/few_rows.c``, built once per machine by `gptkiln.native`): `few_rows_linear`'s
    streaming of 4-row weight blocks, with each int8 weight widened to fp32 in registers and
    each output's scale applied once to its sum. The activations stay fp32, so it equals the
    reference up to rounding (it is not one of `QUANTIZING_ACTIVATIONS`). Measured on the 2-core
    Xeon over GPT-2 124M's 49 int8 weights at batch 1: 6.3-6.7 ms (18.5-19.5 GB/s),
    `dynamic_int8` 5.8-8.9 and the reference 72-89 in the same processes; at 4 rows 8.6-10.2
    against 10.0-12.4.

    For fp32 x of 1 to ``FEW_ROWS`` rows, an input width that is a multiple of 16, contiguous
    int8 weight and fp32 scales; anything else goes to `dequantize_linear`. Offered by
    `int8_candidates` only where the library loads (`gptkiln.native.int8_rows_library`).
    """
    from gptkiln.native import int8_rows_library

    y = None
    cpu = x.device.type == scale.device.type == "cpu"  # an untuned Int8Linear on CUDA comes here
    if cpu and scale.dtype == torch.float32 and scale.is_contiguous():  # only then: the library
        lib = int8_rows_library()
        y = _by_row_loop(lib and lib.int8_rows_linear, x, qweight, (scale,), bias, torch.int8)
    return dequantize_linear(x, qweight, scale, bias) if y is None else y


def q8_rows_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The int8 product with 8-bit *activations*, by the project's own AVX-512 VNNI loop
    (``csrc/q8_rows.c``, built once per machine by `gptkiln.native`): each row of x is rounded
    to 8 bits in blocks of 32 values, each block with its own scale (llama.cpp's q8_0), and
    multiplied by the int8 weights in int8 (``vpdpbusd``: 64 products an instruction), in
    `int8_rows_linear`'s streaming of 4-row weight blocks; each output's weight scale once at
    the end. It changes the numbers as q8_0 does (one of `QUANTIZING_ACTIVATIONS`): ~1% of the
    output's norm against `dequantize_linear` over N(0, 1) rows; a block of 32 holding an
    outlier rounds only its own 31 others coarsely. It needs no copy of the weights (unlike
    `dynamic_int8`, whose per-call scale is one per row and whose weights fbgemm repacks).

    Measured on the 2-core Xeon over GPT-2 124M's 48 block products and head at batch 1 (a C
    benchmark of both loops, one process): 2.9-3.0 ms a step against `int8_rows_linear`'s
    5.2-5.5. For fp32 x of 1 to ``FEW_ROWS`` rows, an input width that is a multiple of 64,
    contiguous int8 weight and fp32 scales, on a CPU with AVX-512 VNNI; anything else goes to
    `dequantize_linear`. Offered by `int8_candidates` only where the library loads
    (`gptkiln.native.q8_rows_library`) and `exact_only` is false."""
    from gptkiln.native import q8_rows_library

    y = None
    cpu = x.device.type == scale.device.type == "cpu"
    if cpu and scale.dtype == torch.float32 and scale.is_contiguous():
        lib = q8_rows_library()
        y = _by_row_loop(lib and lib.q8_rows_linear, x, qweight, (scale,), bias, torch.int8)
    return dequantize_linear(x, qweight, scale, bias) if y is None else y


def onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear (the kernel inductor calls on CPU), on the plain weight: no packed copy."""
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.size(-1)), weight, bias, "none", [], "")
    return y.reshape(*x.shape[:-1], weight.size(0))


def candidates() -> dict[str, Kernel]:
    """The kernels this torch build offers: name -> kernel. Row blocks: two per thread.

    Module-level functions and partials of them, so a tuned model still pickles.
    """
    blocks = 2 * torch.get_num_threads()
    found: dict[str, Kernel] = {
        "linear": F.linear,  # the reference every other kernel must equal
        "weight_rows": functools.partial(weight_rows, blocks=blocks),
        "input_rows": functools.partial(input_rows, blocks=blocks),
    }
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        found["onednn"] = onednn
    from gptkiln.native import few_rows_library

    if few_rows_library() is not None:
        found["few_rows"] = few_rows_linear
    if not exact_only() and _has_bf16():
        found["bf16"] = bf16_linear
    from gptkiln.native import bf16_rows_library

    if not exact_only() and bf16_rows_library() is not None:
        found["bf16_rows"] = bf16_rows_linear
    return found


@functools.cache
def _has_bf16() -> bool:
    from gptkiln.devices import cpu_bf16_features

    return bool(cpu_bf16_features())


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` in bf16: x and a bf16 copy of the weight (made once per weight, as
    `dynamic_int8`'s packed one, and kept while the weight lives unchanged: half its bytes held
    again), the sums by the CPU's bf16 instructions (AMX, AVX512-BF16), the result and the bias
    in x's dtype. Half the bytes to read per token, at bf16's rounding: a candidate only where
    the CPU has those instructions, held to `ACTIVATION_TOLERANCE` and `QUANTIZING_MARGIN` as
    `dynamic_int8` is; on the Xeon of ``bench/README.md`` it wins only the 50,257-wide head."""
    w16 = _kept(_BF16, (weight,), lambda: weight.detach().to(torch.bfloat16))
    y = F.linear(x.to(torch.bfloat16), w16).to(x.dtype)
    return y if bias is None else y + bias


_BF16: dict[int, tuple] = {}
"""id(weight) -> (weakref of the weight, its version, its bf16 copy)."""


def bf16_rows_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear`` with the weight rounded to bf16 and nothing else: `few_rows_linear`'s loop
    (``csrc/few_rows.c``) over a bf16 copy of the weight (made once per weight and kept while
    it lives unchanged, as `bf16_linear`'s), each weight widened back to fp32 exactly in
    registers, the activations and the sums in fp32. At batch 1 a decode step streams its
    weights from memory, so half the bytes is up to half the time, on any CPU with AVX-512
    (no bf16 instructions needed). The weights' rounding moves the output by ~0.1% of its
    norm: one of `QUANTIZING_ACTIVATIONS` (held to `ACTIVATION_TOLERANCE` and
    `QUANTIZING_MARGIN`, left out by `exact_kernels`), and its copy is weighed against the steps
    a caller will run (`_copy_costs`). Measured on the 2-core Xeon, GPT-2's 50,257x768 head at
    batch 1 in one process: 1.9 ms against ``F.linear``'s 4.2 (`bf16_linear` 4.5). For what
    the loop does not take (`_by_row_loop`), ``F.linear`` on the fp32 weight."""
    from gptkiln.native import bf16_rows_library

    lib = bf16_rows_library()
    y = None
    if lib is not None and weight.device.type == "cpu" and weight.dtype == torch.float32:
        w16 = _kept(_BF16_ROWS, (weight,), lambda: weight.detach().to(torch.bfloat16))
        y = _by_row_loop(lib.bf16_rows_linear, x, w16, (), bias, torch.bfloat16)
    return F.linear(x, weight, bias) if y is None else y


_BF16_ROWS: dict[int, tuple] = {}
"""id(weight) -> (weakref of the weight, its version, the bf16 copy `bf16_rows_linear` reads)."""


# -- int8 weight-only products ------------------------------------------------------------------
def dequantize_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """(x @ qweightᵀ) · scale + bias with the int8 weight converted to x's dtype first: the
    reference every int8 kernel must equal, and the product for every untuned row count.

    x (..., in), qweight (out, in) int8, scale (out,), bias (out,) or None -> (..., out).
    Scaling the outputs instead of the weight is the same sum (each output channel has one
    scale) and costs ``out`` multiplications instead of ``out * in``.
    """
    y = F.linear(x, qweight.to(x.dtype)) * scale.to(x.dtype)
    return y if bias is None else y + bias


def int8pack_mm(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """torch's own int8 weight-only kernel, ``aten._weight_int8pack_mm`` (what inductor lowers
    the dequantize pattern to on the CPU). Shapes as `dequantize_linear`."""
    x2 = x.reshape(-1, x.size(-1))  # (M, in): the kernel takes 2-D inputs only
    y = torch.ops.aten._weight_int8pack_mm(x2, qweight, scale.to(x.dtype))  # (M, out)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], qweight.size(0))


FUSED_INT8_MAX_ROWS = 16
"""`fused_int8` keeps one accumulator per row in its loop: more rows are left to the others."""


def fused_int8(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The int8 product as one loop that inductor generates for this weight's shape and number
    of rows: each int8 weight row is read once, converted in registers and multiplied with every
    input row. Shapes as `dequantize_linear`.

    The first call for a (rows, out, in) traces `_int8_rows` to an FX graph and compiles it with
    ``torch._inductor.compile`` (about a second; inductor keeps the result in its on-disk cache
    for later processes). Calling the compiled graph directly, not through ``torch.compile``,
    skips dynamo's frame hook and guards, about 50 us a call (a decode step makes 49): on the
    Zen 4 EPYC, GPT-2 124M's int8 decoding went from 13.9 to 10.1 ms a token (medians of 8
    paired rounds). More than `FUSED_INT8_MAX_ROWS` rows: RuntimeError.
    """
    x2 = x.reshape(-1, x.size(-1)).contiguous()  # (M, in)
    rows = x2.size(0)
    if rows > FUSED_INT8_MAX_ROWS:
        raise RuntimeError(f"fused_int8 takes at most {FUSED_INT8_MAX_ROWS} rows, got {rows}")
    key = (rows, *qweight.shape, bias is not None, x.dtype, x.device.type)
    compiled = _COMPILED.get(key)
    if compiled is None:
        compiled = _COMPILED[key] = _compile_int8_rows(x2, qweight, scale, bias)
    y = compiled(x2, qweight, scale) if bias is None else compiled(x2, qweight, scale, bias)
    return y.reshape(*x.shape[:-1], qweight.size(0))


def _compile_int8_rows(x2, qweight, scale, bias) -> Callable:
    """`_int8_rows` for these shapes, traced (``make_fx``) and compiled by inductor."""
    from torch._inductor import compile as inductor_compile
    from torch.fx.experimental.proxy_tensor import make_fx

    def with_bias(x, qweight, scale, bias):
        return _int8_rows(x, qweight, scale, bias)

    def without_bias(x, qweight, scale):
        return _int8_rows(x, qweight, scale, None)

    fn, args = (
        (without_bias, (x2, qweight, scale))
        if bias is None
        else (with_bias, (x2, qweight, scale, bias))
    )
    # Traced on fake tensors that carry a ShapeEnv: without one inductor bypasses its FX graph
    # cache ("No shape env") and a later process generates the same code again.
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = [fake_mode.from_tensor(a, static_shapes=True) for a in args]
    with torch.no_grad():
        with fake_mode:
            graph = make_fx(fn)(*fakes)
        return inductor_compile(graph, fakes)


def _int8_rows(x, qweight, scale, bias):
    """What `fused_int8` compiles: written as products and sums, not as a matmul, so that
    inductor fuses it into one loop (a matmul would be lowered to `int8pack_mm`)."""
    w = qweight.to(x.dtype)  # (out, in), converted inside the loop, never stored
    y = torch.stack([(w * x[m]).sum(-1) for m in range(x.size(0))]) * scale  # (M, out)
    return y if bias is None else y + bias


_COMPILED: dict[tuple, Callable] = {}
"""(rows, out, in, has bias, dtype, device) -> the compiled `_int8_rows` for it."""


def dynamic_int8(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The int8 product with int8 *activations*: torch's dynamic quantized linear
    (``quantized.linear_dynamic``; fbgemm's kernel on x86), as llama.cpp's q8_0 decodes.

    Each row of x is quantized on the fly to 8 bits (one affine scale per call; with
    ``reduce_range``, 7 bits, so that the u8 x s8 pair sums of AVX2's ``vpmaddubsw`` cannot
    saturate on CPUs without VNNI; several rows are scaled to one range first, so that each is
    quantized on its own grid), the sums run over int8 x int8 into int32, and the weight's
    per-channel scales come after. This changes the numbers as q8_0 does: against
    `dequantize_linear` the output differs by 1-2% of its norm (`ACTIVATION_TOLERANCE`), not
    by float rounding; the model's perplexity moves far less (``bench/README.md``). Shapes as
    `dequantize_linear`.

    The weight is packed into fbgemm's layout once, at the first call for this weight (a copy:
    the int8 weights are then held twice), and kept while the weight lives and is unchanged.
    """
    x2 = x.reshape(-1, x.size(-1))  # (M, in)
    if x2.size(0) == 1:  # one row: the call's one activation scale is the row's own
        y = torch.ops.quantized.linear_dynamic(x2, _packed(qweight, scale, bias), True)  # (1, out)
    else:
        # The op takes one scale for all rows: divide each row by its largest |value| first (the
        # product is linear in each row) so that a small row is not quantized on a large one's
        # grid, and multiply the outputs back (the bias after).
        top = x2.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(x2.dtype).tiny)  # (M, 1)
        y = torch.ops.quantized.linear_dynamic(x2 / top, _packed(qweight, scale, None), True)
        y = y * top if bias is None else torch.addcmul(bias, y, top)  # (M, out)
    return y.reshape(*x.shape[:-1], qweight.size(0))


ACTIVATION_TOLERANCE = 0.03
"""The largest relative error (norm of the difference over the reference's norm) a kernel of
`QUANTIZING_ACTIVATIONS` may show against its family's reference and still be chosen. 7-bit
activations of normally distributed rows (`dynamic_int8`) measured 1-2% at GPT-2's shapes,
q8_0's blocks of 32 (`q8_rows_linear`) ~1%, bf16 weights (`bf16_rows_linear`) ~0.1%."""

_PACKED: dict[int, tuple] = {}
"""id(qweight) -> (weakref of qweight, versions of qweight/scale/bias, the packed weight)."""


def _packed(qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    """The packed weight `dynamic_int8` multiplies by, made once per weight: repacked if the
    int8 weight, its scales or bias were changed in place, or if the weight was freed and the id
    went to another tensor."""

    def pack():
        with warnings.catch_warnings():  # the quantized tensor types are deprecated, the op not
            warnings.simplefilter("ignore")
            qt = torch._make_per_channel_quantized_tensor(
                qweight.detach(),
                scale.detach().double(),
                torch.zeros(qweight.size(0), dtype=torch.long),
                0,
            )
            return torch.ops.quantized.linear_prepack(
                qt, None if bias is None else bias.detach().float()
            )

    return _kept(_PACKED, (qweight, scale, bias), pack)


def _stamp(t: torch.Tensor) -> tuple:
    """What a copy made from ``t`` was made from: its version (bumped by in-place changes), its
    storage and shape (``param.data = ...`` changes them and leaves the version)."""
    return t._version, t.data_ptr(), t.shape


def _kept(cache: dict[int, tuple], tensors: tuple, make: Callable[[], object]):
    """``make()``, made once for ``tensors`` (the first one the key) and kept in ``cache``: made
    again if any of them changed in place or was given other storage (``param.data = ...``
    keeps the object and its version), or if the first was freed and its id went to another
    tensor."""
    versions = tuple(None if t is None else _stamp(t) for t in tensors)
    entry = cache.get(id(tensors[0]))
    if entry is not None and entry[0]() is tensors[0] and entry[1] == versions:
        return entry[2]
    value = make()
    cache[id(tensors[0])] = (weakref.ref(tensors[0]), versions, value)
    return value


def int8_candidates() -> dict[str, Callable]:
    """The int8 products: name -> kernel ``(x, qweight, scale, bias) -> y``; the first,
    `dequantize_linear`, is the reference. Module-level functions, so a tuned model pickles.
    ``dynamic`` and ``q8_rows`` quantize the activations too (see `dynamic_int8`,
    `q8_rows_linear`, `ACTIVATION_TOLERANCE`); where `exact_only` they are left out, so that
    every choice gives the reference's numbers up to rounding (the same tokens whatever the
    tuner's timings). ``int8_rows`` (`int8_rows_linear`) and ``q8_rows`` only where their
    libraries build (``q8_rows``: and the CPU has AVX-512 VNNI)."""
    found = {
        "dequantize": dequantize_linear,
        "int8pack_mm": int8pack_mm,
        "fused": fused_int8,
        "dynamic": dynamic_int8,
    }
    from gptkiln.native import int8_rows_library, q8_rows_library

    if int8_rows_library() is not None:
        found["int8_rows"] = int8_rows_linear
    if q8_rows_library() is not None:
        found["q8_rows"] = q8_rows_linear
    if exact_only():
        del found["dynamic"]
        found.pop("q8_rows", None)
    return found


QUANTIZING_ACTIVATIONS = frozenset({"dynamic", "bf16", "q8_rows", "bf16_rows"})
"""The candidates whose numbers differ from the reference by more than rounding (by design)."""

CHOICE_RULES = "rules=4"
"""Part of every choice's key on disk: a change to `_fastest`'s rules bumps it, so that choices
made by the old rules are made again."""


def _candidates_of(family: str) -> dict[str, Callable]:
    """The candidates for a layer of this family ("float32" or "int8"; see `_family`)."""
    return int8_candidates() if family == "int8" else candidates()


_CHOSEN: dict[tuple[int, int, int, int, str, str] | str, str | dict] = {}
"""(out, in, rows, threads, weight dtype, the candidates' names) -> the kernel name tuned in this
process (or `_copy_costs`'s record of one that copies the weights), so it is timed once (and
again inside or outside `exact_kernels`, whose candidates differ); and a decode step's entry
(`_tune_step`) -> "native" or "layers"."""


def tune_decoding(
    model: nn.Module,
    rows: int,
    repeats: int = 2,
    steps: int | None = None,
    one_call: bool = True,
) -> dict[tuple[int, int], str]:
    """Give every eligible layer of ``model`` (a `gptkiln.model.Linear`, or a
    `gptkiln.quantize.Int8Linear`) the fastest kernel of its family for ``rows``, and its
    MLPs and attention layers the compiled loops (`use_compiled_loops`, whatever ``rows``).

    Eligible: a CPU, contiguous, plain (not sharded) weight, fp32 (the `candidates`) or int8
    with fp32 scales (the `int8_candidates`), and ``rows <= FEW_ROWS``. Layers are grouped by
    weight dtype and shape; each candidate is timed running over the whole group (its best of
    ``repeats`` passes; the check against the family's reference on the first layer warms it
    up), so the weights stream from memory as they do while decoding. A shape already tuned in
    this process for this many rows and threads takes the earlier choice without timing, and
    so does one tuned by an earlier process on this machine (`gptkiln.cache`: keyed by torch
    version, CPU and its flags, weight dtype and shape, rows, threads and the candidates' names),
    once it still equals the reference on the first layer's first rows (which also warms it up).

    ``steps``: how many decode steps the caller will run at most (None: as many as come, a
    server's). A kernel that first makes a copy of each weight (`dynamic_int8`'s packed one,
    `bf16_linear`'s) is taken only where the copies are made already or the time it saves over
    ``steps`` pays for making them; else the fastest kernel that needs none
    (`_copy_costs`, measured once per machine with the choice): packing GPT-2's int8 head for
    fbgemm took 0.44 s on the 2-core Xeon to save ~1 ms a step, a loss for a 200-token
    ``generate``.

    ``one_call``: whether the caller's steps put every row at one position, so that a GPT-2's
    blocks may run in one call (`_tune_step`); a server's rows, each at its own position, run
    the layers, and its products keep their own fastest kernels. The global random state is
    left alone. Returns {(out, in): kernel name}.
    """
    use_compiled_loops(model)
    if rows > FEW_ROWS:
        return {}
    from gptkiln.cache import decode_kernel_choices, use_for_inductor

    use_for_inductor()  # `fused_int8`'s compiled loops, kept beside the choices
    stored = decode_kernel_choices()
    known = stored.entries()
    groups: dict[tuple[str, tuple[int, int]], list[nn.Module]] = {}
    for module in model.modules():
        family = _family(module)
        if family is not None:
            groups.setdefault((family, tuple(module.weight.shape)), []).append(module)
    threads = torch.get_num_threads()
    picked = {}
    with torch.no_grad():
        for (family, shape), layers in groups.items():
            kernels = _candidates_of(family)
            names = ",".join(kernels)
            key = (*shape, rows, threads, family, names)
            if key not in _CHOSEN:
                entry = f"{family} {shape[0]}x{shape[1]} rows={rows} threads={threads} {names}"
                entry += f" {CHOICE_RULES}"
                choice = known.get(entry)
                name = _for_steps(choice, steps, layers) if _valid(choice, kernels) else None
                reference = next(iter(kernels))  # needs no check against itself
                if name is None or (
                    name != reference and not _still_equal(kernels, name, layers[0], rows)
                ):
                    choice = _fastest(kernels, layers, rows, repeats)
                    if choice in _QUANTIZING_KERNELS:
                        choice = _copy_costs(kernels, choice, layers, rows, repeats)
                    stored.put(entry, choice)
                _CHOSEN[key] = choice
            name = _for_steps(_CHOSEN[key], steps, layers)
            picked[shape] = name
            for layer in layers:
                layer.few_row_kernels[rows] = kernels[name]
                _drop_unused_copies(layer)
        if one_call:
            _tune_step(model, rows, repeats, stored, known)
    for (family, shape), layers in groups.items():  # as the step's choice left them
        names = {kernel: name for name, kernel in _candidates_of(family).items()}
        picked[shape] = names.get(layers[0].few_row_kernels.get(rows), picked[shape])
    return picked


def _tune_step(model: nn.Module, rows: int, repeats: int, stored, known: dict) -> None:
    """`use_native_blocks` where the tuner chose the loops for every block product; where it
    chose other kernels for some, and the model is a GPT-2 with a KV cache of ``rows`` rows,
    time a whole decode step both ways and keep the faster: the layers with their tuned
    kernels, against the loops for every block product in one call (which saves the time
    between the products, ~0.2 ms a block, that timing the products alone does not see).
    The step is timed at the cache's last position (written before it is read: decoding
    writes each position's keys first). The choice is kept as the products' are (in this
    process, and on disk, keyed by the shapes, rows, threads and the kernels the layers had)."""
    from gptkiln.native import decode_blocks_library

    if getattr(getattr(model, "config", None), "family", None) != "gpt2":
        return
    if use_native_blocks(model, rows) or decode_blocks_library() is None:
        return
    cache = model.h[0].attn.kv_cache
    if cache is None or cache.k.size(0) != rows:
        return
    products = _block_products(model)
    families = [_family(layer) for layer in products]
    if None in families:
        return
    names = {k: n for f in set(families) for n, k in _candidates_of(f).items()}
    had = sorted({names.get(layer.few_row_kernels.get(rows), "?") for layer in products})
    c = model.config
    entry = (
        f"gpt2 step {c.n_layer}x{c.n_embd} heads={c.n_head} mlp={c.mlp_size} rows={rows} "
        f"threads={torch.get_num_threads()} layers={','.join(had)} {CHOICE_RULES}"
    )
    if entry not in _CHOSEN:
        choice = known.get(entry)
        if choice not in ("native", "layers"):
            choice = _time_step(model, products, families, rows, repeats)
            stored.put(entry, choice)
        _CHOSEN[entry] = choice
    if _CHOSEN[entry] == "native":
        for layer, family in zip(products, families):
            layer.few_row_kernels[rows] = _loop_for(layer, rows, family)
            _drop_unused_copies(layer)
        use_native_blocks(model, rows)


_LOOPS = {"float32": few_rows_linear, "int8": int8_rows_linear}
"""The project's own exact loop for each weight family."""

LOOP_KINDS = {few_rows_linear: 0, int8_rows_linear: 1, q8_rows_linear: 2}
"""The loops ``csrc/decode_blocks.c`` runs, each by its number there (``KIND_*``)."""


def _in_one_call(layer: nn.Module, kernel) -> bool:
    """Whether the one-call step runs ``layer`` by ``kernel``: one of `LOOP_KINDS`, and
    ``q8_rows`` only where the layer's input is a multiple of 64 wide (elsewhere
    ``csrc/q8_rows.c`` refuses it, and a step refused half-way is run again by the layers)."""
    return kernel in LOOP_KINDS and (kernel is not q8_rows_linear or layer.weight.size(1) % 64 == 0)


def _loop_for(layer: nn.Module, rows: int, family: str) -> Callable:
    """The loop a block product runs in the one-call step: its kernel where the step runs it
    (`_in_one_call`: ``q8_rows`` stays ``q8_rows``), else its family's exact loop."""
    kernel = layer.few_row_kernels.get(rows)
    return kernel if _in_one_call(layer, kernel) else _LOOPS[family]


def _block_products(model: nn.Module) -> list[nn.Module]:
    """A GPT-2 model's block products, in the order ``csrc/decode_blocks.c`` runs them."""
    return [
        layer
        for block in model.h
        for layer in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj)
    ]


def _time_step(model, products, families, rows: int, repeats: int) -> str:
    """Which decode step of ``model`` ran faster, "native" or "layers" (best of ``repeats``
    after one to warm up): the one call with the loops on every block product, or the layers
    with the kernels they have; the layers' kernels are left as they were."""
    token = torch.zeros(rows, 1, dtype=torch.long, device=model.wte.weight.device)
    pos = model.cache_len - 1

    def step():
        model(token, start_pos=pos, last_only=True)

    def best():
        return min(_seconds(step) for _ in range(repeats + 1))

    kept = [layer.few_row_kernels.get(rows) for layer in products]
    layers_time = best()
    for layer, family in zip(products, families):
        layer.few_row_kernels[rows] = _loop_for(layer, rows, family)
    native = use_native_blocks(model, rows)
    native_time = best() if native else math.inf
    for layer, kernel in zip(products, kept):
        layer.few_row_kernels[rows] = kernel
    use_native_blocks(model, rows)  # taken away again: the layers have other kernels
    return "native" if native_time < layers_time else "layers"


def use_native_blocks(model: nn.Module, rows: int) -> bool:
    """Give a GPT-2 ``model`` the one-call decode step of ``csrc/decode_blocks.c``
    (`gptkiln.native.DecodeBlocks`: every block and the final norm of a step; the head keeps
    its tuned kernel) for steps of ``rows`` rows, where the tuner gave every block product this
    project's own loop for that many rows (`LOOP_KINDS`: `few_rows_linear`, `int8_rows_linear`,
    `q8_rows_linear` where the layer's input is a multiple of 64 wide; `_in_one_call`): the
    step runs those loops from C instead of from Python one layer at a time, so it is offered
    only where they were timed fastest. Takes it away for ``rows`` otherwise. Returns whether
    the model has it for ``rows``.

    Measured on the 2-core Xeon, GPT-2 124M int8 at batch 1: 15.6 ms a step through the layers,
    ~6 ms of it outside the products (the interpreter, small ATen calls); figures with the one
    call in bench/README.md."""
    from gptkiln.native import DecodeBlocks, decode_blocks_library

    if getattr(getattr(model, "config", None), "family", None) != "gpt2":
        return False
    native = all(
        _in_one_call(layer, getattr(layer, "few_row_kernels", {}).get(rows))
        for layer in _block_products(model)
    ) and (decode_blocks_library() is not None)
    blocks = model.decode_blocks
    if native:
        if blocks is None:
            blocks = model.decode_blocks = DecodeBlocks(LOOP_KINDS)
        blocks.rows.add(rows)
    elif blocks is not None:
        blocks.rows.discard(rows)
    return native


_QUANTIZING_KERNELS = {
    "bf16": (bf16_linear, _BF16),
    "dynamic": (dynamic_int8, _PACKED),
    "bf16_rows": (bf16_rows_linear, _BF16_ROWS),
}
"""The `QUANTIZING_ACTIVATIONS` that keep a copy of each weight, by name: the kernel, and the
cache of the copies."""

_INEXACT = {
    "bf16": bf16_linear,
    "dynamic": dynamic_int8,
    "q8_rows": q8_rows_linear,
    "bf16_rows": bf16_rows_linear,
}
"""`QUANTIZING_ACTIVATIONS` by name: the kernels `keep_exact` takes off."""


def _drop_unused_copies(layer: nn.Module) -> None:
    """Free the copies of ``layer``'s weight that timing the candidates made (a bf16 one, a
    packed int8 one: as many bytes again as the weight, or half) where none of the kernels the
    layer now uses reads them; a later call of such a kernel makes its copy again."""
    used = set(layer.few_row_kernels.values())
    for kernel, cache in _QUANTIZING_KERNELS.values():
        if kernel not in used:
            cache.pop(id(layer.weight), None)


def use_compiled_gelu(model: nn.Module) -> int:
    """Give every MLP of ``model`` with GPT-2's tanh GELU the compiled loop of ``csrc/gelu.c``
    (`gptkiln.native.gelu_tanh_`: the bias of ``c_fc`` and the GELU in one pass over its
    output, in place), which it uses without autograd on the CPU in fp32. Returns how many
    MLPs took it: 0 where the library does not build (they keep ``F.gelu``).

    Measured on the 2-core Xeon, (4096, 3072): ``F.gelu`` 37 ms, the loop with the bias 4.7 ms;
    (16, 3072), a decode step's: 79 against 25 us. Its values are the tanh GELU's up to float
    rounding (within 5e-7 of each other over N(0, 3) inputs), so `exact_kernels` keeps it."""
    from gptkiln.model import MLP
    from gptkiln.native import gelu_library, gelu_tanh_

    mlps = [m for m in model.modules() if isinstance(m, MLP) and m.approximate == "tanh"]
    if not mlps or gelu_library() is None:
        return 0
    for mlp in mlps:
        mlp.gelu_in_place = gelu_tanh_
    return len(mlps)


def use_compiled_attention(model: nn.Module) -> int:
    """Give every SDPA attention layer of ``model`` the compiled decode-step attention of
    ``csrc/decode_attention.c`` (`gptkiln.native.decode_attention`: one query a row over the KV
    cache, masks and grouped heads included), which it uses without autograd on the CPU in fp32
    where a step has one new token. Returns how many layers took it: 0 where the library does
    not build (they keep SDPA).

    Measured on the 2-core Xeon, GPT-2 124M's 12 heads of 64: batch 1 over 130 cached positions
    ~30 us a call against SDPA's ~90 us in a decode step (SDPA's flash kernel is built for blocks
    of queries). Its values are SDPA's up to float rounding (3e-7 apart in the tests), so
    `exact_kernels` keeps it."""
    from gptkiln.model import Attention
    from gptkiln.native import decode_attention, decode_attention_library

    # a config's attention "math" asks for the explicit product (the book's): left as it is
    layers = [m for m in model.modules() if isinstance(m, Attention) and m.use_sdpa]
    if not layers or decode_attention_library() is None:
        return 0
    for layer in layers:
        layer.decode_attention = decode_attention
    return len(layers)


def use_compiled_loops(model: nn.Module) -> None:
    """`use_compiled_gelu` and `use_compiled_attention`: the project's compiled loops for
    forwards without autograd, where they build (decoding, prefill, scoring)."""
    use_compiled_gelu(model)
    use_compiled_attention(model)


def keep_exact(model: nn.Module) -> None:
    """Take the kernels of `QUANTIZING_ACTIVATIONS` off every layer of ``model`` (and free their
    weight copies): the row counts they served go back to the reference product.
    `exact_kernels` decides what a tuning offers; a model tuned before (a trainer's, which
    samples text between evaluations) keeps what it was given until this."""
    inexact = set(_INEXACT.values())
    for module in model.modules():
        kernels = getattr(module, "few_row_kernels", None)
        if kernels and inexact & set(kernels.values()):
            for rows in [r for r, k in kernels.items() if k in inexact]:
                del kernels[rows]
            _drop_unused_copies(module)


def chosen() -> dict[tuple[int, int, int, int, str], str]:
    """Every product's choice made in this process: {(out, in, rows, threads, weight dtype):
    kernel name} (the latest, where one was made both inside and outside `exact_kernels`)."""
    return {
        key[:5]: choice if isinstance(choice, str) else choice["kernel"]
        for key, choice in _CHOSEN.items()
        if isinstance(key, tuple)  # not a step's (`_tune_step`)
    }


def _family(module: nn.Module) -> str | None:
    """ "float32" or "int8": the candidates a layer takes; None when it is not tuned."""
    w = getattr(module, "weight", None)
    if not (
        hasattr(module, "few_row_kernels")
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


def _fastest(kernels: dict[str, Callable], layers: list[nn.Module], rows: int, repeats: int) -> str:
    """The name of the kernel with the least time over ``layers``; the reference (the first
    kernel: ``F.linear``, or `dequantize_linear` for int8) on a near tie. A kernel whose result
    differs from the reference's beyond float rounding (beyond `ACTIVATION_TOLERANCE` for one
    that quantizes its activations, which must also be `QUANTIZING_MARGIN` faster), or that
    raises, is never chosen. A kernel that compiles (`COMPILED`: seconds of inductor in every
    process that uses it) gives way to a kernel quantizing its activations unless it is
    `QUANTIZING_MARGIN` faster than that one."""
    first = layers[0]
    x = torch.randn(rows, first.weight.size(1), generator=torch.Generator().manual_seed(0))
    reference = next(iter(kernels))
    expected = kernels[reference](x, *_operands(first))
    best_name, best_time = reference, math.inf
    quantizing: dict[str, float] = {}
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

        seconds = min(_seconds(run) for _ in range(repeats))
        if name in QUANTIZING_ACTIVATIONS:
            quantizing[name] = seconds
            continue
        # Within 5% of the reference, keep it: no choice flips on timing noise alone.
        margin = 0.95 if best_name == reference else 1.0
        if seconds < best_time * margin:
            best_name, best_time = name, seconds
    # A kernel that changes the numbers must win clearly, so that the tokens a process decodes
    # rarely hang on timing noise; a compiled kernel must itself win clearly against it.
    for name, seconds in quantizing.items():
        margin = 1 / QUANTIZING_MARGIN if best_name in COMPILED else QUANTIZING_MARGIN
        if seconds <= best_time * margin:
            best_name, best_time = name, seconds
    return best_name


COMPILED = frozenset({"fused"})
"""The candidates that compile (inductor): every process that uses one loads inductor and its
compiled loop, ~6 s on a 2-core Xeon even from inductor's on-disk cache (`bench/README.md`)."""


def _copy_costs(
    kernels: dict[str, Callable], name: str, layers: list[nn.Module], rows: int, repeats: int
) -> dict:
    """For ``name``, a kernel that keeps a copy of each weight (`_QUANTIZING_KERNELS`), chosen
    by `_fastest`: the choice as `tune_decoding` keeps it, with what `_for_steps` weighs.
    ``without_copies``: the fastest of the kernels that keep none; ``copy_seconds``: a pass
    over ``layers`` that makes the copies less one that has them; ``step_seconds_saved``: the
    time a pass (a decode step's products of this shape) takes less than without copies."""
    x = torch.randn(rows, layers[0].weight.size(1), generator=torch.Generator().manual_seed(0))

    def run(kernel=kernels[name]):
        for layer in layers:
            kernel(x, *_operands(layer))

    cache = _QUANTIZING_KERNELS[name][1]
    for layer in layers:
        cache.pop(id(layer.weight), None)
    making = _seconds(run)
    having = min(_seconds(run) for _ in range(repeats))
    others = {n: k for n, k in kernels.items() if n not in _QUANTIZING_KERNELS}
    fallback = _fastest(others, layers, rows, repeats)
    without = min(_seconds(lambda: run(others[fallback])) for _ in range(repeats))
    return {
        "kernel": name,
        "without_copies": fallback,
        "copy_seconds": max(making - having, 0.0),
        "step_seconds_saved": max(without - having, 0.0),
    }


def _valid(choice, kernels: dict[str, Callable]) -> bool:
    """Whether a choice read from the disk cache names kernels on offer here: a name, or
    `_copy_costs`'s record."""
    if isinstance(choice, str):
        return choice in kernels
    return (
        isinstance(choice, dict)
        and choice.get("kernel") in kernels
        and choice.get("without_copies") in kernels
        and all(
            isinstance(choice.get(k), (int, float)) for k in ("copy_seconds", "step_seconds_saved")
        )
    )


def _for_steps(choice: str | dict, steps: int | None, layers: list[nn.Module]) -> str:
    """The kernel a choice gives for at most ``steps`` decode steps (None: unbounded): a
    name as it is; of `_copy_costs`'s record, the kernel that makes copies where they are made
    already (for every layer) or where ``steps`` times the time it saves pays for making them,
    else the fastest kernel without copies."""
    if isinstance(choice, str):
        return choice
    name = choice["kernel"]
    if steps is None or steps * choice["step_seconds_saved"] >= choice["copy_seconds"]:
        return name
    cache = _QUANTIZING_KERNELS[name][1]
    if all(_has_copy(cache, layer.weight) for layer in layers):
        return name
    return choice["without_copies"]


def _has_copy(cache: dict[int, tuple], weight: torch.Tensor) -> bool:
    """Whether ``cache`` (`_kept`'s) holds a copy made from ``weight`` itself: not a stale
    entry of a freed tensor whose id went to this one."""
    entry = cache.get(id(weight))
    return entry is not None and entry[0]() is weight and entry[1][0] == _stamp(weight)


def _still_equal(kernels: dict[str, Callable], name: str, layer: nn.Module, rows: int) -> bool:
    """Whether ``kernels[name]`` (a choice read from the disk cache) still gives the reference's
    result on ``layer`` for ``rows`` rows (`_agrees`), as `_fastest` asks of every candidate."""
    x = torch.randn(rows, layer.weight.size(1), generator=torch.Generator().manual_seed(0))
    # the first CHECK_ROWS outputs only: the reference converts the whole weight (60 ms for
    # GPT-2's int8 head) and a kernel that copies weights would pack it (0.44 s); a compiled
    # kernel the whole layer (its shape is what it compiles for: the check warms it up)
    operands = _operands(layer)
    if name not in COMPILED:
        operands = tuple(None if t is None else t[:CHECK_ROWS] for t in operands)
    expected = next(iter(kernels.values()))(x, *operands)
    try:
        return _agrees(name, kernels[name](x, *operands), expected)
    except RuntimeError:
        return False
    finally:
        for _, cache in _QUANTIZING_KERNELS.values():  # the slice's copy, if one was made
            cache.pop(id(operands[0]), None)


CHECK_ROWS = 256
"""How many of a layer's outputs `_still_equal` checks a choice read from the disk cache on."""


QUANTIZING_MARGIN = 0.8
"""A kernel of `QUANTIZING_ACTIVATIONS` is chosen only in at most this fraction of the best exact
kernel's time."""


def _agrees(name: str, y: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether candidate ``name``'s result may stand for the reference's: equal up to float
    rounding, or, for a kernel that quantizes its activations, within `ACTIVATION_TOLERANCE`."""
    if name in QUANTIZING_ACTIVATIONS:
        error = (y - expected).norm() / expected.norm().clamp_min(1e-30)
        return bool(torch.isfinite(y).all()) and float(error) <= ACTIVATION_TOLERANCE
    return torch.allclose(y, expected, rtol=1e-4, atol=1e-5)


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
