"""The HTTP routes: validate a request, hand its sequences to the batcher, shape the answer.

``POST /v1/completions`` (OpenAI's legacy completions, streamed as server-sent events or whole),
``POST /v1/chat/completions`` (an instruction-tuned run's: the messages in its stored template),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus), ``GET /`` (the
playground page) and gptkiln's own ``POST /v1/inspect`` (a prompt's attention weights and
next-token probabilities, `gptkiln.inspect`, for the page's Inspect view) and ``POST
/v1/tokenize`` (a prompt's token count, by which the page sizes Max tokens). Every error is
OpenAI-shaped JSON (`schemas.OpenAIError`). The ASGI guard in front checks the API key and the
body size before a route sees the request. No route reads or writes a file: the page is read
from the package once, when the app is made.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import importlib.resources
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from gptkiln.chat_template import ChatTemplate, is_chat_template
from gptkiln.config import SampleConfig
from gptkiln.errors import GptkilnError
from gptkiln.finetune.templates import PromptTemplate, format_messages
from gptkiln.inspect import inspect_prompt
from gptkiln.model import GPT
from gptkiln.serve.batcher import (
    Batcher,
    Done,
    Failed,
    PromptLogprobs,
    QueueFull,
    Sequence,
    Token,
    TokenLogprobs,
)
from gptkiln.serve.metrics import CONTENT_TYPE, ServeMetrics
from gptkiln.serve.schemas import (
    MAX_INSPECT_TOKENS,
    MAX_SEED,
    MAX_STOP_STRINGS,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    ChatReply,
    Choice,
    Completion,
    CompletionRequest,
    InspectRequest,
    Logprobs,
    ModelCard,
    ModelList,
    OpenAIError,
    TokenizeRequest,
    Usage,
    parse_request,
)
from gptkiln.tokenizers import encode_prompt

DEFAULT_MAX_BODY_BYTES = 1 << 20


def create_app(
    model: GPT,
    tokenizer: Any,
    *,
    model_name: str,
    template: PromptTemplate | ChatTemplate | None = None,
    max_batch: int = 8,
    max_queue: int = 64,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    prefill_tokens: int = 512,
) -> FastAPI:
    """The server for one loaded model; uvicorn (or any ASGI server) runs it.

    Args:
        model: the GPT, in eval mode; the app's batcher owns it while the app runs.
        tokenizer: the model's tokenizer.
        model_name: the id clients give as ``model`` and `/v1/models` lists.
        template: an instruction-tuned run's prompt template (`finetune.runs.run_template`):
            with it the app answers ``POST /v1/chat/completions``; without it that is a 400.
        max_batch: sequences decoded together (KV-cache rows).
        max_queue: sequences that may wait for a row; more get 429.
        api_key: when set, every ``/v1/`` request needs ``Authorization: Bearer KEY`` (401).
        max_body_bytes: larger request bodies get 413.
        prefill_tokens: prompt tokens prefilled per decode step (see `Batcher`).
    """
    served = Served(model, tokenizer, model_name, template, max_batch, max_queue, prefill_tokens)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await served.batcher.start()
        yield
        await served.batcher.stop()

    app = FastAPI(
        title="gptkiln", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.batcher, app.state.metrics = served.batcher, served.metrics
    app.add_middleware(
        Guard, api_key=api_key, max_body_bytes=max_body_bytes, metrics=served.metrics
    )
    _add_error_handlers(app)
    _add_info_routes(app, served, api_key_required=api_key is not None)
    _add_generation_routes(app, served)
    _add_tokenize_route(app, served)
    return app


class Served:
    """What the routes share: the model, its tokenizer and template, the batcher that owns the
    model while the app runs, the metrics, and `submit`, which hands a request's sequences to
    the batcher."""

    def __init__(
        self,
        model: GPT,
        tokenizer: Any,
        model_name: str,
        template: PromptTemplate | ChatTemplate | None,
        max_batch: int,
        max_queue: int,
        prefill_tokens: int,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.model_name, self.template = model_name, template
        self.max_batch, self.max_queue = max_batch, max_queue
        self.batcher = Batcher(
            model,
            tokenizer,
            max_batch=max_batch,
            max_queue=max_queue,
            prefill_tokens=prefill_tokens,
            on_token=lambda first, seconds: self.metrics.token(first, seconds),
        )
        self.metrics = ServeMetrics(lambda: self.batcher.waiting, lambda: self.batcher.active)
        self.context = model.config.context_length
        self.vocab = min(model.config.vocab_size, tokenizer.vocab_size)  # ids both know

    def check_model(self, name: str | None) -> None:
        """A request's ``model``, when it names one, must be this one (404 otherwise)."""
        if name is not None and name != self.model_name:
            raise _unknown_model(name, self.model_name)

    def submit(
        self,
        prompts: list[tuple[str, list[int]]],
        cfg: SampleConfig,
        n: int,
        *,
        logprobs: int | None = None,
        prompt_logprobs: bool = False,
    ) -> tuple[asyncio.Queue, list[Sequence]]:
        """One `Sequence` a prompt x n (sample j draws with seed + j), handed to the batcher."""
        queue: asyncio.Queue = asyncio.Queue()
        seqs = [
            Sequence(
                ids,
                _nth_sample(cfg, j),
                queue,
                index=i * n + j,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            )
            for i, (_, ids) in enumerate(prompts)
            for j in range(n)
        ]
        if len(seqs) > self.max_batch + self.max_queue:
            raise OpenAIError(
                400,
                f"this request asks for {len(seqs)} sequences (prompts x n); the server holds at "
                f"most {self.max_batch + self.max_queue} (--max-batch + --max-queue): send fewer "
                "at once",
                param="n",
            )
        try:
            self.batcher.submit(seqs)
        except QueueFull as e:
            raise OpenAIError(
                429, f"the server is busy: {e}; retry in a moment", code="queue_full"
            ) from None
        self.metrics.prompt_tokens.inc(sum(len(ids) for _, ids in prompts))
        return queue, seqs


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI-shaped JSON: ours, Starlette's (404, 405, ...) and the unexpected."""

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {e.detail}"
        return JSONResponse(OpenAIError(e.status_code, message).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception) -> JSONResponse:
        error = OpenAIError(500, f"the server failed: {type(e).__name__}: {e}")
        return JSONResponse(error.body(), status_code=500)


