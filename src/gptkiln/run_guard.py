"""A run directory's keeping: which files are a run's, the checks before a command writes into
a folder (`check_out_dir`, `check_run_dir_for_training`, `check_not_a_run_file`,
`check_writable`), what a fresh run sets aside while it replaces a run and brings back if it
fails (`set_aside_replaced`, `restore_replaced`, and the same for prepared data), the
temporaries a killed save leaves (`drop_temporaries`), and `RunLock`, which lets one trainer at a
time write a run. Writing and reading a checkpoint's files is `gptkiln.checkpoint`'s.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from gptkiln.checkpoint import (
    ADAPTER_FILE,
    PREVIOUS_STATE_FILE,
    TENSORBOARD_DIR,
    TRAINER_STATE_FILE,
    first_save_cut_short,
    has_checkpoint,
    has_whole_checkpoint,
)
from gptkiln.errors import GptkilnError
from gptkiln.loading import CONFIG_FILE, WEIGHTS_FILE
from gptkiln.loading.files import REPLACED_DIR
from gptkiln.tokenizers import TOKENIZER_FILES


def check_out_dir(out_dir: str | os.PathLike, *, overwrite: bool) -> list[Path]:
    """Check ``out_dir`` before a converted or downloaded model is written there: refuse a file,
    a directory that already holds a model unless ``overwrite``, and a folder no file can be
    made in (read-only, ``/proc``): the folder itself where it exists (its files are written
    inside it first, `gptkiln.export.files.staged`), else the nearest one it would be made in.

    Returns the files of an old training run there (its trainer state, metrics, plot and
    TensorBoard events), for
    the caller to delete once the new model is written, so the directory never mixes two.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise GptkilnError(f"--out {out_dir} is a file; give the path of a directory to write")
    there = _nearest_folder(out_dir.absolute().parent, "--out", out_dir)
    if not has_checkpoint(out_dir):
        _check_can_write_in(out_dir if out_dir.is_dir() else there, "--out", out_dir)
        return []
    if not overwrite:
        raise GptkilnError(
            f"--out {out_dir} already holds a model; pass --overwrite to replace it, "
            "or choose another --out"
        )
    _check_can_write_in(out_dir, "--out", out_dir)
    names = (TRAINER_STATE_FILE, PREVIOUS_STATE_FILE, ADAPTER_FILE, "metrics.csv", "loss.png")
    files = [out_dir / name for name in names if (out_dir / name).exists()]
    return files + tensorboard_events(out_dir)


SETTING_ASIDE_DIR = ".replacing"
"""Where the files of a run being set aside gather before the folder becomes ``.replaced``."""
RESTORING_DIR = ".restoring"
"""Where the replaced run's files wait while they go back (`restore_replaced`)."""
REPLACED_DATA_DIR = ".replaced-data"
"""Where a new run that prepares other text into ``RUN/data`` keeps the data there before it,
until its first checkpoint (the data is prepared before the run's files are set aside)."""


def run_files(run_dir: str | os.PathLike) -> list[Path]:
    """What a run of gptkiln writes in its directory, that is there: weights, config, trainer
    state, adapters, tokenizer and chat template, metrics, plot, TensorBoard events, harness
    results and judgements. Not its prepared data (``data/``), which a new run may read."""
    run_dir = Path(run_dir)
    names = (WEIGHTS_FILE, CONFIG_FILE, TRAINER_STATE_FILE, PREVIOUS_STATE_FILE, ADAPTER_FILE,
             "metrics.csv", "loss.png", "judgements.json", "eval", TENSORBOARD_DIR,
             *TOKENIZER_FILES)  # fmt: skip
    named = [run_dir / name for name in dict.fromkeys(names) if (run_dir / name).exists()]
    return named + sorted(run_dir.glob("judgements-*.json"))  # `judge --name NAME`


def _written_by_prepare(path: Path) -> bool:
    """Whether ``path``, in a folder holding a ``meta.json``, is one `gptkiln prepare` writes
    there (the meta, the tokens, the tokenizer's files) in a folder whose meta is gptkiln's."""
    from gptkiln.data.prepare import FILES, read_meta
    from gptkiln.tokenizers.base import TOKENIZER_FILES

    meta = read_meta(path.parent)
    if meta is None or "tokenizer" not in meta:  # another tool's meta.json
        return False
    # its splits and meta, a mixture's token files, the tokenizer's files (an HF one's all)
    return path.name in (*FILES, *TOKENIZER_FILES) or path.suffix in (".bin", ".npy")


