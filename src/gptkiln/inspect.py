"""See inside a model: the attention weights, next-token probabilities and per-token loss of a
prompt.

`inspect_prompt` runs the model once on the prompt with ``GPT.forward``'s ``attentions`` switch,
which has every layer compute its weights on the explicit path, softmax(Q K^T / sqrt(hs)) with
the causal mask, and hand them back: the same model, weights and math as training, not a copy.
From that one forward it gathers

- every layer's and head's attention weights, (n_layer, n_head, T, T): query tokens down, key
  tokens across, each row summing to 1, zero above the diagonal. With grouped-query attention
  (Llama 3, Qwen3: fewer key/value heads than query heads) there is still one map per query
  head, its own queries against the keys it shares with its group; ``kv_head_of`` names the
  key/value head each query head reads (query head h reads h // (n_head / n_kv_head));
- at each position, the top-k next tokens and their probabilities (softmax of the logits), and
  the probability and loss of the token that does come next in the prompt;
- the prompt's mean loss over the tokens it predicts, and its perplexity.

`Inspection.to_dict` is the JSON that ``gptkiln inspect --json`` writes; `Inspection.report`, the
table it prints; `gptkiln.plots.plot_attention` draws the heat-maps. `token_labels` turns ids into
readable labels: a GPT-2 byte piece shown as the text it is part of, spaces as ``␣``, newlines as
``↵``.

Shape legend: L layers, nh heads, T prompt tokens, V vocabulary.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from gptkiln.errors import GptkilnError
from gptkiln.model import GPT

DEFAULT_TOP_K = 5
DEFAULT_MAX_TOKENS = 64
"""Tokens inspected by default: 64 rows and columns per heat-map still fit a label per token."""

# How the characters that print as nothing (or as a line break) are shown in a label.
VISIBLE = {" ": "␣", "\n": "↵", "\t": "⇥"}
PIECE = "…"  # marks a token that holds only part of a character (a byte-level BPE piece)


@dataclass
class TokenProb:
    """A token and the probability the model gave it."""

    id: int
    label: str
    prob: float


@dataclass
class Position:
    """What the model predicts after one prompt token.

    Attributes:
        top_k: the most probable next tokens, most probable first.
        next: the prompt's actual next token with its probability; None at the last position.
        loss: -log of ``next.prob`` (the cross-entropy of that prediction); None at the last.
    """

    top_k: list[TokenProb]
    next: TokenProb | None
    loss: float | None


@dataclass
class Inspection:
    """One prompt seen through one model (see the module docstring).

    Attributes:
        prompt: the text as given.
        ids: the token ids inspected (T of them).
        labels: a readable label for each id (`token_labels`).
        attention: (L, nh, T, T) attention weights, float32 on the CPU.
        positions: T predictions, one after each token.
        prompt_tokens: tokens of the whole prompt; more than T when it was cropped.
        max_tokens: the crop asked for (None: none).
        context_length: the model's context, the crop that always applies.
        n_kv_head: the model's key/value heads (fewer than nh with grouped-query attention;
            None: one per query head).
    """

    prompt: str
    ids: list[int]
    labels: list[str]
    attention: torch.Tensor
    positions: list[Position]
    prompt_tokens: int
    max_tokens: int | None
    context_length: int
    n_kv_head: int | None = None

    @property
    def kv_head_of(self) -> list[int]:
        """For each query head, the key/value head it reads: h // (nh / nkv), the
        ``repeat_interleave`` grouping of `gptkiln.model`; [0, 1, ..., nh - 1] without GQA."""
        n_head = self.attention.shape[1]
        group = n_head // (self.n_kv_head or n_head)
        return [h // group for h in range(n_head)]

    @property
    def cropped(self) -> bool:
        return self.prompt_tokens > len(self.ids)

    def crop_note(self) -> str | None:
        """One line saying that (and why) only the first tokens were inspected; None if all."""
        if not self.cropped:
            return None
        if self.max_tokens is not None and self.max_tokens < self.context_length:
            why = f"--max-tokens {self.max_tokens}"
        else:
            why = f"the model's context of {self.context_length}"
        return (
            f"the prompt has {self.prompt_tokens} tokens; inspecting the first {len(self.ids)} "
            f"({why}), whose numbers are those of the whole prompt (each token sees only the "
            "ones before it)"
        )

    @property
    def loss(self) -> float | None:
        """Mean loss over the T - 1 tokens the prompt lets the model predict; None for T = 1."""
        losses = [p.loss for p in self.positions if p.loss is not None]
        return sum(losses) / len(losses) if losses else None

    @property
    def perplexity(self) -> float | None:
        return None if self.loss is None else math.exp(min(self.loss, 50))

    def to_dict(self, decimals: int = 6) -> dict[str, Any]:
        """Everything as JSON-ready values; weights and probabilities rounded to ``decimals``."""
        n_layer, n_head = self.attention.shape[:2]

        def token(t: TokenProb | None) -> dict[str, Any] | None:
            return None if t is None else {**vars(t), "prob": round(t.prob, decimals)}

        return {
            "prompt": self.prompt,
            "prompt_tokens": self.prompt_tokens,
            "cropped": self.cropped,
            "n_layer": n_layer,
            "n_head": n_head,
            "n_kv_head": self.n_kv_head or n_head,
            "kv_head_of": self.kv_head_of,
            "tokens": [{"id": i, "label": s} for i, s in zip(self.ids, self.labels)],
            "attention": self.attention.double().round(decimals=decimals).tolist(),
            "positions": [
                {
                    "position": t,
                    "top_k": [token(c) for c in p.top_k],
                    "next": token(p.next),
                    "loss": None if p.loss is None else round(p.loss, decimals),
                }
                for t, p in enumerate(self.positions)
            ],
            "loss": None if self.loss is None else round(self.loss, decimals),
            "perplexity": None if self.perplexity is None else round(self.perplexity, decimals),
        }

    def write_json(self, path: str | os.PathLike) -> Path:
        """Write `to_dict` to ``path`` (UTF-8, one line); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), ensure_ascii=False) + "\n", encoding="utf-8")
        return path

    def report(self, position: int | None = None) -> str:
        """The table ``gptkiln inspect`` prints: per position, the token, the actual next token
        with its probability and loss, and the top-k; then the loss and perplexity."""
        rows = range(len(self.ids))
        if position is not None:
            rows = [pick("--position", position, len(self.ids), "prompt tokens")]
        width = min(16, max(text_width(s) for s in [*self.labels, "token"]))
        k = len(self.positions[0].top_k)
        lines = [
            f"{'pos':>4}  {pad('token', width)}  {pad('next', width)}  {'p(next)':>8}  "
            f"{'loss':>6}  top-{k} next tokens"
        ]
        for t in rows:
            p = self.positions[t]
            nxt = p.next
            actual = (
                f"{pad(nxt.label, width)}  {prob(nxt.prob):>8}  {p.loss:6.2f}"
                if nxt is not None and p.loss is not None
                else f"{pad('-', width)}  {'':8}  {'':6}"
            )
            top = "  ".join(f"{c.label} {prob(c.prob)}" for c in p.top_k)
            lines.append(f"{t:>4}  {pad(self.labels[t], width)}  {actual}  {top}")
        if self.loss is None:
            lines.append("loss: none (a prompt of one token gives nothing to predict)")
        else:
            lines.append(
                f"loss {self.loss:.4f} over {len(self.ids) - 1} predicted tokens | "
                f"perplexity {self.perplexity:.2f}"
            )
        return "\n".join(lines)