def _add_info_routes(app: FastAPI, served: Served, *, api_key_required: bool) -> None:
    """``GET /`` (the playground), ``/health``, ``/metrics``, ``/v1/models[/NAME]``."""
    page = (importlib.resources.files("gptkiln.serve") / "static" / "index.html").read_bytes()
    card = ModelCard(id=served.model_name, created=int(time.time()), context_length=served.context)

    @app.get("/", include_in_schema=False)
    async def playground() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": served.model_name,
            "api_key_required": api_key_required,
            "chat": served.template is not None,  # POST /v1/chat/completions answers
            # what the page sizes its fields by: a prompt and its new tokens fit the context
            "context_length": served.context,
            "inspect_max_tokens": min(MAX_INSPECT_TOKENS, served.context),
            "max_batch": served.max_batch,
            "active": served.batcher.active,
            "waiting": served.batcher.waiting,
        }

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(served.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return ModelList(data=[card]).model_dump()

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str) -> dict[str, Any]:
        served.check_model(name)
        return card.model_dump()


async def _respond(
    answer: Answer, queue: asyncio.Queue, seqs: list[Sequence], request: Request
) -> Response:
    """The answer streamed as server-sent events, or whole once every sequence is done."""
    if answer.req.stream:
        return StreamingResponse(answer.stream(queue, seqs), media_type="text/event-stream")
    whole = await answer.whole(queue, seqs, request)
    if whole is None:  # the client went away: nobody reads this
        return Response(status_code=499)
    return JSONResponse(whole)


