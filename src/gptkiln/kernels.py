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

So nothing is fixed in advance: `tune_decoding` times every candidate over the model's own
weights (all layers of a shape, as decoding reads them, so the weights come from memory and not
from a warm cache) and hands each `gptkiln.model.Linear` the fastest for that number of rows.
Every candidate computes the same sums as ``F.linear`` in another order; a candidate whose result
differs beyond float rounding is never chosen. Untuned layers, layers under autograd and
products of more rows use ``F.linear``.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

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
    return y.view(-1, x2.size(0)).t()  # (M, blocks * h)


def _input_on_the_left(x2, w, b) -> torch.Tensor:
    blocks = w.size(0)
    xb = x2.expand(blocks, *x2.shape)  # (blocks, M, in), a view
    wt = w.transpose(1, 2)  # (blocks, in, h), a view
    y = torch.bmm(xb, wt) if b is None else torch.baddbmm(b[:, None, :], xb, wt)  # (blocks, M, h)
    return y.transpose(0, 1).reshape(x2.size(0), -1)  # (M, blocks * h)


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
    return found


_CHOSEN: dict[tuple[int, int, int, int], str] = {}
"""(out, in, rows, threads) -> the kernel name tuned in this process, so it is timed once."""


def tune_decoding(model: nn.Module, rows: int, repeats: int = 2) -> dict[tuple[int, int], str]:
    """Give every eligible `gptkiln.model.Linear` of ``model`` the fastest kernel for ``rows``.

    Eligible: a CPU, fp32, contiguous, plain (not sharded) weight, and ``rows <= FEW_ROWS``.
    Layers are grouped by weight shape; each candidate is timed running over the whole group
    (its best of ``repeats`` passes; the check against ``F.linear`` on the first layer warms
    it up), so the weights stream from memory as they do while decoding. A shape already tuned
    in this process for this many rows and threads takes the earlier choice without timing.
    The global random state is left alone. Returns {(out, in): kernel name}.
    """
    if rows > FEW_ROWS:
        return {}
    groups: dict[tuple[int, int], list[nn.Module]] = {}
    for module in model.modules():
        if _eligible(module):
            groups.setdefault(tuple(module.weight.shape), []).append(module)
    if not groups:
        return {}
    kernels = candidates()
    threads = torch.get_num_threads()
    picked = {}
    with torch.no_grad():
        for shape, layers in groups.items():
            key = (*shape, rows, threads)
            if key not in _CHOSEN:
                _CHOSEN[key] = _fastest(kernels, layers, rows, repeats)
            picked[shape] = _CHOSEN[key]
            for layer in layers:
                layer.few_row_kernels[rows] = kernels[_CHOSEN[key]]
    return picked


def chosen() -> dict[tuple[int, int, int, int], str]:
    """Every choice made in this process: {(out, in, rows, threads): kernel name}."""
    return dict(_CHOSEN)


def _eligible(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (
        hasattr(module, "few_row_kernels")
        and type(w) in (nn.Parameter, torch.Tensor)  # not a DTensor shard (FSDP)
        and w.device.type == "cpu"
        and w.dtype == torch.float32
        and w.is_contiguous()
    )


def _fastest(kernels: dict[str, Kernel], layers: list[nn.Module], rows: int, repeats: int) -> str:
    """The name of the kernel with the least time over ``layers``; ``F.linear`` on a tie."""
    first = layers[0]
    x = torch.randn(rows, first.weight.size(1), generator=torch.Generator().manual_seed(0))
    expected = F.linear(x, first.weight, first.bias)
    best_name, best_time = "linear", math.inf
    for name, kernel in kernels.items():
        try:
            same = torch.allclose(
                kernel(x, first.weight, first.bias), expected, rtol=1e-4, atol=1e-5
            )
        except RuntimeError:  # a kernel this build or CPU does not run
            continue
        if not same:
            continue

        def run(kernel=kernel):
            for layer in layers:
                kernel(x, layer.weight, layer.bias)

        seconds = min(_seconds(run) for _ in range(repeats))
        # Within 5% of F.linear, keep F.linear: no choice flips on timing noise alone.
        if seconds < best_time * (0.95 if best_name == "linear" else 1.0):
            best_name, best_time = name, seconds
    return best_name


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