def inspect_prompt(
    model: GPT,
    tokenizer: Any,
    text: str,
    *,
    top_k: int = DEFAULT_TOP_K,
    max_tokens: int | None = DEFAULT_MAX_TOKENS,
) -> Inspection:
    """Attention weights, top-k next tokens and per-token loss of ``text`` under ``model``.

    Args:
        model: a GPT (in any mode: it runs in eval mode, without gradients, and is left as it
            was).
        tokenizer: the model's tokenizer (a `gptkiln.tokenizers.Tokenizer`).
        text: the prompt.
        top_k: how many of the most probable next tokens to keep at each position (1 to V).
        max_tokens: inspect the first ``max_tokens`` tokens (and never more than the model's
            context); None: as many as the context holds. The model attends only to earlier
            tokens, so the weights and probabilities of the tokens kept are exactly those of
            the whole prompt.

    Returns:
        An `Inspection`; ``cropped`` tells whether the prompt was longer than what was kept.

    Raises:
        GptkilnError: an empty prompt, ``top_k`` or ``max_tokens`` out of range, or ids the
            model has no embedding for.
    """
    V, ctx = model.config.vocab_size, model.config.context_length
    if not 1 <= top_k <= V:
        raise GptkilnError(f"--top-k {top_k}: choose 1 to {V:,} (the model's vocabulary)")
    if max_tokens is not None and max_tokens < 1:
        raise GptkilnError(f"--max-tokens {max_tokens}: choose at least 1 (default 64)")
    all_ids = tokenizer.encode(text)
    if not all_ids:
        raise GptkilnError("the prompt is empty; pass --prompt with some text")
    limit = min(ctx, max_tokens or ctx)
    ids = all_ids[:limit]
    if max(ids) >= V:
        raise GptkilnError(
            f"the tokenizer ({tokenizer.kind}, {tokenizer.vocab_size:,} ids) gave id {max(ids):,}, "
            f"beyond the model's {V:,}; pass the model's own tokenizer"
        )
    idx = torch.tensor([ids], device=model.wte.weight.device)  # (1, T)
    attentions: list[torch.Tensor] = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(idx, attentions=attentions)  # (1, T, V)
    finally:
        model.train(was_training)
    weights = torch.cat(attentions).float().cpu()  # L x (1, nh, T, T) -> (L, nh, T, T)
    logits = logits[0].float()  # (T, V)
    probs = torch.softmax(logits, dim=-1)  # (T, V)
    top = probs.topk(top_k, dim=-1)  # values and indices (T, k)
    losses = F.cross_entropy(logits[:-1], idx[0, 1:], reduction="none")  # (T - 1,)
    next_probs = probs[:-1].gather(1, idx[0, 1:, None])[:, 0]  # (T - 1,)
    labels = token_labels(tokenizer, ids)
    top_ids = top.indices.tolist()
    single = _single_labels(tokenizer, {i for row in top_ids for i in row})
    positions = []
    for t in range(len(ids)):
        candidates = [
            TokenProb(i, single[i], p) for i, p in zip(top_ids[t], top.values[t].tolist())
        ]
        if t + 1 < len(ids):
            nxt = TokenProb(ids[t + 1], labels[t + 1], next_probs[t].item())
            positions.append(Position(candidates, nxt, losses[t].item()))
        else:
            positions.append(Position(candidates, None, None))
    return Inspection(
        text, ids, labels, weights, positions, len(all_ids), max_tokens, ctx, model.config.kv_heads
    )


