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
the model (`gptkiln.cpu.tuner.keep_exact`: a trainer's model samples text between evaluations). So
the scores and tokens are the weights' own whatever the CPU, and equal the ``hf`` backend's.

`evaluate` runs tasks on a run and writes the harness's results JSON (by default into
``RUN/eval/``); `run_tasks` runs them on a model in hand (a trainer's) and returns the metrics
as flat columns. The class is registered as the harness's model ``gptkiln``: with the harness
installed, ``python -m gptkiln.evaluate --model gptkiln --model_args run=RUN --tasks ...`` is
the harness's own command line (``lm_eval ...``) with this module imported, and a harness with
plugin discovery finds it through the ``lm_eval.models`` entry point in pyproject.toml.

lm-eval is an optional dependency (the ``eval`` extra): without it this module imports, and
`evaluate` says in one line how to install it.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import yaml

from gptkiln.cpu.loops import target_log_probs
from gptkiln.errors import GptkilnError
from gptkiln.sampling import greedy

try:  # the harness is an optional extra; `harness()` says how to install it where it is missing
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError:
    TemplateLM = object  # type: ignore[assignment,misc]

    def register_model(*names):  # type: ignore[no-redef]
        return lambda cls: cls


INSTALL = "pip install 'lm-eval>=0.4.13,<0.5' (or gptkiln's extra: pip install -e \".[eval]\")"
DEFAULT_BATCH_SIZE = 16
HARNESS_MAX_GEN_TOKS = 256  # the harness's default when a task gives no max_gen_toks


def harness():
    """The ``lm_eval`` module, or one line saying how to install it."""
    try:
        import lm_eval
        import lm_eval.api.model  # noqa: F401
    except ImportError as e:
        raise GptkilnError(
            f"evaluating with lm-evaluation-harness needs the lm-eval package ({e}); {INSTALL}"
        ) from None
    return lm_eval


# -- scoring (context, continuation) pairs ------------------------------------------------------
Pair = tuple[list[int], list[int]]  # (context ids, continuation ids)


def fit_window(context: list[int], continuation: list[int], max_length: int) -> Pair:
    """The pair the model reads: ``context + continuation`` cut to its last ``max_length + 1``
    tokens (the last one is only predicted, never read), from the context's side; the harness's
    ``hf`` backend cuts the same way. A continuation longer than the window is refused."""
    if len(continuation) > max_length:
        raise GptkilnError(
            f"a continuation of {len(continuation)} tokens is longer than the model's context "
            f"of {max_length}; it cannot be scored in one window (use a rolling-window task)"
        )
    cut = max(0, len(context) + len(continuation) - (max_length + 1))
    return context[cut:], continuation


def _by_context(pairs: Sequence[Pair]) -> list[list[int]]:
    """Indices of ``pairs`` grouped by context, in order of first appearance: the pairs that
    share one run it once. A context of one token is not shared: each such pair is a group of
    its own (see `plan_batches`)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (ctx, _) in enumerate(pairs):
        groups.setdefault(tuple(ctx) if len(ctx) > 1 else (-1 - i,), []).append(i)
    return list(groups.values())


def plan_batches(pairs: Sequence[Pair], batch_size: int, max_length: int) -> list[list[int]]:
    """Indices of ``pairs`` in batches: the longest first (as the harness's ``hf`` backend
    sorts), the continuations of one context side by side, at most ``batch_size`` contexts a
    batch, and never more positions than the window holds once the contexts are left-padded to
    the longest (the longest context plus the longest continuation, less one).

    A context of one token is not shared (every document's first rolling window starts from
    end-of-text): sharing it would save one position a continuation, and the continuations
    would run one by one after it through the cache, whose attention takes an explicit mask
    and so does the whole square instead of the causal half."""

    def longest_first(members: list[int]) -> tuple:
        ctx = pairs[members[0]][0]
        return -len(ctx) - max(len(pairs[i][1]) for i in members), tuple(ctx), members[0]

    batches: list[list[int]] = []
    batch: list[int] = []
    contexts, longest_ctx, longest_cont = 0, 0, 0
    for members in sorted(_by_context(pairs), key=longest_first):
        ctx = pairs[members[0]][0]
        cont = max(len(pairs[i][1]) for i in members)
        fits = max(longest_ctx, len(ctx)) + max(longest_cont, cont) - 1 <= max_length
        if batch and (contexts == batch_size or not fits):
            batches.append(batch)
            batch, contexts, longest_ctx, longest_cont = [], 0, 0, 0
        batch.extend(sorted(members, key=lambda i: -len(pairs[i][1])))
        contexts += 1
        longest_ctx, longest_cont = max(longest_ctx, len(ctx)), max(longest_cont, cont)
    if batch:
        batches.append(batch)
    return batches


SCORE_ROWS = 1024
"""Positions whose logits are formed at once while scoring: with GPT-2's 50,257 tokens ~200 MB
in float32, where a batch of 16 whole windows would hold 3.3 GB."""


def _score_positions(
    model, hidden: torch.Tensor, targets: list[int], counts: list[int], greedy_too: bool
) -> list[tuple[float, bool]]:
    """(summed log-probability, whether each token is the argmax) of every continuation:
    ``hidden`` (N, C) the final norm's output at the positions that predict its tokens, in
    order, ``targets`` the N tokens, ``counts`` how many of them each continuation has. The head
    runs on ``SCORE_ROWS`` positions at a time; log-softmax in float32, as the ``hf`` backend
    takes it (by `gptkiln.cpu.loops.target_log_probs`, which writes none of it, where that builds).
    Without ``greedy_too`` the second answer is False (not computed)."""
    target = torch.tensor(targets, device=hidden.device)
    picked = torch.empty(len(targets), device=hidden.device)  # float32
    hits = torch.zeros(len(targets), dtype=torch.bool, device=hidden.device)
    for a in range(0, len(targets), SCORE_ROWS):
        b = min(a + SCORE_ROWS, len(targets))
        logits = model.head(hidden[a:b])  # (n, V)
        native = target_log_probs(logits, target[a:b], with_argmax=greedy_too)
        if native is not None:  # the same figures, without writing the log-softmax
            picked[a:b], top = native
        else:
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            picked[a:b] = logprobs.gather(-1, target[a:b, None]).squeeze(-1)
            top = greedy(logits) if greedy_too else None
        if greedy_too:
            hits[a:b] = top == target[a:b]
    sums, alls = picked.split(counts), hits.split(counts)
    return [(float(x.sum()), greedy_too and bool(h.all())) for x, h in zip(sums, alls)]


def _score_whole(model, pairs: Sequence[Pair], greedy_too: bool) -> list[tuple[float, bool]]:
    """Each pair as one row of ``context + continuation[:-1]``, right-padded: one forward (the
    ``hf`` backend's way; the cheaper one for short contexts), the head only where a
    continuation's token is predicted."""
    device = model.wte.weight.device
    rows = [ctx + cont[:-1] for ctx, cont in pairs]
    width = max(len(r) for r in rows)
    idx = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=device)  # (B, T)
    x = model.hidden(idx)  # (B, T, C); padding comes after each row's tokens, never seen
    row = [b for b, (_, cont) in enumerate(pairs) for _ in cont]
    col = [len(ctx) - 1 + j for ctx, cont in pairs for j in range(len(cont))]
    at = x[torch.tensor(row, device=device), torch.tensor(col, device=device)]  # (N, C)
    targets = [t for _, cont in pairs for t in cont]
    return _score_positions(model, at, targets, [len(c) for _, c in pairs], greedy_too)


def _score_shared(model, pairs: Sequence[Pair], greedy_too: bool) -> list[tuple[float, bool]]:
    """Each distinct context run once into the KV cache (left-padded), its last position
    scoring every continuation's first token; then the continuations' other tokens, one round
    per choice: round j feeds the j-th continuation of every context that has one into that
    context's cache row, after the context (a later round overwrites an earlier one's keys and
    values there, and attends to no more than its own)."""
    from gptkiln.sampling import left_pad

    device = model.wte.weight.device
    members = _by_context(pairs)
    idx, pad_lens = left_pad([pairs[m[0]][0] for m in members], 0, device)  # (U, P)
    P = idx.size(1)
    longest = max(len(cont) for _, cont in pairs)
    model.setup_cache(len(members), P + longest - 1, pad_lens)
    first = model.hidden(idx, start_pos=0)[:, -1]  # (U, C): what predicts each first token
    at: list[torch.Tensor | None] = [None] * len(pairs)  # (len(cont), C) each
    for j in range(max(len(m) for m in members)):
        round_rows = [(u, m[j]) for u, m in enumerate(members) if len(m) > j]
        tails = [pairs[i][1][:-1] for _, i in round_rows]
        x = None
        if max(len(t) for t in tails):
            width = max(len(t) for t in tails)
            tail_idx = torch.tensor([t + [0] * (width - len(t)) for t in tails], device=device)
            rows = torch.tensor([u for u, _ in round_rows], device=device)
            every_row = len(round_rows) == len(members)  # then the cache is read without a copy
            x = model.hidden(tail_idx, start_pos=P, rows=None if every_row else rows)  # (R, T, C)
        for r, (u, i) in enumerate(round_rows):
            n = len(pairs[i][1])
            at[i] = first[u, None] if n == 1 else torch.cat([first[u, None], x[r, : n - 1]])
    targets = [t for _, cont in pairs for t in cont]
    counts = [len(c) for _, c in pairs]
    return _score_positions(model, torch.cat(at), targets, counts, greedy_too)  # type: ignore[arg-type]


def _cheaper_shared(pairs: Sequence[Pair]) -> bool:
    """Whether the shared-context way (`_score_shared`) runs the blocks on fewer positions than
    one forward of whole rows (`_score_whole`); both run the head only where a token is scored.
    Contexts are grouped as `_score_shared` groups them (`_by_context`). Ties go to the whole
    rows, which need no cache."""
    whole = len(pairs) * max(len(a) + len(b) - 1 for a, b in pairs)
    groups = [[len(pairs[i][1]) - 1 for i in m] for m in _by_context(pairs)]  # tail lengths
    shared = len(groups) * max(len(ctx) for ctx, _ in pairs)
    for j in range(max(len(t) for t in groups)):
        tails = [t[j] for t in groups if len(t) > j]
        shared += len(tails) * max(tails)
    return shared < 0.9 * whole


EVEN_ROWS = 0.9
"""A forward of whole rows (`_score_whole`) pads each row to its longest: a row shorter than
this share of that longest one starts a forward of its own (`_even_rows`)."""
RUN_POSITIONS = 1024
"""...once the forward before it holds this many positions: fewer rows than that make the
products less efficient than the padding costs."""


def _even_rows(pairs: Sequence[Pair], batch: list[int]) -> list[list[int]]:
    """A batch of whole rows in runs of about one length, the longest first: a run ends where
    the next row is shorter than ``EVEN_ROWS`` of the run's first, once it holds
    ``RUN_POSITIONS`` positions. A batch sorted by its contexts (`plan_batches`) can still mix
    rows from a full window down to a fifth of one (a rolling task's last windows); padded to
    the longest, a fifth of its positions would be padding, whose products and attention are
    thrown away. Each row's figures do not depend on the rows beside it."""
    length = {i: len(pairs[i][0]) + len(pairs[i][1]) - 1 for i in batch}
    runs: list[list[int]] = []
    for i in sorted(batch, key=lambda i: -length[i]):
        if runs:
            run = runs[-1]
            short = length[i] < EVEN_ROWS * length[run[0]]
            if not (short and length[run[0]] * len(run) >= RUN_POSITIONS):
                run.append(i)
                continue
        runs.append([i])
    return runs


@torch.inference_mode()
def score_pairs(
    model,
    pairs: Sequence[Pair],
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    greedy_too: bool = True,
    on_batch: Callable[[int], None] | None = None,
) -> list[tuple[float, bool]]:
    """(log-probability of the continuation given the context, whether greedy decoding would
    write it) for every pair of token ids; each pair must fit the window (`fit_window`) and
    have a context of at least one token.

    Args:
        model: a `GPT` (its device is the model's own); it is put in eval mode meanwhile.
        pairs: (context ids, continuation ids).
        batch_size: contexts a forward holds (>= 1).
        greedy_too: also find whether each continuation is the greedy one (an argmax over the
            vocabulary at every position); False: skipped, and answered False.
        on_batch: told how many pairs each batch scored (a progress bar).
    """
    ctx_len = model.config.context_length
    for ctx, cont in pairs:
        if not ctx or not cont or len(ctx) + len(cont) - 1 > ctx_len:
            raise ValueError(f"a pair of {len(ctx)} + {len(cont)} tokens does not fit the window")
    scored: list[tuple[float, bool] | None] = [None] * len(pairs)
    was_training = model.training
    model.eval()
    try:
        for batch in plan_batches(pairs, batch_size, ctx_len):
            if _cheaper_shared([pairs[i] for i in batch]):
                score, runs = _score_shared, [batch]
            else:
                score, runs = _score_whole, _even_rows(pairs, batch)
            for run in runs:
                for i, result in zip(run, score(model, [pairs[i] for i in run], greedy_too)):
                    scored[i] = result
            if on_batch is not None:
                on_batch(len(batch))
    finally:
        model.clear_cache()
        model.train(was_training)
    return scored  # type: ignore[return-value]


# -- the harness's model -----------------------------------------------------------------------
# Registered once, by the module gptkiln.evaluate: `python -m gptkiln.evaluate` runs this file a
# second time as __main__, which imports the module itself (see the end) rather than register a
# second class under the same name (the registry refuses that).
_register = register_model("gptkiln") if __name__ != "__main__" else (lambda cls: cls)


@_register
class GptkilnLM(TemplateLM):
    """The lm-evaluation-harness model ``gptkiln``: a run (or an imported Hugging Face GPT-2
    directory, or a quantized run) behind the harness's `LM` interface.

    ``lm_eval --model gptkiln --model_args run=RUN[,quantize=int8][,dtype=bfloat16]`` builds
    it from the harness's command line (see the module docstring for how the harness finds it);
    `from_model` wraps a model already built (a trainer's).

    Args:
        run: the run directory.
        device: where it is loaded (cpu, cuda, cuda:N, mps, auto).
        batch_size: contexts a forward holds, or sequences generated at once; the harness's
            ``auto`` means `DEFAULT_BATCH_SIZE`.
        quantize: "int8" quantizes the weights as they load.
        dtype: float32, bfloat16 or float16 for the weights (default: as stored).
        max_batch_size: accepted for the harness's ``--max_batch_size``; unused.
        progress: progress bars of the requests.
    """

    def __init__(
        self,
        run: str | os.PathLike | None = None,
        device: str | None = None,
        batch_size: int | str | None = None,
        quantize: str | None = None,
        dtype: str | None = None,
        max_batch_size: int | None = None,
        progress: bool = True,
        **unknown: Any,
    ) -> None:
        harness()
        if unknown:
            raise GptkilnError(
                f"--model_args {', '.join(sorted(unknown))}: not an argument of the gptkiln "
                "model; it takes run=RUN and optionally quantize=int8, dtype=bfloat16"
            )
        if run is None:
            raise GptkilnError("the gptkiln model needs its run: --model_args run=RUN")
        from gptkiln.devices import resolve_device
        from gptkiln.loading import check_language_model, load_run

        model, tokenizer, _ = load_run(
            run,
            device=resolve_device(str(device or "cpu")),
            dtype=_dtype(dtype),
            quantize=quantize,
        )
        check_language_model(model, run)
        self._setup(model, tokenizer, _batch_size(batch_size), str(run), quantize, progress)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        """The harness's constructor for ``--model gptkiln --model_args ...``: the process is
        an evaluation's own, so on the CPU freed memory is kept for reuse
        (`gptkiln.allocator.keep_freed_memory`, as ``gptkiln evaluate`` does): every batch's
        logits would otherwise be mapped and zero-filled again, page by page."""
        lm = super().create_from_arg_string(arg_string, additional_config)
        if lm.device.type == "cpu":
            from gptkiln.allocator import keep_freed_memory

            keep_freed_memory()
        return lm

    @classmethod
    def from_model(
        cls,
        model,
        tokenizer,
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        source: str = "the model",
        progress: bool = True,
    ) -> GptkilnLM:
        """The harness's model over a `GPT` already built (used on its own device, as it is:
        pass the module itself, not a compiled or DDP wrapper) and its tokenizer."""
        harness()
        from gptkiln.loading import check_language_model

        check_language_model(model, source)
        lm = cls.__new__(cls)
        lm._setup(model, tokenizer, _batch_size(batch_size), source, None, progress)
        return lm

    def _setup(self, model, tokenizer, batch_size: int, source: str, quantize, progress) -> None:
        TemplateLM.__init__(self)
        self._model, self._tokenizer, self._source = model, tokenizer, source
        self._batch_size, self._quantize, self._progress = batch_size, quantize, progress
        self._device = model.wte.weight.device
        from gptkiln.cpu.loops import use_compiled_loops

        use_compiled_loops(model)  # their sums are torch's up to rounding, as the hf backend's

    # -- what the harness reads ----------------------------------------------------------------
    @property
    def model(self):
        return self._model

    @property
    def eot_token_id(self) -> int:
        if self._tokenizer.eot_id is None:
            raise GptkilnError(
                f"{self._source}: its {self._tokenizer.kind} tokenizer has no end-of-text token, "
                "which the harness puts before a text scored from its start (an empty context, a "
                "rolling-window task); choose tasks whose requests all have a context"
            )
        return self._tokenizer.eot_id

    @property
    def max_length(self) -> int:
        return self._model.config.context_length

    @property
    def max_gen_toks(self) -> int:
        return HARNESS_MAX_GEN_TOKS

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return f"gptkiln-{self._tokenizer.kind}-{self._tokenizer.fingerprint()}"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list:
        """Token ids; a literal ``<|endoftext|>`` is the end-of-text token, as the ``hf``
        backend's tokenizer reads it."""
        from gptkiln.loading import check_ids_fit

        ids = self._tokenizer.encode(string)
        if ids:
            check_ids_fit(max(ids), self._model, self._tokenizer, self._source)
        return ids

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids))

    def get_model_info(self) -> dict[str, Any]:
        return {
            "model_source": self._source,
            "model_num_parameters": self._model.num_parameters(),
            "model_dtype": str(self._model.ln_f.weight.dtype),
            "quantize": self._quantize,
            "tokenizer": self._tokenizer.kind,
        }

    # -- the three kinds of request ------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """The harness's tokenized pairs: ((context, continuation) strings or None, context ids,
        continuation ids) -> (log-probability, is greedy)."""
        pairs = [fit_window(ctx, cont, self.max_length) for _, ctx, cont in requests]
        answers = self._score(pairs, "loglikelihood requests", disable_tqdm, greedy_too=True)
        for (strings, _, _), answer in zip(requests, answers):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood over disjoint windows of the context length, the first
        conditioned on the end-of-text token; all windows of all documents batched together."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        pairs: list[Pair] = []
        owner: list[int] = []
        for n, (text,) in enumerate(req.args for req in requests):
            windows = get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for window in map(make_disjoint_window, windows):
                pairs.append(window)
                owner.append(n)
        totals = [0.0] * len(requests)
        scores = self._score(pairs, "rolling windows", disable_tqdm, greedy_too=False)
        for n, (logprob, _) in zip(owner, scores):  # is_greedy: not part of the answer
            totals[n] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continuations generated with the KV cache, batched by length among the requests
        that share ``generation_kwargs``; each ends at a stop string (left out), at end-of-text
        or after ``max_gen_toks`` tokens."""
        from tqdm.auto import tqdm

        from gptkiln.cpu import exact_kernels, prepare_for_decoding
        from gptkiln.sampling import generate_batched

        groups: dict[str, list[int]] = {}
        for n, req in enumerate(requests):
            key = json.dumps(req.args[1], sort_keys=True, default=str)
            groups.setdefault(key, []).append(n)
        texts: list[str] = [""] * len(requests)
        bar = tqdm(
            total=len(requests),
            desc="Running generate_until requests",
            disable=disable_tqdm or not self._progress,
        )
        for members in groups.values():
            cfg = sample_config(requests[members[0]].args[1], self._tokenizer, self.max_gen_toks)
            room = self.max_length - cfg.max_new_tokens
            prompts = {n: self._prompt(requests[n].args[0], room) for n in members}
            order = sorted(members, key=lambda n: -len(prompts[n]))  # the longest first
            with exact_kernels():  # the weights' own sums: no decoding shortcut changes a token
                streams = generate_batched(
                    self._model,
                    [prompts[n] for n in order],
                    cfg,
                    self._tokenizer,
                    batch_size=self.batch_size,
                    prepare=prepare_for_decoding,
                )
            for n, stream in zip(order, streams):
                texts[n] = stream.text
                self.cache_hook.add_partial("generate_until", requests[n].args, stream.text)
            bar.update(len(members))
        bar.close()
        return texts

    # -- helpers -------------------------------------------------------------------------------
    def _score(self, pairs: Sequence[Pair], what: str, disable_tqdm: bool, greedy_too: bool):
        from tqdm.auto import tqdm

        from gptkiln.cpu.tuner import keep_exact

        keep_exact(self._model)  # scoring tunes nothing: what an earlier tuning gave goes
        with tqdm(
            total=len(pairs), desc=f"Running {what}", disable=disable_tqdm or not self._progress
        ) as bar:
            return score_pairs(
                self._model,
                pairs,
                batch_size=self.batch_size,
                greedy_too=greedy_too,
                on_batch=bar.update,
            )

    def _prompt(self, context: str, room: int) -> list[int]:
        """A generation's context ids: cut from the left to leave ``max_gen_toks`` of room in
        the window, as the ``hf`` backend cuts it (where that leaves none, which the ``hf``
        backend refuses, the window slides as `gptkiln generate`'s does)."""
        ids = self.tok_encode(context) if context else [self.eot_token_id]
        return ids[-room:] if room > 0 else ids


