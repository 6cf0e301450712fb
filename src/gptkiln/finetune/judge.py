"""Scoring a fine-tuned run's answers with a larger model as the judge: the book's section 7.8
(there Llama 3 through Ollama), against any OpenAI-compatible endpoint (``POST
{url}/chat/completions``: OpenAI, vLLM, Ollama's ``/v1``, another ``gptkiln serve``).

For each test entry the run answers (greedy, all entries batched through gptkiln's own
generation, `gptkiln.api.complete`), then the judge is asked the book's question: given the
input, the correct output and the model's response, a score from 0 to 100, "the integer number
only". An answer that is a number in [0, 100] is the entry's score; any other answer is counted
as unparsed and kept as it came (never fatal). The run's score is the mean of the scores.

The judge is a client, not a model: requests run concurrently, each retried with exponential
backoff on a connection error, a timeout, a 408, a 429 or a 5xx. A request that fails for its own
entry (a 400 such as a context-length error, a reply that is not a chat completion) is that
entry's failure, kept with its reason while the others go on, as Inspect and lm-eval keep a
sample's error; a judge that never answers, refuses the key or has no such URL or model stops the
judging in one line, since every request would fail the same way.

The command's pipeline (the run's answers, the verdict written and kept) is
`gptkiln.finetune.judging`'s.
"""

from __future__ import annotations

import json
import math
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gptkiln.errors import GptkilnError

BOOK_PROMPT = (
    "Given the input `{input}` and correct output `{output}`, score the model response "
    "`{response}` on a scale from 0 to 100, where 100 is the best score. Respond with the "
    "integer number only."
)
"""The book's question to the judge (section 7.8), with ``{input}`` (the entry's prompt as the
run's template writes it, without the response header), ``{output}`` and ``{response}``."""

PLACEHOLDERS = ("{input}", "{output}", "{response}")
REASONING = re.compile(r"^\s*<think>.*?</think>", re.S)  # a thinking model's preamble
_SCORE = re.compile(r"\s*(\d{1,3}(?:\.\d+)?)\s*(?:/\s*100)?\s*\.?\s*")


