"""Text generation as small pure functions: filter logits, sample, prefill, decode one token.

``generate_stream`` yields each new token as it is chosen; ``generate`` collects them. With the
KV cache (the default) the prompt is run once (prefill) and every later step feeds one token;
without it every step re-runs the whole window, as the book's ``generate_text_simple`` does.
Both give the same tokens. Each sequence's text comes through a `text_stream.TextStream`.

Nothing here knows a backend: the caller that owns a decoding (`gptkiln.api`, the evaluation
harness) passes ``prepare``, e.g. `gptkiln.cpu.prepare_for_decoding`, which this calls once
the cache is set and the first token is out, as ``prepare(model, rows, steps)``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from numbers import Integral
from typing import Any

import numpy as np
import torch

from gptkiln.config import SampleConfig, check_sampling
from gptkiln.errors import GptkilnError
from gptkiln.logits_processors import apply_logit_bias, apply_penalties, prompt_tokens
from gptkiln.model import GPT
from gptkiln.text_stream import TextStream, end_ids, hidden_ids, stop_ids_of


def logits_to_probs(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> torch.Tensor:
    """Next-token probabilities (B, V) from logits (B, V) after temperature, top-k, top-p and
    min-p, in that order (transformers' order).

    temperature must be > 0 here (0 means greedy and never reaches this function).
    """
    logits = logits.float()
    # Shifted so the largest is 0: a tiny temperature then gives -inf, never inf (inf - inf would
    # be NaN after softmax); softmax does not change under the shift.
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    top_ids = None  # top-k's ids, largest first
    if top_k is not None and top_k < logits.size(-1):
        kth, top_ids = torch.topk(logits, top_k, dim=-1)
        logits = logits.masked_fill(logits < kth[..., -1:], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1.0:
        probs = _top_p(probs, top_p, top_k, top_ids)
    return _min_p(probs, min_p)


def _min_p(probs: torch.Tensor, min_p: float | None) -> torch.Tensor:
    """Min-p of probabilities (B, V): each row's tokens less likely than ``min_p`` times its
    likeliest dropped, the rest renormalised (the likeliest always stays; a row of NaNs stays
    NaN). Unchanged where ``min_p`` is None or 0."""
    if not min_p:
        return probs
    kept = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


NUCLEUS_CANDIDATES = (256, 4096)
"""How many of a row's most likely tokens top-p ranks on the CPU before it sorts the row whole:
the first where enough (`_top_p`)."""


def _top_p(
    probs: torch.Tensor, top_p: float, top_k: int | None, top_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Top-p of probabilities (B, V): each row's most likely tokens kept until their sum
    reaches top_p, and every token as likely as the last of them (so what is kept never
    depends on how equal probabilities are ranked, as top-k keeps every token tied with its
    k-th), renormalised.

    Ranking a whole row is a sort: GPT-2's 50,257 ids take 0.6-3.9 ms on a 2-core EPYC. On the
    CPU (eager) a row's ``m`` most likely are found first instead (``torch.topk``: 0.14 ms for
    256, 0.7 for 4,096), ``m`` each of `NUCLEUS_CANDIDATES` in turn (top-k's k where fewer).
    They suffice where their running sum reaches top_p and the last of them is less likely
    than the last token top_p needs (`_edge`: no token past them can tie it): every token past
    them is dropped. A row that the next ``m`` cannot suffice for (the sum still missing, over
    the least likely candidate's probability, is more ids than it adds) is sorted whole at
    once, as is one that none can suffice for (`_never_within`: a nearly flat row, an untrained
    model's) and one that none suffices for. Each row takes its own way, so its result is the
    same in any batch. ``top_ids`` (B, k): top-k's ids, largest first, its k candidates ranked
    already."""
    vocab = probs.size(-1)
    sizes = sorted({min(m, top_k or vocab) for m in NUCLEUS_CANDIDATES if m < vocab})
    if not sizes or probs.device.type != "cpu" or torch.compiler.is_compiling():
        return _sorted_nucleus(probs, top_p)
    kept = None  # (B, V), made once some rows go one way and some another
    rows = torch.arange(probs.size(0))  # the rows still to rank
    part, part_ids, to_sort = probs, top_ids, []
    # top-k's k, where the last size, reach top_p but for a tie past them: nothing to bound
    if sizes[-1] != top_k:
        hopeless = _never_within(probs, sizes[-1], top_p)
        if bool(hopeless.all()):
            return _sorted_nucleus(probs, top_p)
        if bool(hopeless.any()):
            kept = torch.empty_like(probs)
            to_sort.append(rows[hopeless])
            rows, part = rows[~hopeless], probs[~hopeless]
            part_ids = None if top_ids is None else top_ids[~hopeless]
    for i, m in enumerate(sizes):
        if m == top_k and part_ids is not None:
            ranked, ids = part.gather(-1, part_ids), part_ids
        else:
            ranked, ids = torch.topk(part, m, dim=-1)  # largest first
        running = ranked.cumsum(dim=-1)
        # enough: they reach top_p (top-k's k do unless it kept a tie past them), and no id
        # past them can tie the last one kept
        enough = (running[:, -1] >= top_p) & (ranked[:, -1] < _edge(ranked, top_p, running)[:, 0])
        sorted_now = ~enough
        if i + 1 < len(sizes):
            missing = (top_p - running[:, -1]) / ranked[:, -1]  # ids still needed, at least
            sorted_now &= missing > sizes[i + 1] - m
        if kept is None and bool(enough.all()):
            return _nucleus(part, ranked, ids, top_p, running)
        if kept is None and bool(sorted_now.all()):
            return _sorted_nucleus(probs, top_p)
        kept = torch.empty_like(probs) if kept is None else kept
        if bool(enough.any()):
            picked = (part[enough], ranked[enough], ids[enough], top_p, running[enough])
            kept[rows[enough]] = _nucleus(*picked)
        to_sort.append(rows[sorted_now])
        later = ~(enough | sorted_now)
        rows, part = rows[later], part[later]
        part_ids = None if part_ids is None else part_ids[later]
        if len(rows) == 0:
            break
    rest = torch.cat(to_sort)
    if len(rest):
        kept[rest] = _sorted_nucleus(probs[rest], top_p)
    return kept


def _sorted_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`_nucleus` over each row of probabilities (B, V) sorted whole."""
    return _nucleus(probs, *torch.sort(probs, dim=-1, descending=True), top_p)


def _never_within(probs: torch.Tensor, m: int, top_p: float) -> torch.Tensor:
    """Whether each row's ``m`` most likely of probabilities (B, V) surely sum below top_p, (B,):
    where ``m`` times its largest probability does, or where the probabilities of at least
    ``t = top_p / 2m`` do not reach ``top_p / 2`` (the ``m`` hold no more than those, plus ``t``
    each for the rest). Three passes over the row, no ranking."""
    t = top_p / (2 * m)
    above = torch.where(probs >= t, probs, 0.0).sum(dim=-1)
    return (probs.amax(dim=-1) * m < top_p) | (above < top_p / 2)


def _nucleus(
    probs: torch.Tensor,
    ranked: torch.Tensor,
    ids: torch.Tensor,
    top_p: float,
    running: torch.Tensor | None = None,
) -> torch.Tensor:
    """Top-p over each row's ranked tokens (B, m), most likely first, and their ids (with their
    running sum, where known): a token dropped where the tokens ranked above it already reach
    top_p (the first always stays), the rest renormalised and put in place of ``probs`` (B, V).

    The kept tokens' total is the running sum at the last one kept: one row's own sum, where
    a sum over a batch's rows (B, V) may round a row otherwise than alone."""
    return torch.zeros_like(probs).scatter_(-1, ids, _kept(ranked, top_p, running))


