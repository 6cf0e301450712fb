"""The data loader off a GPU step's critical path (`gptkiln.train.prefetch`): the next
micro-batch is read on another thread while this one trains, and the batches are exactly the
source's, in order or not."""

import threading

import pytest
import torch

from gptkiln.config import TrainConfig
from gptkiln.train.optimizer_step import OptimizerStep
from gptkiln.train.prefetch import Prefetched, batches_for


class Recorded:
    """A batch source that says which thread read which (step, micro-step)."""

    def __init__(self, last_step: int = 100):
        self.reads: list[tuple[tuple[int, int], str]] = []
        self.last_step = last_step

    def get(self, step: int, micro: int):
        if step > self.last_step:
            raise IndexError(f"no step {step}")
        self.reads.append(((step, micro), threading.current_thread().name))
        return torch.full((2, 3), 10 * step + micro), torch.full((2, 3), -(10 * step + micro))


def test_the_next_micro_batch_is_read_on_another_thread_before_it_is_asked_for():
    source = Recorded()
    loader = Prefetched(source, grad_accum=2, pin=False)
    got = [loader.get(s, m) for s in range(3) for m in range(2)]
    for (s, m), (x, y) in zip([(s, m) for s in range(3) for m in range(2)], got):
        assert x.eq(10 * s + m).all() and y.eq(-(10 * s + m)).all()  # the source's, in order
    loader._ahead[1].result()
    keys = [key for key, _ in source.reads]
    assert keys == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0)]
    threads = [name for _, name in source.reads]
    assert threads[0] == threading.current_thread().name  # the first: nothing read ahead yet
    assert all(name.startswith("gptkiln-batches") for name in threads[1:])
    loader.close()


def test_a_batch_out_of_turn_is_read_there_and_then_and_a_failed_read_ahead_is_harmless():
    source = Recorded(last_step=5)
    loader = Prefetched(source, grad_accum=1, pin=False)
    assert loader.get(5, 0)[0].eq(50).all()  # reads (6, 0) ahead, which fails
    x, _ = loader.get(2, 0)  # a resume elsewhere: read now, the failed read ahead dropped
    assert x.eq(20).all()
    with pytest.raises(IndexError):
        loader.get(6, 0)  # asked for, the failure is the caller's
    loader.close()


def test_an_optimizer_step_reads_ahead_on_cuda_only():
    cfg = TrainConfig(out="unused", grad_accum=3)
    source = Recorded()
    assert batches_for(source, 3, "cpu") is source
    on_gpu = batches_for(source, 3, "cuda:0")
    assert isinstance(on_gpu, Prefetched) and on_gpu.pin and on_gpu.grad_accum == 3
    assert on_gpu.following(4, 2) == (5, 0) and on_gpu.following(4, 0) == (4, 1)
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert OptimizerStep(model, model, opt, source, cfg, "cpu").batches is source
    step = OptimizerStep(model, model, opt, source, cfg, "cuda")
    assert isinstance(step.batches, Prefetched)
    step.close()  # the reader thread stops (Trainer.close)
    assert step.batches._reader._shutdown
    on_gpu.close()
