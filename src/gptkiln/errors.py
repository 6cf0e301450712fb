"""The one exception type for mistakes a user can fix."""


class GptkilnError(Exception):
    """Bad input from a person: a file, a flag or a value, with the fix in the message.

    The CLI prints ``str(error)`` on one line and exits with code 2; library callers can catch it.
    Messages name what was wrong, where, and how to fix it, e.g.
    ``"data/x.jsonl line 3: not valid JSON (Expecting ',' ...); fix or remove that line"``.
    """
