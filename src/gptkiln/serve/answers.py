"""The answer: a request's events from the batcher shaped into OpenAI's objects, whole
(``text_completion``, ``chat.completion``) or streamed as server-sent chunks."""

from __future__ import annotations

import asyncio
import codecs
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gptkiln.serve.events import Done, Failed, PromptLogprobs, Sequence, Token, TokenLogprobs
from gptkiln.serve.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    ChatReply,
    Choice,
    Completion,
    CompletionRequest,
    Logprobs,
    OpenAIError,
    PromptTokensDetails,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
)
from gptkiln.serve.tools import content_text, parse_tool_calls, settled_content


async def respond(
    answer: Answer, queue: asyncio.Queue, seqs: list[Sequence], request: Request
) -> Response:
    """The answer streamed as server-sent events, or whole once every sequence is done."""
    if answer.req.stream:
        return StreamingResponse(answer.stream(queue, seqs), media_type="text/event-stream")
    whole = await answer.whole(queue, seqs, request)
    if whole is None:  # the client went away: nobody reads this
        return Response(status_code=499)
    return JSONResponse(whole)


@dataclass
class Collected:
    """A request's events, gathered for a whole (not streamed) answer; keys are choice indexes."""

    texts: dict[int, str]
    tokens: dict[int, list[tuple[int, TokenLogprobs | None]]]
    prompt_scores: dict[int, list[TokenLogprobs | None]]
    reasons: dict[int, str]
    seqs: list[Sequence]
    used: int = 0