def _kept(ranked: torch.Tensor, top_p: float, running: torch.Tensor | None = None) -> torch.Tensor:
    """Top-p over each row's ranked probabilities (B, m), most likely first (with their running
    sum, where known): (B, m), the dropped 0 and the kept renormalised (`_nucleus`). A token is
    kept where the tokens ranked above it do not reach top_p yet, or where it is as likely as
    the last such one (`_edge`)."""
    running = ranked.cumsum(dim=-1) if running is None else running
    drop = (running - ranked >= top_p) & (ranked < _edge(ranked, top_p, running))
    total = running.gather(-1, (~drop).sum(dim=-1, keepdim=True) - 1)  # (B, 1)
    return ranked.masked_fill(drop, 0.0) / total


def _edge(ranked: torch.Tensor, top_p: float, running: torch.Tensor) -> torch.Tensor:
    """The probability of the last token top-p needs, (B, 1), from ranked probabilities (B, m),
    most likely first, and their running sum: the first whose sum reaches top_p (the last of
    the m where none does)."""
    needed = (running - ranked < top_p).sum(dim=-1, keepdim=True)  # (B, 1), at least 1
    return ranked.gather(-1, needed.clamp(1, ranked.size(-1)) - 1)  # (NaN rows: the first)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest logit, (...,) from (..., V): ``logits.argmax(-1)``, the
    first of equal largest ones as there, NaN counted largest as there. fp32 on the CPU goes
    through NumPy's argmax, which torch's is far behind at this width (2-core Xeon, torch 2.13,
    V = 50,257: 5 against 96 us for one row, 122 against 816 for 16, 23 against 56 ms for
    1,023)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def sample(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    min_p: float | None = None,
) -> torch.Tensor:
    """Pick one token per row from logits (B, V): argmax when temperature is 0, else a draw
    from `logits_to_probs` (`draw`; with a top-k on the CPU, from each row's candidates alone:
    `_draw_from_candidates`). Returns (B,)."""
    if temperature == 0:
        return greedy(logits)
    if _from_candidates(logits, top_k):
        u = torch.rand(
            (logits.size(0), 1), generator=generator, device=logits.device, dtype=torch.float32
        )
        return _draw_from_candidates(logits, temperature, top_k, top_p, u, min_p)
    return draw(logits_to_probs(logits, temperature, top_k, top_p, min_p), generator)


def _from_candidates(logits: torch.Tensor, top_k: int | None) -> bool:
    """Whether a top-k draw from logits (B, V) reads only its k candidates
    (`_draw_from_candidates`): on the CPU, eager. On a GPU the check for a tie at a row's k-th
    would wait for the device, where the whole row's work does not."""
    cpu = logits.device.type == "cpu" and not torch.compiler.is_compiling()
    return cpu and top_k is not None and top_k < logits.size(-1)