def sample_config(gen_kwargs: dict, tokenizer, max_gen_toks: int):
    """A `SampleConfig` from a task's ``generation_kwargs`` (normalized as the harness's
    backends normalize them: ``until``, ``max_gen_toks`` or its aliases, ``do_sample``,
    ``temperature``, ``top_k``, ``top_p``), its stop strings with the end-of-text text
    among them as the ``hf`` backend adds it (``tokenizer``'s); ``max_gen_toks`` where the task
    gives no length."""
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

    from gptkiln.config import SampleConfig

    kwargs = dict(normalize_gen_kwargs(dict(gen_kwargs), max_gen_toks))
    eot = tokenizer.eot_id
    until = handle_stop_sequences(
        kwargs.pop("until"), None if eot is None else tokenizer.decode([eot])
    )
    max_new = kwargs.pop("max_gen_toks")
    do_sample = kwargs.pop("do_sample", False)
    temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
    top_k, top_p = kwargs.pop("top_k", None) or None, kwargs.pop("top_p", None)  # HF: 0 = off
    if kwargs.pop("num_beams", 1) != 1:
        raise GptkilnError("generation_kwargs num_beams: gptkiln has no beam search; use 1")
    if kwargs:
        raise GptkilnError(
            f"generation_kwargs {', '.join(sorted(kwargs))}: not a setting gptkiln's "
            "generation has (it takes until, max_gen_toks, do_sample, temperature, top_k, "
            "top_p); remove it from the task or --gen_kwargs"
        )
    return SampleConfig(
        max_new_tokens=int(max_new),
        temperature=temperature if do_sample else 0.0,
        top_k=None if top_k is None else int(top_k),
        top_p=None if top_p is None else float(top_p),
        stop=tuple(s for s in until if s),
    )


