"""The HTTP routes: validate a request (`parsing`), hand its sequences to the batcher, shape
the answer (`answers`).

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
import dataclasses
import functools
import hmac
import importlib.resources
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException

from gptkiln.chat_template import ChatTemplate
from gptkiln.config import SampleConfig
from gptkiln.errors import GptkilnError
from gptkiln.finetune.templates import PromptTemplate
from gptkiln.inspect import inspect_prompt
from gptkiln.model import GPT
from gptkiln.serve.answers import Answer, ChatAnswer, respond
from gptkiln.serve.batcher import Batcher, QueueFull
from gptkiln.serve.constrain import Grammars
from gptkiln.serve.events import Sequence
from gptkiln.serve.metrics import CONTENT_TYPE, ServeMetrics
from gptkiln.serve.parsing import (
    chat_grammar,
    chat_max_tokens,
    chat_prompt,
    check_messages,
    check_tools,
    compile_grammar,
    nth_sample,
    prompt_ids,
    refuse_unsupported,
    response_grammar,
    sample_config,
    unknown_model,
)
from gptkiln.serve.prefix_cache import DEFAULT_MAX_BYTES as DEFAULT_PREFIX_CACHE_BYTES
from gptkiln.serve.schemas import (
    MAX_INSPECT_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    InspectRequest,
    ModelCard,
    ModelList,
    OpenAIError,
    TokenizeRequest,
    parse_request,
)

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
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
    sampling_defaults: dict[str, Any] | None = None,
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
        prefix_cache_bytes: the most the prefix cache holds (`prefix_cache.PrefixCache`); 0
            turns it off.
        sampling_defaults: what a request that leaves a field of `MODEL_SAMPLING` out samples
            with (the model's generation_config.json: `config.sample.model_sampling`), as vLLM's
            ``--generation-config auto``; OpenAI's defaults for the rest.
    """
    served = Served(
        model,
        tokenizer,
        model_name,
        template,
        max_batch,
        max_queue,
        prefill_tokens,
        prefix_cache_bytes,
    )
    served.sampling_defaults = dict(sampling_defaults or {})

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await served.batcher.start()
        if served.grammars is not None:  # once the kernels are timed: never beside the timing
            served.grammars.build_soon()  # the app answers meanwhile; a grammar waits for it
        yield
        await served.batcher.stop()
        if served.grammars is not None:  # the read never left running as the process ends
            await asyncio.to_thread(served.grammars.wait_for_reading)

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
    _add_inspect_route(app, served)
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
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
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
            prefix_cache_bytes=prefix_cache_bytes,
            on_token=lambda first, seconds: self.metrics.token(first, seconds),
        )
        self.metrics = ServeMetrics(
            lambda: self.batcher.waiting,
            lambda: self.batcher.active,
            self.batcher.prefix_cache,
        )
        self.context = model.config.context_length
        self.vocab = min(model.config.vocab_size, tokenizer.vocab_size)  # ids both know
        self.grammars = Grammars(tokenizer) if Grammars.available() else None
        self.sampling_defaults: dict[str, Any] = {}  # the model's, for fields a request omits

    def sampling(self, req, prompts: list[tuple[str, list[int]]], **options) -> SampleConfig:
        """A request's `SampleConfig` (`parsing.sample_config`) for this model: its context,
        its ids, its generation_config.json's sampling for the fields the request leaves out."""
        ids = [ids for _, ids in prompts]
        return sample_config(
            req, ids, self.context, defaults=self.sampling_defaults, vocab=self.vocab, **options
        )

    def check_model(self, name: str | None) -> None:
        """A request's ``model``, when it names one, must be this one (404 otherwise)."""
        if name is not None and name != self.model_name:
            raise unknown_model(name, self.model_name)

    def submit(
        self,
        prompts: list[tuple[str, list[int]]],
        cfg: SampleConfig,
        n: int,
        *,
        logprobs: int | None = None,
        prompt_logprobs: bool = False,
        grammar: str | None = None,
    ) -> tuple[asyncio.Queue, list[Sequence]]:
        """One `Sequence` a prompt x n (sample j draws with seed + j), handed to the batcher;
        with ``grammar`` (compiled already, `parsing.compile_grammar`), each its own matcher."""
        queue: asyncio.Queue = asyncio.Queue()
        seqs = [
            Sequence(
                ids,
                nth_sample(cfg, j),
                queue,
                index=i * n + j,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                constraint=None if grammar is None else self.grammars.constraint(grammar),
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
                429,
                f"the server is busy: {e}; retry in a moment",
                code="queue_full",
                headers={"Retry-After": "1"},  # the openai client waits that long, then retries
            ) from None
        self.metrics.prompt_tokens.inc(sum(len(ids) for _, ids in prompts))
        return queue, seqs


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI-shaped JSON: ours, Starlette's (404, 405, ...) and the unexpected."""

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

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


def _add_generation_routes(app: FastAPI, served: Served) -> None:
    """``POST /v1/completions`` and ``/v1/chat/completions``."""
    tokenizer, model_name, template = served.tokenizer, served.model_name, served.template

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req: CompletionRequest = parse_request(CompletionRequest, await request.body())
        served.check_model(req.model)
        refuse_unsupported(req)
        # a long prompt takes a while to encode: off the event loop, which keeps streaming
        prompts = await asyncio.to_thread(prompt_ids, req.prompt, tokenizer, served.vocab)
        cfg = served.sampling(req, prompts)
        grammar = response_grammar(req.response_format, served.grammars)
        if grammar is not None:  # the first use of a schema compiles it: off the event loop
            await asyncio.to_thread(compile_grammar, grammar, served.grammars, "response_format")
        queue, seqs = served.submit(
            prompts,
            cfg,
            req.n,
            logprobs=req.logprobs,
            prompt_logprobs=req.echo and req.logprobs is not None,
            grammar=grammar,
        )
        return await respond(Answer(req, prompts, tokenizer, model_name), queue, seqs, request)

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
        req = req.model_copy(update={"max_tokens": chat_max_tokens(req)})
        refuse_unsupported(req)
        check_messages(req.messages)
        family = check_tools(req, template)  # None: no tool calls to read back
        tools = req.tools if req.tool_choice != "none" else None
        prompts = await asyncio.to_thread(chat_prompt, template, req.messages, tokenizer, tools)
        grammar = chat_grammar(req, family, served.grammars)
        cfg = served.sampling(
            req,
            prompts,
            # a grammar's answer ends where the grammar does: no template header may cut it
            extra_stop=template.stop_strings() if grammar is None else (),
            source="messages",
        )
        # an answer is text: a template's markers the model writes are not (vLLM's default);
        # with tools, a call's own markers may be special tokens, which the parser must see
        cfg = dataclasses.replace(cfg, skip_special_tokens=tools is None)
        if grammar is not None:
            param = "response_format" if req.response_format is not None else "tools"
            await asyncio.to_thread(compile_grammar, grammar, served.grammars, param)
        top = (req.top_logprobs or 0) if req.logprobs else None
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true; send both", "top_logprobs")
        queue, seqs = served.submit(prompts, cfg, req.n, logprobs=top, grammar=grammar)
        answer = ChatAnswer(req, prompts, tokenizer, model_name, tool_family=family)
        answer.skips_special = cfg.skip_special_tokens
        return await respond(answer, queue, seqs, request)


def _add_inspect_route(app: FastAPI, served: Served) -> None:
    """``POST /v1/inspect``: a prompt's attention weights, top-k next tokens and per-token loss
    (`gptkiln.inspect.inspect_prompt`; the page's inspect tab)."""
    tokenizer, model_name = served.tokenizer, served.model_name

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
        if req.messages is None and (req.tools or req.tool_choice):
            raise OpenAIError(400, "tools are counted with messages; send messages", "tools")
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
            check_messages(req.messages)  # as chat checks them: a tool result answers a call
            check_tools(req, served.template)
            tools = req.tools if req.tool_choice != "none" else None
            prompts = await asyncio.to_thread(
                chat_prompt, served.template, req.messages, served.tokenizer, tools
            )
        return {"count": len(prompts[0][1]), "max_model_len": served.context}


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
        """``Authorization: Bearer KEY``, the scheme's name in any case (RFC 9110)."""
        scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        ok = hmac.compare_digest(given.strip(b" "), self.api_key.encode("utf-8"))
        return ok and scheme.lower() == b"bearer"

    def _too_large(self) -> OpenAIError:
        return OpenAIError(
            413,
            f"the request body is over {self.limit:,} bytes (--max-body-bytes); send a smaller one",
            code="request_too_large",
        )


async def _reply(error: OpenAIError, scope, receive, send) -> None:
    await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
