"""Measuring a model while it trains: sums over fixed batches split across ranks (the loss, bits
per character of the text, a task's own counts), and short samples to watch it learn by."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gptkiln import distributed as dist_utils
from gptkiln.config import SampleConfig
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

    ids = tokenizer.encode(prompt)
    cfg = SampleConfig(max_new_tokens=max_new_tokens, temperature=0.8, top_k=50, seed=seed)
    new = generate(model, ids, cfg, eot_id=tokenizer.eot_id, use_cache=use_cache)
    return prompt + tokenizer.decode(new)