class Scores:
    """A choice's scored tokens, each with where its text begins in the choice's text, given
    out once the text given out reaches them: the tokens of a stop string, and the end-of-text
    token, are past the text and never given out, so the tokens given out spell the text.

    A token's place counts the characters its bytes before it complete (a UTF-8 decoder fed
    token by token): a token inside a character (byte-level BPE) begins where that character
    does, as the text, which holds the character once, has it."""

    def __init__(self, tokenizer: Any, hidden: frozenset[int] = frozenset()) -> None:
        self.tokenizer = tokenizer
        self._hidden = hidden  # ids the text leaves out (skip_special_tokens): no characters
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._at = 0  # characters the tokens added so far complete
        self._shown = 0  # characters of text given out
        self._pending: list[tuple[int, TokenLogprobs | None, int]] = []

    def add(self, token: int, entry: TokenLogprobs | None) -> None:
        self._pending.append((token, entry, self._at))
        if token in self._hidden:
            return
        self._at += len(self._decoder.decode(self.tokenizer.token_bytes(token)))

    def release_all(self, text: str) -> list[tuple[int, TokenLogprobs | None, int]]:
        """Every token added so far, an echoed prompt's, whose text is ``text``: its ids may
        decode to more (a BOS the tokenizer adds, the end-of-text of an empty prompt), so their
        offsets are counted back from the end of ``text`` (a token before it at 0), and the
        tokens after start at its end."""
        extra = self._at - len(text)
        out = [(t, e, max(0, at - extra)) for t, e, at in self._pending]
        self._pending, self._at, self._shown = [], len(text), len(text)
        return out

    def release(self, text: str, done: bool = False) -> list[tuple[int, TokenLogprobs | None, int]]:
        """The tokens whose text begins within the text given out, now ``text`` more; at the
        end (``done``) the rest are dropped."""
        self._shown += len(text)
        ready = 0
        while ready < len(self._pending) and self._pending[ready][2] < self._shown:
            ready += 1
        out, self._pending = self._pending[:ready], [] if done else self._pending[ready:]
        return out


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
        self.scores: dict[int, Scores] = {}  # a streamed choice's tokens, when scored
        self.skips_special = False  # the text leaves special tokens out (cfg's; chat sets it)

    def _hidden(self) -> frozenset[int]:
        from gptkiln.text_stream import hidden_ids

        return hidden_ids(self.tokenizer, self.skips_special)

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

    def _usage(self, completion_tokens: int, seqs: list[Sequence]) -> Usage:
        """The tokens of each prompt (once, whatever ``n``), those of it the prefix cache held
        (the most any of its samples found), and those generated."""
        prompt_tokens = sum(len(ids) for _, ids in self.prompts)
        cached: dict[int, int] = {}
        for seq in seqs:
            prompt = seq.index // self.req.n
            cached[prompt] = max(cached.get(prompt, 0), seq.cached)
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached.values())),
        )

    def _logprobs(self, scored: list[tuple[int, TokenLogprobs | None, int]]) -> Logprobs:
        """OpenAI's logprobs object for tokens given out by `Scores` (id, scores, offset)."""
        out = Logprobs()
        for token, entry, offset in scored:
            out.tokens.append(self.tokenizer.decode([token]))
            out.token_ids.append(token)
            out.text_offset.append(offset)
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

    def _scores(
        self,
        tokens: list[tuple[int, TokenLogprobs | None]],
        text: str,
        prompt: list[tuple[int, TokenLogprobs | None]] = (),
        prompt_text: str = "",
    ) -> list:
        """A whole choice's tokens whose text begins in ``text`` (`Scores`), after the echoed
        ``prompt``'s tokens (``prompt_text``), all of them."""
        scores = Scores(self.tokenizer, self._hidden())
        for token, entry in prompt:
            scores.add(token, entry)
        echoed = scores.release_all(prompt_text)
        for token, entry in tokens:
            scores.add(token, entry)
        return echoed + scores.release(text, done=True)

    async def whole(self, queue: asyncio.Queue, seqs: list[Sequence], request: Request):
        """Wait for every choice; None if the client left first (that cancels them)."""
        got = Collected(
            texts={s.index: "" for s in seqs},
            tokens={s.index: [] for s in seqs},
            prompt_scores={},
            reasons={},
            seqs=seqs,
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
                echoed = []
                if self.req.echo:
                    entries = got.prompt_scores.get(i, [None] * len(prompt))
                    echoed = list(zip(prompt, entries, strict=True))
                scored = self._scores(got.tokens[i], got.texts[i], echoed, head)
                logprobs = self._logprobs(scored)
            choices.append(
                Choice(
                    text=head + got.texts[i],
                    index=i,
                    logprobs=logprobs,
                    finish_reason=got.reasons[i],
                )
            )
        usage = self._usage(got.used, got.seqs)
        return _timed(self._completion(choices, usage), got.seqs, usage)

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
                yield self._usage_chunk(self._usage(used, seqs), seqs)
            yield "data: [DONE]\n\n"
        finally:
            for seq in seqs:
                seq.cancelled = True

    def _opening(self, seqs: list[Sequence]) -> Iterator[str]:
        """With ``echo``, each prompt first (with its logprobs, they come as an event)."""
        if self.req.logprobs is not None:
            self.scores = {s.index: Scores(self.tokenizer, self._hidden()) for s in seqs}
        if self.req.echo and self.req.logprobs is None:
            for seq in seqs:
                yield self._chunk(Choice(text=self._prompt_of(seq.index)[0], index=seq.index))

    def _chunks(self, event: PromptLogprobs | Token | Done) -> Iterator[str]:
        """A chunk a token (its text may be "" while held back; its scores once its text is
        out), a last one per choice with its finish_reason (and the text held back until
        then)."""
        if isinstance(event, PromptLogprobs):
            text, prompt = self._prompt_of(event.index)
            scores = self.scores[event.index]
            for token, entry in zip(prompt, event.entries, strict=True):
                scores.add(token, entry)
            lp = self._logprobs(scores.release_all(text))
            yield self._chunk(Choice(text=text, index=event.index, logprobs=lp))
        elif isinstance(event, Token | Done):
            lp = None
            scores = self.scores.get(event.index)
            if scores is not None:
                if isinstance(event, Token):
                    scores.add(event.id, event.logprobs)
                ready = scores.release(event.text, done=isinstance(event, Done))
                lp = self._logprobs(ready) if ready else None
            reason = event.reason if isinstance(event, Done) else None
            yield self._chunk(
                Choice(text=event.text, index=event.index, logprobs=lp, finish_reason=reason)
            )

    def _usage_chunk(self, usage: Usage, seqs: list[Sequence]) -> str:
        return _sse(_timed(self._completion([], usage), seqs, usage))

    def _chunk(self, choice: Choice) -> str:
        return _sse(self._completion([choice]))


class ChatAnswer(Answer):
    """The same events in OpenAI's chat shapes: a ``chat.completion`` whose choices hold an
    assistant ``message``, or ``chat.completion.chunk`` events whose ``delta`` is the role
    first, then content pieces, then ``{}`` with the finish_reason. Each token's
    log-probabilities in OpenAI's chat shape when asked (``logprobs.content``). With tools in
    play (``tool_family``), the answer's tool calls are read back into ``tool_calls``
    (`tools.parse_tool_calls`; the first alone with ``parallel_tool_calls: false``); a stream
    then sends its content as soon as no call can begin in it (`tools.settled_content`) and
    holds the rest until the end, when it sends the content left and each call (its id and
    name, then its arguments): its content pieces add up to the whole answer's content."""

    prefix = "chatcmpl"

    def __init__(self, req, prompts, tokenizer: Any, model_name: str, *, tool_family=None):
        super().__init__(req, prompts, tokenizer, model_name)
        self.tool_family = tool_family
        self.held: dict[int, str] = {}  # a streamed choice's text so far, with tools
        self.sent: dict[int, int] = {}  # how much of it went out (as `tools.content_text`)

    def _shape(self, got: Collected, indexes: list[int]) -> dict[str, Any]:
        choices = []
        for i in indexes:
            content, calls, reason = self._read_calls(got.texts[i], got.reasons[i])
            logprobs = None
            if self.req.logprobs:
                scored = self._scores(got.tokens[i], got.texts[i])
                logprobs = ChatLogprobs(content=[self._scored(t, lp) for t, lp, _ in scored])
            reply = ChatReply(content=content, tool_calls=calls or None)
            choices.append(
                ChatChoice(index=i, message=reply, logprobs=logprobs, finish_reason=reason)
            )
        usage = self._usage(got.used, got.seqs)
        whole = ChatCompletion(
            id=self.id, created=self.created, model=self.model_name, choices=choices, usage=usage
        )
        return _timed(whole.model_dump(), got.seqs, usage)

    def _read_calls(self, text: str, reason: str) -> tuple[str | None, list[ToolCall], str]:
        """(content, tool calls, finish_reason) of a choice's whole text."""
        if self.tool_family is None:
            return text, [], reason
        names = [t.function.name for t in self.req.tools or []]
        content, calls = parse_tool_calls(self.tool_family, text, names)
        if self.req.parallel_tool_calls is False:
            calls = calls[:1]  # at most one call a turn, as OpenAI's
        return content, calls, "tool_calls" if calls and reason == "stop" else reason

    def _scored(self, token: int, entry: TokenLogprobs | None) -> TokenLogprob:
        """One token in OpenAI's chat logprobs shape: its text, bytes and alternatives."""
        assert entry is not None  # a generated token is always scored when asked
        top = [
            TopLogprob(
                token=self.tokenizer.decode([alt]),
                logprob=lp,
                bytes=list(self.tokenizer.token_bytes(alt)),
            )
            for alt, lp in entry.top
        ]
        return TokenLogprob(
            token=self.tokenizer.decode([token]),
            logprob=entry.logprob,
            bytes=list(self.tokenizer.token_bytes(token)),
            top_logprobs=top,
        )

    def _opening(self, seqs: list[Sequence]) -> Iterator[str]:
        if self.req.logprobs:
            self.scores = {s.index: Scores(self.tokenizer, self._hidden()) for s in seqs}
        for seq in seqs:
            yield self._delta(ChatChunkChoice(index=seq.index, delta={"role": "assistant"}))

    def _chunks(self, event: PromptLogprobs | Token | Done) -> Iterator[str]:
        """A content piece a token whose text is out (none while a stop string may begin;
        with logprobs, one a token, its scores with it); at the end, the text held back until
        then and the finish_reason."""
        if self.tool_family is not None:
            yield from self._tool_chunks(event)
            return
        scored = None
        scores = self.scores.get(event.index) if isinstance(event, Token | Done) else None
        if scores is not None:
            if isinstance(event, Token):
                scores.add(event.id, event.logprobs)
            ready = scores.release(event.text, done=isinstance(event, Done))
            if ready:
                scored = ChatLogprobs(content=[self._scored(t, lp) for t, lp, _ in ready])
        if isinstance(event, Token | Done) and (event.text or scored is not None):
            delta = {"content": event.text}
            yield self._delta(ChatChunkChoice(index=event.index, delta=delta, logprobs=scored))
        if isinstance(event, Done):
            yield self._delta(
                ChatChunkChoice(index=event.index, delta={}, finish_reason=event.reason)
            )

    def _tool_chunks(self, event: PromptLogprobs | Token | Done) -> Iterator[str]:
        """With tools: a content piece once no call can begin in it (its tokens' scores with
        it), the rest held; at the end the content left, the calls, the finish_reason."""
        if not isinstance(event, Token | Done):
            return
        i = event.index
        text = self.held[i] = self.held.get(i, "") + event.text
        scores = self.scores.get(i)
        if isinstance(event, Done):
            yield from self._tool_end(i, event.reason, scores)
            return
        if scores is not None:
            scores.add(event.id, event.logprobs)
        sent = self.sent.get(i, 0)
        piece = text[sent : settled_content(self.tool_family, text)]
        if piece:
            self.sent[i] = sent + len(piece)
            logprobs = None
            if scores is not None:
                logprobs = ChatLogprobs(
                    content=[self._scored(t, lp) for t, lp, _ in scores.release(piece)]
                )
            shown = content_text(self.tool_family, piece)  # a <|python_tag|> left out
            if shown or logprobs is not None:
                delta = {"content": shown}
                yield self._delta(ChatChunkChoice(index=i, delta=delta, logprobs=logprobs))

    def _tool_end(self, i: int, reason: str, scores: Scores | None) -> Iterator[str]:
        """The whole text read (`_read_calls`): the content not yet sent (what was sent begins
        it, `tools.settled_content`), each call (its id and name, then its arguments), the
        finish_reason."""
        text, sent = self.held.pop(i), self.sent.pop(i, 0)
        content, calls, reason = self._read_calls(text, reason)
        rest = (content or "")[len(content_text(self.tool_family, text[:sent])) :]
        logprobs = None
        if scores is not None:
            scored = scores.release(text[sent:], done=True)
            logprobs = ChatLogprobs(content=[self._scored(t, lp) for t, lp, _ in scored])
        if rest or logprobs is not None:
            delta = {"content": rest}
            yield self._delta(ChatChunkChoice(index=i, delta=delta, logprobs=logprobs))
        for k, call in enumerate(calls):
            head = {"index": k, "id": call.id, "type": "function"}
            named = {**head, "function": {"name": call.function.name, "arguments": ""}}
            args = {"index": k, "function": {"arguments": call.function.arguments}}
            yield self._delta(ChatChunkChoice(index=i, delta={"tool_calls": [named]}))
            yield self._delta(ChatChunkChoice(index=i, delta={"tool_calls": [args]}))
        yield self._delta(ChatChunkChoice(index=i, delta={}, finish_reason=reason))

    def _usage_chunk(self, usage: Usage, seqs: list[Sequence]) -> str:
        chunk = ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model_name, choices=[], usage=usage
        )
        return _sse(_timed(chunk.model_dump(), seqs, usage))

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