def check_not_a_run_file(path: str | os.PathLike, flag: str) -> None:
    """One line when writing ``path`` would replace a file of the run in its folder (weights,
    config, trainer state, tokenizer, metrics, plot, ...), or of prepared data (its
    ``meta.json``, ``train.bin``, ...): an output named after one by slip."""
    from gptkiln.data.prepare import is_prepared

    path = Path(path)
    if path.is_file() and is_prepared(path.parent) and _written_by_prepare(path):
        raise GptkilnError(
            f"{flag} {path}: a file of the prepared data in {path.parent}, which writing there "
            "would replace; give another path"
        )
    if not (path.exists() and (path.parent / CONFIG_FILE).is_file()):
        return
    if any(path.resolve() == f.resolve() for f in run_files(path.parent)):
        raise GptkilnError(
            f"{flag} {path}: a file of the run in {path.parent}, which writing there would "
            "replace; give another path"
        )


def check_writable(path: str | os.PathLike, flag: str) -> None:
    """One line, before any work, where ``path`` could not be written: a file on its way, or a
    folder (its own, or the nearest one there of those it would be made in) where no file can
    be made (read-only, a full disk, ``/proc``). Nothing is left behind: no folder is made."""
    _check_can_write_in(_nearest_folder(Path(path).absolute().parent, flag, path), flag, path)


def check_folder_writable(folder: str | os.PathLike, flag: str) -> None:
    """One line, before any work, where no file can be made in ``folder``: itself where it
    exists, else the nearest one there of those it would be made in (a file on the way, a
    read-only folder, ``/proc``)."""
    _check_can_write_in(_nearest_folder(Path(folder).absolute(), flag, folder), flag, folder)


def _check_can_write_in(there: Path, flag: str, path: str | os.PathLike) -> None:
    """One line where no file can be made in the folder ``there`` (for ``flag`` ``path``)."""
    try:
        with tempfile.NamedTemporaryFile(dir=there, prefix=".gptkiln-probe-"):
            pass
    except OSError as e:
        raise GptkilnError(
            f"{flag} {path}: cannot write in {there} ({e.strerror or e}); give another path"
        ) from None


def _nearest_folder(folder: Path, flag: str, path: str | os.PathLike) -> Path:
    """``folder`` or the nearest of its parents that exists, where ``path`` would be made;
    one line when that is a file."""
    there = next(p for p in (folder, *folder.parents) if p.exists())
    if not there.is_dir():
        raise GptkilnError(f"{flag} {path}: {there} is a file, not a folder; give another path")
    return there


def set_aside_replaced(run_dir: str | os.PathLike) -> None:
    """The start of a new run over an old one (``--overwrite``): the old run's files move into
    ``RUN/.replaced``, so that none of them (a chat template, another tokenizer's, adapters)
    stays beside the new run's and a restart never resumes it, while it is still whole should
    the new run fail before its first checkpoint (`restore_replaced`); `drop_replaced` deletes
    it once the new run has saved one. Where ``.replaced`` is there already (an attempt that
    ended before its first checkpoint), it holds the replaced run, and the files here are that
    attempt's: they go."""
    run_dir = Path(run_dir)
    aside = run_dir / REPLACED_DIR
    finish_setting_aside(run_dir)
    files = run_files(run_dir)
    if aside.exists() and has_whole_checkpoint(run_dir):
        drop_replaced(run_dir)  # stale: the run here saved a checkpoint after it was set aside
    if aside.exists():
        for path in files:
            _remove(path)
        return
    if files:  # moved into a folder of their own first, so that a stop halfway splits nothing
        going = run_dir / SETTING_ASIDE_DIR
        going.mkdir()
        for path in files:
            os.replace(path, going / path.name)
        os.replace(going, aside)


