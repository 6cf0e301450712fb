"""Keep freed host memory in the process: a CPU training step stops paying page faults.

A training step allocates and frees the same large tensors every time (GPT-2 124M: the
50257 x 768 embedding gradient, the (tokens, 50257) logits and their gradient, 100-150 MB each).
glibc's malloc serves blocks of more than 32 MB with a fresh ``mmap`` and gives them back with
``munmap`` when freed, so every step the kernel maps and zero-fills those pages again, one fault
per 4 KiB page. On the 2-core machine of bench/README.md that is about a fifth of a 124M step
(2.87 -> 2.32 s at context 256, batch 2).

`keep_freed_memory` tells glibc to serve every block from its heap (``M_MMAP_MAX = 0``) and not
to trim the heap's top (``M_TRIM_THRESHOLD``), so a freed block is reused by the next step
without faults. The process keeps its peak resident memory instead of shrinking between steps,
and the heap can grow by a few copies of a large block before it settles: torch allocates
aligned blocks (``posix_memalign``), which glibc cuts only from a free chunk a little larger
than the request, so a freed block walled in by small allocations waits until its neighbours
are freed too (tests/test_allocator.py: settled within 9 rounds of a 64 MB block).
This is the practice PyTorch's own CPU launcher follows with jemalloc or tcmalloc
(``python -m torch.backends.xeon.run_cpu``); here it needs no extra library.

The ``gptkiln train`` command calls it, as the process is its own. A library caller decides for
its own process: nothing in gptkiln calls it on import.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_THRESHOLD = 2**31 - 1  # the largest int mallopt takes: 2 GiB


def keep_freed_memory() -> bool:
    """Make glibc keep freed blocks for reuse; True when applied (Linux with glibc), else False.

    Idempotent. Memory mapped before the call stays as it was; only later blocks are affected.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018  glibc only: musl's mallopt does nothing
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
