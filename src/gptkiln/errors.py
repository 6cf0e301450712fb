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


LOW_SPACE_BYTES = 1 << 20
"""Below this much free space, a write that failed without saying why failed for want of it."""


def out_of_space(error: BaseException, directory=None) -> bool:
    """Whether ``error`` is a write that failed for want of space: its errno says so (no space,
    over quota) or its text does (safetensors' Rust "os error 28"); for a writer that keeps no
    errno (``torch.save``'s stream writer, NumPy's ``tofile``), when ``directory``'s device has
    less than `LOW_SPACE_BYTES` left. An error with another errno (a permission, a read-only
    disk, a file over the size limit) is not."""
    import errno
    import shutil

    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(error)
    if "No space left on device" in text or "os error 28" in text:
        return True
    if directory is None or not isinstance(error, (OSError, RuntimeError)):
        return False
    if isinstance(error, OSError) and error.errno is not None:
        return False
    try:
        return shutil.disk_usage(directory).free < LOW_SPACE_BYTES
    except OSError:
        return False
