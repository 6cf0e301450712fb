"""Scoring (context, continuation) pairs of token ids with the model, as the harness's
``loglikelihood`` asks: batches sorted by length, a context shared by several continuations run
once into the KV cache, the head only where a token is scored (`score_pairs`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from gptkiln.errors import GptkilnError
from gptkiln.native import target_log_probs
from gptkiln.sampling import greedy

DEFAULT_BATCH_SIZE = 16

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
    takes it (by `gptkiln.native.target_log_probs`, which writes none of it, where that builds).
    Without ``greedy_too`` the second answer is False (not computed)."""
    target = torch.tensor(targets, device=hidden.device)
    picked = torch.empty(len(targets), device=hidden.device)  # float32
    hits = torch.zeros(len(targets), dtype=torch.bool, device=hidden.device)
    for a in range(0, len(targets), SCORE_ROWS):
        b = min(a + SCORE_ROWS, len(targets))
        logits = model.logits(hidden[a:b])  # (n, V)
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
