"""A generated sequence's tokens as text: given out as it becomes final, ended at a stop string
or an end id. `generate`, the CLI, the server and chat all read text through `TextStream`."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import numpy as np


def end_ids(eot_id: int | Sequence[int] | None) -> tuple[int, ...]:
    """The ids that end a sequence, from one end-of-text id, several, or None (none)."""
    if eot_id is None:
        return ()
    if isinstance(eot_id, (int, np.integer)):
        return (int(eot_id),)
    return tuple(int(i) for i in eot_id)


def stop_ids_of(tokenizer) -> tuple[int, ...]:
    """The ids that end a sequence for ``tokenizer``: its `stop_ids` (a gptkiln tokenizer's),
    else its ``eot_id`` alone (any object with ``decode`` and ``eot_id`` serves)."""
    ids = getattr(tokenizer, "stop_ids", None)
    return end_ids(tokenizer.eot_id if ids is None else ids)


def hidden_ids(tokenizer, skip_special_tokens: bool) -> frozenset[int]:
    """The ids a `TextStream` leaves out of the text: with ``skip_special_tokens``, the
    tokenizer's `special_ids` (an object without them: its ``eot_id``)."""
    if not skip_special_tokens:
        return frozenset()
    ids = getattr(tokenizer, "special_ids", None)
    return frozenset(end_ids(tokenizer.eot_id)) if ids is None else frozenset(ids)


def start_at_end(text: str, strings: Collection[str]) -> int:
    """The length of the longest end of ``text`` that begins one of ``strings`` without being
    all of it (0: none): what a stream holds back while a stop string (or a tool call's marker)
    may be starting."""
    return max((k for s in strings for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


class TextStream:
    """The text of one generated sequence, given out piece by piece as it becomes final.

    Token ids go in one at a time (`push`); out comes the new text that can no longer change:
    an incomplete character (a byte-level BPE token can end inside one, which decodes as U+FFFD)
    and a tail that may be the start of a stop string are held back until later tokens settle
    them. The end-of-text id, or a stop string appearing in the text, ends the sequence: the text
    stops right before the stop string, which is never given out, and `done` is set. `flush`
    gives out what is held back once no more tokens come.

    The text is its ids decoded whole. Where ``decode`` is a tokenizer's whose
    ``decodes_in_pieces`` is true (characters, byte-level BPE), only the ids after the last
    whole character are decoded at each token, and the text before them is kept: the same text
    for a token's work that does not grow with the sequence.

    Args:
        decode: ids -> text (the tokenizer's ``decode``).
        stop: stop strings.
        eot_id: the end-of-text id, or several (a tokenizer's `stop_ids`), which end the
            sequence (None: none does).
        hidden: ids left out of the text (a tokenizer's `special_ids`, for
            ``skip_special_tokens``); kept in `ids`. One whose own text holds a stop string
            ends the sequence there, as its text would have.
    """

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        stop: Sequence[str] = (),
        eot_id: int | Sequence[int] | None = None,
        hidden: Collection[int] = (),
    ) -> None:
        self.decode, self.stop, self.eot_id = decode, tuple(stop), eot_id
        self._ends = end_ids(eot_id)
        self._hidden = frozenset(hidden)
        self.ids: list[int] = []  # the sequence's ids, end-of-text excluded
        self.end: int | None = None  # the end id that ended it, if one did
        self._shown: list[int] = []  # those decoded into the text: hidden ids left out
        self.text = ""  # the text given out so far
        self.done = False
        self._taken = 0
        owner = getattr(decode, "__self__", None)  # the tokenizer of a bound ``decode``
        self._in_pieces = bool(getattr(owner, "decodes_in_pieces", False))
        self._settled, self._settled_text = 0, ""  # ids[:settled] decode to settled_text

    @property
    def finish_reason(self) -> str:
        """``"stop"`` after end-of-text or a stop string, else ``"length"`` (OpenAI's names)."""
        return "stop" if self.done else "length"

    def push(self, token: int) -> str:
        """Add one token; return the text it makes final ("" once the sequence is done)."""
        if self.done:
            return ""
        if token in self._ends:
            piece = self.flush()
            self.done, self.end = True, token
            return piece
        self.ids.append(token)
        if token in self._hidden:
            if any(s in self.decode([token]) for s in self.stop):
                piece = self.flush()
                self.done = True
                return piece
            return ""
        self._shown.append(token)
        full = self._decoded()
        shown = len(self.text)
        ends = [i for s in self.stop if (i := full.find(s, max(0, shown - len(s) + 1))) >= 0]
        if ends:
            self.done = True
            return self._give(full[: max(min(ends), shown)])
        final = len(full.rstrip("\ufffd"))  # an incomplete character waits for its other bytes
        final -= start_at_end(full[:final], self.stop)
        return self._give(full[: max(final, shown)])

    def flush(self) -> str:
        """What is held back, once no more tokens come (nothing after the sequence is done)."""
        return "" if self.done else self._give(self._decoded())

    def _decoded(self) -> str:
        """``decode(ids)``; in pieces where the tokenizer allows, the ids up to the last whole
        character kept as their text and only those after it decoded."""
        if not self._in_pieces:
            return self.decode(self._shown)
        tail = self.decode(self._shown[self._settled :])
        full = self._settled_text + tail
        if tail and not tail.endswith("\ufffd"):  # a whole character last: settled up to here
            self._settled, self._settled_text = len(self._shown), full
        return full

    def take(self) -> str:
        """The text given out since the last `take`: for a reader of a stream that another
        function (`generate_stream`) pushes tokens into."""
        piece = self.text[self._taken :]
        self._taken = len(self.text)
        return piece

    def _give(self, text: str) -> str:
        piece = text[len(self.text) :]
        self.text = text
        return piece
