"""What instruction tuning and classification share: the base model, which of its layers train
(all, the last N with the head, or LoRA adapters), batches of examples, the run's record, and
checkpoints. Each is a `gptkiln.train.Task`, trained by the one loop, `gptkiln.train.Trainer`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gptkiln import distributed as dist_utils
from gptkiln.config import FinetuneConfig, TrainConfig
from gptkiln.config.finetune import read_fields
from gptkiln.errors import GptkilnError
from gptkiln.finetune.lora import LoraSpec, add_lora
from gptkiln.model import GPT
from gptkiln.train.data_order import EpochOrder, spread_evenly
from gptkiln.train.task import RunContext

Batch = tuple[torch.Tensor, torch.Tensor]
IGNORE_INDEX = -100  # targets cross_entropy skips (its ignore_index)


class ExampleBatches:
    """Training batches of examples: epochs of a seeded order (`EpochOrder`, so resuming needs
    only the step), each micro-batch made by ``collate(ids)``.

    Args:
        n: training examples.
        collate: example ids -> (inputs, targets).
        width: example ids -> the length of their collated inputs (for the tokens seen).
    """

    walks_epochs = True
    stride = None  # examples, not windows over a stream

    def __init__(
        self,
        n: int,
        collate: Callable[[list[int]], Batch],
        width: Callable[[list[int]], int],
        cfg: TrainConfig,
        world: dist_utils.World,
    ):
        self.order = EpochOrder(n, cfg, world, what="training examples")
        self.global_batch = self.order.global_batch
        self.steps_per_epoch = self.order.steps_per_epoch
        self.collate, self.width = collate, width

    @property
    def total_steps(self) -> int:
        return self.order.total_steps

    def tokens(self, step: int) -> int:
        return sum(len(ids) * self.width(ids) for ids in self.order.step_ids(step))

    def get(self, step: int, micro: int) -> Batch:
        return self.collate(self.order.ids(step, micro))


def fixed_batches(
    ids: Sequence[int], batch_size: int, wanted: int, collate: Callable[[list[int]], Batch]
) -> list[Batch]:
    """Evaluation batches: all of ``ids``, or ``wanted`` of them spread evenly, in order."""
    chosen = [ids[i] for i in spread_evenly(len(ids), wanted)]
    return [collate(chosen[i : i + batch_size]) for i in range(0, len(chosen), batch_size)]


def classifier_from(model: GPT, num_classes: int, seed: int) -> GPT:
    """``model`` with its head replaced by ``score``, a new ``Linear(n_embd, num_classes)``
    initialised as PyTorch does after ``torch.manual_seed(seed)`` (the book's chapter 6)."""
    from gptkiln.loading import build_model

    config = dataclasses.replace(model.config, num_classes=num_classes, tie_embeddings=False)
    sd = {k: v for k, v in model.state_dict().items() if not k.startswith(("lm_head.", "score."))}
    torch.manual_seed(seed)
    head = torch.nn.Linear(config.n_embd, num_classes)
    sd["score.weight"], sd["score.bias"] = head.weight.detach(), head.bias.detach()
    return build_model(config, sd, "the classifier").train()


def train_only(model: GPT, train_layers: str) -> None:
    """Freeze all but what ``train_layers`` names: ``"all"`` freezes nothing; ``"last-N"``
    leaves the last N blocks, the final norm and the head (the book's chapter 6: the last block,
    ``final_norm`` and the new ``out_head``) training."""
    if train_layers == "all":  # a LoRA run's merged weights load frozen: all train again
        for p in model.parameters():
            p.requires_grad_(p.is_floating_point())
        return
    n = int(train_layers.removeprefix("last-"))
    if n > model.config.n_layer:
        raise GptkilnError(
            f"--train-layers {train_layers}: the model has {model.config.n_layer} blocks; pass "
            f"last-N with N <= {model.config.n_layer}, or all"
        )
    model.requires_grad_(False)
    for module in (*model.h[-n:], model.ln_f, model.head):
        module.requires_grad_(True)


@dataclass
class Example:
    """A conversation's token ids and, for each, whether it is learnt (a target of the loss)."""

    ids: list[int]
    trained: list[bool]

    def to_json(self) -> str:
        return json.dumps({"ids": self.ids, "trained": self.trained})


# -- packing (--pack): short examples end to end in one window, none attending another ------------
# The examples are packed once, in the data's order, each into the current window while it fits
# (a new window otherwise). A row of packed examples has their inputs and targets end to end (each
# as it has them alone) and their segment numbers, which the model turns into positions restarting
# at 0 and a block-diagonal causal mask (`gptkiln.positions.packed_positions_and_mask`): each
# example's logits are those it has alone. The epochs then walk the windows in a seeded order.


def pack(lengths: Sequence[int], width: int) -> list[list[int]]:
    """Windows of example numbers: in order, each example into the current window while the
    inputs (``length - 1`` each) fit in ``width``. An example is never split."""
    windows: list[list[int]] = []
    used = width + 1  # no window yet
    for i, n in enumerate(lengths):
        if used + n - 1 > width:
            windows.append([])
            used = 0
        windows[-1].append(i)
        used += n - 1
    return windows


def collate_packed(
    windows: Sequence[Sequence[Example]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of rows of packed examples: inputs (B, 2, T), each row's token ids
    and their segment numbers (0, 1, ... one per example; padding -1), targets (B, T) the
    examples' learnt next ids, else -100. T is the widest row's inputs."""
    longest = max(sum(len(e.ids) - 1 for e in window) for window in windows)
    ids = torch.full((len(windows), longest), pad_id, dtype=torch.long)
    segments = torch.full((len(windows), longest), -1, dtype=torch.long)
    targets = torch.full((len(windows), longest), IGNORE_INDEX, dtype=torch.long)
    for row, window in enumerate(windows):
        at = 0
        for number, e in enumerate(window):
            n = len(e.ids) - 1
            example = torch.as_tensor(e.ids, dtype=torch.long)
            learnt = torch.as_tensor(e.trained[1:], dtype=torch.bool)
            ids[row, at : at + n] = example[:-1]
            segments[row, at : at + n] = number
            targets[row, at : at + n] = torch.where(learnt, example[1:], IGNORE_INDEX)
            at += n
    return torch.stack([ids, segments], dim=1), targets  # (B, 2, T), (B, T)


class FineTuning:
    """A fine-tuning `Task`'s common half; each task reads its data, then calls `build_model`,
    then sets ``batches`` and its evaluation batches: `Classification` its own, the tasks of
    token sequences (instruct, chat, dpo) with `set_example_batches`, over their `collate` and
    `width`, evaluated by the loss on their learnt tokens unless they say otherwise."""

    columns: tuple[str, ...]
    plots: tuple[str, ...]
    batches: ExampleBatches

    def __init__(self, ctx: RunContext, ft: FinetuneConfig):
        from gptkiln.loading import load_run_tokenizer, read_config

        self.ctx, self.ft, self.cfg, self.run_dir = ctx, ft, ctx.cfg, ctx.run_dir
        base = Path(ft.base)
        if base.resolve() == ctx.run_dir.resolve():
            raise GptkilnError(
                f"--out {ctx.run_dir} is the base model's directory; fine-tune into another one"
            )
        self.base_cfg = read_config(base)
        self.tokenizer = load_run_tokenizer(base, self.base_cfg)
        self.lora = (
            LoraSpec(ft.lora_rank, float(ft.lora_alpha), ft.lora_qkv, ft.lora_head)
            if ft.lora
            else None
        )
        self.base_sd: dict[str, torch.Tensor] | None = None  # a LoRA run's frozen base
        self.tuner = None  # peft's LoraModel around the model, for a LoRA run
        self.base_ref: dict | None = None  # a LoRA run's reference to its base's weights
        self.split: dict[str, int] = {}

    # -- the model ---------------------------------------------------------------------------
    def build_model(
        self, sequences: Iterable[Sequence[int]], num_classes: int | None = None
    ) -> None:
        """Load the base, check the data's token ids (``sequences``) and the end-of-text have
        embeddings in it, give it a classifier head when asked, choose what trains."""
        from gptkiln.finetune.data import data_digest
        from gptkiln.loading import check_ids_fit, load_model

        ctx, ft = self.ctx, self.ft
        self.data_sha256 = data_digest(ft.data)  # the data is read and checked by now
        if ctx.resume and self.lora is not None:  # the frozen base stored with the run
            model = load_model(ctx.run_dir, adapters=False)
        else:
            model = load_model(ft.base)
            if num_classes is not None:
                model = classifier_from(model, num_classes, self.cfg.seed)
        if num_classes is None and model.config.num_classes:
            raise GptkilnError(
                f"{ft.base} is a classifier; instruction tuning needs a language model (a "
                "pretrained run or a Hugging Face model directory)"
            )
        highest = max((max(ids) for ids in sequences if len(ids)), default=-1)
        if self.tokenizer.eot_id is not None:  # each example's end, and the padding
            highest = max(highest, self.tokenizer.eot_id)
        check_ids_fit(highest, model, self.tokenizer, ft.base)  # not an IndexError in a step
        model.train()
        if self.lora is None:
            train_only(model, ft.train_layers)
        else:
            self.base_sd, self.base_ref = self._base_weights(model)
            torch.manual_seed(self.cfg.seed)  # the adapters' A matrices
            self.tuner = add_lora(model, self.lora)  # DPO's reference: the adapters off
            if num_classes is not None and not self.lora.head:
                model.score.requires_grad_(True)  # a new head trains in full
        self.model = model.to(ctx.device)
        self.model_config = model.config
        self.trainable = [n for n, p in self.model.named_parameters() if p.requires_grad]
        if ctx.resume:
            self._check_same_run()

    def _base_weights(self, model: GPT) -> tuple[dict[str, torch.Tensor], dict | None]:
        """(what a LoRA run writes of its frozen model, the reference to its base): the tensors
        the base directory lacks (a classifier's new head) and the base by reference; or, for a
        base that is not plain weights (a LoRA run itself, a quantized run) or a resumed run
        (which has them already), its whole state dict and None."""
        from gptkiln.loading import describe_weights, read_config
        from gptkiln.loading.base import BASE_ENTRY, base_directory, base_reference

        sd = dict(model.state_dict())
        if model.config.tie_embeddings:
            sd.pop("lm_head.weight", None)  # stored once, as wte.weight
        if self.ctx.resume:
            ref = read_config(self.run_dir).get(BASE_ENTRY)
            if ref is None:  # a run that keeps a copy of its base
                return sd, None
            base = base_directory(self.run_dir, ref)
        else:
            base_cfg = read_config(self.ft.base)
            if (base_cfg.get("finetune") or {}).get("lora") or base_cfg.get("quantization"):
                return sd, None
            base, ref = Path(self.ft.base), None
        _, stored, files = describe_weights(base)
        ref = ref or base_reference(base, files, self.run_dir)
        return {k: v for k, v in sd.items() if k not in stored}, ref

    def say_what_trains(self) -> None:
        """One line on stderr (rank 0), once the task is built: what fine-tunes on what."""
        if not self.ctx.world.is_main:
            return
        trained = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in self.model.parameters())
        how = (
            f"LoRA rank {self.lora.rank}, alpha {self.lora.alpha:g}, q/k/v {self.lora.qkv}"
            if self.lora
            else f"layers: {self.ft.train_layers}"
        )
        print(
            f"fine-tuning {self.ft.base} ({self.ft.task}; {how}): {trained:,} of {total:,} "
            f"parameters train ({100 * trained / total:.2f}%); "
            f"{self.split['train']:,} train, {self.split['val']:,} val, "
            f"{self.split['test']:,} test examples",
            file=sys.stderr,
            flush=True,
        )

    # -- the run's record --------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """The ``"finetune"`` entry of config.json (see `gptkiln.finetune.runs`)."""
        return {
            "task": self.ft.task,
            "base": str(Path(self.ft.base).resolve()),
            "config": self.ft.to_dict(),
            "data_sha256": self.data_sha256,
            "data_path": data_path(self.ft.data),
            "split": self.split,
            "lora": None if self.lora is None else self.lora.to_dict(),
            **self.task_info(),
        }

    def task_info(self) -> dict[str, Any]:
        raise NotImplementedError

    def _check_same_run(self) -> None:
        """A resume continues the same fine-tuning: the same settings and data file."""
        from gptkiln import checkpoint
        from gptkiln.loading import read_config

        checkpoint.check_same_model_config(self.run_dir, self.model_config)
        saved = read_config(self.run_dir).get("finetune") or {}
        if not isinstance(saved, dict) or not isinstance(saved.get("config", {}), dict):
            raise GptkilnError(
                f'{self.run_dir / "config.json"}: its "finetune" record is damaged (not an '
                "object of settings); restore the file, or start again with --overwrite in "
                "place of --resume"
            )
        now = {  # what info() records, before the task has read its examples
            "config": self.ft.to_dict(),
            "base": str(Path(self.ft.base).resolve()),
            "data_sha256": self.data_sha256,
        }
        defaults = {f.name: f.default for f in dataclasses.fields(FinetuneConfig)}
        then = {**defaults, **saved.get("config", {}), "base": saved.get("base")}  # older runs
        then = read_fields(then)  # a setting its task never read, saved before it was refused
        settings = {**now["config"], "base": now["base"]}
        settings.pop("data")  # compared by its contents, below
        diffs = [
            f"{k} {then.get(k)!r} then, {v!r} now"
            for k, v in settings.items()
            if then.get(k) != v and not (k == "template" and _same_file(then.get(k), v))
        ]
        if saved.get("data_sha256") != now["data_sha256"]:
            diffs.append(f"the contents of --data {self.ft.data}")
        if diffs:
            raise GptkilnError(
                f"cannot resume {self.run_dir}: it was fine-tuned otherwise ({'; '.join(diffs)}); "
                "resume with the same settings and data, or start again with --overwrite in place "
                "of --resume"
            )

    # -- batches of token sequences (instruct, chat, dpo) ---------------------------------------
    def set_example_batches(self, n_train: int, n_test: int, n: int) -> None:
        """The split of ``n`` examples (the first ``n_train`` train, the next ``n_test`` are
        the test set, the rest validation: the book's), the training batches and the fixed
        evaluation batches, each made by `collate`."""
        cfg, world = self.ctx.cfg, self.ctx.world
        self.train_ids = list(range(n_train))
        self.test_ids = list(range(n_train, n_train + n_test))
        self.val_ids = list(range(n_train + n_test, n))
        if self.ft.pack:
            self._pack_batches(n_train)
        else:
            self.batches = ExampleBatches(
                n_train,
                lambda ids: self.collate([self.train_ids[i] for i in ids]),
                lambda ids: self.width([self.train_ids[i] for i in ids]),
                cfg,
                world,
            )
        wanted = cfg.eval_batches * cfg.batch_size * world.world_size
        self.val_batches = fixed_batches(self.val_ids, cfg.batch_size, wanted, self.collate)
        self.train_eval_batches = (
            fixed_batches(self.train_ids, cfg.batch_size, wanted, self.collate)
            if cfg.eval_train
            else []
        )

    def _pack_batches(self, n_train: int) -> None:
        """Training batches of windows of packed examples (`pack`), said in a line first."""
        examples = [self.example(i) for i in self.train_ids]
        width = self.pack_width()
        windows = pack([len(e.ids) for e in examples], width)
        packs = [[examples[i] for i in window] for window in windows]
        self.batches = ExampleBatches(
            len(packs),
            lambda ids: collate_packed([packs[i] for i in ids], self.pad_id),
            lambda ids: max(sum(len(e.ids) - 1 for e in packs[i]) for i in ids),
            self.ctx.cfg,
            self.ctx.world,
        )
        if self.ctx.world.is_main:
            tokens = sum(len(e.ids) - 1 for e in examples)
            print(
                f"packing: {n_train:,} training examples into {len(packs):,} windows of up to "
                f"{width} tokens ({100 * tokens / (len(packs) * width):.0f}% of them filled); "
                "none attends another",
                file=sys.stderr,
                flush=True,
            )

    def learnt(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """What a batch's loss is the mean over: its learnt targets (a classifier's rows). The
        optimizer step weighs each micro-batch by it, so that micro-batches and ranks of
        uneven learnt tokens make the step one batch would (transformers' num_items_in_batch)."""
        return (y != IGNORE_INDEX).sum()

    def training_loss(self, forward, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of a batch: packed windows ((B, 2, T) inputs, ids and segments) or rows."""
        if x.dim() == 3:
            _, loss = forward(x[:, 0], y, segments=x[:, 1])
        else:
            _, loss = forward(x, y)
        return loss

    def example(self, i: int):
        """Example ``i``'s ids and whether each is learnt (a `chat.Example`), for packing."""
        raise NotImplementedError

    def pack_width(self) -> int:
        """The input tokens of a window of packed examples."""
        raise NotImplementedError

    def collate(self, ids: Sequence[int]) -> Batch:
        """(inputs, targets) of the examples ``ids``."""
        raise NotImplementedError

    def width(self, ids: Sequence[int]) -> int:
        """Input tokens a row of `collate`'s batch of ``ids`` holds (for the tokens seen)."""
        raise NotImplementedError

    # -- what the loop asks --------------------------------------------------------------------
    def evaluate(self, model: torch.nn.Module, autocast) -> dict[str, float | None]:
        """Loss per learnt token on the fixed training and validation batches."""
        from gptkiln.train.evaluation import evaluate

        device, world = self.ctx.device, self.ctx.world
        sets = (("train", self.train_eval_batches), ("val", self.val_batches))
        return {
            f"{split}_loss": evaluate(model, batches, device, world, autocast) if batches else None
            for split, batches in sets
        }

    def summary(self, row: dict) -> str:
        return loss_summary(row)

    def save(self, model_sd: dict, state: dict, train_config: dict) -> None:
        from gptkiln import checkpoint

        extra = {"finetune": self.info()}
        if self.lora is None:
            checkpoint.write_checkpoint(
                self.run_dir,
                self.model_config,
                model_sd,
                state,
                train_config=train_config,
                tokenizer=self.tokenizer,
                extra=extra,
            )
            return
        adapters = {name: model_sd[name] for name in self.trainable}
        checkpoint.write_checkpoint(
            self.run_dir,
            self.model_config,
            self.base_sd,  # written once, at the first save: it does not change
            state,
            train_config=train_config,
            tokenizer=self.tokenizer,
            extra=extra,
            adapter_sd=adapters,
            base_ref=self.base_ref,
        )
        self.base_sd = None

    def load(self) -> tuple[dict, dict]:
        from gptkiln import checkpoint

        if self.lora is None:
            return checkpoint.read_checkpoint(self.run_dir)
        adapters, state = checkpoint.read_adapter_checkpoint(self.run_dir)
        unknown = sorted(set(adapters) - set(self.trainable))
        if unknown:
            raise GptkilnError(
                f"{self.run_dir}: its adapters ({', '.join(unknown[:3])} ...) are not those of "
                "these LoRA settings; resume with the run's settings, or start again with "
                "--overwrite in place of --resume"
            )
        return {**self.model.state_dict(), **adapters}, state


def data_path(data: str) -> str:
    """Where ``--data`` is, wherever a later command runs from: a file's absolute path (an
    ``hf:`` dataset as given)."""
    from gptkiln.data import hub

    return data if hub.is_hf_spec(data) else str(Path(data).resolve())


def loss_summary(row: dict) -> str:
    """``train X | val Y (ppl Z)``: the evaluation's part of a line, as pretraining prints it."""
    val = row.get("val_loss")
    val_text = f" | val {val:.3f} (ppl {math.exp(min(val, 50)):.1f})" if val is not None else ""
    return f"train {row['train_loss']:.3f}{val_text}"


def _same_file(then: Any, now: Any) -> bool:
    """A template recorded as typed (relative, before a file's path was recorded whole) and
    the same file's whole path now."""
    if not (isinstance(then, str) and isinstance(now, str)):
        return False
    return Path(then).is_file() and Path(then).resolve() == Path(now).resolve()
