"""Fine-tuning a trained model: instruction following, classification, chat and preference
tuning (DPO), in full or with LoRA; and judging the result (`judge`).

``finetune(FinetuneConfig(base=..., data=...), train_config)`` trains with the loop of
pretraining, `gptkiln.train.Trainer`, over a task from this package:

- `instruct.InstructionTuning`: the book's chapter 7 (data `data.read_instructions`, prompts
  `templates`, batches `instruct.collate_instructions`);
- `classify.Classification`: the book's chapter 6 (data `data.read_labelled`, a ``score`` head,
  `classify.classify` to ask the result);
- `chat.ChatTuning`: conversations in the model's own chat template, loss on the assistant's
  turns (data `data.read_conversations`);
- `dpo.PreferenceTuning`: Direct Preference Optimization on preference pairs (the book's
  chapter 7 bonus; data `data.read_preferences`), the reference being the starting model;
- either with LoRA adapters (`lora`, on the `peft` library; the book's appendix E).

A fine-tuned run is a run directory like any other, with a ``"finetune"`` entry in its
config.json (`runs`) that `generate`, `chat`, `classify` and the server read.
"""

from __future__ import annotations

from typing import Any

from gptkiln.config import FinetuneConfig, TrainConfig

# The loop's settings for fine-tuning where they differ from pretraining's: the book's
# chapters 6-7 (AdamW at 5e-5, weight decay 0.1, constant rate, no warm-up; epochs over the
# examples; evaluation on 5 batches). LoRA's adapters start from zero and want a larger rate.
# AdamW stays fine-tuning's where pretraining's default became Muon on a WSD schedule. Eager
# on CUDA too unless --compile asks: batches padded to their longest example change shape from
# step to step, and each new shape would compile again.
FINETUNE_TRAIN_DEFAULTS: dict[str, Any] = dict(
    compile=False,
    optimizer="adamw",
    schedule="cosine",
    batch_size=8,
    max_steps=0,
    epochs=2,
    sampling="windows",
    lr=5e-5,
    min_lr=0.0,
    warmup_steps=0,
    decay_lr=False,
    weight_decay=0.1,
    eval_interval=10,
    eval_batches=5,
    sample_interval=10,
    checkpoint_interval=50,
)
LORA_LR = 5e-4


def train_config(ft: FinetuneConfig, **settings: Any) -> TrainConfig:
    """The loop's `TrainConfig` for ``ft``: the fine-tuning defaults (``lr`` 5e-4 with LoRA),
    then ``settings`` (``out=``, ``batch_size=``, ...)."""
    defaults = {**FINETUNE_TRAIN_DEFAULTS, "lr": LORA_LR if ft.lora else 5e-5, "data": ft.data}
    return TrainConfig.from_dict({**defaults, **settings})


def finetune(
    ft: FinetuneConfig, train: TrainConfig, *, resume: bool = False, overwrite: bool = False
):
    """Fine-tune ``ft.base`` on ``ft.data`` into the run directory ``train.out``.

    Args:
        ft: what to start from, learn and train (see `FinetuneConfig`).
        train: the loop's settings (`train_config` gives the fine-tuning defaults, eager on
            CUDA too; a `TrainConfig` made otherwise compiles on CUDA unless ``compile=False``,
            and batches of changing length compile again at each new shape).
        resume: continue the run in ``train.out``; as in pretraining, the result is the one of
            a run never interrupted.
        overwrite: start afresh over a run in ``train.out``.

    Returns:
        The loop's `gptkiln.train.TrainResult` (its ``history`` holds each evaluation's row).
    """
    from gptkiln.train import Trainer

    task = task_class(ft.task)
    trainer = Trainer(train, resume=resume, overwrite=overwrite, task=lambda ctx: task(ctx, ft))
    # As `gptkiln.train.train`: not closed on a failure (another rank may be in a collective).
    result = trainer.fit()
    trainer.close()
    return result


def task_class(name: str):
    """The `Task` class of a fine-tuning task's name."""
    from gptkiln.finetune.chat import ChatTuning
    from gptkiln.finetune.classify import Classification
    from gptkiln.finetune.dpo import PreferenceTuning
    from gptkiln.finetune.instruct import InstructionTuning

    tasks = {
        "instruct": InstructionTuning,
        "classify": Classification,
        "chat": ChatTuning,
        "dpo": PreferenceTuning,
    }
    return tasks[name]
