"""`GptkilnLM`: the lm-evaluation-harness model ``gptkiln`` over the one model, answering the
harness's three kinds of request (``loglikelihood`` through `scoring.score_pairs`,
``loglikelihood_rolling`` in the harness's windows, ``generate_until`` through
`sampling.generate_batched`); `sample_config`, a task's ``generation_kwargs`` as a `SampleConfig`;
`harness`, the ``lm_eval`` module or one line saying how to install it."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

from gptkiln.errors import GptkilnError
from gptkiln.evaluate.scoring import DEFAULT_BATCH_SIZE, Pair, fit_window, score_pairs

try:  # the harness is an optional extra; `harness()` says how to install it where it is missing
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError:
    TemplateLM = object  # type: ignore[assignment,misc]

    def register_model(*names):  # type: ignore[no-redef]
        return lambda cls: cls


INSTALL = "pip install 'lm-eval>=0.4.13,<0.5' (or gptkiln's extra: pip install -e \".[eval]\")"
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


# -- the harness's model -----------------------------------------------------------------------
# Registered once, when the package is imported (`python -m gptkiln.evaluate` runs __main__.py
# after importing it; the harness's registry refuses a second class under the same name).
@register_model("gptkiln")
class GptkilnLM(TemplateLM):
    """The lm-evaluation-harness model ``gptkiln``: a run (or a Hugging Face model directory,
    or a quantized run) behind the harness's `LM` interface.

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
        """The harness's constructor for ``--model gptkiln --model_args run=RUN,...``; see
        `_harnessed`."""
        config = _harness_config(additional_config)
        return cls._harnessed(super().create_from_arg_string(arg_string, config))

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """The harness's constructor for model arguments given as a dict (what its command line
        builds in lm-eval 0.4.13); see `_harnessed`."""
        config = _harness_config(additional_config)
        return cls._harnessed(super().create_from_arg_obj(arg_dict, config))

    @staticmethod
    def _harnessed(lm: GptkilnLM) -> GptkilnLM:
        """A model the harness made: the process is an evaluation's own, so on the CPU freed
        memory is kept for reuse (`gptkiln.allocator.keep_freed_memory`, as ``gptkiln
        evaluate`` does): every batch's logits would otherwise be mapped and zero-filled
        again, page by page."""
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
        from gptkiln.cpu import exact_kernels, prepare_for_decoding

        # the library's GELU and attention (their sums are torch's up to rounding, as the hf
        # backend's); no kernels yet: `generate_until` asks for them, `release` takes them off
        with exact_kernels():  # nothing that rounds on purpose, at any row count
            self._plan = prepare_for_decoding(model, steps=0)

    def release(self) -> None:
        """Give the model back as it was before this LM (`gptkiln.cpu.DecodePlan.release`): a
        trainer's model goes on training as it was."""
        self._plan.release()

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
    def prefix_token_id(self) -> int:
        """What a text scored from its start is conditioned on: BOS where the tokenizer has one
        (as the hf backend's prefix_token_id), else end-of-text."""
        # the tokenizer's own BOS (an hf kind's), as tokenizer.bos_token_id: not config.json's
        bos = getattr(self._tokenizer, "special_tokens", {}).get("bos_token")
        if bos is not None:
            return self._tokenizer.encode_templated(bos)[0]
        return self.eot_token_id

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
    def loglikelihood(self, requests, disable_tqdm: bool = False):
        """The harness's own (it tokenizes the pairs, with a bar of its own: off as ours is)."""
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self._progress)

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
        from gptkiln.gpu import graphs_for
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
                    prepare=graphs_for(self._model) or prepare_for_decoding,
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

        from gptkiln.cpu import exact_kernels, prepare_for_decoding

        # scoring tunes nothing: what an earlier tuning gave that rounds goes
        with exact_kernels():
            self._plan = prepare_for_decoding(self._model, steps=0)
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
    ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``), its stop
    strings with the end-of-text text among them as the ``hf`` backend adds it
    (``tokenizer``'s); ``max_gen_toks`` where the task gives no length."""
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
    min_p = kwargs.pop("min_p", None) or None
    repetition = float(kwargs.pop("repetition_penalty", None) or 1.0)  # None: the default
    if kwargs.pop("num_beams", 1) != 1:
        raise GptkilnError("generation_kwargs num_beams: gptkiln has no beam search; use 1")
    if kwargs:
        raise GptkilnError(
            f"generation_kwargs {', '.join(sorted(kwargs))}: not a setting gptkiln's "
            "generation has (it takes until, max_gen_toks, do_sample, temperature, top_k, "
            "top_p, min_p, repetition_penalty); remove it from the task or --gen_kwargs"
        )
    return SampleConfig(
        max_new_tokens=int(max_new),
        temperature=temperature if do_sample else 0.0,
        top_k=None if top_k is None else int(top_k),
        top_p=None if top_p is None else float(top_p),
        min_p=None if min_p is None else float(min_p),
        repetition_penalty=repetition,
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


def _harness_config(additional_config: dict | None) -> dict:
    """The harness's settings for the model, its ``--device`` (cuda:0 unless given) the CPU
    where no CUDA is here (`_available`)."""
    config = dict(additional_config or {})
    if config.get("device") is not None:
        config["device"] = _available(config["device"])
    return config


def _available(device: str | None) -> str:
    """The device the harness's command line asks for: ``device``, but the CPU where it names
    CUDA and none is here, as the harness's own ``hf`` model does (its ``--device`` defaults to
    ``cuda:0``), saying so. (Called from Python, the model refuses such a device.)"""
    device = str(device or "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"note: --device {device}: no CUDA here, so the model runs on the CPU",
              file=sys.stderr, flush=True)  # fmt: skip
        return "cpu"
    return device
