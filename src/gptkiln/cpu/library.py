"""The backend's C: one shared library built from ``csrc/`` once per machine, loaded with ctypes.

``csrc/gptkiln_cpu.h`` declares every function; ``csrc/generic/`` holds the plain-C version of
every kernel (the reference: it builds with any C compiler, on x86-64 or ARM), ``csrc/x86/``
the AVX-512 versions beside them, and ``csrc/dispatch.c`` the entry points, which call the
AVX-512 version where the CPU runs it and the generic one elsewhere. All of it is compiled into
ONE shared object (`library`): on x86-64 with both, elsewhere (and with
``GPTKILN_CPU_KERNELS=generic``, on any machine) with the generic sources alone. Each entry
point is typed once, at load (`ENTRIES`).

Where: the ``cpu/`` directory of gptkiln's cache (`gptkiln.cache.cache_dir`), named by a digest
of every source, the compiler (its resolved path, size and time), the flags and the build
(``generic`` or ``x86``), so an edited source or a new compiler builds a new one (and the old
is removed). Two processes may build at once: each compiles into its own temporary directory and
renames the library into place (``os.replace``, atomic); a file that does not load is built
again. The directory is made private (0700). A directory or library file not owned by this
user, or writable by others (a cache on shared storage, ``/tmp``), is never loaded: one line
says so and the library is built in a private temporary directory instead, as ssh and Python's
own caches refuse files others could have written.

None (the kernels not offered: torch's own run) where there is no compiler, the build fails,
the platform is not POSIX, or ``GPTKILN_NATIVE=0`` is set. ``CC`` picks the compiler (default:
``cc``, then ``gcc``, then ``clang``). The OpenMP loops run on torch's OpenMP runtime where the
soname matches (gcc's ``libgomp.so.1``, which torch's Linux wheels load first), so the two
share one pool of threads; a compiler without OpenMP (Apple's clang) builds the loops serial.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SOURCES = Path(__file__).resolve().parent / "csrc"
FLAGS = ("-O3", "-fPIC", "-fopenmp")
ENV = "GPTKILN_NATIVE"
"""``GPTKILN_NATIVE=0`` turns the compiled kernels off (torch's own are used)."""
BUILD_ENV = "GPTKILN_CPU_KERNELS"
"""``GPTKILN_CPU_KERNELS=generic`` builds and loads the plain-C library on any machine."""

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
ENTRIES: dict[str, list] = {
    "few_rows_linear": [_P] * 4 + [_I] * 4,
    "int8_rows_linear": [_P] * 5 + [_I] * 4,
    "bf16_rows_linear": [_P] * 4 + [_I] * 4,
    "q8_rows_linear": [_P] * 5 + [_I] * 4,
    "gelu_tanh": [_P] * 2 + [_L] * 3 + [_I],
    "decode_attention": [_P] * 5 + [_L] * 11 + [_F, _I],
    "target_log_probs": [_P] * 4 + [_L] * 3 + [_I],
    "gpt2_decode_blocks": [_P, ctypes.c_char_p, _I, _P, _P]
    + [_I] * 5
    + [_L] * 2
    + [_P, _F, _P, _P, _I],
    "llama_decode_blocks": [_P, ctypes.c_char_p, _I, _P, _P]
    + [_I] * 6
    + [_L] * 2
    + [_P, _P, _P, _F, _P, _I],
    "gk_avx512": [],
    "gk_q8_vnni": [],
}
"""Every entry point of ``csrc/gptkiln_cpu.h``: name -> its argument types (each returns int)."""


def build() -> str:
    """Which build `library` loads: ``generic`` (``GPTKILN_CPU_KERNELS=generic``, or a CPU that
    is not x86-64) or ``x86`` (the generic sources and the AVX-512 ones beside them)."""
    if os.environ.get(BUILD_ENV, "").lower() == "generic":
        return "generic"
    return "x86" if platform.machine().lower() in ("x86_64", "amd64") else "generic"


def library() -> ctypes.CDLL | None:
    """The library of this process's build (`build`) loaded and typed, or None where it cannot
    be (see the module's docstring). Built at most once per process and build (a build begun by
    `build_soon` is waited for)."""
    if os.environ.get(ENV) == "0" or os.name != "posix":
        return None
    kind = build()
    if _load.cache_info().currsize and kind in _LOADED:  # loaded: no lock to take
        return _load(kind)
    with _BUILDING:
        lib = _load(kind)
        _LOADED.add(kind)
        return lib


_BUILDING = threading.Lock()
_LOADED: set[str] = set()


def build_soon() -> None:
    """Begin loading the library (building it where the cache has none: 2-3 s of the compiler's
    time on two cores) in a thread of its own, so that the compiler works while the process
    imports torch and loads its model; `library` then waits for it. For the commands that
    decode (`generate`, `chat`, `serve`), before anything else: a first use on a machine then
    waits for the compiler only for what is left of it when its first decode step comes."""
    if os.environ.get(ENV) == "0" or os.name != "posix" or build() in _LOADED:
        return
    # not a daemon: a process that ends first waits for the build (no half-built files left)
    threading.Thread(target=library, name="gptkiln-cpu-build").start()


@functools.cache
def _load(kind: str) -> ctypes.CDLL | None:
    lib = load_built(kind)
    if lib is None:
        return None
    for name, argtypes in ENTRIES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    return lib


def sources(kind: str) -> list[Path]:
    """The C files of a build: the dispatcher, every generic kernel, and for ``x86`` the
    AVX-512 ones."""
    files = [SOURCES / "dispatch.c", *sorted((SOURCES / "generic").glob("*.c"))]
    if kind == "x86":
        files += sorted((SOURCES / "x86").glob("*.c"))
    return files


def compiler() -> str | None:
    """The C compiler: ``$CC``, else the first of cc, gcc, clang on the PATH; None: none."""
    named = os.environ.get("CC")
    if named:
        return shutil.which(named)
    return next((path for c in ("cc", "gcc", "clang") if (path := shutil.which(c))), None)


def built_dir() -> Path:
    """Where built libraries are kept: ``cpu/`` in gptkiln's cache directory."""
    from gptkiln.cache import cache_dir

    return cache_dir() / "cpu"


def load_built(kind: str) -> ctypes.CDLL | None:
    """The ``kind`` build of ``csrc/`` as a loaded shared library, built first where no loadable
    build of these sources with this compiler is in `install_dir` (or, where there is none, the
    cache); None where it cannot be built."""
    cc = compiler()
    name = cc and library_name(kind, cc)
    if name is None:
        return None
    where = install_dir() or private_dir(built_dir())  # once per install where it may be
    path = where / name
    if path.exists() and trusted(path, file=True):
        try:
            return ctypes.CDLL(str(path))
        except OSError:  # truncated, or not a library: build it again
            pass
    if not build_into(where, kind, cc):
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError:
        return None


def library_name(kind: str, cc: str) -> str | None:
    """The file name of the ``kind`` build of these sources by the compiler ``cc``: a digest
    of every source and header, the compiler as a file (its resolved path, size and time: a
    new one is another build, found without running it), the flags and the build. None where
    the compiler is not a file."""
    try:
        real = os.path.realpath(cc)
        info = os.stat(real)
    except OSError:
        return None
    files = [*sources(kind), *sorted(SOURCES.rglob("*.h"))]
    compiled_by = f"{real} {info.st_size} {info.st_mtime_ns} {' '.join(FLAGS)} {kind}"
    digest = hashlib.sha256(
        b"".join(f.read_bytes() for f in files) + compiled_by.encode()
    ).hexdigest()[:16]
    return f"gptkiln-cpu-{kind}-{digest}.so"


def build_into(where: Path, kind: str | None = None, cc: str | None = None) -> Path | None:
    """Build the ``kind`` library (None: this machine's, `build`) with ``cc`` (None:
    `compiler`) into the directory ``where`` and remove the builds of earlier sources there;
    the library's path, or None where it cannot be built. `load_built` calls it at first use;
    ``setup.py`` at install, into the package's ``_built/`` (`INSTALL_DIR`), so that a first
    ``generate`` after ``pip install`` waits for no compiler."""
    kind, cc = kind or build(), cc or compiler()
    name = cc and library_name(kind, cc)
    if name is None:
        return None
    path = where / name
    if not _build(cc, kind, sources(kind), path):
        return None
    for old in where.glob(f"gptkiln-cpu-{kind}-*.so"):  # builds of earlier sources
        if old != path:
            with contextlib.suppress(OSError):
                old.unlink()
    return path


INSTALL_DIR = SOURCES.parent / "_built"
"""Where the library is built once per install: beside the package's own sources, where this
user may write them and nobody else may (a virtual environment or a checkout of the user's
own). A library there is as trusted as the package's Python files beside it, which run anyway;
elsewhere (a system install), the cache's ``cpu/``."""

INSTALL_ENV = "GPTKILN_CPU_INSTALL_BUILD"
"""``GPTKILN_CPU_INSTALL_BUILD=0``: the library is built and loaded in the cache only (the
tests set it, so that each test's cache is the whole story)."""


def install_dir() -> Path | None:
    """`INSTALL_DIR`, created 0700 where the package's directory is this user's own and nobody
    else may write it (`trusted`); None elsewhere or with ``GPTKILN_CPU_INSTALL_BUILD=0``."""
    if os.environ.get(INSTALL_ENV) == "0" or not trusted(INSTALL_DIR.parent):
        return None
    if not os.access(INSTALL_DIR.parent, os.W_OK):
        return None
    with contextlib.suppress(OSError):
        INSTALL_DIR.mkdir(mode=0o700, exist_ok=True)
    return INSTALL_DIR if trusted(INSTALL_DIR) else None


def trusted(path: Path, file: bool = False) -> bool:
    """Whether ``path`` is this user's own and nobody else may write it: owned by the user (or
    root, for a directory), not writable by the group or others, and for a library a plain file,
    not a link. Anything else could hold a library another user planted."""
    try:
        info = os.lstat(path) if file else os.stat(path)
    except OSError:
        return False
    if file and not stat.S_ISREG(info.st_mode):
        return False
    owners = (os.getuid(),) if file else (os.getuid(), 0)
    return info.st_uid in owners and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def private_dir(where: Path) -> Path:
    """``where``, created private (0700) where it is not there; where it is there but not
    `trusted`, one line on stderr and a private temporary directory of this process instead."""
    with contextlib.suppress(OSError):
        where.parent.mkdir(parents=True, exist_ok=True)
        where.mkdir(mode=0o700, exist_ok=True)
    if trusted(where):
        return where
    print(
        f"gptkiln: not loading compiled kernels from {where}: it is not yours alone "
        "(another owner, or writable by others); building them privately for this process",
        file=sys.stderr,
    )
    return _private_temp()


@functools.cache
def _private_temp() -> Path:
    """A private (0700) temporary directory for this process's build, removed as it exits (a
    library it has loaded stays mapped after its file is gone)."""
    path = Path(tempfile.mkdtemp(prefix="gptkiln-cpu-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _build(cc: str, kind: str, files: list[Path], path: Path) -> bool:
    """Compile ``files`` into the shared library ``path``: each source to an object file at once
    (the cores the machine has), linked into a temporary file renamed into place. With OpenMP,
    and where the compiler has none, without it. False on any failure (the compiler's messages
    are dropped: the kernels are an option, not a need)."""
    for flags in (FLAGS, tuple(f for f in FLAGS if f != "-fopenmp")):
        try:
            with tempfile.TemporaryDirectory(prefix=path.stem + ".", dir=path.parent) as tmp:
                defines = ["-DGK_X86"] if kind == "x86" else []
                objects = [Path(tmp) / f"{i}.o" for i in range(len(files))]

                def compile_one(pair, flags=flags, defines=defines):
                    source, obj = pair
                    args = [cc, *flags, *defines, "-c", "-o", str(obj), str(source)]
                    return subprocess.run(args, capture_output=True, timeout=120).returncode

                with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
                    codes = list(pool.map(compile_one, zip(files, objects)))
                if any(codes):
                    continue
                out = Path(tmp) / "lib.so"
                link = [cc, *flags, "-shared", "-o", str(out), *map(str, objects), "-lm"]
                if subprocess.run(link, capture_output=True, timeout=120).returncode != 0:
                    continue
                os.chmod(out, 0o700)  # whatever the umask: a library only its user may write
                os.replace(out, path)
                return True
        except (OSError, subprocess.SubprocessError):
            return False
    return False