def finish_setting_aside(run_dir: str | os.PathLike) -> None:
    """A set-aside (`set_aside_replaced`) or a restore (`restore_replaced`) that stopped
    halfway: the files it had moved go back beside the others, so the run is whole in its
    directory again. Ranks that do it at once take each file once."""
    for name in (SETTING_ASIDE_DIR, RESTORING_DIR):  # either way, its files back in the run
        going = Path(run_dir) / name
        if not going.is_dir():
            continue
        for path in list(going.iterdir()):
            with contextlib.suppress(FileNotFoundError):  # another rank moved it first
                os.replace(path, Path(run_dir) / path.name)
        with contextlib.suppress(OSError):
            going.rmdir()


def restore_replaced(run_dir: str | os.PathLike) -> bool:
    """A new run that failed before its first checkpoint: its files go and the run it replaced
    comes back in place. Whether there was one to bring back."""
    run_dir = Path(run_dir)
    restored = restore_replaced_data(run_dir)
    aside = run_dir / REPLACED_DIR
    if not aside.is_dir():
        return restored
    for path in run_files(run_dir):
        _remove(path)
    back = run_dir / RESTORING_DIR  # from here a stop halfway is finished by the next start
    os.replace(aside, back)
    finish_setting_aside(run_dir)
    return True


def set_aside_replaced_data(run_dir: Path, prepared: Path) -> None:
    """A new run's text, prepared in ``prepared``, takes the place of ``RUN/data``: the data
    there goes to ``RUN/.replaced-data`` (unless an attempt that stopped before its first
    checkpoint put the replaced run's there already: then the data here is that attempt's)."""
    data, aside = run_dir / "data", run_dir / REPLACED_DATA_DIR
    if aside.exists():
        shutil.rmtree(data)
    else:
        os.replace(data, aside)
    os.replace(prepared, data)


def restore_replaced_data(run_dir: str | os.PathLike) -> bool:
    """The data a failed new run replaced, back in ``RUN/data``; whether there was any."""
    data, aside = Path(run_dir) / "data", Path(run_dir) / REPLACED_DATA_DIR
    if not aside.is_dir():
        return False
    shutil.rmtree(data, ignore_errors=True)
    os.replace(aside, data)
    return True


def drop_replaced(run_dir: str | os.PathLike) -> None:
    """The new run saved its first checkpoint: the run it replaced is deleted (renamed first,
    so that a stop halfway never leaves part of it as ``.replaced``)."""
    for name in (REPLACED_DIR, REPLACED_DATA_DIR):
        aside = Path(run_dir) / name
        if not aside.exists():
            continue
        going = aside.with_name(f"{name}.{os.getpid()}.deleting")
        try:
            os.replace(aside, going)
        except OSError:
            going = aside
        shutil.rmtree(going, ignore_errors=True)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def tensorboard_events(run_dir: str | os.PathLike) -> list[Path]:
    """The TensorBoard event files of a run (``train --tensorboard``), in ``RUN/tensorboard/``."""
    return sorted((Path(run_dir) / TENSORBOARD_DIR).glob("events.out.tfevents.*"))


_TEMPORARY = re.compile(r"\.(?P<name>.+)\.[0-9a-f]{8}\.tmp")  # `_new_temporary`'s names


def drop_temporaries(run_dir: str | os.PathLike) -> list[Path]:
    """Delete the temporary files `atomic_write` left beside a run's checkpoint files when a
    save was killed (a checkpoint's worth of disk each); those removed. Only under the run's
    lock: training is the one writer of these names."""
    from gptkiln.tokenizers import TOKENIZER_FILES

    names = {CONFIG_FILE, WEIGHTS_FILE, TRAINER_STATE_FILE, PREVIOUS_STATE_FILE, ADAPTER_FILE,
             "metrics.csv", "loss.png", "accuracy.png", "chat_template.jinja",
             *TOKENIZER_FILES}  # fmt: skip
    dropped = []
    for path in Path(run_dir).glob(".*.tmp"):
        match = _TEMPORARY.fullmatch(path.name)
        if match and match["name"] in names and path.is_file():
            path.unlink(missing_ok=True)
            dropped.append(path)
    return dropped


def _flock_soon(fd: int, fcntl) -> None:
    """An exclusive ``flock`` on ``fd``, tried for a tenth of a second: `RunLock.held` (gptkiln
    info) holds a shared one for an instant, which must not refuse a run starting then."""
    for _ in range(10):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            time.sleep(0.01)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


