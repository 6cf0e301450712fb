"""Every command of the README's tour runs as written (the two set-up commands are .ci/run's)."""

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, SHARED_DATA

README = (REPO / "README.md").read_text()


def tour_blocks() -> list[tuple[str, str]]:
    tour = README.split("## A tour", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(bash|python)\n(.*?)```", tour, flags=re.S)


def test_the_set_up_commands_are_what_ci_runs():
    commands = re.findall(r"```bash\n(.*?)\n```", README.split("## A tour")[0], flags=re.S)
    install_and_run, run_tests = commands
    assert "gptkiln train" in install_and_run and "gptkiln generate" in install_and_run
    ci = (REPO / ".ci" / "run").read_text()
    assert run_tests.strip() in ci  # .ci/run runs exactly the README's test command


@pytest.mark.slow
def test_tour_runs_as_written(tmp_path):
    if not SHARED_DATA.exists():
        pytest.skip("../shared/data not present")
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "shared").symlink_to(SHARED_DATA.parent)  # so ../shared/data resolves
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
            assert "ROMEO:" in proc.stdout
            continue
        for line in block.strip().splitlines():
            start = time.perf_counter()
            proc = subprocess.run(
                shlex.split(line), cwd=work, env=env, capture_output=True, text=True, timeout=600
            )
            assert proc.returncode == 0, f"{line}\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"
            print(f"{time.perf_counter() - start:6.1f}s  {line}")
            if line.startswith("gptkiln generate"):
                prompt = shlex.split(line)[shlex.split(line).index("--prompt") + 1]
                assert proc.stdout.startswith(prompt) and len(proc.stdout) > len(prompt) + 5
            if line.startswith("gptkiln eval"):
                assert "perplexity" in proc.stdout
    assert (work / "runs" / "char" / "loss.png").exists()
    assert (work / "exported" / "tiny-gpt2" / "config.json").exists()


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
