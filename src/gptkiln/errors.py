"""The one exception type for mistakes a user can fix."""


class GptkilnError(Exception):
    """Bad input from a person: a file, a flag or a value, with the fix in the message.

    The CLI prints ``str(error)`` on one line and exits with ``exit_code`` (2); library callers
    can catch it.
    Messages name what was wrong, where, and how to fix it, e.g.
    ``"data/x.jsonl line 3: not valid JSON (Expecting ',' ...); fix or remove that line"``.
    """

    exit_code = 2


class RunStopped(GptkilnError):
    """A run that stopped for a reason outside its input (another rank died or hung, torchrun
    ended it): still one line that says where the last checkpoint is, but exit code 1."""

    exit_code = 1