def _batch_size(value: int | str | None) -> int:
    if value is None or str(value).startswith("auto"):
        return DEFAULT_BATCH_SIZE
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise GptkilnError(f"batch size {value!r}: give a whole number >= 1 (or auto)")
    return size


def _dtype(name: str | None) -> torch.dtype | None:
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name is None or name == "auto":
        return None
    if name not in dtypes:
        raise GptkilnError(f"dtype {name!r}: choose one of {', '.join(dtypes)} (or leave it out)")
    return dtypes[name]


# -- running tasks ------------------------------------------------------------------------------
class _TaskYamlLoader(yaml.SafeLoader):
    """YAML as the harness writes tasks: its ``!function module.name`` tags parse (to None)."""


_TaskYamlLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def task_names(tasks: str | Sequence[str]) -> list[str]:
    """Task names from ``"a,b"`` or a list of them (each may itself hold commas)."""
    items = [tasks] if isinstance(tasks, str) else list(tasks)
    names = [n.strip() for item in items for n in str(item).split(",") if n.strip()]
    if not names:
        raise GptkilnError("no tasks given; name at least one, e.g. --tasks hellaswag,arc_easy")
    return names


def check_task_files(include_path: str | os.PathLike | None, names: Sequence[str]) -> None:
    """One line for a task file that does not parse: every YAML file under ``include_path``
    and every task given as a YAML file (the harness would skip such a file and then call its
    task unknown)."""
    files = [Path(n) for n in names if n.endswith((".yaml", ".yml")) and Path(n).is_file()]
    if include_path is not None:
        folder = Path(include_path)
        if not folder.is_dir():
            raise GptkilnError(
                f"--include-path {folder}: not a folder; give the folder of your task YAML files"
            )
        files += sorted(p for p in folder.rglob("*") if p.suffix in (".yaml", ".yml"))
    for path in files:
        try:
            yaml.load(path.read_text(encoding="utf-8"), Loader=_TaskYamlLoader)  # noqa: S506
        except (yaml.YAMLError, UnicodeDecodeError, OSError) as e:
            reason = " ".join(str(e).split())
            raise GptkilnError(
                f"{path}: the task file does not parse ({reason}); fix its YAML or move it out "
                "of the include path"
            ) from None


