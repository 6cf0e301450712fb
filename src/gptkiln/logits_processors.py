"""What changes a row's logits before the temperature and the filters: the penalties (CTRL's
repetition penalty, OpenAI's presence and frequency), OpenAI's ``logit_bias`` and a grammar's
token bitmask; transformers calls these its logits processors, and the filters that follow
(`gptkiln.sampling.logits_to_probs`) its warpers. Pure functions of tensors, used by
`gptkiln.sampling`'s decoding, the server's rows (`gptkiln.serve.choosing`) and the CUDA-graph
step (`gptkiln.gpu.step`) alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    presence: float,
    frequency: float,
    repetition: float = 1.0,
    in_prompt: torch.Tensor | None = None,
) -> torch.Tensor:
    """The penalties on logits (B, V). First CTRL's ``repetition`` penalty (transformers' and
    vLLM's, over the whole sequence; llama.cpp's ``repeat_penalty`` over its last 64 tokens): the
    logit of each token in the row's prompt (``in_prompt`` (B, V) bool, where given) or generated
    divided by ``repetition`` where positive, multiplied where negative. Then OpenAI's: each logit
    minus ``frequency`` times its token's count so far, minus ``presence`` once if that count is not
    0. ``counts`` (B, V) holds how often each token was generated in each row (the prompt does not
    count there)."""
    if repetition != 1:
        seen = counts > 0 if in_prompt is None else (counts > 0) | in_prompt
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalised, logits)
    if not presence and not frequency:
        return logits
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def apply_logit_bias(logits: torch.Tensor, bias: Sequence[tuple[int, float]]) -> torch.Tensor:
    """OpenAI's ``logit_bias`` on logits (B, V): each ``(token id, bias)``'s bias added to that
    token's logit in every row (a new tensor; ``logits`` itself where there is none)."""
    if not bias:
        return logits
    ids = torch.tensor([i for i, _ in bias], device=logits.device)
    values = torch.tensor([b for _, b in bias], device=logits.device, dtype=logits.dtype)
    return logits.index_add(-1, ids, values.expand(logits.size(0), -1))


def prompt_tokens(
    prompts: Sequence[Sequence[int]], vocab: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Which tokens each prompt holds, (B, V) bool on ``device``: `apply_penalties`'
    ``in_prompt`` (the whole prompt, also where the model sees only its last context)."""
    seen = torch.zeros(len(prompts), vocab, dtype=torch.bool)
    for row, ids in enumerate(prompts):
        seen[row, torch.as_tensor(list(ids), dtype=torch.long)] = True
    return seen.to(device)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Forbid, in place, the tokens a grammar does not allow: logits (B, V) get -inf where the
    token's bit in ``bitmask`` (B, ceil(V'/32)) int32, bit ``i % 32`` of word ``i // 32``, is 0
    (the layout llguidance, xgrammar and outlines-core fill). Ids past the mask's V' (a model's
    vocabulary padded beyond its tokenizer's) are forbidden too. Returns ``logits``."""
    rows, vocab = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # (B, W, 32)
    allowed = bits.reshape(rows, -1)[:, :vocab].bool()  # (B, min(32W, V))
    logits[:, allowed.shape[1] :] = float("-inf")
    logits[:, : allowed.shape[1]].masked_fill_(~allowed.to(logits.device), float("-inf"))
    return logits