def _add_generation_routes(app: FastAPI, served: Served) -> None:
    """``POST /v1/completions``, ``/v1/chat/completions`` and ``/v1/inspect``."""
    tokenizer, model_name, template = served.tokenizer, served.model_name, served.template

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req: CompletionRequest = parse_request(CompletionRequest, await request.body())
        served.check_model(req.model)
        _refuse_unsupported(req)
        # a long prompt takes a while to encode: off the event loop, which keeps streaming
        prompts = await asyncio.to_thread(prompt_ids, req.prompt, tokenizer, served.vocab)
        cfg = sample_config(req, [ids for _, ids in prompts], served.context)
        queue, seqs = served.submit(
            prompts,
            cfg,
            req.n,
            logprobs=req.logprobs,
            prompt_logprobs=req.echo and req.logprobs is not None,
        )
        return await _respond(Answer(req, prompts, tokenizer, model_name), queue, seqs, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest, await request.body())
        served.check_model(req.model)
        if template is None:
            raise OpenAIError(
                400,
                f"model {model_name!r} is not instruction-tuned (its run stores no prompt "
                "template), so it cannot read chat messages: send text to POST /v1/completions, "
                "or serve a run made by gptkiln finetune",
                param="messages",
                code="not_instruction_tuned",
            )
        req = req.model_copy(update={"max_tokens": _chat_max_tokens(req)})
        prompts = await asyncio.to_thread(chat_prompt, template, req.messages, tokenizer)
        cfg = sample_config(
            req,
            [ids for _, ids in prompts],
            served.context,
            extra_stop=template.stop_strings(),
            source="messages",
        )
        queue, seqs = served.submit(prompts, cfg, req.n)
        answer = ChatAnswer(req, prompts, tokenizer, model_name)
        return await _respond(answer, queue, seqs, request)

    @app.post("/v1/inspect")
    async def inspect(request: Request) -> JSONResponse:
        req: InspectRequest = parse_request(InspectRequest, await request.body())
        served.check_model(req.model)
        if not req.prompt:
            raise OpenAIError(400, "prompt is empty; give some text to inspect", "prompt")
        if req.top_k > served.vocab:
            raise OpenAIError(
                400,
                f"top_k {req.top_k} is more than the vocabulary's {served.vocab} tokens",
                "top_k",
            )
        run = functools.partial(
            inspect_prompt,
            served.model,
            tokenizer,
            req.prompt,
            top_k=req.top_k,
            max_tokens=req.max_tokens,
        )
        try:
            found = await served.batcher.call(run)
        except GptkilnError as e:
            raise OpenAIError(400, f"prompt: {e}", "prompt") from None
        return JSONResponse({"model": model_name, **found.to_dict(decimals=4)})