@functools.lru_cache(maxsize=4)
def task_manager(include_path: str | None, defaults: bool):
    """The harness's index of tasks: its own (~15,000, some seconds to read) when ``defaults``,
    and those under ``include_path``. Kept, so that a trainer evaluating every N steps reads
    the index once."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=defaults)


def _matches(manager, name: str) -> list[str]:
    if name in manager.task_index:
        return [name]
    if any(c in name for c in "*?["):
        return manager.match_tasks([name])
    return []


def load_tasks(tasks: str | Sequence[str], include_path: str | os.PathLike | None = None):
    """(the harness's task index, the tasks and groups to run) for task names, glob patterns
    (``mmlu_*``) or YAML files; tasks of one's own under ``include_path`` load without reading
    the harness's index when every name is found there. An unknown task, a file that does not
    parse or a task that cannot be built (its dataset, its config) is one line."""
    harness()
    names = task_names(tasks)
    check_task_files(include_path, names)
    path = None if include_path is None else str(Path(include_path).resolve())
    manager = task_manager(path, False) if path else None
    if manager is None or not all(_matches(manager, n) or _is_file(n) for n in names):
        manager = task_manager(path, True)
    specs: list[str] = []
    for name in names:
        found = _matches(manager, name)
        if not found and not _is_file(name):
            close = difflib.get_close_matches(name, manager.all_tasks, n=3)
            where = f" or under {include_path}" if include_path else ""
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise GptkilnError(
                f"unknown task {name!r}: not among the harness's {len(manager.all_tasks):,} "
                f"tasks{where}; {hint}list them with `lm_eval ls tasks`, or give "
                "--include-path DIR for task YAMLs of your own"
            )
        specs.extend(found or [name])
    return manager, [obj for spec in specs for obj in _build(manager, spec)]


def _is_file(name: str) -> bool:
    return name.endswith((".yaml", ".yml")) and Path(name).is_file()


def _build(manager, spec: str) -> list:
    """The top-level tasks and groups that one name builds (a tag: its tasks)."""
    try:
        loaded = manager.load([spec])
    except Exception as e:  # the harness raises what its config, dataset or code raised
        reason = " ".join(str(e).split()) or type(e).__name__
        raise GptkilnError(f"task {spec!r} could not be built: {reason}") from None
    children = {c for kids in loaded["group_map"].values() for c in kids}
    groups = [g for name, g in loaded["groups"].items() if name not in children]
    return groups + [t for name, t in loaded["tasks"].items() if name not in children]


def run_harness(
    lm,
    manager,
    tasks: list,
    *,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    log_samples: bool = False,
    seed: int | None = None,
    bootstrap_iters: int = 100_000,
) -> dict[str, Any]:
    """The harness's ``simple_evaluate`` on built tasks; its results dict (with ``samples``
    when ``log_samples``). ``seed`` sets the harness's four seeds (Python, NumPy, torch,
    few-shot sampling); None keeps its defaults (0, 1234, 1234, 1234)."""
    import lm_eval

    check_settings(num_fewshot, limit)
    seeds = {} if seed is None else dict.fromkeys(
        ("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed"), seed
    )  # fmt: skip
    return lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        task_manager=manager,
        num_fewshot=num_fewshot,
        limit=limit,
        log_samples=log_samples,
        bootstrap_iters=bootstrap_iters,
        **seeds,
    )


def check_settings(num_fewshot: int | None, limit: int | float | None) -> None:
    """One line for a number of few-shot examples or a limit the harness cannot take."""
    if num_fewshot is not None and num_fewshot < 0:
        raise GptkilnError(f"num_fewshot must be >= 0, got {num_fewshot}")
    if limit is not None and not limit > 0:
        raise GptkilnError(f"limit must be > 0 (a count, or a fraction below 1), got {limit}")


def flat_metrics(results: dict[str, Any]) -> dict[str, float]:
    """Every task's (and group's) numeric metrics as ``TASK/METRIC`` (``TASK/METRIC/FILTER``
    for a filter other than ``none``): metrics.csv and TensorBoard columns. Standard errors are
    left out."""
    flat: dict[str, float] = {}
    for section in ("results", "groups"):
        for task, values in (results.get(section) or {}).items():
            for key, value in values.items():
                metric, _, filt = key.partition(",")
                if not filt or metric.endswith("_stderr"):
                    continue
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                flat[f"{task}/{metric}" + ("" if filt == "none" else f"/{filt}")] = float(value)
    return flat


def results_table(results: dict[str, Any]) -> str:
    """The harness's tables of a results dict, as its command line prints them."""
    from lm_eval.utils import make_table

    table = make_table(results)
    if results.get("groups"):
        table += "\n" + make_table(results, "groups")
    return table


