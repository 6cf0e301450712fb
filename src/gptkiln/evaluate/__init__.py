"""EleutherAI's lm-evaluation-harness on gptkiln models: its `LM` interface over the one model.

`GptkilnLM` answers the harness's three kinds of request with the model's own forward and
`gptkiln.sampling`:

- ``loglikelihood``: (context, continuation) pairs scored in batches sorted by length. A context
  shared by several continuations (a question's choices) is run once into the KV cache, and each
  continuation goes on from it; the head computes logits only where a token is scored, a
  thousand positions at a time. A pair longer than the window keeps its last
  ``context_length + 1`` tokens, as the harness's ``hf`` backend cuts it.
- ``loglikelihood_rolling``: a document scored in windows of the context length (the harness's
  rolling-window rule, `lm_eval.utils.get_rolling_token_windows`), for perplexity tasks.
- ``generate_until``: batched generation with the KV cache (`sampling.generate_batched`, as
  `gptkiln generate` runs it), the task's stop strings and ``max_gen_toks``, greedy or sampled
  as its ``generation_kwargs`` say.

None of the three uses the decoding tuner's kernels that change the sums on purpose (int8
activations, bf16 copies of the weights): generation decodes inside
`gptkiln.cpu.exact_kernels`, and scoring first takes off any such kernel an earlier tuning gave
the model (`gptkiln.cpu.DecodePlan.drop_inexact`; `evaluate_model` releases the plan after). So
the scores and tokens are the weights' own whatever the CPU, and equal the ``hf`` backend's.

`evaluate_run` runs tasks on a run and writes the harness's results JSON (by default into
``RUN/eval/``); `evaluate_model` runs them on a model in hand (a trainer's), and `run_tasks`
returns its metrics as flat columns. The class is registered as the harness's model
``gptkiln``: with the harness installed, ``python -m gptkiln.evaluate --model gptkiln
--model_args run=RUN --tasks ...`` is the harness's own command line (``lm_eval ...``) with
this package imported, and a harness with plugin discovery finds it through the
``lm_eval.models`` entry point in pyproject.toml (``gptkiln.evaluate:GptkilnLM``).

The package, bottom up: `scoring` (context-continuation pairs scored with the model: the
batches, the shared-context cache, the head only where a token is scored), `lm` (`GptkilnLM`,
the harness's model, and the harness's generation settings as a `SampleConfig`), `tasks`
(loading the harness's tasks, running them, the results table and the files written).

lm-eval is an optional dependency (the ``eval`` extra): without it this package imports, and
`evaluate_run` says in one line how to install it.
"""

from gptkiln.evaluate.lm import (
    HARNESS_MAX_GEN_TOKS,
    INSTALL,
    GptkilnLM,
    harness,
    sample_config,
)
from gptkiln.evaluate.scoring import DEFAULT_BATCH_SIZE, Pair, fit_window, plan_batches, score_pairs
from gptkiln.evaluate.tasks import (
    HarnessResults,
    check_settings,
    check_task_files,
    evaluate_model,
    evaluate_run,
    flat_metrics,
    load_tasks,
    main,
    results_table,
    run_harness,
    run_tasks,
    task_manager,
    task_names,
)

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "HARNESS_MAX_GEN_TOKS",
    "INSTALL",
    "GptkilnLM",
    "HarnessResults",
    "Pair",
    "check_settings",
    "check_task_files",
    "evaluate_model",
    "evaluate_run",
    "fit_window",
    "flat_metrics",
    "harness",
    "load_tasks",
    "main",
    "plan_batches",
    "results_table",
    "run_harness",
    "run_tasks",
    "sample_config",
    "score_pairs",
    "task_manager",
    "task_names",
]
