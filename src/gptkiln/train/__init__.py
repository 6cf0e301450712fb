"""Training: `train(config)` runs the loop, evaluates, samples, logs, checkpoints and resumes.

Two parts, one seam: `Trainer` is the loop (optimizer steps with gradient accumulation and
clipping, the schedule, evaluation, samples, metrics.csv, loss.png, atomic checkpoints, exact
resume, torchrun), over any model and batch source that a `Task` gives it; `LanguageModeling`
is pretraining's task (prepared text, sliding or random windows, a fresh GPT). Fine-tuning's
tasks (`gptkiln.finetune`) give the same loop an instruction-following or a classification
model, so `gptkiln train` and `gptkiln finetune` share one loop, one checkpoint format, one
resume and one metrics file.

Data order is a pure function of (seed, step): optimizer step s reads the global items
[s*G, (s+1)*G) of an epoch's seeded permutation (or of a seeded random stream), G = batch_size x
grad_accum x world_size, and rank r takes its own slice of them. So a resumed run needs only the
step to continue the exact data order, and N processes read disjoint items that together are
exactly what one process with N times the batch would read.

The modules, each one idea (this package re-exports their public names):

- `loop`: `Trainer` (set-up, the step loop, divergence checks), `train`, `TrainResult`, and
  `now`, the clock the loop reads (replace ``gptkiln.train.loop.now`` to fake it).
- `task`: the `Task` and `BatchSource` protocols, `RunContext`, `LanguageModeling`.
- `data_order`: `EpochOrder`, `Batches`, `eval_batches`, `spread_evenly`.
- `evaluation`: `sum_over_batches`, `evaluate`, `evaluate_text`, `bits_per_char`, `sample_text`.
- `run_log`: metrics.csv (`RunLog`, `read_metrics`), `TensorBoardLog`, the progress bar.
- `checkpointing`: `Checkpoints` (cadence, save, restore), `start_mode`, `resume_after_restart`.
- `precision`: `--precision auto` resolved to fp32 or bf16, measured on the CPU, kept on resume.
- `timing`: `TrainingClock` (the time budget), `Speedometer` (tokens per second).
- `stops`: the one-line messages of a run that diverged, was stopped, or has nothing to train.
"""

from gptkiln.train.checkpointing import Checkpoints, Progress, resume_after_restart, start_mode
from gptkiln.train.checkpointing import _gather_rng as _gather_rng
from gptkiln.train.data_order import Batches, EpochOrder, eval_batches, spread_evenly
from gptkiln.train.evaluation import (
    Evaluation,
    bits_per_char,
    evaluate,
    evaluate_text,
    loss_sums,
    sample_text,
    sum_over_batches,
)
from gptkiln.train.loop import Trainer, TrainResult, check_one_gpu_each, now, train
from gptkiln.train.run_log import (
    METRICS_FIELDS,
    ProgressBar,
    RunLog,
    TensorBoardLog,
    read_metrics,
    tensorboard_writer_class,
)
from gptkiln.train.task import BatchSource, LanguageModeling, RunContext, Task, model_config_for
from gptkiln.train.task import _prepared_matches as _prepared_matches
from gptkiln.train.timing import Speedometer, TrainingClock

__all__ = [
    "METRICS_FIELDS",
    "BatchSource",
    "Batches",
    "Checkpoints",
    "EpochOrder",
    "Evaluation",
    "Progress",
    "ProgressBar",
    "RunContext",
    "RunLog",
    "Speedometer",
    "Task",
    "TensorBoardLog",
    "TrainResult",
    "Trainer",
    "TrainingClock",
    "LanguageModeling",
    "bits_per_char",
    "check_one_gpu_each",
    "eval_batches",
    "evaluate",
    "evaluate_text",
    "loss_sums",
    "model_config_for",
    "now",
    "read_metrics",
    "resume_after_restart",
    "sample_text",
    "spread_evenly",
    "start_mode",
    "sum_over_batches",
    "tensorboard_writer_class",
    "train",
]