def inspect_run(
    run_dir: str | os.PathLike,
    prompt: str,
    *,
    top_k: int = DEFAULT_TOP_K,
    max_tokens: int | None = DEFAULT_MAX_TOKENS,
    device: str = "cpu",
    quantize: str | None = None,
) -> Inspection:
    """`inspect_prompt` with the model and tokenizer of a run (or Hugging Face model) directory;
    ``quantize="int8"`` quantizes its weights on load (`gptkiln.loading.load_model`), to see
    what int8 weights change."""
    from gptkiln.loading import check_language_model, load_run

    model, tokenizer, _ = load_run(run_dir, device=device, quantize=quantize)
    check_language_model(model, run_dir)
    return inspect_prompt(model, tokenizer, prompt, top_k=top_k, max_tokens=max_tokens)


def check_view(
    inspection: Inspection,
    layer: int | None = None,
    head: int | None = None,
    position: int | None = None,
) -> None:
    """Refuse a layer, head or position the inspection does not have, with one line each.
    Negative numbers count from the end (-1: the last)."""
    n_layer, n_head, T = inspection.attention.shape[:3]
    for flag, value, count, what in (
        ("--layer", layer, n_layer, "layers"),
        ("--head", head, n_head, "heads"),
        ("--position", position, T, "prompt tokens"),
    ):
        if value is not None:
            pick(flag, value, count, what)


