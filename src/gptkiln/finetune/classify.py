"""Classification fine-tuning (the book's chapter 6): texts padded to one length, a new head on
the last position's hidden state, cross-entropy and accuracy; and `classify`, which asks a
trained classifier.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gptkiln import distributed as dist_utils
from gptkiln.config import FinetuneConfig
from gptkiln.errors import GptkilnError
from gptkiln.finetune.task import ExampleBatches, FineTuning, fixed_batches
from gptkiln.train.evaluation import sum_over_batches
from gptkiln.train.task import RunContext

Batch = tuple[torch.Tensor, torch.Tensor]


def pad_texts(ids: Sequence[Sequence[int]], length: int, pad_id: int) -> torch.Tensor:
    """(N, length) ids: each text cut to ``length`` tokens, then padded with ``pad_id`` (the
    book's ``SpamDataset``; the last position, which the head reads, may be padding)."""
    rows = [list(i[:length]) + [pad_id] * (length - min(len(i), length)) for i in ids]
    return torch.tensor(rows, dtype=torch.long).reshape(len(rows), length)


def _loss_and_correct(logits: torch.Tensor, loss: torch.Tensor, y: torch.Tensor):
    """(summed loss, examples, correct) of one batch; the prediction is the last position's."""
    count = torch.tensor(y.numel(), dtype=torch.float64, device=y.device)
    correct = (logits[:, -1, :].argmax(dim=-1) == y).sum().double()
    return torch.stack([loss.double() * count, count, correct])


def classification_metrics(
    model: torch.nn.Module,
    batches: Sequence[Batch],
    device: str = "cpu",
    world: dist_utils.World | None = None,
    autocast=None,
) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) over ``batches`` of (ids, labels), each example counted
    once. The book's ``calc_loss_loader`` averages the batches' mean losses instead: the same
    number when the batches are of one size."""
    loss_sum, count, correct = sum_over_batches(
        model, batches, device, world, autocast, _loss_and_correct
    )
    return loss_sum / count, correct / count


class Classification(FineTuning):
    """`Task` of classification fine-tuning; the examples are shuffled (seeded) and split into
    train, val and test in that order (the book's ``random_split``)."""

    columns = (
        "train_loss",
        "val_loss",
        "test_loss",
        "train_accuracy",
        "val_accuracy",
        "test_accuracy",
    )
    plots = ("loss", "accuracy")

    def __init__(self, ctx: RunContext, ft: FinetuneConfig):
        from gptkiln.finetune.data import check_splits, read_labelled, split_sizes

        super().__init__(ctx, ft)
        data = read_labelled(ft.data, ft.text_column, ft.label_column)
        self.classes = data.classes
        n = len(data.texts)
        sizes = split_sizes(n, ft.val_fraction, ft.test_fraction)
        check_splits(ft.data, n, sizes, ft.val_fraction)
        n_train, n_val, n_test = sizes
        self.split = {"train": n_train, "val": n_val, "test": n_test}
        order = torch.randperm(n, generator=torch.Generator().manual_seed(ctx.cfg.seed)).tolist()
        train, val, test = order[:n_train], order[n_train:][:n_val], order[n_train + n_val :]
        try:
            ids = self.tokenizer.encode_ordinary_batch(data.texts)
        except GptkilnError as e:
            raise GptkilnError(f"--data {ft.data}: {e}") from None
        self.pad_id = self.tokenizer.eot_id if self.tokenizer.eot_id is not None else 0
        self.build_model(ids, num_classes=len(self.classes))
        ctx_len = self.model_config.context_length
        self.max_length = self._max_length([ids[i] for i in train], ctx_len)
        self.x = pad_texts(ids, self.max_length, self.pad_id)  # (N, max_length)
        self.y = torch.tensor(data.labels, dtype=torch.long)  # (N,)
        cfg = ctx.cfg
        self.batches = ExampleBatches(
            n_train,
            lambda rows: self.collate([train[i] for i in rows]),
            lambda rows: self.max_length,
            cfg,
            ctx.world,
        )
        wanted = cfg.eval_batches * cfg.batch_size * ctx.world.world_size
        self.eval_sets = {
            split: fixed_batches(rows, cfg.batch_size, wanted, self.collate) if rows else []
            for split, rows in (("train", train), ("val", val), ("test", test))
        }
        self.say_what_trains()

    def _max_length(self, train_ids: list[list[int]], ctx_len: int) -> int:
        """The tokens every text is cut or padded to: ``--max-length``, else the longest
        training text (the book's), at most the model's context."""
        if self.ft.max_length is not None:
            if self.ft.max_length > ctx_len:
                raise GptkilnError(
                    f"--max-length {self.ft.max_length} is beyond the model's context of "
                    f"{ctx_len} tokens; pass at most {ctx_len}"
                )
            return self.ft.max_length
        return min(max(len(i) for i in train_ids), ctx_len)

    def collate(self, rows: Sequence[int]) -> Batch:
        rows = torch.as_tensor(list(rows), dtype=torch.long)
        return self.x[rows], self.y[rows]

    def task_info(self) -> dict:
        return {"classes": self.classes, "max_length": self.max_length, "pad_id": self.pad_id}

    # -- what the loop asks --------------------------------------------------------------------
    def evaluate(self, model: torch.nn.Module, autocast) -> dict[str, float | None]:
        """Loss and accuracy on the fixed batches of each split (None for an empty one)."""
        row: dict[str, float | None] = {}
        for split, batches in self.eval_sets.items():
            if split == "train" and not self.cfg.eval_train:
                batches = []
            loss, accuracy = (
                classification_metrics(model, batches, self.ctx.device, self.ctx.world, autocast)
                if batches
                else (None, None)
            )
            row[f"{split}_loss"], row[f"{split}_accuracy"] = loss, accuracy
        return row

    def summary(self, row: dict) -> str:
        parts = []
        for split in ("train", "val", "test"):
            loss, accuracy = row.get(f"{split}_loss"), row.get(f"{split}_accuracy")
            if loss is not None:
                acc = "" if accuracy is None else f" (acc {100 * accuracy:.1f}%)"
                parts.append(f"{split} {loss:.3f}{acc}")
        return " | ".join(parts)

    def sample(self, model, use_cache: bool) -> None:
        return None


@dataclass
class Prediction:
    """A classifier's answer for one text: the most likely class and every class's
    probability."""

    label: str
    probabilities: dict[str, float]


@torch.no_grad()
def classify(
    run_dir: str | os.PathLike, texts: Sequence[str], *, device: str = "cpu"
) -> list[Prediction]:
    """Ask a classifier fine-tuned with ``gptkiln finetune --task classify`` about ``texts``.

    Each text is cut or padded to the run's ``max_length`` as in training (the book's
    ``classify_review``), and the head reads the last position.
    """
    from gptkiln.finetune.runs import classifier_info
    from gptkiln.loading import load_run

    model, tokenizer, run_cfg = load_run(run_dir, device=device)
    info = classifier_info(run_cfg, run_dir)
    empty = [i for i, t in enumerate(texts) if not t.strip()]
    if empty:
        raise GptkilnError(f"text {empty[0] + 1} is empty; give each --text some words")
    ids = tokenizer.encode_ordinary_batch(list(texts))
    x = pad_texts(ids, info["max_length"], info["pad_id"]).to(device)
    probs = torch.softmax(model(x)[:, -1, :].float(), dim=-1)  # (N, num_classes)
    classes = info["classes"]
    return [
        Prediction(classes[int(p.argmax())], {c: float(v) for c, v in zip(classes, p, strict=True)})
        for p in probs
    ]
