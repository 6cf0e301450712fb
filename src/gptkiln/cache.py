"""What a process learns about its machine, kept on disk for the next one: the decode tuner's
kernel choices (`gptkiln.cpu.tuner`) and inductor's compiled int8 kernels.

Timing every candidate kernel over a 124M model's weights takes seconds (3.9 s in fp32 on a
2-core Xeon, more for int8, which compiles its fused kernel), and the answer is the same for every
process on the machine. So the first process writes it down, and later ones read it.

Where: ``$GPTKILN_CACHE`` when set, else ``$XDG_CACHE_HOME/gptkiln``, else
``~/.cache/gptkiln``. In it:

- ``decode-kernels.json``: the tuner's choices (`JsonCache`): ``{"format", "machine": {...},
  "entries": {key: kernel name}}``. ``machine`` holds what makes a choice this machine's: the
  torch and gptkiln versions, the CPU model, a digest of its flags and the instruction set
  torch's kernels use (`machine`); an entry's key holds the layer's weight dtype and shape, the
  number of rows, the thread count and the names of the candidates that were timed. A file of
  another machine (the same home directory on another host, a new torch) is stale: ignored and
  rewritten. A file that does not parse is ignored and rewritten too: the cache can make a
  process faster, never stop it.
- ``inductor/``: inductor's own on-disk caches (``TORCHINDUCTOR_CACHE_DIR``, unless the user
  set it), which hold the int8 kernels `gptkiln.cpu.products.fused_int8` compiles
  (`use_for_inductor`).

Two processes may write at once (two ``generate`` commands started together, ``serve`` beside a
``generate``): each writes a temporary file in the same directory and renames it over the old one
(``os.replace``, atomic on POSIX and Windows), so a reader sees the old file or the new one,
never half of one; an exclusive lock (``fcntl.flock``, where there is one) around reading,
merging and writing keeps one writer from dropping the other's entries.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ENV = "GPTKILN_CACHE"
"""The environment variable that moves the cache directory."""

FORMAT = 1
"""The layout of a cache file; another value is stale."""


def cache_dir() -> Path:
    """The cache directory (not created): ``$GPTKILN_CACHE``, else ``$XDG_CACHE_HOME/gptkiln``,
    else ``~/.cache/gptkiln`` (the XDG default)."""
    moved = os.environ.get(ENV)
    if moved:
        return Path(moved).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "gptkiln"


def machine() -> dict[str, str]:
    """What makes a measurement this machine's: torch's and gptkiln's versions, the CPU model,
    a digest of the CPU's flags and the instruction set torch's CPU kernels use
    (``torch.backends.cpu.get_cpu_capability``: "AVX512", "AVX2", ...)."""
    import torch

    from gptkiln.version import __version__

    model, flags = _cpu_model_and_flags()
    return {
        "torch": torch.__version__,
        "gptkiln": __version__,
        "cpu": model,
        "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "isa": torch.backends.cpu.get_cpu_capability(),
    }


def _cpu_model_and_flags() -> tuple[str, str]:
    """("Intel(R) Xeon(R) ...", "fpu vme ... amx_tile ...") from /proc/cpuinfo (Linux); where
    there is none, what `platform` says of the processor and no flags."""
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name == "model name" and not model:
                    model = value.strip()
                elif name in ("flags", "Features") and not flags:  # x86, arm64
                    flags = " ".join(sorted(value.split()))
                if model and flags:
                    break
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


class JsonCache:
    """One JSON file of entries (str -> JSON value) that hold on one machine (`machine`).

    Reading never raises: a missing, unreadable, corrupt or stale file reads as empty. Writing
    never raises either (a read-only home directory costs the next process the time, nothing
    else); `put` merges into what is on disk at that moment, under a lock, and renames a whole
    new file into place.
    """

    def __init__(self, name: str, key: dict[str, str] | None = None):
        """``name``: the file's name in `cache_dir` without ``.json``; ``key``: what the file's
        entries hold for (default: this `machine`)."""
        self.path = cache_dir() / f"{name}.json"
        self.key = machine() if key is None else key

    def entries(self) -> dict[str, Any]:
        """The file's entries when it is this key's, else {}."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # missing, unreadable, not JSON (UnicodeDecodeError too)
            return {}
        if (
            not isinstance(data, dict)
            or data.get("format") != FORMAT
            or data.get("machine") != self.key
            or not isinstance(data.get("entries"), dict)
        ):
            return {}
        return data["entries"]

    def get(self, entry: str) -> Any:
        """The value stored for ``entry``, or None."""
        return self.entries().get(entry)

    def put(self, entry: str, value: Any) -> None:
        """Store ``value`` for ``entry`` beside the file's other entries (a stale or corrupt file
        is replaced by one holding this entry alone)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._locked():
                entries = {**self.entries(), entry: value}
                data = {"format": FORMAT, "machine": self.key, "entries": entries}
                self._replace(json.dumps(data, indent=1, sort_keys=True))
        except OSError:
            pass

    def _replace(self, text: str) -> None:
        """Write ``text`` to a temporary file beside the cache file and rename it over it."""
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """An exclusive lock on ``<file>.lock`` while held (none where ``fcntl`` is missing:
        then two writers at once may drop one entry, which is timed again later)."""
        try:
            import fcntl
        except ImportError:  # Windows
            yield
            return
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def decode_kernel_choices() -> JsonCache:
    """The tuner's choices on this machine (``decode-kernels.json``)."""
    return JsonCache("decode-kernels")


def use_for_inductor() -> None:
    """Point inductor's on-disk caches (its FX graph cache, generated code and built libraries)
    into ``<cache dir>/inductor`` for this process, unless ``TORCHINDUCTOR_CACHE_DIR`` is set
    already. Its default is ``/tmp/torchinductor_<user>``, which many systems empty at boot.
    Call before inductor first compiles (it reads the variable each time it looks)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