def _add_tokenize_route(app: FastAPI, served: Served) -> None:
    """``POST /v1/tokenize``: a prompt's (or chat messages') token count and the context, as
    vLLM's ``/tokenize`` answers them (``count``, ``max_model_len``)."""

    @app.post("/v1/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req: TokenizeRequest = parse_request(TokenizeRequest, await request.body())
        served.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError(400, "give a prompt or messages (one of them) to count", "prompt")
        if req.messages is None:
            prompts = await asyncio.to_thread(
                prompt_ids, req.prompt, served.tokenizer, served.vocab
            )
        elif served.template is None:
            raise OpenAIError(
                400,
                f"model {served.model_name!r} is not instruction-tuned, so it has no template "
                "to put messages in: count a prompt instead",
                "messages",
                code="not_instruction_tuned",
            )
        else:
            prompts = await asyncio.to_thread(
                chat_prompt, served.template, req.messages, served.tokenizer
            )
        return {"count": len(prompts[0][1]), "max_model_len": served.context}


def _unknown_model(name: str, served: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"model {name!r} is not served here; this server serves {served!r} (GET /v1/models)",
        param="model",
        code="model_not_found",
    )


# -- a request's values, checked ---------------------------------------------------------------
def prompt_ids(prompt: Any, tokenizer: Any, vocab_size: int) -> list[tuple[str, list[int]]]:
    """Each prompt as (its text, its ids): a string or a list of strings is encoded (an empty
    string is the end-of-text token), a list of ids (or of lists) is taken as ids."""
    if isinstance(prompt, list) and not prompt:
        raise OpenAIError(400, "prompt is an empty list; give a string or token ids", "prompt")
    many = isinstance(prompt, list) and not isinstance(prompt[0], int)
    out = []
    for i, item in enumerate(prompt if many else [prompt]):
        where = f"prompt[{i}]" if many else "prompt"
        if isinstance(item, str):
            try:
                item.encode("utf-8")
                ids = encode_prompt(tokenizer, item)
            except UnicodeEncodeError:
                raise OpenAIError(
                    400, f"{where} is not valid Unicode text (a lone surrogate)", "prompt"
                ) from None
            except GptkilnError as e:
                raise OpenAIError(400, f"{where}: {e}", "prompt") from None
            out.append((item, ids))
            continue
        if not item:
            raise OpenAIError(400, f"{where} has no token ids; give at least one", "prompt")
        bad = [t for t in item if not 0 <= t < vocab_size]
        if bad:
            raise OpenAIError(
                400,
                f"{where} has token id {bad[0]}, outside the vocabulary 0..{vocab_size - 1}",
                "prompt",
            )
        out.append((tokenizer.decode(item), list(item)))
    return out


def chat_prompt(
    template: PromptTemplate | ChatTemplate, messages: list[ChatMessage], tokenizer: Any
) -> list[tuple[str, list[int]]]:
    """The one prompt of a chat request, as (its text, its ids): the messages in the run's
    template (`finetune.templates.format_messages`, as ``gptkiln chat`` formats them)."""
    try:
        text = format_messages(template, [m.model_dump() for m in messages])
    except GptkilnError as e:
        raise OpenAIError(400, str(e), "messages") from None
    try:
        text.encode("utf-8")
        templated = is_chat_template(template)  # a model's own template holds its specials
        return [(text, encode_prompt(tokenizer, text, templated=templated))]
    except UnicodeEncodeError:
        raise OpenAIError(
            400, "messages: a content is not valid Unicode text (a lone surrogate)", "messages"
        ) from None
    except GptkilnError as e:
        raise OpenAIError(400, f"messages: {e}", "messages") from None


def _chat_max_tokens(req: ChatCompletionRequest) -> int | None:
    """``max_completion_tokens`` (OpenAI's newer name) or ``max_tokens``: one budget."""
    new, old = req.max_completion_tokens, req.max_tokens
    if new is not None and old is not None and new != old:
        raise OpenAIError(
            400,
            f"max_completion_tokens {new} and max_tokens {old} disagree; they name the same "
            "budget: send one of them",
            "max_completion_tokens",
        )
    return old if new is None else new


def _refuse_unsupported(req: CompletionRequest) -> None:
    """A 400 for the completion fields this server does not honour, rather than ignoring them."""
    for name, value, allowed in (
        ("suffix", req.suffix, None),
        ("logit_bias", req.logit_bias, None),
        ("best_of", req.best_of, req.n),
    ):
        if value and value != allowed:
            raise OpenAIError(
                400,
                f"{name} is not supported by this server (got {json.dumps(value)[:80]}); "
                "leave it out",
                name,
            )


def sample_config(
    req: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    context: int,
    *,
    extra_stop: tuple[str, ...] = (),
    source: str = "prompt",
) -> SampleConfig:
    """The request's `SampleConfig`, once every prompt and its new tokens fit the context.

    Args:
        req: the parsed request (its ``max_tokens``, sampling fields and ``stop``).
        prompts: the ids of each prompt.
        context: the model's context length.
        extra_stop: stop strings added to the request's own (a template's headers).
        source: the request field the prompts came from, named in a too-long error.
    """
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS or not all(stop):
        raise OpenAIError(
            400,
            f"stop takes up to {MAX_STOP_STRINGS} non-empty strings, got {len(stop)}: "
            f"{json.dumps(stop)[:200]}",
            "stop",
        )
    longest = max(len(ids) for ids in prompts)
    if longest > context:
        raise OpenAIError(
            400,
            f"the prompt has {longest} tokens, more than the model's context of {context}; it "
            f"would have to be cropped, which this server does not do: shorten the {source}",
            source,
            code="context_length_exceeded",
        )
    new = context - longest if req.max_tokens is None else req.max_tokens
    if longest + new > context:
        raise OpenAIError(
            400,
            f"the prompt's {longest} tokens plus max_tokens {new} exceed the model's context of "
            f"{context}; lower max_tokens to at most {context - longest} or shorten the {source}",
            "max_tokens",
            code="context_length_exceeded",
        )
    try:
        return SampleConfig(
            max_new_tokens=new,
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            seed=req.seed,
            stop=tuple(dict.fromkeys([*stop, *extra_stop])),
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
        )
    except GptkilnError as e:
        raise OpenAIError(400, str(e)) from None


def _nth_sample(cfg: SampleConfig, j: int) -> SampleConfig:
    """The j-th sample of a prompt draws with seed + j: sample 0 is the prompt run alone."""
    if cfg.seed is None or j == 0:
        return cfg
    return SampleConfig(**{**cfg.__dict__, "seed": (cfg.seed + j) % (MAX_SEED + 1)})


# -- the answer --------------------------------------------------------------------------------
@dataclass
class Collected:
    """A request's events, gathered for a whole (not streamed) answer; keys are choice indexes."""

    texts: dict[int, str]
    tokens: dict[int, list[tuple[int, TokenLogprobs | None]]]
    prompt_scores: dict[int, list[TokenLogprobs | None]]
    reasons: dict[int, str]
    used: int = 0


class Answer:
    """Turns a completion request's events into OpenAI's ``text_completion`` objects, whole or
    as chunks. The event loops (`whole`, `stream`) are shared with `ChatAnswer`; the shapes
    (`_shape`, `_opening`, `_chunks`, `_usage_chunk`) are each answer's own."""

    prefix = "cmpl"

    def __init__(self, req: CompletionRequest, prompts, tokenizer: Any, model_name: str) -> None:
        self.req, self.prompts, self.tokenizer = req, prompts, tokenizer
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model_name = model_name
        self.offsets: dict[int, int] = {}  # a streamed choice's text so far, for logprobs

    def _completion(self, choices: list[Choice], usage: Usage | None = None) -> dict[str, Any]:
        return Completion(
            id=self.id,
            created=self.created,
            model=self.model_name,
            choices=choices,
            usage=usage,
        ).model_dump(exclude_none=False)

    def _prompt_of(self, index: int) -> tuple[str, list[int]]:
        return self.prompts[index // self.req.n]

    def _usage(self, completion_tokens: int) -> Usage:
        prompt_tokens = sum(len(ids) for _, ids in self.prompts)
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )

    def _logprobs(
        self, ids: list[int], scored: list[TokenLogprobs | None], offset: int = 0
    ) -> Logprobs:
        """OpenAI's logprobs object for tokens ``ids`` whose text starts at ``offset``."""
        out = Logprobs()
        for token, entry in zip(ids, scored):
            text = self.tokenizer.decode([token])
            out.tokens.append(text)
            out.token_ids.append(token)
            out.text_offset.append(offset)
            offset += len(text)
            if entry is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                out.top_token_ids.append(None)
                continue
            out.token_logprobs.append(entry.logprob)
            top: dict[str, float] = {}
            for alt, lp in entry.top:
                top.setdefault(self.tokenizer.decode([alt]), lp)
            out.top_logprobs.append(top)
            out.top_token_ids.append([alt for alt, _ in entry.top])
        return out

    async def whole(self, queue: asyncio.Queue, seqs: list[Sequence], request: Request):
        """Wait for every choice; None if the client left first (that cancels them)."""
        got = Collected(
            texts={s.index: "" for s in seqs},
            tokens={s.index: [] for s in seqs},
            prompt_scores={},
            reasons={},
        )
        watcher = asyncio.create_task(_watch_disconnect(request, queue))
        try:
            while len(got.reasons) < len(seqs):
                event = await queue.get()
                if event is None:  # the client went away
                    return None
                if isinstance(event, Failed):
                    raise OpenAIError(500, event.message)
                if isinstance(event, PromptLogprobs):
                    got.prompt_scores[event.index] = event.entries
                elif isinstance(event, Token):
                    got.texts[event.index] += event.text
                    got.tokens[event.index].append((event.id, event.logprobs))
                elif isinstance(event, Done):
                    got.texts[event.index] += event.text
                    got.reasons[event.index] = event.reason
                    got.used += event.tokens
        finally:
            watcher.cancel()
            for seq in seqs:
                seq.cancelled = True  # a no-op for those done
        return self._shape(got, sorted(s.index for s in seqs))

    def _shape(self, got: Collected, indexes: list[int]) -> dict[str, Any]:
        """The whole ``text_completion``: each choice's text (after the prompt with ``echo``),
        its logprobs when asked, its finish_reason; the usage."""
        choices = []
        for i in indexes:
            prompt_text, prompt = self._prompt_of(i)
            head = prompt_text if self.req.echo else ""
            logprobs = None
            if self.req.logprobs is not None:
                ids = [t for t, _ in got.tokens[i]]
                scored = [lp for _, lp in got.tokens[i]]
                if self.req.echo:
                    scored = got.prompt_scores.get(i, [None] * len(prompt)) + scored
                    ids = prompt + ids
                logprobs = self._logprobs(ids, scored)
            choices.append(
                Choice(
                    text=head + got.texts[i],
                    index=i,
                    logprobs=logprobs,
                    finish_reason=got.reasons[i],
                )
            )
        return self._completion(choices, self._usage(got.used))

    async def stream(self, queue: asyncio.Queue, seqs: list[Sequence]) -> AsyncIterator[str]:
        """Server-sent events: the opening chunks, the chunks of each event, the usage if asked,
        then ``[DONE]``. A client that leaves closes this generator, which cancels the choices
        still running."""
        left = len(seqs)
        used = 0
        try:
            for chunk in self._opening(seqs):
                yield chunk
            while left:
                event = await queue.get()
                if isinstance(event, Failed):
                    yield _sse(OpenAIError(500, event.message).body())
                    return
                if isinstance(event, Done):
                    left -= 1
                    used += event.tokens
                for chunk in self._chunks(event):
                    yield chunk
            options = self.req.stream_options
            if options is not None and options.include_usage:
                yield self._usage_chunk(self._usage(used))
            yield "data: [DONE]\n\n"
        finally:
            for seq in seqs:
                seq.cancelled = True

    def _opening(self, seqs: list[Sequence]) -> Iterator[str]:
        """With ``echo``, each prompt first (with its logprobs, they come as an event)."""
        self.offsets = {s.index: 0 for s in seqs}
        if self.req.echo:
            for seq in seqs:
                text, _ = self._prompt_of(seq.index)
                self.offsets[seq.index] = len(text)
                if self.req.logprobs is None:
                    yield self._chunk(Choice(text=text, index=seq.index))

    def _chunks(self, event: PromptLogprobs | Token | Done) -> Iterator[str]:
        """A chunk a token (its text may be "" while held back), a last one per choice with
        its finish_reason (and the text held back until then)."""
        if isinstance(event, PromptLogprobs):
            text, prompt = self._prompt_of(event.index)
            lp = self._logprobs(prompt, event.entries)
            yield self._chunk(Choice(text=text, index=event.index, logprobs=lp))
        elif isinstance(event, Token):
            lp = None
            if event.logprobs is not None:
                lp = self._logprobs([event.id], [event.logprobs], self.offsets[event.index])
            self.offsets[event.index] += len(event.text)
            yield self._chunk(Choice(text=event.text, index=event.index, logprobs=lp))
        elif isinstance(event, Done):
            yield self._chunk(
                Choice(text=event.text, index=event.index, finish_reason=event.reason)
            )

    def _usage_chunk(self, usage: Usage) -> str:
        return _sse(self._completion([], usage))

    def _chunk(self, choice: Choice) -> str:
        return _sse(self._completion([choice]))


class ChatAnswer(Answer):
    """The same events in OpenAI's chat shapes: a ``chat.completion`` whose choices hold an
    assistant ``message``, or ``chat.completion.chunk`` events whose ``delta`` is the role
    first, then content pieces, then ``{}`` with the finish_reason."""

    prefix = "chatcmpl"

    def _shape(self, got: Collected, indexes: list[int]) -> dict[str, Any]:
        choices = [
            ChatChoice(
                index=i, message=ChatReply(content=got.texts[i]), finish_reason=got.reasons[i]
            )
            for i in indexes
        ]
        return ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model_name,
            choices=choices,
            usage=self._usage(got.used),
        ).model_dump()

    def _opening(self, seqs: list[Sequence]) -> Iterator[str]:
        for seq in seqs:
            yield self._delta(ChatChunkChoice(index=seq.index, delta={"role": "assistant"}))

    def _chunks(self, event: PromptLogprobs | Token | Done) -> Iterator[str]:
        """A content piece a token whose text is out (none while a stop string may begin);
        at the end, the text held back until then and the finish_reason."""
        if isinstance(event, Token | Done) and event.text:
            yield self._delta(ChatChunkChoice(index=event.index, delta={"content": event.text}))
        if isinstance(event, Done):
            yield self._delta(
                ChatChunkChoice(index=event.index, delta={}, finish_reason=event.reason)
            )

    def _usage_chunk(self, usage: Usage) -> str:
        return self._delta(None, usage)

    def _delta(self, choice: ChatChunkChoice | None, usage: Usage | None = None) -> str:
        chunk = ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model_name,
            choices=[] if choice is None else [choice],
            usage=usage,
        )
        return _sse(chunk.model_dump())


