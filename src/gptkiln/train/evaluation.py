"""Measuring a model while it trains: sums over fixed batches split across ranks (the loss, bits
per character of the text, a task's own counts), and short samples to watch it learn by."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from gptkiln import distributed as dist_utils
from gptkiln.config import SampleConfig, TrainConfig
from gptkiln.model import GPT


@torch.no_grad()
def sum_over_batches(
    model: torch.nn.Module,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    device: str,
    world: dist_utils.World | None,
    autocast,
    measure: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> list[float]:
    """Sums over ``batches`` of ``measure(logits, loss, y)``, a float64 tensor of sums per batch
    (e.g. loss x targets, targets), added up over all ranks, which split the batches.

    Every rank runs the same number of forwards (FSDP needs all ranks in every forward); the
    padding ones are not counted.
    """
    world = world or dist_utils.World()
    was_training = model.training
    model.eval()
    rounds = math.ceil(len(batches) / world.world_size)
    totals = None
    for i in range(rounds):
        j = i * world.world_size + world.rank
        x, y = batches[j % len(batches)]
        x, y = x.to(device), y.to(device)
        with autocast or torch.autocast(device_type="cpu", enabled=False):
            logits, loss = model(x, y)
        sums = measure(logits, loss, y)
        totals = torch.zeros_like(sums) if totals is None else totals
        if j < len(batches):
            totals += sums
    totals = dist_utils.all_reduce_sum(totals, world)
    model.train(was_training)
    return totals.tolist()


def loss_sums(logits: torch.Tensor, loss: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(summed loss, targets) of one batch: the loss is a mean over the targets that count,
    those not -100 (padding masked by a fine-tuning batch)."""
    count = (y != -100).sum().double()
    return torch.stack([loss.double() * count, count])


def evaluate(
    model: torch.nn.Module,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    device: str,
    world: dist_utils.World | None = None,
    autocast=None,
) -> float:
    """Mean cross-entropy over ``batches`` (weighted by targets), the work split across ranks."""
    loss_sum, count = sum_over_batches(model, batches, device, world, autocast, loss_sums)
    return loss_sum / count


@dataclass
class Evaluation:
    """What `evaluate_text` measured over a list of batches.

    Attributes:
        loss: mean cross-entropy per target token, in nats.
        tokens: target tokens scored.
        characters: characters of those targets' text (`Tokenizer.char_counts`).
    """

    loss: float
    tokens: int
    characters: int

    @property
    def bits_per_char(self) -> float | None:
        """The summed loss over the characters of the text scored, in bits: comparable across
        tokenizers, which cut the same text into different numbers of tokens."""
        if not self.characters:
            return None
        return bits_per_char(self.loss, self.tokens, self.characters)


def bits_per_char(loss: float, tokens: int, characters: int) -> float:
    """Bits per character of a text from its mean cross-entropy per token in nats: the summed
    loss over the characters, over ln 2 (for a char tokenizer exactly ``loss / ln 2``)."""
    return loss * (tokens / characters) / math.log(2)


def evaluate_text(
    model: torch.nn.Module,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    device: str,
    char_counts: torch.Tensor,
    world: dist_utils.World | None = None,
    autocast=None,
) -> Evaluation:
    """`evaluate`, also counting the characters of the targets' text for bits per character.

    Args:
        char_counts: characters per id, ``(vocab_size,)`` (`Tokenizer.char_counts`).
    """
    counts = char_counts.to(device)

    def measure(logits, loss, y):  # (summed loss, targets, characters) of one batch
        return torch.cat([loss_sums(logits, loss, y), counts[y].sum().double().reshape(1)])

    loss_sum, tokens, chars = sum_over_batches(model, batches, device, world, autocast, measure)
    return Evaluation(loss=loss_sum / tokens, tokens=int(tokens), characters=int(chars))