@dataclass
class HarnessResults:
    """What `evaluate` did.

    Attributes:
        results: the harness's results dict (``results``, ``groups``, ``configs``, ``versions``,
            ``n-shot``, ``higher_is_better``, ``n-samples``, ``config``, ...), as written.
        table: the harness's results table, with a first line naming the run and settings.
        path: the results JSON written (None: not written).
        sample_paths: one JSON Lines file of per-sample records a task, with ``log_samples``.
    """

    results: dict[str, Any]
    table: str
    path: Path | None
    sample_paths: list[Path]

    def metrics(self) -> dict[str, float]:
        """The metrics as flat columns (`flat_metrics`)."""
        return flat_metrics(self.results)


def evaluate(
    run_dir: str | os.PathLike,
    tasks: str | Sequence[str],
    *,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    include_path: str | os.PathLike | None = None,
    output_path: str | os.PathLike | None = None,
    log_samples: bool = False,
    seed: int | None = None,
    device: str = "cpu",
    quantize: str | None = None,
    dtype: str | None = None,
    bootstrap_iters: int = 100_000,
    progress: bool = True,
) -> HarnessResults:
    """Run lm-evaluation-harness tasks on a run, as ``lm_eval --model gptkiln`` would, and
    write the harness's results JSON.

    Args:
        run_dir: a run directory, an imported Hugging Face GPT-2 directory, or a quantized run.
        tasks: task names (``"hellaswag,arc_easy"`` or a list), glob patterns or YAML files.
        num_fewshot: examples put before each question (None: each task's own, else 0).
        limit: documents per task at most (a fraction of them when below 1); for a quick look.
        batch_size: contexts a forward holds, sequences generated at once (>= 1).
        include_path: a folder of task YAMLs of one's own.
        output_path: a folder for ``results_DATE.json`` (and ``samples_TASK_DATE.jsonl``), or a
            ``.json`` file; default ``RUN/eval/``.
        log_samples: also write every request's prompt, answers and scores.
        seed: the harness's seeds (Python, NumPy, torch, few-shot order), all set to this; None
            keeps the harness's defaults.
        device: cpu | cuda | cuda:N | mps | auto.
        quantize: "int8" quantizes the weights as they load.
        dtype: float32, bfloat16 or float16 for the weights (None: as stored), as the ``hf``
            backend's ``dtype``.
        bootstrap_iters: resamples for the standard errors of metrics that need them (0: none).
        progress: progress bars.

    Returns:
        The results, the table as printed and the files written.
    """
    harness()
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise GptkilnError(f"batch_size must be a whole number >= 1, got {batch_size!r}")
    check_settings(num_fewshot, limit)
    # the model first: a missing run or a classifier is refused before the harness reads its
    # task index (seconds) and logs what it makes of the tasks
    lm = GptkilnLM(
        run_dir,
        device=device,
        batch_size=batch_size,
        quantize=quantize,
        dtype=dtype,
        progress=progress,
    )
    manager, built = load_tasks(tasks, include_path)
    folder, path = _output_paths(run_dir, output_path)
    results = run_harness(
        lm,
        manager,
        built,
        num_fewshot=num_fewshot,
        limit=limit,
        log_samples=log_samples,
        seed=seed,
        bootstrap_iters=bootstrap_iters,
    )
    model_args = {"run": str(run_dir)} | ({"quantize": quantize} if quantize else {})
    model_args |= {"dtype": dtype} if dtype else {}
    results["config"].update(model="gptkiln", model_args=model_args, device=device)
    samples = results.pop("samples", None)
    sample_paths = _write(results, samples, folder, path)
    args = ",".join(f"{k}={v}" for k, v in model_args.items())
    header = (
        f"gptkiln ({args}), limit: {limit}, num_fewshot: {num_fewshot}, batch_size: {batch_size}"
    )
    return HarnessResults(results, header + "\n" + results_table(results), path, sample_paths)