def _draw_from_candidates(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float | None,
    uniforms: torch.Tensor,
    min_p: float | None = None,
) -> torch.Tensor:
    """`draw` from `logits_to_probs` with a top-k, from each row's most likely ids alone: the
    other ids have no probability there, so the probabilities, the top-p and the running sum
    are of a few values, not V (16 rows of GPT-2's 50,257 ids, top-k 40: 1.7 ms against 3.7
    on a 2-core EPYC). A row's candidates are its k most likely ids and a margin (an eighth of
    k, at least 8), twice as many while the last of them still ties its k-th (top-k keeps
    every id tied with its k-th), up to the whole row; those below its k-th get no
    probability. They are summed in the order of their ids, as `draw` sums a whole row, so a
    uniform picks the same id in both, up to the rounding of the softmax's sum. A row with a
    value that is not a number (or an infinite largest) gets id 0, as there. Each row takes
    its own way, so its id is the same in any batch. ``uniforms`` (B, 1): `draw`'s."""
    vocab = logits.size(-1)
    tokens = torch.zeros(logits.size(0), dtype=torch.long, device=logits.device)
    rows = torch.arange(logits.size(0), device=logits.device)  # the rows still to draw
    # a margin past the k-th: where top-k's ties run on (bf16 values), one topk mostly suffices
    width, part = top_k + 1 + max(8, top_k // 8), logits
    while len(rows):
        width = min(width, vocab)
        values, ids = torch.topk(part, width, dim=-1)  # (R, width), largest first
        values = values.float()
        scaled = (values - values[:, :1]) / temperature  # as logits_to_probs scales them
        kth = scaled[:, top_k - 1 : top_k]  # (R, 1)
        nan = scaled.isnan().any(dim=-1)  # where logits_to_probs' every probability is NaN
        # every id top-k keeps is a candidate: the last is below the k-th, or the k-th is -inf
        # (fewer possible ids than k: a grammar's mask), or the row is whole
        past = (scaled[:, -1:] < kth) | (kth == float("-inf"))
        done = ~nan & (past.squeeze(-1) | (width == vocab))
        if bool(done.any()):
            kept = scaled[done].masked_fill(scaled[done] < kth[done], float("-inf"))
            probs = torch.softmax(kept, dim=-1)
            if top_p is not None and top_p < 1.0:
                probs = _kept(probs, top_p)
            probs = _min_p(probs, min_p)
            order = ids[done].argsort(dim=-1)  # by id, as draw sums a row
            ids_done, probs = ids[done].gather(-1, order), probs.gather(-1, order)
            picked = draw(probs, uniforms=uniforms[rows[done]])
            tokens[rows[done]] = ids_done.gather(-1, picked[:, None]).squeeze(-1)
        later = ~(done | nan)
        rows, part, width = rows[later], part[later], 2 * width
    return tokens


def draw(
    probs: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    uniforms: torch.Tensor | None = None,
) -> torch.Tensor:
    """One id a row from probabilities (B, V), id i with probability p_i: the first id whose
    running sum passes a uniform draw times the row's total (one uniform a row, from
    ``generator`` or torch's global one, or the rows' ``uniforms`` (B, 1) float32 where given:
    `row_uniforms`). An id of probability 0 adds nothing to the sum, so
    it is never the first to pass. A row with no probability (NaNs: a diverged model's) gives
    id 0, as `greedy`'s argmax does. ``torch.multinomial`` draws an exponential for every id
    instead: 1.1 ms against 0.06 for a row of GPT-2's 50,257 ids (2-core EPYC).

    The CPU's running sum adds one id after another, so an id of probability 0 repeats the sum
    before it exactly. A GPU's scan adds in parallel, and a single row's may differ by an ulp
    across a run of zeros, or fall: there it is made `flat_over_zeros` (0.15 ms more on the
    CPU, which needs none of it)."""
    cdf = probs.cumsum(dim=-1)
    if probs.device.type != "cpu":
        cdf = flat_over_zeros(probs, cdf)
    total = cdf[:, -1:]
    u = uniforms
    if u is None:
        u = torch.rand(total.shape, generator=generator, device=probs.device, dtype=cdf.dtype)
    below = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    picked = torch.searchsorted(cdf, below, right=True).squeeze(-1)
    return torch.where(total[:, 0] > 0, picked.clamp_(max=probs.size(-1) - 1), 0)


def flat_over_zeros(probs: torch.Tensor, cdf: torch.Tensor) -> torch.Tensor:
    """A running sum ``cdf`` of ``probs`` (B, V) as `draw` needs it: each id of probability 0
    holding the sum before it exactly, and no value below one before it (the sum of the kept
    ids carried over the zeros, then the running maximum)."""
    return torch.where(probs > 0, cdf, 0).cummax(dim=-1).values


def sample_rows(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generators: Sequence[torch.Generator | None] | None,
    min_p: float | None = None,
) -> torch.Tensor:
    """`sample` for a batch (B, V) -> (B,) where each row may draw from its own generator (a
    row's None: torch's global one), so a seeded row's tokens never depend on the rows beside
    it: the batch's probabilities are computed together (with a top-k on the CPU, each row's
    candidates': `_draw_from_candidates`), each row's uniform comes from its own generator
    (`row_uniforms`), and one `draw` picks every row's id. (None: one draw for the batch.)"""
    if generators is None or temperature == 0:
        return sample(logits, temperature, top_k, top_p, min_p=min_p)
    uniforms = row_uniforms(generators, logits.device)
    if _from_candidates(logits, top_k):
        return _draw_from_candidates(logits, temperature, top_k, top_p, uniforms, min_p)
    return draw(logits_to_probs(logits, temperature, top_k, top_p, min_p), uniforms=uniforms)


def row_uniforms(
    generators: Sequence[torch.Generator | None], device: torch.device
) -> torch.Tensor:
    """One uniform a row, (B, 1) float32 on ``device``, each drawn from its row's generator (None:
    torch's global one) as `draw` draws a row's alone: a seeded row's numbers are the same in
    any batch. On a GPU these are launches, never a wait for the device."""
    return torch.cat([torch.rand((1, 1), generator=g, device=device) for g in generators])


DECODING = contextvars.ContextVar("gptkiln_decoding", default=False)
"""Whether the model's forwards now are a decoding's (its prompt's prefill, its steps, a decode
backend's tuning): a backend's kernels that round on purpose (bf16 weights, 8-bit activations)
run there only, never in another forward of the same model (a perplexity, an inspection, a
caller's own ``model(x)``). Serve marks its prefill and steps, not its inspections."""


@contextlib.contextmanager
def decoding() -> Iterator[None]:
    """A block whose forwards are a decoding's (`DECODING`)."""
    token = DECODING.set(True)
    try:
        yield
    finally:
        DECODING.reset(token)


def prefill(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """Run the prompt (B, T) through the model, filling the KV cache; last logits (B, V)."""
    with decoding():
        return model(idx, start_pos=0, last_only=True)[:, -1, :]


def decode_one_token(model: GPT, token: torch.Tensor, pos: int) -> torch.Tensor:
    """Feed one token per row (B,) at position pos; logits (B, V) for the next one."""
    with decoding():
        return model(token[:, None], start_pos=pos, last_only=True)[:, -1, :]


def window_logits(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """No cache: run the last context_length tokens of idx (B, T); last logits (B, V)."""
    with decoding():
        return model(idx[:, -model.config.context_length :], last_only=True)[:, -1, :]


def left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch prompts of unequal length: (B, T) ids left-padded with pad_id, and pad counts (B,)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise GptkilnError("every prompt needs at least one token; give a non-empty prompt")
    longest = max(len(p) for p in prompts)
    idx = torch.tensor([[pad_id] * (longest - len(p)) + list(p) for p in prompts], device=device)
    pad_lens = torch.tensor([longest - len(p) for p in prompts], device=device)
    return idx, pad_lens


Prepare = Callable[[GPT, int, int], object]
"""A decode backend's set-up, ``prepare(model, rows, steps)``: given a model whose KV cache holds
``rows`` rows, ready it for at most ``steps`` one-token steps
(`gptkiln.cpu.prepare_for_decoding`).

What it returns may offer ``sampling_steps(cfg, seeds, counts, pos)`` (`gptkiln.gpu`'s plan
does): then each later step within the cache is that backend's ``step(token, pos)``, which
feeds ``token`` (B,) at ``pos`` and returns the next token (B,) chosen on the device
(`sample_on_device`, penalties with ``counts`` (B, V) as they stand, each row's seed of
``seeds``); None: it declines, and the model decodes and `sample_rows` samples as without it.
"""


class HostTokens:
    """A step's tokens (B,) on their way to the host: on CUDA a copy into pinned memory that
    does not wait, and an event after it, so that `read` waits for this step's work alone and
    not for the steps queued behind it; elsewhere the tokens themselves (a CPU step has run when
    it returns) or a plain copy."""

    def __init__(self, token: torch.Tensor):
        self.event = None
        if token.device.type == "cpu":
            self.tokens = token
        elif token.device.type == "cuda":
            self.tokens = torch.empty(token.shape, dtype=token.dtype, pin_memory=True)
            with torch.cuda.device(token.device):  # the tokens' GPU, not the current one
                self.tokens.copy_(token, non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record()
        else:
            self.tokens = token.cpu()

    def read(self) -> torch.Tensor:
        """The tokens, on the CPU, once they are there."""
        if self.event is not None:
            self.event.synchronize()
        return self.tokens


@torch.inference_mode()
def generate_stream(
    model: GPT,
    prompts: Sequence[Sequence[int]] | Sequence[int] | torch.Tensor | np.ndarray,
    cfg: SampleConfig | None = None,
    eot_id: int | Sequence[int] | None = None,
    use_cache: bool = True,
    *,
    streams: Sequence[TextStream] | None = None,
    row_seeds: Sequence[int | None] | None = None,
    prepare: Prepare | None = None,
    read_ahead: bool | None = None,
    keep: int = 0,
    **overrides,
) -> Iterator[torch.Tensor]:
    """Yield the next token of every row, (B,) per step, until max_new_tokens or every row ended.

    ``prompts`` and ``overrides`` as `generate`'s: one prompt (a list of ids, a 1-D tensor or
    array) is one row, each step a (1,) tensor. The model decodes in eval mode (no dropout)
    and goes back to its mode when the stream ends or is closed.

    A row ends at ``eot_id`` (any of them, when several: a tokenizer's `stop_ids`; with
    ``cfg.stop_at_eos``) or, when ``streams`` are given (one
    `TextStream` a row, which this fills as tokens come), when its stream is done (a stop
    string); stop strings in ``cfg.stop`` need the streams. An ended row keeps yielding ``eot_id``
    (or 0) until the others end. Prompts longer than the context keep their last
    ``context_length`` tokens (the model never sees more), as does the running sequence; with
    ``keep``, the first ``keep`` ids of every prompt stay and the last ``context_length - keep``
    follow them (llama.cpp's ``n_keep``: a BOS the model always saw first, `kept_ids`).

    Where a row can end, the host reads every step's tokens, and this yields what it read (a
    CPU tensor); where none can, nothing is read and the tokens stay on the model's device.

    With ``cfg.seed`` (or ``row_seeds``, one seed or None a row) every row draws from its own
    generator, so a row's tokens are those it gets alone with the same seed.

    ``prepare(model, rows, steps)``: the decode backend's set-up (`Prepare`), called once the
    KV cache is set and the first token is out (a first token waits for no tuning), where more
    than one token is asked for; None decodes with the model as it is.

    ``read_ahead``: queue step k+1 on the device before the host reads step k's tokens, so the
    device decodes while the host checks the ends and stop strings (the tokens are the same;
    a decoding that ends computes one step it does not use). None: on CUDA, for the steps a
    backend takes on the device whole (`Prepare`'s ``sampling_steps``, the CUDA graphs), whose
    launch is cheap; an eager step's launch is the host's work, which reading ahead would only
    delay.
    """
    cfg = sample_config(cfg, overrides, "generate_stream")
    check_sampling(cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p)
    if any(i >= model.config.vocab_size for i, _ in cfg.logit_bias):
        raise GptkilnError(
            f"logit_bias names token {max(i for i, _ in cfg.logit_bias)}, past the model's "
            f"{model.config.vocab_size} ids; give ids below {model.config.vocab_size}"
        )
    if cfg.stop and streams is None:
        raise GptkilnError(
            "stop strings need the generated text: pass streams=[TextStream(tokenizer.decode, "
            "stop, eot_id) ...], one a row (or call generate(..., tokenizer=...))"
        )
    prompts = _prompt_rows(prompts, model.config.vocab_size)[1]
    was_training = model.training
    model.eval()
    try:
        yield from _stream(model, prompts, cfg, eot_id, use_cache, streams, row_seeds, prepare,
                           read_ahead, keep)  # fmt: skip
    finally:
        model.train(was_training)


def _stream(model, prompts, cfg, eot_id, use_cache, streams, row_seeds, prepare, read_ahead, keep):
    """`generate_stream`'s steps, its arguments checked."""
    ends = end_ids(eot_id)
    steps = _Steps(model, prompts, cfg, ends[0] if ends else 0, use_cache, row_seeds, keep)
    ended = _Ends(steps.rows, cfg, ends, streams, steps.device)
    # Each decode step multiplies B rows: the caller's backend prepares for that after the
    # first token is out (a first token waits for no timing).
    untuned = prepare is not None and use_cache and cfg.max_new_tokens > 1
    for step in range(cfg.max_new_tokens):
        token = ended.masked(steps.token())
        steps.count(token, ended.finished)
        ended.see(token)
        last = step + 1 == cfg.max_new_tokens
        host = HostTokens(token) if ended.possible else None  # before the next step is queued
        ahead = host is not None and not last and not untuned
        ahead = ahead and _reads_ahead(read_ahead, steps.backend_next, steps.device)
        if ahead:
            steps.queue(token)
        # the only read of a step's tokens, and none where no row can end
        yield token if host is None else ended.read(host)
        if last or ended.all_done:
            return
        if untuned:
            steps.start_backend(prepare)
            untuned = False
        if not ahead:
            steps.queue(token)


class _Steps:
    """The model's side of a `generate_stream`: the running ids and the KV cache (prefilled
    here), each step's logits or the backend's next token, the penalty counts and each row's
    generator."""

    def __init__(
        self,
        model: GPT,
        prompts: Sequence[Sequence[int]],
        cfg: SampleConfig,
        filler: int,
        use_cache: bool,
        row_seeds: Sequence[int | None] | None,
        keep: int = 0,
    ) -> None:
        self.model, self.cfg, self.use_cache = model, cfg, use_cache
        self.device = model.wte.weight.device
        self.ctx = ctx = model.config.context_length
        if not 0 <= keep < ctx or any(len(p) < keep for p in prompts):
            raise GptkilnError(f"keep={keep}: the ids kept of every prompt, 0 to {ctx - 1}")
        self.keep = keep
        cropped = [list(p)[:keep] + list(p)[keep:][-(ctx - keep) :] for p in prompts]
        self.idx, self.pad_lens = left_pad(cropped, filler, self.device)
        if self.pad_lens.any() and not use_cache:
            raise GptkilnError("prompts of unequal length need use_cache=True (the padding mask)")
        self.rows = B = self.idx.size(0)
        self.seeds = _row_seeds(cfg.seed, row_seeds, B)
        self.generators = _row_generators(self.seeds, self.device)
        vocab = model.config.vocab_size
        self.counts = torch.zeros(B, vocab, device=self.device) if cfg.penalised else None
        self.in_prompt = None  # the prompts' tokens, for the repetition penalty
        if cfg.repetition_penalty != 1:
            self.in_prompt = prompt_tokens(prompts, vocab, self.device)
        self.pos = self.idx.size(1)
        self.backend_step = None  # the prepared backend's decode-and-sample step
        self.next_token = None  # the token it chose for this step
        if use_cache:  # room for the prompt and the new tokens only: 1024 slots are 600 MB at B 8
            model.setup_cache(B, min(ctx, self.pos + cfg.max_new_tokens), self.pad_lens)
            self.logits = prefill(model, self.idx)
        else:
            self.logits = window_logits(model, self.idx)

    @property
    def backend_next(self) -> bool:
        """Whether the backend takes the next step whole (it does within the cache)."""
        return self.backend_step is not None and self.pos < self.ctx

    def token(self) -> torch.Tensor:
        """This step's token (B,): the backend's, or drawn from the logits after penalties."""
        if self.next_token is not None:
            return self.next_token
        cfg, logits = self.cfg, self.logits
        if self.counts is not None:
            logits = apply_penalties(
                logits,
                self.counts,
                cfg.presence_penalty,
                cfg.frequency_penalty,
                cfg.repetition_penalty,
                self.in_prompt,
            )
        logits = apply_logit_bias(logits, cfg.logit_bias)
        return sample_rows(
            logits, cfg.temperature, cfg.top_k, cfg.top_p, self.generators, cfg.min_p
        )

    def count(self, token: torch.Tensor, finished: torch.Tensor) -> None:
        """Count ``token`` (B,) for the penalties in the rows that have not ended."""
        if self.counts is not None:
            rows = torch.arange(self.rows, device=self.device)
            self.counts[rows, token] += (~finished).to(self.counts.dtype)

    def start_backend(self, prepare: Prepare) -> None:
        """Hand the later steps to the backend ``prepare`` sets up, where it takes them."""
        plan = prepare(self.model, self.rows, self.cfg.max_new_tokens - 1)
        start = getattr(plan, "sampling_steps", None)
        if start is not None:
            self.backend_step = start(self.cfg, self.seeds, self.counts, self.pos, self.in_prompt)

    def queue(self, token: torch.Tensor) -> None:
        """Queue the step that feeds ``token`` (B,): its logits, or the backend's next token."""
        model, ctx = self.model, self.ctx
        self.idx = torch.cat([self.idx, token[:, None]], dim=1)
        self.next_token = None
        if not self.use_cache:
            self.logits = window_logits(model, self.window()[0])
        elif self.backend_next:
            self.next_token = self.backend_step(token, self.pos)
            self.pos += 1
        elif self.pos < ctx:
            self.logits = decode_one_token(model, token, self.pos)
            self.pos += 1
        else:  # the window slides: positions shift, so the cache is rebuilt from the window
            window, pads = self.window()
            model.setup_cache(self.rows, ctx, pads)
            self.logits = prefill(model, window)

    def window(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The last ``ctx`` ids of every row (B, ctx) and their left padding (B,); a row whose
        first ``keep`` ids are past them has those first and its last ``ctx - keep`` after."""
        ctx, keep, (B, T) = self.ctx, self.keep, self.idx.shape
        shift = T - ctx
        if shift <= 0:
            return self.idx, self.pad_lens
        last = torch.arange(shift, T, device=self.device).expand(B, ctx)  # (B, ctx)
        starts = self.pad_lens[:, None] + torch.arange(keep, device=self.device)  # (B, keep)
        kept = torch.cat([starts, last[:, keep:]], dim=1)  # the row's start, then its last
        cut = (self.pad_lens < shift)[:, None]  # (B, 1): rows whose start is out of the window
        cols = torch.where(cut, kept, last) if keep else last
        return self.idx.gather(1, cols), (self.pad_lens - shift).clamp(min=0)


class _Ends:
    """Which rows of a `generate_stream` ended: ``finished`` (B,) on the model's device masks
    their tokens; ``done`` is the host's copy, from the tokens it reads (`read`), where a row
    can end at all (``possible``: an end id to stop at, or streams to fill)."""

    def __init__(
        self,
        rows: int,
        cfg: SampleConfig,
        ends: tuple[int, ...],
        streams: Sequence[TextStream] | None,
        device: torch.device,
    ) -> None:
        self.ends, self.filler, self.streams = ends, ends[0] if ends else 0, streams
        self.stop = torch.tensor(ends, device=device) if cfg.stop_at_eos and ends else None
        self.possible = self.stop is not None or streams is not None
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)
        self.done = [False] * rows

    @property
    def all_done(self) -> bool:
        return all(self.done)

    def masked(self, token: torch.Tensor) -> torch.Tensor:
        """``token`` (B,) with an ended row's replaced by the filler (the first end id, or 0)."""
        return token.masked_fill(self.finished, self.filler)

    def see(self, token: torch.Tensor) -> None:
        """Mark on the device the rows whose ``token`` is an end id."""
        if self.stop is not None:
            self.finished |= torch.isin(token, self.stop)

    def read(self, host: HostTokens) -> torch.Tensor:
        """The step's tokens on the host: each row's pushed to its stream (a stop string ends
        it, on the device too, before the next step's tokens are masked) and checked against
        the end ids."""
        out = host.read()
        for row, t in enumerate(out.tolist()):
            if self.done[row]:
                continue
            if self.streams is not None:  # a stop string, or an end its stream knows, ends it
                self.streams[row].push(t)
                if self.streams[row].done:
                    self.done[row] = True
                    self.finished[row] = True
            if self.stop is not None and t in self.ends:
                self.done[row] = True
        return out


def _reads_ahead(read_ahead: bool | None, backend_next: bool, device: torch.device) -> bool:
    """Whether `generate_stream` queues the next step before it reads this one's tokens:
    ``read_ahead`` where given, else on CUDA where the backend takes the next step
    (``backend_next``)."""
    if read_ahead is not None:
        return read_ahead
    return device.type == "cuda" and backend_next


def generate_batched(
    model: GPT,
    prompts: Sequence[Sequence[int]],
    cfg: SampleConfig,
    tokenizer,
    *,
    batch_size: int,
    row_seeds: Sequence[int | None] | None = None,
    prepare: Prepare | None = None,
    on_batch: Callable[[range, list[TextStream]], None] | None = None,
) -> list[TextStream]:
    """Generate from every prompt (token ids), ``batch_size`` rows at a time, each row into its
    own `TextStream`: the text ends before a stop string of ``cfg.stop`` or at end-of-text
    (with ``cfg.stop_at_eos``). ``row_seeds``: one seed (or None) a prompt, as
    `generate_stream`'s, and so is ``prepare``. Returns the streams, in the prompts' order, each
    flushed (what a row that ran out of tokens held back is given out). ``on_batch(rows,
    streams)`` is told each batch as it ends (the prompts' indices, their flushed streams), so a
    caller can keep what is done before the rest is (a stop loses the batch in hand only).

    `gptkiln.api.complete` and the harness backend (`gptkiln.evaluate`) both generate through
    this; the model is left in the mode it was in, without a cache.
    """
    eot = stop_ids_of(tokenizer) if cfg.stop_at_eos else None
    hidden = hidden_ids(tokenizer, cfg.skip_special_tokens)
    streams = [TextStream(tokenizer.decode, cfg.stop, eot, hidden) for _ in prompts]
    ctx = model.config.context_length
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(prompts), batch_size):
            batch = range(start, min(start + batch_size, len(prompts)))
            for _ in generate_stream(
                model,
                [prompts[r] for r in batch],
                cfg,
                stop_ids_of(tokenizer),
                streams=[streams[r] for r in batch],
                row_seeds=None if row_seeds is None else [row_seeds[r] for r in batch],
                prepare=prepare,
                keep=kept_ids(tokenizer, [prompts[r] for r in batch], ctx),
            ):
                pass
            for r in batch:
                streams[r].flush()
            if on_batch is not None:
                on_batch(batch, [streams[r] for r in batch])
    finally:
        model.clear_cache()
        model.train(was_training)
    return streams


def kept_ids(tokenizer, prompts: Sequence[Sequence[int]], context: int) -> int:
    """`generate_stream`'s ``keep`` for ``prompts`` and a model of ``context`` tokens: the ids
    the tokenizer puts before every text (Llama 3's BOS: `tokenizers.leading_ids`), where every
    prompt begins with them and the window has room for more, so a window that slides keeps
    the start the model was trained to see first; else 0."""
    from gptkiln.tokenizers import leading_ids

    lead = leading_ids(tokenizer) if tokenizer is not None else []
    fits = lead and len(lead) < context and all(list(p[: len(lead)]) == lead for p in prompts)
    return len(lead) if fits else 0


def _row_seeds(
    seed: int | None, row_seeds: Sequence[int | None] | None, rows: int
) -> list[int | None]:
    """Each row's seed (None: unseeded): ``row_seeds``, or ``seed`` for every row."""
    seeds = list(row_seeds) if row_seeds is not None else [seed] * rows
    if len(seeds) != rows:
        raise GptkilnError(
            f"row_seeds has {len(seeds)} seeds for {rows} prompts; give one a prompt"
        )
    return seeds


def _row_generators(
    seeds: Sequence[int | None], device: torch.device
) -> list[torch.Generator | None] | None:
    """One generator a row (seeded; None for a row without a seed), or None when no row has a
    seed (one draw for the whole batch from torch's global generator)."""
    if all(s is None for s in seeds):
        return None
    return [None if s is None else torch.Generator(device=device).manual_seed(s) for s in seeds]


def _before_end(ids: list[int], ends: Sequence[int]) -> list[int]:
    """``ids`` up to the first of ``ends`` (all of them where none is there)."""
    cut = next((i for i, t in enumerate(ids) if t in ends), len(ids))
    return ids[:cut]


def sample_config(cfg: SampleConfig | None, overrides: dict[str, Any], caller: str):
    """``cfg`` (a default `SampleConfig` when None) with ``overrides`` set, each a field."""
    cfg = cfg or SampleConfig()
    if not overrides:
        return cfg
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(SampleConfig)})
    if unknown:
        raise GptkilnError(
            f"{caller}() has no setting {', '.join(unknown)}; SampleConfig's are: "
            + ", ".join(f.name for f in dataclasses.fields(SampleConfig))
        )
    return SampleConfig(**{**cfg.__dict__, **overrides})


def _prompt_rows(prompts, vocab_size: int) -> tuple[bool, list[list[int]]]:
    """(whether ``prompts`` is one prompt, its rows of ids), each id checked to be one of the
    model's: text, or an id past the vocabulary, is one line, not an error deep in torch."""
    if isinstance(prompts, str):
        raise GptkilnError(
            "generate() takes token ids, not text: pass tokenizer.encode(text), or use "
            "gptkiln.api.complete(run, text) for text in and out"
        )
    if isinstance(prompts, (torch.Tensor, np.ndarray)):  # (T,) one prompt, (B, T) a batch
        prompts = prompts.tolist() if prompts.ndim else [prompts.item()]  # 0-d: one id
    # one prompt of ids (a float or None among them refused below), or a batch of rows; a 0-d
    # tensor or array is one id
    arrays = (torch.Tensor, np.ndarray)
    first = prompts[0] if len(prompts) else None
    single = len(prompts) > 0 and not (
        isinstance(first, Sequence) or (isinstance(first, arrays) and first.ndim > 0)
    )
    rows = [prompts] if single else prompts
    batch = [
        r.tolist()
        if isinstance(r, arrays)
        else [t.item() if isinstance(t, arrays) and t.ndim == 0 else t for t in r]
        for r in rows
    ]
    for n, row in enumerate(batch):
        bad = [t for t in row if isinstance(t, bool) or not isinstance(t, Integral)]
        bad += [t for t in row if isinstance(t, Integral) and not 0 <= t < vocab_size]
        if bad:
            where = "the prompt" if single else f"prompt {n}"
            raise GptkilnError(
                f"{where} holds {bad[0]!r}, not a token id of this model (0 to {vocab_size - 1}); "
                "encode prompts with the model's own tokenizer"
            )
    return single, batch


def generate(
    model: GPT,
    prompts: Sequence[Sequence[int]] | Sequence[int] | torch.Tensor | np.ndarray,
    cfg: SampleConfig | None = None,
    eot_id: int | Sequence[int] | None = None,
    use_cache: bool = True,
    *,
    tokenizer=None,
    prepare: Prepare | None = None,
    read_ahead: bool | None = None,
    **overrides,
) -> list[list[int]] | list[int]:
    """New token ids for one prompt (a list of ids, or a 1-D tensor or array) or a batch (a list
    of lists, or a 2-D tensor or array).

    ``overrides`` set `SampleConfig` fields directly: ``generate(model, ids, max_new_tokens=20,
    temperature=0)``. The end-of-text token, when it stops a row, is not included. Stop strings
    (``stop=[...]``) need ``tokenizer`` (its ``decode``; it also gives ``eot_id`` when that is not
    passed); a row ends with the token that completes a stop string, which is included, as
    Hugging Face's ``generate`` does (the text-level functions, `gptkiln.api.stream_text` and the
    server, cut the text before the stop string). ``prepare`` and ``read_ahead``: as
    `generate_stream`'s; with ``tokenizer``, a sliding window keeps the ids it begins every text
    with (`kept_ids`).

    The default samples at temperature 1; the book's ``generate_text_simple`` is greedy
    (``temperature=0`` here gives its ids). Under a seed, sampled ids are gptkiln's draws
    (`draw`: one uniform a row), not ``torch.multinomial``'s, so the book's seeded samples
    are other tokens from the same distribution.
    """
    cfg = sample_config(cfg, overrides, "generate")
    if tokenizer is not None and eot_id is None:
        eot_id = stop_ids_of(tokenizer)
    single, batch = _prompt_rows(prompts, model.config.vocab_size)
    if cfg.stop and tokenizer is None:
        raise GptkilnError("stop strings need the tokenizer: generate(..., tokenizer=tokenizer)")
    ends = end_ids(eot_id) if cfg.stop_at_eos else ()
    streams = None
    if cfg.stop:
        hidden = hidden_ids(tokenizer, cfg.skip_special_tokens)
        streams = [TextStream(tokenizer.decode, cfg.stop, ends, hidden) for _ in batch]
    was_training = model.training
    model.eval()
    try:
        tokens = generate_stream(
            model,
            batch,
            cfg,
            eot_id,
            use_cache,
            streams=streams,
            prepare=prepare,
            read_ahead=read_ahead,
            keep=kept_ids(tokenizer, batch, model.config.context_length),
        )
        steps = list(tokens)  # (B,) each; left on the device where no row can end: no sync
    finally:
        model.clear_cache()
        model.train(was_training)
    if streams is not None:  # a row's ids up to its stop string's last token or an end id
        rows = [stream.ids for stream in streams]
    else:
        ids = torch.stack(steps, dim=1).tolist() if steps else [[] for _ in batch]
        rows = [_before_end(row, ends) for row in ids]
    return rows[0] if single else rows