class RunLock:
    """A run directory held by one training process at a time: an exclusive ``flock`` on the
    directory itself (no file in it), taken before anything there is read or moved, and let go
    when the run ends (the kernel lets it go when the process dies). A second ``train`` or
    ``finetune`` into the same directory is one line, not two runs writing one metrics.csv.

    A directory the lock made (a new run's) is removed again when the run leaves it empty.
    Where ``fcntl`` is missing (Windows) nothing is locked."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.fd: int | None = None
        self.made: list[Path] = []

    def acquire(self) -> None:
        try:
            import fcntl
        except ImportError:
            return
        if self.run_dir.exists() and not self.run_dir.is_dir():
            return  # a file: the run's checks refuse it in their words
        self.made = [p for p in (self.run_dir, *self.run_dir.parents) if not p.exists()]
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.run_dir, os.O_RDONLY)
        try:
            _flock_soon(fd, fcntl)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return  # a filesystem without flock (some network ones): nothing is locked
            self.release()
            raise GptkilnError(
                f"{self.run_dir} is being written by another training run (a gptkiln train or "
                "finetune still going); wait for it to end, or choose another --out"
            ) from None
        self.fd = fd
        drop_temporaries(self.run_dir)  # a killed save's, which no one else writes now

    @staticmethod
    def held(run_dir: str | os.PathLike) -> bool:
        """Whether a training process holds ``run_dir`` now (its lock taken; False where that
        cannot be asked: no such folder, no ``flock``)."""
        try:
            import fcntl

            fd = os.open(run_dir, os.O_RDONLY)
        except (ImportError, OSError):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # fails while another holds it whole
        except OSError as e:
            return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
        finally:
            os.close(fd)  # (and with it the shared lock just taken)
        return False

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor lets the lock go
            self.fd = None
        for path in self.made:  # deepest first: a new run's folders it left empty
            with contextlib.suppress(OSError):
                path.rmdir()
        self.made = []


def check_run_dir_for_training(
    run_dir: str | os.PathLike, *, resume: bool, overwrite: bool
) -> None:
    """Refuse to train over an existing checkpoint by accident, or to resume from nothing."""
    run_dir = Path(run_dir)
    if resume and overwrite:
        raise GptkilnError("--resume and --overwrite contradict each other; pass one of them")
    if run_dir.exists() and not run_dir.is_dir():
        raise GptkilnError(f"--out {run_dir} is a file; give a folder for the run")
    finish_setting_aside(run_dir)
    has_state = any((run_dir / f).is_file() for f in (TRAINER_STATE_FILE, PREVIOUS_STATE_FILE))
    whole = has_state and has_whole_checkpoint(run_dir)
    aside = run_dir / REPLACED_DIR
    if whole and (aside.is_dir() or (run_dir / REPLACED_DATA_DIR).is_dir()):
        drop_replaced(run_dir)  # stale: the run here saved a checkpoint after it was set aside
    if aside.is_dir() and not overwrite and not whole:
        data = run_dir / REPLACED_DATA_DIR
        data_back = f" (and {data} back as its data/)" if data.is_dir() else ""
        raise GptkilnError(
            f"{aside} holds the run an --overwrite replaced, and the run that replaced it "
            f"stopped before its first checkpoint; move the files in {aside} back into "
            f"{run_dir}{data_back} to keep it (then --resume continues it), or pass --overwrite "
            "to start afresh"
        )
    if resume and not has_state:
        what = (
            "a model but no trainer_state.pt (saved for inference only)"
            if (run_dir / WEIGHTS_FILE).is_file()
            else "no checkpoint"
        )
        raise GptkilnError(
            f"cannot resume {run_dir}: it holds {what}; drop --resume to start a new run"
        )
    if not overwrite and first_save_cut_short(run_dir):
        raise GptkilnError(
            f"{run_dir} holds the start of a first checkpoint that was cut short (a trainer "
            "state without the weights it goes with): there is nothing to resume; pass "
            "--overwrite to start afresh, or choose another --out"
        )
    if not resume and not overwrite and has_checkpoint(run_dir):
        if not has_state:
            raise GptkilnError(
                f"{run_dir} already holds a model (saved without a training state, so it "
                "cannot be resumed); pass --overwrite to train a new one there, or choose "
                "another --out"
            )
        raise GptkilnError(
            f"{run_dir} already holds a checkpoint; pass --resume to continue it, "
            f"--overwrite to start afresh, or choose another --out"
        )
