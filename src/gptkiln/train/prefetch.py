"""The data loader off a GPU step's critical path: the next micro-batch read (and pinned) on a
thread of its own while the GPU runs this one, then copied without blocking the host.

A `BatchSource` is a pure function of (step, micro-step) (`gptkiln.train.data_order`), so the
batch after this one is known before it is asked for: `Prefetched.get` hands over the batch read
ahead and starts reading the next. Reading ahead changes what a step computes in no way: a
request for any other batch (the first, a resumed run's) is read there and then. On CUDA the
batch waits in pinned (page-locked) host memory, so that ``.to(device, non_blocking=True)`` is an
asynchronous copy, ordered before the step's kernels on the stream, instead of a synchronous
one from pageable memory.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from gptkiln.train.task import BatchSource


class Prefetched:
    """``source``'s micro-batches, each read while the step before it runs.

    Args:
        source: the batches by (step, micro-step).
        grad_accum: micro-steps an optimizer step reads: the one after (s, grad_accum - 1)
            is (s + 1, 0).
        pin: keep each batch in pinned host memory (CUDA), for a copy that does not block.
    """

    def __init__(self, source: BatchSource, grad_accum: int, pin: bool) -> None:
        self.source, self.grad_accum, self.pin = source, grad_accum, pin
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="gptkiln-batches")
        self._ahead: tuple[tuple[int, int], Future] | None = None

    def following(self, step: int, micro: int) -> tuple[int, int]:
        """The (step, micro-step) read after ``(step, micro)``."""
        return (step, micro + 1) if micro + 1 < self.grad_accum else (step + 1, 0)

    def get(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of micro-step ``micro`` of step ``step``, on the host (pinned when ``pin``);
        the next one starts reading before this returns."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == (step, micro):
            batch = ahead[1].result()
        else:
            if ahead is not None:  # one reader of the source at a time
                ahead[1].exception()  # waits; a batch past the last one may have failed
            batch = self._read(step, micro)
        key = self.following(step, micro)
        self._ahead = (key, self._reader.submit(self._read, *key))
        return batch

    def _read(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.source.get(step, micro)
        return (x.pin_memory(), y.pin_memory()) if self.pin else (x, y)

    def close(self) -> None:
        """Stop reading ahead (a read under way finishes)."""
        self._ahead = None
        self._reader.shutdown(wait=False, cancel_futures=True)


def batches_for(source: BatchSource, grad_accum: int, device: str) -> BatchSource | Prefetched:
    """What an optimizer step reads its batches through on ``device``: on CUDA `Prefetched`
    (read ahead, pinned); elsewhere ``source`` itself (a CPU step uses every core: a reader
    beside it would only take them from it)."""
    if device.startswith("cuda"):
        return Prefetched(source, grad_accum, pin=True)
    return source
