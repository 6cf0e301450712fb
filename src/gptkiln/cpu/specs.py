"""The table of kernels: what each candidate product reads and rounds, in one place.

Every product the tuner may give a layer is one `KernelSpec`: its name (the key of a choice on
disk), the function, the weight kind it multiplies ("float32" or "int8"), the decode precision
it computes at (``fp32``: the weights as they are; ``bf16``: the weights rounded to bf16, the
activations and sums fp32; ``int8``: int8 weights times activations rounded to 8 bits in blocks
of 32, as llama.cpp's q8_0; ``exact``: an int8 weight times fp32 activations, the dequantized
product up to rounding), whether it gives its family's reference numbers up to float rounding
(``exact``), whether it keeps a copy of each weight (``copies``), whether it needs inductor
(``inductor``: seconds of compiling in every process that uses it), whether it needs the
project's library (``library``), and the number ``csrc/generic/decode_blocks.c`` runs it by
(``loop``; None: the one-call step cannot run it).

`offered` answers what a layer of a weight kind may run at a precision: the precision's own
kernels, the reference first. The tuner times only among those, so the numbers a person gets
depend on the precision they chose, never on a timing race (`gptkiln.cpu.tuner`).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gptkiln.cpu import products as p
from gptkiln.cpu.library import library

PRECISIONS = ("fp32", "bf16", "int8")
"""The decode precisions a person chooses (``--precision``): fp32 (exact), bf16 (bf16 weights,
fp32 activations), int8 (a quantized run's int8 weights, 8-bit activations as llama.cpp's q8_0)."""


@dataclass(frozen=True)
class KernelSpec:
    """One candidate product (see the module's docstring for each field)."""

    name: str
    kernel: Callable
    weight: str  # "float32" or "int8"
    precision: str  # "fp32", "bf16", "int8" or "exact" (int8 weights, fp32 activations)
    exact: bool = True
    copies: bool = False
    inductor: bool = False
    library: bool = False
    loop: int | None = None
    needs: Callable[[], bool] | None = None  # offered only where this says so


def _onednn() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _vnni() -> bool:
    lib = library()
    return lib is not None and bool(lib.gk_q8_vnni())


SPECS: tuple[KernelSpec, ...] = (
    # fp32 weights, fp32 numbers: the reference first
    KernelSpec("linear", F.linear, "float32", "fp32"),
    KernelSpec("weight_rows", p.weight_rows, "float32", "fp32"),
    KernelSpec("input_rows", p.input_rows, "float32", "fp32"),
    KernelSpec("onednn", p.onednn, "float32", "fp32", needs=_onednn),
    KernelSpec("few_rows", p.few_rows_linear, "float32", "fp32", library=True, loop=0),
    # fp32 weights decoded at bf16: a bf16 copy of each weight, activations and sums fp32
    KernelSpec(
        "bf16_rows",
        p.bf16_rows_linear,
        "float32",
        "bf16",
        exact=False,
        copies=True,
        library=True,
        loop=3,
    ),  # fmt: skip
    # int8 weights, fp32 activations: the dequantized product up to rounding
    KernelSpec("dequantize", p.dequantize_linear, "int8", "exact"),
    KernelSpec("int8pack_mm", p.int8pack_mm, "int8", "exact"),
    KernelSpec("fused", p.fused_int8, "int8", "exact", inductor=True),
    KernelSpec("int8_rows", p.int8_rows_linear, "int8", "exact", library=True, loop=1),
    # int8 weights, activations rounded to 8 bits in blocks of 32 (q8_0), by VNNI
    KernelSpec(
        "q8_rows",
        p.q8_rows_linear,
        "int8",
        "int8",
        exact=False,
        library=True,
        loop=2,
        needs=_vnni,
    ),  # fmt: skip
    # measured and kept callable, but of no precision a person chooses: fbgemm's dynamic int8
    # product rounds each row to 7 bits on one scale (not q8_0's blocks), and bf16_linear rounds
    # the activations to bf16 as well as the weights
    KernelSpec("dynamic", p.dynamic_int8, "int8", "int8-dynamic", exact=False, copies=True),
    KernelSpec("bf16", p.bf16_linear, "float32", "bf16-activations", exact=False, copies=True),
)

for _spec in SPECS:  # what a planned layer runs inside a decoding only (`planned.PlannedProduct`)
    if not _spec.exact:
        _spec.kernel.rounds = True

BY_NAME = {spec.name: spec for spec in SPECS}
BY_KERNEL = {spec.kernel: spec for spec in SPECS}
REFERENCE = {"float32": "linear", "int8": "dequantize"}
"""Each weight kind's reference product: what every other kernel of it is checked against."""


def inexact() -> frozenset[str]:
    """The kernels whose numbers differ from their weight kind's reference beyond rounding."""
    return frozenset(s.name for s in SPECS if not s.exact)


def available(spec: KernelSpec) -> bool:
    """Whether this machine offers ``spec``: its library loads, its CPU check passes."""
    if spec.library and library() is None:
        return False
    return spec.needs is None or bool(spec.needs())


def precision_for(weight: str, precision: str) -> str:
    """The precision a layer of ``weight`` kind runs at when ``precision`` is asked: an int8
    layer at ``int8`` (its q8_0 loop where the CPU has one), else at ``exact``; a float layer at
    ``bf16`` where asked and the library loads, else ``fp32``. Inside `exact_kernels` (or with
    ``GPTKILN_EXACT_KERNELS=1``) every layer keeps its weights' own numbers: ``exact``, ``fp32``."""
    if weight == "int8":
        fast = precision == "int8" and not exact_only() and available(BY_NAME["q8_rows"])
        return "int8" if fast else "exact"
    bf16 = precision == "bf16" and not exact_only() and available(BY_NAME["bf16_rows"])
    return "bf16" if bf16 else "fp32"


def offered(weight: str, precision: str) -> dict[str, Callable]:
    """What a layer of ``weight`` kind may run at ``precision`` (`precision_for`): name ->
    kernel, the weight kind's reference first (what the others are checked against). At
    ``fp32`` and ``exact`` the tuner times them all; at ``bf16`` and ``int8`` the precision's
    one kernel is taken where it agrees with the reference within its tolerance."""
    at = precision_for(weight, precision)
    reference = BY_NAME[REFERENCE[weight]]
    found = {reference.name: reference.kernel}
    for spec in SPECS:
        if spec.weight == weight and spec.precision == at and available(spec):
            found[spec.name] = spec.kernel
    return found


_EXACT = contextvars.ContextVar("gptkiln_exact_kernels", default=False)


@contextlib.contextmanager
def exact_kernels() -> Iterator[None]:
    """A block in which every layer runs kernels that give its weights' reference numbers up to
    float rounding (no 8-bit activations, no bf16 copies), as ``GPTKILN_EXACT_KERNELS=1`` does
    for a whole process: for work whose numbers are the point, such as a benchmark's scores."""
    token = _EXACT.set(True)
    try:
        yield
    finally:
        _EXACT.reset(token)


def exact_only() -> bool:
    """Whether every layer keeps to exact kernels here (`exact_kernels`, or
    ``GPTKILN_EXACT_KERNELS=1``)."""
    return _EXACT.get() or os.environ.get("GPTKILN_EXACT_KERNELS") == "1"
