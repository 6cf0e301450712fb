"""Text generation as small pure functions: filter logits, sample, prefill, decode one token.

``generate_stream`` yields each new token as it is chosen; ``generate`` collects them. With the
KV cache (the default) the prompt is run once (prefill) and every later step feeds one token;
without it every step re-runs the whole window, as the book's ``generate_text_simple`` does.
Both give the same tokens.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from gptkiln.config import SampleConfig, check_sampling
from gptkiln.errors import GptkilnError
from gptkiln.kernels import tune_decoding
from gptkiln.model import GPT


def logits_to_probs(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """Next-token probabilities (B, V) from logits (B, V) after temperature, top-k and top-p.

    temperature must be > 0 here (0 means greedy and never reaches this function).
    """
    logits = logits.float()
    # Shifted so the largest is 0: a tiny temperature then gives -inf, never inf (inf - inf would
    # be NaN after softmax); softmax does not change under the shift.
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_probs, sorted_idx = torch.sort(probs, dim=-1, descending=True)
        # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, sorted_idx, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one token per row from logits (B, V): argmax when temperature is 0. Returns (B,)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = logits_to_probs(logits, temperature, top_k, top_p)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def prefill(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """Run the prompt (B, T) through the model, filling the KV cache; last logits (B, V)."""
    return model(idx, start_pos=0, last_only=True)[:, -1, :]


def decode_one_token(model: GPT, token: torch.Tensor, pos: int) -> torch.Tensor:
    """Feed one token per row (B,) at position pos; logits (B, V) for the next one."""
    return model(token[:, None], start_pos=pos, last_only=True)[:, -1, :]


def window_logits(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """No cache: run the last context_length tokens of idx (B, T); last logits (B, V)."""
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


@torch.inference_mode()
def generate_stream(
    model: GPT,
    prompts: Sequence[Sequence[int]],
    cfg: SampleConfig,
    eot_id: int | None = None,
    use_cache: bool = True,
) -> Iterator[torch.Tensor]:
    """Yield the next token of every row, (B,) per step, until max_new_tokens or every row ended.

    A row that produced ``eot_id`` (with ``cfg.stop_at_eos``) is finished: it keeps yielding
    ``eot_id`` until the others finish. Prompts longer than the context keep their last
    ``context_length`` tokens (the model never sees more), as does the running sequence.
    """
    check_sampling(cfg.temperature, cfg.top_k, cfg.top_p)
    device = model.wte.weight.device
    generator = None
    if cfg.seed is not None:
        generator = torch.Generator(device=device).manual_seed(cfg.seed)
    ctx = model.config.context_length
    idx, pad_lens = left_pad([list(p)[-ctx:] for p in prompts], eot_id or 0, device)
    if pad_lens.any() and not use_cache:
        raise GptkilnError("prompts of unequal length need use_cache=True (the padding mask)")
    stop = eot_id if cfg.stop_at_eos else None
    finished = torch.zeros(idx.size(0), dtype=torch.bool, device=device)
    pos = idx.size(1)
    if use_cache:  # room for the prompt and the new tokens only: 1024 slots are 600 MB at batch 8
        model.setup_cache(idx.size(0), min(ctx, pos + cfg.max_new_tokens), pad_lens)
        if cfg.max_new_tokens > 1:  # each decode step multiplies B rows: the fastest kernel
            tune_decoding(model, rows=idx.size(0))
        logits = prefill(model, idx)
    else:
        logits = window_logits(model, idx)
    for step in range(cfg.max_new_tokens):
        token = sample(logits, cfg.temperature, cfg.top_k, cfg.top_p, generator)  # (B,)
        if stop is not None:
            token = token.masked_fill(finished, stop)
            finished |= token == stop
        yield token
        if step + 1 == cfg.max_new_tokens or (stop is not None and bool(finished.all())):
            return
        idx = torch.cat([idx, token[:, None]], dim=1)
        if not use_cache:
            logits = window_logits(model, idx)
        elif pos < ctx:
            logits = decode_one_token(model, token, pos)
            pos += 1
        else:  # the window slides: positions shift, so the cache is rebuilt from the last ctx
            model.setup_cache(idx.size(0), ctx, (pad_lens - (idx.size(1) - ctx)).clamp(min=0))
            logits = prefill(model, idx[:, -ctx:])


def generate(
    model: GPT,
    prompts: Sequence[Sequence[int]] | Sequence[int] | torch.Tensor | np.ndarray,
    cfg: SampleConfig | None = None,
    eot_id: int | None = None,
    use_cache: bool = True,
    **overrides,
) -> list[list[int]] | list[int]:
    """New token ids for one prompt (a list of ids, or a 1-D tensor or array) or a batch (a list
    of lists, or a 2-D tensor or array).

    ``overrides`` set `SampleConfig` fields directly: ``generate(model, ids, max_new_tokens=20,
    temperature=0)``. The end-of-text token, when it stops a row, is not included.
    """
    cfg = cfg or SampleConfig()
    if overrides:
        cfg = SampleConfig(**{**cfg.__dict__, **overrides})
    if isinstance(prompts, (torch.Tensor, np.ndarray)):  # (T,) one prompt, (B, T) a batch
        prompts = prompts.tolist()
    single = len(prompts) > 0 and isinstance(prompts[0], int)
    batch = [list(prompts)] if single else [list(p) for p in prompts]
    rows: list[list[int]] = [[] for _ in batch]
    done = [False] * len(batch)
    was_training = model.training
    model.eval()
    try:
        for token in generate_stream(model, batch, cfg, eot_id, use_cache):
            for row, t in enumerate(token.tolist()):
                if done[row]:
                    continue
                if cfg.stop_at_eos and t == eot_id:
                    done[row] = True
                else:
                    rows[row].append(t)
    finally:
        model.clear_cache()
        model.train(was_training)
    return rows[0] if single else rows
