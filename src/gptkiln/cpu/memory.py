"""A decoding model's large tensors in memory that Linux backs with 2 MB pages.

A decode step at batch 1 reads every weight once, gigabytes a token for a 1B model. Read through
4 KB pages, each 2 MB of weight costs the processor 512 page-table walks and as many TLB
entries, and the hardware prefetchers stop at every 4 KB boundary; through one 2 MB page, one.
llama.cpp gets large pages for free: it maps its GGUF file, which the kernel's page cache holds
in large folios (``FileHugePages`` in ``/proc/meminfo``). A model loaded into torch's memory gets
4 KB pages unless asked (transparent huge pages are ``madvise`` by default on most
distributions), so the plan asks: each weight of at least `LARGE` bytes is copied once into a
2 MB-aligned block marked ``MADV_HUGEPAGE`` (`madvise(2)`), and the layer's parameter points at
it (``param.data``: the same Parameter, its values bit for bit).

Measured on the 2-core EPYC (one thread, CPU ms a greedy step, the host busy on its other core):
GPT-2 124M fp32 38-44 on 4 KB pages, 30.7-31.4 on 2 MB pages; the Llama 3.2-1B shape fp32 226-228
against 207-214, bf16 104-106 against 103. A move costs a copy: 0.085 s for 500 MB where the
process reuses 2 MB pages it freed, but 1.4-2.2 ms a MB on that virtual machine for pages it
takes fresh (the hypervisor backs each as it is first touched; system time, no compaction
stalls), or where the kernel must compact memory to make 2 MB blocks: 5-10 s for a 1B model's
weights, more than its steps gain. So moves stop at the first that runs slower than `SLOW`
(smallest first: a 4 MB one tells), and on that machine the weights stay on 4 KB pages.

Nothing happens where the kernel offers no transparent huge pages (not Linux, or
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``never``) or with ``GPTKILN_HUGE_PAGES=0``;
a refused ``madvise`` leaves ordinary pages; ``GPTKILN_HUGE_PAGES=1`` moves every weight
whatever the moves cost. torch's own ``THP_MEM_ALLOC_ENABLE=1`` does the
same for its allocations, but it is read once, when torch is imported, and a model's weights
loaded from safetensors are not torch's allocations.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import time

import torch
from torch import nn

PAGE = 2 << 20
"""A transparent huge page on x86-64 and most ARM64 kernels."""

LARGE = 2 * PAGE
"""Tensors of fewer bytes stay where they are: one page or two gain little."""

ENV = "GPTKILN_HUGE_PAGES"
_MADV_HUGEPAGE = 14
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def available() -> bool:
    """Whether this process may ask for transparent huge pages: Linux, a kernel that offers
    them (``always`` or ``madvise``), libc's ``madvise``, and not ``GPTKILN_HUGE_PAGES=0``."""
    if os.environ.get(ENV) == "0" or not os.path.exists(_THP):
        return False
    try:
        with open(_THP) as f:
            mode = f.read()
    except OSError:
        return False
    return "[never]" not in mode and _madvise() is not None


@functools.cache
def _madvise():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


SLOW = 1e-3
"""Seconds a MB beyond which moving stops: 2 MB blocks are then made by the kernel's compaction
as each is asked for (a host whose memory is full of file cache), at a cost (1-2 ms a MB
measured: 5-10 s for a 1B model's weights) that the steps would not pay back."""

_compacting = False
"""Whether a move ran slower than `SLOW` in this process: no more are made."""


def on_huge_pages(t: torch.Tensor, clock=time.perf_counter) -> torch.Tensor:
    """``t``'s values in a new contiguous tensor whose memory starts on a 2 MB boundary and is
    marked for huge pages before it is first written (so the kernel backs it with them as the
    copy touches it); ``t`` itself where it is small, not on the CPU, moved before, huge pages
    are not `available`, or a move in this process ran slower than `SLOW` (from then on,
    every tensor stays where it is)."""
    global _compacting
    size = t.numel() * t.element_size()
    if size < LARGE or t.device.type != "cpu" or not available():
        return t
    if _compacting and os.environ.get(ENV) != "1":  # 1: at any cost
        return t
    if t.data_ptr() % PAGE == 0 and t.is_contiguous():  # moved before (or torch's THP block)
        return t
    began = clock()
    per = t.element_size()
    # a plain tensor, as the weight was, even where the caller decodes in inference mode (an
    # inference tensor has no version counter, which the kernels' weight copies are keyed by)
    with torch.inference_mode(False):
        block = torch.empty((size + PAGE) // per + 1, dtype=t.dtype)  # room to align inside
        start = -block.data_ptr() % PAGE
        if start % per:
            return t
        out = block[start // per : start // per + t.numel()].view(t.shape)
        if _madvise()(out.data_ptr(), size - size % PAGE, _MADV_HUGEPAGE) != 0:
            return t  # refused: ordinary pages, as before
        out.copy_(t)
    _compacting = clock() - began > SLOW * size / 2**20
    return out


def move_to_huge_pages(model: nn.Module) -> int:
    """The large parameters and buffers of ``model`` on the CPU moved `on_huge_pages`, smallest
    first (each Parameter object kept, a tied one moved once); the bytes moved."""
    tensors = [(p, None, None) for p in model.parameters()]
    tensors += [
        (b, module, name)
        for module in model.modules()
        for name, b in module._buffers.items()
        if b is not None
    ]
    tensors.sort(key=lambda t: t[0].numel() * t[0].element_size())  # a slow host shows early
    moved = 0
    with torch.no_grad(), torch.inference_mode(False):  # plain tensors, as `on_huge_pages`
        for t, module, name in tensors:
            data = t.data if module is None else t
            new = on_huge_pages(data)
            if new is data:
                continue
            if module is None:
                t.data = new
            else:
                module._buffers[name] = new
            moved += new.numel() * new.element_size()
    return moved
