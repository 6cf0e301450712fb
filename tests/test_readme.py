"""Every command of the README's tour runs as written (the two set-up commands are .ci/run's).

The tour runs in an empty directory on what any clone has. Its one command on the book's own
text, which the project does not ship, is given ``the-verdict.txt`` where this workplace has it
(``../shared/data``), copied into that directory for the run; elsewhere that command alone is
skipped, with a warning that says so.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from conftest import REPO, SHARED_DATA

README = (REPO / "README.md").read_text()
BOOK_TEXT = "the-verdict.txt"


def tour_blocks() -> list[tuple[str, str]]:
    tour = README.split("## A tour", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(bash|python)\n(.*?)```", tour, flags=re.S)


def test_the_set_up_commands_are_what_ci_runs():
    commands = re.findall(r"```bash\n(.*?)\n```", README.split("## A tour")[0], flags=re.S)
    install_and_run, run_tests = commands
    assert "gptkiln train" in install_and_run and "gptkiln generate" in install_and_run
    ci = (REPO / ".ci" / "run").read_text()
    assert run_tests.strip() in ci  # .ci/run runs exactly the README's test command
    # ... and its fast part again in a fresh clone, where no ../shared exists
    assert run_tests.strip() + ' -m "not slow"' in ci.split("git clone", 1)[1]


def test_the_tour_needs_nothing_a_clone_lacks():
    tour = "".join(block for _, block in tour_blocks())
    assert "../shared" not in tour and "shared/data" not in tour
    book_lines = [line for line in tour.splitlines() if BOOK_TEXT in line]
    assert book_lines == [
        f"gptkiln train --config book-verdict --data {BOOK_TEXT} --out runs/verdict --epochs 1"
    ]  # the only command that needs a file the reader brings


@pytest.fixture
def background():
    """Commands the tour starts in the background (a line ending in ` &`), stopped at the end."""
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=30)


def start_server(line: str, cwd: Path, env: dict, procs: list) -> None:
    """Start `gptkiln serve ... --port N` and wait until it answers on that port."""
    import httpx

    args = shlex.split(line)
    port = args[args.index("--port") + 1] if "--port" in args else "8000"
    procs.append(subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.DEVNULL))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert procs[-1].poll() is None, f"{line} exited with {procs[-1].returncode}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise AssertionError(f"{line} did not answer on port {port}")


@pytest.mark.slow
def test_tour_runs_as_written(tmp_path, background):
    work = tmp_path / "work"
    work.mkdir()
    book_text = SHARED_DATA / BOOK_TEXT
    if book_text.is_file():  # the reader's copy of the book's text, for its one command
        shutil.copy(book_text, work / BOOK_TEXT)
    skipped = []
    bindir = Path(sys.executable).parent
    env = {
        **os.environ,
        "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    blocks = tour_blocks()
    assert len(blocks) >= 6
    for lang, block in blocks:
        if lang == "python":
            proc = subprocess.run(
                [sys.executable, "-c", block],
                cwd=work,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert proc.returncode == 0, proc.stderr[-2000:]
            if (
                "ROMEO:" in block
            ):  # the API's block prints a sample; the fine-tuning one writes data
                assert "ROMEO:" in proc.stdout
            continue
        for line in block.strip().splitlines():
            if BOOK_TEXT in shlex.split(line) and not (work / BOOK_TEXT).exists():
                skipped.append(line)
                print(f"skipped  {line}  ({book_text} not present)")
                continue
            if line.endswith(" &"):  # a server, for the blocks after it
                start_server(line[:-2], work, env, background)
                continue
            start = time.perf_counter()
            proc = subprocess.run(
                shlex.split(line), cwd=work, env=env, capture_output=True, text=True, timeout=600
            )
            assert proc.returncode == 0, f"{line}\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"
            print(f"{time.perf_counter() - start:6.1f}s  {line}")
            if line.startswith("gptkiln generate"):
                argv = shlex.split(line)
                prompts = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--prompt"]
            if line.startswith("gptkiln generate") and "--input" in line:
                # an instruction-tuned run's prompt goes into its template; the response alone shows
                assert not proc.stdout.startswith(prompts[0]) and proc.stdout.endswith("\n")
            elif line.startswith("gptkiln generate"):
                first = proc.stdout.splitlines()[0]  # one prompt streams; several: a header
                assert first.startswith(prompts[0] if len(prompts) == 1 else "--- prompt 1 of")
                assert all(p in proc.stdout for p in prompts)
                assert len(proc.stdout) > sum(len(p) + 5 for p in prompts)
            if line.startswith("gptkiln info"):
                assert "resumable" in proc.stdout
            if line.startswith("gptkiln perplexity"):
                assert "perplexity" in proc.stdout
    assert (work / "runs" / "char" / "loss.png").exists()
    assert any((work / "runs" / "char" / "tensorboard").glob("events.out.tfevents.*"))
    assert (work / "exported" / "tiny-gpt2" / "config.json").exists()
    assert (work / "runs" / "instruct-lora" / "adapter.safetensors").exists()
    assert (work / "exported" / "instruct" / "model.safetensors").exists()
    if skipped:
        warnings.warn(
            f"{book_text} not present (the book's text is not shipped): skipped "
            + "; ".join(skipped),
            stacklevel=1,
        )
    else:
        assert (work / "runs" / "verdict" / "model.safetensors").exists()


def test_download_offline_says_how_to_use_a_local_directory(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "gptkiln", "download", "gpt2", "--out", str(tmp_path / "gpt2")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "convert hf" in proc.stderr
