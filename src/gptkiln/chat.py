"""``gptkiln chat``: a conversation with an instruction-tuned run, in a terminal or over stdin.

`Chat` keeps the turns and formats each prompt with the run's stored template
(`finetune.templates.format_conversation`), or the model's own chat template
(`gptkiln.chat_template`) when it was not fine-tuned by gptkiln; responses stream through the same
`api.stream_from_model` as ``gptkiln generate``. `run_chat` is the terminal around it: a line
is a message; ``/reset`` forgets the conversation, ``/exit`` (or end of input) leaves; Ctrl-C
stops a response and keeps the chat going.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from collections.abc import Iterator
from typing import TextIO

from gptkiln.config import SampleConfig
from gptkiln.errors import GptkilnError

COMMANDS = "/reset forgets the conversation, /exit (or Ctrl-D) leaves, Ctrl-C stops a response"


class Chat:
    """A conversation with an instruction-tuned run.

    Each `reply` sends the conversation so far (oldest turns dropped first when it would not
    leave room in the context for ``cfg.max_new_tokens``) and records the turn, also when the
    response was stopped early.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        cfg: SampleConfig,
        *,
        device: str = "cpu",
        precision: str | None = None,
    ):
        from gptkiln.api import load_for_decoding
        from gptkiln.chat_template import is_chat_template
        from gptkiln.finetune.runs import require_template

        self.run_dir, self.device = run_dir, device
        self.model, self.tokenizer, run_cfg, self.precision = load_for_decoding(
            run_dir, device, precision=precision
        )
        self.template = require_template(run_cfg, run_dir)
        self.templated = is_chat_template(self.template)  # its text holds its special tokens
        stop = tuple(cfg.stop) + self.template.stop_strings()
        # a reply is text: a template's markers the model writes (``<|im_start|>``) are not
        self.cfg = SampleConfig(**{**cfg.__dict__, "stop": stop, "skip_special_tokens": True})
        self.turns: list[tuple[str, str]] = []
        self.on_notice = lambda text: print(f"note: {text}", file=sys.stderr, flush=True)
        self._said: set[str] = set()  # notes said once a chat (the precision, a window sliding)

    def note_once(self, text: str) -> None:
        """Say ``text`` unless a note of its kind was said (numbers aside: the window slides
        at every long turn, with another count each time)."""
        kind = re.sub(r"[0-9][0-9,]*", "N", text)
        if kind not in self._said:
            self._said.add(kind)
            self.on_notice(text)

    def reset(self) -> None:
        self.turns.clear()

    def prompt(self, message: str) -> str:
        """The text the model continues for ``message``, with as many earlier turns as fit."""
        from gptkiln.api import window_seen
        from gptkiln.finetune.templates import format_conversation
        from gptkiln.tokenizers import encode_prompt

        context = self.model.config.context_length
        # room for the answer: --max-new-tokens, at most half the context (a longer answer
        # slides its window anyway), so that a model of a short context keeps some history
        room = context - min(self.cfg.max_new_tokens, context // 2)
        turns = list(self.turns)
        while True:
            text = format_conversation(self.template, turns, message)
            ids = encode_prompt(self.tokenizer, text, templated=self.templated)
            length = len(ids)
            if length <= room or not turns:
                if len(turns) < len(self.turns):
                    self.note_once(
                        f"the conversation has outgrown the model's context of {context} tokens: "
                        "its earliest turns are left out, more as it goes on (/reset starts "
                        "afresh)"
                    )
            if length <= room:
                return text
            if not turns:  # the message alone: past the context, its start is cut
                if length > context:
                    self.on_notice(
                        f"your message in its template is {length} tokens, past the model's "
                        f"context of {context}: the model sees "
                        f"{window_seen(self.tokenizer, ids, context)}"
                    )
                return text
            turns.pop(0)

    def reply(self, message: str) -> Iterator[str]:
        """The response to ``message``, piece by piece."""
        from gptkiln.api import stream_from_model

        pieces: list[str] = []
        stream = stream_from_model(
            self.model,
            self.tokenizer,
            self.prompt(message),
            self.cfg,
            self.run_dir,
            self.note_once,
            templated=self.templated,
            precision=self.precision,
        )
        try:
            with contextlib.closing(stream):  # a stopped response frees the KV cache at once
                for piece in stream:
                    pieces.append(piece)
                    yield piece
        finally:  # a response stopped by Ctrl-C is part of the conversation as far as it went
            self.turns.append((message, "".join(pieces).strip()))


def run_chat(
    chat: Chat,
    *,
    interactive: bool,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
    jsonl: bool = False,
) -> None:
    """Read messages, one a line, and write the responses as they come.

    ``interactive``: a person at a terminal: a banner, a ``you>`` prompt with line editing, a
    note after ``/reset``. Otherwise (stdin from a script or a pipe) only the responses are
    written, each on its own line(s), ended by a newline. ``jsonl``: for a script, each line in
    is a JSON string or a message object (``{"role": "user", "content": ...}``), so a message
    may hold newlines, and each response goes out whole as one JSON line
    (``{"role": "assistant", "content": ...}``), so a reader knows where it ends; the commands
    are objects there (``{"command": "reset"}``, ``{"command": "exit"}``), so that every text is
    a message (`_run_jsonl`).
    """
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    if jsonl:
        return _run_jsonl(chat, stdin, stdout)
    if interactive:
        try:
            import readline  # noqa: F401 - line editing and history for input()
        except ImportError:  # Windows
            pass
        stdout.write(f"chatting with {chat.run_dir}: {COMMANDS}\n")
    while True:
        try:
            line = input("you> ") if interactive else stdin.readline()
        except EOFError:
            break
        except KeyboardInterrupt:
            stdout.write(f"\n({COMMANDS})\n")
            continue
        except UnicodeDecodeError:  # a strict stdin (a UTF-8 locale) refuses the bytes itself
            line = "\udcff"  # refused below as any bytes that are not UTF-8
        if not interactive and not line:  # end of input
            break
        message = line.strip()
        if not message:
            continue
        try:
            message.encode("utf-8")
        except UnicodeEncodeError:  # bytes that are not UTF-8, kept by Python as surrogates
            if not interactive:
                raise GptkilnError(
                    "a message on stdin is not valid UTF-8 text; send the messages in UTF-8"
                ) from None
            stdout.write("(that message is not valid UTF-8 text; type it again)\n")
            continue
        if message == "/exit":
            break
        if message == "/reset":
            chat.reset()
            if interactive:
                stdout.write("(the conversation is forgotten)\n")
            continue
        _respond(chat, message, stdout, interactive)


def _run_jsonl(chat: Chat, stdin: TextIO, stdout: TextIO) -> None:
    """`run_chat` for a script: a line in, a JSON string or object (`_json_line`), each message's
    response out as one JSON line; ``{"command": "reset"}`` forgets the conversation (no line
    out), ``{"command": "exit"}`` ends; a blank line is passed over."""
    number = 0
    while True:
        number += 1
        try:
            line = stdin.readline()
        except UnicodeDecodeError:  # a strict stdin (a UTF-8 locale) refuses the bytes itself
            line = '"\udcff"'  # refused below as any text that is not UTF-8
        if not line:  # end of input
            break
        if not line.strip():
            continue
        message = _json_line(line, number)
        if message == {"command": "exit"}:
            break
        if message == {"command": "reset"}:
            chat.reset()
            continue
        reply = "".join(chat.reply(message))
        stdout.write(json.dumps({"role": "assistant", "content": reply}) + "\n")
        stdout.flush()


def _json_line(line: str, number: int) -> str | dict:
    """A ``--jsonl`` line: a message (a JSON string, or a user message's ``content``), or a
    command (``{"command": "reset"}`` or ``"exit"``); an empty message is refused (every message
    a script sends is one response line it waits for)."""
    try:
        value = json.loads(line)
    except ValueError as e:
        value = e
    if isinstance(value, dict) and value.get("command") in ("reset", "exit") and len(value) == 1:
        return value
    if isinstance(value, dict) and value.get("role", "user") == "user":
        value = value.get("content")
    if not isinstance(value, str):
        raise GptkilnError(
            f"stdin line {number}: not a JSON string or user message ({line.strip()[:60]!r}); "
            'send one a line, e.g. "Hello", {"role": "user", "content": "Hello"} or '
            '{"command": "reset"}'
        )
    if not value.strip():  # skipped, it would leave a script waiting for its response line
        raise GptkilnError(
            f"stdin line {number}: an empty message ({line.strip()[:60]!r}), which gets no "
            "response; send some text (a blank line is passed over)"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # bytes that are not UTF-8, kept by Python as surrogates
        raise GptkilnError(
            f"stdin line {number}: not valid UTF-8 text; send the messages in UTF-8"
        ) from None
    return value.strip()


def _respond(chat: Chat, message: str, stdout: TextIO, interactive: bool) -> None:
    pieces = chat.reply(message)
    if interactive:
        stdout.write("bot> ")
    try:
        for piece in pieces:
            stdout.write(piece)
            stdout.flush()
    except KeyboardInterrupt:
        pieces.close()  # records the turn as far as it went
        stdout.write(" [stopped]")
    stdout.write("\n")
    stdout.flush()
