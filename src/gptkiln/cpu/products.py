"""The few-row products of CPU decoding: the candidates the tuner times, as plain functions.

While decoding, every linear layer multiplies a handful of rows (one per sequence in the batch)
by a weight matrix that is read from main memory once per token: at batch 1 the product is a
matrix-vector product bounded by memory bandwidth, at batch 8 a GEMM with 8 rows. How fast the
CPU's BLAS does either depends on the machine far more than one would guess (measured on three
2-core machines this project has run on, `bench/README.md`):

- ``F.linear`` (MKL's kernels) streamed GPT-2 124M's weights at 12-14 GB/s at batch 1 on an AMD
  EPYC (Zen 4) that reads 33 GB/s. The same product cut into row blocks of the weight, one
  batched matmul (`weight_rows`), ran at 31-41 GB/s: 33 -> 21 ms a token.
- At 8 rows the same machine's best was oneDNN's linear (`onednn`), 74 -> 40 ms a step. On an
  Intel Xeon with AMX, by contrast, ``F.linear`` ran twice as fast as `input_rows` at batch 1.
- At 4-16 rows no library product reached the memory's speed on the 2-core Xeon: ``F.linear``,
  `weight_rows`, oneDNN and MKL's packed weights all ran at 9-12 GB/s where the machine reads
  19. `few_rows_linear`, the project's own loop (``csrc/``, built once per machine by
  `gptkiln.cpu.library`), ran at 14-18 GB/s at 16 rows and 17-23 at 8.

So nothing is fixed in advance: `gptkiln.cpu.tuner` times the candidates of a layer's weight kind
and precision (`gptkiln.cpu.specs.SPECS`) over the model's own weights. Every exact candidate
computes ``F.linear``'s sums in another order. Int8 weights (`gptkiln.quantize.Int8Linear`:
y = (x qᵀ) · scale + bias) have their own family: the reference `dequantize_linear` (what
``torchao``'s int8 weight-only linear does in eager mode), torch's ``aten._weight_int8pack_mm``,
`fused_int8` (a loop inductor generates), the project's `int8_rows_linear` (int8 weights widened
to fp32 in registers, activations fp32), and two that round the activations to 8 bits on
purpose (`dynamic_int8`, fbgemm's dynamic quantized linear, and `q8_rows_linear`, llama.cpp's
q8_0). For bf16 decoding of an fp32 layer, `bf16_rows_linear` reads a bf16 copy of the weight
in `few_rows_linear`'s loop (activations and sums fp32), and `bf16_linear` multiplies in bf16.
What each rounds, and which copies each keeps, is the spec table's to say, not this module's.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F

from gptkiln.cpu.library import library
from gptkiln.cpu.memory import on_huge_pages

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
    """``F.linear(x, weight, bias)`` by the project's own AVX-512 loop (``csrc/*/rows.c``,
    built once per machine by `gptkiln.cpu.library`): each thread streams whole 4-row blocks of the
    weight from memory once, multiplies them with every row of x while the next block is
    prefetched, and adds each output's partial sums up once at the end.

    For fp32, 1 to ``FEW_ROWS`` rows, an input width that is a multiple of 16 and contiguous
    tensors; anything else goes to ``F.linear``. Offered by the spec table only where the library
    loads (`gptkiln.cpu.library.library`).
    """
    lib = library()
    y = _by_row_loop(lib and lib.few_rows_linear, x, weight, (), bias, torch.float32)
    return F.linear(x, weight, bias) if y is None else y


def _by_row_loop(
    loop, x, weight, operands, bias, weight_dtype, chunked: bool = False
) -> torch.Tensor | None:
    """``x`` (..., in) times ``weight`` (out, in) by a compiled loop of ``csrc/*/rows.c``,
    ``loop(x, weight, *operands, bias, y, rows, out, in, threads)``; None where there is no
    loop (None) or it does not take these tensors (fp32 x of 1 to ``FEW_ROWS`` rows, an input
    width that is a multiple of 16, a contiguous weight of ``weight_dtype``, an fp32 bias; every
    tensor on the CPU): the caller takes its reference. ``chunked``: more rows go through the
    loop ``FEW_ROWS`` at a time (a rounding kernel's prefill: each row's sums as a step's)."""
    n_out, n_in = weight.shape
    x2 = x.reshape(-1, n_in)
    if chunked and x2.size(0) > FEW_ROWS:
        parts = []
        for start in range(0, x2.size(0), FEW_ROWS):
            part = _by_row_loop(loop, x2[start : start + FEW_ROWS], weight, operands, bias,
                                weight_dtype)  # fmt: skip
            if part is None:
                return None
            parts.append(part)
        return torch.cat(parts).reshape(*x.shape[:-1], n_out)
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
    ``csrc/*/rows.c``, built once per machine by `gptkiln.cpu.library`): `few_rows_linear`'s
    streaming of 4-row weight blocks, with each int8 weight widened to fp32 in registers and
    each output's scale applied once to its sum. The activations stay fp32, so it equals the
    reference up to rounding (it is not inexact (`gptkiln.cpu.specs`)). Measured on the 2-core
    Xeon over GPT-2 124M's 49 int8 weights at batch 1: 6.3-6.7 ms (18.5-19.5 GB/s),
    `dynamic_int8` 5.8-8.9 and the reference 72-89 in the same processes; at 4 rows 8.6-10.2
    against 10.0-12.4.

    For fp32 x of 1 to ``FEW_ROWS`` rows, an input width that is a multiple of 16, contiguous
    int8 weight and fp32 scales; anything else goes to `dequantize_linear`. Offered by
    the spec table only where the library loads (`gptkiln.cpu.library.library`).
    """
    y = None
    cpu = x.device.type == scale.device.type == "cpu"  # an untuned Int8Linear on CUDA comes here
    if cpu and scale.dtype == torch.float32 and scale.is_contiguous():  # only then: the library
        lib = library()
        y = _by_row_loop(lib and lib.int8_rows_linear, x, qweight, (scale,), bias, torch.int8)
    return dequantize_linear(x, qweight, scale, bias) if y is None else y


def q8_rows_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The int8 product with 8-bit *activations*, by the project's own AVX-512 VNNI loop
    (``csrc/*/q8_rows.c``, built once per machine by `gptkiln.cpu.library`): each row of x is
    rounded to 8 bits in blocks of 32 values, each block with its own scale (llama.cpp's q8_0), and
    multiplied by the int8 weights in int8 (``vpdpbusd``: 64 products an instruction), in
    `int8_rows_linear`'s streaming of 4-row weight blocks; each output's weight scale once at
    the end. It changes the numbers as q8_0 does (inexact (`gptkiln.cpu.specs`)): ~1% of the
    output's norm against `dequantize_linear` over N(0, 1) rows; a block of 32 holding an
    outlier rounds only its own 31 others coarsely. It needs no copy of the weights (unlike
    `dynamic_int8`, whose per-call scale is one per row and whose weights fbgemm repacks).

    Measured on the 2-core Xeon over GPT-2 124M's 48 block products and head at batch 1 (a C
    benchmark of both loops, one process): 2.9-3.0 ms a step against `int8_rows_linear`'s
    5.2-5.5. For fp32 x of 1 to ``FEW_ROWS`` rows, an input width that is a multiple of 64,
    contiguous int8 weight and fp32 scales; more rows (a prefill) go through the loop
    ``FEW_ROWS`` at a time, tensors it refuses round the same by torch (`q8_0`), and an input
    width that is no multiple of 64 goes to
    `int8_rows_linear` (exact) at every row count. Offered by the spec table at the int8
    precision, where the library has the VNNI loop."""
    y = None
    cpu = x.device.type == scale.device.type == "cpu"
    if cpu and scale.dtype == torch.float32 and scale.is_contiguous():
        lib = library()
        loop = lib and lib.q8_rows_linear
        y = _by_row_loop(loop, x, qweight, (scale,), bias, torch.int8, chunked=True)
    if y is not None:
        return y
    if qweight.size(1) % Q8_BLOCKS_OF or x.dtype != torch.float32:
        # an input the loop never takes (not a multiple of 64 wide): the exact int8 loop, at
        # every row count alike
        return int8_rows_linear(x, qweight, scale, bias)
    # tensors the loop refuses: the same rounding, by torch (its sums in another order)
    return dequantize_linear(q8_0(x), qweight, scale, bias)


