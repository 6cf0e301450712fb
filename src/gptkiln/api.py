"""Library functions behind the CLI subcommands that work on a trained model: generate and eval.

`prepare` is `gptkiln.data.prepare.prepare`, `train` is `gptkiln.train.train`, `convert` and
`download` live in `gptkiln.convert`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from gptkiln.config import SampleConfig
from gptkiln.errors import GptkilnError


def stream_text(
    run_dir: str | os.PathLike,
    prompt: str,
    cfg: SampleConfig | None = None,
    *,
    device: str = "cpu",
    on_notice: Callable[[str], None] | None = None,
    input: str = "",
    raw: bool = False,
) -> Iterator[str]:
    """Yield the generated text piece by piece as tokens are chosen.

    The text ends at end-of-text or right before a stop string of ``cfg.stop``. An empty prompt
    starts from the end-of-text token (unconditional generation). A prompt longer than the
    model's context keeps its last ``context_length`` tokens; the ``on_notice`` callback (if
    given) is told so.

    An instruction-tuned run (`gptkiln finetune`) takes ``prompt`` as the instruction and
    ``input`` as its input, formatted with the run's stored template (`finetune.templates`);
    the text is the response alone, which also ends where the model starts a part of the
    template (``### Instruction:`` ...). ``raw`` sends ``prompt`` as it is.
    """
    from gptkiln.finetune.runs import run_template
    from gptkiln.finetune.templates import format_prompt
    from gptkiln.loading import check_language_model, load_run

    cfg = cfg or SampleConfig()
    model, tokenizer, run_cfg = load_run(run_dir, device=device)
    check_language_model(model, run_dir)
    template = None if raw else run_template(run_cfg, run_dir)
    if template is not None:
        prompt = format_prompt(template, prompt, input)
        cfg = dataclasses.replace(cfg, stop=tuple(cfg.stop) + template.stop_strings())
    elif input:
        why = "--raw leaves it out" if raw else f"{run_dir} has none (it is not instruction-tuned)"
        raise GptkilnError(
            f"--input goes into an instruction-tuned run's prompt template, and {why}; put the "
            "whole prompt in --prompt"
        )
    yield from stream_from_model(model, tokenizer, prompt, cfg, run_dir, on_notice)


def stream_from_model(
    model,
    tokenizer,
    prompt: str,
    cfg: SampleConfig,
    source: str | os.PathLike = "the model",
    on_notice: Callable[[str], None] | None = None,
) -> Iterator[str]:
    """`stream_text` for a model already loaded (``source`` names it in messages): the text
    of one sequence through `sampling.TextStream`, which `generate`, `chat` and the
    fine-tuning samples all read."""
    from gptkiln.loading import check_ids_fit
    from gptkiln.sampling import TextStream, generate_stream
    from gptkiln.tokenizers import encode_prompt

    was_training = model.training
    model.eval()
    ids = encode_prompt(tokenizer, prompt)
    check_ids_fit(max(ids), model, tokenizer, source)
    ctx = model.config.context_length
    if len(ids) > ctx and on_notice:
        on_notice(
            f"prompt has {len(ids)} tokens, more than the model's context of {ctx}; "
            f"keeping the last {ctx}"
        )
    stream = TextStream(tokenizer.decode, cfg.stop, tokenizer.eot_id if cfg.stop_at_eos else None)
    try:
        for _ in generate_stream(model, [ids], cfg, tokenizer.eot_id, streams=[stream]):
            if piece := stream.take():
                yield piece
        if tail := stream.flush():  # it ended inside a character, or by length: what is held back
            yield tail
    finally:
        model.clear_cache()
        model.train(was_training)


def generate_text(
    run_dir: str | os.PathLike, prompt: str, cfg: SampleConfig | None = None, *, device: str = "cpu"
) -> str:
    """The prompt followed by the generated text."""
    return prompt + "".join(stream_text(run_dir, prompt, cfg, device=device))


@dataclass
class EvalResult:
    loss: float
    perplexity: float
    tokens: int


def evaluate_run(
    run_dir: str | os.PathLike,
    data: str | os.PathLike,
    *,
    batch_size: int = 8,
    device: str = "cpu",
    progress: bool = True,
) -> EvalResult:
    """Cross-entropy and perplexity of a model on text.

    Args:
        data: a prepared data directory (its validation split is used) or a text/jsonl file,
            tokenized with the run's tokenizer and cut into non-overlapping context windows.
    """
    import numpy as np
    from tqdm.auto import tqdm

    from gptkiln.data.windows import SlidingWindowDataset
    from gptkiln.loading import check_ids_fit, check_language_model, load_run

    if batch_size < 1:
        raise GptkilnError(f"batch_size must be >= 1, got {batch_size}")
    model, tokenizer, _ = load_run(run_dir, device=device)
    check_language_model(model, run_dir)
    model.eval()
    tokens = _eval_tokens(Path(data), tokenizer)
    if len(tokens):
        check_ids_fit(int(np.max(tokens)), model, tokenizer, run_dir)
    ctx = model.config.context_length
    dataset = SlidingWindowDataset(
        np.asarray(tokens), min(ctx, len(tokens) - 1), min(ctx, len(tokens) - 1)
    )
    total, count = 0.0, 0
    with torch.no_grad():
        for start in tqdm(range(0, len(dataset), batch_size), disable=not progress, unit="batch"):
            xs, ys = zip(*(dataset[i] for i in range(start, min(start + batch_size, len(dataset)))))
            x, y = torch.stack(xs).to(device), torch.stack(ys).to(device)
            _, loss = model(x, y)
            total += loss.item() * y.numel()
            count += y.numel()
    loss = total / count
    return EvalResult(loss=loss, perplexity=math.exp(min(loss, 50)), tokens=count)


def _eval_tokens(data: Path, tokenizer):
    from gptkiln.data.prepare import is_prepared, load_prepared
    from gptkiln.data.sources import iter_documents

    if is_prepared(data):
        prepared = load_prepared(data)
        if prepared.tokenizer.fingerprint() != tokenizer.fingerprint():
            same_kind = prepared.tokenizer.kind == tokenizer.kind
            raise GptkilnError(
                f"{data} was prepared with {'another' if same_kind else 'the'} "
                f"{prepared.tokenizer.kind!r} tokenizer than the run's {tokenizer.kind!r}"
                f"{' (another vocabulary)' if same_kind else ''}: its ids mean other text. Pass a "
                "text file, or prepare the data with the run's tokenizer (gptkiln prepare TEXT "
                "--tokenizer RUN_DIR --out DIR)"
            )
        return prepared.val
    ids: list[int] = []
    for i, doc_ids in enumerate(tokenizer.encode_ordinary_batch(list(iter_documents(data)))):
        if i and tokenizer.eot_id is not None:  # documents joined as `prepare` joins them
            ids.append(tokenizer.eot_id)
        ids.extend(doc_ids)
    if len(ids) < 2:
        raise GptkilnError(f"{data} has {len(ids)} token(s); evaluation needs at least 2")
    return ids
