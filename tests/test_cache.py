"""The on-disk cache of what a process learns about its machine (`gptkiln.cache`): where it lives,
that a stale or corrupt file is rebuilt and never an error, that writers at once leave a valid
file, and that the decode tuner's choices carry over to the next process without a timing run."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import gptkiln.kernels as kernels
from gptkiln import cache
from gptkiln.config import GPTConfig
from gptkiln.model import GPT

SRC = str(Path(cache.__file__).resolve().parents[1])
KEY = {"torch": "1.0", "cpu": "a test CPU"}


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    """Every test starts with no choices made in this process (only the disk's, if any)."""
    monkeypatch.setattr(kernels, "_CHOSEN", {})


def test_the_directory_is_gptkiln_cache_else_xdg_else_home(monkeypatch, tmp_path):
    monkeypatch.setenv("GPTKILN_CACHE", str(tmp_path / "moved"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "moved"
    monkeypatch.delenv("GPTKILN_CACHE")
    assert cache.cache_dir() == tmp_path / "xdg" / "gptkiln"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_dir() == tmp_path / "home" / ".cache" / "gptkiln"


def test_gptkiln_cache_moves_the_tuners_file(monkeypatch, tmp_path):
    monkeypatch.setenv("GPTKILN_CACHE", str(tmp_path / "elsewhere"))
    kernels.tune_decoding(tiny_model(), rows=2, repeats=1)
    data = json.loads((tmp_path / "elsewhere" / "decode-kernels.json").read_text())
    assert len(data["entries"]) == 5  # the tiny GPT's five weight shapes
    assert data["machine"] == cache.machine()


def test_machine_names_torch_the_cpu_and_its_flags():
    found = cache.machine()
    assert found["torch"] == torch.__version__
    assert found["cpu"] and len(found["cpu_flags"]) == 16
    assert found["isa"] == torch.backends.cpu.get_cpu_capability()


def test_entries_round_trip_and_merge(tmp_path, monkeypatch):
    monkeypatch.setenv("GPTKILN_CACHE", str(tmp_path))
    store = cache.JsonCache("t", KEY)
    assert store.get("a") is None  # no file yet
    store.put("a", "linear")
    store.put("b", "onednn")
    assert cache.JsonCache("t", KEY).entries() == {"a": "linear", "b": "onednn"}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".t.json")] == []  # no temps


@pytest.mark.parametrize(
    "text",
    ["{not json", "", "\xff\xfe", "[1, 2]", '{"format": 1, "machine": {}, "entries": []}'],
)
def test_a_corrupt_file_reads_as_empty_and_is_rewritten(text, tmp_path, monkeypatch):
    monkeypatch.setenv("GPTKILN_CACHE", str(tmp_path))
    (tmp_path / "t.json").write_text(text, encoding="latin-1")
    store = cache.JsonCache("t", KEY)
    assert store.entries() == {}
    store.put("a", "linear")
    assert json.loads((tmp_path / "t.json").read_text())["entries"] == {"a": "linear"}


def test_another_machines_file_is_stale_and_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("GPTKILN_CACHE", str(tmp_path))
    cache.JsonCache("t", {**KEY, "torch": "0.9"}).put("a", "weight_rows")
    store = cache.JsonCache("t", KEY)
    assert store.get("a") is None  # another torch's choice is not this one's
    store.put("b", "linear")
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["machine"] == KEY and data["entries"] == {"b": "linear"}


def test_a_cache_that_cannot_be_written_is_no_error(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("GPTKILN_CACHE", str(blocker / "cache"))  # a directory under a file
    store = cache.JsonCache("t", KEY)
    store.put("a", "linear")
    assert store.get("a") is None


def test_writers_at_once_leave_a_valid_file_with_every_entry(tmp_path):
    """Four processes put 25 entries each at the same time: the file parses after every
    rename (a reader never sees half a file), and no writer dropped another's entries."""
    writer = textwrap.dedent(
        """
        import sys
        sys.path.insert(0, sys.argv[1])
        from gptkiln.cache import JsonCache
        store = JsonCache("t", {"torch": "1.0", "cpu": "a test CPU"})
        for i in range(25):
            store.put(f"{sys.argv[2]}-{i}", i)
        """
    )
    env = {**os.environ, "GPTKILN_CACHE": str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", writer, SRC, str(w)], env=env) for w in range(4)
    ]
    seen = 0
    while any(p.poll() is None for p in procs):  # read while they write
        path = tmp_path / "t.json"
        if path.exists():
            json.loads(path.read_text())  # raises on a half-written file
            seen += 1
    assert all(p.wait() == 0 for p in procs)
    entries = json.loads((tmp_path / "t.json").read_text())["entries"]
    assert entries == {f"{w}-{i}": i for w in range(4) for i in range(25)}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".t.json")] == []