Q8_BLOCKS_OF = 64
"""`q8_rows_linear`'s loop takes inputs a multiple of this wide (two blocks of 32 a chunk)."""


def q8_0(x: torch.Tensor) -> torch.Tensor:
    """``x`` (..., in) as q8_0 rounds it, in fp32: each block of 32 values to the nearest of 255
    steps of ``d = max |x_b| / 127`` (ties to even, as ``csrc/*/q8_rows.c``'s ``lrintf``); a block
    holding what is not finite all NaN, so that it stays so in every output of its row."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)  # no -1: x may have no rows
    amax = blocks.abs().amax(-1, keepdim=True)
    finite = blocks.isfinite().all(-1, keepdim=True)
    seven = torch.full_like(amax, 127.0)
    inv = torch.where(finite & (amax > 0), seven / torch.where(amax > 0, amax, 1.0), 0.0)
    d = torch.where(finite, amax / seven, torch.nan)
    return (torch.round(torch.where(finite, blocks, 0.0) * inv) * d).reshape(x.shape)


def onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear (the kernel inductor calls on CPU), on the plain weight: no packed copy."""
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.size(-1)), weight, bias, "none", [], "")
    return y.reshape(*x.shape[:-1], weight.size(0))


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
    (``csrc/*/rows.c``) over a bf16 copy of the weight (made once per weight and kept while
    it lives unchanged, as `bf16_linear`'s), each weight widened back to fp32 exactly in
    registers, the activations and the sums in fp32. At batch 1 a decode step streams its
    weights from memory, so half the bytes is up to half the time, on any CPU with AVX-512
    (no bf16 instructions needed). The weights' rounding moves the output by ~0.1% of its
    norm: inexact (`gptkiln.cpu.specs`) (held to `ACTIVATION_TOLERANCE` and
    `QUANTIZING_MARGIN`, left out by exact decoding), and its copy is weighed against the steps
    a caller will run (`_copy_costs`). Measured on the 2-core Xeon, GPT-2's 50,257x768 head at
    batch 1 in one process: 1.9 ms against ``F.linear``'s 4.2 (`bf16_linear` 4.5). For what
    the loop does not take (`_by_row_loop`), ``F.linear`` over the same rounded weights; more
    rows than ``FEW_ROWS`` (a prefill) go through the loop that many at a time: each row's
    numbers are those a step of it gets."""
    lib = library()
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return F.linear(x, weight, bias)
    rounded = bf16_copy(weight)
    if lib is not None:  # a prefill's many rows through the loop too, FEW_ROWS at a time
        y = _by_row_loop(lib.bf16_rows_linear, x, rounded, (), bias, torch.bfloat16, chunked=True)
        if y is not None:
            return y
    # tensors the loop refuses (a width no multiple of 16): the same rounded weights for torch's
    # product; the weight itself where it holds bf16's values already (a bf16 checkpoint
    # decoding in fp32), else widened for the call
    same = _kept(_BF16_SAME, (weight,), lambda: torch.equal(rounded.to(weight.dtype), weight))
    return F.linear(x, weight if same else rounded.to(x.dtype), bias)


def bf16_copy(weight: torch.Tensor) -> torch.Tensor:
    """The bf16 copy of ``weight`` `bf16_rows_linear` reads (and the one-call step, for a layer
    it runs at bf16), made once and kept while the weight lives unchanged."""
    return _kept(
        _BF16_ROWS,
        (weight,),
        lambda: on_huge_pages(weight.detach().to(torch.bfloat16).contiguous()),
    )


_BF16_ROWS: dict[int, tuple] = {}
"""id(weight) -> (weakref of the weight, its version, the bf16 copy `bf16_rows_linear` reads)."""

_BF16_SAME: dict[int, tuple] = {}
"""id(weight) -> (weakref of the weight, its version, whether its bf16 copy equals it)."""


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
the inexact kernels may show against its family's reference and still be chosen. 7-bit
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
    """What a copy made from ``t`` was made from: its version (bumped by in-place changes; an
    inference tensor, made inside ``torch.inference_mode``, has none), its storage and shape
    (``param.data = ...`` changes them and leaves the version)."""
    return None if t.is_inference() else t._version, t.data_ptr(), t.shape


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