def _timed(body: dict[str, Any], seqs: list[Sequence], usage: Usage) -> dict[str, Any]:
    """``body`` (a whole answer, or a stream's usage chunk) with the request's ``timings``, as
    llama.cpp's server adds them (its field names), measured where the tokens are handed out:
    ``prompt_n`` the prompt tokens prefilled (those the prefix cache held left out) and
    ``prompt_ms`` the time from the request's arrival to its first token (waiting for a row
    included); ``predicted_n`` the tokens generated and ``predicted_ms`` the time from the first
    token to the last; ``predicted_per_second`` the decode rate, the tokens after each choice's
    first over that time (null where there are none, or no time: one token each), what the
    page's tokens/s shows. None of it where no token came."""
    firsts = [s.first_token_at for s in seqs if s.first_token_at is not None]
    if not firsts:
        return body
    submitted = min(s.submitted for s in seqs)
    first, last = min(firsts), max(s.last_token_at for s in seqs if s.last_token_at is not None)
    after = usage.completion_tokens - len(firsts)
    span = last - first
    body["timings"] = {
        "prompt_n": usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens,
        "prompt_ms": round((first - submitted) * 1000, 3),
        "predicted_n": usage.completion_tokens,
        "predicted_ms": round(span * 1000, 3),
        "predicted_per_second": round(after / span, 3) if after > 0 and span > 0 else None,
    }
    return body


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
