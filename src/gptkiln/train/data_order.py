"""Which items each optimizer step reads: a pure function of (seed, step, rank), so that a resumed
run needs only the step to continue the exact data order.

Optimizer step s reads the global items [s*G, (s+1)*G) of an epoch's seeded permutation (or of a
seeded random stream), G = batch_size x grad_accum x world_size, and rank r takes its own slice
of them; so N processes read disjoint items that together are exactly what one process with N
times the batch would read. Evaluation reads a fixed list of windows spread over a split.
"""

from __future__ import annotations

import numpy as np
import torch

from gptkiln import distributed as dist_utils
from gptkiln.config import TrainConfig
from gptkiln.errors import GptkilnError


class EpochOrder:
    """Which of ``n_items`` items each (optimizer step, micro-step, rank) reads, in epochs.

    Epoch e is a permutation of the items seeded with ``seed + e``, walked ``global_batch`` =
    batch_size x grad_accum x world_size items a step (the items left over at an epoch's end are
    dropped, as a DataLoader with ``drop_last``); rank r takes its own ``batch_size`` slice of
    each micro-step. Computed from indices alone, so resuming needs only the step.
    """

    def __init__(
        self,
        n_items: int,
        cfg: TrainConfig,
        world: dist_utils.World,
        what: str = "windows",
    ):
        self.n_items, self.batch_size, self.world = n_items, cfg.batch_size, world
        self.grad_accum = cfg.grad_accum
        self.seed, self.max_steps, self.epochs = cfg.seed, cfg.max_steps, cfg.epochs
        self.global_batch = cfg.batch_size * cfg.grad_accum * world.world_size
        self.steps_per_epoch = n_items // self.global_batch
        if self.steps_per_epoch == 0:
            fix = "or context_length, or use more text" if what == "windows" else "or use more data"
            raise GptkilnError(
                f"the training split has {n_items} {what}, fewer than one step's "
                f"{self.global_batch} (batch_size x grad_accum x processes); lower batch_size "
                + fix
            )
        self._perm: tuple[int, torch.Tensor] | None = None

    @property
    def total_steps(self) -> int:
        return self.max_steps or self.epochs * self.steps_per_epoch

    def _order(self, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s permutation, in int32 where the items fit (torch draws the same
        permutation in either dtype: half the memory, 4 bytes an item, for the same order)."""
        if self._perm is None or self._perm[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            dtype = torch.int32 if self.n_items <= torch.iinfo(torch.int32).max else torch.int64
            self._perm = (epoch, torch.randperm(self.n_items, generator=gen, dtype=dtype))
        return self._perm[1]

    def ids(self, step: int, micro: int, rank: int | None = None) -> list[int]:
        """The items of this rank's (or ``rank``'s) micro-step ``micro`` of step ``step``."""
        rank = self.world.rank if rank is None else rank
        first = (micro * self.world.world_size + rank) * self.batch_size
        epoch, within = divmod(step, self.steps_per_epoch)
        order = self._order(epoch)
        return order[within * self.global_batch + first :][: self.batch_size].tolist()

    def step_ids(self, step: int) -> list[list[int]]:
        """The items of every micro-step of every rank of optimizer step ``step``."""
        ranks = range(self.world.world_size)
        return [self.ids(step, m, r) for m in range(self.grad_accum) for r in ranks]


class Batches:
    """Training windows by (step, micro-step, rank), computed from indices alone.

    ``"windows"`` sampling walks the sliding windows in epochs (`EpochOrder`); ``"random"``
    reads the windows of a seeded random stream in order, and ``"aligned"`` the same stream
    with each window that crosses a document's end moved to start at it
    (`AlignedWindowDataset`; ``eot_id``, the tokenizer's end of text, must be given).
    """

    walks_epochs: bool  # the order depends on the global batch: resuming must keep it

    def __init__(
        self,
        tokens: np.ndarray,
        cfg: TrainConfig,
        context_length: int,
        world: dist_utils.World,
        eot_id: int | None = None,
    ):
        from gptkiln.data.windows import (
            AlignedWindowDataset,
            RandomWindowDataset,
            SlidingWindowDataset,
        )

        self.cfg, self.world = cfg, world
        self.context_length = context_length
        self.global_batch = cfg.batch_size * cfg.grad_accum * world.world_size
        self.walks_epochs = cfg.sampling == "windows"
        self.order: EpochOrder | None = None
        self.stride: int | None = None  # the windows' step, where the order walks them
        if self.walks_epochs:
            self.stride = cfg.stride or context_length
            self.dataset = SlidingWindowDataset(tokens, context_length, self.stride)
            self.order = EpochOrder(len(self.dataset), cfg, world)
            self.steps_per_epoch = self.order.steps_per_epoch
        else:
            num = max(1, cfg.max_steps) * self.global_batch
            if cfg.sampling == "aligned":
                if eot_id is None:
                    raise GptkilnError(
                        "sampling 'aligned' starts windows at the end of text token, and this "
                        "tokenizer has none; use sampling 'random'"
                    )
                self.dataset = AlignedWindowDataset(tokens, context_length, num, cfg.seed, eot_id)
            else:
                self.dataset = RandomWindowDataset(tokens, context_length, num, cfg.seed)
            self.steps_per_epoch = cfg.max_steps

    @property
    def total_steps(self) -> int:
        return self.cfg.max_steps or self.cfg.epochs * self.steps_per_epoch

    def tokens(self, step: int) -> int:
        """Input tokens that optimizer step ``step`` reads, over all ranks and micro-steps."""
        return self.global_batch * self.context_length

    def get(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of shape (batch_size, T) for this rank's micro-step of optimizer step ``step``."""
        b = self.cfg.batch_size
        if self.order is not None:
            ids = self.order.ids(step, micro)
        else:
            first = (micro * self.world.world_size + self.world.rank) * b
            ids = range(step * self.global_batch + first, step * self.global_batch + first + b)
        xs, ys = zip(*(self.dataset[i] for i in ids), strict=True)
        return torch.stack(xs), torch.stack(ys)


def eval_batches(
    tokens: np.ndarray, context_length: int, batch_size: int, n_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed list of evaluation batches over a split's non-overlapping windows.

    When the split has at most ``n_batches * batch_size`` windows, all of them, in order (the
    book's validation loader). When it has more, that many windows spread evenly from the split's
    start to its end, so the estimate covers the whole split and not only its first pages (on
    char-level tiny Shakespeare the first 15k characters of the validation split score ~0.015
    lower than the whole split). Raises when the split is shorter than one window.
    """
    from gptkiln.data.windows import SlidingWindowDataset

    dataset = SlidingWindowDataset(tokens, context_length, context_length)
    order = spread_evenly(len(dataset), n_batches * batch_size)
    batches = []
    for start in range(0, len(order), batch_size):
        xs, ys = zip(*(dataset[i] for i in order[start : start + batch_size]), strict=True)
        batches.append((torch.stack(xs), torch.stack(ys)))
    return batches


def spread_evenly(n: int, wanted: int) -> list[int]:
    """All of ``range(n)`` when ``n <= wanted``, else ``wanted`` indices spread evenly from the
    first to the last."""
    if n <= wanted:
        return list(range(n))
    spread = torch.linspace(0, n - 1, wanted, dtype=torch.float64)
    return spread.round().long().tolist()  # float64: exact for any real corpus
