"""Library functions behind the CLI subcommands that work on a trained model: generate and
perplexity, and info's (`gptkiln.info.run_info`, given here too).

`prepare` is `gptkiln.data.prepare.prepare`, `train` is `gptkiln.train.train`, `convert` and
`download` live in `gptkiln.convert`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gptkiln.config import SampleConfig
from gptkiln.errors import GptkilnError
from gptkiln.info import RunInfo, run_info  # gptkiln info's, part of the Python API here
from gptkiln.model import GPT
from gptkiln.tokenizers import leading_ids

__all__ = [
    "Completion",
    "PerplexityResult",
    "RunInfo",
    "complete",
    "generate_text",
    "perplexity_of_model",
    "perplexity_of_run",
    "run_info",
    "stream_from_model",
    "stream_text",
]


def stream_text(
    run_dir: str | os.PathLike,
    prompt: str,
    cfg: SampleConfig | None = None,
    *,
    device: str = "cpu",
    on_notice: Callable[[str], None] | None = None,
    input: str = "",
    raw: bool = False,
    quantize: str | None = None,
    precision: str | None = None,
    **overrides,
) -> Iterator[str]:
    """Yield the generated text piece by piece as tokens are chosen. ``overrides`` set
    `SampleConfig` fields, as `gptkiln.generate`'s do (``max_new_tokens=20``).

    The text ends at end-of-text or right before a stop string of ``cfg.stop``. An empty prompt
    starts from the end-of-text token (unconditional generation). A prompt longer than the model's
    context keeps its last ``context_length`` tokens, and past the context the window slides (each
    new token sees the last ``context_length``; a Llama 3 BOS stays first, `sampling.kept_ids`); the
    ``on_notice`` callback (if given) is told either. ``quantize="int8"`` quantizes the weights on
    load (`gptkiln.loading.load_model`). ``precision`` (``fp32``, ``bf16``, ``int8``; None: the
    run's own) is what a CPU decodes at (`gptkiln.cpu.ready_for_decoding`); ``on_notice`` is told
    which, first. Without ``cfg``, the run's generation_config.json sets the sampling ``overrides``
    leave out (`_with_model_sampling`; ``on_notice`` is told).

    An instruction-tuned run (`gptkiln finetune`, or a model with its own chat template,
    `gptkiln.chat_template`) takes ``prompt`` as the instruction and ``input`` as its input,
    formatted with the run's stored template (`finetune.templates`);
    the text is the response alone, which also ends where the model starts a part of the
    template (``### Instruction:`` ...). ``raw`` sends ``prompt`` as it is.
    """
    from gptkiln.chat_template import is_chat_template
    from gptkiln.finetune.runs import run_template
    from gptkiln.finetune.templates import format_prompt
    from gptkiln.loading import check_language_model
    from gptkiln.sampling import sample_config

    cfg = sample_config(
        cfg, _with_model_sampling(run_dir, cfg, overrides, on_notice), "stream_text"
    )
    _check_texts([prompt], "stream_text")
    model, tokenizer, run_cfg, precision = load_for_decoding(run_dir, device, quantize, precision)
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
    templated = is_chat_template(template)
    yield from stream_from_model(
        model, tokenizer, prompt, cfg, run_dir, on_notice, templated=templated, precision=precision
    )


def stream_from_model(
    model,
    tokenizer,
    prompt: str,
    cfg: SampleConfig,
    source: str | os.PathLike = "the model",
    on_notice: Callable[[str], None] | None = None,
    *,
    templated: bool = False,
    precision: str | None = None,
) -> Iterator[str]:
    """`stream_text` for a model already loaded (``source`` names it in messages): the text
    of one sequence through `text_stream.TextStream`, which `generate`, `chat` and the
    fine-tuning samples all read. ``templated``: ``prompt`` was rendered by the model's chat
    template (`gptkiln.tokenizers.encode_prompt`)."""
    from gptkiln.sampling import generate_stream, kept_ids
    from gptkiln.text_stream import TextStream, hidden_ids, stop_ids_of

    was_training = model.training
    model.eval()
    ids = _prompt_ids(
        model, tokenizer, prompt, source, on_notice, templated=templated, new=cfg.max_new_tokens
    )
    _say_precision(model, precision, on_notice)
    ends = stop_ids_of(tokenizer)  # every id that ends a turn (Llama 3 Instruct has several)
    hidden = hidden_ids(tokenizer, cfg.skip_special_tokens)
    stream = TextStream(tokenizer.decode, cfg.stop, ends if cfg.stop_at_eos else None, hidden)
    try:
        for _ in generate_stream(
            model,
            [ids],
            cfg,
            ends,
            streams=[stream],
            prepare=_decoding(model, precision),
            keep=kept_ids(tokenizer, [ids], model.config.context_length),
        ):
            if piece := stream.take():
                yield piece
        if tail := stream.flush():  # it ended inside a character, or by length: what is held back
            yield tail
    finally:
        model.clear_cache()
        model.train(was_training)


def _prompt_ids(
    model: GPT,
    tokenizer: Any,
    prompt: str,
    run: Any,
    on_notice: Callable[[str], None] | None,
    which: str = "prompt",
    templated: bool = False,
    new: int = 0,
) -> list[int]:
    """A prompt's ids (an empty one: end-of-text), checked against the model's vocabulary; the
    notice says when it is longer than the context, or when it and its ``new`` tokens pass the
    context, where the window slides (``which`` names it there).

    Past the context this library slides the window (the book's ``generate``); the server
    refuses instead (OpenAI's ``context_length_exceeded``), so its clients never get text the
    model wrote without seeing the whole prompt."""
    from gptkiln.loading import check_ids_fit
    from gptkiln.tokenizers import encode_prompt

    ids = encode_prompt(tokenizer, prompt, templated=templated)
    check_ids_fit(max(ids), model, tokenizer, run)
    ctx = model.config.context_length
    if on_notice is None or len(ids) + new <= ctx:  # nothing to say: the window never slides
        return ids
    seen = window_seen(tokenizer, ids, ctx)
    if len(ids) > ctx:
        on_notice(
            f"{which} has {len(ids)} tokens, more than the model's context of {ctx}; keeping {seen}"
        )
    else:
        on_notice(
            f"{which}'s {len(ids)} tokens and up to {new} new ones pass the model's context of "
            f"{ctx}: past it the window slides, each new token seeing {seen} (as the book's "
            "generate does; gptkiln serve refuses such a request instead)"
        )
    return ids


def window_seen(tokenizer: Any, ids: Sequence[int], ctx: int) -> str:
    """What a window of ``ctx`` over ``ids`` holds, in words: the last ``ctx`` ids, or the ids
    kept first (Llama 3's BOS, llama.cpp's n_keep: `sampling.kept_ids`) and the last others."""
    from gptkiln.sampling import kept_ids

    keep = kept_ids(tokenizer, [ids], ctx)
    return (
        f"{tokenizer.decode(ids[:keep])} and the last {ctx - keep}" if keep else f"the last {ctx}"
    )


@dataclass
class Completion:
    """One generated sample of `complete`.

    Attributes:
        prompt_index: which prompt it continues (from 0, in the order given).
        prompt: that prompt.
        index: the sample's number among that prompt's samples (from 0).
        seed: the seed it was drawn with (``cfg.seed + index``); None when unseeded.
        text: the generated text, without the prompt; it ends right before a stop string.
        token_ids: the generated ids, as transformers' ``generate`` and vLLM give them: an
            end-of-text id that ended the sample is the last (its text is none); when a stop
            string ended it, they run to the token that completed it (whose text is cut).
        finish_reason: ``"stop"`` (end-of-text or a stop string) or ``"length"``
            (``max_new_tokens`` reached), OpenAI's names.
    """

    prompt_index: int
    prompt: str
    index: int
    seed: int | None
    text: str
    token_ids: list[int]
    finish_reason: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def complete(
    run_or_model: str | os.PathLike | GPT,
    prompts: str | Sequence[str],
    cfg: SampleConfig | None = None,
    *,
    num_samples: int = 1,
    tokenizer: Any = None,
    batch_size: int = 32,
    device: str = "cpu",
    on_notice: Callable[[str], None] | None = None,
    quantize: str | None = None,
    templated: bool = False,
    precision: str | None = None,
    on_batch: Callable[[list[Completion]], None] | None = None,
    **overrides,
) -> list[Completion]:
    """``num_samples`` samples for each prompt, generated together in batches. ``overrides``
    set `SampleConfig` fields, as `gptkiln.generate`'s do (``max_new_tokens=20``).

    Sample ``j`` of a prompt is drawn from its own generator seeded with ``cfg.seed + j``, so
    sample 0 is what the prompt gives alone with ``cfg.seed``, and no sample depends on the
    others in its batch (unseeded, the batch takes one draw from torch's global generator).
    Greedy samples (temperature 0) are those of each prompt alone.

    Args:
        run_or_model: a run directory (or an imported Hugging Face one), or a `GPT` (then
            ``tokenizer`` is needed, and ``device`` is the model's own).
        prompts: the texts to continue, or one text (not its characters as prompts; an empty
            one starts from end-of-text).
        cfg: how to sample, and when a sample ends (``stop`` strings, ``max_new_tokens``).
        num_samples: samples per prompt (>= 1).
        tokenizer: the tokenizer of a `GPT` given as ``run_or_model``.
        batch_size: samples generated at once (>= 1); the KV cache grows with it.
        device: where a run is loaded.
        on_notice: told when a prompt is longer than the model's context (its start is cut),
            or when it and ``cfg.max_new_tokens`` pass the context (the window slides).
        quantize: "int8" quantizes a run's weights as it loads (`gptkiln.loading.load_model`);
            a `GPT` given is used as it is (quantize it with `gptkiln.quantize.quantize_model`).
        precision: what a CPU decodes at, ``fp32``, ``bf16`` or ``int8`` (None: the weights'
            own; `gptkiln.cpu.ready_for_decoding`).
        templated: the prompts were rendered by the model's chat template and hold their own
            special tokens (`gptkiln.tokenizers.encode_prompt`).
        on_batch: told each batch's samples as soon as the batch is done, in order (the
            caller's thread), so they can be kept before the rest are (`gptkiln judge` does).

    Without ``cfg``, a run's generation_config.json sets the sampling settings
    ``overrides`` leave out (as transformers' ``generate`` and ``gptkiln generate`` take them:
    `_with_model_sampling`); a ``cfg`` given is used as it is.

    Returns:
        The samples, prompt by prompt, each prompt's in order of ``index``.
    """
    from gptkiln.sampling import generate_batched, sample_config

    cfg = sample_config(
        cfg, _with_model_sampling(run_or_model, cfg, overrides, on_notice), "complete"
    )
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    _check_completing(prompts, cfg, num_samples, batch_size)
    model, tokenizer, precision = _model_and_tokenizer(
        run_or_model, tokenizer, device, quantize, precision
    )
    source = "the model" if isinstance(run_or_model, GPT) else run_or_model
    ids = [
        _prompt_ids(
            model, tokenizer, p, source, on_notice, f"prompt {i + 1}", templated, cfg.max_new_tokens
        )
        for i, p in enumerate(prompts)
    ]
    _say_precision(model, precision, on_notice)
    rows = [(i, j) for i in range(len(prompts)) for j in range(num_samples)]
    made = functools.partial(_completion, prompts, rows, cfg.seed)

    def told(batch: range, done: list) -> None:
        on_batch([made(r, stream) for r, stream in zip(batch, done, strict=True)])

    streams = generate_batched(
        model,
        [ids[i] for i, _ in rows],
        cfg,
        tokenizer,
        batch_size=batch_size,
        row_seeds=None if cfg.seed is None else [cfg.seed + j for _, j in rows],
        prepare=_decoding(model, precision),
        on_batch=None if on_batch is None else told,
    )
    return [made(r, stream) for r, stream in enumerate(streams)]


def _completion(
    prompts: list[str], rows: list[tuple[int, int]], seed: int | None, row: int, stream
) -> Completion:
    """`complete`'s row ``row`` (``rows[row]``: prompt i's sample j), its stream done."""
    i, j = rows[row]
    return Completion(
        prompt_index=i,
        prompt=prompts[i],
        index=j,
        seed=None if seed is None else seed + j,
        text=stream.text,
        token_ids=[*stream.ids, *(() if stream.end is None else (stream.end,))],
        finish_reason=stream.finish_reason,
    )


def _with_model_sampling(
    run: Any,
    cfg: SampleConfig | None,
    overrides: dict[str, Any],
    on_notice: Callable[[str], None] | None,
) -> dict[str, Any]:
    """``overrides`` and, where no ``cfg`` is given, what a run's generation_config.json sets
    of the sampling they leave out (`config.sample.model_sampling`: Qwen3's temperature 0.6, top-k
    20, top-p 0.95), as transformers' ``generate`` takes a model's generation config for the
    settings its call does not give; ``on_notice`` is told which. A `GPT` has no such file."""
    if cfg is not None or isinstance(run, GPT):
        return overrides
    from gptkiln.config.sample import model_sampling, sampling_said

    taken = {k: v for k, v in model_sampling(run).items() if k not in overrides}
    if taken and on_notice is not None:
        said = sampling_said(taken)
        on_notice(
            f"sampling as {run}'s generation_config.json sets it: {said} (an argument overrides it)"
        )
    return {**taken, **overrides}


def _check_completing(prompts: list, cfg: SampleConfig, num_samples, batch_size) -> None:
    """`complete`'s own settings, refused in one line each before anything loads."""
    for name, value in (("num_samples", num_samples), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise GptkilnError(f"{name} must be a whole number >= 1, got {value!r}")
    if not prompts:
        raise GptkilnError("no prompts to complete; give at least one (an empty one is allowed)")
    _check_texts(prompts, "complete")
    if cfg.seed is not None and cfg.seed + num_samples - 1 >= 2**63:
        raise GptkilnError(
            f"seed {cfg.seed} + num_samples - 1 is past 2**63 - 1, the largest seed; "
            "give a smaller seed"
        )


def _check_texts(prompts: list, caller: str) -> None:
    """Prompts of the text-level functions are text: token ids are one line pointing to the
    functions that take them."""
    for n, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            where = "the prompt" if len(prompts) == 1 else f"prompt {n + 1}"
            raise GptkilnError(
                f"{caller}() takes text, and {where} is a {type(prompt).__name__}; for token "
                "ids use gptkiln.generate(model, ids) (gptkiln.loading.load_run gives the model)"
            )


def load_for_decoding(
    run_dir: str | os.PathLike,
    device: str,
    quantize: str | None = None,
    precision: str | None = None,
):
    """`gptkiln.loading.load_run` for decoding at ``precision`` (None: the run's own; ``int8``
    quantizes a float run as it loads): (model, tokenizer, run config, the precision)
    (`gptkiln.cpu.ready_for_decoding`)."""
    from gptkiln.cpu import loading_quantize, ready_for_decoding
    from gptkiln.loading import load_run

    model, tokenizer, run_cfg = load_run(
        run_dir, device=device, quantize=loading_quantize(quantize, precision)
    )
    precision = ready_for_decoding(model, precision, device, run_dir)
    return model, tokenizer, run_cfg, precision


def _say_precision(model, precision: str | None, on_notice) -> None:
    """Tell ``on_notice`` what a CPU decodes at, once the prompts are checked (an error stays
    one line)."""
    if on_notice is not None and precision is not None and model.wte.weight.device.type == "cpu":
        on_notice(precision_notice(precision))


def precision_notice(precision: str) -> str:
    """The one line that says what a CPU decodes at, and how to choose another."""
    from gptkiln.cpu import specs

    what = {
        "fp32": "fp32 (exact)",
        "bf16": "bf16 (bf16 weights, fp32 activations)",
        "int8": "int8 (int8 weights, 8-bit activations, as llama.cpp's q8_0)",
    }[precision]
    weight = "int8" if precision == "int8" else "float32"
    if precision != "fp32" and specs.precision_for(weight, precision) != precision:
        what = (
            "fp32 (exact)" if precision == "bf16" else "int8 (int8 weights, fp32 activations)"
        ) + (
            f": {precision}'s own loop cannot run here (no compiled kernel library, a CPU "
            "without its instructions, or GPTKILN_EXACT_KERNELS=1)"
        )
    return f"decoding at {what}; --precision fp32, bf16 or int8 chooses"


def _decoding(model, precision: str | None):
    """The decode backend's set-up `sampling.generate_stream` calls after a first token: on the
    CPU, `gptkiln.cpu.prepare_for_decoding` at ``precision`` (None: the model's own); on CUDA,
    `gptkiln.gpu.prepare_graphs` for a float model (CUDA graphs; an int8 one decodes eagerly);
    elsewhere none. On the CPU at a precision that rounds (bf16, int8) the model is planned at
    once, untuned: the prompt's prefill rounds as the steps after it do, on a first call as on
    a later one."""
    if model.wte.weight.device.type != "cpu":
        from gptkiln.gpu import graphs_for

        return graphs_for(model)
    from gptkiln.cpu import default_precision, prepare_for_decoding

    if (precision or default_precision(model)) != "fp32":
        prepare_for_decoding(model, steps=0, precision=precision)

    def prepare(model, rows: int, steps: int):
        return prepare_for_decoding(model, rows, steps, precision=precision)

    return prepare


def _model_and_tokenizer(
    run_or_model: Any,
    tokenizer: Any,
    device: str,
    quantize: str | None,
    precision: str | None = None,
) -> tuple[GPT, Any, str | None]:
    if isinstance(run_or_model, GPT):
        if tokenizer is None:
            raise GptkilnError("complete(model, ...) needs the model's tokenizer: tokenizer=...")
        if quantize is not None:
            raise GptkilnError(
                f"complete(model, ..., quantize={quantize!r}): quantize= applies to a run as it "
                "loads; quantize a built model with gptkiln.quantize.quantize_model first"
            )
        return run_or_model, tokenizer, precision
    model, tokenizer, _, precision = load_for_decoding(run_or_model, device, quantize, precision)
    return model, tokenizer, precision


def generate_text(
    run_dir: str | os.PathLike,
    prompt: str,
    cfg: SampleConfig | None = None,
    *,
    device: str = "cpu",
    quantize: str | None = None,
    precision: str | None = None,
    **overrides,
) -> str:
    """The prompt followed by the generated text; ``overrides`` as `stream_text`'s."""
    pieces = stream_text(
        run_dir, prompt, cfg, device=device, quantize=quantize, precision=precision, **overrides
    )
    return prompt + "".join(pieces)


@dataclass
class PerplexityResult:
    """A model's loss on text, and its perplexity and bits per character (`perplexity_of_run`).

    Attributes:
        loss: mean cross-entropy per token, in nats.
        perplexity: ``exp(loss)``.
        tokens: the target tokens scored.
        characters: the characters of the text those tokens are (a document separator counts
            one; see `Tokenizer.char_counts`).
        bits_per_char: the summed loss over ``characters``, in bits: comparable across
            tokenizers, unlike ``loss``.
    """

    loss: float
    perplexity: float
    tokens: int
    characters: int
    bits_per_char: float


def perplexity_of_run(
    run_dir: str | os.PathLike,
    data: str | os.PathLike,
    *,
    batch_size: int = 8,
    device: str = "cpu",
    progress: bool = True,
    quantize: str | None = None,
    text_field: str = "text",
) -> PerplexityResult:
    """Cross-entropy, perplexity and bits per character of a model on text.

    Args:
        data: a prepared data directory (its validation split is used) or a text/jsonl file,
            tokenized with the run's tokenizer (each document begun as the tokenizer begins a
            text: Llama 3's BOS first), every token after the first scored once
            (`perplexity_of_model`); the characters counted are those of the targets scored.
        quantize: "int8" quantizes the weights on load (`gptkiln.loading.load_model`).
        text_field: the JSON key or column of a ``data`` file that holds the text.
    """
    import numpy as np

    from gptkiln.loading import check_ids_fit, check_language_model, load_run

    if batch_size < 1:
        raise GptkilnError(f"batch_size must be >= 1, got {batch_size}")
    model, tokenizer, _ = load_run(run_dir, device=device, quantize=quantize)
    check_language_model(model, run_dir)
    tokens = eval_tokens(data, tokenizer, text_field=text_field)
    if len(tokens):
        check_ids_fit(int(np.max(tokens)), model, tokenizer, run_dir)
    return perplexity_of_model(model, tokens, tokenizer, batch_size=batch_size, progress=progress)


def perplexity_of_model(
    model: torch.nn.Module, tokens, tokenizer, *, batch_size: int = 8, progress: bool = False
) -> PerplexityResult:
    """Cross-entropy, perplexity and bits per character of a built model over token ids (a
    sequence or a 1-D array) of ``tokenizer``, on the model's device: every id after the first
    is scored once, over non-overlapping context windows and, for the ids a last whole window
    leaves, one more window ending at the last id (its earlier targets ignored: the tail is
    scored with a full context, as lm-eval's rolling windows score it). A target that is the
    tokenizer's own leading token (Llama 3's BOS, which `eval_tokens` puts before each
    document) is not scored: it is not text, and it always follows an end of text."""
    import numpy as np
    from tqdm.auto import tqdm

    from gptkiln.data.windows import SlidingWindowDataset
    from gptkiln.train import bits_per_char

    model.eval()
    device = model.ln_f.weight.device
    tokens = np.asarray(tokens)
    T = min(model.config.context_length, len(tokens) - 1)
    dataset = SlidingWindowDataset(tokens, T, T)
    lead = [i for i in leading_ids(tokenizer) if i != tokenizer.eot_id]  # (an end is text's)
    char_counts = torch.tensor(tokenizer.char_counts())
    total, count, chars = 0.0, 0, 0

    def score(x: torch.Tensor, y: torch.Tensor) -> None:
        nonlocal total, count, chars
        if lead:
            y = y.masked_fill(torch.isin(y, torch.tensor(lead)), -100)
        scored = y != -100
        n = int(scored.sum())
        if n:
            _, loss = model(x.to(device), y.to(device))
            total += loss.item() * n
            count += n
            chars += int(char_counts[y[scored]].sum())

    with torch.no_grad():
        for start in tqdm(range(0, len(dataset), batch_size), disable=not progress, unit="batch"):
            xs, ys = zip(*(dataset[i] for i in range(start, min(start + batch_size, len(dataset)))))
            score(torch.stack(xs), torch.stack(ys))
        left = len(tokens) - 1 - len(dataset) * T  # targets past the last whole window
        if left > 0:
            # a copy: a prepared split is a read-only memmap
            tail = torch.from_numpy(np.array(tokens[-T - 1 :], dtype=np.int64))
            y = tail[1:].clone()
            y[: T - left] = -100  # scored by the windows before
            score(tail[None, :-1], y[None])
    loss = total / count
    return PerplexityResult(
        loss=loss,
        perplexity=math.exp(min(loss, 50)),
        tokens=count,
        characters=chars,
        bits_per_char=bits_per_char(loss, count, chars),
    )


def eval_tokens(data: str | os.PathLike, tokenizer, *, text_field: str = "text"):
    """The ids `perplexity_of_run` scores: a prepared directory's validation split (its tokenizer
    must be ``tokenizer``), or a text/jsonl file's documents (their ``text_field``) encoded and
    joined as `prepare` joins them, each begun with the ids the tokenizer puts before a text
    (`leading_ids`)."""
    from gptkiln.data.prepare import is_prepared, load_prepared
    from gptkiln.data.sources import iter_documents

    if is_prepared(data) and text_field != "text":  # its text was read when it was prepared
        raise GptkilnError(
            f"--text-field {text_field}: --data {data} is prepared data, its text read already; "
            "drop --text-field, or pass the text file"
        )
    if is_prepared(data):  # else a source as prepare takes it (a path, hf:NAME, shakespeare)
        prepared = load_prepared(data)
        if prepared.tokenizer.fingerprint() != tokenizer.fingerprint():
            same_kind = prepared.tokenizer.kind == tokenizer.kind
            raise GptkilnError(
                f"{data} was prepared with a {prepared.tokenizer.kind!r} tokenizer"
                f"{' of another vocabulary' if same_kind else ''}, not the run's "
                f"{tokenizer.kind!r} one: its ids mean other text. Pass a "
                "text file, or prepare the data with the run's tokenizer (gptkiln prepare TEXT "
                "--tokenizer RUN_DIR --out DIR)"
            )
        return prepared.val
    import numpy as np

    from gptkiln.data.encoding import encoded_batches
    from gptkiln.data.prepare import BATCH_CHARS

    # each document starts as the tokenizer starts a text, and documents are joined as
    # `prepare` joins them (one end of text between two); the ids as arrays, a batch of
    # documents at a time: a list of Python ints took about 64 bytes a token
    lead = np.array(leading_ids(tokenizer), dtype=np.int64)
    end = [] if tokenizer.eot_id is None else [tokenizer.eot_id]
    between = np.array(end + [t for t in lead.tolist() if t not in end], dtype=np.int64)
    documents = iter_documents(data, text_field=text_field)
    parts: list[np.ndarray] = []
    for _, arrays in encoded_batches(documents, tokenizer, BATCH_CHARS, text=lambda doc: doc):
        for doc_ids in arrays:
            parts += [between if parts else lead, doc_ids.astype(np.int64, copy=False)]
    ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if len(ids) < 2:
        raise GptkilnError(f"{data} has {len(ids)} token(s); evaluation needs at least 2")
    return ids