def pick(flag: str, value: int, count: int, what: str) -> int:
    """``value`` as an index into ``count`` things (negative: from the end), or one line why not."""
    if not -count <= value < count:
        raise GptkilnError(
            f"{flag} {value}: there are {count} {what}, numbered 0 to {count - 1} "
            f"(or -1 for the last); pick one of them"
        )
    return value % count


# -- readable tokens -------------------------------------------------------------------------
def token_labels(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """A readable label for each token of a sequence.

    Each label is the text of the token's bytes, with ``␣`` for a space, ``↵`` for a newline,
    ``⇥`` for a tab and a ``\\x..``/``\\u....`` escape for other invisible characters. A token
    that holds only part of a character (GPT-2's byte pieces of Chinese, say) shows that whole
    character, with ``…`` on the side where the character goes on in the next (or previous)
    token: ``文`` split in two reads ``文…``, ``…文``. Bytes that make no character (never the
    case for an encoded text) show as ``\\x..``.
    """
    pieces = [tokenizer.token_bytes(i) for i in ids]
    chars = _characters(b"".join(pieces))  # (start, end, text) per character
    labels, start, c = [], 0, 0
    for piece in pieces:
        end = start + len(piece)
        while c < len(chars) and chars[c][1] <= start:  # characters wholly before this token
            c += 1
        overlap = []
        j = c
        while j < len(chars) and chars[j][0] < end:
            overlap.append(chars[j])
            j += 1
        text = "".join(visible(ch) for _, _, ch in overlap)
        if overlap and overlap[0][0] < start:
            text = PIECE + text
        if overlap and overlap[-1][1] > end:
            text += PIECE
        labels.append(text)
        start = end
    return labels


def visible(ch: str) -> str:
    """One character as a label shows it: spaces and line breaks as symbols, other characters
    that print as nothing as escapes."""
    if ch in VISIBLE:
        return VISIBLE[ch]
    if len(ch) > 1 or ch.isprintable():  # a multi-character string is already an escape
        return ch
    return ch.encode("unicode_escape").decode("ascii")


def prob(p: float) -> str:
    """A probability in a few characters: 0.123, or 4.5e-05 below 0.001."""
    return f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"


def text_width(text: str) -> int:
    """Columns a terminal gives ``text``: two for a wide (East Asian) character."""
    import unicodedata

    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


def pad(text: str, width: int) -> str:
    """``text`` padded to ``width`` terminal columns, or cut to them with ``…`` (so tables line
    up, Chinese included)."""
    if text_width(text) > width:
        cut, used = "", 0
        for ch in text:
            if used + text_width(ch) > width - 1:
                break
            cut += ch
            used += text_width(ch)
        text = cut + PIECE
    return text + " " * (width - text_width(text))


def _characters(data: bytes) -> list[tuple[int, int, str]]:
    """(start byte, end byte, text) of each UTF-8 character of ``data``; a byte that begins no
    character stands alone as ``\\xNN``."""
    chars, i = [], 0
    while i < len(data):
        for n in (1, 2, 3, 4):
            try:
                ch = data[i : i + n].decode("utf-8")
            except UnicodeDecodeError:
                continue
            break
        else:
            ch, n = f"\\x{data[i]:02x}", 1
        chars.append((i, i + n, ch))
        i += n
    return chars


def _single_labels(tokenizer: Any, ids: set[int]) -> dict[int, str]:
    """Labels of tokens on their own (the top-k candidates): a lone byte piece shows its bytes."""
    return {i: token_labels(tokenizer, [i])[0] for i in ids}