def tiny_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.from_name("tiny", vocab_size=61, context_length=32)).eval()


def test_a_second_process_takes_the_tuners_choices_without_timing(tmp_path):
    """The first process times the candidates and writes its choices; the second, with
    `_fastest` made to fail, gets the same choices from the disk."""
    script = textwrap.dedent(
        """
        import json, sys
        sys.path.insert(0, sys.argv[1])
        import torch
        import gptkiln.kernels as kernels
        from gptkiln.config import GPTConfig
        from gptkiln.model import GPT
        if sys.argv[2] == "forbid":
            def timed(*args):
                raise AssertionError("a timing run")
            kernels._fastest = timed
        torch.manual_seed(0)
        model = GPT(GPTConfig.from_name("tiny", vocab_size=61, context_length=32)).eval()
        picked = kernels.tune_decoding(model, rows=2, repeats=1)
        print(json.dumps(sorted((list(k), v) for k, v in picked.items())))
        """
    )
    env = {**os.environ, "GPTKILN_CACHE": str(tmp_path)}

    def run(mode: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-c", script, SRC, mode]
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)

    assert "a timing run" in run("forbid").stderr  # an empty cache: it must time
    first = run("time")
    assert first.returncode == 0, first.stderr
    second = run("forbid")
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout) == json.loads(first.stdout)


def test_a_cached_choice_that_no_longer_equals_the_reference_is_timed_again(monkeypatch):
    model = tiny_model()
    found = {"linear": F.linear, "mine": F.linear}
    monkeypatch.setattr(kernels, "candidates", lambda: found)
    monkeypatch.setattr(kernels, "_fastest", lambda *a: "mine")
    kernels.tune_decoding(model, rows=2)  # "mine" for every shape, on disk
    monkeypatch.setattr(kernels, "_CHOSEN", {})
    found["mine"] = lambda x, w, b: F.linear(x, w, b) + 1  # the same name, now wrong
    timed = []
    monkeypatch.setattr(kernels, "_fastest", lambda *a: timed.append(1) or "linear")
    assert set(kernels.tune_decoding(model, rows=2).values()) == {"linear"}
    assert len(timed) == 5  # every shape timed again, and the disk now says "linear"
    monkeypatch.setattr(kernels, "_CHOSEN", {})
    monkeypatch.setattr(kernels, "_fastest", lambda *a: pytest.fail("timed"))
    assert set(kernels.tune_decoding(model, rows=2).values()) == {"linear"}


def test_new_candidates_or_another_thread_count_are_timed_again(monkeypatch):
    model = tiny_model()
    monkeypatch.setattr(kernels, "candidates", lambda: {"linear": F.linear})
    kernels.tune_decoding(model, rows=2, repeats=1)
    monkeypatch.setattr(kernels, "_CHOSEN", {})
    timed = []
    monkeypatch.setattr(kernels, "_fastest", lambda *a: timed.append(1) or "linear")
    monkeypatch.setattr(kernels, "candidates", lambda: {"linear": F.linear, "new": F.linear})
    kernels.tune_decoding(model, rows=2)
    assert len(timed) == 5  # a kernel that was not there when the choice was made
    monkeypatch.setattr(kernels, "_CHOSEN", {})
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        kernels.tune_decoding(model, rows=2)
    finally:
        torch.set_num_threads(threads)
    assert len(timed) == 10


def test_tuning_points_inductors_cache_into_ours_unless_set(monkeypatch, tmp_path):
    monkeypatch.setenv("GPTKILN_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")  # so that the next line is undone
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    kernels.tune_decoding(tiny_model(), rows=1, repeats=1)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "users"))
    cache.use_for_inductor()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "users")


def test_gpt2_ranks_come_from_the_cache_while_the_files_are_the_same(monkeypatch, tmp_path):
    import gptkiln.tokenizers.gpt2 as tokenizers

    monkeypatch.setenv("GPTKILN_CACHE", str(tmp_path))
    first = tokenizers.gpt2_mergeable_ranks()  # read from the files, checked, and stored
    assert first == tokenizers._gpt2_ranks_from(*tokenizers._gpt2_files())
    read = tokenizers._gpt2_ranks_from
    monkeypatch.setattr(tokenizers, "_gpt2_ranks_from", lambda *a: pytest.fail("read again"))
    assert tokenizers.gpt2_mergeable_ranks() == first
    (tmp_path / "gpt2-ranks.json").write_text('{"format": 1, "machine"')  # cut short
    monkeypatch.setattr(tokenizers, "_gpt2_ranks_from", read)
    assert tokenizers.gpt2_mergeable_ranks() == first  # read from the files, and rewritten
    assert len(json.loads((tmp_path / "gpt2-ranks.json").read_text())["entries"]["tokens"]) == 50256