def evaluate_model(
    model,
    tokenizer,
    tasks: str | Sequence[str],
    *,
    include_path: str | os.PathLike | None = None,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    seed: int | None = None,
    bootstrap_iters: int = 0,
    output_path: str | os.PathLike | None = None,
    source: str = "the model",
) -> HarnessResults:
    """Harness tasks on a model in hand (a trainer's, at an evaluation step); the results
    JSON written to ``output_path`` (a folder or a ``.json`` file) when given.

    The model is used on its own device and put back in the mode it was in; pass the `GPT`
    itself, not a compiled or DDP wrapper, and call this on one rank. The harness's task index
    is read once per process; the tasks are built anew each call. Standard errors are computed
    only with ``bootstrap_iters`` > 0. ``source`` names the model in the table's first line and
    in the JSON's ``model_args``.

    Returns:
        The results and their table; ``path`` is None when nothing was written.
    """
    manager, built = load_tasks(tasks, include_path)
    lm = GptkilnLM.from_model(
        model, tokenizer, batch_size=batch_size, source=source, progress=False
    )
    folder, path = (None, None) if output_path is None else _output_paths(None, output_path)
    results = run_harness(
        lm,
        manager,
        built,
        num_fewshot=num_fewshot,
        limit=limit,
        seed=seed,
        bootstrap_iters=bootstrap_iters,
    )
    results["config"].update(model="gptkiln", model_args={"source": source})
    results.pop("samples", None)
    if path is not None:
        _write(results, None, folder, path)
    header = f"gptkiln ({source}), limit: {limit}, num_fewshot: {num_fewshot}"
    return HarnessResults(results, header + "\n" + results_table(results), path, [])