def sample_text(
    model: GPT, tokenizer, prompt: str, max_new_tokens: int, seed: int, use_cache: bool = True
) -> str:
    """A short sample from ``prompt`` (top-k 50, temperature 0.8) for watching a run learn."""
    from gptkiln.sampling import generate
    from gptkiln.tokenizers import encode_prompt

    ids = encode_prompt(tokenizer, prompt)  # an empty prompt starts from end-of-text
    cfg = SampleConfig(max_new_tokens=max_new_tokens, temperature=0.8, top_k=50, seed=seed)
    new = generate(model, ids, cfg, eot_id=tokenizer.eot_id, use_cache=use_cache)
    return prompt + tokenizer.decode(new)


BENCHMARK_PREFIX = "eval/"
"""What metrics.csv and TensorBoard call a harness task's metric: ``eval/TASK/METRIC``."""


class TaskBenchmarks:
    """lm-evaluation-harness tasks (``cfg.eval_tasks``) on the model while it trains: on the
    final weights, and every ``cfg.eval_tasks_interval`` steps when set.

    Rank 0 alone runs them, on the model itself (not its DDP wrapper), while the other ranks
    wait at a barrier (so a harness run must end within GPTKILN_DIST_TIMEOUT). Under FSDP no
    rank holds the whole model, so it is refused. The random number generators (Python, NumPy,
    torch), which the harness seeds, are put back afterwards: training goes on as it would have
    without the tasks.

    Args:
        cfg: the run's settings (``eval_tasks``, ``eval_tasks_interval``, ``eval_tasks_limit``,
            ``eval_tasks_include_path``, ``batch_size``, ``parallel``).
        run_dir: the results JSON of the final weights goes into ``run_dir/eval/``.
        world: this process's rank.
    """

    def __init__(self, cfg: TrainConfig, run_dir: Path, world: dist_utils.World) -> None:
        from gptkiln.errors import GptkilnError
        from gptkiln.evaluate import load_tasks

        if world.distributed and cfg.parallel == "fsdp":
            raise GptkilnError(
                "--eval-tasks with --parallel fsdp: no process holds the whole model to run the "
                "harness on; use --parallel ddp, or evaluate the run afterwards with "
                "`gptkiln evaluate OUT --tasks ...`"
            )
        self.cfg, self.run_dir, self.world = cfg, run_dir, world
        limit = cfg.eval_tasks_limit
        self.limit = int(limit) if limit is not None and limit >= 1 else limit
        flag = "--eval-tasks-include-path"
        load_tasks(cfg.eval_tasks, cfg.eval_tasks_include_path, flag)  # bad tasks: before step 1

    def due(self, step: int, last: bool) -> bool:
        """Whether the tasks run after optimizer step ``step`` (``last``: the final one)."""
        interval = self.cfg.eval_tasks_interval
        return last or (interval is not None and step % interval == 0)

    def run(self, model: GPT, tokenizer, step: int, last: bool, write) -> dict[str, float]:
        """The tasks' metrics as ``eval/TASK/METRIC`` columns (on rank 0; {} on the others).
        After the final step the results JSON is written into ``run_dir/eval/`` and its table
        and path go to ``write`` (the run's printed log)."""
        from gptkiln.evaluate import evaluate_model

        columns: dict[str, float] = {}
        if self.world.is_main:
            cfg = self.cfg
            with _rng_kept(model.wte.weight.device):
                report = evaluate_model(
                    model,
                    tokenizer,
                    cfg.eval_tasks,
                    include_path=cfg.eval_tasks_include_path,
                    limit=self.limit,
                    batch_size=cfg.batch_size,
                    output_path=self.run_dir / "eval" if last else None,
                    source=f"{self.run_dir} at step {step}",
                )
            columns = {BENCHMARK_PREFIX + k: v for k, v in report.metrics().items()}
            if last:
                write(f"{report.table}\nharness results written to {report.path}")
        dist_utils.barrier(self.world)  # the other ranks wait for rank 0's tasks
        return columns


@contextlib.contextmanager
def _rng_kept(device: torch.device):
    """Python's, NumPy's and torch's random states (the CPU's and a CUDA ``device``'s) as they
    were on entry, put back on exit."""
    import random

    import numpy as np

    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