async def _watch_disconnect(request: Request, queue: asyncio.Queue) -> None:
    """Look 4 times a second whether the client of a whole (not streamed) answer went away;
    then wake its handler with None. (A stream notices by itself: Starlette closes it.)"""
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)
    queue.put_nowait(None)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# -- the guard in front: key, body size, request counts ---------------------------------------
class Guard:
    """ASGI middleware: counts every answer by route and status; asks ``/v1/`` requests for the
    API key (401); reads the body up to ``max_body_bytes`` (413 beyond) and hands it on."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, metrics: ServeMetrics):
        self.app, self.api_key, self.limit, self.metrics = app, api_key, max_body_bytes, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]

        async def counted_send(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.answered(path, message["status"])
            await send(message)

        if self.api_key is not None and path.startswith("/v1/") and not self._authorized(scope):
            error = OpenAIError(
                401,
                "a valid API key is required: send the header 'Authorization: Bearer KEY' "
                "with the key the server was started with (--api-key)",
                code="invalid_api_key",
            )
            return await _reply(error, scope, receive, counted_send)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"").decode("latin-1")
        if declared.isdigit() and int(declared) > self.limit:
            return await _reply(self._too_large(), scope, receive, counted_send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                return await _reply(self._too_large(), scope, receive, counted_send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        started = False

        async def tracked_send(message) -> None:
            nonlocal started
            started = True
            await counted_send(message)

        try:
            await self.app(scope, replay, tracked_send)
        except Exception:  # Starlette's outermost layer answers 500 and logs it
            if not started:
                self.metrics.answered(path, 500)
            raise

    def _authorized(self, scope) -> bool:
        given = dict(scope["headers"]).get(b"authorization", b"")
        expected = b"Bearer " + self.api_key.encode("utf-8")
        return hmac.compare_digest(given, expected)

    def _too_large(self) -> OpenAIError:
        return OpenAIError(
            413,
            f"the request body is over {self.limit:,} bytes (--max-body-bytes); send a smaller one",
            code="request_too_large",
        )


async def _reply(error: OpenAIError, scope, receive, send) -> None:
    await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