def run_tasks(
    model,
    tokenizer,
    tasks: str | Sequence[str],
    *,
    include_path: str | os.PathLike | None = None,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    seed: int | None = None,
    bootstrap_iters: int = 0,
) -> dict[str, float]:
    """`evaluate_model`'s metrics as flat columns, ``TASK/METRIC`` (`flat_metrics`), for
    metrics.csv and TensorBoard; nothing is written."""
    return evaluate_model(
        model,
        tokenizer,
        tasks,
        include_path=include_path,
        num_fewshot=num_fewshot,
        limit=limit,
        batch_size=batch_size,
        seed=seed,
        bootstrap_iters=bootstrap_iters,
    ).metrics()


def _output_paths(run_dir, output_path) -> tuple[Path, Path]:
    """(the folder written into, the results JSON), the folder made now: a path that cannot be
    written is found before the evaluation, not after it."""
    date = datetime.now().isoformat(timespec="seconds").replace(":", "-")
    out = Path(run_dir) / "eval" if output_path is None else Path(output_path)
    folder, path = (
        (out.parent, out) if out.suffix == ".json" else (out, out / f"results_{date}.json")
    )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GptkilnError(
            f"--output-path {out}: cannot make the folder {folder} ({e.strerror}); give "
            "another folder or .json file"
        ) from None
    if path.is_dir():
        raise GptkilnError(f"--output-path {path}: a folder; give a .json file name or a folder")
    return folder, path


def _write(results: dict, samples: dict | None, folder: Path, path: Path) -> list[Path]:
    """The results JSON, and each task's samples as JSON Lines beside it (named after it)."""
    from lm_eval.utils import handle_non_serializable

    def dump(obj, **kw) -> str:
        return json.dumps(obj, default=handle_non_serializable, ensure_ascii=False, **kw)

    path.write_text(dump(results, indent=2) + "\n", encoding="utf-8")
    written = []
    stem = path.stem.removeprefix("results")  # results_DATE.json: samples_TASK_DATE.jsonl
    stem = stem if not stem or stem.startswith("_") else f"_{stem}"  # out.json: ..._out.jsonl
    for task, rows in (samples or {}).items():
        sample_path = folder / f"samples_{task}{stem}.jsonl"
        sample_path.write_text("".join(dump(r) + "\n" for r in rows), encoding="utf-8")
        written.append(sample_path)
    return written


def main() -> None:
    """``python -m gptkiln.evaluate ...``: the harness's own command line (``lm_eval ...``,
    every flag of it) with the ``gptkiln`` model registered, for a harness without plugin
    discovery."""
    try:
        harness()
    except GptkilnError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    from gptkiln.evaluate import main as _main  # the module proper, where the model is registered

    _main()