@dataclass
class Judge:
    """Where and how to ask the judge.

    Attributes:
        url: the endpoint's base URL (``http://localhost:11434/v1``): requests go to
            ``{url}/chat/completions``.
        model: the judge model's name at that endpoint.
        prompt: the question, with ``{input}``, ``{output}`` and ``{response}``.
        key: sent as ``Authorization: Bearer KEY`` when given.
        timeout: seconds a request may take.
        retries: further attempts after a failed one, waiting 1, 2, 4, ... x ``backoff`` s.
        backoff: the first wait, in seconds.
        concurrency: requests in flight at once.
        max_tokens: the longest answer asked for (None: the endpoint's default).
    """

    url: str
    model: str
    prompt: str = BOOK_PROMPT
    key: str | None = field(default=None, repr=False)
    timeout: float = 60.0
    retries: int = 3
    backoff: float = 1.0
    concurrency: int = 4
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise GptkilnError(f"--judge-url {self.url}: give an http:// or https:// URL")
        missing = [p for p in PLACEHOLDERS if p not in self.prompt]
        if missing:
            raise GptkilnError(
                f"the judge's prompt lacks {', '.join(missing)}; write each of "
                f"{', '.join(PLACEHOLDERS)} in it once"
            )
        if self.concurrency < 1 or self.retries < 0 or not 0 < self.timeout < math.inf:
            raise GptkilnError(
                "--concurrency must be >= 1, --retries >= 0 and --timeout a number > 0, got "
                f"{self.concurrency}, {self.retries} and {self.timeout}"
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise GptkilnError(
                f"--judge-max-tokens must be >= 1 (the judge's answer holds the score), got "
                f"{self.max_tokens}"
            )

    def question(self, input: str, output: str, response: str) -> str:
        # the prompt's placeholders filled in one pass: a placeholder's name inside a text
        # ("{output}" in an instruction about format strings) stays that text
        values = {"{input}": input, "{output}": output, "{response}": response}
        return _PLACEHOLDER.sub(lambda m: values[m.group(0)], self.prompt)


_PLACEHOLDER = re.compile(r"\{input\}|\{output\}|\{response\}")


def parse_score(answer: str) -> float | None:
    """The score of a judge's answer: a number in [0, 100] (``85``, ``85.5``, ``85/100``),
    after the reasoning block a thinking model writes first (Qwen3's ``<think>...</think>``),
    else None (unparsed)."""
    answer = REASONING.sub("", answer, count=1)
    match = _SCORE.fullmatch(answer)
    if match is None:
        return None
    score = float(match.group(1))
    return score if 0 <= score <= 100 else None


@dataclass
class Entry:
    """One judged test entry."""

    input: str
    output: str
    response: str | None  # the run's answer; None until it is given (`judging.NOT_ANSWERED`)
    answer: str | None = None  # the judge's, as it came
    score: float | None = None  # None: the answer was not a number in [0, 100], or none came
    error: str | None = None  # why the judge gave no answer (`RequestFailed`)


@dataclass
class Verdict:
    """The judged entries, and their mean score over those the judge scored."""

    entries: list[Entry]

    @property
    def scored(self) -> int:
        return sum(e.score is not None for e in self.entries)

    @property
    def unparsed(self) -> int:
        return sum(e.score is None and e.error is None for e in self.entries)

    @property
    def failed(self) -> int:
        return sum(e.error is not None for e in self.entries)

    @property
    def mean(self) -> float | None:
        scores = [e.score for e in self.entries if e.score is not None]
        return sum(scores) / len(scores) if scores else None

    def summary(self) -> dict[str, Any]:
        return {
            "mean": self.mean,
            "scored": self.scored,
            "unparsed": self.unparsed,
            "failed": self.failed,
            "entries": len(self.entries),
        }

    def notes(self, path: str | os.PathLike) -> list[str]:
        """What a reader of the mean should know: the requests that failed (how many, the
        first reason), and a judge none of whose answers was a score (so there is no mean)."""
        n, out = len(self.entries), []
        failed = [(i, e) for i, e in enumerate(self.entries, start=1) if e.error is not None]
        if failed:
            i, first = failed[0]
            out.append(
                f"{len(failed)} of {n} judge requests failed: their score is null, the reason "
                f"kept in {path}; the first, entry {i}: {first.error}"
            )
        unparsed = [(i, e) for i, e in enumerate(self.entries, start=1) if e.answer is not None]
        if unparsed and self.scored == 0:
            i, first = unparsed[0]
            fix = (
                "use a judge model that follows the prompt (--judge-model), or a prompt that "
                "asks for the number alone (--prompt-file)"
            )
            if first.answer.lstrip().startswith("<think>") and "</think>" not in first.answer:
                fix = "the judge's reasoning was cut: give it room with --judge-max-tokens"
            out.append(
                f"none of the judge's {len(unparsed)} answers is a score (a number from 0 to 100 "
                f"alone), so there is no mean; entry {i}'s was {first.answer[:120]!r}: {fix}"
            )
        return out


class RequestFailed(GptkilnError):
    """A request that failed for its own entry (the judge refused it, or its reply is not a
    chat completion): that entry's failure, the judging goes on."""


_TRANSIENT = (408, 429)  # and 5xx: retried with backoff


def ask(judge: Judge, question: str, client) -> str:
    """The judge's answer to ``question``, retried with backoff on a transient failure.

    Raises:
        RequestFailed: the request failed for its own sake (a 4xx other than those of the
            key or the URL, such as a context-length 400; a reply that is not a chat completion).
        GptkilnError: the judge can answer no request (it never answered; it refused the key;
            no such URL or model): one line that says what to fix.
    """
    import httpx

    headers = {"Authorization": f"Bearer {judge.key}"} if judge.key else {}
    body = {
        "model": judge.model,
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
    }
    if judge.max_tokens is not None:
        body["max_tokens"] = judge.max_tokens
    url = judge.url.rstrip("/") + "/chat/completions"
    why = ""
    for attempt in range(judge.retries + 1):
        if attempt:
            time.sleep(judge.backoff * 2 ** (attempt - 1))
        try:
            reply = client.post(url, json=body, headers=headers, timeout=judge.timeout)
        except httpx.HTTPError as e:
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            continue
        if reply.status_code in _TRANSIENT or reply.status_code >= 500:
            why = f"HTTP {reply.status_code}"
            continue
        if reply.status_code != 200:
            raise _refusal(judge, url, reply)
        return _content(reply)
    raise GptkilnError(
        f"the judge at {url} did not answer after {judge.retries + 1} "
        f"attempt{'s' if judge.retries else ''} ({why}); check "
        "--judge-url and that the server runs"
    )


def _refusal(judge: Judge, url: str, reply) -> GptkilnError:
    """The error of a 4xx reply: the key's (401, 403) and the URL's or model's (404) stop the
    judging; any other (a 400: too long a question, a field the server refuses) is the entry's."""
    from urllib.parse import urlsplit

    code, said = reply.status_code, _said(reply)
    if code in (401, 403):
        fix = (
            "no key was sent: name the environment variable that holds it with --judge-key-env VAR"
            if judge.key is None
            else "check the key (in the variable --judge-key-env names; OPENAI_API_KEY for "
            "openai.com)"
        )
        return GptkilnError(f"the judge at {url} refused the key (HTTP {code}: {said}); {fix}")
    if code == 404:
        path = urlsplit(judge.url).path.rstrip("/")
        if path.endswith("/chat/completions"):
            fix = "give --judge-url without /chat/completions (the base URL, ending in /v1)"
        elif "/v1" not in path:
            fix = (
                "check --judge-url: OpenAI-compatible base URLs end in /v1, e.g. "
                "http://localhost:11434/v1"
            )
        else:
            fix = f"check --judge-url and --judge-model ({judge.model!r}: served there?)"
        return GptkilnError(
            f"the judge at {url} has no such endpoint or model (HTTP 404: {said}); {fix}"
        )
    return RequestFailed(f"the judge refused the request (HTTP {code}: {said})")


def _said(reply) -> str:
    """The server's words in an error reply: OpenAI's ``{"error": {"message"}}``, a plain
    ``{"error"}``, vLLM's ``{"message"}`` or FastAPI's ``{"detail"}``, else the reply's start."""
    try:
        said = reply.json()
        error = said.get("error")
        message = error.get("message") if isinstance(error, dict) else error
        message = message or said.get("message") or said.get("detail")
    except (ValueError, AttributeError):
        message = None
    text = message if isinstance(message, str) and message.strip() else reply.text
    return repr(text[:200])


def _content(reply) -> str:
    """The text of an OpenAI chat completion; a reply of another shape is `RequestFailed`."""
    try:
        content = reply.json()["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise RequestFailed(
            f"the judge answered {reply.text[:200]!r}, not an OpenAI chat completion (an "
            "OpenAI-compatible base URL ends in /v1)"
        ) from None
    return content if isinstance(content, str) else json.dumps(content)


def judge_entries(
    judge: Judge,
    entries: Sequence[Entry],
    progress: bool = True,
    client=None,
    on_judged: Callable[[], None] | None = None,
    kept: int = 0,
) -> Verdict:
    """Each entry's answer and score from the judge, ``judge.concurrency`` at a time. Each
    answer is set in the calling thread as it comes, then ``on_judged()`` is called (so the
    entries can be written while the others are asked); a stop (Ctrl-C, a judge gone) sends
    no more requests and waits for none, the answers that came before it set. ``kept``:
    entries judged before, counted by the progress bar as done."""
    import httpx
    from tqdm.auto import tqdm

    own = client is None
    client = client or httpx.Client()
    bar = tqdm(
        total=kept + len(entries), initial=kept, desc="judging", unit="entry", disable=not progress
    )

    def one(entry: Entry) -> tuple[str | None, str | None]:  # (answer, error)
        question = judge.question(entry.input, entry.output, entry.response)
        try:
            return ask(judge, question, client), None
        except RequestFailed as e:  # this entry's: the others go on
            return None, str(e)

    asking = _Asking(one, entries, judge.concurrency)
    try:
        for entry, answered in asking:
            _set_answer(entry, answered)
            bar.update(1)
            if on_judged is not None:
                on_judged()
    finally:
        for entry, answered in asking.stop():  # after a stop: those that came, not yet set
            _set_answer(entry, answered)
        bar.close()
        if own:
            client.close()
    return Verdict(list(entries))


class _Asking:
    """``one(entry)`` for each entry on ``workers`` daemon threads, iterated as the results
    come (a worker's exception raised here). `stop` starts no more and waits for none: a
    request in flight ends on its own thread, which does not hold the process at its exit (a
    ThreadPoolExecutor's threads are joined there, so a Ctrl-C waited out the judge's
    --timeout, and a second one printed a traceback)."""

    def __init__(self, one: Callable[[Entry], Any], entries: Sequence[Entry], workers: int):
        self.todo, self.done, self.left = queue.SimpleQueue(), queue.SimpleQueue(), len(entries)
        self.stopped = threading.Event()
        for entry in entries:
            self.todo.put(entry)

        def work() -> None:
            while not self.stopped.is_set():
                try:
                    entry = self.todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    self.done.put((entry, one(entry), None))
                except BaseException as e:  # raised in the caller's thread
                    self.done.put((entry, None, e))

        for _ in range(min(workers, len(entries))):
            threading.Thread(target=work, name="gptkiln-judge", daemon=True).start()

    def __iter__(self):
        while self.left:
            entry, result, error = self.done.get()
            self.left -= 1
            if error is not None:
                raise error
            yield entry, result

    def stop(self) -> list[tuple[Entry, Any]]:
        """Start no more; the results that came and were not taken."""
        self.stopped.set()
        came = []
        while True:
            try:
                entry, result, error = self.done.get_nowait()
            except queue.Empty:
                return came
            if error is None:
                came.append((entry, result))


def _set_answer(entry: Entry, answered: tuple[str | None, str | None]) -> None:
    """The judge's (answer, error) about ``entry``, and its score, set."""
    entry.answer, entry.error = answered
    entry.score = None if entry.answer is None else parse_score(entry.answer)


def check_judge(judge: Judge, client=None) -> None:
    """One short question to the judge before the run answers the test entries (minutes to
    hours): a judge that can answer no request (down, its key refused, no such URL or model)
    is its one line now, not after the answering. A refusal of this question alone (a 400)
    is left to the entries' own requests."""
    import httpx

    own = client is None
    client = client or httpx.Client()
    try:
        ask(judge, judge.question("Repeat the word: ok", "ok", "ok"), client)  # its own prompt
    except RequestFailed:
        pass
    finally:
        if own:
            client.close()
